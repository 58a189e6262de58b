"""Transport benchmark: hmp against a raw TCP socket pair and pickle, on loopback.

Peers, each a sender process and a receiver process started once for the whole run:
  * raw TCP, acknowledged: 64 MiB messages, length-prefixed, received with recv_into a
    preallocated buffer, each acknowledged with 8 bytes before the next is sent;
  * raw TCP, streaming: the same socket pair sending ``--stream`` messages back to back with one
    acknowledgement for all of them: the real limit of a loopback stream;
  * hmp: a 64 MiB float32 tensor as a ``Tensors`` request answered with ``Ack`` (acknowledged),
    and ``--stream`` of them as one-way messages followed by one request (streaming). Both hmp
    processes call ``tune_malloc()`` first, as daemons do (see hmp.transport.endpoint); a second
    hmp pair without it gives ``hmp_default_malloc_gbps``;
  * pickle: the same tensor pickled over the raw TCP pair and unpickled (the naive way);
  * small messages (hmp only): request/reply latency (p50, p99) and one-way messages/s.

Method: after one untimed warm-up block of every peer, the run is ``--rounds`` cycles; a cycle is
one short block of each peer (``--repeats`` acknowledged messages, one stream of ``--stream``
messages, ...), in an order that puts the peers compared next to each other (raw, hmp; raw stream,
hmp stream) and is reversed every other cycle. Each cycle gives one ratio per comparison from two
adjacent blocks; a headline ratio is the median of those per-cycle ratios, printed with its min,
quartiles and max. Per-peer GB/s are medians over the peer's blocks.

    python bench/transport.py [--json] [--quick] [--rounds N] [--repeats N] [--stream N]
                              [--megabytes M] [--frame-bytes B] [--small N] [--pin]

With ``--json`` the last line is one JSON object with every figure (``ratio_vs_raw_tcp``,
``ratio_vs_raw_tcp_stream``, their ``*_spread``, per-peer ``peers``, latency and rates).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import socket
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import alternate, fmt_spread, load_average, quantile, ratios, spread, summary  # noqa: E402

from hmp.messages import Ack, Heartbeat, Kind, Shutdown, Tensors  # noqa: E402
from hmp.transport.codec import DEFAULT_FRAME_BYTES  # noqa: E402
from hmp.transport.endpoint import Client, Server, tune_malloc  # noqa: E402

MiB = 1 << 20
HDR = struct.Struct("!QBB")  # payload bytes, acknowledge after this message, payload is a pickle
ACK = struct.Struct("!Q")  # messages received since the previous acknowledgement
REPLY_TIMEOUT_S = 300.0


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def _guard(conn: Any, fn: Any) -> None:
    try:
        fn()
    except BaseException:  # the driver must hear of it instead of waiting for a timeout
        with contextlib.suppress(OSError, BrokenPipeError):
            conn.send(("error", traceback.format_exc()))
        raise


# ----------------------------------------------------------------------------- raw TCP peer

def _recv_exact_into(conn: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = conn.recv_into(view[pos:])
        if n == 0:
            raise ConnectionError("peer closed")
        pos += n


def _tcp_receiver(port_q: Any, cpu: int | None) -> None:
    _pin(cpu)
    torch.set_num_threads(1)
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(0)
    hdr = bytearray(HDR.size)
    count = 0
    while True:
        try:
            _recv_exact_into(conn, memoryview(hdr))
        except ConnectionError:
            break
        n, ack, pickled = HDR.unpack(hdr)
        if len(buf) < n:
            buf = bytearray(n)  # once: every later message lands in the same buffer
        _recv_exact_into(conn, memoryview(buf)[:n])
        if pickled:
            pickle.loads(memoryview(buf)[:n])  # the naive receiver's cost: unpickling the tensor
        count += 1
        if ack:
            conn.sendall(ACK.pack(count))
            count = 0
    conn.close()
    srv.close()


def _tcp_sender(port: int, nbytes: int, cpu: int | None, conn: Any) -> None:
    _pin(cpu)
    torch.set_num_threads(1)

    def body() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tensor = torch.randn(nbytes // 4)
        payload = memoryview(tensor.numpy()).cast("B")
        ackbuf = bytearray(ACK.size)

        def send(data: Any, ack: bool, pickled: bool) -> None:
            sock.sendall(HDR.pack(len(data), ack, pickled))
            sock.sendall(data)

        def wait_ack(expect: int) -> None:
            _recv_exact_into(sock, memoryview(ackbuf))
            (got,) = ACK.unpack(ackbuf)
            if got != expect:
                raise RuntimeError(f"receiver acknowledged {got} messages, expected {expect}")

        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            what, k = cmd
            times = []
            if what == "acked":  # k messages, each acknowledged before the next
                for _ in range(k):
                    t0 = time.perf_counter()
                    send(payload, True, False)
                    wait_ack(1)
                    times.append(time.perf_counter() - t0)
            elif what == "stream":  # k messages back to back, one acknowledgement for all
                t0 = time.perf_counter()
                for i in range(k):
                    send(payload, i == k - 1, False)
                wait_ack(k)
                times.append(time.perf_counter() - t0)
            elif what == "pickle":  # k pickled tensors, each acknowledged after unpickling
                for _ in range(k):
                    t0 = time.perf_counter()
                    send(pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL), True, True)
                    wait_ack(1)
                    times.append(time.perf_counter() - t0)
            else:
                raise ValueError(f"unknown command {what!r}")
            conn.send(times)
        sock.close()

    _guard(conn, body)


# ----------------------------------------------------------------------------- hmp peer

def _hmp_receiver(addr_q: Any, frame_bytes: int, tune: bool, cpu: int | None) -> None:
    import uvloop

    _pin(cpu)
    torch.set_num_threads(1)
    if tune:
        tune_malloc()  # before the first socket, as a daemon does at start

    async def main() -> None:
        stop = asyncio.Event()
        count = {"oneway": 0, "tensors": 0, "numel": 0}

        async def on_tensors(msg, peer):
            count["tensors"] += 1
            count["numel"] += sum(t.numel() for t in msg.tensors)
            if msg.rid == 0:  # one-way: part of a stream
                return None
            detail = f"{count['tensors']} {count['numel']}"
            count["tensors"] = count["numel"] = 0
            return Ack(detail=detail)

        async def on_heartbeat(msg, peer):
            if msg.rid == 0:  # one-way
                count["oneway"] += 1
                return None
            detail = str(count["oneway"])
            count["oneway"] = 0
            return Ack(detail=detail)

        async def on_shutdown(msg, peer):
            stop.set()
            return Ack()

        handlers = {Kind.TENSORS: on_tensors, Kind.HEARTBEAT: on_heartbeat, Kind.SHUTDOWN: on_shutdown}
        async with Server("tcp://127.0.0.1:0", handlers, name="bench", frame_bytes=frame_bytes) as srv:
            addr_q.put(srv.address)
            await stop.wait()
            await asyncio.sleep(0.05)

    uvloop.run(main())


def _hmp_sender(address: str, nbytes: int, frame_bytes: int, tune: bool, cpu: int | None, conn: Any) -> None:
    _pin(cpu)
    torch.set_num_threads(1)
    if tune:
        tune_malloc()

    async def main() -> None:
        async with Client(address, name="bench", frame_bytes=frame_bytes, timeout_s=REPLY_TIMEOUT_S) as client:
            tensor = torch.randn(nbytes // 4)
            msg = Tensors(name="g", tensors=(tensor,))

            async def request_checked(expect: int) -> None:
                reply = await client.request(msg)
                got = tuple(int(x) for x in reply.detail.split())
                if got != (expect, expect * tensor.numel()):
                    raise RuntimeError(f"receiver saw {got} (messages, elements), expected {expect}")

            conn.send("ready")
            while True:
                cmd = conn.recv()  # blocking: nothing else runs in this process meanwhile
                if cmd[0] == "stop":
                    break
                what, k = cmd
                out: Any = []
                if what == "acked":  # k tensors, each a request answered before the next
                    for _ in range(k):
                        t0 = time.perf_counter()
                        await request_checked(1)
                        out.append(time.perf_counter() - t0)
                elif what == "stream":  # k - 1 one-way tensors, then one request, ordered after them
                    t0 = time.perf_counter()
                    for _ in range(k - 1):
                        await client.send(msg)
                    await request_checked(k)
                    out.append(time.perf_counter() - t0)
                elif what == "latency":  # small request/reply, one at a time
                    for _ in range(k):
                        t0 = time.perf_counter()
                        await client.request(Heartbeat(step=1))
                        out.append(time.perf_counter() - t0)
                elif what == "oneway":  # small one-way messages; the final request is ordered after them
                    t0 = time.perf_counter()
                    for i in range(k):
                        await client.send(Heartbeat(step=i))
                    reply = await client.request(Heartbeat(step=-1))
                    out = [time.perf_counter() - t0]
                    if int(reply.detail) != k:
                        raise RuntimeError(f"server counted {reply.detail} of {k} one-way messages")
                else:
                    raise ValueError(f"unknown command {what!r}")
                conn.send(out)
            await client.request(Shutdown(reason="bench done"))

    def body() -> None:
        import uvloop

        uvloop.run(main())

    _guard(conn, body)


# ----------------------------------------------------------------------------- driver

class Pair:
    """One peer's receiver and sender processes, the sender driven block by block over a pipe."""

    def __init__(self, name: str, receiver: Any, rargs: tuple, sender: Any, sargs_of: Any) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        q = ctx.Queue()
        self.procs = [ctx.Process(target=receiver, args=(q, *rargs), daemon=True, name=f"{name}-recv")]
        self.procs[0].start()
        where = q.get(timeout=120)
        self.conn, child = ctx.Pipe()
        self.procs.append(ctx.Process(target=sender, args=(*sargs_of(where), child), daemon=True,
                                      name=f"{name}-send"))
        self.procs[1].start()

    def _recv(self) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"{self.name}: no answer from the sender in {REPLY_TIMEOUT_S} s")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"{self.name} sender failed:\n{reply[1]}")
        return reply

    def ready(self) -> None:
        if self._recv() != "ready":
            raise RuntimeError(f"{self.name}: unexpected greeting")

    def ask(self, what: str, k: int) -> list[float]:
        self.conn.send((what, k))
        return self._recv()

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(("stop",))
        for p in reversed(self.procs):
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (few cycles)")
    ap.add_argument("--rounds", type=int, default=40, help="alternating cycles of all peers")
    ap.add_argument("--repeats", type=int, default=3, help="acknowledged messages per block")
    ap.add_argument("--stream", type=int, default=6, help="messages per acknowledgement when streaming")
    ap.add_argument("--megabytes", type=int, default=64, help="size of the large message (MiB)")
    ap.add_argument("--frame-bytes", type=int, default=DEFAULT_FRAME_BYTES, help="hmp frame size (bytes)")
    ap.add_argument("--small", type=int, default=4000, help="one-way small messages per block")
    ap.add_argument("--pin", action="store_true",
                    help="pin every sender to CPU 0 and every receiver to CPU 1 (the same for all peers)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.repeats, args.stream, args.small = 4, 2, 3, 1000
    torch.set_num_threads(1)
    nbytes = args.megabytes * MiB
    scpu, rcpu = (0, 1) if args.pin else (None, None)
    load_before = load_average()
    t_start = time.perf_counter()

    pairs: dict[str, Pair] = {}
    try:
        pairs["raw"] = Pair("raw", _tcp_receiver, (rcpu,), _tcp_sender, lambda port: (port, nbytes, scpu))
        for name, tune in (("hmp", True), ("hmp_default_malloc", False)):
            pairs[name] = Pair(name, _hmp_receiver, (args.frame_bytes, tune, rcpu), _hmp_sender,
                               lambda addr, t=tune: (addr, nbytes, args.frame_bytes, t, scpu))
        for p in pairs.values():
            p.ready()

        # Blocks: (series name, peer, command, messages). Compared peers sit next to each other.
        n_lat = max(50, args.small // 20)
        blocks = [("raw", "raw", "acked", args.repeats), ("hmp", "hmp", "acked", args.repeats),
                  ("raw_stream", "raw", "stream", args.stream), ("hmp_stream", "hmp", "stream", args.stream),
                  ("hmp_default_malloc", "hmp_default_malloc", "acked", args.repeats),
                  ("pickle", "raw", "pickle", 1),
                  ("latency", "hmp", "latency", n_lat), ("oneway", "hmp", "oneway", args.small)]
        for _series, peer, what, k in blocks:  # warm-up: buffers, page faults, code paths
            pairs[peer].ask(what, k)
        series: dict[str, list[list[float]]] = {b[0]: [] for b in blocks}
        for cycle in range(args.rounds):
            order = {b[0]: b for b in blocks}
            for name in alternate(list(order), cycle):
                _s, peer, what, k = order[name]
                series[name].append(pairs[peer].ask(what, k))
    finally:
        for p in pairs.values():
            p.close()
    wall_s = time.perf_counter() - t_start
    load_after = load_average()

    def block_gbps(name: str, per_block: int) -> list[float]:
        """GB/s of each block: messages moved / the block's summed time."""
        return [per_block * nbytes / sum(ts) / 1e9 for ts in series[name]]

    gb = {"raw": block_gbps("raw", args.repeats), "hmp": block_gbps("hmp", args.repeats),
          "raw_stream": block_gbps("raw_stream", args.stream), "hmp_stream": block_gbps("hmp_stream", args.stream),
          "hmp_default_malloc": block_gbps("hmp_default_malloc", args.repeats),
          "pickle": block_gbps("pickle", 1)}
    cmp = {  # ratio key: (numerator series, denominator series), one ratio per cycle
        "ratio_vs_raw_tcp": ("hmp", "raw"),
        "ratio_vs_raw_tcp_stream": ("hmp_stream", "raw_stream"),
        "ratio_acked_vs_raw_tcp_stream": ("hmp", "raw_stream"),
        "ratio_raw_tcp_acked_vs_stream": ("raw", "raw_stream"),
        "ratio_default_malloc_vs_raw_tcp": ("hmp_default_malloc", "raw"),
        "ratio_vs_pickle": ("hmp", "pickle"),
    }
    lat_us = [x * 1e6 for blk in series["latency"] for x in blk]
    lat_p50_blocks = [quantile([x * 1e6 for x in blk], 0.5) for blk in series["latency"]]
    oneway_blocks = [args.small / blk[0] for blk in series["oneway"]]

    gbps_key = {"raw": "raw_tcp_gbps", "hmp": "hmp_gbps", "raw_stream": "raw_tcp_stream_gbps",
                "hmp_stream": "hmp_stream_gbps", "hmp_default_malloc": "hmp_default_malloc_gbps",
                "pickle": "pickle_gbps"}
    res: dict[str, Any] = {"message_bytes": nbytes, "frame_bytes": args.frame_bytes}
    for name, key in gbps_key.items():
        res[key] = round(quantile(gb[name], 0.5), 3)
    for key, (a, b) in cmp.items():
        rs = ratios(gb[a], gb[b])
        res[key] = round(quantile(rs, 0.5), 3)
        res[f"{key}_spread"] = spread(rs)
    res.update({
        "req_reply_p50_us": round(quantile(lat_us, 0.5), 1),
        "req_reply_p99_us": round(quantile(lat_us, 0.99), 1),
        "req_reply_p50_us_blocks": summary(lat_p50_blocks, 1),
        "oneway_msgs_per_s": round(quantile(oneway_blocks, 0.5)),
        "oneway_msgs_per_s_blocks": summary(oneway_blocks, 0),
        "peers": {name: {"gbps_blocks": summary(v)} for name, v in gb.items()},
        "method": {"cycles": args.rounds, "acked_messages_per_block": args.repeats,
                   "stream_messages_per_ack": args.stream, "latency_requests_per_block": n_lat,
                   "oneway_messages_per_block": args.small, "pinned": args.pin,
                   "order": [b[0] for b in blocks], "order_reversed_every_other_cycle": True},
        "samples": {"raw": args.rounds * args.repeats, "hmp": args.rounds * args.repeats,
                    "raw_stream": args.rounds * args.stream, "hmp_stream": args.rounds * args.stream,
                    "hmp_default_malloc": args.rounds * args.repeats, "pickle": args.rounds,
                    "latency": len(lat_us), "oneway_runs": len(oneway_blocks)},
        "load_avg_before": load_before, "load_avg_after": load_after, "wall_s": round(wall_s, 1),
    })
    report(res)
    if args.json:
        print(json.dumps(res))


def report(res: dict[str, Any]) -> None:
    m = res["method"]
    print(f"{res['message_bytes'] // MiB} MiB messages; {m['cycles']} cycles of one block per peer "
          f"({m['acked_messages_per_block']} acknowledged messages, or one stream of {m['stream_messages_per_ack']} "
          f"with one acknowledgement), order reversed every other cycle"
          f"{'; senders on CPU 0, receivers on CPU 1' if m['pinned'] else ''}")
    print(f"{'peer':<34}{'GB/s median':>12}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}")
    labels = {"raw": "raw TCP, acknowledged", "hmp": "hmp tensor, acknowledged (request)",
              "raw_stream": "raw TCP, streaming", "hmp_stream": "hmp tensor, streaming (one-way)",
              "hmp_default_malloc": "hmp acknowledged, default malloc", "pickle": "pickle over TCP"}
    for name, label in labels.items():
        s = res["peers"][name]["gbps_blocks"]
        print(f"{label:<34}{s['median']:>12.3f}{s['min']:>8.3f}{s['p25']:>8.3f}{s['p75']:>8.3f}{s['max']:>8.3f}")
    print("\nratio (median of per-cycle ratios of adjacent blocks) [min .. max] (IQR)")
    for key in ("ratio_vs_raw_tcp", "ratio_vs_raw_tcp_stream", "ratio_acked_vs_raw_tcp_stream",
                "ratio_raw_tcp_acked_vs_stream", "ratio_default_malloc_vs_raw_tcp", "ratio_vs_pickle"):
        print(f"  {key:<34}{fmt_spread(res[f'{key}_spread'])}")
    print("  (targets: ratio_vs_raw_tcp >= 0.8)")
    lb = res["req_reply_p50_us_blocks"]
    print(f"request/reply p50 = {res['req_reply_p50_us']:.0f} us, p99 = {res['req_reply_p99_us']:.0f} us "
          f"(per-block p50 {lb['min']:.0f} .. {lb['max']:.0f}; target p50 <= 250)")
    ob = res["oneway_msgs_per_s_blocks"]
    print(f"one-way small messages = {res['oneway_msgs_per_s']:,}/s (per block {ob['min']:,.0f} .. "
          f"{ob['max']:,.0f}; target >= 50,000)")
    print(f"load average before {res['load_avg_before']}, after {res['load_avg_after']}; {res['wall_s']} s")


if __name__ == "__main__":
    main()
