"""Placement planner benchmark: every planner on the shipped models and on seeded random problems.

Problems:

- ``click`` and ``deep_mlp``: the two shipped models (hmp.models), profiled on this machine's CPU
  (measured) plus two GPU types described by speed_scale (labelled NOT_MEASURED). Their minimum
  throughput is set to a fixed fraction (``THROUGHPUT_FRACTION``) of what the best homogeneous pool
  sustains, so that the constraint binds whatever this machine's speed;
- ``random-<seed>``: ``synthetic.random_problem(seed)``, 4-40 layers, 2-4 resource types (most too
  large for brute force), and ``SMALL`` problems of chosen sizes that brute force can enumerate.

For each problem and planner: cost, feasibility, planning seconds. Summary figures:

- ``rl_gap_vs_bruteforce``: mean of ``(rl - bf) / bf`` over problems brute force can enumerate
  (``R ** L <= 2**20``) and finds feasible (an RL plan that is infeasible there counts as inf);
- ``rl_vs_greedy``, ``rl_vs_ga``: mean of ``rl / other`` cost over the larger problems (brute force
  cannot enumerate) where both are feasible;
- the same figures for the RL planner's best *sampled* plan, before its local-search polish
  (``rl_sampled_*``), to show what the policy alone achieves;
- ``feasible_rate``: the share of problems where some planner finds a feasible plan on which the RL
  planner's plan is feasible too (``feasible_rate_by_planner`` for all planners).

Finally, if ``bench/pipeline.py`` exists, it is run with ``--json`` and its last line (measured
throughput of the planned click pipeline against data-parallel) is included under ``pipeline``.

Run: ``python bench/placement.py [--json] [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from hmp.models import click_model, deep_mlp  # noqa: E402
from hmp.placement import cost_model  # noqa: E402
from hmp.placement.baselines import BruteForcePlanner  # noqa: E402
from hmp.placement.problem import PlacementProblem, Plan  # noqa: E402
from hmp.placement.registry import make_planner, problem_from_config  # noqa: E402
from hmp.placement.rl import RLPlanner  # noqa: E402
from hmp.placement.synthetic import random_problem  # noqa: E402

PLANNERS = ("bruteforce", "greedy", "random", "ga", "rl")
RANDOM_SEEDS = tuple(range(12))
#: (layers, types) of the problems brute force can enumerate (R ** L <= 2 ** 20); seeds 100, 101, ...
SMALL = ((4, 2), (6, 3), (8, 4), (10, 2), (12, 3), (10, 4), (16, 2), (20, 2), (9, 4), (12, 2))
QUICK_SEEDS, QUICK_SMALL = tuple(range(3)), SMALL[:4]
#: min_throughput of the shipped-model problems, as a fraction of the best homogeneous pool's.
THROUGHPUT_FRACTION = {"click": 0.9, "deep_mlp": 0.9}
TARGETS = {"rl_gap_vs_bruteforce": 0.03, "rl_vs_greedy": 1.0, "rl_vs_ga": 1.0, "feasible_rate": 1.0}

SHIPPED_CONFIG = {
    "resources": [
        {"name": "cpu", "price_per_hour": 0.17, "count": 16, "device": "cpu"},
        # Not on this machine: CPU times scaled per layer kind (embedding lookups barely speed up,
        # matrix products a lot), plus a per-layer launch overhead.
        {"name": "gpu_t4", "price_per_hour": 0.53, "count": 4, "measured": False, "overhead_s": 2e-5,
         "speed_scale": {"sparse": 0.6, "dense": 8.0, "elementwise": 4.0}},
        {"name": "gpu_a100", "price_per_hour": 3.67, "count": 2, "measured": False, "overhead_s": 1e-5,
         "speed_scale": {"sparse": 1.0, "dense": 40.0, "elementwise": 12.0}},
    ],
    "bandwidth_bytes_per_s": 1.25e9,  # 10 Gbit/s between stages
    "samples": 1e9,
    "min_throughput": 1.0,  # replaced per model, see THROUGHPUT_FRACTION
    "batch_size": 256,
    "reps": 7,
    "warmup": 3,
    "num_threads": 1,
}


def shipped_problems() -> list[PlacementProblem]:
    out = []
    for name, model in (("click", click_model()), ("deep_mlp", deep_mlp())):
        p = problem_from_config(SHIPPED_CONFIG, model, name=name)
        pool = max(r.count * p.batch_size / p.times[:, j].sum() for j, r in enumerate(p.resources))
        out.append(replace(p, min_throughput=THROUGHPUT_FRACTION[name] * pool))
    return out


def run_planners(problem: PlacementProblem) -> dict[str, dict]:
    row: dict[str, dict] = {}
    for name in PLANNERS:
        planner = make_planner(name)
        if isinstance(planner, BruteForcePlanner) and not planner.can_solve(problem):
            continue
        t0 = time.perf_counter()
        extra = {}
        if isinstance(planner, RLPlanner):
            res = planner.train(problem)
            plan: Plan = res.plan
            extra = {"sampled_cost": res.sampled.cost if res.sampled.feasible else None, "evaluations": res.evaluations, "iterations": len(res.history)}
        else:
            plan = planner.plan(problem)
        row[name] = {
            "cost": plan.cost if plan.feasible else None,
            "feasible": plan.feasible,
            "seconds": time.perf_counter() - t0,
            "stages": len(plan.stages),
            **extra,
        }
    return row


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def summarize(results: dict[str, dict], rl_cost: str = "cost") -> dict:
    """The summary figures, for the RL plan's ``cost`` or its ``sampled_cost`` (before the polish)."""
    gaps, vs_greedy, vs_ga = [], [], []
    feasible_somewhere, rl_feasible = 0, 0
    by_planner = {p: [0, 0] for p in PLANNERS}  # feasible, attempted where some planner is feasible
    for res in results.values():
        rows = res["planners"]
        any_feasible = any(r["feasible"] for r in rows.values())
        if any_feasible:
            feasible_somewhere += 1
            rl_feasible += rows["rl"][rl_cost] is not None
            for p, r in rows.items():
                by_planner[p][0] += r["feasible"]
                by_planner[p][1] += 1
        rl = rows["rl"][rl_cost]
        if "bruteforce" in rows:
            bf = rows["bruteforce"]
            if bf["feasible"]:
                gaps.append((rl - bf["cost"]) / bf["cost"] if rl is not None else math.inf)
        else:
            for other, acc in (("greedy", vs_greedy), ("ga", vs_ga)):
                if rl is not None and rows[other]["feasible"]:
                    acc.append(rl / rows[other]["cost"])
    return {
        "rl_gap_vs_bruteforce": _mean(gaps),
        "rl_gap_max": max(gaps) if gaps else None,
        "n_bruteforce_problems": len(gaps),
        "rl_vs_greedy": _mean(vs_greedy),
        "rl_vs_ga": _mean(vs_ga),
        "rl_vs_ga_max": max(vs_ga) if vs_ga else None,
        "n_large_problems": len(vs_ga),
        "feasible_rate": rl_feasible / feasible_somewhere if feasible_somewhere else None,
        "feasible_rate_by_planner": {p: (f / n if n else None) for p, (f, n) in by_planner.items()},
        "targets": TARGETS,
    }


