"""Transport benchmark: hmp against a raw TCP socket pair and pickle, on loopback.

Peers, each a sender process and a receiver process started once for the whole run:
  * raw TCP, acknowledged: 64 MiB messages, length-prefixed, received with recv_into a
    preallocated buffer, each acknowledged (8 bytes) before the next is sent. The sender writes
    as libzmq does, non-blocking: it hands the kernel all that is left and waits for room; one
    blocking ``sendall`` of 64 MiB (``--tcp-send sendall``, this benchmark's method before) was
    25-40% slower in an A/B on the 2-core VM this was written on (a handicap for the raw peer);
  * raw TCP, streaming: the same socket pair sending ``--stream`` messages back to back with one
    acknowledgement for all of them (the limit of a loopback stream);
  * hmp: a 64 MiB float32 tensor as a ``Tensors`` request answered with ``Ack`` (acknowledged),
    and ``--stream`` of them as one-way messages followed by one request (streaming). Both hmp
    processes call ``tune_malloc()`` first, as daemons do (see hmp.transport.endpoint); a second
    hmp pair without it gives ``hmp_default_malloc_gbps``;
  * pickle: the same tensor pickled over the raw TCP pair and unpickled (the naive way);
  * small messages (hmp only): request/reply latency (p50, p99) and one-way messages/s;
  * CURVE (docs/security.md): a third hmp pair whose server and client use CURVE (keys made for the
    run in a temporary folder), its 64 MiB requests interleaved message by message with plain hmp
    requests (``--curve-pairs`` pairs per cycle): round-trip times (median), and the median of
    the per-pair ratios CURVE / plain (``curve_rtt_ratio``). ``--curve-pairs 0`` leaves it out.

Method. One 64 MiB message takes ~20-40 ms here, and the same message's time varies 2-3x from one
to the next on a shared VM, so a few long runs per peer (as before) compared different moments of
the machine. Now every peer is warmed up, then the run is ``--rounds`` cycles; a cycle is
``--repeats`` raw/hmp acknowledged pairs interleaved message by message (raw, hmp, hmp, raw, ...),
``--stream-pairs`` raw/hmp pairs of streams, then one block of each other peer, orders reversed every other
cycle. Each pair of adjacent blocks gives one ratio (the other comparisons: one per cycle); a ratio
is the median of them, with its min, quartiles and max in ``*_spread``. Per-peer GB/s are medians over the peer's blocks.

    python bench/transport.py [--json] [--quick] [--rounds N] [--repeats N] [--stream N] [--stream-pairs N]
                              [--megabytes M] [--frame-bytes B] [--small N] [--tcp-send S] [--pin]
                              [--curve-pairs N]

With ``--json`` the last line is one JSON object with every figure (``ratio_vs_raw_tcp``,
``ratio_vs_raw_tcp_stream`` (hmp streaming vs raw streaming), ``ratio_acked_vs_raw_tcp_stream``
(hmp requests vs raw streaming), their ``*_spread``, per-peer ``peers``, latency, rates and the
machine's load during the run; ``curve_rtt_ms``, ``curve_plain_rtt_ms``, ``curve_rtt_ratio`` and its
spread, ``curve_gbps``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import select
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import (guard, CpuMeter, alternate, cpu_line, fmt_spread, is_quiet, load_average, quantile,  # noqa: E402
                    ratios, spread, summary)

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


def _tcp_sender(port: int, nbytes: int, how: str, cpu: int | None, conn: Any) -> None:
    _pin(cpu)
    torch.set_num_threads(1)

    def body() -> None:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tensor = torch.randn(nbytes // 4)
        payload = memoryview(tensor.numpy()).cast("B")
        ackbuf = bytearray(ACK.size)

        poller = select.poll()
        poller.register(sock, select.POLLOUT)

        def send(data: Any, ack: bool, pickled: bool) -> None:
            sock.sendall(HDR.pack(len(data), ack, pickled))
            if how == "sendall":  # one blocking call for the whole message (slower here)
                sock.sendall(data)
                return
            # Non-blocking, as libzmq writes: hand the kernel all that is left, wait for room, repeat.
            view = memoryview(data).cast("B")
            pos = 0
            sock.setblocking(False)
            try:
                while pos < len(view):
                    try:
                        pos += sock.send(view[pos:])
                    except BlockingIOError:
                        poller.poll()
            finally:
                sock.setblocking(True)

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

    guard(conn, body)


# ----------------------------------------------------------------------------- hmp peer

def _security(key_dir: str | None, name: str, serve: bool) -> Any:
    """A CURVE setting from the run's key folder (None: plain)."""
    if key_dir is None:
        return False
    from hmp.transport.security import Curve

    return Curve.load(key_dir, name, serve=serve)


