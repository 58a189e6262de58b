"""hmp: a heterogeneous message-passing runtime for distributed deep-learning training.

What the README's examples use is here: :class:`LocalCluster` (start a job's daemons and train),
:class:`JobManager` (cluster mode), :class:`PSClient` and :func:`connect` (a client of a running job's
parameter server), :func:`load_config` (a checked :class:`Config`), :func:`load_dataset` and
:func:`build_model` (a job's data and model as its daemons build them), :func:`load_model` (the
model a finished job wrote), :class:`Worker` and :class:`SyncWorker` (your own training loop as a worker of a
job: docs/own_loop.md), :class:`Dataset`,
:class:`ShardedModel`, and the errors :class:`HmpError` and :class:`ConfigError`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "Dataset", "HmpError", "JobManager", "LocalCluster", "PSClient", "ShardedModel",
           "SyncWorker", "Worker", "build_model", "connect", "load_config", "load_dataset", "load_model", "__version__"]


def __getattr__(name: str):
    # Lazy: importing hmp must not pull torch and zmq into processes that need neither.
    if name == "LocalCluster":
        from hmp.cluster import LocalCluster
        return LocalCluster
    if name == "JobManager":
        from hmp.manager.service import JobManager
        return JobManager
    if name in ("Worker", "SyncWorker"):
        from hmp.nodes import user_handle
        return getattr(user_handle, name)
    if name == "PSClient":
        from hmp.client import PSClient
        return PSClient
    if name == "ShardedModel":
        from hmp.ps.sharding import ShardedModel
        return ShardedModel
    if name == "load_config":
        from hmp.job import load
        return load
    if name == "load_dataset":
        from hmp.job import dataset
        return dataset
    if name == "build_model":
        from hmp.models import from_config
        return from_config
    if name == "load_model":
        from hmp.export import load_model
        return load_model
    if name == "Dataset":
        from hmp.data import Dataset
        return Dataset
    if name == "Config":
        from hmp.config import Config
        return Config
    if name in ("ConfigError", "HmpError"):
        from hmp import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'hmp' has no attribute {name!r}")


async def connect(config: Any, scheduler: str, *, token: str | None = None, name: str = "client",
                  device: str = "cpu", timeout_s: float = 30.0, security: Any = None) -> Any:
    """A :class:`PSClient` of a running job from its config file (or :class:`Config`) and its scheduler's
    address alone: the shards' addresses come from the scheduler's ``discover`` answer (docs/protocol.md,
    "Taking part from outside the topology"), waited for until every shard has joined (at most
    ``timeout_s``). Enter the client to connect it::

        async with await hmp.connect("job.toml", "tcp://10.0.0.1:5555", token=job_token) as ps:
            await ps.pull()

    ``token``: the job's token (default: ``$HMP_JOB_TOKEN``, else the config's ``[job] token``; the
    launcher makes one per run and gives it to its daemons in ``HMP_JOB_TOKEN``). ``security``: CURVE keys
    as for :meth:`PSClient.from_config` (None: with ``[security] curve``, ``name``'s key in ``key_dir``).
    The config's model must be the job's: a different chunk layout is a :class:`ConfigError`; a job
    without shards (ring all-reduce) or shards that do not all join in time are :class:`HmpError`."""
    import asyncio
    import dataclasses
    import time

    from hmp import job
    from hmp.client import PSClient
    from hmp.config import Config
    from hmp.errors import ConfigError, HmpError
    from hmp.messages import Discover
    from hmp.transport import security as sec
    from hmp.transport import Client, process_settings

    cfg = config if isinstance(config, Config) else job.with_env(job.load(config, data=False))
    if token is not None:
        cfg = cfg.replace(job=dataclasses.replace(cfg.job, token=token))
    if security is None and process_settings().security is None:
        security = sec.from_config(cfg, name, serve=False) or False
    deadline = time.monotonic() + timeout_s
    async with Client(scheduler, name=name, timeout_s=min(timeout_s, cfg.limits.request_timeout_s),
                      job_token=cfg.job.token, security=security) as scheduler_client:
        while True:
            directory = (await scheduler_client.request(Discover())).ps
            if not directory:
                raise HmpError(f"the job at {scheduler} has no parameter server (a ring all-reduce job)")
            if directory.get("shards"):
                break
            if time.monotonic() >= deadline:
                raise HmpError(f"the shards of the job at {scheduler} did not all join within {timeout_s} s")
            await asyncio.sleep(0.1)
    client = PSClient.from_config(cfg, [(str(sid), str(address)) for sid, address in directory["shards"]],
                                  name=name, device=device, security=security)
    mine = [[c.key, c.dtype, c.start, c.numel] for c in client.sharded.layout.chunks]
    if mine != [list(c) for c in directory["chunks"]]:
        raise ConfigError(cfg.path, "model", f"the model of the job at {scheduler}: its chunk layout "
                                             f"({len(directory['chunks'])} chunks) differs from this config's "
                                             f"({len(mine)} chunks); use the job's own config file")
    return client
