"""What several test modules share: ports, job configs and topologies, daemons that always stop, waits.

Test modules import helpers from here, never from each other."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from hmp.config import loads
from hmp.nodes.forkserver import ForkedProcess, ForkServer
from hmp.transport.codec import DTYPES

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "docs" / "report.schema.json"


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
HB_JOB = 0.5  # the heartbeat interval of digits_job_text's jobs (seconds)


def nodes_toml(*nodes: tuple[str, str] | tuple[str, str, str]) -> str:
    """The ``[[nodes]]`` tables of a topology: one ``(id, role)`` or ``(id, role, extra TOML lines)`` each."""
    text = ""
    for node in nodes:
        nid, role, extra = (*node, "")[:3]
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\n{extra}\n'.replace("\n\n\n", "\n\n")
    return text


def scheduler_node() -> tuple[str, str, str]:
    """The scheduler on a free loopback port (workers and shards may bind port 0; the scheduler may not)."""
    return ("scheduler", "scheduler", f'bind = "tcp://127.0.0.1:{free_port()}"')


def digits_job_text(tmp: Path, *, name: str, consistency: str = "async", target: float = 0.95, epochs: int = 30,
                    max_seconds: float = 120, optimizer: str = SGD, train_extra: str = "") -> str:
    """The [job], [model], [data], [optimizer] and [train] sections of the tests' digits jobs (no nodes)."""
    return f"""
[job]
name = "{name}"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end
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
                 policy: str = "static", name: str = "test") -> Path:
    """A digits job on loopback; PS ports fixed when a test needs to dial the shards itself."""
    ps_bind = [f"tcp://127.0.0.1:{free_port()}" if fixed_ps_ports else "tcp://127.0.0.1:0" for _ in range(2)]
    nodes = [("scheduler", "scheduler", f'bind = "tcp://127.0.0.1:{free_port()}"'),
             ("ps0", "ps", f'bind = "{ps_bind[0]}"'), ("ps1", "ps", f'bind = "{ps_bind[1]}"')]
    if workers in ("both", "cpu"):
        nodes.append(("cpu0", "cpu_worker", "batch_size = 16"))
    if workers in ("both", "gpu"):
        nodes.append(("gpu0", "gpu_worker", 'device = "cpu"\nbatch_size = 128'))
    text = digits_job_text(tmp, name=name, consistency=consistency, target=target, epochs=epochs,
                           max_seconds=max_seconds, optimizer=optimizer,
                           train_extra=f'policy = "{policy}"\n{extra_train}') + f"""
[ps]
chunk_bytes = 16384
checkpoint_every = {checkpoint_every}
checkpoint_dir = "{tmp / 'ckpt'}"
"""
    text += nodes_toml(*nodes)
    path = tmp / "job.toml"
    path.write_text(text)
    return path


def shard_job_config(tmp: Path, ps: str = "", limits: str = "", **kw) -> Path:
    """The tests' digits job with fixed shard ports, shared memory off and ``[ps]``/``[limits]`` lines added."""
    path = write_config(tmp, fixed_ps_ports=True, **kw)
    text = path.read_text().replace("[ps]\n", f"[ps]\n{ps}\n") + "\n[shm]\nenabled = false\n"
    if limits:
        text += f"\n[limits]\n{limits}\n"
    path.write_text(text)
    return path


def ring_config(tmp: Path, *, workers: int = 2, target: float = 0.95, epochs: int = 40, max_seconds: float = 120,
                extra: str = "") -> Path:
    """A digits ring (allreduce) job of ``workers`` CPU workers, buckets small enough to exercise overlap."""
    text = digits_job_text(tmp, name="ring", consistency="allreduce", target=target, epochs=epochs,
                           max_seconds=max_seconds, train_extra="batch_size = 32") + f"""
[collective]
bucket_bytes = 16384  # the digits MLP (~70 KiB) in several buckets: overlap and ordering get exercised
small_bytes = 4096
piece_bytes = 4096
{extra}
""" + nodes_toml(scheduler_node(), *((f"w{i}", "cpu_worker") for i in range(workers)))
    path = tmp / "job.toml"
    path.write_text(text)
    return path


