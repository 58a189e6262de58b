"""End-to-end training: hmp against torch DistributedDataParallel (gloo) on the same processes.

A throughput-bound job: ``deep_mlp`` (1024 -> 4 x 2048 -> 10, 14.7 M parameters, 59 MB of float32)
on generated dense data (``[data] kind = "synthetic"``: 10000 rows x 1024 features, 10 classes,
90/10 split, seed 0), 2 worker processes x batch 64, SGD lr 0.03 momentum 0.9, one epoch over
each worker's half of the training set (71 steps per worker; ~16 s for hmp, ~19 s for DDP here).
Both sides train exactly the same job: the model from ``[model] seed`` (``hmp.models.build_model``),
each worker's contiguous slice of the training set in hmp's seeded order
(``ShuffledBatches(seed=(data seed, index))``), the two workers' gradients averaged every step
(hmp sync, DDP), so both follow the same loss curve (same final test loss). Every process runs
one torch thread (2 cores here, 4-5 processes).

* hmp: real daemons through ``LocalCluster``, a fresh cluster per run: a scheduler, PS shards
  and 2 ``cpu_worker`` s, for each mode of :data:`MODES` asked for (default ``sync``).
* DDP: two processes (``gloo``) that stay up for the whole benchmark; DDP's defaults (25 MB
  buckets all-reduced while backward runs; ``gradient_as_bucket_view`` or one 100 MB bucket
  measured the same, 490-525 samples/s).

Every hmp run sits between two blocks of DDP runs (``--ddp-runs`` each, in the same DDP processes;
the first block comes after one uncounted DDP warm-up run). Both record, at the same cadence (every
``REPORT_S``), each worker's cumulative samples and the EMA (0.9) of its training loss: hmp in
the reports its workers send the scheduler (the run report's series), DDP on each rank. From them:

* samples/s, steady state: every worker's samples between ``WARM_S`` after training began and
  its last progress report (the final report, after worker 0's evaluation, is left out), on a
  common window, summed over the workers. Start-up, the first steps and the final evaluation are
  excluded.
* time to target loss: from the first worker's start of training (hmp: the scheduler's clock,
  each worker's start taken from its first report as ``t - samples / samples_per_s``) to the
  first report at which a worker's training-loss EMA is at or below ``--target-loss``. Training
  loss, not test loss: evaluating the 14.7 M-parameter model takes ~1 s that hmp's worker 0
  would spend inside its training time. The final test loss (outside every timing) is reported.

A side's samples/s and time to target are means over its runs (``*_spread``: median, min,
quartiles, max of the runs). ``ratio_<mode>_vs_ddp`` = the mode's mean samples/s / DDP's, and
``ratio_vs_ddp`` that of the mode with the highest samples/s; ``ratio_time_to_loss_vs_ddp`` =
DDP's mean time to target loss / the best mode's. A ratio of means over all interleaved runs: the
machine's speed drifts over seconds (1-s rates within one run vary by +-15% on this 2-core VM, and
whole runs of either side by +-10%), which a mean over every run damps better than the median of
three per-run ratios (the same three benchmark runs: 1.25-1.44 as medians of per-run ratios,
1.26-1.39 as ratios of means). The per-run ratios (each hmp run against the mean of the DDP runs
right before and after it) are the ratios' ``_spread``. One benchmark run takes 3-4 minutes
(3 hmp runs of ~30 s with their cluster's start and stop, 5 DDP runs of ~20 s with the warm-up;
176-226 s measured).

    python bench/train.py [--json] [--repeats N] [--ddp-runs N] [--modes sync,async] [--epochs N]
                          [--target-loss L]

``bench/ps.py`` runs this as its part (b) (``python bench/ps.py --skip push --json``). Modes are
the keys of :data:`MODES` (a new one is one entry there); ``allreduce`` (the ring all-reduce,
``consistency = "allreduce"``, no PS shards) is listed but not run by default: ``--modes
sync,allreduce``. A mode the config does not accept fails before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stats import (CpuMeter, ProcessGroup, cpu_line, fmt_spread, free_port, guard, is_quiet, load_average, quantile,  # noqa: E402
                    spread)

# hmp modes: [train] consistency and how many PS shards the job has. A mode whose consistency the
# config does not accept yet fails at once, with the config's error, before anything starts.
MODES: dict[str, dict[str, Any]] = {
    "sync": {"consistency": "sync", "shards": 2},
    "async": {"consistency": "async", "shards": 2},
    "ssp": {"consistency": "ssp", "shards": 2},
    "allreduce": {"consistency": "allreduce", "shards": 0},  # ring all-reduce among the workers
}
WORKERS = 2
REPLY_TIMEOUT_S = 180.0  # a worker process's answer to one command, and gloo's timeout (bench/ps.py too)
REPORT_S = 0.25  # report cadence of both sides: the resolution of every time here
WARM_S = 3.0  # seconds after the start of training left out of samples/s


@dataclasses.dataclass(frozen=True)
class Workload:
    """The one job both sides train."""

    model: str = "deep_mlp"
    model_args: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"in_features": 1024, "width": 2048, "depth": 4, "classes": 10})
    model_seed: int = 0
    data_kind: str = "synthetic"
    data_args: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"n": 10000, "n_features": 1024, "num_classes": 10})
    data_seed: int = 0
    test_fraction: float = 0.1
    batch: int = 64  # per worker
    lr: float = 0.03
    momentum: float = 0.9
    epochs: int = 1
    target_loss: float = 1.4
    chunk_bytes: int = 1 << 20

    def dataset(self) -> Any:
        """The data exactly as an hmp node loads ``[data]`` (``hmp.job.dataset``)."""
        from hmp.data import load_dataset

        return load_dataset({"kind": self.data_kind, "seed": self.data_seed, "test_fraction": self.test_fraction,
                             **self.data_args})

    def build_model(self) -> torch.nn.Module:
        """The initial model exactly as an hmp node builds ``[model]`` (``hmp.job.sharded_model``)."""
        from hmp.models import build_model

        return build_model(self.model, seed=self.model_seed, **self.model_args)


def _toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all bound at once: one at a time may repeat a port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def write_job(folder: Path, mode: str, w: Workload, max_seconds: float) -> Path:
    """An hmp job for ``mode`` on loopback: a scheduler, the mode's PS shards, ``WORKERS`` cpu workers."""
    spec = MODES[mode]
    text = f"""
[job]
name = "bench-train-{mode}"
report_dir = "{folder / 'run'}"
heartbeat_interval_s = 0.5
join_timeout_s = 120
log_format = "json"

[model]
name = "{w.model}"
args = {_toml(w.model_args)}
seed = {w.model_seed}

[data]
kind = "{w.data_kind}"
seed = {w.data_seed}
test_fraction = {w.test_fraction}
args = {_toml(w.data_args)}

[optimizer]
name = "sgd"
lr = {w.lr}
momentum = {w.momentum}

[train]
consistency = "{spec['consistency']}"
batch_size = {w.batch}
epochs = {w.epochs}
max_seconds = {max_seconds}
eval_every_s = 1e9  # no evaluation while training: only worker 0's after its last step
report_interval_s = {REPORT_S}

[ps]
chunk_bytes = {w.chunk_bytes}
checkpoint_dir = "{folder / 'ckpt'}"
"""
    nodes = [("scheduler", "scheduler"), *[(f"ps{i}", "ps") for i in range(spec["shards"])],
             *[(f"cpu{i}", "cpu_worker") for i in range(WORKERS)]]
    for (nid, role), port in zip(nodes, free_ports(len(nodes))):
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\nbind = "tcp://127.0.0.1:{port}"\nthreads = 1\n'
    path = folder / "job.toml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- the figures of one run

