"""Row-sparse push and pull against dense pushes and a single process (issue 14, "Sparse end to end").

A generated click-style svmlight file (``--rows`` rows, default 1M, of ``--fields`` hashed categorical
features each, in ``--features`` hashed feature ids, default 1M; labels from a hidden logistic model of the
features) is written to a temporary folder (removed afterwards) and trained on, for ``--seconds`` of
training each (plus start-up: loading, joining), by:

* ``sparse``: hmp (``LocalCluster``: a scheduler, two PS shards, two ``cpu_worker`` s) with
  ``sparse_mlp(num_features)``: a 1M-row ``nn.EmbeddingBag(sparse=True)`` table, pushed and pulled by
  rows (docs/protocol.md, "Row-sparse tables"), ``[data] sparse = true`` (CSR from file to batch);
* ``dense``: the same job with ``sparse_mlp(..., sparse=False)``: every push carries the whole table's
  gradient and every reply the whole table (what hmp did before row-sparse tables);
* ``single_process``: one PyTorch process, the same model (``sparse=True``), data, batch size and
  optimizer (``torch.optim.Adagrad``, which takes sparse gradients), no parameter server.

For each: samples/s (hmp: the workers' summed rates between their first and last progress reports, the
steady state; the process: over its timed steps), bytes on the wire per step (hmp: the workers' pushed
plus pulled bytes over their updates, over the same span: the start-up's whole-table pull is outside),
and peak RSS per daemon (``VmHWM``, MiB). Figures: ``sparse_vs_dense`` (samples/s ratio, target >= 5),
``sparse_vs_single_process`` (samples/s ratio), ``sparse_bytes_per_step`` / ``dense_bytes_per_step`` and
``sparse_rows_per_step`` (rows pushed per step: the bytes follow the rows a batch touches, not the table).

Both hmp jobs run with the config's defaults, so the table is cut into ``[ps] table_chunk_bytes`` (8 MiB)
chunks (``--table-chunk-bytes`` overrides it): a sparse push costs a few tensor operations per table chunk
it touches (ids checked, rows gathered and updated, on both ends), so with 1 MiB chunks (64 for the 64 MiB
table, nearly all touched by every batch) those dominate the step (measured: 17.5k against 44.7k samples/s
at 8 MiB, 200k rows); 8 chunks still spread the table over both shards.

    python bench/sparse.py [--json] [--rows N] [--features N] [--fields N] [--seconds S] [--batch N]
                           [--skip dense,single_process]

With ``--json`` the last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import free_port  # noqa: E402  (bench/_stats.py)


def generate(path: Path, rows: int, features: int, fields: int, seed: int = 0) -> float:
    """Write the svmlight file; returns the fraction of positive labels. Field ``j``'s values (Zipf-like
    popularity, so that a batch touches popular rows often) hash into its own range of feature ids, so a
    row's ids are increasing and distinct, as the format wants."""
    rng = np.random.default_rng(seed)
    span = features // fields
    vocab = min(span, 200_000)
    values = np.minimum(rng.zipf(1.2, size=(rows, fields)) - 1, vocab - 1)  # popular values first
    ids = (values * 2_654_435_761 + 12_345) % span + np.arange(fields) * span  # hashed, per-field range
    weights = rng.normal(0, 1.0, size=(fields, vocab)).astype(np.float32)
    score = weights[np.arange(fields), values].sum(1) + rng.normal(0, 0.5, rows)
    labels = (score > np.median(score)).astype(np.int64)
    with open(path, "w") as f:
        for lo in range(0, rows, 100_000):
            block = ids[lo:lo + 100_000] + 1  # one-based ids
            lines = [f"{y} " + " ".join(f"{i}:1" for i in row) for y, row in zip(labels[lo:lo + 100_000],
                                                                             block.tolist())]
            f.write("\n".join(lines) + "\n")
    return float(labels.mean())


