"""Shared pytest fixtures and the meaning of the suite's marks.

Marks (registered in pyproject.toml):

* ``gpu``: the test needs a CUDA device. Without one it is skipped here, whatever the test file
  says, so that ``-m gpu`` selects exactly the tests the GPU machine must run and a CPU run never
  reports them as failures. Tests that run Triton kernels under ``TRITON_INTERPRET=1`` on the CPU
  are not ``gpu`` tests.
* ``slow``: the test takes seconds (full-scale workloads); ``-m "not slow"`` is the quick loop.

Threads: every test runs with one intra-op thread (``OMP_NUM_THREADS=1``, set here before anything
imports torch, so the processes tests start inherit it too; an ``OMP_NUM_THREADS`` already in the
environment wins). The suite's tensors are tiny: a thread team only adds contention, and on a busy
2-core machine it is ruinous (measured side by side under load: ``tests/runtime/layers/test_kda_layer.py``
and ``test_attention.py`` 3.3x faster in wall time with one thread; the Triton interpreter cases 2-3x).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (gpu mark)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny graphs: intra-op threads only add contention (10x slower on a busy 2-core box).
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``: one thread even where the
    environment asked for more (the suite's default is one, see the module docstring)."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
