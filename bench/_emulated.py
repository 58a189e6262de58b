"""All-reduce on emulated hosts (part (b) of bench/allreduce.py): hmp's ring, gloo and hmp's PS on
``hosts`` network namespaces joined by ``mbit`` links (hmp.emulate), each as a fraction of the
bandwidth-optimal time.

Setup. :class:`hmp.emulate.EmulatedHosts` makes ``hosts`` hosts (default 4) on one bridge, every
link shaped with tbf to ``mbit`` (default 1000 Mbit/s) in each direction, no delay (the kernel here
has no netem). Every process below runs inside its host's namespace (``EmulatedHosts.popen``), so
whatever crosses hosts crosses its sender's and its receiver's shaped link; the driver talks to
each process over its stdin/stdout (JSON lines). Peers, every process started once:

* ``ring``: one member per host, ``python bench/_emulated.py --member ring``: a hmp ``Server``
  on ``tcp://<host address>:47310`` routing ``Kind.RING`` to a ``RingHost``, and a
  :class:`hmp.collective.Ring` over the members' servers (``tune_malloc()`` first, as daemons do);
* ``gloo``: one process per host, ``torch.distributed`` gloo (``init_method tcp://<h0>:47320``,
  ``GLOO_SOCKET_IFNAME=eth0``), ``all_reduce`` (sum);
* ``ps``: a scheduler daemon on h0 and one PS shard daemon per host (``python -m hmp.nodes.main
  ps``, sync consistency, SGD, 1 MiB chunks, a quarter of them each), and one worker process per
  host doing ``PSClient.push`` rounds of the same S bytes (a ``deep_mlp`` of exactly S bytes of
  float32 parameters). Every worker sends (N-1)/N of S to the other hosts' shards and gets as much
  back, and every shard receives and returns as much for the other hosts' workers, so each link
  carries 2 (N-1)/N S each way, like the ring. The worker's own shard is on its host: that quarter
  goes through shared memory (the hmp default; emulated hosts count as different hosts for it).

Every process sets ``torch.set_num_threads(1)``.

Method. Once, before the peers start: a raw TCP stream (python sockets) h0 -> h1, and the ring's
pattern (h_i -> h_i+1, all at once), to measure what a link carries. Then ``repeats`` cycles of one
block per peer in the order ring, gloo, ps, reversed every other cycle (gloo is next to both). A
block: ``warm`` untimed all-reduces (push rounds), a start signal to every process, then ``rounds``
timed ones; each process records when each op ended (CLOCK_MONOTONIC, shared by every namespace),
and op k's time is the last member's end of op k less the last member's end of op k-1 (the last
start for the first). ``median_s`` is the median over every timed op of every block;
``fraction_of_optimal = optimal_s / median_s`` with ``optimal_s = 2 (N-1)/N * S * 8 / B`` and B the
configured rate; ``fraction_of_measured_link`` the same against the measured single-stream rate.

The machine has few cores: 4 hosts x (ring + gloo + PS) processes share them, and the kernel's
work for the veths, the bridge and tbf runs on them too. The output says how busy the CPUs were
during each peer's blocks (``busy_cpus``, out of ``cpus``) and the CPU seconds per op of each peer's
processes.

    python bench/_emulated.py [--json] [--quick] [--mib 16] [--hosts 4] [--mbit 1000]
                              [--repeats N] [--rounds N] [--piece-bytes B] [--window N]
                              [--algorithm auto|ring|halving]

Result: ``{"hosts", "mbit", "size_bytes", "optimal_s", "link", "ring", "gloo", "ps", ...}``, each peer with
``median_s``, ``fraction_of_optimal``, ``fraction_of_measured_link`` and their spreads; bench/allreduce.py
puts it under ``emulated`` (``emulated.ring.fraction_of_optimal``, target >= 0.85) unless ``--skip-emulated``.
Needs root (network namespaces); without, the result is ``{"skipped": "<reason>"}``. Everything
started (processes, namespaces) is removed at the end, on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
_BENCH = str(Path(__file__).resolve().parent)
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)

from _stats import CpuMeter, alternate, cpu_line, fmt_spread, is_quiet, load_average, quantile, spread  # noqa: E402

from hmp.collective.ring import ALGORITHMS  # noqa: E402
from hmp.emulate import EmulatedHosts, EmulationUnavailable, HostSpec  # noqa: E402

MiB = 1 << 20
PEERS = ("ring", "gloo", "ps")
TARGET_RING = 0.85
SUBNET = "10.231.23.0/24"  # namespaces are private: this only has to be unused in the machine's own namespace
PORT = {"ring": 47310, "gloo": 47320, "scheduler": 47330, "ps": 47331, "link": 47340}
START_TIMEOUT_S = 300.0  # every process imports torch at once on a few cores
REPLY_TIMEOUT_S = 180.0
CHUNK_BYTES = MiB


def optimal_seconds(size_bytes: int, hosts: int, mbit: float) -> float:
    """The bandwidth-optimal all-reduce time: each host sends (and receives) 2 (N-1)/N of S at B."""
    return 2 * (hosts - 1) / hosts * size_bytes * 8 / (mbit * 1e6)


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # system-wide: comparable between the hosts' processes


# ============================================================================ member processes

class _IO:
    """A member's side of the driver's pipe: JSON lines on a private copy of stdout (whatever else
    writes to stdout, a library's print, goes to stderr, the member's log)."""

    def __init__(self) -> None:
        fd = os.dup(1)
        os.dup2(2, 1)
        self.out = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self.out.write(json.dumps(obj) + "\n")
            self.out.flush()

    def recv(self) -> dict[str, Any]:
        line = sys.stdin.readline()
        return json.loads(line) if line.strip() else {"cmd": "stop"}  # EOF: the driver is gone


async def _serve(io: _IO, op: Callable[[], Any], reset: Callable[[], None]) -> None:
    """Blocks on the driver's command: ``run`` (warm untimed ops, ``warmed``, wait for ``go``, the
    timed ops with each one's end time) until ``stop``. Commands are read off the event loop, so a
    member's server keeps answering meanwhile."""
    loop = asyncio.get_running_loop()

    async def recv() -> dict[str, Any]:
        return await loop.run_in_executor(None, io.recv)

    while True:
        cmd = await recv()
        if cmd["cmd"] == "stop":
            return
        if cmd["cmd"] != "run":
            raise ValueError(f"unknown command {cmd!r}")
        reset()
        for _ in range(cmd["warm"]):
            await op()
        io.send({"warmed": True})
        go = await recv()
        if go["cmd"] != "go":
            raise ValueError(f"expected go, got {go!r}")
        t_go, ends = _now(), []
        for _ in range(cmd["rounds"]):
            await op()
            ends.append(_now())
        io.send({"t_go": t_go, "ends": ends})


