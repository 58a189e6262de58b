"""GADGET and the baselines, all behind ``interface.Scheduler``; ``make_scheduler(name)`` builds one.

Every scheduler is non-preemptive: it only starts pending jobs, on the free slots. ``gadget`` (our
reading of GADGET) solves each round with a knapsack greedy over worker counts and embeds rings on
the fewest hosts; ``fifo``, ``first_fit``, ``random`` and ``tiresias`` are the baselines, and
``optimal`` the exact round optimum for small instances. Their rules and GADGET's guarantee are in
docs/gadget.md, "Schedulers".
"""

from __future__ import annotations

import collections
import dataclasses
import random as _random
from collections.abc import Iterable, Mapping, Sequence

from .interface import ClusterView, PendingJob, Placement, RunningJob, Scheduler

SCHEDULERS = ("gadget", "fifo", "first_fit", "random", "tiresias", "optimal")

#: Tiresias-style queue thresholds on requested workers: queue k holds jobs with workers <= thresholds[k].
TIRESIAS_THRESHOLDS = (1, 4, 16)


class InstanceTooLarge(ValueError):
    """The exact scheduler was given more than it can enumerate."""


# --- placement helpers -------------------------------------------------------------------------------------


def fill_hosts(free: Sequence[int], workers: int, order: Iterable[int]) -> Placement | None:
    """Take ``workers`` slots from the hosts in ``order``, each host as full as it allows; None if short."""
    counts = [0] * len(free)
    left = workers
    for h in order:
        if left == 0:
            break
        take = min(left, free[h])
        counts[h] += take
        left -= take
    return tuple(counts) if left == 0 else None


def consolidated_placement(free: Sequence[int], workers: int, link_rings: Sequence[int] | None = None) -> Placement | None:
    """One host if one fits (the fullest such: best fit, so large holes stay for large rings), else the
    fewest hosts (most free first), ties to the least-loaded link, then the lower index."""
    if workers > sum(free):
        return None
    load = link_rings if link_rings is not None else [0] * len(free)
    fits = [h for h, f in enumerate(free) if f >= workers]
    if fits:
        h = min(fits, key=lambda i: (free[i], load[i], i))
        counts = [0] * len(free)
        counts[h] = workers
        return tuple(counts)
    # Fewest hosts: the fullest-free hosts, until the rest fits one host; the rest goes to the best fit
    # (the host with the fewest free slots that hold it), so that no larger hole is cut than needed.
    order = sorted((h for h in range(len(free)) if free[h]), key=lambda i: (-free[i], load[i], i))
    counts = [0] * len(free)
    left = workers
    for k, h in enumerate(order):
        rest = [i for i in order[k:] if free[i] >= left]
        if rest:
            target = min(rest, key=lambda i: (free[i], load[i], i))
            counts[target] += left
            return tuple(counts)
        counts[h] = free[h]
        left -= free[h]
    raise AssertionError("unreachable: workers <= sum(free)")


def spread_placement(free: Sequence[int], workers: int, link_rings: Sequence[int]) -> Placement | None:
    """Hosts whose links carry the fewest rings first (most free among equals): less contention, maybe
    more hosts spanned."""
    if workers > sum(free):
        return None
    return fill_hosts(free, workers, sorted((h for h in range(len(free)) if free[h]),
                                            key=lambda i: (link_rings[i], -free[i], i)))


def spans(placement: Placement) -> bool:
    """Whether a ring on ``placement`` crosses host links (two hosts or more)."""
    first = False
    for c in placement:
        if c:
            if first:
                return True
            first = True
    return False


def clamp_workers(job: PendingJob) -> int:
    return max(job.min_workers, min(job.max_workers, job.requested_workers))


