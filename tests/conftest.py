"""Shared fixtures: uvloop for async tests, loopback addresses, no leaked sockets."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import torch
import uvloop

torch.set_num_threads(1)  # the test process shares 2 cores with the daemons it starts


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
    for p in (path,):
        if os.path.exists(p):
            os.unlink(p)
    os.rmdir(d)
