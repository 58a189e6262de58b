"""Entry points of the four daemons (``[project.scripts]``): ``hmp-<role> --config FILE --id NAME``.

Only the standard library and the config are imported before the arguments are parsed (``--help`` answers at
once); torch and the node modules come after. A daemon names itself in ``ps`` (role and id, :func:`set_title`),
and one that cannot start (a config error, a device torch refuses) tells the scheduler it failed before it exits,
so that the job fails at once, or goes on without it while ``[train] min_workers`` remain, instead of waiting out
``join_timeout_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

# Remember SIGTERM/SIGINT that arrive while the daemon is still importing torch or loading data, before its
# event loop owns the signals; Node.run replays them, so an early stop is as graceful (exit 0) as a late one.
_early_signals: list[int] = []


def _remember_signal(sig: int, _frame: object) -> None:
    _early_signals.append(sig)


for _sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, _remember_signal)

# After the handlers above, on purpose.
from hmp.config import WORKER_ROLES, Consistency, Role  # noqa: E402
from hmp.errors import ConfigError, HmpError  # noqa: E402

#: ``PR_SET_NAME``: the calling thread's name, what ``ps -o comm`` and ``top`` show (at most 15 bytes)
_PR_SET_NAME = 15
#: seconds a daemon that cannot start waits for the scheduler to take note that it failed
FAILED_START_NOTICE_S = 5.0


def set_title(title: str, comm: str) -> None:
    """Name this process in ``ps``: ``comm`` (``ps -o comm``, cut to 15 bytes) through ``prctl(PR_SET_NAME)``, and
    ``title`` as its command line (``ps -o args``) by overwriting the memory that held the process's arguments
    (cut to their length, the rest zeroed: nothing past it is touched). A daemon forked from the fork server would
    otherwise show the server's ``python -m hmp.nodes.forkserver``. Best effort: Linux only, silently nothing
    elsewhere."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(comm.encode()[:15]), 0, 0, 0)
        # Fields 48 and 49 of /proc/self/stat (Linux 3.5+): where the arguments' strings start and end.
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
    except (OSError, ValueError, IndexError, AttributeError):
        return
    size = end - start
    if size < 2:
        return
    data = title.encode(errors="replace")[:size - 1]
    ctypes.memmove(start, data + b"\0" * (size - len(data)), size)


def _parse(role: str, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"hmp-{role.replace('_', '-')}", description=f"Run one hmp {role} daemon.")
    ap.add_argument("--config", required=True, help="topology/job TOML file (see conf/)")
    ap.add_argument("--id", required=True, help="this node's id in the config's [[nodes]]")
    ap.add_argument("--log-format", choices=["auto", "console", "json"], default=None,
                    help="override [job] log_format")
    ap.add_argument("--ready-file", metavar="PATH", default=None,
                    help="once serving, write {\"address\", \"pid\"} (JSON) here: how a launcher learns the address "
                         "the daemon bound (e.g. a port the OS picked)")
    if role in (Role.PS, Role.SCHEDULER):
        ap.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint (shards) or saved state (scheduler: epochs, "
                             "counters, report)")
    return ap.parse_args(argv)


