"""Fixtures of the sidecar tests (helpers in ``sidecar_fixtures.py``)."""

from __future__ import annotations

import logging

import pytest
from sidecar_fixtures import Gate, Records

from harts_planner.rpc import server as server_module


@pytest.fixture
def records():
    """The server's log records of this test (logger ``harts_planner.rpc``)."""
    handler, logger = Records(), server_module.LOGGER
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def gate(monkeypatch):
    """A :class:`Gate` installed in the server module; opened at the end so nothing stays held."""
    g = Gate().install(monkeypatch)
    yield g
    g.open()