def _hmp_receiver(addr_q: Any, frame_bytes: int, tune: bool, cpu: int | None, key_dir: str | None = None) -> None:
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
        async with Server("tcp://127.0.0.1:0", handlers, name="bench", frame_bytes=frame_bytes,
                          security=_security(key_dir, "bench-server", True)) as srv:
            addr_q.put(srv.address)
            await stop.wait()
            await asyncio.sleep(0.05)

    uvloop.run(main())


def _hmp_sender(address: str, nbytes: int, frame_bytes: int, tune: bool, cpu: int | None, key_dir: str | None,
                conn: Any) -> None:
    _pin(cpu)
    torch.set_num_threads(1)
    if tune:
        tune_malloc()

    async def main() -> None:
        async with Client(address, name="bench", frame_bytes=frame_bytes, timeout_s=REPLY_TIMEOUT_S,
                          security=_security(key_dir, "bench", False)) as client:
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

    guard(conn, body)


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
    ap.add_argument("--rounds", type=int, default=36, help="alternating cycles of all peers")
    ap.add_argument("--repeats", type=int, default=3,
                    help="acknowledged raw/hmp message pairs per cycle (also hmp default-malloc messages)")
    ap.add_argument("--stream", type=int, default=6, help="messages per acknowledgement when streaming")
    ap.add_argument("--stream-pairs", type=int, default=2, help="raw/hmp pairs of streams per cycle")
    ap.add_argument("--megabytes", type=int, default=64, help="size of the large message (MiB)")
    ap.add_argument("--frame-bytes", type=int, default=DEFAULT_FRAME_BYTES, help="hmp frame size (bytes)")
    ap.add_argument("--tcp-send", choices=["nonblocking", "sendall"], default="nonblocking",
                    help="raw TCP sender: non-blocking sends of all that is left (as libzmq), or one "
                         "blocking sendall per message (this benchmark's method before)")
    ap.add_argument("--small", type=int, default=4000, help="one-way small messages per block")
    ap.add_argument("--curve-pairs", type=int, default=2,
                    help="plain/CURVE pairs of acknowledged hmp messages per cycle (0: no CURVE figures)")
    ap.add_argument("--pin", action="store_true",
                    help="pin every sender to CPU 0 and every receiver to CPU 1 (the same for all peers)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.repeats, args.stream, args.stream_pairs, args.small = 4, 2, 3, 1, 1000
        args.curve_pairs = min(args.curve_pairs, 1)
    torch.set_num_threads(1)
    nbytes = args.megabytes * MiB
    scpu, rcpu = (0, 1) if args.pin else (None, None)
    n_lat = max(50, args.small // 20)
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t_start = time.perf_counter()

    # What each series asks of which pair: (pair, command, messages per block).
    what = {"raw": ("raw", "acked", 1), "hmp": ("hmp", "acked", 1),
            "raw_stream": ("raw", "stream", args.stream), "hmp_stream": ("hmp", "stream", args.stream),
            "hmp_default_malloc": ("hmp_default_malloc", "acked", args.repeats), "pickle": ("raw", "pickle", 1),
            "latency": ("hmp", "latency", n_lat), "oneway": ("hmp", "oneway", args.small)}
    if args.curve_pairs:  # plain requests of their own, paired with the CURVE ones
        what.update({"curve_plain": ("hmp", "acked", 1), "curve": ("hmp_curve", "acked", 1)})
    # times[series][cycle]: the seconds returned by each of that cycle's blocks of the series
    times: dict[str, list[list[list[float]]]] = {name: [] for name in what}
    pairs: dict[str, Pair] = {}
    key_dir = None
    if args.curve_pairs:
        import tempfile

        from hmp.keygen import main as keygen
        key_dir = tempfile.mkdtemp(prefix="hmp-bench-keys-")
        if keygen([key_dir, "--nodes", "bench", "--client", "bench-server"]) != 0:
            raise RuntimeError("hmp-keygen failed")
        # the server's own key is the job's server key; "bench-server" only names the receiver process
    try:
        pairs["raw"] = Pair("raw", _tcp_receiver, (rcpu,), _tcp_sender,
                            lambda port: (port, nbytes, args.tcp_send, scpu))
        for name, tune in (("hmp", True), ("hmp_default_malloc", False)):
            pairs[name] = Pair(name, _hmp_receiver, (args.frame_bytes, tune, rcpu), _hmp_sender,
                               lambda addr, t=tune: (addr, nbytes, args.frame_bytes, t, scpu, None))
        if args.curve_pairs:
            pairs["hmp_curve"] = Pair("hmp_curve", _hmp_receiver, (args.frame_bytes, True, rcpu, key_dir), _hmp_sender,
                                      lambda addr: (addr, nbytes, args.frame_bytes, True, scpu, key_dir))
        for p in pairs.values():
            p.ready()
        for pair, cmd, k in what.values():  # warm-up: buffers, page faults, code paths
            pairs[pair].ask(cmd, k)
            if cmd == "acked":
                pairs[pair].ask(cmd, k)

        def run(name: str) -> None:
            pair, cmd, k = what[name]
            times[name][-1].append(pairs[pair].ask(cmd, k))

        for cycle in range(args.rounds):
            for series in times.values():
                series.append([])
            # raw and hmp message by message, in adjacent pairs, each first in every other pair
            for i in range(args.repeats):
                for name in alternate(["raw", "hmp"], cycle + i):
                    run(name)
            for i in range(args.stream_pairs):
                for name in alternate(["raw_stream", "hmp_stream"], cycle + i):
                    run(name)
            for i in range(args.curve_pairs):
                for name in alternate(["curve_plain", "curve"], cycle + i):
                    run(name)
            for name in alternate(["hmp_default_malloc", "pickle", "latency", "oneway"], cycle):
                run(name)
    finally:
        for p in pairs.values():
            p.close()
        if key_dir is not None:
            import shutil

            shutil.rmtree(key_dir, ignore_errors=True)
    wall_s = time.perf_counter() - t_start
    load_after = load_average()
    cpu = meter.stop()

    def gbps(name: str, per_cycle: bool) -> list[float]:
        """GB/s of each block (per_cycle False) or of all of a cycle's blocks together (True)."""
        k = what[name][2]
        if per_cycle:
            return [len(blocks) * k * nbytes / sum(sum(b) for b in blocks) / 1e9 for blocks in times[name]]
        return [k * nbytes / sum(b) / 1e9 for blocks in times[name] for b in blocks]

    big = ("raw", "hmp", "raw_stream", "hmp_stream", "hmp_default_malloc", "pickle")
    blocks = {name: gbps(name, False) for name in big}
    cycles = {name: gbps(name, True) for name in big}
    cmp = {  # ratio key: per-pair ratios (adjacent blocks)
        "ratio_vs_raw_tcp": ratios(blocks["hmp"], blocks["raw"]),
        "ratio_vs_raw_tcp_stream": ratios(blocks["hmp_stream"], blocks["raw_stream"]),
        # per cycle: the cycle's acknowledged messages together against its stream / other blocks
        "ratio_acked_vs_raw_tcp_stream": ratios(cycles["hmp"], cycles["raw_stream"]),
        "ratio_raw_tcp_acked_vs_stream": ratios(cycles["raw"], cycles["raw_stream"]),
        "ratio_default_malloc_vs_raw_tcp": ratios(cycles["hmp_default_malloc"], cycles["raw"]),
        "ratio_vs_pickle": ratios(cycles["hmp"], cycles["pickle"]),
    }
    lat_us = [x * 1e6 for blocks_ in times["latency"] for b in blocks_ for x in b]
    lat_p50_blocks = [quantile([x * 1e6 for x in b], 0.5) for blocks_ in times["latency"] for b in blocks_]
    oneway_blocks = [args.small / b[0] for blocks_ in times["oneway"] for b in blocks_]

    gbps_key = {"raw": "raw_tcp_gbps", "hmp": "hmp_gbps", "raw_stream": "raw_tcp_stream_gbps",
                "hmp_stream": "hmp_stream_gbps", "hmp_default_malloc": "hmp_default_malloc_gbps",
                "pickle": "pickle_gbps"}
    res: dict[str, Any] = {"message_bytes": nbytes, "frame_bytes": args.frame_bytes}
    for name, key in gbps_key.items():
        res[key] = round(quantile(blocks[name], 0.5), 3)
    for key, rs in cmp.items():
        res[key] = round(quantile(rs, 0.5), 3)
        res[f"{key}_spread"] = spread(rs)
    res.update({
        "req_reply_p50_us": round(quantile(lat_us, 0.5), 1),
        "req_reply_p99_us": round(quantile(lat_us, 0.99), 1),
        "req_reply_p50_us_blocks": summary(lat_p50_blocks, 1),
        "oneway_msgs_per_s": round(quantile(oneway_blocks, 0.5)),
        "oneway_msgs_per_s_blocks": summary(oneway_blocks, 0),
        "peers": {name: {"gbps_blocks": summary(blocks[name]), "gbps_cycles": summary(cycles[name])}
                  for name in big},
        "method": {"cycles": args.rounds, "acked_pairs_per_cycle": args.repeats,
                   "stream_messages_per_ack": args.stream,
                   "stream_pairs_per_cycle": args.stream_pairs, "default_malloc_messages_per_block": args.repeats,
                   "latency_requests_per_block": n_lat, "oneway_messages_per_block": args.small,
                   "tcp_send": args.tcp_send, "pinned": args.pin},
        "samples": {"raw": len(blocks["raw"]), "hmp": len(blocks["hmp"]),
                    "raw_stream": len(blocks["raw_stream"]) * args.stream,
                    "hmp_stream": len(blocks["hmp_stream"]) * args.stream,
                    "hmp_default_malloc": len(blocks["hmp_default_malloc"]) * args.repeats,
                    "pickle": len(blocks["pickle"]), "latency": len(lat_us), "oneway_runs": len(oneway_blocks)},
        "load_avg_before": load_before, "load_avg_after": load_after, "cpu_during_run": cpu,
        "quiet": is_quiet(cpu),
        "wall_s": round(wall_s, 1),
    })
    if args.curve_pairs:
        curve_s = [x for blocks_ in times["curve"] for b in blocks_ for x in b]
        plain_s = [x for blocks_ in times["curve_plain"] for b in blocks_ for x in b]
        rs = ratios(curve_s, plain_s)  # adjacent pairs, each first in every other pair
        res.update({"curve_rtt_ms": round(quantile(curve_s, 0.5) * 1e3, 2),
                    "curve_plain_rtt_ms": round(quantile(plain_s, 0.5) * 1e3, 2),
                    "curve_rtt_ratio": round(quantile(rs, 0.5), 3), "curve_rtt_ratio_spread": spread(rs),
                    "curve_gbps": round(nbytes / quantile(curve_s, 0.5) / 1e9, 3)})
        res["method"]["curve_pairs_per_cycle"] = args.curve_pairs
        res["samples"]["curve_pairs"] = len(rs)
    report(res)
    if args.json:
        print(json.dumps(res))


def report(res: dict[str, Any]) -> None:
    m = res["method"]
    print(f"{res['message_bytes'] // MiB} MiB messages, {m['cycles']} cycles; a cycle: {m['acked_pairs_per_cycle']} "
          f"adjacent raw/hmp acknowledged message pairs, {m['stream_pairs_per_cycle']} raw/hmp pairs of streams of "
          f"{m['stream_messages_per_ack']} "
          f"messages per acknowledgement, then the rest; orders alternate. Raw TCP sender: {m['tcp_send']}"
          f"{'; senders on CPU 0, receivers on CPU 1' if m['pinned'] else ''}")
    print(f"{'peer (GB/s per block)':<36}{'median':>8}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}{'n':>5}")
    labels = {"raw": "raw TCP, acknowledged (1 message)", "hmp": "hmp tensor request (1 message)",
              "raw_stream": "raw TCP, streaming", "hmp_stream": "hmp tensor, streaming (one-way)",
              "hmp_default_malloc": "hmp requests, default malloc", "pickle": "pickle over TCP"}
    for name, label in labels.items():
        s = res["peers"][name]["gbps_blocks"]
        print(f"{label:<36}{s['median']:>8.3f}{s['min']:>8.3f}{s['p25']:>8.3f}{s['p75']:>8.3f}{s['max']:>8.3f}"
              f"{s['n']:>5}")
    print("\nratio: median of per-pair ratios [min .. max] (IQR, pairs)")
    for key in ("ratio_vs_raw_tcp", "ratio_vs_raw_tcp_stream", "ratio_acked_vs_raw_tcp_stream",
                "ratio_raw_tcp_acked_vs_stream", "ratio_default_malloc_vs_raw_tcp", "ratio_vs_pickle"):
        print(f"  {key:<34}{fmt_spread(res[f'{key}_spread'])}")
    print("  (target: ratio_vs_raw_tcp >= 0.8)")
    lb = res["req_reply_p50_us_blocks"]
    print(f"request/reply p50 = {res['req_reply_p50_us']:.0f} us, p99 = {res['req_reply_p99_us']:.0f} us "
          f"(per-block p50 {lb['min']:.0f} .. {lb['max']:.0f}; target p50 <= 250)")
    ob = res["oneway_msgs_per_s_blocks"]
    print(f"one-way small messages = {res['oneway_msgs_per_s']:,}/s (per block {ob['min']:,.0f} .. "
          f"{ob['max']:,.0f}; target >= 50,000)")
    if "curve_rtt_ratio" in res:
        print(f"CURVE: {res['message_bytes'] // MiB} MiB request round trip {res['curve_rtt_ms']:.1f} ms against "
              f"{res['curve_plain_rtt_ms']:.1f} ms plain ({res['curve_gbps']:.2f} GB/s); per-pair ratio CURVE/plain "
              f"{fmt_spread(res['curve_rtt_ratio_spread'])}")
    print(cpu_line(res.get("cpu_during_run"), res["load_avg_before"], res["load_avg_after"], res["wall_s"]))


if __name__ == "__main__":
    main()
