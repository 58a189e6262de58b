"""Part (b) of bench/gadget.py: a slice of the ITP trace replayed through hmp's real cluster mode (hmp.manager)
on emulated hosts, under GADGET and under the best baseline, and the cost model against measured iterations.

Setup. ``conf/hosts4x2.toml``: 4 emulated hosts x 2 worker slots, every link shaped to 200 Mbit/s each way
(docs/emulate.md). One :class:`hmp.emulate.EmulatedHosts` is started once and shared by every
:class:`hmp.manager.JobManager` below (each job: a scheduler daemon and one CPU ring worker per slot, inside
the hosts the placement names). Two model types, both ring-all-reduce MLPs on digits, batch 32 per worker:
``wide`` (64-1024-1024-10: 4.5 MB of gradient per step, little compute: a ring that spans hosts waits on
the links) and ``mid`` (64-256-256-10: 0.35 MB).

Method.

1. *Probes* (calibration): each model type runs on 1 worker, 2 on one host, 1+1, 2+2 and 1+1+1+1 hosts,
   in four groups of jobs that run together (:data:`PROBE_GROUPS`, placed by a pinned scheduler; the last
   group's two rings share every link); each job's measured iteration time (the ring workers' mean step
   time, ``step_s``, median over the ring) is a measurement, with the rings that ran beside it stretch by
   stretch (:class:`hmp.gadget.model.IterationSample` ``segments``). The cost model is hmp.gadget's with
   its two optional terms on: the 8 slots share this machine's cores (one compute pool,
   ``cluster_spec(specs, cores=...)``: a ring's compute is stretched by max(1, busy workers / effective
   cores)) and links shared by n rings give each ``1 / (1 + beta (n - 1))`` of their rate. Its constants
   (per-model compute, intra-host bandwidth, link efficiency, hop latency, effective cores, beta) are fitted
   by :func:`hmp.gadget.model.calibrate` (``robust=True``: least absolute relative error, the figure being a
   median), starting from each model's gradient bytes and its compute time profiled in this process. This
   probe fit is the model the replays' schedulers (GADGET included) and the simulations of step 3 use.
2. *The slice*: ``--real-jobs`` (20) consecutive jobs of the trace from ``--real-start`` (1000: a busy
   stretch with 1- to 32-GPU jobs), GPU counts clipped to 4. Arrivals are compressed linearly to
   ``--real-arrive-s`` (40 s); durations (3 min to 4 days in the trace) are mapped log-linearly onto 2-10 s
   of running alone at the requested size. :func:`hmp.gadget.jobs.jobs_from_trace` (seeded) assigns model
   types and utilities (linear decay, sigmoid deadline, convergence: synthetic, the trace has neither; their
   slack is 20 s instead of half an hour) and turns each duration into samples with the calibrated model;
   the samples are rounded to whole epochs of the 1437 training digits (at least one): each job file trains
   that many epochs.
3. *Best baseline*: the same jobs simulated (:func:`hmp.gadget.simulate.simulate`, calibrated model) under
   fifo, first_fit, random, tiresias; the one with the highest total utility is replayed for real.
4. *Replays*: the jobs are submitted at their compressed times to a JobManager running GADGET, then to one
   running the best baseline; each job's utility is its utility function at its real completion time.
   ``real_utility_vs_best_baseline`` = GADGET's total / the baseline's (target > 1.0).
5. *Model error*: every job of the probes and of both replays is a measurement (step 1). The model, the
   same class GADGET schedules with, is re-fitted on every job; a job's prediction is
   :func:`hmp.gadget.model.predict_sample` (the model's iteration time averaged over the job's stretches).
   ``model_error`` = the median over the placements seen (model type x workers per host) of the median
   |predicted - measured| / measured (target <= 0.2). For comparison: ``model_error_fair_link_shares``
   (beta = 1), ``model_error_plain`` (no shared compute, beta = 1: the model before the shared-compute
   term), both fitted on every job too; ``model_error_probe_fit``: the probe fit GADGET actually scheduled
   with, on the replays' jobs (out of sample), and ``model_error_plain_probe_fit`` the same for the plain model.

    python bench/_gadget_real.py [--json] [--real-jobs 20] [--real-start 1000] [--real-arrive-s 40] [--seed 0]

Needs root (network namespaces); without, the result is ``{"skipped": "<reason>"}``. Every process and
namespace is removed at the end, on errors and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _stats import run_folder  # noqa: E402  (bench/_stats.py)
from hmp import log as hmp_log  # noqa: E402
from hmp.emulate import EmulatedHosts, EmulationUnavailable, load_hosts  # noqa: E402
from hmp.gadget.interface import PendingJob, Placement  # noqa: E402
from hmp.gadget.jobs import (ConvergenceStop, LinearDecay, SigmoidDeadline, TraceJob, UtilityMix,  # noqa: E402
                             jobs_from_trace, read_trace)
from hmp.gadget.model import IterationSample, ModelType, RingCostModel, calibrate, predict_sample  # noqa: E402
from hmp.gadget.schedulers import make_scheduler  # noqa: E402
from hmp.gadget.simulate import simulate  # noqa: E402
from hmp.manager.service import DEFAULT_NETWORK, DONE, JobManager, JobResult, cluster_spec  # noqa: E402
from hmp.manager.spec import JobSpec, loads_job, profile_compute_s  # noqa: E402

#: The trace as shipped with the project (data/traces, with its licence), else the shared copy.
TRACE = next((p for p in (ROOT / "data" / "traces" / "itp_cluster04_busiest5000.csv",
                          ROOT.parent / "shared" / "traces" / "itp_cluster04_busiest5000.csv") if p.exists()),
             ROOT / "data" / "traces" / "itp_cluster04_busiest5000.csv")
HOSTS = ROOT / "conf" / "hosts4x2.toml"
#: model type -> the digits MLP's hidden layers
MODELS = {"wide": [1024, 1024], "mid": [256, 256]}
BASELINES = ("fifo", "first_fit", "random", "tiresias")
#: Probe groups: each group's jobs run together, pinned to these placements (model type, workers per host).
PROBE_GROUPS = (
    (("wide", (1, 0, 0, 0)), ("wide", (0, 2, 0, 0)), ("wide", (0, 0, 1, 1))),
    (("mid", (1, 0, 0, 0)), ("mid", (0, 2, 0, 0)), ("mid", (0, 0, 1, 1))),
    (("wide", (2, 2, 0, 0)), ("mid", (0, 0, 2, 2))),
    (("wide", (1, 1, 1, 1)), ("mid", (1, 1, 1, 1))),     # two rings sharing every link
)

JOB = """
[job]
name = "{name}"
heartbeat_interval_s = 0.5
join_timeout_s = 90