def job_text(tmp: Path, data: Path, features: int, sparse: bool, seconds: float, batch: int,
             table_chunk_bytes: int | None) -> str:
    return f"""
[job]
name = "sparse_bench_{'sparse' if sparse else 'dense'}"
report_dir = "{tmp / ('run_sparse' if sparse else 'run_dense')}"
heartbeat_interval_s = 1.0
join_timeout_s = 120

[model]
name = "sparse_mlp"
args = {{ num_features = {features}, dim = 16, hidden = [64], sparse = {str(sparse).lower()} }}

[data]
kind = "svmlight"
path = "{data}"
sparse = true
test_fraction = 0.05
args = {{ n_features = {features} }}

[optimizer]
name = "adagrad"
lr = 0.05

[train]
consistency = "async"
batch_size = {batch}
epochs = 1000
target_accuracy = 0.0
max_seconds = {seconds}
eval_every_s = 100000
report_interval_s = 1.0

[limits]
request_timeout_s = 120

[ps]
{"" if table_chunk_bytes is None else f"table_chunk_bytes = {table_chunk_bytes}"}

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"

[[nodes]]
id = "ps0"
role = "ps"

[[nodes]]
id = "ps1"
role = "ps"

[[nodes]]
id = "cpu0"
role = "cpu_worker"

[[nodes]]
id = "cpu1"
role = "cpu_worker"
"""



def _hwm_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def run_hmp(tmp: Path, data: Path, features: int, sparse: bool, seconds: float, batch: int,
                  table_chunk_bytes: int | None) -> dict[str, Any]:
    from hmp.cluster import LocalCluster

    path = tmp / ("sparse.toml" if sparse else "dense.toml")
    path.write_text(job_text(tmp, data, features, sparse, seconds, batch, table_chunk_bytes))
    peak: dict[str, float] = {}
    t0 = time.monotonic()
    async with LocalCluster(path) as cluster:
        train = asyncio.ensure_future(cluster.train(timeout_s=seconds + 240))
        while not train.done():  # VmHWM is read while the daemons live (it goes with the process)
            for nid, p in cluster.procs.items():
                if p.returncode is None and (m := _hwm_mib(p.pid)) is not None:
                    peak[nid] = max(peak.get(nid, 0.0), m)
            await asyncio.wait({train}, timeout=0.5)
        report = train.result()
    workers = report["workers"]
    # Steady state: between each worker's first and last progress report (the start-up's whole-table pull
    # and the last evaluation's pull fall outside), summed over the workers.
    delta = {"updates": 0.0, "samples": 0.0, "bytes_out": 0.0, "bytes_in": 0.0, "rows_pushed": 0.0}
    rate = 0.0
    for series in report["series"].values():
        if len(series) < 2:
            continue
        first, last = series[0], series[-1]
        for k in delta:
            delta[k] += last.get(k, 0) - first.get(k, 0)
        rate += (last["samples"] - first["samples"]) / max(1e-9, last["t"] - first["t"])
    updates = delta["updates"] or 1
    return {"samples_per_s": rate, "samples_per_s_whole_run": sum(w["samples_per_s"] for w in workers.values()),
            "updates": sum(w["updates"] for w in workers.values()),
            "bytes_per_step": (delta["bytes_out"] + delta["bytes_in"]) / updates,
            "pushed_bytes_per_step": delta["bytes_out"] / updates,
            "rows_per_step": delta["rows_pushed"] / updates if sparse else None,
            "test_accuracy": report["final"].get("test_accuracy"), "peak_rss_mib": {k: round(v, 1) for k, v in peak.items()},
            "wall_s": round(time.monotonic() - t0, 1)}


