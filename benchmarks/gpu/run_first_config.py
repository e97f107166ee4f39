"""Run a benchmark script with one Triton config per kernel (no autotuning), as
``run_gpu_tests.py`` does for pytest: on a cold lent machine a full autotune of every kernel costs
minutes (``benchmarks/results/gpu_runs.md``). Usage:
``python3 benchmarks/gpu/run_first_config.py benchmarks/cp_states_one_gpu.py --out x.json``."""

import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels"))

from harts_kernels.tuning import use_first_config_only  # noqa: E402

if len(sys.argv) < 2:
    sys.exit("usage: run_first_config.py SCRIPT [ARGS...]")
use_first_config_only()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