def pipeline_config(tmp, *, epochs=2, max_seconds=25.0, workers=("cpu0", "cpu1", "accel0"), join_wait_s=10.0,
                    samples=16000):
    """The click model as a planned pipeline on loopback: embeddings on the measured 'cpu' type, the MLP on the
    scaled 'accel' type (the cheapest plan), parameters on two PS shards. Batch 512 and an accel at $0.04/h, 20x
    slower at lookups, keep the split clearly cheapest (by ~50%) under the cost model's per-message overhead, even
    when the profile is taken on a loaded machine; at batch 256 one cpu stage is cheaper (four messages each way
    per boundary)."""
    text = f"""
[job]
name = "pipe"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end
join_timeout_s = 60

[model]
name = "click_model"
args = {{ fields = 16, buckets = 1000, dim = 16, hidden = [256, 128] }}

[data]
kind = "click"
samples = {samples}
args = {{ fields = 16, buckets = 1000 }}

[optimizer]
name = "adam"
lr = 0.003

[train]
batch_size = 512
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 0.5
report_interval_s = 0.3

[ps]
chunk_bytes = 65536

[placement]
enabled = true
planner = "bruteforce"
micro_batches = 4
min_throughput = 2000.0
bandwidth_bytes_per_s = 1e10
join_wait_s = {join_wait_s}
profile_repeats = 7
resources = [
  {{ name = "cpu", price_per_hour = 0.17 }},
  {{ name = "accel", price_per_hour = 0.04, measured = false, speed_scale = {{ sparse = 0.05, dense = 8.0, elementwise = 4.0 }} }},
]
"""
    stages = [(w, "gpu_worker", 'resource = "accel"\ndevice = "cpu"') if w.startswith("accel")
              else (w, "cpu_worker", 'resource = "cpu"') for w in workers]
    text += nodes_toml(scheduler_node(), ("ps0", "ps"), ("ps1", "ps"), *stages)
    path = tmp / "pipe.toml"
    path.write_text(text)
    return loads(text, str(path))


def check_sections(report: dict, keys: Iterable[str]) -> None:
    """The report's ``keys`` are as docs/report.schema.json says."""
    import jsonschema

    properties = json.loads(SCHEMA.read_text())["properties"]
    for key in keys:
        jsonschema.validate(report[key], properties[key])


