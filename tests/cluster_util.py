"""Helpers for cluster tests: configs on free loopback ports, written into the test's tmp dir."""

from __future__ import annotations

import random
import socket
from pathlib import Path


#: the ports :func:`free_port` handed out in this process (never twice: two nodes of a config must differ)
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (where a bind to port 0 takes its port)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a config's ``bind``, from the 12,000 ports just below the kernel's
    ephemeral range. Below it, because the port is bound later, by a daemon: a port from the ephemeral range
    (a bind to port 0 here) could meanwhile be given to a worker that binds port 0, which then answers the
    joins meant for the scheduler. Ray's default worker ports (10002-19999) lie below the range used."""
    high = _ephemeral_low()
    low = max(20000, high - 12000)
    for _ in range(1000):
        port = random.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{low}, {high})")


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
