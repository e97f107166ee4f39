"""Shared pytest fixtures."""

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Tiny graphs: intra-op threads only add contention (10x slower on a busy 2-core box).
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