def _at(points: list[tuple[float, float]], t: float) -> float:
    """Cumulative samples at ``t``, linear between report points (``points`` sorted by time)."""
    if t <= points[0][0]:
        return points[0][1]
    for (t0, s0), (t1, s1) in zip(points, points[1:]):
        if t <= t1:
            return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1
    return points[-1][1]


def steady_rate(workers: list[list[tuple[float, float]]], t_from: float) -> tuple[float | None, float, float]:
    """Samples/s of all workers together on the common window [``t_from``, the earliest last point]:
    ``(rate, window start, window end)``; rate None when the window is under a second."""
    t_to = min(p[-1][0] for p in workers)
    if t_to - t_from < 1.0:
        return None, t_from, t_to
    total = sum(_at(p, t_to) - _at(p, t_from) for p in workers)
    return total / (t_to - t_from), t_from, t_to


def time_to_loss(workers: list[list[tuple[float, float]]], target: float) -> float | None:
    """The first time a worker's training-loss EMA is at or below ``target`` (None: never)."""
    hits = [next((t for t, loss in p if loss <= target), None) for p in workers]
    hits = [t for t in hits if t is not None]
    return min(hits) if hits else None


def figures(samples: list[list[tuple[float, float]]], losses: list[list[tuple[float, float]]],
            target: float) -> dict[str, Any]:
    """samples/s and time to target of one run; times since the first worker's start of training."""
    rate, a, b = steady_rate(samples, WARM_S)
    return {"samples_per_s": rate, "window_s": [round(a, 2), round(b, 2)],
            "time_to_target_loss_s": time_to_loss(losses, target),
            "train_loss": min(p[-1][1] for p in losses if p)}