[model]
name = "digits_mlp"
args = {{ hidden = {hidden} }}
seed = 0

[data]
kind = "digits"
test_fraction = 0.2

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9

[train]
consistency = "allreduce"
batch_size = 32
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 5.0
report_interval_s = 1.0

[collective]
bucket_bytes = 26214400

[submit]
min_workers = {lo}
max_workers = {hi}
workers = {want}
model_type = "{model}"
utility = {utility}
"""


def _say(msg: str) -> None:
    print(f"[gadget real {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _utility_table(u: Any) -> str:
    if isinstance(u, LinearDecay):
        return f'{{ kind = "linear", value = {u.value!r}, zero_at_s = {u.zero_at_s!r} }}'
    if isinstance(u, SigmoidDeadline):
        return f'{{ kind = "sigmoid", value = {u.value!r}, deadline_s = {u.deadline_s!r}, width_s = {u.width_s!r} }}'
    if isinstance(u, ConvergenceStop):
        return f'{{ kind = "convergence", value = {u.value!r}, converge_s = {u.converge_s!r}, grace_s = {u.grace_s!r} }}'
    raise TypeError(f"no job-file form for utility {u!r}")


def job_spec(name: str, model: str, epochs: int, lo: int, hi: int, want: int, utility: str = "",
             max_seconds: float = 120.0) -> JobSpec:
    text = JOB.format(name=name, hidden=MODELS[model], epochs=epochs, max_seconds=max_seconds, lo=lo, hi=hi, want=want,
                      model=model, utility=utility or '{ kind = "linear", value = 1.0, zero_at_s = 600 }')
    return loads_job(text, f"<bench job {name}>")


class Pinned:
    """A scheduler that starts each pending job on the placement pinned for its id, once it fits."""

    name = "pinned"

    def __init__(self, pins: dict[str, Placement]) -> None:
        self.pins = pins

    def schedule(self, view: Any) -> dict[str, Placement]:
        free, out = list(view.free), {}
        for job in view.pending:
            p = self.pins[job.job_id]
            if all(n <= f for n, f in zip(p, free)):
                out[job.job_id] = p
                free = [f - n for f, n in zip(free, p)]
        return out


def _placement(result: JobResult, hosts: Sequence[str]) -> Placement:
    return tuple(result.placement.get(h, 0) for h in hosts)


def _segments(job: JobResult, others: Sequence[JobResult], hosts: Sequence[str]) -> list[tuple[float, tuple]]:
    """The stretches of ``job``'s run with the set of other rings running beside it: (seconds, others)."""
    cuts = {job.start_s, job.end_s}
    for o in others:
        for t in (o.start_s, o.end_s):
            if job.start_s < t < job.end_s:
                cuts.add(t)
    times = sorted(cuts)
    out = []
    for a, b in zip(times, times[1:]):
        mid = (a + b) / 2
        beside = tuple((o.model_type, _placement(o, hosts)) for o in others
                       if o is not job and o.start_s <= mid < o.end_s)
        out.append((b - a, beside))
    return out


