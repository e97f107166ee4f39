"""The vocabulary-parallel LM head (``VocabParallelHead``, paper Section 3.5) on 2 gloo processes.

The fused row-chunked log-probs over a ``Shard(0)`` vocabulary keep every rank's weight at its
``V / tp`` rows (uneven splits included) and reduce only per-row scalars: exactly two collectives
per microbatch forward (``all_reduce(MAX)`` of N row maxima, ``all_reduce(SUM)`` of N + P scalars)
and none in its own backward; the log-probs and the hidden-row gradient equal the single-process
head's. With sequence parallelism the hidden rows enter as this rank's block of the replica's rows.
"""

import numpy as np
import pytest
import torch

from harts_runtime.parallel import ParallelDims, row_block, run_distributed

N, D, V, P = 13, 16, 37, 20  # V = 37: an uneven vocabulary split (19 + 18)
TOL = dict(rtol=1e-5, atol=1e-5)  # float32, on log-probs and gradients of magnitude 1-10


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.3
    row_index = torch.randint(0, N, (P,), generator=g)
    labels = torch.randint(0, V, (P,), generator=g)
    return hidden, weight, row_index, labels


def _reference():
    from harts_runtime.layout.rows import lm_chunks
    from harts_runtime.loss.logprobs import lm_head_logprobs

    hidden, weight, row_index, labels = _inputs()
    hidden.requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    chunks = lm_chunks(row_index.numpy(), N, 4)
    lp = lm_head_logprobs(hidden, w, row_index, labels, chunks, 4)
    (lp * torch.arange(P)).sum().backward()
    return lp.detach(), hidden.grad, w.grad


def _worker(rank, world, sp):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor.parallel import parallelize_module

    from harts_runtime.layout.rows import lm_chunks
    from harts_runtime.parallel import VocabParallelHead

    mesh = ParallelDims(tp=2, world_size=world, sequence_parallel=sp).build_mesh()
    hidden, weight, row_index, labels = _inputs()
    head = nn.Linear(D, V, bias=False)
    head.weight.data.copy_(weight)
    parallelize_module(head, mesh.tp, VocabParallelHead(sp))
    local_w = head.weight.to_local()
    if sp:
        a, b = row_block(N, 2, rank)
        hidden = hidden[a:b]
    hidden = hidden.clone().requires_grad_(True)
    calls = []
    real = dist.all_reduce

    def counting(t, *args, **kwargs):
        calls.append((tuple(t.shape), str(kwargs.get("op", args[0] if args else "SUM"))))
        return real(t, *args, **kwargs)

    dist.all_reduce = counting
    try:
        lp = head.mapped_logprobs(hidden, row_index, labels, lm_chunks(row_index.numpy(), N, 4), 4, N)
        forward_calls = list(calls)
        (lp * torch.arange(P)).sum().backward()
    finally:
        dist.all_reduce = real
    return {
        "lp": lp.detach(),
        "dhidden": hidden.grad,
        "dw_local": head.weight.grad.to_local(),
        "w_rows": tuple(local_w.shape),
        "forward_calls": forward_calls,
        "all_calls": calls,
    }


@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_head_two_collectives_and_exact(sp):
    results = run_distributed(_worker, 2, sp, timeout=120)
    lp, dh, dw = _reference()
    assert [r["w_rows"] for r in results] == [(19, D), (18, D)]
    for rank, r in enumerate(results):
        assert len(r["forward_calls"]) == 2, r["forward_calls"]
        (shape_max, op_max), (shape_sum, _) = r["forward_calls"]
        assert "MAX" in op_max.upper() and shape_max == (N,) and shape_sum == (N + P,)
        assert r["all_calls"] == r["forward_calls"], "the head's own backward needs no collective"
        torch.testing.assert_close(r["lp"], lp, **TOL)
        a, b = row_block(N, 2, rank) if sp else (0, N)
        torch.testing.assert_close(r["dhidden"], dh[a:b], **TOL)
        lo = sum(x["w_rows"][0] for x in results[:rank])
        torch.testing.assert_close(r["dw_local"], dw[lo : lo + r["w_rows"][0]], **TOL)
    np.testing.assert_array_equal(results[0]["lp"].numpy(), results[1]["lp"].numpy())
