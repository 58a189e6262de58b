"""The contract between GADGET's pure parts and whatever runs jobs (the simulator, the real job manager).

A *placement* is how many workers a job has on each host: a tuple indexed like ``ClusterSpec.hosts``.
A *scheduler* is called on every arrival and completion with a :class:`ClusterView` and answers which
pending jobs start now, and where. Schedulers never move or resize a running job (no preemption): the
real cluster cannot migrate a running ring cheaply, and the simulator models the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol

#: workers per host, indexed like ClusterSpec.hosts; sum = the job's worker count
Placement = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class HostSpec:
    """One host: its worker slots and its link to the switch (bytes/s, each direction).

    Added (default keeps old call sites valid): ``pool``, the compute pool (a physical machine's cores,
    named in ``ClusterSpec.pool_cores``) this host's workers share with the other hosts of that pool;
    None: each slot has its own compute (a GPU), no sharing.
    """

    name: str
    slots: int
    link_bytes_s: float
    pool: str | None = None


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Hosts on one switch (a star): a ring that spans hosts crosses each spanned host's link.

    Added (default: none): ``pool_cores``, (pool name, cores) for each compute pool the hosts name; the
    workers of a pool's hosts share its cores (e.g. emulated hosts on one machine, docs/gadget.md).
    """

    hosts: tuple[HostSpec, ...]
    pool_cores: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        pools = dict(self.pool_cores)
        if len(pools) != len(self.pool_cores) or any(not c > 0 for c in pools.values()):
            raise ValueError(f"pool_cores: each pool once, cores > 0, got {self.pool_cores}")
        for h in self.hosts:
            if h.pool is not None and h.pool not in pools:
                raise ValueError(f"host {h.name!r} names pool {h.pool!r}, not in pool_cores {sorted(pools)}")

    @property
    def total_slots(self) -> int:
        return sum(h.slots for h in self.hosts)


class Utility(Protocol):
    def __call__(self, completion_s: float) -> float:
        """Value of the job finishing ``completion_s`` seconds after its submission (>= 0)."""
        ...


class CostModel(Protocol):
    def iteration_s(self, model: str, placement: Placement, others: Sequence[tuple[str, Placement]] = ()) -> float:
        """Seconds per iteration of a ring of ``model`` placed so, while the rings ``others``
        (model, placement) run too and share the host links they cross."""
        ...

    def samples_per_iteration(self, model: str, workers: int) -> float:
        ...


class LoadedCostModel(CostModel, Protocol):
    """Added: the fast paths GADGET and the simulator use (``hmp.gadget.model.RingCostModel`` has them)."""

    def iteration_s_loaded(self, model: str, placement: Placement, link_rings: Sequence[int], *,
                           counted: bool = False, extra: Placement | None = None,
                           busy: Sequence[float] | None = None, extra_model: str | None = None) -> float:
        """Like ``iteration_s`` with the rings given as a count per host link: the *other* rings, or all of
        them with ``counted=True``; ``extra``: one more ring about to start. Added, for clusters whose hosts
        share compute pools: ``busy``, the *other* rings' CPU demand on each host (``RingCostModel.cpu_demand``;
        None: none counted) and ``extra_model``, the model of ``extra`` (its workers' CPU share)."""
        ...

    def compact_placement(self, workers: int) -> Placement:
        """The placement ``workers`` get alone on the empty cluster (fewest hosts)."""
        ...


@dataclasses.dataclass(frozen=True)
class PendingJob:
    """What a scheduler may know about a job that waits for workers."""

    job_id: str
    submit_s: float
    model: str               # a model type the cost model knows (gradient bytes, compute time)
    min_workers: int
    max_workers: int
    requested_workers: int   # what the user asked for (the trace's num_gpus)
    samples: float           # work left, in training samples (each iteration does workers x local batch)
    utility: Utility         # value of finishing at a given completion time


@dataclasses.dataclass(frozen=True)
class RunningJob:
    job_id: str
    model: str
    placement: Placement
    start_s: float
    samples_left: float
    utility: Utility
    attained_s: float        # worker-seconds received so far (Tiresias' attained service)
    # Added (default keeps old call sites valid): when the job was submitted. GADGET needs it to price the
    # utility a running ring loses when a new ring shares its links; None = unknown, that loss is not priced.
    submit_s: float | None = None


@dataclasses.dataclass(frozen=True)
class ClusterView:
    now_s: float
    cluster: ClusterSpec
    free: tuple[int, ...]                 # free slots per host
    pending: Sequence[PendingJob]         # in submit order
    running: Mapping[str, RunningJob]
    cost: CostModel


class Scheduler(Protocol):
    name: str

    def schedule(self, view: ClusterView) -> dict[str, Placement]:
        """Pending job id -> placement for the jobs that start now; every placement must fit ``view.free``
        and give the job between min_workers and max_workers workers."""
        ...
