"""PS reply micro-benchmark: zero-copy replies with tracker bookkeeping vs copying the chunks.

A PS shard answers a push with the chunks' new values. Two ways to keep a reply from carrying
values of a later update:

* ``zerocopy``: the reply frames are the shard's own chunk tensors; the server tracks the send
  (``Reply(msg, on_sent)``, hmp.transport.endpoint) and the next mutation waits until libzmq has
  let go of every reply still in flight (what ``PSShardNode`` did before issue 10).
* ``zerocopy_spin``: the same, with the tracker polled every 0.5 ms as before issue 10 (uvloop
  makes that sleep an immediate reschedule: a spin), to show what the old wait cost.
* ``copy``: the reply carries a copy of the chunks (one memcpy per reply); no tracker, and a
  mutation never waits for a send.

Set-up: one shard process per tracker-poll setting (``zerocopy`` and ``copy`` share one; each
variant has its own ``Server`` and ``ShardCore``, async SGD), and this process as 2 workers (two
``Client`` s on one uvloop, as the 2-core machine has room for no more processes), over
tcp://127.0.0.1. A round: both workers push 16 MiB (16 chunks of 1 MiB, float32) at once and copy
the replies' values into their parameters (as ``PSClient`` does); its time is until both replies
are in. Variants run in alternating blocks (``--blocks`` cycles, order reversed every other
cycle; each block ``--warm`` untimed then ``--rounds`` timed rounds); a block's figure is its
median round, a variant's the median of its blocks, and ``ratio_copy_vs_zerocopy`` the median
of per-cycle ratios (copy round time / zerocopy round time: < 1 means the copy is faster).
``shard_cpu_ms_per_round``: the shard process's CPU time per round (from /proc).

    python bench/reply.py [--json] [--blocks N] [--rounds N] [--warm N] [--mib N] [--chunk-kib N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hmp.messages import Kind, Params, Push  # noqa: E402
from hmp.ps.shard_core import ShardCore  # noqa: E402
from hmp.transport import channel  # noqa: E402
from hmp.transport.endpoint import Client, Reply, Server  # noqa: E402

MiB = 1 << 20
VARIANTS = ("zerocopy", "copy", "zerocopy_spin")


def _chunks(total_bytes: int, chunk_bytes: int) -> dict[int, torch.Tensor]:
    n = chunk_bytes // 4
    return {k: torch.zeros(n) for k in range(total_bytes // chunk_bytes)}


class _Shard:
    """One variant's shard: a ShardCore (async SGD) behind its own Server."""

    def __init__(self, variant: str, chunks: dict[int, torch.Tensor]) -> None:
        self.variant = variant
        self.core = ShardCore("ps0", chunks, "sgd", {"lr": 1e-6})
        self.in_flight = 0  # zerocopy: replies libzmq still holds
        self.released: asyncio.Future | None = None

    def _sent(self, ok: bool) -> None:
        self.in_flight -= 1
        if not self.in_flight and self.released is not None and not self.released.done():
            self.released.set_result(None)

    async def on_push(self, msg: Push, peer: bytes) -> Any:
        core = self.core
        if self.variant == "copy":
            core.apply(msg.sender, msg.keys, msg.grads, msg.samples)
            values = tuple(v.clone() for v in core.values(msg.keys))
            return Params(keys=msg.keys, values=values, version=core.version)
        while self.in_flight:  # the old bookkeeping: no mutation while a reply references the chunks
            if self.released is None or self.released.done():
                self.released = asyncio.get_running_loop().create_future()
            await self.released
        core.apply(msg.sender, msg.keys, msg.grads, msg.samples)
        self.in_flight += 1
        return Reply(Params(keys=msg.keys, values=core.values(msg.keys), version=core.version), self._sent)


