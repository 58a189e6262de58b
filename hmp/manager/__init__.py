"""Cluster mode: a job manager that places submitted ring-all-reduce jobs onto hosts' worker slots (docs/jobs.md).

* :mod:`hmp.manager.spec`: job files (an hmp config without ``[[nodes]]``, plus ``[submit]``) and the topology a
  placed job becomes;
* :mod:`hmp.manager.utility`: a job file's utility table -> :mod:`hmp.gadget.jobs`' utility functions;
* :mod:`hmp.manager.core`: the sans-IO core (slots, queue, running jobs, the scheduler's checked decisions);
* :mod:`hmp.manager.service`: the asyncio shell (:class:`~hmp.manager.service.JobManager`), each job a
  :class:`~hmp.cluster.LocalCluster` on the shared emulated hosts;
* :mod:`hmp.manager.ray_inventory`: the hosts and slots of a Ray cluster's nodes (``hmp-manager --engine ray``), whose
  jobs run through :class:`~hmp.ray_engine.RayCluster`;
* :mod:`hmp.manager.cli`: ``hmp-manager`` and ``hmp-submit``.
"""