# ----------------------------------------------------------------------------- DDP

def _ddp_worker(rank: int, port: int, w: Workload, conn: Any, barrier: Any) -> None:
    torch.set_num_threads(1)

    def body() -> None:
        import torch.distributed as dist
        from torch.nn import functional as F
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hmp.data import ShuffledBatches
        from hmp.ema import ema
        from hmp.train.evaluate import evaluate

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS,
                                timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))
        data = w.dataset()
        n = len(data.y_train)
        lo, hi = n * rank // WORKERS, n * (rank + 1) // WORKERS  # hmp's static slice of worker ``rank``
        order = ShuffledBatches(hi - lo, seed=(w.data_seed, rank))
        x, y = data.x_train, data.y_train
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            _, epochs, max_steps, final_eval = cmd  # a warm-up asks for a few steps, no evaluation
            model = DDP(w.build_model())
            opt = torch.optim.SGD(model.parameters(), lr=w.lr, momentum=w.momentum)
            barrier.wait()
            dist.barrier()
            t_start = time.perf_counter()
            next_report = t_start + REPORT_S
            samples, steps, loss_avg = 0, 0, None
            points: list[tuple[float, float, float]] = []  # (t, samples, loss EMA), as hmp's reports
            for epoch in range(epochs):
                ids = lo + order.order(epoch)
                for pos in range(0, len(ids), w.batch):
                    if steps >= max_steps:
                        break
                    idx = ids[pos:pos + w.batch]
                    opt.zero_grad(set_to_none=False)
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    loss.backward()
                    opt.step()
                    loss_avg = ema(loss_avg, loss.item(), 0.9)
                    steps += 1
                    samples += len(idx)
                    now = time.perf_counter()
                    if now >= next_report:
                        points.append((now - t_start, samples, loss_avg))
                        next_report = now + REPORT_S
            wall = time.perf_counter() - t_start
            points.append((wall, samples, loss_avg))
            test = evaluate(model.module, data.x_test, data.y_test) if rank == 0 and final_eval else {}
            conn.send({"points": points, "steps": steps, "samples": samples, "train_s": wall, **test})
        dist.destroy_process_group()

    guard(conn, body)