def _run(role: str, argv: list[str] | None = None) -> int:
    args = _parse(role, argv)
    set_title(f"hmp-{role.replace('_', '-')} {args.id} --config {args.config}", f"hmp:{args.id}")
    import uvloop

    from hmp import job
    from hmp import log as hmp_log

    try:
        cfg = job.with_env(job.load(args.config))
        node_cfg = cfg.node(args.id)
        if node_cfg.role != role:
            raise ConfigError(cfg.path, f"nodes[id={args.id}].role", f"role {role!r} for hmp-{role}, "
                                                                    f"found {node_cfg.role!r}")
        from hmp.transport.security import from_config

        from_config(cfg, args.id)  # key files ([security] curve): checked before anything starts
    except ConfigError as exc:
        print(f"hmp-{role}: config error: {exc}", file=sys.stderr)
        return 2
    hmp_log.configure(args.log_format or cfg.job.log_format)
    if cfg.limits.tune_malloc:  # before the first socket: libzmq's I/O thread picks its malloc arena then
        from hmp.transport.endpoint import tune_malloc

        tune_malloc()
    import torch

    # Once per process, here, before any thread starts (several daemons share the cores): torch's intra-op thread
    # count is process-wide, every thread started later (the node's compute thread, Hogwild threads) uses it, and
    # nothing else in hmp changes it.
    torch.set_num_threads(node_cfg.threads)

    def build() -> Any:
        if role == Role.SCHEDULER:
            from hmp.nodes.scheduler import SchedulerNode
            return SchedulerNode(cfg, args.id, resume=args.resume)
        if role == Role.PS:
            from hmp.nodes.ps_shard import PSShardNode
            return PSShardNode(cfg, args.id, resume=args.resume)
        if cfg.train.consistency == Consistency.ALLREDUCE:  # no PS: the workers' ring
            from hmp.nodes.ring_worker import RingWorkerNode
            return RingWorkerNode(cfg, args.id)
        if cfg.placement.enabled:  # a pipeline job: the worker runs the stage it is assigned
            from hmp.nodes.stage_worker import StageWorkerNode
            return StageWorkerNode(cfg, args.id)
        from hmp.nodes.worker import WorkerNode
        return WorkerNode(cfg, args.id)

    async def go() -> int:
        try:
            node = build()
        except Exception as exc:
            # It cannot start (e.g. a device torch refuses): say so in one line, and tell the scheduler, which
            # otherwise waits for its join until join_timeout_s.
            why = str(exc) if isinstance(exc, HmpError) else f"{exc.__class__.__name__}: {exc}"
            if not isinstance(exc, ConfigError):  # that one is printed below, as every config error
                print(f"hmp-{role} {args.id}: cannot start: {why}", file=sys.stderr, flush=True)
            if role in WORKER_ROLES:
                await _tell_scheduler_failed(cfg, args.id, f"failed: cannot start: {why}")
            if isinstance(exc, ConfigError):
                raise
            return 1
        ready = (lambda address: _write_ready(args.ready_file, address)) if args.ready_file else None
        return await node.run(pending_signals=_early_signals, ready=ready)

    try:
        return uvloop.run(go())
    except ConfigError as exc:  # found only once running, e.g. a bind address another process holds
        print(f"hmp-{role} {args.id}: config error: {exc}", file=sys.stderr)
        return 2
    except HmpError as exc:
        print(f"hmp-{role} {args.id}: {exc}", file=sys.stderr)
        return 1


async def _tell_scheduler_failed(cfg: Any, node_id: str, reason: str) -> None:
    """Leave the job with ``reason`` (``failed: ...``) before ever joining it: the scheduler then judges at once
    (the job fails, or goes on while ``[train] min_workers`` remain). Best effort, bounded: a scheduler that does
    not answer still fails the job after join_timeout_s."""
    from hmp.messages import Leave
    from hmp.transport.client import Client
    from hmp.transport.security import from_config

    s = cfg.scheduler
    client = Client(s.advertise or s.bind, name=node_id, job_token=cfg.job.token,
                    security=from_config(cfg, node_id, serve=False) or False,
                    timeout_s=min(FAILED_START_NOTICE_S, cfg.job.join_timeout_s))
    try:
        await client.connect()
        await client.request(Leave(reason=reason))
    except HmpError as exc:
        print(f"hmp: {node_id}: the scheduler did not hear that it failed ({exc})", file=sys.stderr, flush=True)
    finally:
        await client.close()


def _write_ready(path: str, address: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"  # whole or absent: the launcher polls for it
    with open(tmp, "w") as f:
        json.dump({"address": address, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def scheduler_main(argv: list[str] | None = None) -> int:
    return _run(Role.SCHEDULER, argv)


def ps_main(argv: list[str] | None = None) -> int:
    return _run(Role.PS, argv)


def cpu_worker_main(argv: list[str] | None = None) -> int:
    return _run(Role.CPU_WORKER, argv)


def gpu_worker_main(argv: list[str] | None = None) -> int:
    return _run(Role.GPU_WORKER, argv)


ROLE_MAINS = {Role.SCHEDULER: scheduler_main, Role.PS: ps_main, Role.CPU_WORKER: cpu_worker_main,
              Role.GPU_WORKER: gpu_worker_main}

if __name__ == "__main__":  # python -m hmp.nodes.main ROLE --config ... --id ...
    if sys.argv[1:] == ["-"]:  # the arguments as one JSON line on stdin (hmp.launcher.keeper), read with torch
        line = sys.stdin.readline()  # imported and the early-signal handlers in place; no line: exit 0
        if not line:
            sys.exit(0)
        sys.argv[1:] = json.loads(line)
    sys.exit(ROLE_MAINS[sys.argv[1]](sys.argv[2:]))
