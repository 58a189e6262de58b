"""Batch-size and data-share policies for heterogeneous CPU+GPU SGD (Ma & Rusu, arXiv:2004.08771).

Pure (no sockets, clocks or threads), so that the scheduler (through :mod:`hmp.batching.adapter`),
the tests and the virtual-time simulator drive the same code: a :class:`BatchPolicy` takes the
workers' :class:`WorkerReport` s and returns each live worker's :class:`Assignment` (batch size,
data share, synchronous or not). One subclass per ``[train] policy``: :class:`StaticPolicy`,
:class:`SyncSGD`, :class:`StaticHogbatch` and :class:`AdaptiveHogbatch`; their rules are in
docs/hogbatch.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence

from hmp.config import BatchPolicyKind
from hmp.ema import ema

#: a worker's device kind, as the policies see it (the adapter maps ``gpu_worker`` to "gpu")
WORKER_KINDS = ("cpu", "gpu")


# ----------------------------------------------------------------------------- values

@dataclasses.dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker's progress, as the scheduler received it.

    ``samples_per_s``: examples processed per second over the worker's last report interval. The
    scheduler passes per *compute* second by default (:mod:`hmp.batching.adapter`: wall-clock speed grows
    with the batch when each update has a fixed communication cost, which made Adaptive Hogbatch
    run away); per wall-clock second with ``policy_args.speed = "wall"``. ``updates``: model updates since the worker started (cumulative). ``loss``: mean
    training loss over the interval, ``nan`` when not measured. ``busy_fraction``: share of the
    interval spent computing, in [0, 1]. ``batch_size``: the batch size used in the interval.
    ``time_s``: the worker's clock when it wrote the report, in seconds; only used to drop
    reports that arrive out of order.
    """

    worker_id: str
    kind: str
    samples_per_s: float
    updates: int
    loss: float
    busy_fraction: float
    batch_size: int
    time_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        _check_kind(self.kind)
        if not _finite(self.samples_per_s) or self.samples_per_s < 0:
            raise ValueError(f"{self.worker_id}: samples_per_s must be a finite number >= 0, got {self.samples_per_s!r}")
        if not isinstance(self.updates, int) or self.updates < 0:
            raise ValueError(f"{self.worker_id}: updates must be an int >= 0, got {self.updates!r}")
        if not isinstance(self.loss, (int, float)):
            raise ValueError(f"{self.worker_id}: loss must be a float (nan when not measured), got {self.loss!r}")
        if not _finite(self.busy_fraction) or not 0.0 <= self.busy_fraction <= 1.0:
            raise ValueError(f"{self.worker_id}: busy_fraction must be in [0, 1], got {self.busy_fraction!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"{self.worker_id}: batch_size must be an int >= 1, got {self.batch_size!r}")
        if not _finite(self.time_s):
            raise ValueError(f"{self.worker_id}: time_s must be a finite number of seconds, got {self.time_s!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """What one worker should do from now on.

    ``batch_size``: examples per model update. ``data_share``: the fraction of the epoch this
    worker is expected to take (first-come-first-served policies hand data out on demand; the
    share is the forecast, used to size prefetching and partitions). ``sync``: updates wait for
    all workers (bulk-synchronous) instead of being applied as they arrive.
    """

    worker_id: str
    batch_size: int
    data_share: float
    sync: bool


# ----------------------------------------------------------------------------- the policy concept

@dataclasses.dataclass(slots=True)
class _Worker:
    kind: str
    speed: float | None = None  # smoothed samples/s; None until the first measurement
    last_seen_s: float | None = None  # scheduler clock of the last report
    last_report_time_s: float = -math.inf  # worker clock of the last accepted report


class BatchPolicy:
    """A batch policy: ``initial(workers)``, ``update(reports, now_s)`` and ``forget(worker_id)``
    each return ``{worker_id: Assignment}`` for every live worker. The base keeps the worker
    table, the smoothed speeds, staleness and the throughput shares; a subclass says how the
    table turns into assignments (``_assign``)."""

    name: BatchPolicyKind

    def __init__(self, smoothing: float, stale_after_s: float | None) -> None:
        if not _finite(smoothing) or not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing is the weight kept on the old speed estimate, expected in [0, 1), got {smoothing!r}")
        if stale_after_s is not None and (not _finite(stale_after_s) or stale_after_s <= 0):
            raise ValueError(f"stale_after_s must be None or seconds > 0, got {stale_after_s!r}")
        self.smoothing = float(smoothing)
        self.stale_after_s = stale_after_s
        self._workers: dict[str, _Worker] = {}

    # -- the interface

    def initial(self, workers: Sequence[tuple[str, str]]) -> dict[str, Assignment]:
        """Replace the worker table with ``(worker_id, kind)`` pairs (nothing measured yet) and
        return their first assignments."""
        ids = [w for w, _ in workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        for worker_id, kind in workers:
            if not isinstance(worker_id, str) or not worker_id:
                raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
            _check_kind(kind)
        self._workers = {w: _Worker(kind=k) for w, k in workers}
        return self._assign()

    def update(self, reports: Sequence[WorkerReport], now_s: float) -> dict[str, Assignment]:
        """Fold in reports received at scheduler time ``now_s`` (seconds); a report from an
        unknown worker registers it."""
        if not _finite(now_s):
            raise ValueError(f"now_s must be a finite number of seconds, got {now_s!r}")
        for r in reports:  # validate all before changing anything
            if not isinstance(r, WorkerReport):
                raise ValueError(f"reports must be WorkerReport, got {type(r).__name__}")
            known = self._workers.get(r.worker_id)
            if known is not None and known.kind != r.kind:
                raise ValueError(f"{r.worker_id} registered as {known.kind!r} but reports kind {r.kind!r}")
        ids = [r.worker_id for r in reports]
        if len(set(ids)) != len(ids):
            raise ValueError(f"one report per worker per update, got ids {ids}")
        for r in reports:
            w = self._workers.get(r.worker_id)
            if w is None:  # late join or rejoin after being forgotten
                w = self._workers[r.worker_id] = _Worker(kind=r.kind)
            w.last_seen_s = now_s
            if r.time_s <= w.last_report_time_s:
                continue  # duplicate or out-of-order delivery: the newer report already counted
            w.last_report_time_s = r.time_s
            self._observe(w, r)
        for w in self._workers.values():
            if w.last_seen_s is None:
                w.last_seen_s = now_s  # staleness clock of never-heard workers starts now
        if self.stale_after_s is not None:
            for worker_id in [k for k, w in self._workers.items() if now_s - w.last_seen_s > self.stale_after_s]:
                del self._workers[worker_id]
        return self._assign()

    def forget(self, worker_id: str) -> dict[str, Assignment]:
        """Drop a worker that left; return the remaining workers' assignments."""
        if worker_id not in self._workers:
            raise KeyError(f"unknown worker {worker_id!r}; live workers are {sorted(self._workers)}")
        del self._workers[worker_id]
        return self._assign()

    # -- introspection

    @property
    def live(self) -> dict[str, str]:
        """Live workers: id -> kind."""
        return {k: w.kind for k, w in self._workers.items()}

    def estimates(self) -> dict[str, float | None]:
        """Smoothed throughput per live worker in samples/s (None: not measured yet)."""
        return {k: w.speed for k, w in self._workers.items()}

    # -- for subclasses

    def _observe(self, w: _Worker, r: WorkerReport) -> None:
        if w.speed is not None or r.samples_per_s > 0:  # a zero before any work is "not started", not "stalled"
            w.speed = ema(w.speed, r.samples_per_s, self.smoothing)

    def _speeds(self) -> dict[str, float]:
        """Speed per live worker; unmeasured workers are assumed as fast as the measured mean
        (so a newcomer gets a fair first share), and all equal when nobody is measured."""
        known = [w.speed for w in self._workers.values() if w.speed is not None]
        prior = sum(known) / len(known) if known else 1.0
        return {k: (w.speed if w.speed is not None else prior) for k, w in self._workers.items()}

    def _throughput_shares(self) -> dict[str, float]:
        """First-come-first-served: each worker takes data in proportion to its throughput."""
        speeds = self._speeds()
        top = max(speeds.values(), default=0.0)
        if top <= 0:
            return {k: 1.0 / len(speeds) for k in speeds}
        scaled = {k: s / top for k, s in speeds.items()}  # in [0, 1]: the sum cannot overflow
        total = sum(scaled.values())
        return {k: s / total for k, s in scaled.items()}

    def _assign(self) -> dict[str, Assignment]:
        raise NotImplementedError


# ----------------------------------------------------------------------------- policies

class StaticPolicy(BatchPolicy):
    """Every worker keeps its configured batch size (``batch_sizes[worker_id]``, else
    ``default_batch``) and an equal share of the data (its own slice); updates are asynchronous."""

    name = BatchPolicyKind.STATIC

    def __init__(self, batch_sizes: Mapping[str, int], default_batch: int, stale_after_s: float | None = None) -> None:
        super().__init__(0.5, stale_after_s)  # speeds are only tracked for estimates()
        self.batch_sizes = {k: _check_batch(f"batch_sizes[{k!r}]", b) for k, b in batch_sizes.items()}
        self.default_batch = _check_batch("default_batch", default_batch)

    def _assign(self) -> dict[str, Assignment]:
        n = len(self._workers)
        return {k: Assignment(k, self.batch_sizes.get(k, self.default_batch), 1.0 / n, False) for k in self._workers}


class SyncSGD(BatchPolicy):
    """Bulk-synchronous data-parallel SGD: every worker uses ``batch_size`` examples per step
    and takes an equal share of the data; the step waits for the slowest worker."""

    name = BatchPolicyKind.SYNC

    def __init__(self, batch_size: int, stale_after_s: float | None = None) -> None:
        super().__init__(0.5, stale_after_s)  # speeds are only tracked for estimates()
        self.batch_size = _check_batch("batch_size", batch_size)

    def _assign(self) -> dict[str, Assignment]:
        n = len(self._workers)
        return {k: Assignment(k, self.batch_size, 1.0 / n, True) for k in self._workers}


class StaticHogbatch(BatchPolicy):
    """CPU+GPU Hogbatch: CPU workers use ``cpu_batch`` (small, Hogwild style), GPU workers
    ``gpu_batch`` (large); updates are asynchronous and data is handed out first-come-first-
    served, so data shares follow the smoothed throughputs. The update rate of a worker is
    ``samples_per_s / batch_size``, so the CPU side makes most of the updates."""

    name = BatchPolicyKind.HOGBATCH

    def __init__(self, cpu_batch: int, gpu_batch: int, smoothing: float = 0.5, stale_after_s: float | None = None) -> None:
        super().__init__(smoothing, stale_after_s)
        self.batches = {"cpu": _check_batch("cpu_batch", cpu_batch), "gpu": _check_batch("gpu_batch", gpu_batch)}

    def _assign(self) -> dict[str, Assignment]:
        shares = self._throughput_shares()
        return {k: Assignment(k, self.batches[w.kind], shares[k], False) for k, w in self._workers.items()}


class AdaptiveHogbatch(BatchPolicy):
    """Adaptive Hogbatch: batch sizes proportional to the smoothed speeds, so update rates
    (``samples_per_s / batch_size``) become equal.

    The target update rate is set by the slowest worker running ``base_batch``:
    ``rate = min_speed / base_batch``. A CPU worker gets ``speed / rate`` examples per batch; a
    GPU worker gets ``threshold * speed / rate``, because a GPU's utilization grows with its
    batch size: ``threshold`` (>= 1) is the largest ratio of update rates accepted between a
    CPU and a GPU worker in exchange for bigger GPU batches (1: exact balance; with one CPU and
    one GPU the CPU's share of updates is at most ``threshold / (1 + threshold)``). Everything
    is then clipped to ``[min_batch, max_batch]``, which can leave the balance unreachable
    (a GPU held at ``max_batch`` below its balanced size makes more than its share of updates). Data shares follow
    throughput (first-come-first-served). See docs/hogbatch.md for why this rule.
    """

    name = BatchPolicyKind.ADAPTIVE

    def __init__(
        self,
        base_batch: int,
        min_batch: int = 1,
        max_batch: int = 4096,
        threshold: float = 1.0,
        smoothing: float = 0.5,
        stale_after_s: float | None = None,
        initial_gpu_batch: int | None = None,
    ) -> None:
        super().__init__(smoothing, stale_after_s)
        # A GPU worker's batch until its own speed is measured (None: threshold * base_batch).
        # Starting from the configured GPU batch spares short jobs the ramp up from a CPU-sized one.
        self.initial_gpu_batch = None if initial_gpu_batch is None else _check_batch("initial_gpu_batch",
                                                                                      initial_gpu_batch)
        self.min_batch = _check_batch("min_batch", min_batch)
        self.max_batch = _check_batch("max_batch", max_batch)
        self.base_batch = _check_batch("base_batch", base_batch)
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch ({min_batch}) must be <= max_batch ({max_batch})")
        if not self.min_batch <= self.base_batch <= self.max_batch:
            raise ValueError(f"base_batch ({base_batch}) must lie in [min_batch, max_batch] = [{min_batch}, {max_batch}]")
        if not _finite(threshold) or threshold < 1.0:
            raise ValueError(f"threshold is a ratio of update rates, expected a finite number >= 1, got {threshold!r}")
        self.threshold = float(threshold)

    def _assign(self) -> dict[str, Assignment]:
        speeds = self._speeds()
        shares = self._throughput_shares()
        positive = [s for s in speeds.values() if s > 0]
        out = {}
        for k, w in self._workers.items():
            stretch = self.threshold if w.kind == "gpu" else 1.0
            if w.kind == "gpu" and w.speed is None and self.initial_gpu_batch is not None:
                raw = float(self.initial_gpu_batch)  # not measured yet: the configured GPU batch
            elif not positive or speeds[k] <= 0:
                raw = stretch * self.base_batch  # nothing to scale by: keep the default
            else:
                # speed / rate with rate = min(positive) / base_batch, the updates/s every worker
                # should make; written as a ratio so tiny speeds cannot overflow it
                raw = stretch * self.base_batch * (speeds[k] / min(positive))
            batch = round(min(float(self.max_batch), max(float(self.min_batch), raw)))
            out[k] = Assignment(k, batch, shares[k], False)
        return out


POLICIES: dict[BatchPolicyKind, type[BatchPolicy]] = {cls.name: cls for cls in (StaticPolicy, SyncSGD, StaticHogbatch,
                                                                                  AdaptiveHogbatch)}


def make_policy(name: str, **knobs) -> BatchPolicy:
    """Build a policy by name (a :class:`~hmp.config.BatchPolicyKind`) with its knobs as keywords;
    unknown names, unknown knobs and missing required knobs raise ``ValueError`` listing what is
    accepted."""
    try:
        cls = POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown batch policy {name!r}; expected one of {[str(k) for k in POLICIES]}") from None
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    unknown = sorted(set(knobs) - set(params))
    if unknown:
        raise ValueError(f"policy {name!r} has no knob(s) {unknown}; accepted knobs are {sorted(params)}")
    missing = sorted(k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in knobs)
    if missing:
        raise ValueError(f"policy {name!r} needs knob(s) {missing}")
    return cls(**knobs)


# ----------------------------------------------------------------------------- helpers

def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_kind(kind: object) -> None:
    if kind not in WORKER_KINDS:
        raise ValueError(f"worker kind must be one of {WORKER_KINDS}, got {kind!r}")


def _check_batch(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value
