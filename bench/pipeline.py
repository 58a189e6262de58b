"""Planned pipeline vs data parallel for the click model on this machine.

    python bench/pipeline.py [--config conf/click_pipeline.toml] [--json]
    python bench/pipeline.py --message-overhead [--json]

Runs the config as the scheduler plans it (a pipeline of stages over the workers, parameters on
the PS), then the same model, data, optimizer, batch size and processes as a data-parallel job
(``[placement] enabled = false``: every worker trains the whole model and pushes to the PS).
Throughput: pipeline, the samples/s through the last stage under the last plan (what the run
report measures); data parallel, the sum over workers of samples per second of training. The last
line is JSON.

``--message-overhead`` measures instead what the cost model's ``message_overhead_s`` stands for:
the fixed cost of one hmp message between two processes on this host (an ``activations`` message
with a tiny tensor to a server in another process): the round trip of a request and its ``ack``
(median of 2,000, after 200 untimed), halved, and the one-way rate of a stream of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hmp.cluster import LocalCluster  # noqa: E402

OVERHEAD_ROUNDS, OVERHEAD_WARMUP, STREAM = 2000, 200, 5000


def variant(config: Path, out: Path, *, pipeline: bool) -> Path:
    """The config with placement on or off and its own report dir."""
    text = config.read_text()
    text = re.sub(r"(?m)^enabled = \w+", f"enabled = {'true' if pipeline else 'false'}", text)
    text = re.sub(r'(?m)^report_dir = .*$', f'report_dir = "{out}"', text)
    path = out.parent / f"{out.name}.toml"
    path.write_text(text)
    return path


async def run(path: Path) -> dict:
    async with LocalCluster(path) as cluster:
        return await cluster.train(timeout_s=180)


def pipeline_figures(report: dict) -> dict:
    last = report["pipeline"]["plans"][-1]
    return {"samples_per_s": last["measured"][-1]["samples_per_s"],
            "predicted_samples_per_s": last["predicted_throughput"],
            "stages": [{"layers": s["layers"], "resource": s["resource"], "workers": s["workers"],
                        "predicted": round(s["predicted_samples_per_s"]), "measured": round(m["samples_per_s"]),
                        "compute_only": round(m["compute_samples_per_s"]),
                        "time_shares": {k: round(m.get(f"{k}_fraction", 0.0), 3) for k in ("busy", "push", "idle")}}
                       for s, m in zip(last["stages"], last["measured"])],
            "cost": last["cost"], "test_accuracy": report["final"]["test_accuracy"],
            "elapsed_s": report["final"]["elapsed_s"]}


def _echo_server(conn) -> None:
    """Child process: serve ``activations`` (ack a request, count a one-way message) until told to stop."""
    from hmp.messages import Ack, Kind
    from hmp.transport.endpoint import Server

    async def serve() -> None:
        seen = 0

        async def on_act(msg, peer):
            nonlocal seen
            seen += 1
            return Ack(detail=str(seen)) if msg.rid else None

        async with Server("tcp://127.0.0.1:0", {Kind.ACTIVATIONS: on_act}, name="echo") as srv:
            conn.send(srv.address)
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(serve())


async def _time_messages(address: str) -> dict:
    import statistics
    import time

    import torch

    from hmp.messages import Activations
    from hmp.transport.endpoint import Client

    msg = Activations(sender="bench", plan=1, step=0, micro_batch=0, values=torch.zeros(4, 4), labels=torch.zeros(4, dtype=torch.int64))
    async with Client(address, name="bench") as c:
        rtts = []
        for k in range(OVERHEAD_WARMUP + OVERHEAD_ROUNDS):
            t0 = time.perf_counter()
            await c.request(msg)
            if k >= OVERHEAD_WARMUP:
                rtts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(STREAM):
            await c.send(msg)
        await c.request(msg)  # acked after every one-way message before it was handled
        stream_s = (time.perf_counter() - t0) / (STREAM + 1)
    return {"round_trip_median_us": statistics.median(rtts) * 1e6,
            "round_trip_p90_us": statistics.quantiles(rtts, n=10)[-1] * 1e6,
            "message_overhead_us": statistics.median(rtts) / 2 * 1e6,
            "one_way_stream_us_per_message": stream_s * 1e6}


def message_overhead() -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo_server, args=(child,), daemon=True)
    proc.start()
    try:
        address = parent.recv()
        return asyncio.run(_time_messages(address))
    finally:
        parent.send("stop")
        proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "conf/click_pipeline.toml"))
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--message-overhead", action="store_true",
                    help="measure the fixed cost of one hmp message between two processes instead")
    args = ap.parse_args()
    if args.message_overhead:
        res = {"bench": "message_overhead", **message_overhead()}
        if not args.json:
            print(f"request round trip {res['round_trip_median_us']:.0f} us (median; p90 "
                  f"{res['round_trip_p90_us']:.0f}), per message {res['message_overhead_us']:.0f} us; one-way "
                  f"stream {res['one_way_stream_us_per_message']:.0f} us per message")
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory(prefix="hmp-bench-pipeline-") as tmp:
        tmpd = Path(tmp)
        pipe = pipeline_figures(asyncio.run(run(variant(Path(args.config), tmpd / "pipeline", pipeline=True))))
        dp_report = asyncio.run(run(variant(Path(args.config), tmpd / "data_parallel", pipeline=False)))
    dp = {"samples_per_s": sum(w["samples_per_s"] for w in dp_report["workers"].values()),
          "workers": len(dp_report["workers"]), "test_accuracy": dp_report["final"]["test_accuracy"],
          "elapsed_s": dp_report["final"]["elapsed_s"]}
    result = {"bench": "pipeline", "config": args.config, "pipeline": pipe, "data_parallel": dp,
              "pipeline_over_data_parallel": pipe["samples_per_s"] / dp["samples_per_s"]}
    if not args.json:
        print(f"pipeline      {pipe['samples_per_s']:9.0f} samples/s (cost model predicted "
              f"{pipe['predicted_samples_per_s']:.0f}), test accuracy {pipe['test_accuracy']:.3f}")
        for s in pipe["stages"]:
            print(f"  layers {s['layers'][0]}-{s['layers'][1]} on {s['resource']} {s['workers']}: predicted "
                  f"{s['predicted']}, measured {s['measured']}, compute only {s['compute_only']} samples/s; "
                  f"wall time: {s['time_shares']}")
        print(f"data parallel {dp['samples_per_s']:9.0f} samples/s on {dp['workers']} workers, test accuracy "
              f"{dp['test_accuracy']:.3f}")
        print(f"ratio pipeline / data parallel: {result['pipeline_over_data_parallel']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