# --- the round objective -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _RoundState:
    """What a round's decisions change: free slots, link load and the running rings' predictions."""

    view: ClusterView
    free: list[int]
    link_rings: list[int]
    # running (and, as the round goes, newly started) multi-host rings by host: job id -> (model, placement)
    rings_on_host: list[dict[str, tuple[str, Placement]]]
    # hosts that share compute pools (cost.pool_of, -1: none), and every ring (not only multi-host) by pool;
    # empty when the cost model has no pools: then a ring's speed depends only on the rings on its links
    pool_of: tuple[int, ...] = ()
    rings_in_pool: list[dict[str, tuple[str, Placement]]] = dataclasses.field(default_factory=list)
    demand: list[float] = dataclasses.field(default_factory=list)   # CPU demand per host (cost.cpu_demand)

    @classmethod
    def start(cls, view: ClusterView) -> _RoundState:
        hosts = len(view.cluster.hosts)
        link_rings = [0] * hosts
        rings_on_host: list[dict[str, tuple[str, Placement]]] = [{} for _ in range(hosts)]
        # the simulator's lazy view lists the link-crossing rings without building every RunningJob
        fast = getattr(view.running, "spanning_rings", None)
        spanning = fast() if fast is not None else {
            job_id: (r.model, r.placement) for job_id, r in view.running.items() if spans(r.placement)}
        for job_id, (model, placement) in spanning.items():
            for h, c in enumerate(placement):
                if c:
                    link_rings[h] += 1
                    rings_on_host[h][job_id] = (model, placement)
        state = cls(view, list(view.free), link_rings, rings_on_host)
        if getattr(view.cost, "shares_compute", False):
            state.pool_of = tuple(view.cost.pool_of)  # type: ignore[attr-defined]
            state.rings_in_pool = [{} for _ in range(max(state.pool_of) + 1)]
            state.demand = [0.0] * hosts
            for job_id, r in view.running.items():
                state._add_to_pools(job_id, r.model, r.placement)
        return state

    def _add_to_pools(self, job_id: str, model: str, placement: Placement) -> None:
        u = self.view.cost.cpu_share(model, placement)  # type: ignore[attr-defined]
        for h, c in enumerate(placement):
            if c:
                self.demand[h] += u * c
                if self.pool_of[h] >= 0:
                    self.rings_in_pool[self.pool_of[h]][job_id] = (model, placement)

    def busy(self, own: tuple[str, Placement] | None = None) -> list[float] | None:
        """CPU demand per host of the rings running or committed, less ``own``'s (a committed ring's: model,
        placement); None when the cost model has no compute pools (it does not use them)."""
        if not self.pool_of:
            return None
        if own is None:
            return self.demand
        u = self.view.cost.cpu_share(*own)  # type: ignore[attr-defined]
        return [d - u * c for d, c in zip(self.demand, own[1])]

    def neighbours(self, placement: Placement) -> dict[str, tuple[str, Placement]]:
        """The running or committed rings whose speed a ring on ``placement`` changes: those on the links it
        crosses, and (compute pools) those in the pools it uses."""
        out: dict[str, tuple[str, Placement]] = {}
        multi = spans(placement)
        for h, c in enumerate(placement):
            if c:
                if multi:
                    out.update(self.rings_on_host[h])
                if self.pool_of and self.pool_of[h] >= 0:
                    out.update(self.rings_in_pool[self.pool_of[h]])
        return out

    def iteration_s(self, model: str, placement: Placement, extra: Placement | None = None,
                    extra_model: str | None = None) -> float:
        """Iteration time of a ring already counted in ``link_rings`` (running or committed this round);
        ``extra``: a ring (of ``extra_model``) about to start, counted too."""
        return self.view.cost.iteration_s_loaded(model, placement, self.link_rings, counted=spans(placement),  # type: ignore[attr-defined]
                                                 extra=extra, extra_model=extra_model,
                                                 busy=self.busy((model, placement)))

    def new_iteration_s(self, model: str, placement: Placement) -> float:
        """Iteration time of a ring not yet committed, beside the running and committed rings."""
        return self.view.cost.iteration_s_loaded(model, placement, self.link_rings, busy=self.busy())  # type: ignore[attr-defined]

    def commit(self, job_id: str, model: str, placement: Placement) -> None:
        for h, c in enumerate(placement):
            self.free[h] -= c
            if self.free[h] < 0:
                raise AssertionError(f"round state: host {h} over-committed by {job_id}")
        if spans(placement):
            for h, c in enumerate(placement):
                if c:
                    self.link_rings[h] += 1
                    self.rings_on_host[h][job_id] = (model, placement)
        if self.pool_of:
            self._add_to_pools(job_id, model, placement)


def _start_value(view: ClusterView, job: PendingJob, placement: Placement, iteration_s: float) -> float:
    samples_per_iter = view.cost.samples_per_iteration(job.model, sum(placement))
    finish_rel = view.now_s - job.submit_s + job.samples * iteration_s / samples_per_iter
    return job.utility(max(0.0, finish_rel))