def daemon_env() -> dict[str, str]:
    """A daemon's environment when a test starts it by hand: this checkout importable, no job token (it accepts
    the test's clients, as a daemon a user starts would)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HMP_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class ForkedDaemon:
    """A daemon forked by this process's fork server (:mod:`hmp.nodes.forkserver`), with the part of
    ``subprocess.Popen`` the tests use: a fork of a process that has imported torch costs milliseconds, where a
    fresh ``python -m hmp.nodes.main`` costs seconds of CPU."""

    def __init__(self, proc: ForkedProcess) -> None:
        self._proc, self.pid = proc, proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        return self._proc.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self._proc.returncode) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"daemon {self.pid}", timeout)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        self._proc.send_signal(sig)

    def kill(self) -> None:
        self._proc.kill()


def fork_daemon(argv: list[str], log: Path) -> ForkedDaemon:
    """``python -m hmp.nodes.main *argv`` forked from the fork server, its output to ``log``. Callable from a
    running event loop: the request is made on a thread of its own."""
    spawn = ForkServer.shared().spawn(argv, env=daemon_env(), log=str(log))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return ForkedDaemon(pool.submit(asyncio.run, spawn).result(timeout=120))


class Daemons:
    """Daemons a test starts by hand (``hmp.nodes.main ROLE``, forked by :func:`fork_daemon`), each logging to a
    file. Every one is stopped when the block ends, however it ends: SIGTERM, then SIGKILL only past a 10 s
    grace."""

    def __init__(self, cfg: Path, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs
        self.procs: dict[str, ForkedDaemon] = {}
        self.starts: dict[str, int] = {}

    def start(self, role: str, node_id: str, *extra: str) -> ForkedDaemon:
        self.starts[node_id] = self.starts.get(node_id, 0) + 1
        proc = fork_daemon([role, "--config", str(self.cfg), "--id", node_id, *extra],
                           self.logs / f"{node_id}.{self.starts[node_id]}.log")
        self.procs[node_id] = proc
        return proc

    def log(self, node_id: str, start: int = 1) -> str:
        """The daemon's log so far ("" until the forked daemon has opened it)."""
        try:
            return (self.logs / f"{node_id}.{start}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> Daemons:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


async def until(predicate, timeout_s: float = 5.0, what: str = "") -> None:
    """Wait until ``predicate()`` holds, polling every 50 ms; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting until {what}")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------------------- nodes in the test's process


@contextlib.asynccontextmanager
async def running(node):
    """``node.run()`` (server, main, background tasks) as a task; stopped and awaited on the way out. With no
    scheduler listening a shard keeps trying to join, serving meanwhile."""
    task = asyncio.create_task(node.run())
    for _ in range(200):
        if node.server is not None and node.server._chan is not None:
            break
        await asyncio.sleep(0.01)
    try:
        yield task
    finally:
        node.stopping.set()
        await asyncio.wait_for(asyncio.shield(task), 15)


@contextlib.asynccontextmanager
async def client_of(node, name: str):
    """A client of ``node``'s server calling itself ``name``, closed on the way out."""
    from hmp.transport.endpoint import Client

    client = Client(node.node.bind, name=name, timeout_s=10)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def serving(node, address: str = "tcp://127.0.0.1:0"):
    """The shard's handlers behind a real Server, and a function opening a client as a worker."""
    from hmp.transport.endpoint import Client, Server

    server = Server(address, node.handlers(), name=node.id, limits=node.limits)
    await server.start()
    node.server = server
    clients: list[Client] = []

    async def as_worker(worker: str) -> Client:
        c = Client(server.address, name=worker, timeout_s=10)
        await c.connect()
        clients.append(c)
        return c

    try:
        yield as_worker
    finally:
        for c in clients:
            await c.close()
        await server.close(grace_s=0.5)


def shard_grads(node, value: float = 1.0) -> tuple[tuple[int, ...], tuple[torch.Tensor, ...]]:
    """A gradient of ``value`` for every chunk the shard node holds."""
    keys = tuple(sorted(node.core.chunks))
    return keys, tuple(torch.full_like(node.core.chunks[k].param, value) for k in keys)


def assert_cores_identical(primary, backup) -> None:
    """Two shard cores hold bit-identical values and optimizer state, and the same clock and push numbers."""
    for k, c in primary.chunks.items():
        assert torch.equal(c.param.view(torch.int32), backup.chunks[k].param.view(torch.int32)), k
        theirs = backup.chunks[k].optimizer.state_dict()
        for name, value in c.optimizer.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.view(torch.int32), theirs[name].view(torch.int32)), (k, name)
            else:
                assert value == theirs[name], (k, name)
    assert (primary.version, primary.updates_applied, primary.samples, primary.last_seq) == \
        (backup.version, backup.updates_applied, backup.samples, backup.last_seq)


# ------------------------------------------------------------------------------------ the scheduler core, scripted

SCHEDULER_HB = 1.0  # heartbeat interval of the scripted scheduler-core jobs (seconds)
SCRIPTED_WORKERS = (("cpu0", "cpu_worker"), ("gpu0", "gpu_worker"))


