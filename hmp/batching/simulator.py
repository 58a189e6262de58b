"""A virtual-time simulator for the batch policies (:mod:`hmp.batching.hogbatch`): virtual workers
with a throughput model run a policy's assignments; nothing sleeps, it is arithmetic. The policy
tests and docs/hogbatch.md use it; it is also a command-line tool::

    python -m hmp.batching.simulator adaptive --knob base_batch=16 --knob threshold=2 \
        --worker c0=cpu:1000 --worker g0=gpu:10000:256 --seconds 60
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
from collections.abc import Mapping

from hmp.batching.hogbatch import WORKER_KINDS, Assignment, BatchPolicy, WorkerReport, _finite, make_policy


@dataclasses.dataclass(frozen=True, slots=True)
class SimWorker:
    """A virtual worker for :func:`simulate`.

    Throughput at batch size ``b`` is ``samples_per_s * b / (b + half_batch)`` samples/s
    (``half_batch`` = 0: flat, like a Hogwild CPU; large: a GPU that needs big batches to be
    busy), multiplied by ``slow_factor`` from ``slow_at_s`` on. From ``leave_at_s`` on the
    worker is gone: its batch in flight is lost and it stops reporting.
    """

    kind: str
    samples_per_s: float
    half_batch: float = 0.0
    slow_at_s: float | None = None
    slow_factor: float = 1.0
    leave_at_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in WORKER_KINDS:
            raise ValueError(f"worker kind must be one of {WORKER_KINDS}, got {self.kind!r}")
        if not _finite(self.samples_per_s) or self.samples_per_s <= 0:
            raise ValueError(f"samples_per_s must be > 0, got {self.samples_per_s!r}")
        if not _finite(self.half_batch) or self.half_batch < 0:
            raise ValueError(f"half_batch must be >= 0, got {self.half_batch!r}")
        if not _finite(self.slow_factor) or self.slow_factor <= 0:
            raise ValueError(f"slow_factor must be > 0, got {self.slow_factor!r}")

    def speed(self, batch: int, t: float) -> float:
        """Samples/s when running batches of ``batch`` at virtual time ``t`` seconds."""
        factor = self.slow_factor if self.slow_at_s is not None and t >= self.slow_at_s else 1.0
        return factor * self.samples_per_s * batch / (batch + self.half_batch)

    def alive(self, t: float) -> bool:
        return self.leave_at_s is None or t < self.leave_at_s


@dataclasses.dataclass(frozen=True, slots=True)
class SimStep:
    """One report interval of :func:`simulate`: it ends at virtual time ``t_s``; ``updates`` and
    ``samples`` were completed per worker in the interval; ``assignments`` is what the policy
    returned at its end (for the entry at ``t_s`` = 0: the initial assignments, no counts)."""

    t_s: float
    updates: dict[str, int]
    samples: dict[str, int]
    assignments: dict[str, Assignment]


@dataclasses.dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`: worker kinds and one :class:`SimStep` per report."""

    kinds: dict[str, str]
    steps: tuple[SimStep, ...]

    def _total(self, field: str, since_s: float, until_s: float) -> dict[str, int]:
        out = dict.fromkeys(self.kinds, 0)
        for step in self.steps:
            if since_s < step.t_s <= until_s:
                for k, n in getattr(step, field).items():
                    out[k] += n
        return out

    def updates(self, since_s: float = 0.0, until_s: float = math.inf) -> dict[str, int]:
        """Model updates per worker completed in the intervals ending in ``(since_s, until_s]``."""
        return self._total("updates", since_s, until_s)

    def samples(self, since_s: float = 0.0, until_s: float = math.inf) -> dict[str, int]:
        """Examples per worker processed in the intervals ending in ``(since_s, until_s]``."""
        return self._total("samples", since_s, until_s)

    def update_share(self, kind: str, since_s: float = 0.0, until_s: float = math.inf) -> float:
        """Fraction of the model updates made by workers of ``kind`` (0 when there were none)."""
        return self._share(self.updates(since_s, until_s), kind)

    def sample_share(self, kind: str, since_s: float = 0.0, until_s: float = math.inf) -> float:
        """Fraction of the examples processed by workers of ``kind`` (0 when there were none)."""
        return self._share(self.samples(since_s, until_s), kind)

    def _share(self, counts: dict[str, int], kind: str) -> float:
        total = sum(counts.values())
        return sum(n for k, n in counts.items() if self.kinds[k] == kind) / total if total else 0.0

    def assignments_at(self, t_s: float) -> dict[str, Assignment]:
        """The assignments in force at virtual time ``t_s`` (returned by the last report <= t_s)."""
        current = self.steps[0].assignments
        for step in self.steps:
            if step.t_s > t_s:
                break
            current = step.assignments
        return current

    @property
    def final(self) -> dict[str, Assignment]:
        """The last assignments the policy returned."""
        return self.steps[-1].assignments


