"""transformers' side of the verl backend's Kimi-Linear test, runnable under another interpreter.

``python kimi_reference.py DIR`` reads ``DIR/trajs.json`` (token-id lists), builds a tiny random
``KimiLinearForCausalLM`` (``hf_configs.kimi_linear_config``, fixed seed, every parameter perturbed
as in ``tests/runtime/models/test_kimi_linear.py``), saves it to ``DIR/hf`` and writes ``DIR/ref.pt``: each
trajectory run alone, its next-token log-probs (float64, ``L_i - 1`` per trajectory, concatenated).

verl 0.9.1 pins transformers < 5.11, which has no Kimi-Linear; ``tests/integrations/test_verl.py``
runs this file under ``HARTS_HF_PYTHON`` (CI: the main stage's venv) when its own transformers
lacks the model. Needs torch and transformers only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def build(out: Path, trajs: list[list[int]], seed: int = 0) -> None:
    import transformers
    import transformers.models.kimi_linear.modeling_kimi_linear as mk

    # fla's Triton chunk_kda needs a GPU: run transformers' own PyTorch reference
    fn = mk.chunk_kimi_delta_attention
    mk.chunk_kimi_delta_attention = getattr(fn, "__wrapped__", fn)
    sys.path.insert(0, str(HERE.parent))
    from hf_configs import kimi_linear_config, perturb_kimi_linear

    torch.manual_seed(seed)
    model = perturb_kimi_linear(transformers.KimiLinearForCausalLM(kimi_linear_config()).float().eval())
    model.save_pretrained(out / "hf")
    lps = []
    with torch.no_grad():
        for t in trajs:
            logits = model(torch.tensor([t])).logits[0].double()
            lsm = torch.log_softmax(logits, -1)
            lps.append(lsm[torch.arange(len(t) - 1), torch.tensor(t[1:])])
    torch.save({"logprobs": torch.cat(lps)}, out / "ref.pt")


if __name__ == "__main__":
    d = Path(sys.argv[1])
    build(d, json.loads((d / "trajs.json").read_text()))
