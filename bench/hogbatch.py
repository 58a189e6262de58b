"""Hogbatch benchmark: time to a target test loss under sync SGD, static Hogbatch and Adaptive Hogbatch.

Every run is a real job (``hmp.LocalCluster``: a scheduler, two PS shards, one ``cpu_worker`` and one
``gpu_worker``; without CUDA the GPU worker runs on the CPU with a large batch) on one of two datasets:

* ``digits``: scikit-learn's bundled digits, the digits MLP (64-128-64-10).
* ``sparse``: a LIBSVM file this script writes first (seeded): 20,000 rows x 2,000 features, 1.5% non-zeros,
  binary labels from a hidden linear rule (:func:`hmp.data.generate_sparse_classification`), read back by the
  runtime's svmlight loader (``[data] kind = "svmlight"``); model ``deep_mlp`` 2000-64-2.

For each dataset every policy trains the same model from the same seed with the same optimizer, learning rate
and worker batch sizes until worker 0's test loss reaches the dataset's target (``train.target_loss``).
Policies alternate between repeats (repeat r starts at policy r), so slow spells of this shared machine spread
over all of them. Time to target is the scheduler's clock (0 = the first worker joined) at the first report
that carries a test loss at or below the target; a run that stops at ``max_seconds`` first counts as not
reached (its time is then ``max_seconds``, a lower bound).

    python bench/hogbatch.py [--json] [--quick] [--repeats N] [--datasets digits,sparse] [--out DIR] [--no-plot]

Prints a table; with ``--json`` the last line is one JSON object: per dataset and policy the median time to
target, whether every repeat reached it, median final test accuracy (PS parameters after the stop), the CPU
worker's share of updates and each worker's utilization (busy fraction) and samples/s; per dataset
``speedup_adaptive_vs_sync`` and ``speedup_adaptive_vs_hogbatch`` (ratios of median times). The plot
(``hogbatch_loss.png`` in ``--out``, default ``runs/bench/hogbatch-<timestamp>/``; ``--out docs`` redraws the docs') shows test loss against wall time, one line per policy (its median
run), one panel per dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import free_port, run_folder  # noqa: E402  (bench/_stats.py)

from hmp.config import BatchPolicyKind as Policy, Consistency  # noqa: E402  (after the path set-up)

POLICIES = (Policy.SYNC, Policy.HOGBATCH, Policy.ADAPTIVE)
WORKERS = ("cpu0", "gpu0")  # cpu0 is worker 0: it measures the test loss the stop rule reads


@dataclasses.dataclass(frozen=True)
class Workload:
    """One dataset with its model and the settings every policy shares.

    ``cpu_batch``/``gpu_batch``: the workers' batch sizes (static Hogbatch uses them as they are; Adaptive
    Hogbatch starts from them and uses ``cpu_batch`` as ``base_batch``); ``sync_batch``: the one batch size
    of bulk-synchronous SGD, per worker.
    """

    name: str
    data: str  # the [data] table body
    model: str  # the [model] table body
    lr: float
    target_loss: float
    cpu_batch: int
    gpu_batch: int
    sync_batch: int
    threshold: float
    max_seconds: float
    chunk_bytes: int
    eval_every_s: float


def workloads(folder: Path) -> dict[str, Workload]:
    """The two workloads; the sparse one's LIBSVM files are written into ``folder``. How the settings were
    chosen (the same for every policy) is in docs/hogbatch.md, section Benchmark."""
    train, test = write_sparse_svmlight(folder)
    return {
        "digits": Workload(
            name="digits", data='kind = "digits"', model='name = "digits_mlp"\nargs = { hidden = [128, 64] }',
            lr=0.05, target_loss=0.15, cpu_batch=16, gpu_batch=256, sync_batch=16, threshold=2.0,
            max_seconds=40.0, chunk_bytes=16384, eval_every_s=0.2),
        "sparse": Workload(
            name="sparse", data=f'kind = "svmlight"\npath = "{train}"\ntest_path = "{test}"\nargs = {{ n_features = 2000 }}',
            model='name = "deep_mlp"\nargs = { in_features = 2000, width = 64, depth = 1, classes = 2 }',
            lr=0.05, target_loss=0.30, cpu_batch=16, gpu_batch=1024, sync_batch=16, threshold=2.0,
            max_seconds=60.0, chunk_bytes=65536, eval_every_s=0.25),
    }


def write_sparse_svmlight(folder: Path, n: int = 20000, n_features: int = 2000, density: float = 0.015,
                          seed: int = 0) -> tuple[Path, Path]:
    """Generate the sparse dataset (seeded) and write it as LIBSVM text: a train file and a 10% test file."""
    import numpy as np
    from scipy import sparse
    from sklearn.datasets import dump_svmlight_file

    from hmp.data import generate_sparse_classification

    d = generate_sparse_classification(n, n_features, density, seed, test_fraction=0.1)
    paths = folder / "sparse_train.svm", folder / "sparse_test.svm"
    for path, x, y in ((paths[0], d.x_train, d.y_train), (paths[1], d.x_test, d.y_test)):
        # CSR first: dump_svmlight_file writes a dense array cell by cell. Labels as -1/+1, LIBSVM's binary form.
        dump_svmlight_file(sparse.csr_matrix(x.numpy()), np.where(y.numpy() > 0, 1, -1), str(path), zero_based=False)
    return paths



def job_config(folder: Path, w: Workload, policy: str) -> Path:
    """The job file for one run: same topology, model, data and optimizer for every policy."""
    if policy == Policy.SYNC:
        consistency, knobs = Consistency.SYNC, f"{{ batch_size = {w.sync_batch} }}"
    elif policy == Policy.HOGBATCH:
        consistency, knobs = Consistency.ASYNC, f"{{ cpu_batch = {w.cpu_batch}, gpu_batch = {w.gpu_batch} }}"
    else:
        consistency, knobs = Consistency.ASYNC, f"{{ base_batch = {w.cpu_batch}, threshold = {w.threshold}, max_batch = 4096 }}"
    text = f"""
