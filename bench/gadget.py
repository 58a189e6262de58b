"""GADGET benchmark (issue 12): (a) trace-driven simulation, (b) the real replay on emulated hosts.

(a) Simulation, pure (hmp.gadget):

- the cost model's constants are fitted to the measured Pollux step times (data/throughput); the fit's
  median and p90 relative error per model are reported (``fit``);
- the trace (default data/traces/itp_cluster04_busiest5000.csv, the first ``--jobs`` submissions;
  ``--trace PATH`` for any CSV with job_id, submit_time_s, num_gpus, duration_s) becomes jobs with a
  seeded, synthetic model type and utility each (hmp.gadget.jobs);
- the cluster is sized from the trace: hosts of 4 slots (the Pollux testbed's nodes, 50 Gbit/s links),
  as many as carry the trace's *average* offered load (GPU-seconds / submission span) at ``--load``
  (default 1.0: capacity = average demand, so every burst above the average queues), and at least
  enough for the widest job;
- every scheduler but ``optimal`` replays the jobs: total utility, mean / p50 / p99 completion time,
  makespan, utilization, mean queueing delay; ``utility_vs_best_baseline`` = GADGET's total utility over
  the best baseline's, summed over ``--seeds`` draws of the synthetic assignment (default 3; target >= 1.1),
  with each draw's ratio as the spread; the completion-time CDFs (first draw) go to gadget_jct_cdf.png in the run folder;
- ``gap_vs_optimal``: on ``--instances`` small random rounds (hmp.gadget.instances), 1 - GADGET's round
  value / the exact optimum's; worst and mean, for one host (the regime of the proved bound: gap <= 0.5)
  and for 2-3 hosts with running rings sharing links (no bound proved; measured).

(b) ``part_b(args)``: if bench/_gadget_real.py exists (written with the cluster mode, hmp.manager), its
``part_b(args) -> dict`` replays a short slice for real; its figures (``real_utility_vs_best_baseline``,
``model_error``) are merged under ``real``. ``--skip-real`` skips it.

Run: ``python bench/gadget.py [--json] [--trace PATH] [--jobs N] [--load L] [--skip-real] [--out DIR] [--no-plot]``;
progress goes to stderr; with --json the last stdout line is one JSON object. The plots go to ``--out``
(default ``runs/bench/gadget-<timestamp>/``, printed at the end); ``--out docs`` redraws the docs' figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)

from _stats import run_folder  # noqa: E402  (bench/_stats.py)
from hmp.gadget.fit import fit_throughput  # noqa: E402
from hmp.gadget.instances import compare_round, random_round  # noqa: E402
from hmp.gadget.jobs import jobs_from_trace, read_trace  # noqa: E402
from hmp.gadget.model import uniform_cluster  # noqa: E402
from hmp.gadget.schedulers import SCHEDULERS, make_scheduler  # noqa: E402
from hmp.gadget.simulate import SimulationResult, simulate  # noqa: E402

DEFAULT_TRACE = os.path.join(ROOT, "data", "traces", "itp_cluster04_busiest5000.csv")
SLOTS_PER_HOST = 4
BASELINES = tuple(n for n in SCHEDULERS if n not in ("gadget", "optimal"))
TARGETS = {"utility_vs_best_baseline": 1.1, "gap_vs_optimal_one_host_worst": 0.5}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class ClusterSizing:
    jobs: int
    span_s: float
    gpu_seconds: float
    offered_gpus: float        # average GPUs busy if every job ran as recorded: gpu_seconds / span
    load: float
    hosts: int
    slots: int


def size_cluster(trace, load: float) -> ClusterSizing:
    span = max(1.0, trace[-1].submit_s - trace[0].submit_s)
    gpu_s = sum(t.num_gpus * t.duration_s for t in trace)
    offered = gpu_s / span
    widest = max(t.num_gpus for t in trace)
    hosts = max(math.ceil(widest / SLOTS_PER_HOST), math.ceil(offered / load / SLOTS_PER_HOST))
    return ClusterSizing(len(trace), span, gpu_s, offered, load, hosts, hosts * SLOTS_PER_HOST)


def summary(r: SimulationResult) -> dict:
    return {
        "total_utility": round(r.total_utility, 3),
        "jobs": len(r.outcomes),
        "jct_mean_h": round(r.jct_mean_s / 3600, 3),
        "jct_p50_h": round(r.jct_p50_s / 3600, 3),
        "jct_p99_h": round(r.jct_p99_s / 3600, 3),
        "queue_mean_h": round(r.queue_mean_s / 3600, 3),
        "makespan_h": round(r.makespan_s / 3600, 2),
        "utilization": round(r.utilization, 4),
        "scheduler_calls": r.scheduler_calls,
        "wall_s": round(r.wall_s, 2),
    }


def plot_cdfs(results: dict[str, SimulationResult], path: os.PathLike, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        x, y = r.jct_cdf()
        ax.step(x / 3600, y, where="post", label=f"{name} (utility {r.total_utility:.0f})",
                linewidth=2.2 if name == "gadget" else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (hours, log scale)")
    ax.set_ylabel("fraction of jobs completed")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gap_vs_optimal(fit, instances: int, seed: int) -> dict:
    """GADGET against the exact round optimum on small random rounds (see the module doc)."""
    models = fit.model_types()
    out = {}
    for label, hosts, slots, running in (("one_host", 1, 6, 0), ("multi_host", 3, 2, 2)):
        rng = random.Random(seed * 1000 + hosts)
        cost = fit.cost_model(uniform_cluster(hosts, slots, fit.link_bytes_s)).with_models(models)
        gaps = []
        for _ in range(instances):
            view = random_round(rng, cost, max_jobs=5, max_workers=4, running=running)
            c = compare_round(view)
            if c.optimal_value > 1e-9:
                gaps.append(1.0 - c.ratio)
        out[label] = {"instances": len(gaps), "worst_gap": round(max(gaps), 4) if gaps else None,
                      "mean_gap": round(sum(gaps) / len(gaps), 4) if gaps else None,
                      "optimal_reached": sum(1 for g in gaps if g < 1e-9)}
    return out


def part_a(args) -> dict:
    t0 = time.monotonic()
    log("fitting the cost model to data/throughput (Pollux step times) ...")
    fit = fit_throughput()
    fit_report = {m: {"rows": e.rows, "median_rel_error": round(e.median_relative_error, 4),
                      "p90_rel_error": round(e.p90_relative_error, 4),
                      "scalability_median_rel_error": round(fit.scalability_error[m].median_relative_error, 4),
                      "scalability_p90_rel_error": round(fit.scalability_error[m].p90_relative_error, 4)}
                  for m, e in fit.placements_error.items()}
    trace = read_trace(args.trace, limit=args.jobs)
    sizing = size_cluster(trace, args.load)
    log(f"trace {args.trace}: {sizing.jobs} jobs over {sizing.span_s / 3600:.1f} h, offered load "
        f"{sizing.offered_gpus:.0f} GPUs -> {sizing.hosts} hosts x {SLOTS_PER_HOST} slots (load {args.load})")
    cost = fit.cost_model(uniform_cluster(sizing.hosts, SLOTS_PER_HOST, fit.link_bytes_s))
    # The model types and utilities are a synthetic, seeded draw: one draw is one sample of many possible
    # workloads, so the headline sums utility over --seeds draws (seed, seed+1, ...) and the per-draw ratios
    # are given as the spread. Tables and the plot are the first draw's.
    seeds = [args.seed + i for i in range(args.seeds)]
    per_seed: dict[int, dict[str, SimulationResult]] = {}
    for seed in seeds:
        jobs = [g.job for g in jobs_from_trace(trace, cost, seed=seed)]
        per_seed[seed] = {}
        for name in ("gadget", *BASELINES):
            log(f"seed {seed}: simulating {name} ...")
            r = per_seed[seed][name] = simulate(jobs, cost, make_scheduler(name, seed=seed), progress=log,
                                                check_every=args.check_every)
            log(f"  {name}: utility {r.total_utility:.1f}, {r.wall_s:.1f} s")
    results = per_seed[seeds[0]]
    totals = {n: sum(per_seed[s][n].total_utility for s in seeds) for n in ("gadget", *BASELINES)}
    best_baseline = max(BASELINES, key=lambda n: totals[n])
    ratio = totals["gadget"] / totals[best_baseline]
    seed_ratios = {s: round(per_seed[s]["gadget"].total_utility
                            / max(per_seed[s][n].total_utility for n in BASELINES), 4) for s in seeds}
    if not args.no_plot:
        args.out = run_folder("gadget", args.out)
        plot_cdfs(results, args.out / "gadget_jct_cdf.png", f"{os.path.basename(args.trace)}: {sizing.jobs} jobs, {sizing.hosts} hosts x "
                                      f"{SLOTS_PER_HOST} slots (load {args.load})\nmodel types and utilities synthetic "
                                      f"(seed {args.seed}); cost model fitted to Pollux step times")
    log(f"GADGET vs the exact optimum on {args.instances} small rounds per regime ...")
    gaps = gap_vs_optimal(fit, args.instances, args.seed)
    return {
        "trace": os.path.relpath(args.trace, ROOT) if args.trace.startswith(ROOT) else args.trace,
        "sizing": dataclasses.asdict(sizing),
        "fit": {"intra_to_link": fit.intra_to_link, "hop_latency_s": fit.network.hop_latency_s,
                "per_model": fit_report},
        "schedulers": {n: summary(r) for n, r in results.items()},
        "seeds": seeds,
        "total_utility_over_seeds": {n: round(v, 1) for n, v in totals.items()},
        "best_baseline": best_baseline,
        "utility_vs_best_baseline": round(ratio, 4),
        "utility_vs_best_baseline_per_seed": seed_ratios,
        "gap_vs_optimal": gaps,
        "gap_vs_optimal_one_host_worst": gaps["one_host"]["worst_gap"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


def part_b(args) -> dict | None:
    """Part (b), the real replay on emulated hosts. ``bench/_gadget_real.py`` (the cluster mode's half)
    provides ``part_b(args: argparse.Namespace) -> dict``; None when skipped or not there."""
    if args.skip_real:
        return None
    path = os.path.join(HERE, "_gadget_real.py")
    if not os.path.exists(path):
        log("bench/_gadget_real.py not found: part (b) skipped")
        return None
    spec = importlib.util.spec_from_file_location("_gadget_real", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.part_b(args)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="CSV with job_id, submit_time_s, num_gpus, duration_s")
    p.add_argument("--jobs", type=int, default=0, help="first N submissions of the trace (default 0: all)")
    p.add_argument("--load", type=float, default=1.0, help="offered load / cluster capacity (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="first seed of the synthetic model/utility assignment")
    p.add_argument("--seeds", type=int, default=3, help="draws of that assignment (seed, seed+1, ...; default 3)")
    p.add_argument("--instances", type=int, default=40, help="small random rounds per regime for gap_vs_optimal")
    p.add_argument("--check-every", type=int, default=50, help="full slot recount every N events (0: never)")
    p.add_argument("--out", default=None, help="folder for the plots (default runs/bench/gadget-<timestamp>/)")
    p.add_argument("--no-plot", action="store_true", help="draw no plots")
    p.add_argument("--skip-real", action="store_true", help="skip part (b), the real replay")
    args = p.parse_args(argv)
    if args.jobs == 0:
        args.jobs = None
    report = {"part_a": part_a(args)}
    real = part_b(args)
    if real is not None:
        report["real"] = real
    report["targets"] = TARGETS
    if args.out:
        log(f"plots in {args.out}")
    a = report["part_a"]
    if not args.json:
        print(f"{'scheduler':<10} {'utility':>9} {'jct mean h':>10} {'p99 h':>8} {'makespan h':>10} {'util':>6}")
        for n, s in a["schedulers"].items():
            print(f"{n:<10} {s['total_utility']:>9.1f} {s['jct_mean_h']:>10.2f} {s['jct_p99_h']:>8.1f} "
                  f"{s['makespan_h']:>10.1f} {s['utilization']:>6.3f}")
        print(f"utility_vs_best_baseline ({a['best_baseline']}, total over seeds {a['seeds']}): "
              f"{a['utility_vs_best_baseline']}; per seed (vs that seed's best baseline): "
              f"{a['utility_vs_best_baseline_per_seed']}")
        print(f"gap_vs_optimal: {json.dumps(a['gap_vs_optimal'])}")
        print("fit (median / p90 relative error): " + ", ".join(
            f"{m} {v['median_rel_error']:.3f}/{v['p90_rel_error']:.3f}" for m, v in a["fit"]["per_model"].items()))
    else:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    from hmp.errors import ConfigError

    try:
        main()
    except ConfigError as e:  # a bad --trace: say which file and line, no traceback
        sys.exit(f"bench/gadget.py: {e}")
