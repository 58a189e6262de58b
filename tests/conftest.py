"""Shared fixtures and the tiers: each test's folder (unit, transport, cluster) is its marker."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
import uvloop

torch.set_num_threads(1)  # the test process shares 2 cores with the daemons it starts

TESTS = Path(__file__).parent
TIERS = ("unit", "transport", "cluster")


def pytest_collection_modifyitems(config, items):
    """Mark every test with its tier, read from its folder, so `-m unit` and `tests/unit` select the same."""
    for item in items:
        path = Path(item.fspath)
        tier = path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/unit, tests/transport or tests/cluster")
        item.add_marker(tier)


def pytest_asyncio_loop_factories(config, item):
    """Every async test runs on uvloop, as the daemons do."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def tcp_address() -> str:
    """A loopback TCP address whose port the OS picks at bind time."""
    return "tcp://127.0.0.1:0"


@pytest.fixture
def ipc_address():
    """A fresh ipc:// path in a temp dir, removed afterwards."""
    d = tempfile.mkdtemp(prefix="hmp-")
    path = os.path.join(d, f"{uuid.uuid4().hex[:8]}.sock")
    yield f"ipc://{path}"
    if os.path.exists(path):
        os.unlink(path)
    os.rmdir(d)
