"""Transport benchmark: hmp against a raw TCP socket pair and pickle, on loopback.

Measured in one run, each peer in its own processes:
  * raw TCP: 64 MiB messages, length-prefixed, received with recv_into a preallocated buffer
    (the physical limit here), acknowledged with one byte;
  * hmp: a 64 MiB float32 tensor as a ``Tensors`` request, answered with ``Ack``. Both hmp
    processes call ``tune_malloc()`` first, as daemons should (see hmp.transport.endpoint); the
    same run without it is reported as ``hmp_default_malloc_gbps``;
  * pickle: the same tensor pickled over raw TCP and unpickled (the naive way);
  * small messages: one-way messages/s and request/reply latency (p50, p99), from every hmp run.

Peers alternate within each round (raw, hmp, raw, hmp with default malloc, pickle) so that machine
noise hits all of them alike; figures are medians over all rounds.

    python bench/transport.py [--json] [--quick] [--repeats N] [--frame-bytes B]

With ``--json`` the last line is one JSON object with every figure and ``ratio_vs_raw_tcp``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import pickle
import socket
import statistics
import struct
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))

from hmp.messages import Ack, Heartbeat, Kind, Tensors  # noqa: E402
from hmp.transport.codec import DEFAULT_FRAME_BYTES  # noqa: E402
from hmp.transport.endpoint import Client, Server, tune_malloc  # noqa: E402

MiB = 1 << 20


# ----------------------------------------------------------------------------- raw TCP peers

def _recv_exact_into(conn: socket.socket, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        n = conn.recv_into(view[pos:])
        if n == 0:
            raise ConnectionError("peer closed")
        pos += n


def _tcp_receiver(port_q: mp.Queue, mode: str) -> None:
    torch.set_num_threads(1)
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(0)
    hdr = bytearray(8)
    while True:
        try:
            _recv_exact_into(conn, memoryview(hdr))
        except ConnectionError:
            break
        (n,) = struct.unpack("!Q", hdr)
        if len(buf) < n:
            buf = bytearray(n)
        _recv_exact_into(conn, memoryview(buf)[:n])
        if mode == "pickle":
            pickle.loads(memoryview(buf)[:n])  # the naive receiver's cost: unpickling the tensor
        conn.sendall(b"k")
    conn.close()
    srv.close()


def bench_tcp(nbytes: int, repeats: int, mode: str) -> list[float]:
    """Seconds per acknowledged message of ``nbytes`` (raw bytes, or a pickled tensor)."""
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_tcp_receiver, args=(q, mode), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=30)
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tensor = torch.randn(nbytes // 4)
        payload = memoryview(tensor.numpy()).cast("B")
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            data = pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL) if mode == "pickle" else payload
            conn.sendall(struct.pack("!Q", len(data)))
            conn.sendall(data)
            if conn.recv(1) != b"k":
                raise RuntimeError("receiver failed")
            if i:  # first round warms up buffers
                times.append(time.perf_counter() - t0)
        conn.close()
        return times
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()


# ----------------------------------------------------------------------------- hmp peers

def _hmp_receiver(addr_q: mp.Queue, frame_bytes: int, tune: bool) -> None:
    import uvloop

    torch.set_num_threads(1)
    if tune:
        tune_malloc()  # before the first socket, as a daemon does at start

    async def main() -> None:
        stop = asyncio.Event()
        count = {"oneway": 0}

        async def on_tensors(msg, peer):
            return Ack(detail=str(sum(t.numel() for t in msg.tensors)))

        async def on_heartbeat(msg, peer):
            if msg.rid == 0:  # one-way
                count["oneway"] += 1
                return None
            return Ack(detail=str(count["oneway"]))

        async def on_shutdown(msg, peer):
            stop.set()
            return Ack()

        handlers = {Kind.TENSORS: on_tensors, Kind.HEARTBEAT: on_heartbeat, Kind.SHUTDOWN: on_shutdown}
        async with Server("tcp://127.0.0.1:0", handlers, name="bench", frame_bytes=frame_bytes) as srv:
            addr_q.put(srv.address)
            await asyncio.wait_for(stop.wait(), 600)
            await asyncio.sleep(0.05)

    uvloop.run(main())


async def _hmp_client(address: str, nbytes: int, repeats: int, frame_bytes: int, small_n: int) -> dict:
    from hmp.messages import Shutdown

    out: dict = {}
    async with Client(address, name="bench", frame_bytes=frame_bytes, timeout_s=120) as client:
        tensor = torch.randn(nbytes // 4)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            reply = await client.request(Tensors(name="g", tensors=(tensor,)))
            if int(reply.detail) != tensor.numel():
                raise RuntimeError("receiver saw the wrong size")
            if i:
                times.append(time.perf_counter() - t0)
        out["big"] = times
        # request/reply latency, one at a time
        lat = []
        for _ in range(small_n // 5):
            t0 = time.perf_counter()
            await client.request(Heartbeat(step=1))
            lat.append(time.perf_counter() - t0)
        out["latency"] = lat
        # one-way small messages; the final request is ordered after them on the same connection
        t0 = time.perf_counter()
        for i in range(small_n):
            await client.send(Heartbeat(step=i))
        reply = await client.request(Heartbeat(step=-1))
        elapsed = time.perf_counter() - t0
        if int(reply.detail) != small_n:
            raise RuntimeError(f"server counted {reply.detail} of {small_n} one-way messages")
        out["oneway_per_s"] = small_n / elapsed
        await client.request(Shutdown(reason="bench done"))
    return out


def _hmp_sender(address: str, out_q: mp.Queue, nbytes: int, repeats: int, frame_bytes: int, small_n: int,
                tune: bool) -> None:
    import uvloop

    torch.set_num_threads(1)
    if tune:
        tune_malloc()
    out_q.put(uvloop.run(_hmp_client(address, nbytes, repeats, frame_bytes, small_n)))


def bench_hmp(nbytes: int, repeats: int, frame_bytes: int, small_n: int, tune: bool) -> dict:
    """Both hmp peers in fresh processes, so that ``tune_malloc`` never touches this one."""
    q: mp.Queue = mp.Queue()
    out_q: mp.Queue = mp.Queue()
    recv = mp.Process(target=_hmp_receiver, args=(q, frame_bytes, tune), daemon=True)
    recv.start()
    send = None
    try:
        address = q.get(timeout=60)
        send = mp.Process(target=_hmp_sender, args=(address, out_q, nbytes, repeats, frame_bytes, small_n, tune),
                          daemon=True)
        send.start()
        return out_q.get(timeout=600)
    finally:
        for proc in (send, recv):
            if proc is not None:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    ap.add_argument("--repeats", type=int, default=12, help="64 MiB transfers per peer per round")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of all peers (medians over all)")
    ap.add_argument("--megabytes", type=int, default=64, help="size of the large message (MiB)")
    ap.add_argument("--frame-bytes", type=int, default=DEFAULT_FRAME_BYTES, help="hmp frame size (bytes)")
    ap.add_argument("--small", type=int, default=20000, help="small messages for the rate test")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.small = 4, 1, 5000
    torch.set_num_threads(1)
    mp.set_start_method("spawn", force=True)
    nbytes = args.megabytes * MiB

    raw, hmp_big, hmp_plain, pick, lat, oneway = [], [], [], [], [], []
    for _ in range(args.rounds):  # alternate peers so that machine noise hits all of them alike
        raw += bench_tcp(nbytes, args.repeats, "raw")
        h = bench_hmp(nbytes, args.repeats, args.frame_bytes, args.small, tune=True)
        hmp_big += h["big"]
        lat += h["latency"]
        oneway.append(h["oneway_per_s"])
        raw += bench_tcp(nbytes, args.repeats, "raw")
        h = bench_hmp(nbytes, args.repeats, args.frame_bytes, args.small, tune=False)
        hmp_plain += h["big"]
        lat += h["latency"]
        oneway.append(h["oneway_per_s"])
        pick += bench_tcp(nbytes, max(2, args.repeats // 3), "pickle")

    gbps = lambda ts: nbytes / statistics.median(ts) / 1e9  # noqa: E731
    lat_us = np.array(sorted(x * 1e6 for x in lat))
    res = {
        "message_bytes": nbytes,
        "frame_bytes": args.frame_bytes,
        "raw_tcp_gbps": round(gbps(raw), 3),
        "hmp_gbps": round(gbps(hmp_big), 3),
        "hmp_default_malloc_gbps": round(gbps(hmp_plain), 3),
        "pickle_gbps": round(gbps(pick), 3),
        "ratio_vs_raw_tcp": round(gbps(hmp_big) / gbps(raw), 3),
        "ratio_default_malloc_vs_raw_tcp": round(gbps(hmp_plain) / gbps(raw), 3),
        "ratio_vs_pickle": round(gbps(hmp_big) / gbps(pick), 3),
        "req_reply_p50_us": round(float(lat_us[len(lat_us) // 2]), 1),
        "req_reply_p99_us": round(float(lat_us[int(len(lat_us) * 0.99)]), 1),
        "oneway_msgs_per_s": round(statistics.median(oneway)),
        "samples": {"raw": len(raw), "hmp": len(hmp_big), "hmp_default_malloc": len(hmp_plain),
                    "pickle": len(pick), "latency": len(lat), "oneway_runs": len(oneway)},
    }
    print(f"{'peer':<28}{'GB/s (median)':>14}")
    print(f"{'raw TCP, 64 MiB':<28}{res['raw_tcp_gbps']:>14.2f}")
    print(f"{'hmp, 64 MiB tensor':<28}{res['hmp_gbps']:>14.2f}")
    print(f"{'  same, default malloc':<28}{res['hmp_default_malloc_gbps']:>14.2f}")
    print(f"{'pickle over TCP':<28}{res['pickle_gbps']:>14.2f}")
    print(f"ratio_vs_raw_tcp = {res['ratio_vs_raw_tcp']:.3f}  (target >= 0.8; default malloc: "
          f"{res['ratio_default_malloc_vs_raw_tcp']:.3f})")
    print(f"request/reply p50 = {res['req_reply_p50_us']:.0f} us, p99 = {res['req_reply_p99_us']:.0f} us (target p50 <= 250)")
    print(f"one-way small messages = {res['oneway_msgs_per_s']:,}/s (target >= 50,000)")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