async def _serve(variants: list[str], total: int, chunk: int) -> None:
    servers = []
    for v in variants:
        shard = _Shard(v, _chunks(total, chunk))
        srv = Server("tcp://127.0.0.1:0", {Kind.PUSH: shard.on_push}, name=f"ps-{v}", frame_bytes=64 * MiB)
        await srv.start()
        servers.append(srv)
        print(v, srv.address, flush=True)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until the driver closes stdin
    for srv in servers:
        await srv.close(grace_s=0.5)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    total, chunk = args.mib * MiB, args.chunk_kib * 1024
    procs, addresses, pids = [], {}, {}
    groups = [["zerocopy", "copy"], ["zerocopy_spin"]]
    for group in groups:
        cmd = [sys.executable, __file__, "--serve", ",".join(group), "--mib", str(args.mib),
               "--chunk-kib", str(args.chunk_kib)]
        if "zerocopy_spin" in group:
            cmd.append("--spin")
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        while (line := p.stdout.readline().strip()) != "ready":  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"shard process {group} exited")
            name, addr = line.split()
            addresses[name], pids[name] = addr, p.pid
    keys = tuple(range(total // chunk))
    workers = []
    for w in range(2):
        params = _chunks(total, chunk)
        grads = tuple(torch.full((chunk // 4,), 0.001 * (w + 1)) for _ in keys)
        clients = {}
        for v in VARIANTS:
            clients[v] = Client(addresses[v], name=f"w{w}", frame_bytes=64 * MiB, timeout_s=60)
            await clients[v].connect()
        workers.append((f"w{w}", params, grads, clients))

    async def one(v: str, w: tuple) -> None:
        name, params, grads, clients = w
        reply = await clients[v].request(Push(keys=keys, grads=grads, samples=1))
        for k, val in zip(reply.keys, reply.values):
            params[k].copy_(val)

    async def round_(v: str) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(v, w) for w in workers))
        return time.perf_counter() - t0

    blocks: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios = []
    load_before = os.getloadavg()
    try:
        for cycle in range(args.blocks):
            order = VARIANTS if cycle % 2 == 0 else VARIANTS[::-1]
            med = {}
            for v in order:
                for _ in range(args.warm):
                    await round_(v)
                c0 = _cpu_s(pids[v])
                times = [await round_(v) for _ in range(args.rounds)]
                cpu[v].append((_cpu_s(pids[v]) - c0) / args.rounds)
                med[v] = statistics.median(times)
                blocks[v].append(med[v])
            ratios.append(med["copy"] / med["zerocopy"])
    finally:
        for _, _, _, clients in workers:
            for c in clients.values():
                await c.close()
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=30)
    load_after = os.getloadavg()
    out: dict[str, Any] = {"workers": 2, "push_mib": args.mib, "chunk_kib": args.chunk_kib, "blocks": args.blocks,
                           "rounds_per_block": args.rounds, "cpus": os.cpu_count(),
                           "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)]}
    for v in VARIANTS:
        out[f"{v}_round_ms"] = round(1e3 * statistics.median(blocks[v]), 3)
        out[f"{v}_round_ms_blocks"] = [round(1e3 * b, 3) for b in blocks[v]]
        out[f"{v}_shard_cpu_ms_per_round"] = round(1e3 * statistics.median(cpu[v]), 3)
    out["ratio_copy_vs_zerocopy"] = round(statistics.median(ratios), 4)
    out["ratio_copy_vs_zerocopy_spread"] = [round(min(ratios), 4), round(max(ratios), 4)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--mib", type=int, default=16, help="MiB each worker pushes per round")
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import uvloop

    torch.set_num_threads(1)
    if args.serve:
        channel.tune_malloc()
        if args.spin:  # the tracker poll before issue 10: asyncio.sleep(0.0005), a spin under uvloop
            channel._TRACK_POLL_S = (0.0005, 0.0005)
        uvloop.run(_serve(args.serve.split(","), args.mib * MiB, args.chunk_kib * 1024))
        return
    channel.tune_malloc()
    res = uvloop.run(_drive(args))
    print(f"PS push round, 2 workers x {args.mib} MiB in {args.chunk_kib} KiB chunks, loopback "
          f"(median of {args.blocks} blocks x {args.rounds} rounds; loadavg {res['loadavg_1m_before_after']})")
    print(f"{'variant':<16}{'round ms':>10}{'shard CPU ms/round':>20}")
    for v in VARIANTS:
        print(f"{v:<16}{res[f'{v}_round_ms']:>10.2f}{res[f'{v}_shard_cpu_ms_per_round']:>20.2f}")
    print(f"copy / zerocopy round time: {res['ratio_copy_vs_zerocopy']} "
          f"(per-cycle min..max {res['ratio_copy_vs_zerocopy_spread']})")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
