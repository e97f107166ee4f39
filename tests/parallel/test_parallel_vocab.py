"""Vocabulary parallelism on 2 gloo processes vs the single-process code.

* ``vocab_parallel_logprobs`` (materialised local logits) vs ``mapped_logprobs`` without a group;
* the model's vocabulary-parallel LM head (fused, row-chunked) vs ``lm_head_logprobs`` without a
  group (the same two functions of ``harts_runtime.loss.logprobs``, one process), and the
  masked-lookup embedding vs ``nn.Embedding``, with and without sequence parallelism, on an uneven
  vocabulary split (53 = 27 + 26); the collectives the head issues are recorded and checked.
"""

import pytest
import torch

from harts_runtime.loss.logprobs import mapped_logprobs
from harts_runtime.parallel.launch import run_distributed
from harts_runtime.parallel.vocab import vocab_parallel_logprobs, vocab_range

C, V, P = 7, 53, 19


def _case(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(C, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    rows = torch.randint(0, C, (P,), generator=g)
    labels = torch.randint(0, V, (P,), generator=g)
    labels[:3] = torch.tensor([0, V - 1, V // 2])  # both shard edges
    upstream = torch.randn(P, generator=g, dtype=torch.float64)
    return logits, rows, labels, upstream


def _vp_worker(rank, world, dtype, chunk):
    import torch.distributed as dist

    logits, rows, labels, upstream = _case(dtype)
    a, b = vocab_range(V, rank, world)
    local = logits[:, a:b].clone().requires_grad_(True)
    with _CollectiveLog() as fwd:
        lp = vocab_parallel_logprobs(local, (rows, labels), a, dist.group.WORLD, chunk=chunk)
    with _CollectiveLog() as bwd:
        (lp * upstream.to(lp.dtype)).sum().backward()
    return {"lp": lp.detach(), "grad": local.grad, "range": (a, b), "fwd": fwd.calls, "bwd": bwd.calls}


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,chunk", [(torch.float64, 8192), (torch.float32, 5)], ids=["f64", "f32-chunk5"]
)
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
    for r in out:  # C row maxima, then C sum-exps + P target logits; nothing in backward
        assert r["fwd"] == [("all_reduce", C), ("all_reduce", C + P)] and r["bwd"] == [], (r["fwd"], r["bwd"])


def test_vocab_range_covers_vocab():
    for v in (1, 7, 100):
        for w in (1, 2, 3, 8):
            ranges = [vocab_range(v, r, w) for r in range(w)]
            assert ranges[0][0] == 0 and ranges[-1][1] == v
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(w - 1))


# ----------------------------------------------------------------- the model's vocab-parallel LM head
N, D, ROWS = 13, 6, 4  # 4 row chunks of the fused head; V = 53 splits unevenly (27 + 26)


def _head_case():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    rows = torch.randint(0, N, (P,), generator=g)
    rows[-1] = N - 1  # a target in the last (short) chunk
    labels = torch.randint(0, V, (P,), generator=g)
    labels[:3] = torch.tensor([0, V - 1, 26])  # both shard edges and the last id of shard 0
    upstream = torch.randn(P, generator=g, dtype=torch.float64)
    ids = torch.cat([torch.tensor([0, V - 1, 26, 27]), torch.randint(0, V, (N - 4,), generator=g)])
    return hidden, weight, rows, labels, upstream, ids


def _embed_upstream():
    return torch.randn(N, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _row_blocks():
    from harts_runtime.parallel.comm import row_split

    sizes = row_split(N, 2)
    return [slice(sum(sizes[:r]), sum(sizes[: r + 1])) for r in range(2)]


class _CollectiveLog:
    """Records (op, numel) of every collective issued through ``torch.distributed`` while active."""

    OPS = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "broadcast",
    )

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self.saved = dist, [], {}

    def __enter__(self):
        for op in self.OPS:
            fn = self.saved[op] = getattr(self.dist, op)

            def wrapped(*args, _fn=fn, _op=op, **kw):
                t = args[0] if _op != "all_gather" else args[1]
                self.calls.append((_op, t.numel()))
                return _fn(*args, **kw)

            setattr(self.dist, op, wrapped)
        return self

    def __exit__(self, *exc):
        for op, fn in self.saved.items():
            setattr(self.dist, op, fn)


def _head_worker(rank, world):
    import torch.distributed as dist
    from torch import nn

    from harts_runtime.parallel.comm import split_rows
    from harts_runtime.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead

    hidden, weight, rows, labels, upstream, ids = _head_case()
    dense_head = nn.Linear(D, V, bias=False, dtype=torch.float64)
    dense_head.weight.data.copy_(weight)
    dense_embed = nn.Embedding(V, D, dtype=torch.float64)
    dense_embed.weight.data.copy_(weight)
    out = {}
    for sp in (False, True):
        head = VocabParallelLMHead.from_dense(dense_head, dist.group.WORLD, rank, world, sp)
        h = (split_rows(hidden, dist.group.WORLD) if sp else hidden).clone().requires_grad_(True)
        with _CollectiveLog() as fwd:
            lp = head.mapped_logprobs(h, rows, labels, None, ROWS)
        with _CollectiveLog() as bwd:
            (lp * upstream).sum().backward()
        embed = VocabParallelEmbedding.from_dense(dense_embed, dist.group.WORLD, rank, world, sp)
        x = embed(ids)
        x_w = _embed_upstream()
        (x * (split_rows(x_w, dist.group.WORLD) if sp else x_w)).sum().backward()
        out[sp] = {
            "lp": lp.detach(),
            "dh": h.grad,
            "dw": head.weight.grad,
            "range": head.weight._harts_vocab_range,
            "fwd": fwd.calls,
            "bwd": bwd.calls,
            "logits": head(hidden),
            "x": x.detach(),
            "dembed": embed.weight.grad,
            "embed_range": embed.weight._harts_vocab_range,
        }
    return out


@pytest.fixture(scope="module")
def head_results():
    return run_distributed(_head_worker, 2, timeout=60)


def _head_reference():
    from harts_runtime.layout import lm_chunks
    from harts_runtime.loss.logprobs import lm_head_logprobs

    hidden, weight, rows, labels, upstream, ids = _head_case()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = lm_head_logprobs(h, w, rows, labels, lm_chunks(rows.numpy(), N, ROWS), ROWS)
    (lp * upstream).sum().backward()
    e = weight.clone().requires_grad_(True)
    x = torch.nn.functional.embedding(ids, e)
    (x * _embed_upstream()).sum().backward()
    return {
        "lp": lp.detach(),
        "dh": h.grad,
        "dw": w.grad,
        "logits": hidden @ weight.t(),
        "x": x.detach(),
        "dembed": e.grad,
    }


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_vocab_parallel_lm_head_matches_fused_single_process_head(head_results, sp):
    ref = _head_reference()
    tol = dict(rtol=1e-10, atol=1e-12)
    for rank, res in enumerate(head_results):
        r = res[sp]
        block = _row_blocks()[rank] if sp else slice(0, N)
        a, b = r["range"]
        assert (a, b) == vocab_range(V, rank, 2) and r["embed_range"] == (a, b)
        torch.testing.assert_close(r["lp"], ref["lp"], **tol)
        torch.testing.assert_close(r["dh"], ref["dh"][block], **tol)
        torch.testing.assert_close(r["dw"], ref["dw"][a:b], **tol)
        torch.testing.assert_close(r["logits"], ref["logits"], **tol)
        torch.testing.assert_close(r["x"], ref["x"][block], **tol)
        torch.testing.assert_close(r["dembed"], ref["dembed"][a:b], **tol)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_vocab_parallel_lm_head_communicates_only_row_scalars(head_results, sp):
    """Forward: the head's own collectives are N row maxima and N sum-exps + P target logits, whatever
    the number of row chunks; no vocabulary-wide tensor crosses ranks in either direction. The rest
    is the region entry on hidden rows (N x D): SP's all-gather (with its size exchange) forward,
    the summed dhidden backward (TP: all-reduce; SP: reduce-scatter, an all-reduce on gloo)."""
    for res in head_results:
        r = res[sp]
        longest = max(b.stop - b.start for b in _row_blocks())
        entry = [("all_gather", 1), ("all_gather", longest * D)] if sp else []
        assert r["fwd"] == entry + [("all_reduce", N), ("all_reduce", N + P)], r["fwd"]
        assert r["bwd"] == [("all_reduce", N * D)], r["bwd"]


def test_vocab_parallel_modules_validate_their_config():
    from torch import nn

    from harts_runtime.parallel import ParallelConfigError
    from harts_runtime.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead

    with pytest.raises(ParallelConfigError) as e:
        VocabParallelEmbedding.from_dense(nn.Embedding(3, 4), None, 0, 4)
    assert e.value.field == "vocab_size"
    with pytest.raises(ParallelConfigError) as e:
        VocabParallelLMHead.from_dense(nn.Linear(4, 8, bias=True), None, 0, 2)
    assert e.value.field == "lm_head"
