"""All-reduce benchmark: hmp's ring (hmp.collective) against torch.distributed gloo, one host.

Peers, each a group of ``P`` processes started once per process count and driven block by block
over pipes (house style: bench/_stats.py):
  * ``gloo``: ``torch.distributed`` with the gloo backend over loopback TCP, ``all_reduce`` (sum);
  * ``ring_tcp``: :class:`hmp.collective.Ring` over hmp's TCP transport, each process a
    ``Server`` routing ``Kind.RING`` to a ``RingHost`` (as a daemon would), ``tune_malloc()``
    first (as daemons do). Its algorithm is the one hmp picks: the ring, or recursive
    halving-doubling for 4 (a power of two) processes on one host (``<case>.ring_tcp_algorithm``);
  * ``ring_only_tcp`` (4 processes only): the same with ``algorithm="ring"``, so that both
    algorithms are measured against gloo in the same run (``ratio_ring_only_vs_gloo``);
  * ``ring_shm``: the same ring with each process's tensor in its shared-memory arena
    (docs/shm.md): pieces to members on this host travel as references to the sender's memory;
    skipped, with the reason in the output, where /dev/shm is not writable.

Method. For each process count (2 and 4) and size (16 and 128 MiB of float32; ``--quick``: 2
processes, 16 MiB), ``--cycles`` cycles of one block per peer, the peers' order reversed every
other cycle (``alternate``), so ring_tcp and gloo are always adjacent. A block is ``warm``
untimed all-reduces, a barrier, then ``rounds`` timed ones; its time is the slowest process's.
Each adjacent (gloo, ring) block pair gives one ratio ``gloo time / ring time`` (> 1: hmp is
faster); ``ratio_vs_gloo`` per (procs, size) is their median, with the spread of the pairs.
The headline ``ratio_vs_gloo`` is that of 2 processes, 16 MiB.

    python bench/allreduce.py [--json] [--quick] [--cycles N] [--procs 2,4] [--mib 16,128]
                              [--piece-bytes B] [--window N]

With ``--json`` the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hmp.collective.ring import DEFAULT_PIECE_BYTES, power_of_two  # noqa: E402

from _stats import (free_port, CpuMeter, ProcessGroup, alternate, cpu_line, fmt_spread, guard, is_quiet, load_average,  # noqa: E402
                    quantile, ratios, spread, summary)
from _emulated import report_lines as emulated_lines, run_emulated  # noqa: E402 - part (b): emulated hosts

MiB = 1 << 20
REPLY_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------- peers

def _alloc_plain(numel: int) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32)


def _alloc_shm(numel: int) -> torch.Tensor:
    """The ring_shm peer's tensor, in this process's shared-memory arena (opened before its server,
    see _ring_member): pieces to members on this host travel as references to it."""
    from hmp.transport.shm import process_arena

    arena = process_arena()
    if arena is None:
        raise RuntimeError("ring_shm: no shared-memory arena in this process")
    return arena.alloc(numel, torch.float32)


def _shm_missing() -> str | None:
    """Why the ring_shm peer cannot run (None once it can)."""
    import os

    return None if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "no writable /dev/shm"


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """One peer: its ``name``, ``kind`` (``gloo`` or ``ring``), how its tensor is allocated
    (``alloc``: a key of ALLOCATORS, picklable for the spawned processes), the ring's options,
    the ratio key it reports against gloo, and why it cannot run (None: it can)."""

    name: str
    kind: str
    alloc: str = "plain"
    ring_opts: dict[str, Any] = dataclasses.field(default_factory=dict)
    ratio_key: str | None = None
    missing: Callable[[], str | None] = lambda: None
    runs_at: Callable[[int], bool] = lambda procs: True  # which process counts it is measured at


ALLOCATORS: dict[str, Callable[[int], torch.Tensor]] = {"plain": _alloc_plain, "shm": _alloc_shm}


def _halving_applies(procs: int) -> bool:
    """Whether hmp picks halving-doubling for ``procs`` members on one host (a power of two, at least 4)."""
    return procs >= 4 and power_of_two(procs)


def peer_specs(piece_bytes: int, window: int | None) -> list[PeerSpec]:
    ring = {"piece_bytes": piece_bytes, "window": window}
    return [
        # Where hmp would pick halving-doubling: the ring algorithm too, measured in the same run
        # (first: its blocks are next to gloo's, as ring_tcp's are on the other side).
        PeerSpec("ring_only_tcp", "ring", "plain", {**ring, "algorithm": "ring"}, "ratio_ring_only_vs_gloo",
                 runs_at=_halving_applies),
        PeerSpec("gloo", "gloo"),
        PeerSpec("ring_tcp", "ring", "plain", ring, "ratio_vs_gloo"),
        # The tensor in the process's arena: pieces travel as shared-memory references.
        PeerSpec("ring_shm", "ring", "shm", ring, "ratio_shm_vs_gloo", _shm_missing),
    ]



def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds of every thread of ``pids`` so far (Linux /proc; None elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    try:
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])
    except OSError:
        return None
    return total / tick


# ----------------------------------------------------------------------------- processes

def _gloo_worker(rank: int, size: int, port: int, alloc: str, ring_opts: dict, conn: Any, barrier: Any) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))
        tensors: dict[int, torch.Tensor] = {}
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, numel, warm, rounds = cmd
            t = tensors.get(numel)
            if t is None:
                t = tensors[numel] = ALLOCATORS[alloc](numel)
            t.fill_(1e-3)  # sums grow by P per round: stay far from overflow for any block length here
            for _ in range(warm):
                dist.all_reduce(t)
            barrier.wait()
            t0 = time.perf_counter()
            for _ in range(rounds):
                dist.all_reduce(t)
            conn.send(time.perf_counter() - t0)
        dist.destroy_process_group()

    guard(conn, body)


def _ring_worker(rank: int, size: int, port: int, alloc: str, ring_opts: dict, conn: Any, barrier: Any) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        import asyncio

        import uvloop

        from hmp.collective import Ring, RingHost
        from hmp.messages import Kind
        from hmp.transport.endpoint import Server, tune_malloc

        tune_malloc()  # as daemons do: received frames reuse memory

        async def main() -> None:
            loop = asyncio.get_running_loop()

            async def recv() -> Any:  # off the loop: the server keeps answering meanwhile
                return await loop.run_in_executor(None, conn.recv)

            if alloc == "shm":  # before the server and clients: they offer shared memory when an arena exists
                from hmp.transport.shm import ShmSettings, open_process_arena

                open_process_arena("bench-allreduce", f"r{rank}", ShmSettings())
            host = RingHost()
            server = Server("tcp://127.0.0.1:0", {Kind.RING: host.on_piece}, name=f"r{rank}")
            await server.start()
            conn.send(server.address)
            addresses = await recv()
            ring = Ring(rank=rank, addresses=addresses, generation=1, name=f"r{rank}", timeout_s=REPLY_TIMEOUT_S,
                        **ring_opts)
            await ring.connect()
            host.install(ring)
            tensors: dict[int, torch.Tensor] = {}
            op = 0
            conn.send("ready")
            while True:
                cmd = await recv()
                if cmd[0] == "stop":
                    break
                if cmd[0] == "stats":
                    conn.send(dict(ring.stats))
                    continue
                _, numel, warm, rounds = cmd
                t = tensors.get(numel)
                if t is None:
                    t = tensors[numel] = ALLOCATORS[alloc](numel)
                t.fill_(1e-3)
                for _ in range(warm):
                    await ring.all_reduce(t, op)
                    op += 1
                await loop.run_in_executor(None, barrier.wait)
                t0 = time.perf_counter()
                for _ in range(rounds):
                    await ring.all_reduce(t, op)
                    op += 1
                conn.send(time.perf_counter() - t0)
            await ring.close()
            await server.close()

        uvloop.run(main())

    guard(conn, body)


class Group(ProcessGroup):
    """One peer's ``size`` processes, started at once, driven block by block."""

    def __init__(self, spec: PeerSpec, size: int) -> None:
        self.spec = spec
        port = free_port()
        target = _gloo_worker if spec.kind == "gloo" else _ring_worker
        super().__init__(spec.name, target, lambda rank: (rank, size, port, spec.alloc, spec.ring_opts), size=size,
                         timeout_s=REPLY_TIMEOUT_S)

    def ready(self) -> None:
        if self.spec.kind == "ring":  # ring members first tell their servers' addresses, and hear everyone's
            addresses = [self._recv(c) for c in self.conns]
            for c in self.conns:
                c.send(addresses)
        super().ready()


