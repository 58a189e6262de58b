"""A ``user_worker`` in the config (docs/own_loop.md): what a job with one may be, and who starts it."""

from __future__ import annotations

import re

import pytest

import hmp
from hmp.cluster import START_ORDER
from hmp.config import WORKER_ROLES, Role, loads
from hmp.errors import ConfigError

from tests.support import digits_job_text, nodes_toml

NODES = nodes_toml(("scheduler", "scheduler", 'bind = "tcp://127.0.0.1:47999"'), ("ps0", "ps"),
                   ("mine", "user_worker"))


def job(tmp_path, extra: str = "", nodes: str = NODES, **kw) -> str:
    return digits_job_text(tmp_path, name="own", **kw) + extra + nodes


def test_a_user_worker_is_a_worker_the_launcher_does_not_start(tmp_path):
    cfg = loads(job(tmp_path))
    assert [n.id for n in cfg.workers] == ["mine"] and Role.USER_WORKER in WORKER_ROLES
    assert Role.USER_WORKER not in START_ORDER


def test_restarts_of_user_workers_are_refused(tmp_path):
    text = re.sub(r"(?m)^(join_timeout_s = .*)$", r"\1\nrestarts = { user_worker = 1 }", job(tmp_path))
    with pytest.raises(ConfigError, match=r"job\.restarts\.user_worker.*does not start user workers"):
        loads(text)


def test_hogwild_threads_on_a_user_worker_are_refused(tmp_path):
    nodes = NODES.replace('role = "user_worker"', 'role = "user_worker"\nhogwild_threads = 4')
    with pytest.raises(ConfigError, match=r"nodes\[2\]\.hogwild_threads.*user_worker"):
        loads(job(tmp_path, nodes=nodes))


def test_a_sweep_job_refuses_user_workers(tmp_path):
    sweep = '\n[sweep]\noptimizer = "sgd"\nmembers = [{ lr = 0.1 }, { lr = 0.05 }]\n'
    with pytest.raises(ConfigError, match=r"no user_worker in a \[sweep\] job"):
        loads(job(tmp_path, extra=sweep))


def test_a_handle_names_a_user_worker_of_the_config(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(job(tmp_path))
    with pytest.raises(ConfigError, match=r"nodes\[id=ps0\]\.role.*\"user_worker\".*got 'ps'"):
        hmp.SyncWorker(path, "ps0")
    with pytest.raises(ConfigError, match=r"no node with id 'nobody'"):
        hmp.Worker(path, "nobody")
    worker = hmp.SyncWorker(path, "mine", token="t0k3n")
    assert worker.cfg.job.token == "t0k3n"
    with pytest.raises(hmp.HmpError, match="has not joined yet"):
        worker.model
    with pytest.raises(ValueError, match="timeout_s"):
        hmp.SyncWorker(path, "mine", timeout_s=0)
