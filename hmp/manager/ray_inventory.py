"""The job manager's slots from a Ray cluster: ``hmp-manager --engine ray`` (docs/jobs.md, "Slots from Ray").

    async with hmp.JobManager(hosts=RayInventory(address="auto"), scheduler="gadget") as m:
        handle = await m.submit("conf/jobs/digits_small.toml")

:meth:`RayInventory.read` turns the alive nodes of ``ray.nodes()`` into the manager's hosts
(:class:`RayHost`), one per node:

* **name**: ``<name>`` when the node declares the custom resource ``hmp_host:<name>`` (the Ray engine's
  host resource, docs/ray.md), else the node's IP. A job's topology names this host, and the Ray engine
  pins each daemon there (``hmp_host:<name>``, or Ray's ``node:<IP>``).
* **slots**: the node's ``hmp_slots`` resource when it declares one (``ray start --resources
  '{"hmp_slots": 4}'``), else its whole CPUs (one CPU per ring worker: the manager's workers are
  ``cpu_worker`` with one thread). GPUs are listed but add no slots (the manager's jobs are CPU rings).
  A job's scheduler daemon asks Ray for no CPU (it only relays heartbeats and reports), so a node's slots
  are all its workers'.
* **link**: ``hmp_link_mbit`` when declared, else :data:`DEFAULT_LINK_MBIT` (the cost model's link rate).

Importing this module does not import Ray; :meth:`RayInventory.read` does (``pip install "hmp[ray]"``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: A node's custom resource that sets its worker slots (else: its whole CPUs).
SLOTS_RESOURCE = "hmp_slots"
#: A node's custom resource giving its link rate in Mbit/s, for the cost model (else DEFAULT_LINK_MBIT).
LINK_RESOURCE = "hmp_link_mbit"
#: The link rate the cost model assumes for a Ray node that does not declare one: 10 Gbit/s.
DEFAULT_LINK_MBIT = 10_000.0
#: Prefix of the Ray engine's host resource (hmp.ray_engine.HOST_RESOURCE without the name).
HOST_PREFIX = "hmp_host:"


@dataclasses.dataclass(frozen=True)
class RayHost:
    """One alive Ray node as the job manager's host (module docstring)."""

    name: str
    ip: str
    ray_node: str
    slots: int
    cpus: float
    gpus: float
    bandwidth_mbit: float


def host_of_node(node: dict[str, Any], link_mbit: float = DEFAULT_LINK_MBIT) -> RayHost:
    """The :class:`RayHost` of one entry of ``ray.nodes()`` (its ``Resources``, ``NodeManagerAddress``)."""
    res = node.get("Resources", {})
    ip = str(node["NodeManagerAddress"])
    names = sorted(k[len(HOST_PREFIX):] for k in res if k.startswith(HOST_PREFIX))
    cpus, gpus = float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))
    slots = math.floor(res[SLOTS_RESOURCE]) if SLOTS_RESOURCE in res else math.floor(cpus)
    return RayHost(name=names[0] if names else ip, ip=ip, ray_node=str(node["NodeID"]), slots=int(slots),
                   cpus=cpus, gpus=gpus, bandwidth_mbit=float(res.get(LINK_RESOURCE, link_mbit)))


class RayInventory:
    """The slots of a Ray cluster (module docstring). ``address``: the cluster to join (``"auto"``,
    ``"10.0.0.1:6379"``); None: the Ray instance this process runs, else a local one sized to this machine.
    :meth:`close` shuts down a connection or instance this inventory made."""

    def __init__(self, address: str | None = None, *, link_mbit: float = DEFAULT_LINK_MBIT,
                 ray_init: dict[str, Any] | None = None) -> None:
        self.address = address
        self.link_mbit = link_mbit
        self.ray_init = dict(ray_init or {})
        self._own = False

    @property
    def source(self) -> str:
        return f"the Ray cluster at {self.address}" if self.address else "this process's Ray instance"

    def connect(self) -> None:
        """Join the cluster (or start a local instance) unless this process is connected already."""
        import ray

        from hmp.ray_engine import init_ray

        if not ray.is_initialized():
            init_ray(address=self.address, **self.ray_init)
            self._own = True

    def read(self) -> list[RayHost]:
        """The alive nodes as hosts, in ``ray.nodes()`` order; ValueError when two would have the same name
        (two nodes on one IP without ``hmp_host:<name>`` resources: the engine could not tell them apart)."""
        import ray

        self.connect()
        hosts = [host_of_node(n, self.link_mbit) for n in ray.nodes() if n.get("Alive")]
        seen: dict[str, RayHost] = {}
        for h in hosts:
            if h.name in seen:
                raise ValueError(f"Ray nodes {seen[h.name].ray_node[:12]} and {h.ray_node[:12]} are both host "
                                 f"{h.name!r}: declare a distinct hmp_host:<name> resource on each (docs/jobs.md)")
            seen[h.name] = h
        return hosts

    def close(self) -> None:
        if self._own:
            import ray

            ray.shutdown()
            self._own = False


__all__ = ["DEFAULT_LINK_MBIT", "LINK_RESOURCE", "RayHost", "RayInventory", "SLOTS_RESOURCE", "host_of_node"]