# ----------------------------------------------------------------------------- driver

def bench(procs: int, sizes_mib: list[int], specs: list[PeerSpec], cycles: int) -> dict[str, Any]:
    """Every size for ``procs`` processes: alternating blocks of the runnable peers."""
    groups: dict[str, Group] = {}
    out: dict[str, Any] = {}
    try:
        for spec in specs:
            if spec.runs_at(procs):
                groups[spec.name] = Group(spec, procs)
        for g in groups.values():
            g.ready()
        for mib in sizes_mib:
            numel = mib * MiB // 4
            warm, rounds = (1, 5) if mib <= 32 else (1, 2)
            for g in groups.values():  # warm-up: buffers, page faults, connections
                g.ask("run", numel, 1, 1)
            times: dict[str, list[float]] = {name: [] for name in groups}
            cpu: dict[str, list[float]] = {name: [] for name in groups}
            for cycle in range(cycles):
                for name in alternate(list(groups), cycle):
                    c0 = cpu_seconds(groups[name].pids)
                    times[name].append(max(groups[name].ask("run", numel, warm, rounds)) / rounds)
                    c1 = cpu_seconds(groups[name].pids)
                    if c0 is not None and c1 is not None:
                        cpu[name].append((c1 - c0) / (warm + rounds))
            nbytes = numel * 4
            res: dict[str, Any] = {"procs": procs, "mib": mib, "rounds_per_block": rounds, "warm_per_block": warm,
                                   "blocks": cycles}
            for name, ts in times.items():
                med = quantile(ts, 0.5)
                res[f"{name}_ms"] = round(1e3 * med, 2)
                res[f"{name}_ms_blocks"] = summary([1e3 * t for t in ts], 2)
                # algorithm bandwidth (tensor bytes / time) and bus bandwidth (x 2(P-1)/P: what each sends)
                res[f"{name}_algbw_gbps"] = round(nbytes / med / 1e9, 3)
                res[f"{name}_busbw_gbps"] = round(nbytes * 2 * (procs - 1) / procs / med / 1e9, 3)
                if cpu[name]:
                    res[f"{name}_cpu_ms_per_op"] = round(1e3 * quantile(cpu[name], 0.5), 1)
            for spec in specs:
                if spec.ratio_key and spec.name in groups:
                    rs = ratios(times["gloo"], times[spec.name])  # gloo time / ring time: > 1, hmp faster
                    res[spec.ratio_key] = round(quantile(rs, 0.5), 3)
                    res[f"{spec.ratio_key}_spread"] = spread(rs)
            if "ring_tcp" in groups:
                res["ring_stats_rank0"] = st = groups["ring_tcp"].ask("stats")[0]
                res["ring_tcp_algorithm"] = "halving" if st.get("halving_ops") else "ring"
            out[f"p{procs}_{mib}mib"] = res
    finally:
        for g in groups.values():
            g.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="2 processes, 16 MiB, few cycles")
    ap.add_argument("--cycles", type=int, default=8, help="alternating cycles (one block per peer each)")
    ap.add_argument("--procs", default="2,4", help="process counts, comma-separated")
    ap.add_argument("--mib", default="16,128", help="tensor sizes in MiB of float32, comma-separated")
    ap.add_argument("--piece-bytes", type=int, default=DEFAULT_PIECE_BYTES, help="the ring's piece size")
    ap.add_argument("--window", type=int, default=0, help="the ring's pieces in flight per op (0: unlimited)")
    ap.add_argument("--skip-emulated", action="store_true", help="leave out (b): 4 emulated hosts, bench/_emulated.py")
    args = ap.parse_args()
    procs = [int(x) for x in args.procs.split(",")]
    sizes = [int(x) for x in args.mib.split(",")]
    if args.quick:
        procs, sizes, args.cycles = [2], [16], min(args.cycles, 4)
    torch.set_num_threads(1)
    specs = peer_specs(args.piece_bytes, args.window or None)
    skipped = {s.name: s.missing() for s in specs if s.missing() is not None}
    runnable = [s for s in specs if s.name not in skipped]
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t0 = time.perf_counter()
    cases: dict[str, Any] = {}
    for p in procs:
        cases.update(bench(p, sizes, runnable, args.cycles))
    wall_s = round(time.perf_counter() - t0, 1)
    cpu = meter.stop()
    head = cases.get("p2_16mib") or next(iter(cases.values()))
    res: dict[str, Any] = {
        "ratio_vs_gloo": head.get("ratio_vs_gloo"),
        "ratio_vs_gloo_spread": head.get("ratio_vs_gloo_spread"),
        "ratio_shm_vs_gloo": head.get("ratio_shm_vs_gloo"),
        "headline_case": f"{head['procs']} procs, {head['mib']} MiB",
        "cases": cases,
        "skipped": skipped,
        "ring_options": {"piece_bytes": args.piece_bytes, "window": args.window or None},
        "cycles": args.cycles,
        "load_avg_before": load_before, "load_avg_after": load_average(), "cpu_during_run": cpu,
        "quiet": is_quiet(cpu), "wall_s": wall_s,
    }
    report(res, [s for s in runnable if s.ratio_key])
    if not args.skip_emulated:  # (b) ring, gloo, PS on 4 emulated 1 Gbit/s hosts: emulated.<peer>.fraction_of_optimal
        res["emulated"] = run_emulated(quick=args.quick)
        print("\n".join(emulated_lines(res["emulated"])))
    if args.json:
        print(json.dumps(res))