def _run_s(view: ClusterView, job: PendingJob, placement: Placement, iteration_s: float) -> float:
    return job.samples * iteration_s / view.cost.samples_per_iteration(job.model, sum(placement))


def _running_value(view: ClusterView, r: RunningJob, iteration_s: float) -> float | None:
    if r.submit_s is None:
        return None
    samples_per_iter = view.cost.samples_per_iteration(r.model, sum(r.placement))
    finish_rel = view.now_s - r.submit_s + r.samples_left * iteration_s / samples_per_iter
    return r.utility(max(0.0, finish_rel))


def _contention_loss(state: _RoundState, placement: Placement, new_model: str | None = None) -> float:
    """Utility the rings already on ``placement``'s links (running or started this round) lose when a ring
    (of ``new_model``) on ``placement`` starts (each link's share falls from bw/n to bw/(n+1)), and, when
    hosts share compute pools, the rings in the pools it uses (their compute stretches)."""
    if not spans(placement) and not state.pool_of:
        return 0.0
    view = state.view
    affected = state.neighbours(placement)
    loss = 0.0
    for job_id, (model, p) in affected.items():
        job = view.running.get(job_id)
        if job is None:
            continue  # started this round: its value is counted where it was chosen (round_value re-prices)
        before = _running_value(view, job, state.iteration_s(model, p))
        if before is None:
            continue
        after = _running_value(view, job, state.iteration_s(model, p, extra=placement, extra_model=new_model))
        assert after is not None
        loss += before - after
    return loss


def round_value(view: ClusterView, decisions: Mapping[str, Placement], slot_price: float = 0.0) -> float:
    """The round objective: predicted utility of the jobs started by ``decisions``, each less
    ``slot_price`` times the slot-seconds it will hold, plus the change in the running jobs' predicted
    utility; every ring is timed with all of them (running and new) sharing links. Predictions assume
    each ring keeps this iteration time to its end. Running jobs with no ``submit_s`` count zero change."""
    state = _RoundState.start(view)
    pending = {j.job_id: j for j in view.pending}
    # only running rings that share a link (or a compute pool) with a new ring change speed
    affected: dict[str, tuple[str, Placement]] = {}
    for p in decisions.values():
        affected.update(state.neighbours(p))
    before = {job_id: _running_value(view, view.running[job_id], state.iteration_s(model, placement))
              for job_id, (model, placement) in affected.items()}
    for job_id, p in decisions.items():
        state.commit(job_id, pending[job_id].model, p)
    total = 0.0
    for job_id, p in decisions.items():
        job = pending[job_id]
        it = state.iteration_s(job.model, p)
        total += _start_value(view, job, p, it) - slot_price * sum(p) * _run_s(view, job, p, it)
    for job_id, (model, placement) in affected.items():
        b = before[job_id]
        if b is None:
            continue
        after = _running_value(view, view.running[job_id], state.iteration_s(model, placement))
        assert after is not None
        total += after - b
    return total


# --- baselines ---------------------------------------------------------------------------------------------


class _OrderedBaseline:
    """Start pending jobs at their requested size, in an order, on hosts a placement rule picks."""

    name = "ordered"
    backfill = True

    def order(self, view: ClusterView) -> list[PendingJob]:
        return list(view.pending)

    def place(self, free: Sequence[int], workers: int, view: ClusterView) -> Placement | None:
        return fill_hosts(free, workers, range(len(free)))

    def schedule(self, view: ClusterView) -> dict[str, Placement]:
        free = list(view.free)
        decisions: dict[str, Placement] = {}
        for job in self.order(view):
            if sum(free) == 0:
                break
            p = self.place(free, clamp_workers(job), view)
            if p is None:
                if self.backfill:
                    continue
                break
            decisions[job.job_id] = p
            for h, c in enumerate(p):
                free[h] -= c
        return decisions


class FifoScheduler(_OrderedBaseline):
    name = "fifo"
    backfill = False


class FirstFitScheduler(_OrderedBaseline):
    name = "first_fit"


class RandomScheduler(_OrderedBaseline):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = _random.Random(seed)

    def order(self, view: ClusterView) -> list[PendingJob]:
        jobs = list(view.pending)
        self.rng.shuffle(jobs)
        return jobs

    def place(self, free: Sequence[int], workers: int, view: ClusterView) -> Placement | None:
        hosts = [h for h in range(len(free)) if free[h]]
        self.rng.shuffle(hosts)
        return fill_hosts(free, workers, hosts)


