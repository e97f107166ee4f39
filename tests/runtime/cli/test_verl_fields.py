"""The verl backend's ``harts.*`` fields are generated from the settings tree: the parallel degrees
(``harts.tp`` ... ``harts.sequence_parallel``) and the execution options, errors named
``harts.<field>``. verl itself runs in its own CI venv (``tests/integrations/test_verl.py``); here
its two base classes are stand-ins, so the generation is checked wherever the runtime is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from harts_runtime.job_config import group_settings
from harts_runtime.options import ExecutionOptions

STUB = textwrap.dedent(
    """
    import dataclasses, importlib.util, json, sys, types
    from dataclasses import dataclass

    @dataclass
    class VerlEngineConfig:
        forward_only: bool = False
        dtype: str = "bfloat16"
        def __post_init__(self):
            pass

    @dataclass
    class FSDPActorConfig:
        entropy_coeff: float = 0.0
        def __post_init__(self):
            pass

    mods = {n: types.ModuleType(n) for n in ("verl", "verl.workers", "verl.workers.config", "verl.workers.config.engine")}
    mods["verl.workers.config"].FSDPActorConfig = FSDPActorConfig
    mods["verl.workers.config.engine"].EngineConfig = VerlEngineConfig
    sys.modules.update(mods)
    import harts_runtime  # the package's __init__ imports the backend (tensordict): load the file alone
    from pathlib import Path

    path = Path(harts_runtime.__file__).parent / "integrations" / "verl" / "config.py"
    spec = importlib.util.spec_from_file_location("harts_verl_config", path)
    config = importlib.util.module_from_spec(spec)
    sys.modules["harts_verl_config"] = config
    spec.loader.exec_module(config)

    out = {"fields": [f.name for f in dataclasses.fields(config.HartsEngineConfig)], "errors": {}}
    cfg = config.HartsEngineConfig(cp=2, dtype="float32")
    out["cp"] = cfg.cp
    for name, bad in (("cp", 0), ("tp", True), ("sequence_parallel", 1), ("capacity", 0)):
        try:
            config.HartsEngineConfig(**{name: bad})
        except ValueError as e:
            out["errors"][name] = [e.field, str(e)]
    print(json.dumps(out))
    """
)


def test_harts_fields_are_the_tree_s_parallel_and_execution_settings():
    run = subprocess.run([sys.executable, "-c", STUB], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    fields = set(out["fields"])
    assert {s.name for s in group_settings("parallel")} <= fields
    assert {s.name for s in group_settings("execution")} - {"param_dtype"} <= fields
    assert out["cp"] == 2
    for name, (field, text) in out["errors"].items():
        assert field == f"harts.{name}" and "\n" not in text, (name, field, text)
    assert "must be an integer >= 1, got 0" in out["errors"]["cp"][1]
    assert ExecutionOptions().capacity  # the execution defaults come from the same declarations