def _member_ring(io: _IO, spec: dict[str, Any]) -> None:
    import torch
    import uvloop

    torch.set_num_threads(1)
    from hmp.collective import Ring, RingHost
    from hmp.messages import Kind
    from hmp.transport.endpoint import Server, tune_malloc

    tune_malloc()  # as daemons do: received frames reuse memory
    rank, addrs, port = spec["rank"], spec["addrs"], spec["port"]

    async def main() -> None:
        host = RingHost(timeout_s=REPLY_TIMEOUT_S)
        server = Server(f"tcp://{addrs[rank]}:{port}", {Kind.RING: host.on_piece}, name=f"ring{rank}")
        await server.start()
        opts = {"piece_bytes": spec["piece_bytes"]} if spec["piece_bytes"] else {}  # None: the ring's default
        ring = Ring(rank=rank, addresses=[f"tcp://{a}:{port}" for a in addrs], generation=1, name=f"ring{rank}",
                    timeout_s=REPLY_TIMEOUT_S, window=spec["window"], algorithm=spec["algorithm"], **opts)
        await ring.connect()
        host.install(ring)
        t = torch.empty(spec["numel"], dtype=torch.float32)
        op = 0

        async def one() -> None:
            nonlocal op
            await ring.all_reduce(t, op)
            op += 1

        io.send({"ready": True, "piece_bytes": ring.piece_bytes, "window": ring.window})
        await _serve(io, one, lambda: t.fill_(1e-3))
        io.send({"stats": dict(ring.stats)})
        await ring.close()
        await server.close()

    uvloop.run(main())


def _member_gloo(io: _IO, spec: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    addrs = spec["addrs"]
    dist.init_process_group("gloo", init_method=f"tcp://{addrs[0]}:{spec['port']}", rank=spec["rank"],
                            world_size=len(addrs), timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))
    t = torch.empty(spec["numel"], dtype=torch.float32)
    dist.all_reduce(t.fill_(0.0))  # connections up before "ready"
    io.send({"ready": True})

    async def one() -> None:
        dist.all_reduce(t)

    asyncio.run(_serve(io, one, lambda: t.fill_(1e-3)))
    io.send({"stats": {}})
    dist.destroy_process_group()