class TiresiasScheduler(_OrderedBaseline):
    name = "tiresias"

    def __init__(self, thresholds: Sequence[int] = TIRESIAS_THRESHOLDS) -> None:
        self.thresholds = tuple(thresholds)

    def queue(self, job: PendingJob) -> int:
        w = clamp_workers(job)
        for k, limit in enumerate(self.thresholds):
            if w <= limit:
                return k
        return len(self.thresholds)

    def order(self, view: ClusterView) -> list[PendingJob]:
        # sorted() is stable: submit order within a queue (view.pending is in submit order)
        return sorted(view.pending, key=self.queue)

    def place(self, free: Sequence[int], workers: int, view: ClusterView) -> Placement | None:
        return consolidated_placement(free, workers)


# --- GADGET ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Option:
    job: PendingJob
    workers: int
    placement: Placement
    value: float   # predicted utility if started so, minus the contention loss it causes


def _hull(options: Sequence[_Option]) -> list[_Option]:
    """The upper concave hull of (workers, value) from (0, 0), increasing in both: the options an LP
    relaxation of the multiple-choice knapsack would ever use (LP-dominated ones dropped)."""
    pts = sorted(options, key=lambda o: (o.workers, -o.value))
    hull: list[_Option] = []
    for o in pts:
        if o.value <= (hull[-1].value if hull else 0.0):
            continue  # dominated: no more value for more slots
        while hull:
            w0, v0 = (hull[-2].workers, hull[-2].value) if len(hull) >= 2 else (0, 0.0)
            w1, v1 = hull[-1].workers, hull[-1].value
            # drop hull[-1] if it lies on or below the segment (w0,v0) -> o
            if (v1 - v0) * (o.workers - w0) <= (o.value - v0) * (w1 - w0):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