def single_process(data: str, features: int, seconds: float, batch: int) -> dict[str, Any]:
    """The baseline, run in a process of its own (its peak RSS is its own): Adagrad over the same model."""
    import resource

    import torch
    from torch.nn import functional as F

    from hmp.data import ShuffledBatches, load_svmlight
    from hmp.models import sparse_mlp
    from hmp.train.evaluate import evaluate

    torch.set_num_threads(1)  # like one hmp worker's compute thread on this 2-core machine
    ds = load_svmlight(data, features, sparse=True, test_fraction=0.05)
    torch.manual_seed(0)
    model = sparse_mlp(features, dim=16, hidden=(64,))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05, eps=1e-8)
    order = ShuffledBatches(len(ds.y_train), batch, seed=0)
    x, y = ds.x_train, ds.y_train
    samples, t0, timed = 0, time.perf_counter(), 0.0
    while timed < seconds:
        idx = order.next_batch()
        if idx is None or len(idx) < 1:
            continue
        s = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        timed += time.perf_counter() - s
        samples += len(idx)
    acc = evaluate(model, ds.x_test, ds.y_test)["test_accuracy"]
    return {"samples_per_s": samples / timed, "test_accuracy": acc, "bytes_per_step": 0,
            "peak_rss_mib": {"process": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)},
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--features", type=int, default=1_000_000)
    ap.add_argument("--fields", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=25.0, help="training seconds per run (plus start-up)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--table-chunk-bytes", type=int, default=None,
                    help="[ps] table_chunk_bytes of the sparse job (default: the config's, 8 MiB; a sparse push "
                         "costs per table chunk it touches)")
    ap.add_argument("--skip", default="", help="comma-separated: dense, single_process")
    ap.add_argument("--baseline-of", default="", help=argparse.SUPPRESS)  # internal: run the baseline on this file
    args = ap.parse_args()
    if args.baseline_of:
        print(json.dumps(single_process(args.baseline_of, args.features, args.seconds, args.batch)))
        return
    skip = {s for s in args.skip.split(",") if s}
    tmp = Path(tempfile.mkdtemp(prefix="hmp-sparse-bench-"))
    out: dict[str, Any] = {"rows": args.rows, "features": args.features, "fields": args.fields,
                           "batch_size": args.batch, "seconds": args.seconds, "table_chunk_bytes": args.table_chunk_bytes,
                           "cpus": os.cpu_count()}
    try:
        data = tmp / "click.svm"
        t = time.perf_counter()
        out["positive_fraction"] = generate(data, args.rows, args.features, args.fields)
        out["generate_s"] = round(time.perf_counter() - t, 1)
        out["file_mib"] = round(data.stat().st_size / 2**20, 1)
        out["sparse"] = asyncio.run(run_hmp(tmp, data, args.features, True, args.seconds, args.batch,
                                            args.table_chunk_bytes))
        if "dense" not in skip:
            out["dense"] = asyncio.run(run_hmp(tmp, data, args.features, False, args.seconds, args.batch,
                                               args.table_chunk_bytes))
        if "single_process" not in skip:
            proc = subprocess.run([sys.executable, __file__, "--baseline-of", str(data), "--features",
                                   str(args.features), "--seconds", str(args.seconds), "--batch", str(args.batch)],
                                  capture_output=True, text=True, timeout=args.seconds + 300)
            if proc.returncode != 0:
                raise SystemExit(f"single-process baseline failed:\n{proc.stderr[-3000:]}")
            out["single_process"] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = out["sparse"]
    out["sparse_bytes_per_step"] = s["bytes_per_step"]
    out["sparse_rows_per_step"] = s["rows_per_step"]
    if "dense" in out:
        out["dense_bytes_per_step"] = out["dense"]["bytes_per_step"]
        out["sparse_vs_dense"] = s["samples_per_s"] / max(1e-9, out["dense"]["samples_per_s"])
    if "single_process" in out:
        out["sparse_vs_single_process"] = s["samples_per_s"] / max(1e-9, out["single_process"]["samples_per_s"])
    print(f"data: {args.rows} rows x {args.fields} hashed features in {args.features} ids "
          f"({out['file_mib']} MiB svmlight, generated in {out['generate_s']} s)")
    for name in ("sparse", "dense", "single_process"):
        if name in out:
            r = out[name]
            rss = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["peak_rss_mib"].items()))
            print(f"{name:>15}: {r['samples_per_s']:9.0f} samples/s, {r['bytes_per_step'] / 1e3:10.1f} kB/step on the "
                  f"wire, test accuracy {r['test_accuracy']:.3f}; peak RSS MiB: {rss}")
    if "sparse_vs_dense" in out:
        print(f"sparse_vs_dense {out['sparse_vs_dense']:.1f} (target >= 5)")
    if "sparse_vs_single_process" in out:
        print(f"sparse_vs_single_process {out['sparse_vs_single_process']:.2f}")
    print(f"rows pushed per step {out['sparse_rows_per_step']:.0f}: "
          f"{out['sparse']['pushed_bytes_per_step'] / max(1.0, out['sparse_rows_per_step']):.0f} B pushed per row")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