def _member_ps(io: _IO, spec: dict[str, Any]) -> None:
    import torch
    import uvloop

    torch.set_num_threads(1)
    from hmp.client import PSClient
    from hmp.config import load

    async def main() -> None:
        cfg = load(spec["config"])
        async with PSClient.from_config(cfg, [tuple(s) for s in spec["shards"]], name=spec["name"]) as ps:
            for g in ps.sharded.flat.grads.values():
                g.fill_(1e-4)  # a plausible gradient; SGD keeps the values finite and normal
            await ps.pull()  # waits until every shard serves
            report = ps.sharded.report()
            io.send({"ready": True, "chunks_per_shard": [len(k) for k in ps.sharded.assignment.values()],
                     "imbalance": round(report.imbalance, 3), "shm": ps.arena is not None})

            async def one() -> None:
                await ps.push(samples=1)

            await _serve(io, one, lambda: None)
            io.send({"stats": {}})
            await ps.leave("bench done")

    uvloop.run(main())


def _member_sink(io: _IO, spec: dict[str, Any]) -> None:
    """Accept one connection, count its bytes until EOF; report the rate from first to last byte."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((spec["bind"], spec["port"]))
        s.listen(1)
        io.send({"ready": True})
        c, _ = s.accept()
        with c:
            buf = bytearray(4 * MiB)
            n, t0, t1 = 0, None, None
            while True:
                k = c.recv_into(buf)
                if not k:
                    break
                t1 = _now()
                t0 = t0 or t1
                n += k
    io.send({"bytes": n, "seconds": (t1 or 0.0) - (t0 or 0.0), "t0": t0, "t1": t1})


def _member_source(io: _IO, spec: dict[str, Any]) -> None:
    io.send({"ready": True})
    if io.recv()["cmd"] != "go":
        return
    payload = b"x" * (4 * MiB)
    with socket.create_connection((spec["connect"], spec["port"]), timeout=60) as s:
        left = spec["bytes"]
        while left > 0:
            k = min(left, len(payload))
            s.sendall(memoryview(payload)[:k])
            left -= k
    io.send({"sent": spec["bytes"]})


MEMBERS = {"ring": _member_ring, "gloo": _member_gloo, "ps": _member_ps, "sink": _member_sink,
           "source": _member_source}


def member_main(kind: str, spec_json: str) -> int:
    io = _IO()
    try:
        MEMBERS[kind](io, json.loads(spec_json))
    except BaseException:  # the driver must hear of it instead of waiting for a timeout
        with contextlib.suppress(OSError):
            io.send({"error": traceback.format_exc()})
        return 1
    return 0


# ============================================================================ driver side

def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


class _Proc:
    """A process inside an emulated host: stdin/stdout JSON lines, stderr to a log file."""

    def __init__(self, hosts: EmulatedHosts, host: str, name: str, argv: list[str], log_dir: Path,
                 env: dict[str, str], pipe: bool = True) -> None:
        self.name, self.host = name, host
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self._buf = b""
        io = subprocess.PIPE if pipe else subprocess.DEVNULL
        self.proc = hosts.popen(host, argv, stdin=io, stdout=io if pipe else self._log, stderr=self._log, env=env,
                                cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, obj: Any) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self.died() from None

    def died(self) -> RuntimeError:
        code = self.proc.poll()
        return RuntimeError(f"{self.name} (on {self.host}) exited with code {code}; its log ends:\n"
                            f"{textwrap.indent(_tail(self.log_path), '  | ')}")

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise self.died()

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def line(self) -> dict[str, Any] | None:
        """A complete line already read, parsed; None if none yet."""
        if b"\n" not in self._buf:
            return None
        raw, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(raw)
        if "error" in msg:
            raise RuntimeError(f"{self.name} (on {self.host}) failed:\n{msg['error']}")
        return msg

    def feed(self) -> None:
        chunk = os.read(self.fileno(), 1 << 16)
        if not chunk:
            raise self.died()
        self._buf += chunk

    def close(self) -> None:
        self._log.close()


def _gather(procs: Sequence[_Proc], timeout_s: float, watch: Sequence[_Proc] = ()) -> list[dict[str, Any]]:
    """One message from each of ``procs``; fails at once if any of them, or of ``watch`` (daemons),
    exits, and after ``timeout_s`` without every message."""
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs):
        for i, p in enumerate(procs):
            if i not in got:
                msg = p.line()
                if msg is not None:
                    got[i] = msg
        if len(got) == len(procs):
            break
        for w in watch:
            w.check()
        left = deadline - time.monotonic()
        if left <= 0:
            late = [p.name for i, p in enumerate(procs) if i not in got]
            raise TimeoutError(f"no answer from {late} within {timeout_s} s")
        ready, _, _ = select.select([p for i, p in enumerate(procs) if i not in got], [], [], min(1.0, left))
        for p in ready:
            p.feed()
    return [got[i] for i in range(len(procs))]


def _cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of every thread of ``pids`` so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, NotADirectoryError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])
    return total / tick


def _machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, wall seconds) of the whole machine so far, all CPUs (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    fields += [0] * (8 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, _steal = fields[:8]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK"), time.monotonic()


def _net_counters(emu: EmulatedHosts) -> tuple[int, int, int]:
    """(packets the shapers dropped, TCP segments retransmitted, TCP retransmission timeouts) so far,
    over every host and the bridge. A full tbf queue drops; TCP then retransmits, after a timeout
    (>= 200 ms: a stall) when the loss is at the end of a burst; tail loss probes count as
    retransmits too."""
    drops = retrans = timeouts = 0
    for ns in [emu.switch, *(h.netns for h in emu.hosts.values())]:
        out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show"], capture_output=True, text=True,
                             timeout=30).stdout
        drops += sum(q.get("drops", 0) for q in json.loads(out or "[]") if q.get("kind") == "tbf")
    for h in emu.hosts.values():
        text = subprocess.run(["ip", "netns", "exec", h.netns, "cat", "/proc/net/snmp", "/proc/net/netstat"],
                              capture_output=True, text=True, timeout=30).stdout.splitlines()
        counters: dict[str, int] = {}
        for keys, values in zip(text[::2], text[1::2]):  # "Tcp: names..." then "Tcp: numbers..."
            prefix = keys.split(":")[0]
            for k, v in zip(keys.split()[1:], values.split()[1:]):
                with contextlib.suppress(ValueError):
                    counters[f"{prefix}.{k}"] = int(v)
        retrans += counters.get("Tcp.RetransSegs", 0)
        timeouts += counters.get("TcpExt.TCPTimeouts", 0)
    return drops, retrans, timeouts


class _Peer:
    """One peer's processes (``members``: the ones timed, one per host; ``daemons``: watched)."""

    def __init__(self, name: str, emu: EmulatedHosts, members: list[_Proc], daemons: list[_Proc] | None = None) -> None:
        self.name, self.emu, self.members, self.daemons = name, emu, members, daemons or []
        self.op_s: list[float] = []
        self.block_s: list[float] = []
        self.cpu_s: list[float] = []
        self.busy: list[float] = []
        self.drops: list[float] = []
        self.retrans: list[float] = []
        self.timeouts: list[float] = []
        self.info: list[dict[str, Any]] = []
        self.stats: list[dict[str, Any]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.members + self.daemons]

    def reset(self) -> None:
        for xs in (self.op_s, self.block_s, self.cpu_s, self.busy, self.drops, self.retrans, self.timeouts):
            xs.clear()

    def block(self, warm: int, rounds: int) -> None:
        for p in self.members:
            p.send({"cmd": "run", "warm": warm, "rounds": rounds})
        _gather(self.members, REPLY_TIMEOUT_S, self.daemons)
        n0 = _net_counters(self.emu)
        c0, (b0, w0) = _cpu_seconds(self.pids), _machine_busy()
        for p in self.members:
            p.send({"cmd": "go"})
        res = _gather(self.members, REPLY_TIMEOUT_S, self.daemons)
        c1, (b1, w1) = _cpu_seconds(self.pids), _machine_busy()
        n1 = _net_counters(self.emu)
        self.drops.append((n1[0] - n0[0]) / rounds)
        self.retrans.append((n1[1] - n0[1]) / rounds)
        self.timeouts.append((n1[2] - n0[2]) / rounds)
        start = max(r["t_go"] for r in res)
        ends = [max(r["ends"][k] for r in res) for k in range(rounds)]
        ops = [b - a for a, b in zip([start, *ends], ends)]
        self.op_s += ops
        self.block_s.append((ends[-1] - start) / rounds)
        self.cpu_s.append((c1 - c0) / rounds)
        self.busy.append((b1 - b0) / (w1 - w0))

    def stop(self, timeout_s: float = 20.0) -> None:
        """Ask the members to finish (best effort: close() removes whatever is left)."""
        live = [p for p in self.members if p.proc.poll() is None]
        for p in live:
            with contextlib.suppress(RuntimeError):
                p.send({"cmd": "stop"})
        with contextlib.suppress(RuntimeError, TimeoutError, ValueError, OSError):
            self.stats = [r.get("stats", {}) for r in _gather(live, timeout_s)]
        deadline = time.monotonic() + timeout_s
        for p in live:  # let them exit on their own (a PS worker tells its shards it leaves, frees its arena)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))