class GadgetScheduler:
    """GADGET: greedy utility-per-slot worker counts (multiple-choice knapsack) + ring embedding.

    Each option (job, workers, embedding) is valued at its predicted utility, less the utility its ring
    takes from running rings by sharing links (``price_contention``), less ``slot_price`` per slot-second
    it will hold. The slot price is the opportunity cost of the slots when jobs compete for them: 0 when
    the valuable pending jobs all fit the free slots at their requested size, else ``price_scale`` times
    the utility per slot-second of the job at the capacity boundary (valuable jobs ranked by utility per
    slot-second at their requested size, the first whose cumulative requested slots pass the free slots).

    ``window``: at most this many pending jobs are considered per round (the highest utility per
    slot-second), to bound the work per event.
    ``hopeless_fraction``: a job whose utility can no longer exceed this fraction of its utility at
    completion 0 is *hopeless*; it is started (requested size, shortest first) only on slots left over
    after the valuable jobs (``fill_hopeless``, work conservation).
    ``defer_s``: the first pass values a job by the gain of starting now over starting ``defer_s`` later
    (None: the mean queueing delay of the last 64 jobs it started; 0: no such pass).
    ``max_options``: worker counts tried per job: all of min..max if there are at most this many, else
    powers of two plus min, max and the requested count.
    """

    name = "gadget"

    def __init__(self, window: int = 16, hopeless_fraction: float = 0.01, max_options: int = 16,
                 price_contention: bool = True, fill_hopeless: bool = True, price_scale: float = 1.0,
                 defer_s: float | None = None) -> None:
        if window < 1 or max_options < 1 or price_scale < 0:
            raise ValueError("window and max_options must be >= 1, price_scale >= 0")
        self.window = window
        self.hopeless_fraction = hopeless_fraction
        self.max_options = max_options
        self.price_contention = price_contention
        self.fill_hopeless = fill_hopeless
        self.price_scale = price_scale
        self.defer_s = defer_s                  # None: the mean queueing delay of the last jobs started
        self._recent_waits: collections.deque[float] = collections.deque(maxlen=64)
        self.last_defer_s = 0.0
        self._best_s: dict[str, float] = {}    # job id -> fastest run time alone over its options (cache)
        self._req_s: dict[str, float] = {}     # job id -> run time alone at its requested size (cache)
        self._hopeless: set[str] = set()        # once hopeless, always (utility non-increasing, time grows)
        self.last_slot_price = 0.0              # the last round's slot price (for tests and the bench)

    def worker_options(self, job: PendingJob, limit: int) -> list[int]:
        hi = min(job.max_workers, limit)
        lo = job.min_workers
        if hi < lo:
            return []
        if hi - lo + 1 <= self.max_options:
            return list(range(lo, hi + 1))
        opts = {lo, hi}
        if lo <= job.requested_workers <= hi:
            opts.add(job.requested_workers)
        k = 1
        while k <= hi:  # bounded: doubles up to hi
            if k >= lo:
                opts.add(k)
            k *= 2
        return sorted(opts)

    def _alone_s(self, view: ClusterView, job: PendingJob, workers: int) -> float:
        cost = view.cost
        it = cost.iteration_s(job.model, cost.compact_placement(workers))  # type: ignore[attr-defined]
        return job.samples * it / cost.samples_per_iteration(job.model, workers)

    def _best_run_s(self, view: ClusterView, job: PendingJob) -> float:
        cached = self._best_s.get(job.job_id)
        if cached is None:
            cached = min(self._alone_s(view, job, w) for w in self.worker_options(job, view.cluster.total_slots))
            self._best_s[job.job_id] = cached
        return cached

    def _requested_run_s(self, view: ClusterView, job: PendingJob) -> float:
        cached = self._req_s.get(job.job_id)
        if cached is None:
            cached = self._alone_s(view, job, clamp_workers(job))
            self._req_s[job.job_id] = cached
        return cached

    def _options(self, state: _RoundState, job: PendingJob, slot_price: float, defer_s: float) -> list[_Option]:
        view = state.view
        out: list[_Option] = []
        # the alternative to starting now: starting defer_s later at the requested size (no contention)
        later = job.utility(max(0.0, view.now_s - job.submit_s + defer_s + self._requested_run_s(view, job))) if defer_s else 0.0
        seen: set[Placement] = set()
        for w in self.worker_options(job, sum(state.free)):
            tried = []
            a = consolidated_placement(state.free, w, state.link_rings)
            if a is not None:
                tried.append(a)
                if spans(a):
                    b = spread_placement(state.free, w, state.link_rings)
                    if b is not None and b != a:
                        tried.append(b)
            best: _Option | None = None
            for p in tried:
                if p in seen:
                    continue
                seen.add(p)
                it = state.new_iteration_s(job.model, p)
                v = _start_value(view, job, p, it) - later - slot_price * w * _run_s(view, job, p, it)
                if self.price_contention:
                    v -= _contention_loss(state, p, job.model)
                if best is None or v > best.value:
                    best = _Option(job, w, p, v)
            if best is not None and best.value > 0:
                out.append(best)
        return out

    def _select(self, state: _RoundState, jobs: Sequence[PendingJob], slot_price: float,
                defer_s: float = 0.0) -> list[_Option]:
        """Multiple-choice knapsack greedy on the options priced at ``state``; see docs/gadget.md."""
        capacity = sum(state.free)
        hulls: dict[str, list[_Option]] = {}
        best_single: _Option | None = None
        for job in jobs:
            opts = self._options(state, job, slot_price, defer_s)
            if not opts:
                continue
            hulls[job.job_id] = _hull(opts)
            top = max(opts, key=lambda o: o.value)
            if best_single is None or top.value > best_single.value:
                best_single = top
        if best_single is None:
            return []
        upgrades: list[tuple[float, int, str, int]] = []  # (-efficiency, workers, job id, hull index)
        for job_id, hull in hulls.items():
            w0, v0 = 0, 0.0
            for i, o in enumerate(hull):
                upgrades.append((-(o.value - v0) / (o.workers - w0), o.workers, job_id, i))
                w0, v0 = o.workers, o.value
        upgrades.sort()
        chosen: dict[str, int] = {}     # job id -> hull index
        blocked: set[str] = set()
        used = 0
        for _, _, job_id, i in upgrades:
            if job_id in blocked:
                continue
            hull = hulls[job_id]
            if chosen.get(job_id, -1) != i - 1:
                blocked.add(job_id)  # an earlier upgrade of this job was skipped: later ones need it
                continue
            current = hull[i - 1].workers if i else 0
            if used - current + hull[i].workers <= capacity:
                used += hull[i].workers - current
                chosen[job_id] = i
            else:
                blocked.add(job_id)
        selection = [hulls[j][i] for j, i in chosen.items()]
        if best_single.value > sum(o.value for o in selection):
            return [best_single]
        return selection

    def schedule(self, view: ClusterView) -> dict[str, Placement]:
        if sum(view.free) == 0 or not view.pending:
            return {}
        # 1. drop hopeless jobs (for this and every later round); rank the others by utility per slot-second
        ranked: list[tuple[float, int, PendingJob]] = []
        hopeless: list[PendingJob] = []
        for idx, job in enumerate(view.pending):
            if job.job_id in self._hopeless:
                hopeless.append(job)
                continue
            bound = job.utility(max(0.0, view.now_s - job.submit_s + self._best_run_s(view, job)))
            if bound <= self.hopeless_fraction * job.utility(0.0):
                self._hopeless.add(job.job_id)
                hopeless.append(job)
                continue
            run_s = self._requested_run_s(view, job)
            at_requested = job.utility(max(0.0, view.now_s - job.submit_s + run_s))
            ranked.append((at_requested / (clamp_workers(job) * run_s), idx, job))
        ranked.sort(key=lambda t: (-t[0], t[1]))
        # 2. the slot price: the density at the capacity boundary, if the valuable jobs overflow the free slots
        slot_price = 0.0
        cumulative, total_free = 0, sum(view.free)
        for density, _, job in ranked:
            cumulative += clamp_workers(job)
            if cumulative > total_free:
                slot_price = self.price_scale * density
                break
        self.last_slot_price = slot_price
        window = [job for _, _, job in ranked[: self.window]]
        # 3. rounds: select on the current state, embed the selection (largest rings first), repeat on what is
        # left (a job that no longer fits at its hull size may fit at a smaller one). Bounded by the window.
        # First valued by the marginal gain of starting now rather than defer_s later (urgent jobs first),
        # then, on slots still free, by the utility of starting now (a job never loses by starting early).
        defer_s = self.defer_s if self.defer_s is not None else (
            sum(self._recent_waits) / len(self._recent_waits) if self._recent_waits else 0.0)
        self.last_defer_s = defer_s
        state = _RoundState.start(view)
        decisions: dict[str, Placement] = {}
        remaining = list(window)
        for phase_defer in ((defer_s, 0.0) if defer_s > 0 else (0.0,)):
            for _ in range(len(window)):
                if not remaining or sum(state.free) == 0:
                    break
                selection = self._select(state, remaining, slot_price, phase_defer)
                if not selection:
                    break
                for opt in sorted(selection, key=lambda o: -o.workers):
                    p = self.embed(state, opt.job.model, opt.workers)
                    assert p is not None  # the selection's slots sum to at most the free slots
                    decisions[opt.job.job_id] = p
                    state.commit(opt.job.job_id, opt.job.model, p)
                    self._recent_waits.append(view.now_s - opt.job.submit_s)
                remaining = [j for j in remaining if j.job_id not in decisions]
        # 4. the options were priced one at a time; rings started together may share links (or compute pools)
        # and slow each other (and running rings) more than priced. Re-price the whole round and drop what lowers it.
        if self.price_contention and len(decisions) and (state.pool_of or any(spans(p) for p in decisions.values())):
            decisions = self._prune(view, decisions, slot_price)
            state = _RoundState.start(view)
            for job_id, p in decisions.items():
                state.commit(job_id, next(j.model for j in window if j.job_id == job_id), p)
        # 5. work conservation: hopeless jobs on what is left
        if self.fill_hopeless:
            # shortest first (slot-seconds at the requested size): they hold slots a valuable job may want
            hopeless.sort(key=lambda j: clamp_workers(j) * self._requested_run_s(view, j))
            for job in hopeless:
                w = clamp_workers(job)
                if w > sum(state.free):
                    continue
                p = consolidated_placement(state.free, w, state.link_rings)
                assert p is not None
                decisions[job.job_id] = p
                state.commit(job.job_id, job.model, p)
        return decisions

    @staticmethod
    def _prune(view: ClusterView, decisions: dict[str, Placement], slot_price: float) -> dict[str, Placement]:
        """Drop decisions, one at a time, while that raises the round objective; then keep the best single
        decision instead if it is worth more. At most len(decisions) passes."""
        current = dict(decisions)
        value = round_value(view, current, slot_price)
        for _ in range(len(decisions)):
            best_drop, best_value = None, value
            for job_id in current:
                v = round_value(view, {k: p for k, p in current.items() if k != job_id}, slot_price)
                if v > best_value + 1e-12:
                    best_drop, best_value = job_id, v
            if best_drop is None:
                break
            del current[best_drop]
            value = best_value
        for job_id, p in decisions.items():
            v = round_value(view, {job_id: p}, slot_price)
            if v > value + 1e-12:
                current, value = {job_id: p}, v
        return current

    @staticmethod
    def embed(state: _RoundState, model: str, workers: int) -> Placement | None:
        """The ring embedding: one host if one fits (best fit); else the fewer-hosts or the less-loaded-links
        spread, whichever the cost model times faster (ties: fewer hosts)."""
        p = consolidated_placement(state.free, workers, state.link_rings)
        if p is None or not spans(p):
            return p
        b = spread_placement(state.free, workers, state.link_rings)
        if b is not None and state.new_iteration_s(model, b) < state.new_iteration_s(model, p):
            return b
        return p


