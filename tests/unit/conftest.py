"""The unit tier is pure: a test here that opens a socket, starts a thread or a process fails at once."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading

import pytest
import zmq


class ImpureTest(AssertionError):
    """A unit test reached for I/O: it belongs in tests/transport or tests/cluster."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise ImpureTest(f"unit tests are pure, but this one {what}: move it to tests/transport or tests/cluster")
    return refuse


@pytest.fixture(autouse=True)
def _pure(monkeypatch):
    monkeypatch.setattr(socket.socket, "__init__", _refuse("opened a socket"))
    monkeypatch.setattr(zmq.Context, "socket", _refuse("opened a ZeroMQ socket"))
    monkeypatch.setattr(threading.Thread, "start", _refuse("started a thread"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
    monkeypatch.setattr(os, "fork", _refuse("forked"))
    monkeypatch.setattr(asyncio, "create_subprocess_exec", _refuse("started a process"))
