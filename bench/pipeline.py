"""Planned pipeline vs data parallel for the click model on this machine.

    python bench/pipeline.py [--config conf/click_pipeline.toml] [--runs N] [--pipeline-only] [--json]
    python bench/pipeline.py --message-overhead [--json]

Runs the config as the scheduler plans it (a pipeline of stages over the workers, parameters on
the PS), then the same model, data, optimizer, batch size and processes as a data-parallel job
(``[placement] enabled = false``: every worker trains the whole model and pushes to the PS).
Throughput: pipeline, the samples/s through the last stage under the last plan (what the run
report measures); data parallel, the sum over workers of samples per second of training. The last
line is JSON.

Prediction against measurement: ``predicted_samples_per_s`` is the runtime model's figure for the
last plan as the run report gives it (``hmp/placement/calibration.py``: calibrated on the running
plan once its workers reported a few steps), ``samples_per_s`` the measured one, and
``measured_over_predicted`` their ratio (target: within 0.7-1.3); the report's uncalibrated
prediction (``predicted_before_calibration``) and the planner's cost model
(``cost_model_samples_per_s``) are given beside them. With ``--runs N`` the pipeline (and data
parallel, unless ``--pipeline-only``) run N times, interleaved, and the JSON gives every run and the
medians.

``--transfer M`` checks the calibration out of sample: after each pipeline run, the same config runs
again with ``micro_batches = M`` (a different plan or staffing, with different micro-batches), and
the runtime model with the *first* run's calibrated costs (its report's ``runtime_costs``) predicts
that run's last plan before it is measured (``transfer.measured_over_predicted``).

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
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hmp.cluster import LocalCluster  # noqa: E402

OVERHEAD_ROUNDS, OVERHEAD_WARMUP, STREAM = 2000, 200, 5000


def variant(config: Path, out: Path, *, pipeline: bool, micro_batches: int | None = None) -> Path:
    """The config with placement on or off (and other micro-batches) and its own report dir."""
    text = config.read_text()
    text = re.sub(r"(?m)^enabled = \w+", f"enabled = {'true' if pipeline else 'false'}", text)
    if micro_batches is not None:
        text, n = re.subn(r"(?m)^micro_batches = \d+", f"micro_batches = {micro_batches}", text)
        if n != 1:
            raise SystemExit(f"{config}: expected one 'micro_batches = N' line to replace, found {n}")
    text = re.sub(r'(?m)^report_dir = .*$', f'report_dir = "{out}"', text)
    path = out.parent / f"{out.name}.toml"
    path.write_text(text)
    return path


async def run(path: Path) -> dict:
    async with LocalCluster(path) as cluster:
        return await cluster.train(timeout_s=180)


def pipeline_figures(report: dict) -> dict:
    last = report["pipeline"]["plans"][-1]
    measured, predicted = last["measured"][-1]["samples_per_s"], last["predicted_throughput"]
    return {"samples_per_s": measured,
            "predicted_samples_per_s": predicted,
            "measured_over_predicted": measured / predicted if predicted else None,
            "calibrated": "calibration" in last,
            "predicted_before_calibration": last.get("predicted_before_calibration", predicted),
            "cost_model_samples_per_s": last.get("cost_model_throughput"),
            "plans": len(report["pipeline"]["plans"]),
            "calibration": last.get("calibration"),
            "stages": [{"layers": s["layers"], "resource": s["resource"], "workers": s["workers"],
                        "predicted": round(s["predicted_samples_per_s"]), "measured": round(m["samples_per_s"]),
                        "compute_only": round(m["compute_samples_per_s"]),
                        "time_shares": {k: round(m.get(f"{k}_fraction", 0.0), 3) for k in ("busy", "push", "idle")}}
                       for s, m in zip(last["stages"], last["measured"])],
            "cost": last["cost"], "test_accuracy": report["final"]["test_accuracy"],
            "elapsed_s": report["final"]["elapsed_s"]}


def transfer_figures(first: dict, second: dict) -> dict:
    """The runtime model with ``first``'s calibrated costs predicting ``second``'s last plan (its stages
    as staffed, its micro-batch profile), against what ``second`` measured."""
    from hmp.placement.calibration import RuntimeCosts, StageLoad, predict

    costs = RuntimeCosts.from_dict(first["pipeline"]["runtime_costs"])
    pipe = second["pipeline"]
    prof, last = pipe["profile"], pipe["plans"][-1]
    stages = [StageLoad(s["resource"], sum(prof[i]["micro_batch_ms"][s["resource"]] for i in range(a, b + 1)) * 1e-3,
                        len(s["workers"]), float(sum(prof[i]["param_bytes"] for i in range(a, b + 1))))
              for s in last["stages"] for a, b in [s["layers"]]]
    predicted = predict(stages, pipe["micro_batches"], pipe["batch_size"], costs).samples_per_s
    measured = last["measured"][-1]["samples_per_s"]
    return {"micro_batches": pipe["micro_batches"], "layers": last["layers"],
            "stages": [[s["layers"], s["resource"], len(s["workers"])] for s in last["stages"]],
            "predicted_from_first_run": predicted, "samples_per_s": measured,
            "measured_over_predicted": measured / predicted,
            "own_calibrated_prediction": last["predicted_throughput"] if "calibration" in last else None}


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
    ap.add_argument("--runs", type=int, default=1, help="runs of each (interleaved); the JSON gives medians")
    ap.add_argument("--pipeline-only", action="store_true", help="skip the data-parallel runs")
    ap.add_argument("--transfer", type=int, metavar="M",
                    help="also run with micro_batches = M, predicted with the first run's calibrated costs")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if args.message_overhead:
        res = {"bench": "message_overhead", **message_overhead()}
        if not args.json:
            print(f"request round trip {res['round_trip_median_us']:.0f} us (median; p90 "
                  f"{res['round_trip_p90_us']:.0f}), per message {res['message_overhead_us']:.0f} us; one-way "
                  f"stream {res['one_way_stream_us_per_message']:.0f} us per message")
        print(json.dumps(res))
        return
    pipes, dps, transfers = [], [], []
    with tempfile.TemporaryDirectory(prefix="hmp-bench-pipeline-") as tmp:
        tmpd = Path(tmp)
        for k in range(args.runs):
            first = asyncio.run(run(variant(Path(args.config), tmpd / f"pipeline{k}", pipeline=True)))
            pipes.append(pipeline_figures(first))
            if args.transfer:
                second = asyncio.run(run(variant(Path(args.config), tmpd / f"transfer{k}", pipeline=True,
                                                 micro_batches=args.transfer)))
                transfers.append(transfer_figures(first, second))
                if not args.json:
                    t = transfers[-1]
                    print(f"run {k}: micro_batches {args.transfer}, stages {t['stages']}: {t['samples_per_s']:.0f} "
                          f"samples/s, predicted from run {k}'s calibration {t['predicted_from_first_run']:.0f} "
                          f"(measured/predicted {t['measured_over_predicted']:.2f})", flush=True)
            if not args.json:
                p = pipes[-1]
                print(f"run {k}: pipeline {p['samples_per_s']:.0f} samples/s, predicted {p['predicted_samples_per_s']:.0f} "
                      f"(measured/predicted {p['measured_over_predicted']:.2f}; before calibration "
                      f"{p['predicted_before_calibration']:.0f}, cost model {p['cost_model_samples_per_s']:.0f})", flush=True)
            if args.pipeline_only:
                continue
            dp_report = asyncio.run(run(variant(Path(args.config), tmpd / f"data_parallel{k}", pipeline=False)))
            dps.append({"samples_per_s": sum(w["samples_per_s"] for w in dp_report["workers"].values()),
                        "workers": len(dp_report["workers"]), "test_accuracy": dp_report["final"]["test_accuracy"],
                        "elapsed_s": dp_report["final"]["elapsed_s"]})
    pipe = {**min(pipes, key=lambda p: abs(p["samples_per_s"] - statistics.median(q["samples_per_s"] for q in pipes)))}
    result = {"bench": "pipeline", "config": args.config, "runs": args.runs, "pipeline": pipe,
              "predicted_samples_per_s": statistics.median(p["predicted_samples_per_s"] for p in pipes),
              "samples_per_s": statistics.median(p["samples_per_s"] for p in pipes),
              "measured_over_predicted": statistics.median(p["measured_over_predicted"] for p in pipes),
              "measured_over_predicted_runs": [round(p["measured_over_predicted"], 3) for p in pipes],
              "measured_over_uncalibrated": statistics.median(p["samples_per_s"] / p["predicted_before_calibration"]
                                                              for p in pipes)}
    if transfers:
        result.update(transfer=transfers[len(transfers) // 2], transfer_measured_over_predicted=statistics.median(
            t["measured_over_predicted"] for t in transfers),
            transfer_measured_over_predicted_runs=[round(t["measured_over_predicted"], 3) for t in transfers])
    if dps:
        dp = min(dps, key=lambda d: abs(d["samples_per_s"] - statistics.median(e["samples_per_s"] for e in dps)))
        result.update(data_parallel=dp, pipeline_over_data_parallel=statistics.median(
            p["samples_per_s"] / d["samples_per_s"] for p, d in zip(pipes, dps)))
    if not args.json:
        print(f"pipeline      {pipe['samples_per_s']:9.0f} samples/s (predicted {pipe['predicted_samples_per_s']:.0f}), "
              f"test accuracy {pipe['test_accuracy']:.3f} (the median run)")
        for s in pipe["stages"]:
            print(f"  layers {s['layers'][0]}-{s['layers'][1]} on {s['resource']} {s['workers']}: predicted "
                  f"{s['predicted']}, measured {s['measured']}, compute only {s['compute_only']} samples/s; "
                  f"wall time: {s['time_shares']}")
        print(f"medians over {args.runs} run(s): measured {result['samples_per_s']:.0f}, predicted "
              f"{result['predicted_samples_per_s']:.0f}, measured / predicted {result['measured_over_predicted']:.2f} "
              f"(uncalibrated: {result['measured_over_uncalibrated']:.2f})")
        if dps:
            dp = result["data_parallel"]
            print(f"data parallel {dp['samples_per_s']:9.0f} samples/s on {dp['workers']} workers, test accuracy "
                  f"{dp['test_accuracy']:.3f}")
            print(f"ratio pipeline / data parallel: {result['pipeline_over_data_parallel']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