# --- exact optimum -----------------------------------------------------------------------------------------


def _placements_fitting(free: Sequence[int], workers: int, slots: Sequence[int]) -> list[Placement]:
    """Every placement of ``workers`` on ``free``, one per class of hosts alike (same free slots and same
    capacity count the same only if also same link: we do not merge hosts, the cluster may differ)."""
    out: list[Placement] = []
    counts = [0] * len(free)

    def rec(h: int, left: int) -> None:
        if h == len(free):
            if left == 0:
                out.append(tuple(counts))
            return
        if left > sum(free[h:]):
            return
        for c in range(min(left, free[h]), -1, -1):
            counts[h] = c
            rec(h + 1, left - c)
        counts[h] = 0

    rec(0, workers)
    return out


class OptimalScheduler:
    """The exact maximiser of :func:`round_value` by exhaustive search (small instances only)."""

    name = "optimal"

    def __init__(self, max_jobs: int = 8, max_leaves: int = 200_000, slot_price: float = 0.0) -> None:
        self.max_jobs = max_jobs
        self.max_leaves = max_leaves
        self.slot_price = slot_price   # the round objective's price per slot-second (GADGET's last_slot_price)
        self.last_value = 0.0

    def schedule(self, view: ClusterView) -> dict[str, Placement]:
        if sum(view.free) == 0 or not view.pending:
            self.last_value = 0.0
            return {}
        jobs = list(view.pending)
        if len(jobs) > self.max_jobs:
            raise InstanceTooLarge(f"optimal scheduler: {len(jobs)} pending jobs, at most {self.max_jobs} "
                                   f"(exhaustive search; use it on small instances only)")
        slots = [h.slots for h in view.cluster.hosts]
        best: tuple[float, dict[str, Placement]] = (round_value(view, {}, self.slot_price), {})
        leaves = 0
        decisions: dict[str, Placement] = {}
        free = list(view.free)
        placement_cache: dict[tuple[tuple[int, ...], int], list[Placement]] = {}

        def rec(i: int) -> None:
            nonlocal best, leaves
            if i == len(jobs):
                leaves += 1
                if leaves > self.max_leaves:
                    raise InstanceTooLarge(f"optimal scheduler: more than {self.max_leaves} candidate decisions "
                                           f"({len(jobs)} jobs on {len(free)} hosts); use it on small instances only")
                if decisions:
                    v = round_value(view, decisions, self.slot_price)
                    if v > best[0] + 1e-12:
                        best = (v, dict(decisions))
                return
            rec(i + 1)  # job i does not start now
            job = jobs[i]
            for w in range(job.min_workers, min(job.max_workers, sum(free)) + 1):
                key = (tuple(free), w)
                if key not in placement_cache:
                    placement_cache[key] = _placements_fitting(free, w, slots)
                for p in placement_cache[key]:
                    decisions[job.job_id] = p
                    for h, c in enumerate(p):
                        free[h] -= c
                    rec(i + 1)
                    for h, c in enumerate(p):
                        free[h] += c
                    del decisions[job.job_id]

        rec(0)
        self.last_value = best[0]
        return best[1]


def make_scheduler(name: str, seed: int = 0, **kw) -> Scheduler:
    """A scheduler by name (``SCHEDULERS``); ``kw`` go to its constructor; ``seed`` is used by ``random``."""
    if name == "gadget":
        return GadgetScheduler(**kw)
    if name == "fifo":
        return FifoScheduler(**kw)
    if name == "first_fit":
        return FirstFitScheduler(**kw)
    if name == "random":
        return RandomScheduler(seed=seed, **kw)
    if name == "tiresias":
        return TiresiasScheduler(**kw)
    if name == "optimal":
        return OptimalScheduler(**kw)
    raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
