"""hmp: a heterogeneous message-passing runtime for distributed deep-learning training."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["JobManager", "LocalCluster", "PSClient", "load_config", "__version__"]


def __getattr__(name: str):
    # Lazy: importing hmp must not pull torch and zmq into processes that need neither.
    if name == "LocalCluster":
        from hmp.cluster import LocalCluster
        return LocalCluster
    if name == "JobManager":
        from hmp.jobs.manager import JobManager
        return JobManager
    if name == "PSClient":
        from hmp.client import PSClient
        return PSClient
    if name == "load_config":
        from hmp.job import load
        return load
    raise AttributeError(name)