class DDPPeer(ProcessGroup):
    """The DDP processes, up for the whole benchmark; ``run()`` trains the workload once from scratch."""

    def __init__(self, w: Workload) -> None:
        port = free_port()
        super().__init__("ddp", _ddp_worker, lambda r: (r, port, w), timeout_s=REPLY_TIMEOUT_S)
        self.w = w

    def warm_up(self) -> None:
        """One whole run, not counted: a first run in fresh processes is slower for seconds on end
        (measured 390-440 against 470-540 samples/s after a 5-step warm-up)."""
        self.ask("run", self.w.epochs, math.inf, False)

    def run(self) -> dict[str, Any]:
        ranks = self.ask("run", self.w.epochs, math.inf, True)
        # The last point of each rank is the end of training (no evaluation in between): kept.
        out = figures([[(t, s) for t, s, _ in r["points"]] for r in ranks],
                      [[(t, loss) for t, _, loss in r["points"]] for r in ranks], self.w.target_loss)
        out.update(test_loss=ranks[0].get("test_loss"), test_accuracy=ranks[0].get("test_accuracy"),
                   train_s=max(r["train_s"] for r in ranks), steps=ranks[0]["steps"])
        return out


# ----------------------------------------------------------------------------- hmp

def check_mode(mode: str, folder: Path, w: Workload) -> None:
    """Fail at once if hmp's config does not accept ``mode`` (e.g. a consistency not built yet)."""
    from hmp import job

    if mode not in MODES:
        raise SystemExit(f"unknown hmp mode {mode!r}; expected one of {sorted(MODES)}")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        job.load(write_job(folder, mode, w, 60.0))
    except Exception as exc:  # noqa: BLE001 - the config's own error says why
        raise SystemExit(f"hmp mode {mode!r} cannot run here: {exc}") from None


def hmp_run(mode: str, folder: Path, w: Workload, max_seconds: float) -> dict[str, Any]:
    """One hmp job on a fresh ``LocalCluster``; its figures from the run report's series."""
    from hmp.cluster import LocalCluster

    folder.mkdir(parents=True)
    cfg_path = write_job(folder, mode, w, max_seconds)

    async def go() -> dict[str, Any]:
        async with LocalCluster(cfg_path, env={"PYTHONPATH": str(ROOT)}) as cluster:
            return await cluster.train(timeout_s=max_seconds + 180)

    t0 = time.perf_counter()
    report = asyncio.run(go())
    wall = time.perf_counter() - t0
    # Each worker's start of training on the scheduler's clock: its reports carry samples and
    # samples/s since its own start (hmp.nodes.worker.current_metrics), so start = t - samples / rate.
    # Its last point is the final report (sent after worker 0's evaluation): left out.
    series = [s[:-1] for s in report["series"].values()]
    starts = []
    for s in series:
        p = next((p for p in s if p.get("samples", 0) > 0 and p.get("samples_per_s", 0) > 0), None)
        if p is None:
            raise RuntimeError(f"hmp {mode}: a worker sent no progress report; see {folder / 'run' / 'logs'}")
        starts.append(p["t"] - p["samples"] / p["samples_per_s"])
    first = min(starts)
    out = figures([[(p["t"] - first, p["samples"]) for p in s] for s in series],
                  [[(p["t"] - first, p["loss"]) for p in s if "loss" in p] for s in series], w.target_loss)
    out.update(test_loss=report["final"].get("test_loss"), test_accuracy=report["final"].get("test_accuracy"),
               startup_skew_s=max(starts) - first, train_s=report["final"].get("elapsed_s"),
               updates=sum(x.get("updates", 0) for x in report["workers"].values()), run_wall_s=wall)
    return out


# ----------------------------------------------------------------------------- the benchmark

def mean(xs: list[float | None]) -> float | None:
    """The mean of ``xs``; None if any is None (a run that missed the target: no time to average)."""
    return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)