def pipeline_figures() -> dict | None:
    """bench/pipeline.py --json's last line, or None when that benchmark does not exist (yet)."""
    script = os.path.join(ROOT, "bench", "pipeline.py")
    if not os.path.exists(script):
        return None
    proc = subprocess.run([sys.executable, script, "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-2000:] or "no output"}
    except json.JSONDecodeError:
        return {"error": f"last line is not JSON: {lines[-1][:200]!r}"}


def _fmt(r: dict | None) -> str:
    if r is None:
        return f"{'-':>12} {'':>7}"
    cost = f"{r['cost']:12.4g}" if r["feasible"] else f"{'infeasible':>12}"
    return f"{cost} {r['seconds']:6.2f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="(the last line is always JSON; kept for symmetry with the other benches)")
    ap.add_argument("--quick", action="store_true", help=f"random problems {QUICK_SEEDS} only, and no pipeline run")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()

    problems = shipped_problems()
    for p in problems:
        print(f"{p.name}: {p.n_layers} layers; " + "; ".join(p.describe_resources()))
    problems += [random_problem(100 + k, n_layers=L, n_resources=R) for k, (L, R) in enumerate(QUICK_SMALL if args.quick else SMALL)]
    problems += [random_problem(s) for s in (QUICK_SEEDS if args.quick else RANDOM_SEEDS)]

    print(f"\n{'problem':24} {'space':>9} " + " ".join(f"{p:>20}" for p in PLANNERS))
    results: dict[str, dict] = {}
    for p in problems:
        rows = run_planners(p)
        results[p.name] = {
            "n_layers": p.n_layers,
            "n_resources": p.n_resources,
            "all_measured": p.all_measured,
            "resources": {r.name: r.provenance for r in p.resources},
            "lower_bound_cost": cost_model.lower_bound_cost(p),
            "planners": rows,
        }
        print(f"{p.name:24} {p.n_resources:>3}^{p.n_layers:<5} " + " ".join(f"{_fmt(rows.get(n)):>20}" for n in PLANNERS), flush=True)

    summary = summarize(results)
    sampled = summarize(results, "sampled_cost")
    for k in ("rl_gap_vs_bruteforce", "rl_vs_greedy", "rl_vs_ga", "feasible_rate"):
        summary[k.replace("rl_", "rl_sampled_") if k.startswith("rl_") else "sampled_" + k] = sampled[k]
    pipeline = None if args.quick else pipeline_figures()
    print()
    for k in ("rl_gap_vs_bruteforce", "rl_vs_greedy", "rl_vs_ga", "feasible_rate"):
        v = summary[k]
        ks = k.replace("rl_", "rl_sampled_") if k.startswith("rl_") else "sampled_" + k
        vs = summary[ks]
        print(f"{k:22} {'n/a' if v is None else f'{v:.4f}'}   (target {'<=' if k == 'rl_gap_vs_bruteforce' else '<' if k != 'feasible_rate' else '='} {TARGETS[k]})"
              f"   before polish: {'n/a' if vs is None else f'{vs:.4f}'}")
    if pipeline is None:
        print("pipeline: bench/pipeline.py is not available (planned pipeline vs data-parallel not measured)" if not args.quick else "pipeline: skipped (--quick)")
    else:
        print(f"pipeline: {json.dumps(pipeline)[:500]}")
    summary["seconds"] = time.perf_counter() - t_start
    print(f"total {summary['seconds']:.0f}s")
    print(json.dumps({"summary": summary, "problems": results, "pipeline": pipeline}))


if __name__ == "__main__":
    main()
