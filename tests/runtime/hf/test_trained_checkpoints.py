"""Checkpoints that survive training: for the Kimi-Linear, Qwen3-Next and Qwen3.5-MoE text
families a transformers checkpoint loads with exactly the family's parameters (every
parameter is read from a checkpoint tensor: Kimi-Linear's KDA has no output-gate bias, unlike fla's
layer), trains one AdamW step, saves, and reloads to the trained weights bit for bit, both in
HARTS and in transformers (no missing or unexpected keys, the same tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
hp = pytest.importorskip("harts_planner")

from hf_configs import V, kimi_linear_config, qwen_config  # noqa: E402

from harts_runtime import StepInputs, load_pretrained, save_pretrained, train_step  # noqa: E402
from harts_runtime.hf import save_setup  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5_moe_text")


def hf_model(family: str):
    torch.manual_seed(0)
    if family == "kimi_linear":
        return transformers.KimiLinearForCausalLM(kimi_linear_config()).float()
    if family == "qwen3_next":
        return transformers.Qwen3NextForCausalLM(qwen_config(family)).float()
    return transformers.Qwen3_5MoeForCausalLM(qwen_config(family)).float()


def step_inputs() -> StepInputs:
    """A small prefix-sharing rollout: a trunk, three continuations and a fork inside the trunk."""
    rng = np.random.default_rng(3)
    trunk = rng.integers(0, V, size=19).tolist()
    trajs = [trunk + rng.integers(0, V, size=n).tolist() for n in (5, 14, 9)] + [trunk[:7] + [1, 2, 3]]
    return StepInputs.synthetic(hp.RolloutBatch.from_token_lists(trajs), 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_trained_checkpoint_saves_and_reloads(tmp_path, family):
    hf_model(family).save_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf")
    _, adapter = save_setup(model, None)
    covered = {p.ours for name in adapter.checkpoint_names for p in adapter.pieces(name)}
    params = {n for n, _ in model.named_parameters()}
    assert params <= covered, sorted(params - covered)  # no parameter the family lacks
    assert not any(n.endswith("g_proj.1.bias") for n in params)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = train_step(model, optimizer, step_inputs(), None, "compact", capacity=256)
    assert np.isfinite(float(result.loss))
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = [n for n in trained if not torch.equal(trained[n], before[n])]
    assert len(changed) == len(trained), sorted(set(trained) - set(changed))
    assert all(torch.isfinite(t).all() for t in trained.values())

    save_pretrained(model, tmp_path / "out")
    again = load_pretrained(tmp_path / "out")
    reloaded = dict(again.named_parameters())
    assert reloaded.keys() == trained.keys()
    for n, t in trained.items():
        assert torch.equal(reloaded[n], t), n
    expert_bias = {k: v for k, v in model.state_dict().items() if k.endswith("expert_bias")}
    for k, v in expert_bias.items():  # a buffer the step updated, and the checkpoint carries
        assert torch.equal(again.state_dict()[k], v), k

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    want = adapter.to_hf(model.state_dict())
    got = hf.state_dict()
    assert set(want) <= set(got)
    for k, v in want.items():
        assert torch.equal(got[k].float(), v.float()), k
