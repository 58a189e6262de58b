"""Small statistics shared by the benchmarks: summaries, paired per-block ratios, machine load.

A benchmark that compares two peers runs them in short alternating blocks (A, B, B, A, A, B, ...)
with both peers' processes set up once; each pair of adjacent blocks gives one ratio, so that slow
drifts of the machine (frequency, other tenants, page cache) cancel within the pair. The headline
ratio is the median of those per-pair ratios; its spread (min, quartiles, max) says how far one
pair may stray, and the relative IQR how tight the median is.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A free loopback port for a daemon's config (the benches' one helper for it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_folder(name: str, out: str | Path | None) -> Path:
    """Where a benchmark writes its files (created): ``out``, else ``runs/bench/<name>-<timestamp>/``, so that a
    run changes no tracked file unless asked to (``--out docs`` redraws the docs' figures)."""
    folder = Path(out or Path(__file__).resolve().parents[1] / "runs" / "bench" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` with linear interpolation (numpy's default)."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of no values")
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """``{"n", "min", "p25", "median", "p75", "max"}`` of ``xs``, rounded to ``digits``."""
    xs = [float(x) for x in xs]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": round(min(xs), digits), "p25": round(quantile(xs, 0.25), digits),
            "median": round(quantile(xs, 0.5), digits), "p75": round(quantile(xs, 0.75), digits),
            "max": round(max(xs), digits)}


def spread(xs: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """:func:`summary` plus ``rel_iqr`` ((p75 - p25) / median) and ``rel_range`` ((max - min) / median)."""
    s = summary(xs, digits)
    if s["n"] and s["median"]:
        xs = [float(x) for x in xs]
        med = quantile(xs, 0.5)
        s["rel_iqr"] = round((quantile(xs, 0.75) - quantile(xs, 0.25)) / med, 3)
        s["rel_range"] = round((max(xs) - min(xs)) / med, 3)
    return s


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Element-wise ``num[i] / den[i]`` of two per-block series of the same length (paired blocks)."""
    if len(num) != len(den):
        raise ValueError(f"paired series differ in length: {len(num)} vs {len(den)}")
    return [a / b for a, b in zip(num, den)]


def alternate(order: Sequence[str], cycle: int) -> list[str]:
    """The peers' order in one cycle: as given in even cycles, reversed in odd ones.

    Peers listed next to each other stay next to each other (one pair of adjacent blocks per cycle)
    while each takes the first and the second place equally often, so that neither gains from
    coming first (warm caches, a just-idle core) or last.
    """
    return list(order) if cycle % 2 == 0 else list(reversed(order))


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def fmt_spread(s: dict[str, Any], fmt: str = ".3f") -> str:
    """``median [min .. max] (IQR p25-p75, n=N)`` for a table row."""
    if not s.get("n"):
        return "-"
    return (f"{s['median']:{fmt}} [{s['min']:{fmt}} .. {s['max']:{fmt}}] "
            f"(IQR {s['p25']:{fmt}}-{s['p75']:{fmt}}, n={s['n']})")


class CpuMeter:
    """How busy the machine was during a run, and how much of that was someone else.

    ``start()`` and ``stop()`` read /proc/stat (all CPUs) and this process's and its reaped
    children's CPU time (``os.times``). ``stop()`` returns CPUs' worth on average over the
    interval: ``busy_cpus`` (all user + system time), ``others_busy_cpus`` (the same less this
    benchmark's own processes: children count once reaped, so stop after joining them) and
    ``steal_cpus`` (time the hypervisor ran something else while a CPU here wanted to run).
    None where /proc/stat is missing.
    """

    def __init__(self) -> None:
        self._t0: tuple[float, ...] | None = None

    @staticmethod
    def _read() -> tuple[float, ...] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        fields += [0] * (8 - len(fields))
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return (user + nice + system + irq + softirq) / tick, steal / tick, own, time.monotonic()

    def start(self) -> None:
        self._t0 = self._read()

    def stop(self) -> dict[str, Any] | None:
        t1 = self._read()
        if self._t0 is None or t1 is None:
            return None
        busy, steal, own, wall = (b - a for a, b in zip(self._t0, t1))
        if wall <= 0:
            return None
        return {"busy_cpus": round(busy / wall, 2), "others_busy_cpus": round(max(0.0, busy - own) / wall, 2),
                "steal_cpus": round(steal / wall, 2), "cpus": os.cpu_count()}


QUIET_OTHERS_CPUS = 0.25  # CPUs' worth of other work above which a run does not count as quiet


def is_quiet(cpu: dict[str, Any] | None) -> bool | None:
    """Whether other work stayed under ``QUIET_OTHERS_CPUS`` during a run (None: unknown)."""
    return None if not cpu else cpu["others_busy_cpus"] <= QUIET_OTHERS_CPUS


def cpu_line(cpu: dict[str, Any] | None, load_before: Any, load_after: Any, wall_s: float) -> str:
    """One line on the machine's load during a run, with a warning when others kept it busy."""
    c = cpu or {}
    line = (f"load average before {load_before}, after {load_after}; CPUs busy during the run "
            f"{c.get('busy_cpus', '?')} of {c.get('cpus', '?')} (others than this benchmark: "
            f"{c.get('others_busy_cpus', '?')}; steal {c.get('steal_cpus', '?')}); {wall_s} s")
    if c.get("others_busy_cpus", 0.0) > QUIET_OTHERS_CPUS:
        line += (f"\nWARNING: other work kept {c['others_busy_cpus']} CPUs busy during this run: the machine was "
                 f"not quiet, and ratios measured under contention differ from quiet ones")
    return line


def guard(conn: Any, fn: Any) -> None:
    """Run ``fn`` in a benchmark's child process; an exception is sent to the driver over ``conn``."""
    try:
        fn()
    except BaseException:  # the driver must hear of it instead of waiting for a timeout
        with contextlib.suppress(OSError, BrokenPipeError):
            conn.send(("error", traceback.format_exc()))
        raise


class ProcessGroup:
    """``size`` spawned processes of one peer, started at once and driven block by block over pipes.

    Process ``rank`` runs ``target(*args_of(rank), conn, barrier)`` (the barrier spans the group) and
    answers each command sent to it with one object, or ``("error", traceback)`` (see :func:`guard`).
    ``close()`` asks every process to stop, then terminates and kills those that do not (bounded)."""

    def __init__(self, name: str, target: Any, args_of: Any, size: int = 2, timeout_s: float = 300.0) -> None:
        import multiprocessing as mp

        self.name, self.size, self.timeout_s = name, size, timeout_s
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(size)
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(*args_of(rank), child, self.barrier), daemon=True,
                            name=f"{name}-{size}-{rank}")
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def _recv(self, conn: Any, timeout_s: float | None = None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer from a process in {timeout_s} s")
        reply = conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"{self.name} process failed:\n{reply[1]}")
        return reply

    def ready(self) -> None:
        for c in self.conns:
            self._recv(c)

    def ask(self, *cmd: Any) -> list[Any]:
        """Send ``cmd`` to every process; their answers in rank order."""
        for c in self.conns:
            c.send(cmd)
        return [self._recv(c) for c in self.conns]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("stop",))
        for p in self.procs:
            p.join(timeout=15)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
