"""The empty microbatch: data parallelism pads a replica that has fewer microbatches than another
with it (``harts_runtime.parallel.data``), so every layer must run on zero rows, issue its
collectives, and give a zero loss with finite, zero gradients.

On the CPU the reference paths of every layer kind (the debug hybrid: KDA, MLA, GQA, dense and MoE
FFNs; a Qwen3.5-shaped model: Gated DeltaNet, gated attention, MoE with a gated shared expert); on
CUDA (``gpu`` mark) the fused paths (fla's kernels, the Triton KDA core) of ling-tiny and
Qwen3.5-35B-A3B layer shapes.
"""

import numpy as np
import pytest
import torch

EMPTY = np.zeros(0, dtype=np.int64)


def _tiny(flavor):
    from harts_runtime import model_config

    if flavor == "debug":
        return model_config("debug", moe={"use_expert_bias": True})
    return model_config(flavor, 2).replace(
        vocab_size=128,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        gated_attention={"head_dim": 8},
        gdn={"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8},
        moe={"num_experts": 4, "top_k": 2, "intermediate_size": 16, "shared_intermediate_size": 16},
        dtype="float32",
        chunk_size=8,
    )


def _run_empty(cfg, device):
    from harts_runtime import HybridModel, StepInputs, apply_recompute, run_microbatch
    from harts_runtime.testing import random_batch

    torch.manual_seed(0)
    model = HybridModel(cfg, device=device).train()
    batch = random_batch(3, num=6, vocab=cfg.vocab_size, max_new=8)
    step = StepInputs.synthetic(batch, seed=1, vocab_size=cfg.vocab_size)
    for recompute in (False, True):
        apply_recompute(model, recompute)
        model.zero_grad(set_to_none=True)
        loss, stats = run_microbatch(model, step, EMPTY, "compact")
        assert stats["rows"] == 0 and stats["logprobs"].numel() == 0
        assert float(loss) == 0.0
        for name, p in model.named_parameters():
            assert p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()), name
        counts = [m.local_tokens_per_expert for m in model.moe_layers()]
        assert all(not c.any() for c in counts)


@pytest.mark.parametrize("flavor", ["debug", "qwen3.5-35b-a3b"])
def test_empty_microbatch_on_reference_paths(flavor):
    _run_empty(_tiny(flavor), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("flavor", ["ling-tiny", "qwen3.5-35b-a3b"])
def test_empty_microbatch_on_fused_paths(flavor):
    from harts_runtime import model_config

    _run_empty(model_config(flavor, 2), "cuda")
