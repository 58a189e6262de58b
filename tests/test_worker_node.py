"""A worker's stop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hmp.errors import RemoteError, RequestError
from hmp.job import load
from hmp.messages import Join, Pull, Push, Report, Welcome, Work
from hmp.nodes.worker import WorkerNode

from .cluster_util import write_config


async def test_shutting_down_answer_to_an_async_push_is_a_stop_not_a_failure(tmp_path):
    node = WorkerNode(load(write_config(tmp_path)), "cpu0")

    class PS:
        async def push(self, samples):
            raise RemoteError("shutting_down", "ps0 is shutting down", "ps0")

    assert await node.push_unless_stopped(PS(), 16) is False
    assert node.stop_requested