def _observed(run: Sequence[JobResult], hosts: Sequence[str]) -> list[IterationSample]:
    """Each finished job as the cost model sees it: its placement, its measured iteration time, and what ran
    beside it, stretch by stretch (``others``: the longest stretch's)."""
    out = []
    for r in run:
        if r.status == DONE and r.iteration_s > 0:
            segs = tuple(_segments(r, run, hosts))
            longest = max(segs, key=lambda seg: seg[0])[1] if segs else ()
            out.append(IterationSample(r.model_type, _placement(r, hosts), r.iteration_s, longest, segs))
    return out


def _error_by_placement(cost: RingCostModel, obs: Sequence[IterationSample]) -> tuple[float, list[dict[str, Any]]]:
    """Median over placements (model type, workers per host) of the median relative error of their jobs, each
    job predicted by :func:`hmp.gadget.model.predict_sample` (the model over the job's stretches)."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for o in obs:
        groups.setdefault((o.model, o.placement), []).append((predict_sample(cost, o), o.iteration_s))
    rows = []
    for (model, p), pm in sorted(groups.items()):
        errs = [abs(a - b) / b for a, b in pm]
        rows.append({"model": model, "placement": list(p), "jobs": len(pm),
                     "measured_s": statistics.median(b for _, b in pm), "predicted_s": statistics.median(a for a, _ in pm),
                     "relative_error": statistics.median(errs)})
    return (statistics.median(r["relative_error"] for r in rows) if rows else float("nan")), rows


def _fit(prior: RingCostModel, obs: Sequence[IterationSample], link_sharing: bool = True) -> RingCostModel:
    """:func:`hmp.gadget.model.calibrate`, least absolute relative error (the figure is a median), with the
    effective cores (if ``prior``'s hosts share a compute pool) and, if ``link_sharing``, the link-sharing
    factor fitted too."""
    return calibrate(prior, obs, robust=True, fit_link_sharing=link_sharing).cost


def _constants(cost: RingCostModel) -> dict[str, Any]:
    return {"network": dataclasses.asdict(cost.network),
            "effective_cores": {name: cost.network.core_efficiency * c for name, c in cost.cluster.pool_cores},
            "compute_s": {m.name: m.compute_s for m in cost.models.values()}}


async def _run_jobs(hosts: EmulatedHosts, scheduler: Any, cost: RingCostModel, jobs: Sequence[tuple[float, JobSpec]],
                    run_dir: Path, label: str) -> tuple[list[JobResult], float]:
    """Submit each (submit time, spec) at its time to a fresh JobManager on ``hosts``; every result, and the wall time."""
    def event(name: str, r: JobResult) -> None:
        if name == "job_started":
            _say(f"{label}: {r.job_id} ({r.model_type}) started on {r.placement} after {r.queue_s:.1f} s")
        else:
            _say(f"{label}: {r.job_id} {r.status} after {r.jct_s:.1f} s ({r.iteration_s * 1e3:.0f} ms/iteration"
                 f"{', ' + r.error[:200] if r.error else ''})")

    t0 = time.monotonic()
    async with JobManager(hosts, scheduler, cost=cost, run_dir=run_dir, grace_s=5, on_event=event) as m:
        handles = []
        start = time.monotonic()
        for at, spec in sorted(jobs, key=lambda j: j[0]):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            handles.append(await m.submit(spec))
        results = [await h.wait() for h in handles]
    return results, time.monotonic() - t0


def _summary(results: Sequence[JobResult]) -> dict[str, Any]:
    jct = sorted(r.jct_s for r in results)
    done = [r for r in results if r.status == DONE]
    return {"total_utility": sum(r.utility for r in results), "jobs": len(results), "done": len(done),
            "failed": [f"{r.job_id}: {r.error[:300]}" for r in results if r.status != DONE],
            "jct_mean_s": statistics.fmean(jct), "jct_p50_s": statistics.median(jct),
            "jct_p99_s": jct[min(len(jct) - 1, math.ceil(0.99 * len(jct)) - 1)],
            "queue_mean_s": statistics.fmean(r.queue_s for r in results),
            "makespan_s": max(r.end_s for r in results) - min(r.submit_s for r in results),
            "workers": dict(Counter(r.workers for r in results)),
            "jct_s": [round(x, 2) for x in jct]}


def _slice(trace: Path, start: int, n: int, arrive_s: float, lo_s: float = 2.0, hi_s: float = 10.0) -> list[TraceJob]:
    """The compressed slice (module docstring, step 2)."""
    jobs = read_trace(str(trace))[start:start + n]
    if len(jobs) < n:
        raise ValueError(f"{trace} has {len(jobs)} jobs from {start}, need {n}")
    t0, span = jobs[0].submit_s, max(1.0, jobs[-1].submit_s - jobs[0].submit_s)
    logs = [math.log(max(j.duration_s, 1.0)) for j in jobs]
    lmin, lmax = min(logs), max(logs)
    out = []
    for j, lg in zip(jobs, logs):
        run = lo_s + (hi_s - lo_s) * ((lg - lmin) / (lmax - lmin) if lmax > lmin else 0.5)
        out.append(dataclasses.replace(j, submit_s=(j.submit_s - t0) * arrive_s / span, duration_s=run,
                                       num_gpus=min(j.num_gpus, 4)))
    return out


async def _part_b(args: argparse.Namespace) -> dict[str, Any]:
    t_begin = time.monotonic()
    # The managers' structured log: warnings and up, on stderr (the progress lines are this script's).
    hmp_log.configure("console", level=logging.WARNING, stream=sys.stderr)
    specs, subnet = load_hosts(HOSTS)
    # The 8 emulated slots share this machine's cores: one compute pool (hmp.gadget.model, "shared compute").
    cores = len(os.sched_getaffinity(0))
    cluster = cluster_spec(specs, cores=cores)
    host_names = [s.name for s in specs]
    # The prior cost model: each model type's gradient bytes and batch size, its compute time profiled here.
    prior_models = []
    for model in MODELS:
        spec = job_spec(f"profile-{model}", model, 1, 1, 1, 1)
        prior_models.append(ModelType(model, float(spec.grad_bytes), profile_compute_s(spec), spec.batch_size))
    prior = RingCostModel(cluster, prior_models, DEFAULT_NETWORK)
    plain_prior = prior.with_cluster(cluster_spec(specs))   # the same, with no shared compute
    hosts = EmulatedHosts.from_file(HOSTS)
    try:
        await asyncio.get_running_loop().run_in_executor(None, hosts.start)
    except EmulationUnavailable as exc:
        return {"skipped": f"no emulated hosts here: {exc}"}
    work = Path(tempfile.mkdtemp(prefix="hmp-gadget-real-"))
    try:
        # 1. probes, a group at a time
        _say(f"calibration: {sum(map(len, PROBE_GROUPS))} probe jobs in {len(PROBE_GROUPS)} groups on {HOSTS.name} "
             f"({specs[0].bandwidth_mbit:g} Mbit/s links)")
        probe_runs: list[list[JobResult]] = []
        for k, group in enumerate(PROBE_GROUPS):
            pins = {f"j{i + 1}": p for i, (_, p) in enumerate(group)}
            # Each probe trains for about 4 s (max_seconds), whatever its speed; the epochs are an upper bound.
            group_jobs = [(0.0, job_spec(f"probe-{m}-{sum(p)}", m, epochs=50, lo=sum(p), hi=sum(p), want=sum(p),
                                         max_seconds=4.0)) for m, p in group]
            res, _ = await _run_jobs(hosts, Pinned(pins), prior, group_jobs, work / f"probe{k}", "probe")
            probe_runs.append(res)
        probe_obs = [o for run in probe_runs for o in _observed(run, host_names)]
        cost1 = _fit(prior, probe_obs)
        err1, _ = _error_by_placement(cost1, probe_obs)
        _say(f"calibrated on {len(probe_obs)} probes: model error {err1:.3f}; {cost1.network}; compute "
             + ", ".join(f"{m.name} {m.compute_s * 1e3:.1f} ms" for m in cost1.models.values()))

        # 2. the slice
        trace = _slice(Path(args.trace or TRACE), args.real_start, args.real_jobs, args.real_arrive_s)
        generated = jobs_from_trace(trace, cost1, seed=args.seed, models=sorted(MODELS), mix=UtilityMix(slack_s=20.0))
        jobs: list[tuple[float, JobSpec]] = []
        sim_jobs: list[PendingJob] = []
        for g in generated:
            j = g.job
            examples = 1437
            epochs = max(1, round(j.samples / examples))
            spec = job_spec(f"itp-{len(jobs)}", j.model, epochs, j.min_workers, j.max_workers, j.requested_workers,
                            _utility_table(j.utility))
            jobs.append((j.submit_s, spec))
            sim_jobs.append(dataclasses.replace(j, samples=float(spec.samples)))

        # 3. the best baseline, by simulation
        simulated = {name: simulate(sim_jobs, cost1, make_scheduler(name, seed=args.seed)).total_utility
                     for name in (*BASELINES, "gadget")}
        best = max(BASELINES, key=lambda n: simulated[n])
        _say(f"simulated utility: {', '.join(f'{k} {v:.2f}' for k, v in simulated.items())}; best baseline: {best}")

        # 4. the replays
        runs: dict[str, list[JobResult]] = {}
        walls: dict[str, float] = {}
        for name in ("gadget", best):
            _say(f"replaying {len(jobs)} jobs under {name}")
            runs[name], walls[name] = await _run_jobs(hosts, make_scheduler(name, seed=args.seed), cost1, jobs,
                                                      work / name, name)
            s = _summary(runs[name])
            _say(f"{name}: utility {s['total_utility']:.2f}, mean JCT {s['jct_mean_s']:.1f} s, {s['done']}/{s['jobs']} done, "
                 f"{walls[name]:.0f} s")

        # 5. the model against measurements
        replay_runs = [runs["gadget"], runs[best]]
        replay_obs = [o for run in replay_runs for o in _observed(run, host_names)]
        every = probe_obs + replay_obs
        cost2 = _fit(prior, every)
        err, rows = _error_by_placement(cost2, every)
        fair = _fit(prior, every, link_sharing=False)             # shared compute, fair link shares
        err_fair, _ = _error_by_placement(fair, every)
        plain = _fit(plain_prior, every, link_sharing=False)      # neither term: the model before this change
        err_plain, _ = _error_by_placement(plain, every)
        err_plain_probe, _ = _error_by_placement(_fit(plain_prior, probe_obs, link_sharing=False), replay_obs)
        err_probe_fit, _ = _error_by_placement(cost1, replay_obs)
        _say(f"model error {err:.3f} ({cost2.network}); with fair link shares {err_fair:.3f}; plain model "
             f"(no shared compute, fair shares) {err_plain:.3f}; GADGET's probe fit on the replays {err_probe_fit:.3f} "
             f"(plain {err_plain_probe:.3f})")
        g, b = _summary(runs["gadget"]), _summary(runs[best])
        if not args.no_plot:
            args.out = run_folder("gadget-real", args.out)
            _plot_cdfs({"gadget": g["jct_s"], best: b["jct_s"]}, args.out / "gadget_real_jct_cdf.png",
                       f"{len(jobs)} ITP jobs replayed on {len(specs)} emulated hosts x {specs[0].slots} slots, "
                       f"{specs[0].bandwidth_mbit:g} Mbit/s")
            _say(f"CDF plot: {args.out / 'gadget_real_jct_cdf.png'}")
        return {
            "hosts": str(HOSTS.relative_to(ROOT)), "slots": [s.slots for s in specs],
            "mbit": specs[0].bandwidth_mbit, "trace": str(args.trace or TRACE),
            "slice": {"start": args.real_start, "jobs": args.real_jobs, "arrive_s": args.real_arrive_s,
                      "models": dict(Counter(j.model for j in sim_jobs)),
                      "utilities": dict(Counter(x.utility_kind for x in generated)),
                      "requested": dict(Counter(j.requested_workers for j in sim_jobs))},
            "calibration": {"cores": cores, "probe_jobs": len(probe_obs), "probe_fit_model_error": err1,
                            "probe_fit": _constants(cost1), "jobs": len(every), **_constants(cost2)},
            "simulated_utility": simulated, "best_baseline": best,
            "gadget": g, "baseline": b,
            "real_utility_vs_best_baseline": g["total_utility"] / b["total_utility"] if b["total_utility"] > 0 else float("inf"),
            "model_error": err, "model_error_fair_link_shares": err_fair, "model_error_plain": err_plain,
            "model_error_probe_fit": err_probe_fit, "model_error_plain_probe_fit": err_plain_probe,
            "placements": rows,
            "wall_s": time.monotonic() - t_begin,
        }
    finally:
        hosts.close()
        shutil.rmtree(work, ignore_errors=True)


def _plot_cdfs(jcts: dict[str, list[float]], path: Path, title: str) -> None:
    """The measured job completion times' CDFs, one step line per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, xs in jcts.items():
        xs = sorted(xs)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("job completion time (s), measured")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def part_b(args: argparse.Namespace) -> dict[str, Any]:
    """The real replay (module docstring); ``args`` may lack any option (defaults apply)."""
    full = argparse.Namespace(**{**vars(_parser().parse_args([])), **{k: v for k, v in vars(args).items()
                                                                      if k in vars(_parser().parse_args([]))}})
    return asyncio.run(_part_b(full))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--trace", default=None, help=f"trace CSV (default {TRACE})")
    ap.add_argument("--real-jobs", type=int, default=20, help="jobs in the replayed slice")
    ap.add_argument("--real-start", type=int, default=1000, help="index of the slice's first job in the trace")
    ap.add_argument("--real-arrive-s", type=float, default=40.0, help="seconds the slice's arrivals are compressed to")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model/utility assignment and of `random`")
    ap.add_argument("--out", default=None, help="folder for the completion-time CDFs (default runs/bench/gadget-real-<timestamp>/)")
    ap.add_argument("--no-plot", action="store_true", help="draw no plot")
    return ap


def main() -> None:
    args = _parser().parse_args()
    res = part_b(args)
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
