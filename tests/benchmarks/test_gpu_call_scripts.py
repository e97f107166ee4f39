"""CPU tests of the control flow of the device-only scripts ``benchmarks/gpu/call_a.sh`` and
``call_b.sh`` (benchmarks/results/gpu_runs.md, "FA4"): each runs with bash in a fake repo root (``.fa4a/``, ``.fa4b/``,
``.whl/`` built here: zip wheels and a real xz tar split in three parts, as ``fa4_pack.sh`` makes
them), ``HARTS_GPU_TMP`` standing in for ``/tmp`` and a fake ``python3`` first on ``PATH``. The fake
logs each call and does ``-m pip install ... --target DIR ARGS`` by unzipping each wheel into DIR
(``.`` is the HARTS build: it makes ``DIR/harts_runtime``, or fails when ``SHIM_FAIL_BUILD`` is set).
"""

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("bash", "tar", "xz")), reason="needs bash, tar and xz"
)

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
SCRIPTS = sorted(p.name for p in GPU.glob("*.sh"))

SHIM = """#!/bin/sh
# fake python3 (tests/benchmarks/test_gpu_call_scripts.py): log the call, fake `-m pip install --target`
printf '%s|%s\\n' "${PYTHONPATH:-}" "$*" >> "$SHIM_LOG"
[ "$1 $2 $3" = "-m pip install" ] || { echo "shim: not a pip install: $*" >&2; exit 97; }
target= prev=
for a; do [ "$prev" = --target ] && target=$a; prev=$a; done
[ -n "$target" ] || { echo "shim: no --target" >&2; exit 98; }
mkdir -p "$target"
for a; do
    case $a in
    .) if [ -n "${SHIM_FAIL_BUILD:-}" ]; then
           echo "building wheel for harts"; echo "error: SHIM_BUILD_FAILED" >&2; exit 1
       fi
       mkdir -p "$target/harts_runtime" ;;
    *.whl) [ -f "$a" ] || { echo "ERROR: no such wheel: $a" >&2; exit 1; }
       REAL_PYTHON -m zipfile -e "$a" "$target" || exit 1 ;;
    esac
done
"""

# The compiler library, as fa4_pack.sh packs it: one tar (incompressible, so the three parts are
# real pieces of the xz stream) unpacked into the nvidia_cutlass_dsl/ folder the small wheel made.
LIBRARY = {
    "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": b"CUTLASS = 1\n",
    "nvidia_cutlass_dsl/lib/libcute_dsl.so": os.urandom(24_000),
}
WHEELS = {
    ".fa4a/flash_attn_4-4.0.0b36-py3-none-any.whl": {"flash_attn/cute/__init__.py": "FA4 = 1\n"},
    ".fa4a/nvidia_cutlass_dsl-4.8.1-py3-none-any.whl": {"nvidia_cutlass_dsl/__init__.py": "DSL = 1\n"},
    ".whl/flash_linear_attention-0.4.0-py3-none-any.whl": {"fla/__init__.py": "FLA = 1\n"},
    ".whl/grpcio_tools-1.76.0-cp312-cp312-manylinux_2_17_x86_64.whl": {"grpc_tools/__init__.py": ""},
}


class Rig:
    """A fake lent machine: ``repo`` (the cwd), ``tmp`` (its /tmp), ``out`` ($OUT), the shim's log."""

    def __init__(self, root: Path):
        self.repo, self.tmp, self.out, self.bin = (root / d for d in ("repo", "tmp", "out", "bin"))
        for d in (self.repo, self.tmp, self.out, self.bin):
            d.mkdir()
        self.log, self.seen = root / "shim.log", root / "seen.env"
        for rel, files in WHEELS.items():
            (self.repo / rel).parent.mkdir(exist_ok=True)
            with zipfile.ZipFile(self.repo / rel, "w") as z:
                for name, text in files.items():
                    z.writestr(name, text)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for name, data in LIBRARY.items():
                info = tarfile.TarInfo("./" + name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        xz, third = buf.getvalue(), len(buf.getvalue()) // 3 + 1
        parts = [xz[i : i + third] for i in range(0, len(xz), third)]
        assert len(parts) == 3
        (self.repo / ".fa4b").mkdir()
        for i, part in enumerate(parts):
            (self.repo / (".fa4a" if i == 0 else ".fa4b") / f"part.{i:02d}").write_bytes(part)
        shim = self.bin / "python3"
        shim.write_text(SHIM.replace("REAL_PYTHON", shlex.quote(sys.executable)))
        shim.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_CACHE_DIR", "OUT")}
        self.env = env | {
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HARTS_GPU_TMP": str(self.tmp),
            "OUT": str(self.out),
            "SHIM_LOG": str(self.log),
            "LC_ALL": "C",
        }

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(GPU / script), *args],
            cwd=self.repo,
            env=self.env | env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def record(self) -> list[str]:
        """A command for "$@" that writes the environment it sees to ``seen``."""
        return ["bash", "-c", 'env > "$1"', "_", str(self.seen)]

    def seen_env(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.seen.read_text().splitlines() if "=" in line)

    def pip_calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def rig(tmp_path):
    return Rig(tmp_path)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    """Every script in benchmarks/gpu/ is valid bash (``bash -n``)."""
    assert SCRIPTS and {"call_a.sh", "call_b.sh", "fa4_pack.sh"} <= set(SCRIPTS)
    r = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_call_b_on_a_cold_machine_exits_3_and_runs_nothing(rig):
    r = rig.run("call_b.sh", *rig.record())
    assert r.returncode == 3 and "cold machine: run call_a.sh first" in r.stdout
    assert rig.pip_calls() == [] and not rig.seen.exists() and os.listdir(rig.tmp) == []


