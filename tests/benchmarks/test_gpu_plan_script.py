"""CPU test of the device-call plan ``benchmarks/gpu/issue15_runs.sh`` (benchmarks/results/gpu_runs.md):
each step runs with the two call scripts stubbed (they run their arguments; their own control flow
is tests/benchmarks/test_gpu_call_scripts.py) and a fake ``python3`` that logs its arguments, so the
test checks which benchmarks and tests each step starts, with which options, that each step's log
lands under ``$OUT``, that the command's exit code comes back and that the tuned step packs its
Triton cache."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("bash", "tar", "timeout", "stat")),
    reason="needs bash and coreutils",
)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "issue15_runs.sh"
STUB = '#!/usr/bin/env bash\n[ $# -eq 0 ] || "$@"\n'
FAKE_PYTHON = '#!/bin/sh\necho "$*" >> "$FAKE_LOG"\nexit "${FAKE_RC:-0}"\n'


def run(tmp_path: Path, step: str, rc: int = 0):
    gpu = tmp_path / "repo" / "benchmarks" / "gpu"
    gpu.mkdir(parents=True, exist_ok=True)
    shutil.copy(SCRIPT, gpu / SCRIPT.name)
    for name in ("call_a.sh", "call_b.sh"):
        (gpu / name).write_text(STUB)
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "python3").write_text(FAKE_PYTHON)
    (bin_ / "python3").chmod(0o755)
    out, fake_tmp, log = tmp_path / "out", tmp_path / "tmp", tmp_path / "python.log"
    out.mkdir(exist_ok=True)
    (fake_tmp / "tc_tuned").mkdir(parents=True, exist_ok=True)
    (fake_tmp / "tc_tuned" / "kernel.bin").write_bytes(b"x" * 100)
    log.write_text("")
    env = dict(
        os.environ,
        PATH=f"{bin_}:{os.environ['PATH']}",
        OUT=str(out),
        HARTS_GPU_TMP=str(fake_tmp),
        FAKE_LOG=str(log),
        FAKE_RC=str(rc),
    )
    r = subprocess.run(
        ["bash", f"benchmarks/gpu/{SCRIPT.name}", step],
        cwd=tmp_path / "repo",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return r, log.read_text().splitlines(), out


def test_each_step_starts_its_runs_and_logs_under_out(tmp_path):
    expect = {
        "a": [
            "benchmarks/gpu/run_gpu_tests.py -q -m gpu --import-mode=prepend tests/runtime/layers/test_moe_gpu.py "
            "tests/runtime/modules/test_fused_modules.py tests/kernels/test_kda_gpu.py tests/runtime/models/test_hybrid_model.py"
        ],
        "b": [
            "benchmarks/train_eval.py --layers 24 --fast-autotune --sections speedup,breakdown "
            "--keep attention,linear_attention --out OUT/te24_kept2"
        ],
        "c": [
            "benchmarks/train_eval.py --layers 24 --fast-autotune --sections speedup --keep attention "
            "--out OUT/te24_kept1",
            "benchmarks/gpu/run_gpu_tests.py -q -m gpu --import-mode=prepend "
            "tests/runtime/models/test_families_gpu.py tests/runtime/ops/test_attention_gpu.py",
        ],
        "d": [
            "benchmarks/train_eval.py --layers 24 --fast-autotune --sections fidelity "
            "--fidelity-recompute on --out OUT/te24_fidelity"
        ],
        "e": [
            "benchmarks/train_eval.py --layers 24 --sections speedup --keep attention,linear_attention "
            "--out OUT/te24_tuned"
        ],
    }
    for step, calls in expect.items():
        r, seen, out = run(tmp_path / step, step)
        assert r.returncode == 0, (step, r.stdout, r.stderr)
        assert seen == [c.replace("OUT", str(out)) for c in calls], step
        assert (out / f"{step}.log").exists(), step
    assert (tmp_path / "e" / "out" / "tcache_tuned.tgz").stat().st_size > 0  # the tuned cache comes back


def test_exit_codes_come_back_and_bad_steps_are_refused(tmp_path):
    r, seen, _ = run(tmp_path / "b", "b", rc=5)
    assert r.returncode == 5 and len(seen) == 1
    r, seen, _ = run(tmp_path / "z", "z")
    assert r.returncode == 2 and "unknown step z" in r.stdout and not seen