def bench_train(modes: list[str], repeats: int, ddp_runs: int, tmp: Path, w: Workload | None = None,
                max_seconds: float = 120.0) -> dict[str, Any]:
    """DDP warm-up, a DDP block, then for each repeat and mode: one hmp run and a DDP block.

    A side's figure is the mean over its runs, and a ratio the ratio of two such means: the
    interleaving has both sides sample the same stretch of time, and the machine's speed drifts
    over seconds (1-s rates of one run vary by +-15% here), so a mean over every run is steadier
    than the median of a few per-run ratios. Those per-run ratios (each hmp run against the mean
    of the DDP runs of the blocks right before and after it) give the ``_spread``."""
    w = w or Workload()
    for mode in modes:
        check_mode(mode, tmp / f"check-{mode}", w)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ["ddp", *modes]}
    rate_ratio: dict[str, list[float]] = {m: [] for m in modes}
    loss_ratio: dict[str, list[float]] = {m: [] for m in modes}
    t0 = time.perf_counter()
    ddp = DDPPeer(w)
    try:
        ddp.ready()
        ddp.warm_up()

        def block() -> list[dict[str, Any]]:
            rs = [ddp.run() for _ in range(ddp_runs)]
            runs["ddp"] += rs
            return rs

        before = block()
        for r in range(repeats):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                h = hmp_run(mode, tmp / f"train-{mode}-{r}", w, max_seconds)
                runs[mode].append(h)
                after = block()
                around = before + after
                d_rate = mean([x["samples_per_s"] for x in around])
                if h["samples_per_s"] and d_rate:
                    rate_ratio[mode].append(h["samples_per_s"] / d_rate)
                d_ttl = mean([x["time_to_target_loss_s"] for x in around])
                if d_ttl and h["time_to_target_loss_s"]:
                    loss_ratio[mode].append(d_ttl / h["time_to_target_loss_s"])
                before = after
    finally:
        ddp.close()

    def med(xs: list[Any]) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(quantile(xs, 0.5), 3) if xs else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    res: dict[str, Any] = {"workload": dataclasses.asdict(w), "workers": WORKERS, "modes": modes,
                           "repeats": repeats, "ddp_runs_per_block": ddp_runs, "report_s": REPORT_S,
                           "warm_s": WARM_S, "target_loss": w.target_loss,
                           "params": sum(p.numel() for p in w.build_model().parameters()),
                           "wall_s": round(time.perf_counter() - t0, 1)}
    for name, rs in runs.items():
        v: dict[str, Any] = {"runs": len(rs)}
        for k in ("samples_per_s", "time_to_target_loss_s"):
            xs = [x[k] for x in rs]
            m = mean(xs)
            v[k] = None if m is None else round(m, 1 if k == "samples_per_s" else 3)
            v[f"{k}_spread"] = spread([x for x in xs if x is not None])
            v[f"{k}_runs"] = [None if x is None else round(x, 3) for x in xs]
        v["reached"] = sum(x["time_to_target_loss_s"] is not None for x in rs)
        for k in ("test_loss", "test_accuracy", "train_loss", "train_s", "startup_skew_s", "run_wall_s"):
            if any(k in x for x in rs):
                v[k] = med([x.get(k) for x in rs])
        res[name] = v
    for name in modes:
        res[f"ratio_{name}_vs_ddp"] = ratio(res[name]["samples_per_s"], res["ddp"]["samples_per_s"])
        res[f"ratio_{name}_vs_ddp_spread"] = spread(rate_ratio[name])
        res[f"ratio_time_to_loss_{name}_vs_ddp"] = ratio(res["ddp"]["time_to_target_loss_s"],
                                                         res[name]["time_to_target_loss_s"])
        res[f"ratio_time_to_loss_{name}_vs_ddp_spread"] = spread(loss_ratio[name])
    best = max(modes, key=lambda m: res[m]["samples_per_s"] or 0.0)
    res["best_mode"] = best
    res["samples_per_s"] = res[best]["samples_per_s"]
    res["ddp_samples_per_s"] = res["ddp"]["samples_per_s"]
    res["time_to_target_loss_s"] = res[best]["time_to_target_loss_s"]
    res["ddp_time_to_target_loss_s"] = res["ddp"]["time_to_target_loss_s"]
    for k in ("ratio_{}_vs_ddp", "ratio_time_to_loss_{}_vs_ddp"):
        res[k.replace("_{}", "")] = res[k.format(best)]
        res[k.replace("_{}", "") + "_spread"] = res[k.format(best) + "_spread"]
    return res