def report(res: dict[str, Any], rings: list[PeerSpec]) -> None:
    print(f"all-reduce (sum) of float32 tensors, one host, loopback; {res['cycles']} alternating cycles; "
          f"ring options {res['ring_options']}")
    print(f"{'case':<16}{'peer':<15}{'ms/op':>9}{'min':>9}{'max':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}"
          f"{'CPU ms/op':>11}")
    for case in res["cases"].values():
        label = f"{case['procs']} procs {case['mib']} MiB"
        for name in ["gloo", *[s.name for s in rings if f"{s.name}_ms_blocks" in case]]:
            b = case[f"{name}_ms_blocks"]
            print(f"{label:<16}{name:<15}{case[f'{name}_ms']:>9.2f}{b['min']:>9.2f}{b['max']:>9.2f}"
                  f"{case[f'{name}_algbw_gbps']:>12.3f}{case[f'{name}_busbw_gbps']:>12.3f}"
                  f"{case.get(f'{name}_cpu_ms_per_op', float('nan')):>11.1f}")
            label = ""
        for s in rings:
            if f"{s.ratio_key}_spread" in case:
                print(f"{'':<16}{s.ratio_key} (gloo time / ring time, per adjacent pair): "
                      f"{fmt_spread(case[f'{s.ratio_key}_spread'])}")
        if "ring_tcp_algorithm" in case:
            print(f"{'':<16}ring_tcp ran hmp's choice: {case['ring_tcp_algorithm']}")
    for name, why in res["skipped"].items():
        print(f"skipped {name}: {why}")
    print(f"headline ratio_vs_gloo ({res['headline_case']}) = {res['ratio_vs_gloo']} (target >= 0.9)")
    print(cpu_line(res.get("cpu_during_run"), res["load_avg_before"], res["load_avg_after"], res["wall_s"]))


if __name__ == "__main__":
    main()