def simulate(
    policy: BatchPolicy,
    workers: Mapping[str, SimWorker],
    seconds: float,
    report_every_s: float = 1.0,
) -> SimResult:
    """Run ``policy`` against virtual ``workers`` for ``seconds`` of virtual time.

    Asynchronous assignments: each worker runs back-to-back batches of its current batch size
    (one model update per batch), picking up a new batch size when its next batch starts; a
    worker the policy dropped stays idle until the policy lists it again. Synchronous
    assignments: all live workers run one batch per step, the step lasts as long as the
    slowest, and each worker counts one update per step. Every ``report_every_s`` the live
    workers report the samples/s they completed in the interval (``loss`` nan) and the policy
    is updated with the virtual time as ``now_s``. Nothing sleeps; it is arithmetic.
    """
    if not _finite(seconds) or seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if not _finite(report_every_s) or report_every_s <= 0:
        raise ValueError(f"report_every_s must be > 0, got {report_every_s!r}")
    if not workers:
        raise ValueError("simulate needs at least one worker")
    kinds = {k: w.kind for k, w in workers.items()}
    assign = policy.initial(list(kinds.items()))
    steps = [SimStep(0.0, {}, {}, assign)]
    total_updates = dict.fromkeys(workers, 0)  # cumulative, as workers report them
    win_updates = dict.fromkeys(workers, 0)  # counts in the current report interval
    win_samples = dict.fromkeys(workers, 0)
    win_busy = dict.fromkeys(workers, 0.0)  # busy seconds in the current report interval
    current = {k: a.batch_size for k, a in assign.items()}  # batch size each worker last ran

    def complete(k: str, batch: int, duration: float) -> None:
        total_updates[k] += 1
        win_updates[k] += 1
        win_samples[k] += batch
        win_busy[k] += duration

    def report(t: float) -> dict[str, Assignment]:
        reports = [
            WorkerReport(k, kinds[k], win_samples[k] / report_every_s, total_updates[k], math.nan,
                         min(1.0, win_busy[k] / report_every_s), current[k], t)
            for k, w in workers.items() if w.alive(t)
        ]
        out = policy.update(reports, t)
        steps.append(SimStep(t, dict(win_updates), dict(win_samples), out))
        for k in workers:
            win_updates[k], win_samples[k], win_busy[k] = 0, 0, 0.0
        return out

    next_report = report_every_s
    if any(a.sync for a in assign.values()):
        t = 0.0
        while t < seconds:
            live = [k for k in assign if workers[k].alive(t)]
            if not live:
                break
            current.update({k: assign[k].batch_size for k in live})
            times = {k: current[k] / workers[k].speed(current[k], t) for k in live}
            t += max(times.values())  # the barrier waits for the slowest
            while next_report <= min(t, seconds):
                assign = report(next_report)
                next_report += report_every_s
            if t > seconds:
                break
            for k in live:
                if workers[k].alive(t):
                    complete(k, current[k], times[k])
    else:
        queue: list[tuple[float, str, int, float]] = []  # (finish time, worker, batch, duration)
        idle = set(workers)

        def start_idle(t: float) -> None:
            for k in sorted(idle):
                if k in assign and workers[k].alive(t):
                    b = current[k] = assign[k].batch_size
                    d = b / workers[k].speed(b, t)
                    heapq.heappush(queue, (t + d, k, b, d))
                    idle.discard(k)

        start_idle(0.0)
        while queue:
            t, k, b, d = heapq.heappop(queue)
            while next_report <= min(t, seconds):
                assign = report(next_report)
                start_idle(next_report)
                next_report += report_every_s
            if t > seconds:
                break
            idle.add(k)
            if workers[k].alive(t):  # else it left with this batch in flight: the batch is lost
                complete(k, b, d)
            start_idle(t)
    while next_report <= seconds:
        assign = report(next_report)
        next_report += report_every_s
    return SimResult(kinds, tuple(steps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hmp.batching.simulator", description=__doc__.split("::")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy", help="static, sync, hogbatch or adaptive")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                    help="a policy knob (docs/hogbatch.md), e.g. base_batch=16; repeatable")
    ap.add_argument("--worker", action="append", default=[], metavar="ID=KIND:SAMPLES_PER_S[:HALF_BATCH]",
                    help="a virtual worker, e.g. g0=gpu:10000:256; repeatable")
    ap.add_argument("--seconds", type=float, default=60.0, help="virtual seconds to run")
    ap.add_argument("--report-every", type=float, default=1.0, help="report interval (virtual seconds)")
    args = ap.parse_args(argv)
    try:
        knobs = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.knob)}
        workers = {}
        for spec in args.worker:
            wid, _, rest = spec.partition("=")
            kind, speed, *half = rest.split(":")
            workers[wid] = SimWorker(kind, float(speed), float(half[0]) if half else 0.0)
        result = simulate(make_policy(args.policy, **knobs), workers, args.seconds, args.report_every)
    except (ValueError, json.JSONDecodeError) as exc:
        ap.error(str(exc))
    print(json.dumps({"update_share": {k: result.update_share(k) for k in WORKER_KINDS},
                      "sample_share": {k: result.sample_share(k) for k in WORKER_KINDS},
                      "updates": result.updates(), "samples": result.samples(),
                      "final": {k: dataclasses.asdict(a) for k, a in result.final.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
