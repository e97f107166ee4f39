"""Shared pytest fixtures and the meaning of the suite's marks.

Marks (registered in pyproject.toml):

* ``gpu``: the test needs a CUDA device. Without one it is skipped here, whatever the test file
  says, so that ``-m gpu`` selects exactly the tests the GPU machine must run and a CPU run never
  reports them as failures. Tests that run Triton kernels under ``TRITON_INTERPRET=1`` on the CPU
  are not ``gpu`` tests.
* ``slow``: the test takes seconds (full-scale workloads); ``-m "not slow"`` is the quick loop.
"""

import pytest


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
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
