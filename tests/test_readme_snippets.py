"""Every ```python block of README.md runs as written.

A block runs in a fresh namespace with the working directory in a temporary folder. What a block
takes from its surroundings (a batch from an earlier block, a running sidecar, a checkpoint folder,
a framework's tensors) is made by the block's entry in :data:`SETUP`, found by a line of the block;
a block's few placeholders (a sidecar address, a checkpoint path, ``device="cuda"``) are replaced
by the entry's ``replace`` pairs, each of which must occur in the block, so a README edit that moves
a placeholder fails here instead of going untested. A new block needs no entry when it runs alone.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[tuple[str, str]]:
    """``(section heading, code)`` of every python block, in README order."""
    out, heading, code = [], "README", None
    for line in README.read_text().splitlines(keepends=True):
        if code is not None:
            if line.rstrip() == "```":
                out.append((heading, "".join(code)))
                code = None
            else:
                code.append(line)
        elif line.startswith("```python"):
            code = []
        elif line.startswith("#"):
            heading = line.lstrip("#").strip()
    return out


@dataclass
class Setup:
    """What a block needs: ``make(tmp_path) -> namespace``, and placeholder replacements."""

    make: Callable[[Path], dict] = lambda tmp: {}
    replace: dict[str, Callable[[dict], str]] = field(default_factory=dict)
    needs: tuple[str, ...] = ()


def _small_batch():
    from harts_planner import RolloutBatch, synth

    s = synth.generate("small", seed=0)
    return RolloutBatch.from_arrays(s.tokens, s.offsets, s.tree_ids)


def _sidecar(tmp: Path) -> dict:
    from harts_planner.rpc.server import create_server

    _small_batch().save(tmp / "step.hrb")  # the block's `harts-planner synth step.hrb`, smaller
    server = create_server("127.0.0.1:0", workers=2)  # the block's `harts-planner serve`
    server.__enter__()
    return {"__server": server}


def _checkpoint(tmp: Path, folder: str, flavor: str = "kimi-linear-tiny") -> None:
    import torch

    from harts_runtime import HybridModel, model_config, save_pretrained

    torch.manual_seed(0)
    save_pretrained(HybridModel(model_config(flavor)), tmp / folder)


def _framework(tmp: Path) -> dict:
    """A checkpoint folder ``ckpt/`` and padded framework tensors, as an RL framework holds them."""
    import torch

    from harts_runtime.loss.functions import policy_loss_fn

    _checkpoint(tmp, "ckpt", "qwen3.5-tiny")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 500, (6,), generator=g)
    rows = [torch.cat([prompt, torch.randint(1, 500, (n,), generator=g)]) for n in (5, 9, 3, 7)]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)], attention_mask[i, : len(r)] = r, 1
    shape = input_ids.shape
    return {
        "dims": None,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "adv": torch.randn(shape, generator=g),
        "mask": attention_mask.bool(),
        "old": -torch.rand(shape, generator=g) - 5.0,
        "ref": -torch.rand(shape, generator=g) - 5.0,
        "loss_fn": policy_loss_fn,
    }


#: Block setups by a line that identifies the block.
SETUP: dict[str, Setup] = {
    "from harts_planner import CancelToken, CostLimits, PlanCancelledError, estimate_cost": Setup(
        make=lambda tmp: {"batch": _small_batch(), "plan_step": __import__("harts_planner").plan_step}
    ),  # continues the block above it, on a step of the size the section talks about
    'batch = RolloutBatch.load("step.hrb")': Setup(
        make=_sidecar,
        replace={'"127.0.0.1:50051"': lambda ns: repr(ns["__server"].address)},
        needs=("grpc",),
    ),
    'model = load_pretrained("path/to/Kimi-Linear-48B-A3B-Instruct"': Setup(
        make=lambda tmp: _checkpoint(tmp, "kimi") or {},
        replace={
            '"path/to/Kimi-Linear-48B-A3B-Instruct"': lambda ns: '"kimi"',
            'device="cuda"': lambda ns: 'device="cpu"',
        },
        needs=("torch", "safetensors"),
    ),
    "engine = HartsEngine.build(": Setup(make=_framework, needs=("torch", "safetensors")),  # Qwen3.5
}


def _setup(code: str) -> Setup:
    found = [s for key, s in SETUP.items() if key in code]
    assert len(found) <= 1, "two SETUP entries match one block"
    return found[0] if found else Setup()


BLOCKS = _blocks()


def test_every_setup_matches_a_block():
    codes = [code for _, code in BLOCKS]
    assert all(any(key in code for code in codes) for key in SETUP), [
        k for k in SETUP if not any(k in c for c in codes)
    ]


@pytest.mark.parametrize("heading, code", BLOCKS, ids=[f"{i}-{h[:40]}" for i, (h, _) in enumerate(BLOCKS)])
def test_readme_block_runs(heading, code, tmp_path, monkeypatch):
    setup = _setup(code)
    needs = setup.needs + (("torch",) if "harts_runtime" in code or "import torch" in code else ())
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    monkeypatch.chdir(tmp_path)
    namespace = setup.make(tmp_path)
    for old, new in setup.replace.items():
        assert old in code, f"{heading}: placeholder {old} moved; update SETUP"
        code = code.replace(old, new(namespace))
    server = namespace.pop("__server", None)
    try:
        exec(compile(code, f"README.md ({heading})", "exec"), namespace)  # noqa: S102
    finally:
        if server is not None:
            server.__exit__(None, None, None)
