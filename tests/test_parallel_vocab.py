"""Vocabulary-parallel mapped log-probs on 2 gloo processes vs single-process MappedLogProbs."""

import pytest
import torch

from harts_runtime.logprobs import mapped_logprobs
from harts_runtime.parallel.launch import run_distributed
from harts_runtime.parallel.vocab import vocab_parallel_logprobs, vocab_range

C, V, P = 7, 53, 19


def _case(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(C, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    rows = torch.randint(0, C, (P,), generator=g)
    labels = torch.randint(0, V, (P,), generator=g)
    labels[:3] = torch.tensor([0, V - 1, V // 2])       # both shard edges
    upstream = torch.randn(P, generator=g, dtype=torch.float64)
    return logits, rows, labels, upstream


def _vp_worker(rank, world, dtype, chunk):
    import torch.distributed as dist

    logits, rows, labels, upstream = _case(dtype)
    a, b = vocab_range(V, rank, world)
    local = logits[:, a:b].clone().requires_grad_(True)
    lp = vocab_parallel_logprobs(local, (rows, labels), a, dist.group.WORLD, chunk=chunk)
    (lp * upstream.to(lp.dtype)).sum().backward()
    return {"lp": lp.detach(), "grad": local.grad, "range": (a, b)}


@pytest.mark.parametrize("dtype,chunk", [(torch.float64, 8192), (torch.float32, 5)], ids=["f64", "f32-chunk5"])
def test_vocab_parallel_logprobs_match_single_process(dtype, chunk):
    out = run_distributed(_vp_worker, 2, dtype, chunk, timeout=60)
    logits, rows, labels, upstream = _case(dtype)
    ref_logits = logits.clone().requires_grad_(True)
    ref = mapped_logprobs(ref_logits, (rows, labels))
    (ref * upstream.to(ref.dtype)).sum().backward()
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for r in out:
        torch.testing.assert_close(r["lp"], ref.detach(), **tol)
    grad = torch.cat([r["grad"] for r in out], dim=1)
    assert [r["range"] for r in out] == [(0, 27), (27, 53)]
    torch.testing.assert_close(grad, ref_logits.grad, **tol)


def test_vocab_range_covers_vocab():
    for v in (1, 7, 100):
        for w in (1, 2, 3, 8):
            ranges = [vocab_range(v, r, w) for r in range(w)]
            assert ranges[0][0] == 0 and ranges[-1][1] == v
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(w - 1))
