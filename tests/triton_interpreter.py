"""What a subprocess needs to run fla's Triton kernels on the CPU under ``TRITON_INTERPRET=1``
(shared by the tests that run fla kernels or our own under the interpreter): :func:`prelude` returns the source to put
first in the subprocess's code, :func:`run` runs such code with the interpreter switched on."""

from __future__ import annotations

import os
import subprocess
import sys


def prelude(*fla_modules: str) -> str:
    """Source that makes the interpreter usable for fla: autotuners do not time (the interpreter
    cannot), ``fla_modules`` are imported, and their ``range`` yields ints with ``.to`` (triton's
    interpreter runs fla's ``for i in range(n)`` loops with Python ints, on which fla's kernels call
    ``.to(tl.int64)``)."""
    imports = "".join(f"import {m}\n" for m in fla_modules)
    return (
        "import builtins, operator, sys\n"
        "import triton.runtime.autotuner as at\n"
        "at.Autotuner._bench = lambda self, *a, **k: [0.0, 0.0, 0.0]\n" + imports + "class _Int(int):\n"
        "    def to(self, *a, **k):\n"
        "        return self\n"
        "fla_range = lambda *a: (_Int(i) for i in builtins.range(*(operator.index(x) for x in a)))\n"
        "for name, mod in list(sys.modules.items()):\n"
        "    if name.startswith('fla.') and mod is not None:\n"
        "        mod.range = fla_range\n"
    )


def run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``TRITON_INTERPRET=1``, the repository and this folder
    (the test helpers) on the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, here, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