def report(res: dict[str, Any]) -> None:
    """The human-readable table of :func:`bench_train`'s result."""
    w = res["workload"]
    print(f"(b) {w['model']} {w['model_args']} ({res['params'] / 1e6:.1f} M parameters) on {w['data_kind']} "
          f"{w['data_args']}; {res['workers']} workers x batch {w['batch']}, SGD lr {w['lr']} momentum "
          f"{w['momentum']}, {w['epochs']} epochs; {res['repeats']} run(s) per hmp mode, each between two "
          f"blocks of {res['ddp_runs_per_block']} DDP run(s)")
    print(f"{'peer':<18}{'samples/s':>10}{'[min .. max]':>18}{'to loss (s)':>12}{'[min .. max]':>16}"
          f"{'reached':>9}{'test loss':>10}")
    fmt = lambda x, f=".2f": "-" if x is None else format(x, f)  # noqa: E731
    for name in ["ddp", *res["modes"]]:
        v = res[name]
        sp, tp = v["samples_per_s_spread"], v["time_to_target_loss_s_spread"]
        rng = lambda s, f: f"[{fmt(s.get('min'), f)} .. {fmt(s.get('max'), f)}]"  # noqa: E731
        print(f"{('torch DDP (gloo)' if name == 'ddp' else 'hmp ' + name):<18}{fmt(v['samples_per_s'], '.0f'):>10}"
              f"{rng(sp, '.0f'):>18}{fmt(v['time_to_target_loss_s']):>12}{rng(tp, '.2f'):>16}"
              f"{v['reached']:>5}/{v['runs']:<3}{fmt(v.get('test_loss'), '.3f'):>10}")
    print(f"mean of runs [min .. max]; samples/s: steady state, from {res['warm_s']} s after the start of training "
          f"to each side's last progress report; to loss: until a worker's training-loss EMA <= "
          f"{res['target_loss']} (reports every {res['report_s']} s)")
    print("ratio = hmp mean / DDP mean (to loss: DDP / hmp); spread: per-run ratios, each hmp run against the "
          "DDP runs around it, median [min .. max]")
    for m in res["modes"]:
        for key in (f"ratio_{m}_vs_ddp", f"ratio_time_to_loss_{m}_vs_ddp"):
            print(f"  {key:<38}{fmt(res[key], '.3f'):>6}   per run {fmt_spread(res[f'{key}_spread'])}")
    print(f"ratio_vs_ddp = {res['ratio_vs_ddp']} (samples/s, best mode {res['best_mode']}; target >= 1.0); "
          f"ratio_time_to_loss_vs_ddp = {res['ratio_time_to_loss_vs_ddp']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hmp-bench-train-") as d:
        res = run_from_args(args, Path(d))
    res["load_avg_before"], res["load_avg_after"] = load_before, load_average()
    res["cpu_during_run"] = meter.stop()
    res["quiet"] = is_quiet(res["cpu_during_run"])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    report(res)
    print(cpu_line(res["cpu_during_run"], res["load_avg_before"], res["load_avg_after"], res["wall_s"]))
    if args.json:
        print(json.dumps(res))


def add_args(ap: argparse.ArgumentParser) -> None:
    """This benchmark's options (``bench/ps.py`` takes them for its part (b))."""
    w = Workload()
    ap.add_argument("--repeats", type=int, default=3, help="(b) hmp runs per mode; each costs a cluster start")
    ap.add_argument("--ddp-runs", type=int, default=1, help="(b) DDP runs in each block between two hmp runs")
    ap.add_argument("--modes", default="sync", help=f"(b) hmp modes, comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--epochs", type=int, default=w.epochs, help="(b) epochs over each worker's slice (both)")
    ap.add_argument("--target-loss", type=float, default=w.target_loss,
                    help="(b) training-loss EMA to reach (both)")


def run_from_args(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    modes = [m for m in args.modes.split(",") if m]
    w = dataclasses.replace(Workload(), epochs=args.epochs, target_loss=args.target_loss)
    return bench_train(modes, args.repeats, args.ddp_runs, tmp, w)


if __name__ == "__main__":
    main()
