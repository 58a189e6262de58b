"""Part (b) of bench/gadget.py: a slice of the ITP trace replayed through hmp's real cluster mode (hmp.jobs)
on emulated hosts, under GADGET and under the best baseline, and the cost model against measured iterations.

Setup. ``conf/hosts4x2.toml``: 4 emulated hosts x 2 worker slots, every link shaped to 200 Mbit/s each way
(docs/emulate.md). One :class:`hmp.emulate.EmulatedHosts` is started once and shared by every
:class:`hmp.jobs.JobManager` below (each job: a scheduler daemon and one CPU ring worker per slot, inside
the hosts the placement names). Two model types, both ring-all-reduce MLPs on digits, batch 32 per worker:
``wide`` (64-1024-1024-10: 4.5 MB of gradient per step, little compute: a ring that spans hosts waits on
the links) and ``mid`` (64-256-256-10: 0.35 MB).

Method.

1. *Probes* (calibration): each model type runs on 1 worker, 2 on one host, 1+1, 2+2 and 1+1+1+1 hosts,
   in four groups of jobs that run together (:data:`PROBE_GROUPS`, placed by a pinned scheduler; the last
   group's two rings share every link); each job's measured iteration time (the ring workers' mean step
   time, ``step_s``, median over the ring) is a measurement, and the cost model's constants (per-model
   compute, intra-host bandwidth, link efficiency, hop latency) are fitted to them as in step 5, starting
   from each model's gradient bytes and its compute time profiled in this process. The replays' schedulers
   get this fit (hmp.gadget's model: the constants, not step 5's CPU-sharing term).
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
5. *Model error*: every job of the probes and of both replays is a measurement: its placement, its measured
   iteration time, and the rings that ran beside it, stretch by stretch. hmp.gadget's model gives every slot
   a CPU of its own, but here the 8 emulated slots share this machine's cores; so the model used for the
   figure is hmp.gadget's plus one term (ours): in each stretch of a job's run, its compute time is
   stretched by ``max(1, demand / cores)``, ``demand`` = the sum over the rings running (its own included)
   of workers x their compute share of an iteration alone. The constants (compute per model type,
   1/intra-host bandwidth, 1/link efficiency, hop latency: those of :func:`hmp.gadget.model.calibrate`) are
   fitted by non-negative least absolute relative error (iteratively reweighted NNLS) for each ``cores`` of
   :data:`CORES` (inf: no such term, which is ``calibrate`` itself), the best kept. A job's prediction is
   averaged over its stretches. ``model_error`` = the median over the placements seen (model type x
   workers per host) of the median |predicted - measured| / measured (target <= 0.2), fitted on every job;
   ``model_error_without_cpu_sharing``: ``calibrate``'s fit, no such term; ``model_error_probe_fit``: the
   probe-only fit on the replays' jobs (out of sample). GADGET itself schedules with the probe fit's
   hmp.gadget model (no CPU term: the scheduler interface has none).

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
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hmp import log as hmp_log  # noqa: E402
from hmp.emulate import EmulatedHosts, EmulationUnavailable, load_hosts  # noqa: E402
from hmp.gadget.interface import PendingJob, Placement  # noqa: E402
from hmp.gadget.jobs import (ConvergenceStop, LinearDecay, SigmoidDeadline, TraceJob, UtilityMix,  # noqa: E402
                             jobs_from_trace, read_trace)
from hmp.gadget.model import (IterationSample, ModelType, NetworkConstants, RingCostModel, calibrate,  # noqa: E402
                              ring_factor)
from hmp.gadget.schedulers import make_scheduler  # noqa: E402
from hmp.gadget.simulate import simulate  # noqa: E402
from hmp.jobs.manager import DEFAULT_NETWORK, DONE, JobManager, JobResult, cluster_spec  # noqa: E402
from hmp.jobs.spec import JobSpec, loads_job, profile_compute_s  # noqa: E402

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


@dataclasses.dataclass(frozen=True)
class Observed:
    """One finished job as the cost model sees it: what ran beside it, stretch by stretch."""

    model: str
    placement: Placement
    measured_s: float
    segments: tuple[tuple[float, tuple], ...]   # (seconds, other rings (model, placement)) over its run

    @property
    def longest_beside(self) -> tuple:
        return max(self.segments, key=lambda s: s[0])[1] if self.segments else ()


def _observed(run: Sequence[JobResult], hosts: Sequence[str]) -> list[Observed]:
    return [Observed(r.model_type, _placement(r, hosts), r.iteration_s, tuple(_segments(r, run, hosts)))
            for r in run if r.status == DONE and r.iteration_s > 0]


def _cpu_slowdown(cost: RingCostModel, cores: float, model: str, placement: Placement, beside: tuple) -> float:
    """How much longer compute takes when the rings running together want more CPU than ``cores``: each ring
    wants its workers x its compute share of an iteration (the model's compute / iteration time, alone)."""
    if math.isinf(cores):
        return 1.0
    demand = 0.0
    for m, p in ((model, placement), *beside):
        demand += sum(p) * cost.model_type(m).compute_s / cost.iteration_s(m, p)
    return max(1.0, demand / cores)


def _predict(cost: RingCostModel, cores: float, o: Observed) -> float:
    """The cost model's iteration time averaged over the job's stretches, its compute term stretched by the
    CPU oversubscription of each stretch (``cores`` = inf: the cost model as it is)."""
    segs = o.segments or ((1.0, ()),)
    span = sum(d for d, _ in segs) or 1.0
    compute = cost.model_type(o.model).compute_s
    return sum(d * (cost.iteration_s(o.model, o.placement, beside)
                    + compute * (_cpu_slowdown(cost, cores, o.model, o.placement, beside) - 1.0))
               for d, beside in segs) / span


def _fit(prior: RingCostModel, obs: Sequence[Observed], cores: float) -> RingCostModel:
    """Least squares on relative error, as :func:`hmp.gadget.model.calibrate` (same unknowns: compute per
    model type, 1/intra-host bandwidth, 1/link efficiency, hop latency; non-negative), with each job's compute
    column stretched by its run's CPU slowdown (from the previous round's constants; two rounds). With
    ``cores`` = inf this is ``calibrate`` itself."""
    if math.isinf(cores):
        return calibrate(prior, [IterationSample(o.model, o.placement, o.measured_s, o.longest_beside) for o in obs]).cost
    models = sorted({o.model for o in obs})
    cost = prior
    for _ in range(2):
        rows, target = [], []
        for o in obs:
            segs = o.segments or ((1.0, ()),)
            span = sum(d for d, _ in segs) or 1.0
            row = [0.0] * (len(models) + 3)
            row[models.index(o.model)] = sum(d * _cpu_slowdown(cost, cores, o.model, o.placement, b) for d, b in segs) / span
            w = sum(o.placement)
            if w >= 2:
                mt = prior.model_type(o.model)
                grad = ring_factor(w) * mt.grad_bytes
                loaded = prior.breakdown(o.model, o.placement, o.longest_beside)
                if loaded.hosts_spanned >= 2 and loaded.bottleneck_bytes_s < prior.network.intra_host_bytes_s:
                    row[len(models) + 1] = grad * prior.network.link_efficiency / loaded.bottleneck_bytes_s
                else:
                    row[len(models)] = grad
                row[len(models) + 2] = 2 * (w - 1)
            rows.append([x / o.measured_s for x in row])
            target.append(1.0)
        a, b = np.array(rows), np.array(target)
        # Least absolute relative error (the figure reported is a median), by iteratively reweighted least
        # squares: a few slow outliers (a job that started beside others' start-ups) do not drag the fit.
        weight = np.ones(len(b))
        for _ in range(20):
            x, _ = nnls(a * weight[:, None], b * weight)
            weight = 1.0 / np.sqrt(np.maximum(np.abs(a @ x - b), 0.02))
        network = NetworkConstants(intra_host_bytes_s=1.0 / max(x[len(models)], 1e-18), hop_latency_s=float(x[-1]),
                                   link_efficiency=1.0 / max(x[len(models) + 1], 1e-18))
        cost = prior.with_network(network).with_models(
            [dataclasses.replace(prior.model_type(m), compute_s=max(float(x[i]), 1e-6)) for i, m in enumerate(models)])
    return cost


def _error_by_placement(cost: RingCostModel, cores: float, obs: Sequence[Observed]) -> tuple[float, list[dict[str, Any]]]:
    """Median over placements (model type, workers per host) of the median relative error of their jobs."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for o in obs:
        groups.setdefault((o.model, o.placement), []).append((_predict(cost, cores, o), o.measured_s))
    rows = []
    for (model, p), pm in sorted(groups.items()):
        errs = [abs(a - b) / b for a, b in pm]
        rows.append({"model": model, "placement": list(p), "jobs": len(pm),
                     "measured_s": statistics.median(b for _, b in pm), "predicted_s": statistics.median(a for a, _ in pm),
                     "relative_error": statistics.median(errs)})
    return (statistics.median(r["relative_error"] for r in rows) if rows else float("nan")), rows


#: Candidate "effective cores" for the CPU-sharing term; inf = no such term (hmp.gadget's model as it is).
CORES = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, math.inf)


def _best_fit(prior: RingCostModel, obs: Sequence[Observed]) -> tuple[RingCostModel, float, float]:
    """The cores (of :data:`CORES`) whose fit has the lowest model error, with that fit and error."""
    best = None
    for cores in CORES:
        cost = _fit(prior, obs, cores)
        err, _ = _error_by_placement(cost, cores, obs)
        if best is None or err < best[2]:
            best = (cost, cores, err)
    assert best is not None
    return best


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
    cluster = cluster_spec(specs)
    host_names = [s.name for s in specs]
    # The prior cost model: each model type's gradient bytes and batch size, its compute time profiled here.
    prior_models = []
    for model in MODELS:
        spec = job_spec(f"profile-{model}", model, 1, 1, 1, 1)
        prior_models.append(ModelType(model, float(spec.grad_bytes), profile_compute_s(spec), spec.batch_size))
    prior = RingCostModel(cluster, prior_models, DEFAULT_NETWORK)
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
        cost1, cores1, err1 = _best_fit(prior, probe_obs)
        _say(f"calibrated on {len(probe_obs)} probes: model error {err1:.3f} (effective cores {cores1}); "
             f"{cost1.network}; compute " + ", ".join(f"{m.name} {m.compute_s * 1e3:.1f} ms" for m in cost1.models.values()))

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
        cost2, cores2, err = _best_fit(prior, every)
        _, rows = _error_by_placement(cost2, cores2, every)
        plain = _fit(prior, every, math.inf)
        err_plain, _ = _error_by_placement(plain, math.inf, every)
        err_probe_fit, _ = _error_by_placement(cost1, cores1, replay_obs)
        _say(f"model error {err:.3f} (effective cores {cores2}; without the CPU-sharing term {err_plain:.3f}; "
             f"probe-only fit on the replays {err_probe_fit:.3f})")
        g, b = _summary(runs["gadget"]), _summary(runs[best])
        return {
            "hosts": str(HOSTS.relative_to(ROOT)), "slots": [s.slots for s in specs],
            "mbit": specs[0].bandwidth_mbit, "trace": str(args.trace or TRACE),
            "slice": {"start": args.real_start, "jobs": args.real_jobs, "arrive_s": args.real_arrive_s,
                      "models": dict(Counter(j.model for j in sim_jobs)),
                      "utilities": dict(Counter(x.utility_kind for x in generated)),
                      "requested": dict(Counter(j.requested_workers for j in sim_jobs))},
            "calibration": {"probe_jobs": len(probe_obs), "probe_fit_model_error": err1, "probe_fit_cores": cores1,
                            "jobs": len(every), "effective_cores": cores2,
                            "network": dataclasses.asdict(cost2.network),
                            "compute_s": {m.name: m.compute_s for m in cost2.models.values()}},
            "simulated_utility": simulated, "best_baseline": best,
            "gadget": g, "baseline": b,
            "real_utility_vs_best_baseline": g["total_utility"] / b["total_utility"] if b["total_utility"] > 0 else float("inf"),
            "model_error": err, "model_error_without_cpu_sharing": err_plain, "model_error_probe_fit": err_probe_fit,
            "placements": rows,
            "wall_s": time.monotonic() - t_begin,
        }
    finally:
        hosts.close()
        shutil.rmtree(work, ignore_errors=True)


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
