"""Jobs for the simulator: utility functions, the trace reader and the trace -> job conversion.

The utilities (:class:`LinearDecay`, :class:`SigmoidDeadline`, :class:`ConvergenceStop`) say what a
job is worth when it completes, and :func:`jobs_from_trace` turns a trace's jobs into simulator jobs
whose work, run as recorded, takes the recorded duration (model types and utilities are drawn,
seeded: the trace has neither). Formulas: docs/gadget.md, "Jobs and utilities".
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections.abc import Sequence

from hmp.errors import ConfigError

from .interface import PendingJob, Utility
from .model import RingCostModel

TRACE_COLUMNS = ("job_id", "submit_time_s", "num_gpus", "duration_s")


class TraceError(ConfigError):
    """A trace file that cannot be used: names the file and the line."""

    def __init__(self, path: str, line: int, expected: str) -> None:
        Exception.__init__(self, f"{path}:{line}: {expected}")
        self.path, self.key, self.expected, self.line = path, f"line {line}", expected, line


# --- utilities ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearDecay:
    value: float
    zero_at_s: float

    def __call__(self, completion_s: float) -> float:
        return self.value * max(0.0, 1.0 - completion_s / self.zero_at_s)


@dataclasses.dataclass(frozen=True)
class SigmoidDeadline:
    value: float
    deadline_s: float
    width_s: float

    def __call__(self, completion_s: float) -> float:
        z = (completion_s - self.deadline_s) / self.width_s
        if z > 700:  # exp overflow; the value is 0 to double precision anyway
            return 0.0
        return self.value / (1.0 + math.exp(z))


@dataclasses.dataclass(frozen=True)
class ConvergenceStop:
    value: float
    converge_s: float
    grace_s: float

    def __call__(self, completion_s: float) -> float:
        late = max(0.0, completion_s - self.converge_s)
        return self.value * max(0.0, 1.0 - late / self.grace_s)


def check_utility(u: Utility, horizon_s: float, points: int = 64) -> None:
    """Raise if ``u`` is negative or increases on [0, horizon_s] (sampled): schedulers rely on both."""
    prev = u(0.0)
    for i in range(1, points + 1):
        cur = u(horizon_s * i / points)
        if cur < 0 or cur > prev + 1e-12:
            raise ValueError(f"utility {u} must be >= 0 and non-increasing; at t={horizon_s * i / points} it is {cur}")
        prev = cur


# --- trace -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_s: float
    num_gpus: int
    duration_s: float


def read_trace(path: str, limit: int | None = None) -> list[TraceJob]:
    """Read a CSV with (at least) columns job_id, submit_time_s, num_gpus, duration_s; sorted by submit
    time (stable). Raises :class:`TraceError` naming the file and line of the first bad row."""
    try:
        f = open(path, newline="")
    except OSError as e:
        raise TraceError(path, 0, f"cannot open: {e.strerror}") from None
    jobs: list[TraceJob] = []
    seen: set[str] = set()
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(path, 1, f"empty file; expected a header with columns {', '.join(TRACE_COLUMNS)}")
        header = [h.strip() for h in header]
        missing = [c for c in TRACE_COLUMNS if c not in header]
        if missing:
            raise TraceError(path, 1, f"header lacks column(s) {', '.join(missing)}; it has {', '.join(header)}")
        idx = {c: header.index(c) for c in TRACE_COLUMNS}
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < len(header):
                raise TraceError(path, line, f"{len(row)} fields, the header has {len(header)}")
            job_id = row[idx["job_id"]].strip()
            if not job_id:
                raise TraceError(path, line, "empty job_id")
            if job_id in seen:
                raise TraceError(path, line, f"job_id {job_id!r} appears twice")
            try:
                submit = float(row[idx["submit_time_s"]])
                gpus_text = row[idx["num_gpus"]].strip()
                gpus = int(gpus_text)
                duration = float(row[idx["duration_s"]])
            except ValueError as e:
                raise TraceError(path, line, f"not a number: {e}") from None
            if not (math.isfinite(submit) and submit >= 0):
                raise TraceError(path, line, f"submit_time_s must be a finite number >= 0, got {submit}")
            if gpus < 1:
                raise TraceError(path, line, f"num_gpus must be an integer >= 1, got {gpus}")
            if not (math.isfinite(duration) and duration > 0):
                raise TraceError(path, line, f"duration_s must be a finite number > 0, got {duration}")
            seen.add(job_id)
            jobs.append(TraceJob(job_id, submit, gpus, duration))
            if limit is not None and len(jobs) >= limit:
                break
    if not jobs:
        raise TraceError(path, 2, "no jobs")
    jobs.sort(key=lambda j: j.submit_s)
    return jobs


# --- trace -> jobs -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UtilityMix:
    """How utilities are drawn for trace jobs (synthetic). Times scale with the job's recorded duration
    ``d`` so that short and long jobs are judged alike; ``value`` is 1 for every job (utility <= jobs)."""

    linear: float = 1 / 3           # weights of the three kinds
    sigmoid: float = 1 / 3
    convergence: float = 1 / 3
    linear_zero_at: float = 4.0     # LinearDecay zero_at_s = linear_zero_at * d + slack_s
    deadline: float = 2.0           # SigmoidDeadline deadline_s = deadline * d + slack_s
    deadline_width: float = 0.1     # width_s = deadline_width * deadline_s
    converge_lo: float = 0.5        # converge_fraction ~ U(converge_lo, converge_hi)
    converge_hi: float = 0.9
    grace: float = 2.0              # ConvergenceStop grace_s = grace * d + slack_s
    slack_s: float = 1800.0         # every job may wait this long (half an hour) on top


@dataclasses.dataclass(frozen=True)
class GeneratedJob:
    """A simulator job plus where it came from (for reports)."""

    job: PendingJob
    trace: TraceJob
    utility_kind: str               # "linear" | "sigmoid" | "convergence"
    converge_fraction: float        # 1.0 unless utility_kind == "convergence"


def jobs_from_trace(trace: Sequence[TraceJob], cost: RingCostModel, *, seed: int = 0,
                    models: Sequence[str] | None = None, mix: UtilityMix = UtilityMix(),
                    max_scale: float = 1.0) -> list[GeneratedJob]:
    """Simulator jobs from trace jobs; model types and utilities are synthetic (seeded), see module doc.

    Worker bounds: ``min_workers = 1``, ``max_workers = min(ceil(max_scale * num_gpus), cluster slots)``;
    baselines run jobs at ``requested_workers = min(num_gpus, cluster slots)``.
    """
    rng = random.Random(seed)
    names = sorted(models if models is not None else cost.models)
    if not names:
        raise ValueError("no model types to assign")
    total = cost.cluster.total_slots
    weights = (mix.linear, mix.sigmoid, mix.convergence)
    out: list[GeneratedJob] = []
    for t in trace:
        model = rng.choice(names)
        kind = rng.choices(("linear", "sigmoid", "convergence"), weights=weights)[0]
        requested = min(t.num_gpus, total)
        placement = cost.compact_placement(requested)
        rate = cost.samples_per_iteration(model, requested) / cost.iteration_s(model, placement)
        samples = t.duration_s * rate
        d = t.duration_s
        fraction = 1.0
        utility: Utility
        if kind == "linear":
            utility = LinearDecay(1.0, mix.linear_zero_at * d + mix.slack_s)
        elif kind == "sigmoid":
            deadline = mix.deadline * d + mix.slack_s
            utility = SigmoidDeadline(1.0, deadline, mix.deadline_width * deadline)
        else:
            fraction = rng.uniform(mix.converge_lo, mix.converge_hi)
            samples *= fraction
            utility = ConvergenceStop(1.0, fraction * d, mix.grace * d + mix.slack_s)
        job = PendingJob(
            job_id=t.job_id, submit_s=t.submit_s, model=model, min_workers=1,
            max_workers=max(requested, min(math.ceil(max_scale * t.num_gpus), total)),
            requested_workers=requested, samples=samples, utility=utility)
        out.append(GeneratedJob(job, t, kind, fraction))
    return out
