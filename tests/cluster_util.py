"""Helpers for cluster tests: configs on free loopback ports, written into the test's tmp dir."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SGD = 'name = "sgd"\nlr = 0.05\nmomentum = 0.9'


def digits_job_text(tmp: Path, *, name: str, consistency: str = "async", target: float = 0.95, epochs: int = 30,
                    max_seconds: float = 120, optimizer: str = SGD, train_extra: str = "") -> str:
    """The [job], [model], [data], [optimizer] and [train] sections of the tests' digits jobs (no nodes)."""
    return f"""
[job]
name = "{name}"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.3
join_timeout_s = 60

[model]
name = "digits_mlp"

[data]
kind = "digits"

[optimizer]
{optimizer}

[train]
consistency = "{consistency}"
target_accuracy = {target}
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 0.3
report_interval_s = 0.3
{train_extra}
"""


def write_config(tmp: Path, *, consistency: str = "async", target: float = 0.95, epochs: int = 30,
                 max_seconds: float = 120, fixed_ps_ports: bool = False, extra_train: str = "",
                 checkpoint_every: int = 0, workers: str = "both", optimizer: str = SGD,
                 policy: str = "static") -> Path:
    """A digits job on loopback; PS ports fixed when a test needs to dial the shards itself."""
    ps_bind = [f"tcp://127.0.0.1:{free_port()}" if fixed_ps_ports else "tcp://127.0.0.1:0" for _ in range(2)]
    nodes = [("scheduler", "scheduler", f'bind = "tcp://127.0.0.1:{free_port()}"'),
             ("ps0", "ps", f'bind = "{ps_bind[0]}"'), ("ps1", "ps", f'bind = "{ps_bind[1]}"')]
    if workers in ("both", "cpu"):
        nodes.append(("cpu0", "cpu_worker", "batch_size = 16"))
    if workers in ("both", "gpu"):
        nodes.append(("gpu0", "gpu_worker", 'device = "cpu"\nbatch_size = 128'))
    text = digits_job_text(tmp, name="test", consistency=consistency, target=target, epochs=epochs,
                           max_seconds=max_seconds, optimizer=optimizer,
                           train_extra=f'policy = "{policy}"\n{extra_train}') + f"""
[ps]
chunk_bytes = 16384
checkpoint_every = {checkpoint_every}
checkpoint_dir = "{tmp / 'ckpt'}"
"""
    for nid, role, extra in nodes:
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\n{extra}\n'
    path = tmp / "job.toml"
    path.write_text(text)
    return path