def test_call_a_then_call_b(rig):
    """call_a.sh installs .whl into site and builds HARTS (with site on the path) into harts, keeps
    .fa4a in fa4 and runs the command on harts:site; call_b.sh installs FA4's wheels into site_fa4,
    unpacks part.00 + .fa4b/part.* into it and runs the command with FA4 on the path and its disk
    cache on; a second call_b.sh reuses site_fa4 (no pip). The command's exit status is the call's."""
    t = rig.tmp
    r = rig.run("call_a.sh", *rig.record())
    assert r.returncode == 0, r.stdout + r.stderr
    site_call, build_call = rig.pip_calls()
    assert site_call.startswith("|-m pip install ") and f"--target {t}/site " in site_call
    assert site_call.count(".whl/") == 2 and "--no-index" in site_call
    assert build_call.startswith(f"{t}/site|-m pip install ") and build_call.endswith(f"--target {t}/harts .")
    assert sorted(os.listdir(t / "fa4")) == sorted(os.listdir(rig.repo / ".fa4a"))
    assert (t / "site/fla/__init__.py").is_file() and (t / "harts/harts_runtime").is_dir()
    assert (rig.out / "build.log").is_file()
    seen = rig.seen_env()
    assert seen["PYTHONPATH"] == f"{t}/harts:{t}/site"
    assert seen["TRITON_CACHE_DIR"] == f"{t}/tc" and seen["PYTHONUNBUFFERED"] == "1"
    assert not (t / "tc").exists()  # no HARTS_AUTOTUNE_SEED: the cache is left to Triton

    rig.seen.unlink()
    r = rig.run("call_b.sh", *rig.record())
    assert r.returncode == 0, r.stdout + r.stderr
    calls = rig.pip_calls()
    assert len(calls) == 3 and f"--target {t}/site_fa4 " in calls[2]
    assert calls[2].count(f"{t}/fa4/") == 2 and f"{t}/fa4/part" not in calls[2]  # the wheels only
    site_fa4 = t / "site_fa4"
    for name, data in LIBRARY.items():
        assert (site_fa4 / name).read_bytes() == data
    assert (site_fa4 / "nvidia_cutlass_dsl/__init__.py").is_file()  # the wheel's files kept
    assert (site_fa4 / "flash_attn/cute/__init__.py").is_file()
    seen = rig.seen_env()
    assert seen["PYTHONPATH"].split(":") == [
        f"{t}/harts",
        f"{t}/site",
        f"{t}/site_fa4",
        f"{t}/site_fa4/nvidia_cutlass_dsl/dsl_packages",
    ]
    assert seen["TRITON_CACHE_DIR"] == f"{t}/tc" and seen["PYTHONUNBUFFERED"] == "1"
    assert seen["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert seen["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == f"{t}/fa4cache"

    rig.seen.unlink()
    r = rig.run("call_b.sh", *rig.record(), TRITON_CACHE_DIR="/carried/tc")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(rig.pip_calls()) == 3  # no second install
    assert rig.seen_env()["TRITON_CACHE_DIR"] == "/carried/tc"  # a caller's cache is kept
    assert rig.run("call_b.sh", "bash", "-c", "exit 7").returncode == 7


def test_failed_harts_build_exits_with_the_log_tail(rig):
    r = rig.run("call_a.sh", *rig.record(), SHIM_FAIL_BUILD="1")
    assert r.returncode == 1 and "error: SHIM_BUILD_FAILED" in r.stdout
    assert "SHIM_BUILD_FAILED" in (rig.out / "build.log").read_text()
    assert not rig.seen.exists() and not (rig.tmp / "harts/harts_runtime").exists()
    r = rig.run("call_b.sh", *rig.record())  # and call B still sees a cold machine
    assert r.returncode == 3 and not rig.seen.exists()


def test_missing_carry_fails_early(rig):
    """call_a.sh without .fa4a (or .whl) carried stops before the build and runs nothing."""
    shutil.rmtree(rig.repo / ".fa4a")
    r = rig.run("call_a.sh", *rig.record())
    assert r.returncode == 1 and rig.pip_calls() == [] and not rig.seen.exists()
    shutil.rmtree(rig.repo / ".whl")
    (rig.repo / ".fa4a").mkdir()
    (rig.repo / ".fa4a/part.00").write_bytes(b"x")
    r = rig.run("call_a.sh", *rig.record())
    assert r.returncode == 1 and "no such wheel" in r.stderr and not rig.seen.exists()
    assert len(rig.pip_calls()) == 1  # the build did not start


def test_call_b_without_fa4b_fails_and_a_retry_completes_the_install(rig):
    """A call B that cannot unpack the library (.fa4b not carried) fails; the next call B with it
    installs the library instead of taking the half-made site_fa4 for a finished one."""
    assert rig.run("call_a.sh").returncode == 0
    fa4b = rig.repo.parent / "fa4b.kept"
    shutil.move(rig.repo / ".fa4b", fa4b)
    r = rig.run("call_b.sh", *rig.record())
    assert r.returncode == 1 and not rig.seen.exists()
    shutil.move(fa4b, rig.repo / ".fa4b")
    r = rig.run("call_b.sh", *rig.record())
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(rig.pip_calls()) == 4  # call A's two, the failed call B's, the retry's
    for name, data in LIBRARY.items():  # the first call's truncated library replaced
        assert (rig.tmp / "site_fa4" / name).read_bytes() == data
    assert rig.seen.exists()


@pytest.mark.parametrize("script", ["call_a.sh", "call_b.sh"])
def test_no_command_installs_and_exits_0(rig, script):
    """Without arguments a call only installs: exit 0, nothing printed, no command run."""
    if script == "call_b.sh":
        assert rig.run("call_a.sh").returncode == 0
    before = len(rig.pip_calls())
    r = rig.run(script)
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    assert len(rig.pip_calls()) == before + (2 if script == "call_a.sh" else 1)
    assert all(c.split("|", 1)[1].startswith("-m pip install ") for c in rig.pip_calls())
    made = "harts/harts_runtime" if script == "call_a.sh" else "site_fa4/.complete"
    assert (rig.tmp / made).exists()


def test_autotune_seed_is_copied_into_the_triton_cache(rig):
    """HARTS_AUTOTUNE_SEED=DIR copies DIR's tree (Triton's <hash>/<kernel>.autotune.json files) into
    the Triton cache before the command runs, keeping what the cache already holds; a missing folder
    stops the call before it installs anything."""
    seed = rig.repo / "seed"
    (seed / "ABC").mkdir(parents=True)
    (seed / "ABC/kernel.autotune.json").write_text('{"key": [1], "configs_timings": []}')
    (rig.tmp / "tc/OLD").mkdir(parents=True)
    (rig.tmp / "tc/OLD/kept.json").write_text("{}")
    r = rig.run("call_a.sh", *rig.record(), HARTS_AUTOTUNE_SEED=str(seed))
    assert r.returncode == 0, r.stdout + r.stderr
    tc = Path(rig.seen_env()["TRITON_CACHE_DIR"])
    assert (tc / "ABC/kernel.autotune.json").read_text() == '{"key": [1], "configs_timings": []}'
    assert (tc / "OLD/kept.json").is_file()

    rig.seen.unlink()
    r = rig.run("call_a.sh", *rig.record(), HARTS_AUTOTUNE_SEED=str(rig.repo / "nowhere"))
    assert r.returncode == 1 and "HARTS_AUTOTUNE_SEED: no folder" in r.stdout and not rig.seen.exists()
    assert len(rig.pip_calls()) == 2  # stopped before installing or building anything


def test_the_kept_autotune_choices_are_triton_cache_entries():
    """benchmarks/results/issue26_gpu/tuned/autotune holds what Triton's autotuner writes and reads
    back (``Autotuner.check_disk_cache``): ``<base32 of the key's sha256>/<kernel>.autotune.json`` with
    the tuning key and every config's timings."""
    root = GPU.parent / "results" / "issue26_gpu" / "tuned" / "autotune"
    files = sorted(root.glob("*/*.autotune.json"))
    assert files and sorted(root.rglob("*.json")) == files
    for f in files:
        assert re.fullmatch(r"[A-Z2-7]{52}", f.parent.name), f  # Triton's base32 cache-key folders
        data = json.loads(f.read_text())
        assert data["key"] and data["configs_timings"], f
        for config, timings in data["configs_timings"]:
            assert {"kwargs", "num_warps", "num_stages"} <= set(config) and len(timings) >= 1, f
