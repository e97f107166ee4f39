"""Mapped cross-entropy (compact logits -> semantic log-probs) against the expanded computation (CPU)."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts_runtime.loss.logprobs import LogProbTargets, expanded_logprobs, mapped_logprobs, targets_from_batch
from harts_runtime.testing import random_batch


def shared_rows_with_different_labels(targets: LogProbTargets) -> int:
    """Number of compact rows read by positions with at least two different next tokens."""
    pairs = np.unique(np.stack([targets.row_index.numpy(), targets.labels.numpy()]), axis=1)
    return int((np.bincount(pairs[0]) >= 2).sum())


def test_targets_follow_the_trajectories():
    batch = random_batch(2, num=9)
    t = targets_from_batch(batch)
    rows, labels, positions = [], [], []
    for i in range(batch.num_trajectories):
        a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
        for s in range(a, b - 1):
            rows.append(int(batch.compact_map[s]))
            labels.append(int(batch.tokens[s + 1]))
            positions.append(s)
    assert t.row_index.tolist() == rows and t.labels.tolist() == labels and t.positions.tolist() == positions
    assert t.cu_seqlens.tolist() == [int(o) - i for i, o in enumerate(batch.offsets)]
    assert t.num_semantic == batch.semantic_tokens


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("seed", [0, 1])
def test_mapped_matches_expanded(dtype, chunk, seed):
    batch = random_batch(30 + seed, num=14, vocab=4)
    t = targets_from_batch(batch)
    assert shared_rows_with_different_labels(t) > 0
    gen = torch.Generator().manual_seed(seed)
    vocab = 64
    logits = (3 * torch.randn(batch.compact_tokens, vocab, generator=gen, dtype=torch.float64)).to(dtype)
    grad_out = torch.randn(t.row_index.numel(), generator=gen, dtype=torch.float64)
    # Ground truth in float64 on the expanded rows.
    z64 = logits.detach().double().clone().requires_grad_()
    ref = z64[t.row_index].log_softmax(-1).gather(1, t.labels[:, None])[:, 0]
    ref.backward(grad_out)

    z = logits.clone().requires_grad_()
    lp = mapped_logprobs(z, t, chunk=chunk)
    lp.backward(grad_out.to(lp.dtype))
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert lp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(lp.double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=tol, atol=tol)

    # The expanded baseline (log_softmax in float32 on [P, V] rows, what a trainer runs) agrees too.
    ze = logits.clone().requires_grad_()
    expanded_logprobs(ze, t).backward(grad_out.float())
    tol = max(tol, 1e-5)
    torch.testing.assert_close(ze.grad.double(), z.grad.double(), rtol=2 * tol, atol=2 * tol)


def test_gradcheck():
    batch = random_batch(4, num=6, vocab=3)
    t = targets_from_batch(batch)
    z = torch.randn(batch.compact_tokens, 11, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: mapped_logprobs(x, t, chunk=4), (z,))


def test_rows_nobody_reads_get_zero_gradient():
    batch = random_batch(5, num=8)
    t = targets_from_batch(batch)
    z = torch.randn(batch.compact_tokens, 20, requires_grad=True)
    mapped_logprobs(z, t).sum().backward()
    unread = torch.ones(batch.compact_tokens, dtype=torch.bool).index_fill(0, t.row_index, False)
    assert unread.any()  # leaf rows end trajectories
    assert not z.grad[unread].any()


def test_to_semantic_order():
    batch = random_batch(6, num=5)
    t = targets_from_batch(batch)
    values = torch.arange(t.row_index.numel(), dtype=torch.float32) + 1
    full = t.to_semantic(values)
    assert full.shape == (batch.semantic_tokens,)
    assert torch.equal(full[t.positions], values)
    assert not full[torch.from_numpy(batch.offsets[1:] - 1)].any()


class MaxNumel(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
                self.ops.append((str(func), t.numel()))
        return out


def test_mapped_path_never_allocates_s_by_v():
    batch = random_batch(45, num=40, vocab=3, max_new=4)
    t = targets_from_batch(batch)
    c, p, vocab = batch.compact_tokens, t.row_index.numel(), 4096
    assert p >= 2 * c, "the test needs real sharing (P >= 2C)"
    logits = torch.randn(c, vocab, requires_grad=True)
    weights = torch.randn(p)

    with MaxNumel() as mapped:
        (mapped_logprobs(logits, t, chunk=512) * weights).sum().backward()
    assert any("index_put" in op for op, _ in mapped.ops), "backward ran outside the watcher"
    assert mapped.max_numel <= c * vocab, "mapped path allocated more than the compact [C, V] gradient"
    big = [op for op, n in mapped.ops if n >= p * vocab]
    assert not big, big

    logits.grad = None
    with MaxNumel() as expanded:  # control: the detector sees the expansion
        (expanded_logprobs(logits, t) * weights).sum().backward()
    assert expanded.max_numel >= p * vocab


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_real_vocabulary_values_and_peak_memory():
    """V = 157,184 in bf16 on CUDA: same values as the expanded path, far less peak memory."""
    from harts_runtime.testing import synthetic_tree_batch

    batch = synthetic_tree_batch(0, prompt=200, turns=3, turn_len=(20, 80), fork_prob=0.8, fanout=3)
    t = targets_from_batch(batch).to("cuda")
    c, p, vocab = batch.compact_tokens, t.row_index.numel(), 157_184
    logits = torch.randn(c, vocab, device="cuda").to(torch.bfloat16)
    weights = torch.randn(p, device="cuda")
    peaks, results = {}, {}
    for name, fn in (("mapped", mapped_logprobs), ("expanded", expanded_logprobs)):
        z = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = fn(z, t)
        (lp * weights).sum().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        results[name] = (lp.detach(), z.grad.float())
    # Truth: the same bf16 logits in float32 (the mapped path is checked against float64 on CPU).
    z32 = logits.float().requires_grad_()
    truth = expanded_logprobs(z32, t)
    (truth * weights).sum().backward()
    torch.testing.assert_close(results["mapped"][0], truth.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results["expanded"][0], truth.detach(), rtol=1e-5, atol=1e-5)
    # bf16 gradients: the mapped path rounds each compact row once, so it is at least as close to the
    # truth as the expanded path (which rounds per semantic row and sums in bf16).
    err = {name: float((results[name][1] - z32.grad).abs().max()) for name in results}
    assert err["mapped"] <= 1.01 * err["expanded"] + 1e-6, err
    assert peaks["mapped"] < 0.5 * peaks["expanded"], peaks