def scheduler_config(*, target_accuracy=0.0, target_loss=0.0, max_seconds=600.0, epochs=20, join_timeout_s=30.0,
                     placement=False, min_workers=1, restarts=""):
    """A scheduler, two shards and SCRIPTED_WORKERS, never started: for driving a SchedulerCore by hand."""
    text = f"""
[job]
heartbeat_interval_s = {SCHEDULER_HB}
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end
join_timeout_s = {join_timeout_s}
{restarts}

[train]
target_accuracy = {target_accuracy}
target_loss = {target_loss}
max_seconds = {max_seconds}
epochs = {epochs}
min_workers = {min_workers}
""" + nodes_toml(("scheduler", "scheduler", 'bind = "tcp://127.0.0.1:5555"'), ("ps0", "ps"), ("ps1", "ps"),
                 *SCRIPTED_WORKERS)
    return loads(text, "test.toml")


def scheduler_core(n_train=100, tolerate=False, **cfg):
    """A started SchedulerCore for :func:`scheduler_config` ``(**cfg)``."""
    from hmp.scheduler.core import SchedulerCore

    core = SchedulerCore(scheduler_config(**cfg), n_train=n_train, tolerate_worker_loss=tolerate)
    core.start(0.0)
    return core


def running_scheduler(now=0.0, **kw):
    """A scheduler core with both shards joined and both workers admitted at ``now``."""
    from hmp.scheduler.core import Admitted

    core = scheduler_core(**kw)
    for s in ("ps0", "ps1"):
        core.join(s, "ps", f"tcp://{s}", 1, now)
    for w, role in SCRIPTED_WORKERS:
        assert isinstance(core.join(w, role, f"tcp://{w}", 2, now), Admitted)
    core.take_events()
    return core


