"""Entry points of the four daemons (``[project.scripts]``): ``hmp-<role> --config FILE --id NAME``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

# Remember SIGTERM/SIGINT that arrive while the daemon is still importing torch or loading data, before its
# event loop owns the signals; Node.run replays them, so an early stop is as graceful (exit 0) as a late one.
_early_signals: list[int] = []


def _remember_signal(sig: int, _frame: object) -> None:
    _early_signals.append(sig)


for _sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, _remember_signal)

import uvloop  # noqa: E402  (after the handlers above, on purpose)

from hmp import log as hmp_log  # noqa: E402
from hmp import job  # noqa: E402
from hmp.config import Consistency, Role  # noqa: E402
from hmp.errors import ConfigError, HmpError  # noqa: E402


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

    async def go() -> int:
        if role == Role.SCHEDULER:
            from hmp.nodes.scheduler import SchedulerNode as cls
            node = cls(cfg, args.id, resume=args.resume)
        elif role == Role.PS:
            from hmp.nodes.ps_shard import PSShardNode
            node = PSShardNode(cfg, args.id, resume=args.resume)
        elif cfg.train.consistency == Consistency.ALLREDUCE:  # no PS: the workers' ring
            from hmp.nodes.ring_worker import RingWorkerNode
            node = RingWorkerNode(cfg, args.id)
        elif cfg.placement.enabled:  # a pipeline job: the worker runs the stage it is assigned
            from hmp.nodes.stage_worker import StageWorkerNode
            node = StageWorkerNode(cfg, args.id)
        else:
            from hmp.nodes.worker import WorkerNode
            node = WorkerNode(cfg, args.id)
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
