"""pytest with one Triton config per kernel (no autotuning): the GPU tests' runner on the lent
machine, where a cold full autotune costs minutes (benchmarks/results/gpu_runs.md). Arguments go to pytest, e.g.
``python3 benchmarks/gpu/run_gpu_tests.py -q -m gpu --import-mode=prepend tests/runtime/layers/test_moe_gpu.py``."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels"))

from harts_kernels.tuning import use_first_config_only  # noqa: E402

use_first_config_only()

import pytest  # noqa: E402

sys.exit(pytest.main(sys.argv[1:]))
