"""What counting for the metrics endpoint costs a push/pull round (docs/metrics.md, "Cost").

Two server/client pairs in one process on loopback TCP, identical but for their settings'
metrics (``EndpointSettings.metrics``): "off" made without, "on" made with a ``TransportMetrics``,
as a daemon with ``[metrics] enabled`` does. Each round is a
``Push`` request (``--chunks`` gradients of ``--chunk-bytes``) answered with a ``Params`` reply of the
same tensors: the per-message path of a worker and a shard (the server counts the request and its
sender's bytes, the reply's bytes; the client times the round trip into its histogram). Both ends
run in this one process, so the figure holds both sides' costs.

Method: ``--cycles`` cycles, each a block of ``--rounds`` rounds on one pair then one on the other
(order swapped every other cycle); a block's figure is its median round time, each cycle gives one
ratio on/off, and the ratio reported is the median of those (with min and max). Sizes: a small
message (per-message costs dominate) and a digits-like round (``--chunks`` x ``--chunk-bytes``).

    python bench/metrics.py [--json] [--cycles N] [--rounds N] [--chunks N] [--chunk-bytes B]

With ``--json`` the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hmp.messages import Params, Push  # noqa: E402
from hmp.transport import Client, Server, TransportMetrics  # noqa: E402


async def _pair(metrics: TransportMetrics | None) -> tuple[Server, Client]:
    async def on_push(msg: Push, peer: bytes) -> Params:
        return Params(sender="shard", keys=msg.keys, values=msg.grads, version=1)

    from hmp.messages import Kind

    server = Server("tcp://127.0.0.1:0", {Kind.PUSH: on_push}, name="shard", shm=False, job_token="", metrics=metrics)
    await server.start()
    client = Client(server.address, name="worker", shm=False, job_token="", metrics=metrics)
    await client.connect()
    return server, client


async def _block(client: Client, msg: Push, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await client.request(msg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _measure(pairs: dict[str, Client], msg: Push, cycles: int, rounds: int) -> dict[str, object]:
    for client in pairs.values():  # warm-up
        await _block(client, msg, max(10, rounds // 5))
    med: dict[str, list[float]] = {"off": [], "on": []}
    ratios = []
    for c in range(cycles):
        order = ("off", "on") if c % 2 == 0 else ("on", "off")
        got = {}
        for name in order:
            got[name] = await _block(pairs[name], msg, rounds)
            med[name].append(got[name])
        ratios.append(got["on"] / got["off"])
    return {"off_us": statistics.median(med["off"]) * 1e6, "on_us": statistics.median(med["on"]) * 1e6,
            "ratio_on_off": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


async def main(args: argparse.Namespace) -> dict[str, object]:
    off = await _pair(None)
    on = await _pair(TransportMetrics())
    pairs = {"off": off[1], "on": on[1]}
    out: dict[str, object] = {"cycles": args.cycles, "rounds": args.rounds}
    try:
        small = Push(sender="worker", keys=(0,), grads=(torch.zeros(64),), samples=16)
        floats = args.chunk_bytes // 4
        digits = Push(sender="worker", keys=tuple(range(args.chunks)),
                      grads=tuple(torch.zeros(floats) for _ in range(args.chunks)), samples=16)
        out["small"] = await _measure(pairs, small, args.cycles, args.rounds)
        out["round"] = await _measure(pairs, digits, args.cycles, args.rounds)
        out["round_bytes"] = args.chunks * floats * 4
    finally:
        for server, client in (off, on):
            await client.close()
            await server.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=2,
                    help="gradients per push (the digits test job: ~2.2 chunks of 16 KiB per shard per push)")
    ap.add_argument("--chunk-bytes", type=int, default=16384)
    a = ap.parse_args()
    import uvloop

    res = uvloop.run(main(a))
    for size in ("small", "round"):
        r = res[size]
        print(f"{size:6s} round trip: metrics off {r['off_us']:.1f} us, on {r['on_us']:.1f} us, on/off "
              f"{r['ratio_on_off']:.3f} (min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f}, {a.cycles} cycles)")
    if a.json:
        print(json.dumps(res))