# ----------------------------------------------------------------------------- ring members' inputs
DTYPE_NAMES = [d for d in DTYPES if d != "bool"]
INT_RANGE = {"uint8": (0, 50), "int8": (-25, 25)}  # sums of 4 stay in range: exact comparisons
TOL = {"float16": (1e-2, 2e-2), "bfloat16": (5e-2, 1e-1), "float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}


def ring_inputs(dtype: str, numel: int, rank: int, seed: int) -> torch.Tensor:
    """Member ``rank``'s deterministic input (the parent recomputes it for the expected sum)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    d = DTYPES[dtype]
    if d.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(d)
    lo, hi = INT_RANGE.get(dtype, (-1000, 1000))
    return torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(d)


def check_ring_sum(results: list[torch.Tensor], dtype: str, numel: int, seed: int, where: str) -> None:
    """Every member's result is bit-identical, and equal to the sum (exact for integers)."""
    n = len(results)
    first = results[0]
    for r, t in enumerate(results):
        assert t.dtype == DTYPES[dtype] and t.shape == (numel,), where
        assert tensor_bits(t) == tensor_bits(first), f"{where}: member {r}'s result differs bitwise from member 0's"
    exact = sum(ring_inputs(dtype, numel, r, seed).to(torch.float64) for r in range(n))
    if DTYPES[dtype].is_floating_point:
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(first.to(torch.float64), exact, rtol=rtol, atol=atol * n, msg=where)
    else:
        assert torch.equal(first.to(torch.int64), exact.to(torch.int64)), where


def tensor_bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bits(b: bytes, dtype: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(DTYPES[dtype]) if b else torch.empty(0, dtype=DTYPES[dtype])


# -------------------------------------------------------------------------------- sparse click jobs


FIELDS, BUCKETS, DIM = 4, 50, 8  # the sparse click model: fields, buckets per field, embedding width
TABLE = "0.table.weight"
OPTIMIZERS = {"sgd": 'name = "sgd"\nlr = 0.1', "adagrad": 'name = "adagrad"\nlr = 0.1',
              "adam": 'name = "adam"\nlr = 0.01'}


def sparse_click_config(tmp: Path, *, optimizer: str = "adam", consistency: str = "async", shards: int = 1,
            workers: tuple[str, ...] = ("cpu0",), ps_extra: str = "", node_extra: str = "",
            train_extra: str = "", samples: int = 2000) -> Path:
    """A click job with a row-sparse table of ``FIELDS * BUCKETS`` rows of ``DIM`` (chunks of 32 rows) on
    loopback; shard ports fixed so that tests can dial them."""
    text = f"""
[job]
name = "sparse"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end
join_timeout_s = 60

[model]
name = "click_model"
args = {{ fields = {FIELDS}, buckets = {BUCKETS}, dim = {DIM}, hidden = [16], sparse = true }}

[data]
kind = "click"
samples = {samples}
args = {{ fields = {FIELDS}, buckets = {BUCKETS} }}

[optimizer]
{OPTIMIZERS[optimizer]}

[train]
consistency = "{consistency}"
batch_size = 32
epochs = 2
target_accuracy = 0.0
max_seconds = 60
eval_every_s = 0.5
report_interval_s = 0.3
{train_extra}

[ps]
chunk_bytes = 1024
table_chunk_bytes = 0  # the tables too: several chunks per table, on both shards
checkpoint_dir = "{tmp / 'ckpt'}"
{ps_extra}

[shm]
enabled = false

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"
"""
    for i in range(shards):
        text += f'\n[[nodes]]\nid = "ps{i}"\nrole = "ps"\nbind = "tcp://127.0.0.1:{free_port()}"\n'
    for w in workers:
        text += f'\n[[nodes]]\nid = "{w}"\nrole = "cpu_worker"\nbatch_size = 32\n{node_extra}\n'
    path = tmp / "job.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ the report's schema
REPORT_SCHEMA = json.loads(SCHEMA.read_text())
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def schema_errors(value, schema: dict, where: str = "report") -> list[str]:
    """What of ``value`` breaks ``schema``: the JSON Schema subset docs/report.schema.json uses (type, enum,
    required, properties, patternProperties, additionalProperties, items), by hand (no jsonschema here)."""
    import re

    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types

        def fits(t: str) -> bool:
            if t == "integer":
                return isinstance(value, int) and not isinstance(value, bool) or (
                    isinstance(value, float) and value.is_integer())
            if t == "number":
                return isinstance(value, (int, float)) and not isinstance(value, bool)
            return isinstance(value, TYPES[t])

        if not any(fits(t) for t in types):
            return [f"{where}: {type(value).__name__} {value!r:.60}, expected {types}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not one of {schema['enum']}")
    if isinstance(value, dict):
        errors += [f"{where}: lacks {k!r}" for k in schema.get("required", ()) if k not in value]
        props, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            sub = props.get(k) or next((p for pat, p in patterns.items() if re.search(pat, k)), None)
            if sub is None:
                if extra is False:
                    errors.append(f"{where}: key {k!r} is not in the schema (document it: docs/report.md)")
                    continue
                sub = extra if isinstance(extra, dict) else {}
            errors += schema_errors(v, sub, f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errors += schema_errors(v, schema["items"], f"{where}[{i}]")
    return errors


# ------------------------------------------------------------------------------ a user's model file
USER_MODELS = """
import torch
from torch import nn


class TwoTower(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.left, self.right = nn.Linear(64, width), nn.Linear(64, width)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x):
        return self.head(torch.cat([self.left(x).relu(), self.right(x).tanh()], 1))


def make(width=8):
    return TwoTower(width)
"""


# ------------------------------------------------------------------------------------- config texts
GOOD_CONFIG = """
[train]
consistency = "sync"
[[nodes]]
id = "s"
role = "scheduler"
bind = "tcp://127.0.0.1:5999"
[[nodes]]
id = "p"
role = "ps"
[[nodes]]
id = "w"
role = "cpu_worker"
"""


# --------------------------------------------------------------------------------------- CURVE keys


def curve_keys(folder: Path, *names: str, clients: tuple[str, ...] = ()) -> Path:
    from hmp.keygen import main as keygen

    argv = [str(folder), "--nodes", *names]
    for c in clients:
        argv += ["--client", c]
    assert keygen(argv) == 0
    return folder


# -------------------------------------------------------------------------- a small Hogwild problem


def small_problem(n: int = 256):
    """``[n, 8]`` features and ``[n]`` labels in 3 classes that a linear map of X predicts."""
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(n, 8, generator=gen)
    return X, (X @ torch.randn(8, 3, generator=gen)).argmax(1)


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
