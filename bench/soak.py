"""Hostile-input soak: malformed and hostile messages against a live job while it trains.

Starts the default topology (conf/local.toml: a scheduler, two PS shards, two workers) through
``hmp.cluster.LocalCluster`` with its stop rules pushed out of reach, then sends ``--messages``
hostile messages (default 100,000) from several DEALER sockets at once to the scheduler and both
shards: garbage bytes, bad msgpack, headers of the wrong shape, unknown kinds, wrong versions and
field types, unknown or mismatched dtypes and shapes, too many frames, oversized headers, deep
nesting and thousands of containers, a wrong or missing job token, and strangers' ``shutdown``,
``leave`` and ``status`` (plus, with the job's own token, pushes and pulls of the wrong shapes or
unknown keys, which only the handlers can refuse). Meanwhile it probes the scheduler with valid
``status`` requests every 20 ms from another process and records their latency. When the storm is over it ends the
job (``finish``: final evaluation and report) and prints:

* replies by error code (and by kind for the few that are not errors), messages unanswered;
* the probe latency (median, p99, max) and probes that failed;
* each daemon's RSS before and after the storm (VmRSS from /proc) and its growth;
* the job's result: final accuracy, every daemon's exit code, whether training went on.

``--json`` prints one JSON object as the last line. ``--costs`` instead measures what the codec
spends to refuse (or accept) the most expensive single messages this soak can build, each the
median of many, without starting a job.

Run it alone on the machine (it starts five daemons): ``python bench/soak.py [--messages N] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import statistics
import sys
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import free_port  # noqa: E402  (bench/_stats.py)

from hmp.cluster import LocalCluster  # noqa: E402
from hmp.errors import HmpError, ProtocolError  # noqa: E402
from hmp.messages import PROTOCOL_VERSION, Status  # noqa: E402
from hmp.transport.codec import decode  # noqa: E402
from hmp.transport.endpoint import Client  # noqa: E402

#: Sockets per target: the scheduler gets more (it is the one the probe watches)
SOCKETS = {"scheduler": 4, "ps0": 2, "ps1": 2}
#: Requests a storm socket leaves unanswered before it waits for replies (one-way messages do not count)
WINDOW = 256
#: Variants whose request id cannot be read: never answered, by the one-way rule (docs/protocol.md)
UNANSWERABLE = frozenset({"garbage", "bad_msgpack", "not_a_map", "bad_rid", "one_way_garbage"})
#: Rare and costly variants (thousands of frames, 1 MiB headers) are one message in this many
RARE = 500
PROBE_EVERY_S = 0.02



def write_config(folder: Path) -> tuple[Path, dict[str, str]]:
    """conf/local.toml with its own ports and report folder, and stop rules out of reach (the soak ends it)."""
    text = (ROOT / "conf" / "local.toml").read_text()
    ports = {n: free_port() for n in ("scheduler", "ps0", "ps1")}
    text = text.replace('report_dir = "runs/{name}"', f'report_dir = "{folder / "run"}"')
    text = text.replace("tcp://127.0.0.1:47100", f"tcp://127.0.0.1:{ports['scheduler']}")
    for ps in ("ps0", "ps1"):
        text = re.sub(rf'(id = "{ps}"\nrole = "ps"\nbind = )"tcp://127.0.0.1:0"',
                      rf'\1"tcp://127.0.0.1:{ports[ps]}"', text)
    text = text.replace("epochs = 30", "epochs = 100000").replace("target_accuracy = 0.95", "target_accuracy = 1.0")
    text = text.replace("max_seconds = 240", "max_seconds = 900")
    path = folder / "soak.toml"
    path.write_text(text)
    return path, {n: f"tcp://127.0.0.1:{p}" for n, p in ports.items()}


# ----------------------------------------------------------------------------- the hostile catalogue

def _header(kind: str = "status", rid: int = 1, fields: Any = None, tensors: Any = None, **extra: Any) -> dict:
    h = {"version": PROTOCOL_VERSION, "kind": kind, "sender": "stranger", "rid": rid,
         "fields": {} if fields is None else fields, "tensors": [] if tensors is None else tensors}
    h.update(extra)
    return h


def _nested(depth: int) -> list:
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


def catalogue(token: str) -> list[tuple[str, list[bytes], bool]]:
    """(name, frames, rare) for every hostile variant; the request id (1) is rewritten per message."""
    p = msgpack.packb
    f32 = {"field": "grads", "dtype": "float32", "shape": [4], "frames": 1}
    push_fields = {"keys": [0], "version": 0, "samples": 1}
    rng = random.Random(0)
    out = [
        ("garbage", [bytes(rng.getrandbits(8) for _ in range(64))], False),
        ("bad_msgpack", [b"\xc1\xc1\xc1"], False),
        ("truncated_msgpack", [p(_header())[:-3]], False),
        ("not_a_map", [p([1, 2, 3])], False),
        ("missing_keys", [p({"version": PROTOCOL_VERSION, "kind": "status", "rid": 1})], False),
        ("unknown_kind", [p(_header(kind="teleport"))], False),
        ("bad_version", [p(_header(version=99))], False),
        ("bad_rid", [p(_header(rid=-5))], False),
        ("int_map_key", [p({**_header(), "fields": {1: 2}}, strict_types=False)], False),
        ("wrong_field_type", [p(_header(kind="pull", fields={"keys": "abc"}))], False),
        ("unknown_field", [p(_header(fields={"color": 3}))], False),
        ("bad_dtype", [p(_header(kind="push", fields=push_fields, tensors=[{**f32, "dtype": "complex64"}])),
                       b"\0" * 16], False),
        ("shape_mismatch", [p(_header(kind="push", fields=push_fields, tensors=[{**f32, "shape": [5]}])),
                            b"\0" * 16], False),
        ("frames_mismatch", [p(_header(kind="push", fields=push_fields, tensors=[{**f32, "frames": 3}])),
                             b"\0" * 16], False),
        ("stray_frames", [p(_header()), b"x", b"y"], False),
        ("rank_9", [p(_header(kind="push", fields=push_fields, tensors=[{**f32, "shape": [1] * 9}])), b"\0" * 4],
         False),
        ("huge_shape", [p(_header(kind="push", fields=push_fields, tensors=[{**f32, "shape": [2**40, 2**40]}]))],
         False),
        ("deep_nesting", [p(_header(kind="tensors", fields={"name": "x", "meta": {"x": _nested(200)}}))], False),
        ("many_containers", [p(_header(kind="tensors", fields={"name": "x", "meta": {"x": [[]] * 9000}}))], False),
        ("long_string", [p(_header(sender="s" * 70000))], False),
        ("one_way_garbage", [p(_header(kind="teleport", rid=0))], False),
        ("wrong_token_status", [p(_header(job_token="not-this-job"))], False),
        ("no_token_status", [p(_header())], False),
        ("stranger_shutdown", [p(_header(kind="shutdown", fields={"reason": "stranger"}))], False),
        ("stranger_shutdown_wrong_token", [p(_header(kind="shutdown", fields={"reason": "x"}, job_token="nope"))],
         False),
        ("stranger_leave", [p(_header(kind="leave", fields={"reason": "stranger"}))], False),
        # with the job's own token: only the handlers can refuse these
        ("insider_push_wrong_size", [p(_header(kind="push", fields=push_fields, tensors=[f32], job_token=token)),
                                     b"\0" * 16], False),
        ("insider_push_unknown_key", [p(_header(kind="push", fields={**push_fields, "keys": [10**6]},
                                                tensors=[f32], job_token=token)), b"\0" * 16], False),
        ("insider_pull_unknown_key", [p(_header(kind="pull", fields={"keys": [10**6]}, job_token=token))], False),
        # rare: each costs the receiver more (thousands of parts, a megabyte of header)
        ("too_many_frames", [p(_header())] + [b""] * 5000, True),
        ("oversized_header", [p({**_header(), "pad": b"\0" * (1 << 20)})], True),
    ]
    return out


def _with_rid(frames: list[bytes], rid: int) -> list[bytes]:
    """The frames with request id ``rid`` (< 128) where the header is readable (msgpack's rid 1 is byte 0x01)."""
    h = frames[0]
    i = h.find(b"\xa3rid\x01")
    if i < 0 or rid >= 128:
        return frames
    return [h[:i + 4] + bytes([rid]) + h[i + 5:], *frames[1:]]


class Storm:
    """Sends the catalogue round-robin from several DEALER sockets, counting the replies (in its own
    process: a thread would share the probe's interpreter lock and count its own pauses as the job's)."""

    def __init__(self, targets: dict[str, str], token: str, messages: int, rare_every: int = RARE) -> None:
        self.targets = targets
        self.rare_every = rare_every
        self.messages = messages
        self.variants = catalogue(token)
        self.sent = collections.Counter()  # variant -> sent
        self.replies = collections.Counter()  # error code (or reply kind) -> count
        self.replies_by_target: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.expected = 0  # requests sent with a non-zero rid
        self.replied = collections.Counter()  # variant -> replies (the rid names the variant)
        self.undecodable_replies = 0
        self.elapsed_s = 0.0
        self.error: str = ""

    def summary(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed_s, "sent": dict(self.sent), "replies": dict(self.replies),
                "replied": dict(self.replied), "expected": self.expected,
                "replies_by_target": {t: dict(c) for t, c in self.replies_by_target.items()},
                "undecodable_replies": self.undecodable_replies, "error": self.error}

    def run(self) -> None:
        ctx = zmq.Context()
        socks: list[tuple[str, zmq.Socket]] = []
        try:
            for name, n in SOCKETS.items():
                for _ in range(n):
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.setsockopt(zmq.SNDHWM, 4096)
                    s.connect(self.targets[name])
                    socks.append((name, s))
            self._storm(socks)
        except Exception as exc:  # reported, not raised: the job must still be ended
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            for _, s in socks:
                s.close()
            ctx.term()

    def _drain(self, name: str, s: zmq.Socket, outstanding: dict[int, int], idx: int, timeout_ms: int) -> None:
        if not s.poll(timeout_ms):
            return
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            outstanding[idx] -= 1
            try:
                msg = decode(frames)
                code = getattr(msg, "code", None) or msg.kind.value
            except ProtocolError:
                self.undecodable_replies += 1
                continue
            self.replies[code] += 1
            self.replies_by_target[name][code] += 1
            if 1 <= msg.rid <= len(self.variants):
                self.replied[self.variants[msg.rid - 1][0]] += 1

    def _storm(self, socks: list[tuple[str, zmq.Socket]]) -> None:
        rid_of = {v[0]: i + 1 for i, v in enumerate(self.variants)}
        common = [v for v in self.variants if not v[2]]
        rare = [v for v in self.variants if v[2]]
        outstanding = dict.fromkeys(range(len(socks)), 0)
        t0 = time.perf_counter()
        for i in range(self.messages):
            idx = i % len(socks)
            name, s = socks[idx]
            every = self.rare_every
            variant = rare[(i // every) % len(rare)] if every and i % every == every - 1 else common[i % len(common)]
            vname, frames, _ = variant
            rid = rid_of[vname]
            one_way = vname in UNANSWERABLE
            while outstanding[idx] >= WINDOW:
                self._drain(name, s, outstanding, idx, 1000)
            s.send_multipart(_with_rid(frames, rid), copy=False)
            self.sent[vname] += 1
            if not one_way:
                outstanding[idx] += 1
                self.expected += 1
            if i % 64 == 0:
                self._drain(name, s, outstanding, idx, 0)
        self.elapsed_s = time.perf_counter() - t0
        deadline = time.monotonic() + 10.0  # stragglers
        while any(outstanding.values()) and time.monotonic() < deadline:
            for idx, (name, s) in enumerate(socks):
                if outstanding[idx]:
                    self._drain(name, s, outstanding, idx, 20)


def _storm_process(targets: dict[str, str], token: str, messages: int, rare_every: int, conn: Any) -> None:
    """The storm's process: say it is starting (the probes count from then), run it, send back its summary."""
    storm = Storm(targets, token, messages, rare_every)
    conn.send("starting")
    storm.run()
    conn.send(storm.summary())
    conn.close()


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _pids(cluster: LocalCluster) -> dict[str, int]:
    return {nid: p.pid for nid, p in cluster.procs.items()}


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def soak(messages: int, rare_every: int = RARE) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hmp-soak-") as tmp:
        cfg_path, targets = write_config(Path(tmp))
        result: dict[str, Any] = {"messages": messages, "rare_every": rare_every}
        async with LocalCluster(str(cfg_path)) as cluster:
            # Training under way: every member up and a worker reporting.
            t_start = time.monotonic()
            while True:
                st = await cluster.status(timeout_s=2.0)
                if st and st.get("workers") and all(v == "live" for v in (st.get("members") or {}).values()):
                    break
                if time.monotonic() - t_start > 120:
                    raise HmpError(f"the job did not start training within 120 s: {st}")
                await asyncio.sleep(0.2)
            pids = _pids(cluster)
            rss_before = {n: _rss_kib(p) for n, p in pids.items()}
            status_before = await cluster.status()
            mp = multiprocessing.get_context("spawn")
            receive, send = mp.Pipe(duplex=False)
            storm_proc = mp.Process(target=_storm_process, name="storm",
                                    args=(targets, cluster.job_token, messages, rare_every, send))
            # As the launcher (with the job's token): the one outsider the job lets ask for its status.
            probe = Client(targets["scheduler"], name="launcher", timeout_s=5.0, job_token=cluster.job_token)
            await probe.connect()
            latencies: list[float] = []
            probe_errors = collections.Counter()
            storm_proc.start()
            send.close()
            summary: dict[str, Any] = {}
            try:
                if not await asyncio.to_thread(receive.poll, 60):  # its imports take a few seconds
                    raise HmpError("the storm process did not start within 60 s")
                receive.recv()
                while storm_proc.is_alive() and not receive.poll():
                    t0 = time.perf_counter()
                    try:
                        await probe.request(Status())
                        latencies.append(time.perf_counter() - t0)
                    except HmpError as exc:
                        probe_errors[getattr(exc, "code", type(exc).__name__)] += 1
                    await asyncio.sleep(PROBE_EVERY_S)
                if await asyncio.to_thread(receive.poll, 30):
                    summary = receive.recv()
            finally:
                await asyncio.to_thread(storm_proc.join, 30)
                if storm_proc.is_alive():
                    storm_proc.terminate()
                    storm_proc.join(5)
                receive.close()
                await probe.close()
            rss_after = {n: _rss_kib(p) for n, p in pids.items()}
            status_after = await cluster.status()
            alive_after_storm = {n: p.returncode is None for n, p in cluster.procs.items()}
            # End the job as a stop rule would: final evaluation, report, clean exits.
            report: dict[str, Any] = {}
            job_error = ""
            try:
                await cluster.finish("soak over")
                report = await cluster.train(timeout_s=120)
            except HmpError as exc:
                job_error = f"{type(exc).__name__}: {exc}"
            exit_codes = {n: p.returncode for n, p in cluster.procs.items()}
            log_lines = {}
            for n in pids:
                path = cluster.log_dir / f"{n}.log"
                log_lines[n] = len(path.read_bytes().splitlines()) if path.exists() else None
        def updates(st: dict[str, Any] | None) -> int:  # the workers' updates so far (their latest reports)
            return int(sum(w.get("updates", 0) for w in ((st or {}).get("workers") or {}).values()))
        sent, replied = summary.get("sent", {}), summary.get("replied", {})
        replies, elapsed = collections.Counter(summary.get("replies", {})), summary.get("elapsed_s", 0.0)
        result.update({
            "storm_s": round(elapsed, 2),
            "rate_per_s": round(sum(sent.values()) / elapsed) if elapsed else 0,
            "sent": sum(sent.values()), "sent_by_variant": sent,
            "replies_by_code": dict(replies.most_common()),
            "replies_by_target": {t: dict(collections.Counter(c).most_common())
                                  for t, c in summary.get("replies_by_target", {}).items()},
            "unanswered": summary.get("expected", 0) - sum(replies.values()) - summary.get("undecodable_replies", 0),
            "undecodable_replies": summary.get("undecodable_replies", 0),
            "storm_error": summary.get("error", "") if summary else "the storm process sent no summary",
            "unanswered_by_variant": {v: n - replied.get(v, 0) for v, n in sent.items()
                                      if v not in UNANSWERABLE and n > replied.get(v, 0)},
            "unanswerable_sent": sum(n for v, n in sent.items() if v in UNANSWERABLE),
            "probe": {"count": len(latencies), "errors": dict(probe_errors),
                      "median_ms": round(statistics.median(latencies) * 1e3, 2) if latencies else None,
                      "p99_ms": round(_quantile(latencies, 0.99) * 1e3, 2) if latencies else None,
                      "max_ms": round(max(latencies) * 1e3, 2) if latencies else None},
            "rss_mib": {n: {"before": round((rss_before[n] or 0) / 1024, 1),
                            "after": round((rss_after[n] or 0) / 1024, 1),
                            "growth": round(((rss_after[n] or 0) - (rss_before[n] or 0)) / 1024, 1)} for n in pids},
            "alive_after_storm": alive_after_storm,
            "log_lines": log_lines,  # each daemon's whole log, storm included
            "worker_updates": {"before": updates(status_before), "after": updates(status_after)},
            "job": {"error": job_error, "exit_codes": exit_codes,
                    "accuracy": (report.get("final") or {}).get("test_accuracy"),
                    "stop_reason": (report.get("final") or {}).get("stop_reason")},
        })
        return result


# ----------------------------------------------------------------------------- costs of single messages

def costs(repeats: int = 50) -> list[dict[str, Any]]:
    """Median time the codec takes to decode or refuse each of the most expensive messages built here."""
    from hmp.transport.codec import encode
    from hmp.messages import Tensors
    import torch
    p = msgpack.packb

    def tensors_header(**kw: Any) -> bytes:
        return p(_header(kind="tensors", fields={"name": "a", **kw.pop("fields", {})}, **kw))

    desc1 = {"field": "tensors", "dtype": "float32", "shape": [1], "frames": 1}
    empty = {"field": "tensors", "dtype": "float32", "shape": [0], "frames": 0}
    cases = {
        "1M empty arrays in meta (1 MiB header)": [tensors_header(fields={"meta": {"x": [[[]] * 9000] * 110}})],
        "2300 empty arrays in meta (just over the count)": [tensors_header(fields={"meta": {"x": [[]] * 2300}})],
        "2200 empty arrays in meta (accepted)": [tensors_header(fields={"meta": {"x": [[]] * 2200}})],
        "nesting 1000 deep": [tensors_header(fields={"meta": {"x": _nested(1000)}})],
        "nesting 100k deep (raw bytes)": [b"\x91" * 100_000 + b"\x90"],
        "1024 descriptors + 1024 frames (accepted)": [tensors_header(tensors=[desc1] * 1024)] + [b"1234"] * 1024,
        "1024 empty tensors (accepted)": [tensors_header(tensors=[empty] * 1024)],
        "1025 descriptors": [tensors_header(tensors=[desc1] * 1025)] + [b"1234"] * 1025,
        "5000 descriptors": [tensors_header(tensors=[desc1] * 5000)] + [b"1234"] * 4000,
        "4096 empty frames, none described": [tensors_header()] + [b""] * 4096,
        "4097 empty frames": [tensors_header()] + [b""] * 4097,
        "1 MiB header of junk": [b"\xff" * (1 << 20)],
        "1 MiB bytes in meta (accepted)": [tensors_header(fields={"meta": {"x": b"x" * ((1 << 20) - 200)}})],
        "65k-char sender (accepted)": [tensors_header(sender="s" * 65536)],
        "a heartbeat (accepted)": [p(_header(kind="heartbeat", fields={"step": 1}))],
        "a 16-chunk push (accepted)": [bytes(memoryview(f)) for f in encode(
            Tensors(name="x", tensors=tuple(torch.zeros(4096) for _ in range(16))))],
    }
    rows = []
    for name, frames in cases.items():
        times, outcome = [], ""
        for _ in range(repeats):
            t0 = time.perf_counter()
            try:
                decode(frames)
                outcome = "accepted"
            except ProtocolError as exc:
                outcome = exc.code
            times.append(time.perf_counter() - t0)
        rows.append({"message": name, "outcome": outcome, "median_ms": round(statistics.median(times) * 1e3, 3),
                     "max_ms": round(max(times) * 1e3, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000, help="hostile messages to send (default 100000)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--rare-every", type=int, default=RARE,
                    help=f"one message in this many is a costly one (5,000 frames or a 1 MiB header; default {RARE}, "
                         "0: none)")
    ap.add_argument("--costs", action="store_true", help="measure single-message decode costs instead (no job)")
    args = ap.parse_args()
    if args.messages < 1 or args.rare_every < 0:
        ap.error("--messages must be >= 1 and --rare-every >= 0")
    if args.costs:
        rows = costs()
        for r in rows:
            print(f"{r['message']:48s} {r['outcome']:10s} median {r['median_ms']:8.3f} ms  max {r['max_ms']:8.3f} ms")
        if args.json:
            print(json.dumps({"costs": rows}))
        return
    res = asyncio.run(soak(args.messages, args.rare_every))
    print(f"sent {res['sent']} hostile messages in {res['storm_s']} s ({res['rate_per_s']}/s) to the scheduler and "
          f"both shards from {sum(SOCKETS.values())} sockets; storm error: {res['storm_error'] or 'none'}")
    print("replies by code:", ", ".join(f"{k} {v}" for k, v in res["replies_by_code"].items()))
    print(f"unanswered requests: {res['unanswered']} ({res['unanswered_by_variant'] or 'none'}; besides "
          f"{res['unanswerable_sent']} sent without a readable request id, never answered by design); "
          f"undecodable replies: {res['undecodable_replies']}")
    pr = res["probe"]
    print(f"status probe: {pr['count']} ok, errors {pr['errors'] or 0}; median {pr['median_ms']} ms, "
          f"p99 {pr['p99_ms']} ms, max {pr['max_ms']} ms")
    for n, r in res["rss_mib"].items():
        print(f"RSS {n:10s} {r['before']:8.1f} -> {r['after']:8.1f} MiB ({r['growth']:+.1f})")
    print(f"workers' updates {res['worker_updates']['before']} -> {res['worker_updates']['after']} during the storm; "
          f"alive after it: {res['alive_after_storm']}")
    print("log lines (whole run):", ", ".join(f"{n} {c}" for n, c in res["log_lines"].items()))
    job = res["job"]
    print(f"job: accuracy {job['accuracy']}, stop reason {job['stop_reason']!r}, exit codes {job['exit_codes']}"
          + (f", error: {job['error']}" if job["error"] else ""))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