[job]
name = "hogbatch-{w.name}-{policy}"
report_dir = "{folder / 'run'}"
heartbeat_interval_s = 0.5
log_format = "json"

[model]
{w.model}
seed = 0

[data]
{w.data}
seed = 0

[optimizer]
name = "sgd"
lr = {w.lr}

[train]
consistency = "{consistency}"
batch_size = {w.sync_batch}
epochs = 100000
target_loss = {w.target_loss}
max_seconds = {w.max_seconds}
eval_every_s = {w.eval_every_s}
report_interval_s = {w.eval_every_s}
policy = "{policy}"
policy_args = {knobs}

[ps]
chunk_bytes = {w.chunk_bytes}
checkpoint_dir = "{folder / 'ckpt'}"

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
batch_size = {w.cpu_batch}

[[nodes]]
id = "gpu0"
role = "gpu_worker"
device = "{'cuda' if cuda() else 'cpu'}"
batch_size = {w.gpu_batch}
"""
    path = folder / "job.toml"
    path.write_text(text)
    return path


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def run_job(path: Path) -> dict[str, Any]:
    import hmp

    async with hmp.LocalCluster(path) as cluster:
        return await cluster.train()


def loss_curve(report: dict[str, Any]) -> list[tuple[float, float]]:
    """(scheduler time, test loss) of every report that carried a test loss (worker 0 measures it)."""
    return [(p["t"], p["test_loss"]) for p in report["series"].get(WORKERS[0], []) if "test_loss" in p]


def summarize_run(report: dict[str, Any], w: Workload) -> dict[str, Any]:
    curve = loss_curve(report)
    hit = next((t for t, loss in curve if loss <= w.target_loss), None)
    workers = report["workers"]
    return {
        "reached": hit is not None,
        "time_to_target_s": hit if hit is not None else w.max_seconds,
        "final_test_accuracy": report["final"].get("test_accuracy", float("nan")),
        "final_test_loss": report["final"].get("test_loss", float("nan")),
        "stop_reason": report["final"].get("stop_reason", ""),
        "cpu_update_share": workers.get("cpu0", {}).get("update_share", 0.0),
        "utilization": {k: workers.get(k, {}).get("busy_fraction", 0.0) for k in WORKERS},
        "samples_per_s": {k: workers.get(k, {}).get("samples_per_s", 0.0) for k in WORKERS},
        "updates": {k: workers.get(k, {}).get("updates", 0) for k in WORKERS},
        "final_batch_size": {k: workers.get(k, {}).get("batch_size", 0) for k in WORKERS},
        "curve": curve,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-policy figures over the repeats: medians, and the run with the median time (for the plot)."""
    times = sorted(runs, key=lambda r: r["time_to_target_s"])
    mid = times[(len(times) - 1) // 2]

    def med(f):
        return statistics.median(f(r) for r in runs)

    return {
        "time_to_target_s": med(lambda r: r["time_to_target_s"]),
        "times_s": [round(r["time_to_target_s"], 3) for r in runs],
        "load_avg": [round(r["load_avg"], 2) for r in runs],
        "reached": all(r["reached"] for r in runs),
        "final_test_accuracy": med(lambda r: r["final_test_accuracy"]),
        "cpu_update_share": med(lambda r: r["cpu_update_share"]),
        "utilization": {k: med(lambda r, k=k: r["utilization"][k]) for k in WORKERS},
        "samples_per_s": {k: med(lambda r, k=k: r["samples_per_s"][k]) for k in WORKERS},
        "final_batch_size": mid["final_batch_size"],
        "curve": mid["curve"],
    }


def plot(results: dict[str, dict[str, dict[str, Any]]], targets: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), dpi=100, squeeze=False)
    for ax, (name, per_policy) in zip(axes[0], results.items()):
        for policy, r in per_policy.items():
            if r["curve"]:
                ax.plot(*zip(*r["curve"]), label=f"{policy} ({r['time_to_target_s']:.1f} s)")
        ax.axhline(targets[name], color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_title(f"{name}: test loss against wall time (median run)")
        ax.set_xlabel("wall time since the first worker joined (s)")
        ax.set_ylabel("test loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--quick", action="store_true", help="one repeat per policy")
    ap.add_argument("--repeats", type=int, default=3, help="runs per dataset and policy (medians are reported)")
    ap.add_argument("--datasets", default="digits,sparse", help="comma-separated: digits, sparse")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated: {', '.join(POLICIES)}")
    ap.add_argument("--out", default=None, help="folder for the plot (default runs/bench/hogbatch-<timestamp>/)")
    ap.add_argument("--no-plot", action="store_true", help="draw no plot")
    ap.add_argument("--set", action="append", default=[], metavar="DATASET.FIELD=VALUE",
                    help="override a Workload setting for every policy, e.g. --set sparse.gpu_batch=1024")
    ap.add_argument("--runs-dir", default="", help="keep every run's folder (config, report, logs) here")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    policies = [p for p in args.policies.split(",") if p]
    datasets = [d for d in args.datasets.split(",") if d]
    if not set(policies) <= set(POLICIES) or not set(datasets) <= {"digits", "sparse"}:
        ap.error(f"policies must be among {[str(p) for p in POLICIES]} and datasets among ('digits', 'sparse')")
    t_start = time.monotonic()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    targets: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hmp-hogbatch-") as tmp_dir:
        tmp = args.runs_dir or tmp_dir
        Path(tmp).mkdir(parents=True, exist_ok=True)
        all_workloads = override(workloads(Path(tmp)), args.set)
        for name in datasets:
            w = all_workloads[name]
            targets[name] = w.target_loss
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
            for r in range(repeats):
                for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
                    folder = Path(tmp) / f"{name}-{policy}-{r}"
                    folder.mkdir(exist_ok=True)
                    load_before = os.getloadavg()[0]
                    report = asyncio.run(run_job(job_config(folder, w, policy)))
                    got = summarize_run(report, w)
                    # The machine is shared: the 1-minute load average around each run says how contended it was.
                    got["load_avg"] = (load_before + os.getloadavg()[0]) / 2
                    runs[policy].append(got)
                    print(f"  {name:7s} {policy:9s} repeat {r}: {'reached' if got['reached'] else 'NOT reached'} "
                          f"in {got['time_to_target_s']:.2f} s, test acc {got['final_test_accuracy']:.3f}, "
                          f"cpu share {got['cpu_update_share']:.2f}, batches {got['final_batch_size']}, "
                          f"load {got['load_avg']:.1f}",
                          file=sys.stderr, flush=True)
            results[name] = {p: median_run(rs) for p, rs in runs.items()}
    out: dict[str, Any] = {"device": "cuda" if cuda() else "cpu (gpu_worker runs on the CPU)",
                           "host": platform.node(), "cpu_cores": os.cpu_count(), "repeats": repeats, "targets": targets, "datasets": {}}
    for name, per_policy in results.items():
        entry: dict[str, Any] = {p: {k: v for k, v in r.items() if k != "curve"} for p, r in per_policy.items()}
        t = {p: r["time_to_target_s"] for p, r in per_policy.items()}
        if Policy.ADAPTIVE in t:
            for base in (Policy.SYNC, Policy.HOGBATCH):
                if base in t:
                    entry[f"speedup_adaptive_vs_{base}"] = t[base] / t[Policy.ADAPTIVE]
        out["datasets"][name] = entry
    out["wall_s"] = time.monotonic() - t_start
    if not args.no_plot:
        out["plot"] = str(run_folder("hogbatch", args.out) / "hogbatch_loss.png")
        plot(results, targets, Path(out["plot"]))
        print(f"plot: {out['plot']}", file=sys.stderr)
    print_table(out)
    if args.json:
        print(json.dumps(out))
    return out


def override(all_workloads: dict[str, Workload], settings: list[str]) -> dict[str, Workload]:
    """Apply ``DATASET.FIELD=VALUE`` settings (values parsed as the field's type)."""
    out = dict(all_workloads)
    types = {f.name: f.type for f in dataclasses.fields(Workload)}
    for item in settings:
        key, _, value = item.partition("=")
        name, _, field = key.partition(".")
        if name not in out or field not in types or field in ("name", "data", "model") or not value:
            raise SystemExit(f"--set {item!r}: expected DATASET.FIELD=VALUE with DATASET in {sorted(out)} and "
                             f"FIELD one of {sorted(set(types) - {'name', 'data', 'model'})}")
        out[name] = dataclasses.replace(out[name], **{field: {"int": int, "float": float}[types[field]](value)})
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"\nHogbatch benchmark ({out['device']}; medians of {out['repeats']} repeat(s))")
    print(f"{'dataset':8s} {'policy':9s} {'target':>6s} {'time (s)':>9s} {'reached':>7s} {'test acc':>8s} "
          f"{'cpu upd share':>13s} {'util cpu/gpu':>12s} {'samples/s cpu/gpu':>18s} {'batches cpu/gpu':>15s}")
    for name, entry in out["datasets"].items():
        for policy in POLICIES:
            r = entry.get(policy)
            if r is None:
                continue
            u, s, b = r["utilization"], r["samples_per_s"], r["final_batch_size"]
            print(f"{name:8s} {policy:9s} {out['targets'][name]:6.2f} {r['time_to_target_s']:9.2f} "
                  f"{str(r['reached']):>7s} {r['final_test_accuracy']:8.3f} {r['cpu_update_share']:13.2f} "
                  f"{u['cpu0']:5.2f}/{u['gpu0']:<6.2f} {s['cpu0']:8.0f}/{s['gpu0']:<9.0f} "
                  f"{int(b['cpu0']):>6d}/{int(b['gpu0']):<8d}")
        for k in ("speedup_adaptive_vs_sync", "speedup_adaptive_vs_hogbatch"):
            if k in entry:
                print(f"{name:8s} {k}: {entry[k]:.2f}x")


if __name__ == "__main__":
    main()
