"""Config errors that need a socket: addresses and ports checked against what can be bound."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hmp.config import env_overrides
from hmp.errors import ConfigError
from hmp.job import load


def _mutated(tmp_path, edit) -> Path:
    from tests.support import write_config

    base = write_config(tmp_path)
    path = tmp_path / "bad.toml"
    path.write_text(edit(base.read_text()))
    return path


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace('name = "digits_mlp"', 'name = "nope"'), "model.name"),
    (lambda t: t.replace('name = "digits_mlp"', 'name = "digits_mlp"\nargs = { hidden = "big" }'), "model.args"),
    (lambda t: t.replace('name = "digits_mlp"', 'name = "digits_mlp"\nargs = { wide = 3 }'), "model.args"),
    (lambda t: t.replace('name = "digits_mlp"', 'name = "digits_mlp"\nargs = { hidden = [-1] }'), "model.args"),
    (lambda t: t + '\n[sweep]\nmembers = [{lr = -1.0}]\n', "sweep.members"),
    (lambda t: t.replace("lr = 0.05", 'lr = 0.05\nbetas = ["a", "b"]'), "optimizer.betas"),
    (lambda t: t + "\n[limits]\nmax_frames = -1\n", "limits.max_frames"),
    (lambda t: t + "\n[limits]\nmax_message_bytes = 0\n", "limits.max_message_bytes"),
    (lambda t: t + "\n[limits]\nrequest_timeout_s = -1\n", "limits.request_timeout_s"),
    (lambda t: t.replace("heartbeat_interval_s = 0.5", "heartbeat_interval_s = 0"), "job.heartbeat_interval_s"),
    (lambda t: t.replace('kind = "digits"', 'kind = "digits"\ntest_fraction = 2.0'), "data.test_fraction"),
    (lambda t: re.sub(r'bind = "tcp://127.0.0.1:\d+"', 'bind = "tcp://127.0.0.1:notaport"', t, count=1),
     "nodes[0].bind"),
    (lambda t: t.replace("[train]", "[train]\npolicy_args = { bogus = 1 }"), "train.policy_args"),
    (lambda t: t.replace('policy = "static"', 'policy = "adaptive"').replace(
        "[train]", "[train]\npolicy_args = { bogus = 1 }"), "train.policy_args"),
    (lambda t: t + '\n[sweep]\nmembers = [{lr = "fast"}]\n', "sweep.members"),
    (lambda t: t.replace("checkpoint_every = 0", "checkpoint_every = -1"), "ps.checkpoint_every"),
    (lambda t: t.replace("checkpoint_every = 0", "checkpoint_every_s = -0.5"), "ps.checkpoint_every_s"),
    (lambda t: t.replace("[train]", "[train]\nmin_workers = 0"), "train.min_workers"),
    (lambda t: t.replace("[train]", "[train]\nmin_workers = 3"), "train.min_workers"),  # the job has 2
    (lambda t: t.replace("[job]", "[job]\nrestarts = { ps_shard = 1 }"), "job.restarts.ps_shard"),
    (lambda t: t.replace("[job]", "[job]\nrestarts = { cpu_worker = -1 }"), "job.restarts.cpu_worker"),
    (lambda t: t.replace("[job]", '[job]\ntoken = "tab\\there"'), "job.token"),
    (lambda t: t + "\n[security]\nhandshake_timeout_s = 0\n", "security.handshake_timeout_s"),
])
def test_bad_values_are_config_errors_naming_file_and_key(tmp_path, edit, key):
    """Values the code would refuse only at run time (in a daemon, with a traceback) are refused
    at load time instead, naming the file and the key."""
    path = _mutated(tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert info.value.key == key and info.value.path == str(path)


def test_environment_overrides_are_validated_and_named(tmp_path):
    from tests.support import write_config

    cfg = load(write_config(tmp_path))
    for var, value, key in (("HMP_MAX_SECONDS", "-5", "train.max_seconds"),
                            ("HMP_LOG_FORMAT", "bogus", "job.log_format")):
        with pytest.raises(ConfigError) as info:
            env_overrides(cfg, {var: value})
        assert info.value.key == key and f"${var}" in info.value.path