PS_JOB = f"bench-emulated-ps-{os.getpid()}"  # the PS processes' shared-memory segments are named after it


def _ps_config(folder: Path, addrs: list[str], numel: int) -> Path:
    """A sync PS job: scheduler on h0, shard ps<i> and worker w<i> on host i; the model is one
    Linear(numel / 1024 - 1, 1024) with its bias: exactly numel float32 parameters."""
    model = {"in_features": numel // 1024 - 1, "width": 1, "depth": 0, "classes": 1024}
    args = ", ".join(f"{k} = {v}" for k, v in model.items())
    text = textwrap.dedent(f"""\
        [job]
        name = "{PS_JOB}"
        report_dir = "{folder / 'run'}"
        heartbeat_interval_s = 0.5
        join_timeout_s = 3600
        log_format = "json"

        [model]
        name = "deep_mlp"
        args = {{ {args} }}
        seed = 0

        [data]
        kind = "digits"

        [optimizer]
        name = "sgd"
        lr = 0.01
        momentum = 0.9

        [train]
        consistency = "sync"
        batch_size = 32
        max_seconds = 3600

        [limits]
        request_timeout_s = {REPLY_TIMEOUT_S}

        [ps]
        chunk_bytes = {CHUNK_BYTES}
        checkpoint_dir = "{folder / 'ckpt'}"
        """)
    text += (f'\n[[nodes]]\nid = "scheduler"\nrole = "scheduler"\nhost = "h0"\n'
             f'bind = "tcp://{addrs[0]}:{PORT["scheduler"]}"\n')
    for i, a in enumerate(addrs):
        text += f'\n[[nodes]]\nid = "ps{i}"\nrole = "ps"\nhost = "h{i}"\nbind = "tcp://{a}:{PORT["ps"]}"\n'
    for i in range(len(addrs)):
        text += f'\n[[nodes]]\nid = "w{i}"\nrole = "cpu_worker"\nhost = "h{i}"\n'
    path = folder / "ps.toml"
    path.write_text(text)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _member(hosts: EmulatedHosts, host: str, name: str, kind: str, spec: dict[str, Any], log_dir: Path,
            **env: str) -> _Proc:
    argv = [sys.executable, str(Path(__file__).resolve()), "--member", kind, "--spec", json.dumps(spec)]
    return _Proc(hosts, host, name, argv, log_dir, _env(**env))


def _link(hosts: EmulatedHosts, names: list[str], log_dir: Path, nbytes: int) -> dict[str, Any]:
    """Raw TCP streams (python sockets): h0 -> h1 alone, then h_i -> h_i+1 all at once (the ring's
    pattern: every link carries one stream each way). Mbit/s of payload, first to last byte."""
    out: dict[str, Any] = {"bytes": nbytes}
    for label, pairs in (("single", [(names[0], names[1])]),
                         ("ring_pattern", [(names[i], names[(i + 1) % len(names)]) for i in range(len(names))])):
        sinks = [_member(hosts, dst, f"sink-{label}-{dst}", "sink", {"bind": hosts.address(dst), "port": PORT["link"]},
                         log_dir) for _, dst in pairs]
        sources = [_member(hosts, src, f"source-{label}-{src}", "source",
                           {"connect": hosts.address(dst), "port": PORT["link"], "bytes": nbytes}, log_dir)
                   for src, dst in pairs]
        try:
            _gather(sinks + sources, 60)
            for s in sources:
                s.send({"cmd": "go"})
            res = _gather(sinks, 120)
            _gather(sources, 60)
        finally:
            for p in sinks + sources:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(timeout=10)
                p.close()
        rates = [r["bytes"] * 8 / r["seconds"] / 1e6 for r in res]
        if label == "single":
            out["single_stream_mbit"] = round(rates[0], 1)
        else:
            out["ring_pattern_mbit"] = {"min": round(min(rates), 1), "median": round(quantile(rates, 0.5), 1),
                                        "max": round(max(rates), 1), "streams": len(rates)}
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_emulated(size_bytes: int = 16 * MiB, hosts: int = 4, mbit: float = 1000.0, repeats: int | None = None,
                 quick: bool = False, rounds: int | None = None, warm: int = 1, piece_bytes: int | None = None,
                 window: int | None = None, log: Callable[[str], None] | None = None,
                 algorithm: str = "auto") -> dict[str, Any]:
    """Ring, gloo and PS all-reduces of ``size_bytes`` of float32 on ``hosts`` emulated hosts with
    ``mbit`` links: ``repeats`` alternating cycles (one block of ``warm`` untimed + ``rounds`` timed
    ops per peer each; defaults 6 x 5, ``quick`` 2 x 3). ``{"skipped": reason}`` where network
    namespaces cannot be created. ``piece_bytes``, ``window``, ``algorithm``: the ring's (None: its defaults, as a
    job's). ``log``: progress lines (default: stderr)."""
    if log is None:
        def log(line: str) -> None:
            print(f"[emulated] {line}", file=sys.stderr, flush=True)
    if size_bytes % 4096 or size_bytes < 8192:
        raise ValueError(f"size_bytes must be a multiple of 4096 (the PS model: numel / 1024 - 1 inputs), "
                         f"at least 8192, got {size_bytes}")
    if hosts < 2:
        raise ValueError(f"hosts must be >= 2, got {hosts}")
    repeats = repeats or (2 if quick else 6)
    rounds = rounds or (3 if quick else 5)
    numel = size_bytes // 4
    optimal_s = optimal_seconds(size_bytes, hosts, mbit)
    names = [f"h{i}" for i in range(hosts)]
    emu = EmulatedHosts([HostSpec(n, bandwidth_mbit=mbit, delay_ms=0.0) for n in names], SUBNET)
    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM cleans up like Ctrl-C
    peers: dict[str, _Peer] = {}
    procs: list[_Proc] = []
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t_start = time.perf_counter()
    try:
        try:
            emu.start()
        except EmulationUnavailable as exc:
            return {"skipped": str(exc)}
        with tempfile.TemporaryDirectory(prefix="hmp-bench-emulated-") as d:
            tmp = Path(d)
            logs = tmp / "logs"
            logs.mkdir()
            addrs = [emu.address(n) for n in names]
            log(f"{hosts} hosts {addrs} at {mbit:g} Mbit/s; measuring the links")
            link = _link(emu, names, logs, (64 if quick else 125) * 1_000_000)
            log(f"link: {link}")
            t_setup = time.perf_counter()
            common = {"addrs": addrs, "numel": numel}
            ring = [_member(emu, n, f"ring-{n}", "ring", {**common, "rank": i, "port": PORT["ring"],
                                                            "piece_bytes": piece_bytes, "window": window,
                                                            "algorithm": algorithm}, logs)
                    for i, n in enumerate(names)]
            gloo = [_member(emu, n, f"gloo-{n}", "gloo", {**common, "rank": i, "port": PORT["gloo"]}, logs,
                            GLOO_SOCKET_IFNAME="eth0") for i, n in enumerate(names)]
            cfg = _ps_config(tmp, addrs, numel)
            daemons = [_Proc(emu, names[0], "scheduler", [sys.executable, "-m", "hmp.nodes.main", "scheduler",
                                                          "--config", str(cfg), "--id", "scheduler"],
                             logs, _env(), pipe=False)]
            daemons += [_Proc(emu, n, f"ps{i}", [sys.executable, "-m", "hmp.nodes.main", "ps", "--config", str(cfg),
                                                 "--id", f"ps{i}"], logs, _env(), pipe=False)
                        for i, n in enumerate(names)]
            shards = [[f"ps{i}", f"tcp://{a}:{PORT['ps']}"] for i, a in enumerate(addrs)]
            ps = [_member(emu, n, f"ps-w{i}", "ps", {"config": str(cfg), "shards": shards, "name": f"w{i}"}, logs)
                  for i, n in enumerate(names)]
            procs = ring + gloo + daemons + ps
            peers = {"ring": _Peer("ring", emu, ring), "gloo": _Peer("gloo", emu, gloo),
                     "ps": _Peer("ps", emu, ps, daemons)}
            for p in peers.values():
                p.info = _gather(p.members, START_TIMEOUT_S, daemons)
            setup_s = time.perf_counter() - t_setup
            log(f"every process ready after {setup_s:.1f} s; warm-up")
            for p in peers.values():  # buffers, page faults, connections: before anything is timed
                p.block(1, 2)
                p.reset()
            order = list(PEERS)
            for cycle in range(repeats):
                for name in alternate(order, cycle):
                    peers[name].block(warm, rounds)
                log(f"cycle {cycle + 1}/{repeats}: " + ", ".join(
                    f"{n} {1e3 * peers[n].block_s[-1]:.0f} ms/op" for n in order))
            for p in peers.values():
                p.stop()
            ps_info = peers["ps"].info[0]
            for p in procs:
                p.close()
    except KeyboardInterrupt:
        log("interrupted: removing every process and namespace")
        raise
    finally:
        for p in peers.values():
            for m in p.members:
                with contextlib.suppress(Exception):
                    m.proc.stdin.close()
        emu.close()
        for p in procs:
            p.close()
        if peers:  # segments of PS processes that were killed (the others removed their own)
            from hmp.transport.shm import cleanup_stale

            cleanup_stale(PS_JOB)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    wall_s = time.perf_counter() - t_start
    cpu = meter.stop()
    link_mbit = link["single_stream_mbit"]
    optimal_link_s = optimal_seconds(size_bytes, hosts, link_mbit)
    res: dict[str, Any] = {
        "hosts": hosts, "mbit": mbit, "size_bytes": size_bytes, "dtype": "float32",
        "optimal_s": round(optimal_s, 4), "optimal_at_measured_link_s": round(optimal_link_s, 4),
        "bytes_per_host_each_way": int(2 * (hosts - 1) / hosts * size_bytes),
        "link": link,
    }
    link_note = None
    if link_mbit < 0.97 * mbit:
        link_note = (f"a raw TCP stream carries {link_mbit:.0f} Mbit/s of payload over a {mbit:g} Mbit/s link "
                     f"({link_mbit / mbit:.1%}); tbf counts every byte on the wire (Ethernet, IP and TCP headers: "
                     f"payload is at most 1448/1514 = 95.6% of it at MTU 1500; its burst, 4 ms of traffic, "
                     f"lets a stream's first bytes through at once, so a stream may measure a little above that)")
    res["link"]["note"] = link_note
    for name, p in peers.items():
        med = quantile(p.op_s, 0.5)
        r: dict[str, Any] = {
            "median_s": round(med, 4),
            "fraction_of_optimal": round(optimal_s / med, 3),
            "fraction_of_measured_link": round(optimal_link_s / med, 3),
            "fraction_of_optimal_spread": spread([optimal_s / t for t in p.op_s]),
            "op_ms": spread([1e3 * t for t in p.op_s], 1),
            "block_ms": spread([1e3 * t for t in p.block_s], 1),
            "busbw_mbit": round(2 * (hosts - 1) / hosts * size_bytes * 8 / med / 1e6, 1),
            "cpu_s_per_op": round(quantile(p.cpu_s, 0.5), 3),
            "busy_cpus": round(quantile(p.busy, 0.5), 2),
            "tbf_drops_per_op": round(sum(p.drops) / len(p.drops), 1),
            "tcp_retransmits_per_op": round(sum(p.retrans) / len(p.retrans), 1),
            "tcp_timeouts_per_op": round(sum(p.timeouts) / len(p.timeouts), 2),
        }
        if name != "ring" and p.block_s and len(p.block_s) == len(peers["ring"].block_s):
            rs = [a / b for a, b in zip(p.block_s, peers["ring"].block_s)]
            r["time_vs_ring"] = round(quantile(rs, 0.5), 3)  # > 1: slower than the ring
            r["time_vs_ring_spread"] = spread(rs)
        res[name] = r
    ring_info = peers["ring"].info[0]
    res["ring"]["options"] = {"piece_bytes": ring_info.get("piece_bytes"), "window": ring_info.get("window")}
    if peers["ring"].stats:
        st = peers["ring"].stats[0]
        ops = max(1, st.get("ring_ops", 0) + st.get("halving_ops", 0))
        res["ring"]["bytes_sent_per_op_rank0"] = st.get("bytes_sent", 0) // ops
        # which one ran: "auto" takes the ring here (the hosts are apart); --algorithm halving forces the other
        res["ring"]["algorithm"] = "halving" if st.get("halving_ops") else "ring"
    res["ring"]["target"] = TARGET_RING
    res["ring"]["meets_target"] = res["ring"]["fraction_of_optimal"] >= TARGET_RING
    res["ps"]["setup"] = {"consistency": "sync", "chunk_bytes": CHUNK_BYTES,
                          "chunks_per_shard": ps_info.get("chunks_per_shard"), "imbalance": ps_info.get("imbalance"),
                          "shared_memory_to_own_shard": ps_info.get("shm"), "scheduler": "h0"}
    res.update({
        "method": (f"{repeats} cycles of one block per peer (order {' '.join(PEERS)}, reversed every other cycle), "
                   f"a block {warm} untimed + {rounds} timed ops; op time from the last member's end times"),
        "repeats": repeats, "rounds_per_block": rounds, "warm_per_block": warm, "setup_s": round(setup_s, 1),
        "load_avg_before": load_before, "load_avg_after": load_average(), "cpu_during_run": cpu,
        "quiet": is_quiet(cpu), "wall_s": round(wall_s, 1),
    })
    return res


def report_lines(res: dict[str, Any]) -> list[str]:
    """The result as table lines (bench/allreduce.py prints them too)."""
    if "skipped" in res:
        return [f"emulated hosts: skipped: {res['skipped']}"]
    link = res["link"]
    rp = link.get("ring_pattern_mbit", {})
    lines = [
        f"(b) emulated hosts: {res['hosts']} hosts, {res['mbit']:g} Mbit/s links (tbf), all-reduce of "
        f"{res['size_bytes'] / MiB:g} MiB float32; optimal 2(N-1)/N*S/B = {1e3 * res['optimal_s']:.1f} ms",
        f"  link: one raw TCP stream {link['single_stream_mbit']:.0f} Mbit/s; ring pattern ({rp.get('streams')} "
        f"streams at once) {rp.get('min')}..{rp.get('max')} Mbit/s each",
    ]
    if link.get("note"):
        lines.append(f"  note: {link['note']}; fraction_of_measured_link is against that rate")
    lines.append(f"  {'peer':<6}{'ms/op':>8}{'frac. of optimal':>18}{'of measured link':>18}{'busbw Mbit/s':>14}"
                 f"{'CPU s/op':>10}{'busy CPUs':>11}{'drops/op':>10}{'retrans/op':>12}{'RTOs/op':>9}")
    for name in PEERS:
        r = res[name]
        lines.append(f"  {name:<6}{1e3 * r['median_s']:>8.1f}{r['fraction_of_optimal']:>18.3f}"
                     f"{r['fraction_of_measured_link']:>18.3f}{r['busbw_mbit']:>14.1f}{r['cpu_s_per_op']:>10.3f}"
                     f"{r['busy_cpus']:>8.2f}/{(res.get('cpu_during_run') or {}).get('cpus', '?')}"
                     f"{r['tbf_drops_per_op']:>10.1f}{r['tcp_retransmits_per_op']:>12.1f}"
                     f"{r['tcp_timeouts_per_op']:>9.2f}")
    for name in PEERS:
        lines.append(f"  {name} fraction_of_optimal per op: {fmt_spread(res[name]['fraction_of_optimal_spread'])}")
    for name in ("gloo", "ps"):
        if "time_vs_ring_spread" in res[name]:
            lines.append(f"  {name} time / ring time, per cycle: {fmt_spread(res[name]['time_vs_ring_spread'])}")
    ring = res["ring"]
    lines.append(f"  ring fraction_of_optimal {ring['fraction_of_optimal']} (target >= {ring['target']}: "
                 f"{'met' if ring['meets_target'] else 'NOT met'}); ring options {ring['options']}")
    lines.append(f"  {res['method']}; set-up {res['setup_s']} s")
    lines.append("  " + cpu_line(res.get("cpu_during_run"), res["load_avg_before"], res["load_avg_after"],
                                 res["wall_s"]).replace("\n", "\n  "))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="fewer cycles and rounds")
    ap.add_argument("--mib", type=float, default=16, help="tensor size in MiB of float32")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--mbit", type=float, default=1000.0, help="each link's rate, each direction")
    ap.add_argument("--repeats", type=int, default=None, help="alternating cycles (one block per peer each)")
    ap.add_argument("--rounds", type=int, default=None, help="timed ops per block")
    ap.add_argument("--piece-bytes", type=int, default=None, help="the ring's piece size (default: the ring's)")
    ap.add_argument("--window", type=int, default=0, help="the ring's pieces in flight per op (0: unlimited)")
    ap.add_argument("--algorithm", default="auto", choices=ALGORITHMS,
                    help="the ring peer's algorithm (auto: the ring here, the hosts being apart)")
    ap.add_argument("--member", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.member:
        return member_main(args.member, args.spec)
    try:
        res = run_emulated(int(args.mib * MiB), args.hosts, args.mbit, args.repeats, args.quick, args.rounds,
                           piece_bytes=args.piece_bytes, window=args.window or None, algorithm=args.algorithm)
    except KeyboardInterrupt:
        return 130
    print("\n".join(report_lines(res)))
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
