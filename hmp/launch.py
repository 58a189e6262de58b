"""``hmp-launch CONFIG [KEY=VALUE ...]``: start every daemon of a topology on this host, show progress, stop them all.

``KEY=VALUE`` arguments override the config's keys (``train.lr=0.1 cluster.cpu_workers=8``, TOML values;
:mod:`hmp.config.overrides`); the daemons then read the config as this run resolved it, ``<report_dir>/config.toml``
(:class:`hmp.launcher.base.Launcher`).
``--check``: check the config, the data and the model (one forward pass of a batch) and exit 0 or 2, starting
no daemon.

``--hosts HOSTS.toml``: run each daemon on the emulated host its ``[[nodes]] host`` names (network
namespaces on a rate-limited bridge, docs/emulate.md; needs root); they are removed afterwards.

``--engine ray [--address ADDR]``: run each daemon as (a child of) a Ray actor on a Ray cluster, or on a local
Ray instance started for the job without ``--address`` (docs/ray.md; needs ``pip install "hmp[ray]"``).

Exit code 0 when the job finished (or ``--check`` found nothing wrong), 1 when a daemon failed (one line names
it, the cause from its log and a hint), ``--timeout`` passed or emulated hosts cannot be made here, 2 on a config
error, 130 on Ctrl-C or SIGTERM. However the job ends, once training has begun the scheduler writes the report and
the model of what was trained, its ``final.status`` saying how it ended (completed, timeout, failed, interrupted;
docs/report.md).

Only the standard library is imported before the fork server is asked to start (it imports torch meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from hmp.errors import ConfigError


class ProgressBar:
    """One status line: epoch, per-worker samples/s and loss, best accuracy, elapsed time.

    On a terminal the line is redrawn in place; otherwise a line is printed every ``every_s``.
    """

    def __init__(self, epochs: int, stream=sys.stdout, every_s: float = 5.0) -> None:
        self.epochs, self.stream, self.every_s = epochs, stream, every_s
        self.tty = stream.isatty()
        self.last = 0.0

    def __call__(self, st: dict[str, Any]) -> None:
        workers = st.get("workers", {})
        epoch = max((int(w.get("epoch", 0)) for w in workers.values()), default=0)
        parts = [f"epoch {min(epoch + 1, self.epochs)}/{self.epochs}"]
        for wid, w in sorted(workers.items()):
            if w:
                parts.append(f"{wid} {w.get('samples_per_s', 0):7.0f} samples/s loss {w.get('loss', float('nan')):.3f}")
        best = st.get("best_metric") or {}
        if st.get("best_accuracy") and best.get("name", "test_accuracy") == "test_accuracy":
            parts.append(f"acc {st['best_accuracy']:.3f}")
        elif best:
            parts.append(f"{best['name']} {best['value']:.3f}")
        parts.append(f"{st.get('elapsed_s', 0):5.1f}s")
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r" + line[:200].ljust(120))
            self.stream.flush()
        elif time.monotonic() - self.last >= self.every_s:
            print(line, file=self.stream, flush=True)
            self.last = time.monotonic()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def free_port(host: str) -> int:
    """A TCP port free now on ``host``: the scheduler's, where ``[cluster] scheduler_port`` is 0. The OS picks it;
    the scheduler binds it a moment later (a port the OS gives out this way is not given out again at once)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _checked_config(args: argparse.Namespace, pick_port: Any = free_port) -> Any:
    """The config as this run takes it: the file, the command line's overrides, the environment's; checked by
    every subsystem, its data loaded and fitted to the model (a bad file or a model that does not fit it is one
    line and exit 2 before any daemon starts, docs/data.md; the daemons then load only their part), and every
    worker's device present here (engine local). Advice (e.g. standardize) is one line each on stderr.
    ``pick_port(host)``: the scheduler's port where ``[cluster] scheduler_port`` is 0."""
    from hmp import job
    from hmp.data import DataWarning

    with warnings.catch_warnings(record=True) as advice:
        warnings.simplefilter("always", DataWarning)
        cfg = job.with_env(job.load(args.config, data=True, overrides=args.overrides, free_port=pick_port))
    for w in advice:
        if issubclass(w.category, DataWarning):
            print(f"hmp-launch: warning: {w.message}", file=sys.stderr, flush=True)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if args.engine == "local":  # under Ray the workers run on the Ray cluster's nodes, not necessarily this one
        try:
            job.check_devices(cfg)
        except ConfigError as exc:
            raise job.blamed(exc, cfg) from None
    return cfg


def _check(args: argparse.Namespace) -> int:
    """``--check``: what a launch checks, then the model built as the daemons build it and run on one batch;
    a summary on stdout. Starts no daemon and writes nothing."""
    import torch

    from hmp import job
    from hmp.data import whole_batch

    picked: list[int] = []
    cfg = _checked_config(args, lambda host: picked.append(free_port(host)) or picked[-1])
    ds = job.dataset(cfg)
    model = job.sharded_model(cfg).model.eval()
    params = sum(p.numel() for p in model.parameters())
    rows = min(cfg.train.batch_size, len(ds.x_train))
    forward = "an HFTA sweep: its members' fused model"
    if not cfg.sweep.members and rows:
        try:
            with torch.no_grad():
                out = model(whole_batch(ds.x_train[:rows]))
        except Exception as exc:  # noqa: BLE001 (a user's model may raise anything)
            raise ConfigError(cfg.path, "model.name", f"a model that runs a batch of {rows} rows; it raised "
                                                      f"{exc.__class__.__name__}: {exc}") from None
        forward = f"a batch of {rows} rows gives {list(out.shape) if isinstance(out, torch.Tensor) else type(out)}"
    roles: dict[str, list[str]] = {}
    for n in cfg.nodes:
        if n.role != "scheduler":
            device = f" ({n.device})" if n.device else ""
            roles.setdefault(str(n.role), []).append(n.id + device)
    scheduler = cfg.scheduler.advertise or cfg.scheduler.bind
    picked_now = " (a free port picked now; a launch picks its own)" if picked else ""
    print(f"hmp-launch: {args.config}: ready to run; checked the config, the data and the model, started no daemon")
    if cfg.overrides:
        print(f"  overrides: {' '.join(cfg.overrides)}")
    print(f"  nodes: {len(cfg.nodes)}: scheduler at {scheduler}{picked_now}; "
          + "; ".join(f"{role} {' '.join(ids)}" for role, ids in roles.items()))
    shape = "x".join(str(d) for d in ds.feature_shape)
    print(f"  data: {ds.name}: {len(ds.y_train)} training and {len(ds.y_test)} test rows of [{shape}] "
          f"{'sparse ' if ds.sparse else ''}{ds.x_train.dtype if not ds.sparse else 'float'}, "
          f"{ds.num_classes} classes{', standardized' if cfg.data.standardize else ''}")
    print(f"  model: {cfg.model.name}: {params:,} parameters; {forward}")
    return 0


async def _launch(args: argparse.Namespace) -> int:
    # Imported here, not at the top: main() has started the fork server first, so its import of torch and
    # this process's (through hmp.job) run at once on two cores instead of one after the other.
    import structlog

    from hmp import log as hmp_log

    # Before the modules that bind their loggers at import (hmp.cluster's): the launcher's lines go to stderr.
    hmp_log.configure("auto")
    from hmp.cluster import JobFailed, JobTimedOut, LocalCluster
    from hmp.emulate import EmulationUnavailable

    cfg = _checked_config(args)
    if cfg.job.log_format != "auto":
        hmp_log.configure(cfg.job.log_format)  # the launcher's own log lines (info and up), like a daemon's
    structlog.get_logger("hmp").bind(role="launcher").info("config_checked", config=str(cfg.path), nodes=len(cfg.nodes))
    if args.engine == "ray":
        from hmp.ray_engine import RayCluster  # importable: main() checked
    bar = ProgressBar(cfg.train.epochs)
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    interrupted = False

    def on_signal() -> None:  # a second one skips the wait for the scheduler's report (Launcher.stop)
        nonlocal interrupted
        if not interrupted:
            print("\nhmp-launch: stopping the job; the scheduler writes its report (Ctrl-C again: stop at once)",
                  file=sys.stderr, flush=True)
        interrupted = True
        assert task is not None
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    cluster: Any  # LocalCluster or RayCluster: the same interface
    if args.engine == "ray":
        cluster = RayCluster(cfg, address=args.address, resume=args.resume)
        where = f"the Ray cluster at {args.address}" if args.address else "a local Ray instance"
        print(f"hmp-launch: {len(cfg.nodes)} daemons from {cfg.path} on {where}; logs in {cfg.report_dir / 'logs'}",
              flush=True)
    else:
        cluster = LocalCluster(cfg, resume=args.resume, hosts=args.hosts)  # a bad placement: ConfigError, exit 2
        users = [n.id for n in cfg.nodes if n.role == "user_worker"]
        print(f"hmp-launch: {len(cfg.nodes) - len(users)} daemons from {cfg.path}; logs in {cfg.report_dir / 'logs'}",
              flush=True)
        if users:  # docs/own_loop.md
            print(f"hmp-launch: waiting for user workers {', '.join(users)} to join (hmp.Worker; with this job's "
                  f"token: the same HMP_JOB_TOKEN or [job] token)", flush=True)
    t_launch = time.time()
    failure: JobFailed | None = None
    try:
        async with cluster:
            print(reach_line(cfg, cluster.scheduler_address, cluster.token_file), flush=True)
            for nid, url in getattr(cluster, "metrics_urls", {}).items():
                print(f"hmp-launch: metrics of {nid}: {url}", flush=True)
            if isinstance(cluster, LocalCluster) and cluster.hosts is not None:
                placed = {h: [n.id for n in cfg.nodes if n.host == h] for h in cluster.hosts.names}
                print("hmp-launch: emulated hosts from " + args.hosts + ": " + ", ".join(
                    f"{h} {cluster.hosts.address(h)} {cluster.hosts.hosts[h].spec.bandwidth_mbit:g} Mbit/s "
                    f"[{' '.join(ids)}]" for h, ids in placed.items()), flush=True)
            try:
                report = await cluster.train(timeout_s=args.timeout, progress=bar)
            except JobFailed as exc:  # the `async with` then has the scheduler write the report, and stops the rest
                bar.close()
                failure = exc
    except EmulationUnavailable as exc:
        print(f"hmp-launch: no emulated hosts here: {exc}", file=sys.stderr)
        return 1
    except JobFailed as exc:  # while starting (under Ray: a daemon that never served, an actor Ray cannot place)
        print(f"hmp-launch: job failed: {exc.cause}", file=sys.stderr)
        print(f"  logs: {cfg.report_dir / 'logs'}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        bar.close()
        if interrupted:  # stopping the daemons (and removing emulated hosts) is done: the `async with` ended
            print("hmp-launch: interrupted; every daemon stopped", file=sys.stderr)
            print_written(cfg, t_launch, sys.stderr)
            return 130
        raise
    if failure is not None:
        if isinstance(failure, JobTimedOut):
            print(f"hmp-launch: timeout: the job ran longer than --timeout {args.timeout:g} s and was stopped",
                  file=sys.stderr)
        else:
            print(f"hmp-launch: job failed: {failure.cause}", file=sys.stderr)
            if failure.node:
                print(f"  log: {cluster.log_path(failure.node)}", file=sys.stderr)
        print_written(cfg, t_launch, sys.stderr)
        return 1
    bar.close()
    final = report.get("final", {})
    print(f"hmp-launch: job finished: {final.get('stop_reason', '')}")
    if "test_accuracy" in final:
        print(f"final test accuracy: {final['test_accuracy']:.4f}  (loss {final.get('test_loss', 0):.4f}, "
              f"{final.get('elapsed_s', 0):.1f} s)")
    elif "test_loss" in final:  # another task: its metrics by name (docs/task.md)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in final.items() if k in ("test_loss", "r2", "rmse")
                          or k == final.get("best_reported_metric"))
        print(f"final {shown} ({final.get('elapsed_s', 0):.1f} s)")
    for wid, w in report.get("workers", {}).items():
        print(f"  {wid}: {w['updates']:.0f} updates ({w['update_share']:.0%}), {w['samples_per_s']:.0f} samples/s, "
              f"busy {w['busy_fraction']:.0%}, {w['bytes_out'] / 1e6:.1f} MB out")
    for ev in report.get("membership", []):  # who left, when, why (docs/architecture.md, "Elastic workers")
        print(f"  {ev.get('node')} {ev.get('event')} at {ev.get('t', 0):.1f} s: {ev.get('why', '')}")
    for r in cluster.restarts:
        print(f"  {r['node']} restarted by the launcher (attempt {r['attempt']}, exit code {r['exit_code']})")
    for lost in report.get("ray", {}).get("lost", []):
        print(f"  {lost['node']} lost at {lost['t']:.1f} s: its Ray actor died ({lost['error']})")
    if report.get("work_redone"):
        print(f"  work redone: {report['work_redone']} examples handed out again")
    print(f"report: {cfg.report_dir / 'report.json'}" + (f", plot: {cfg.report_dir / 'loss.png'}" if cfg.job.plot else ""))
    return 0


def reach_line(cfg: Any, address: str, token_file: Path) -> str:
    """How a client outside the topology reaches the running job (README, ``hmp.connect``)."""
    line = (f"hmp-launch: scheduler at {address}; job token in {token_file} (while the job runs): "
            f"await hmp.connect({str(cfg.path)!r}, {address!r}, token=open({str(token_file)!r}).read())")
    if cfg.security.curve:
        line += f"; CURVE keys in {cfg.resolve(cfg.security.key_dir)} (a client uses its own: hmp-keygen DIR --client NAME)"
    return line


def print_written(cfg: Any, since: float, stream: Any) -> None:
    """Say where the report and the model of this run are, with its status, if the scheduler wrote them."""
    path = cfg.report_dir / "report.json"
    try:
        if path.stat().st_mtime < since:
            raise FileNotFoundError  # an earlier run's
        final = json.loads(path.read_text()).get("final", {})
    except (OSError, ValueError):
        print("  no report: training had not begun", file=stream)
        return
    model = final.get("model") or f"none ({final.get('model_error', 'not written')})"
    print(f"  report: {path} (status {final.get('status', '?')}; {final.get('stop_reason', '')}); model: {model}",
          file=stream)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hmp-launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="topology/job TOML file, e.g. conf/local.toml")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="override a config key, e.g. train.lr=0.1 cluster.cpu_workers=8 model.args.hidden=[64,32] "
                         "(TOML values; text without quotes is a string)")
    ap.add_argument("--check", action="store_true",
                    help="check the config, the data and the model (one forward pass) and exit 0 or 2; start nothing")
    ap.add_argument("--resume", action="store_true", help="PS shards continue from their checkpoints")
    ap.add_argument("--timeout", type=float, default=None, help="fail the job after this many seconds")
    ap.add_argument("--hosts", metavar="HOSTS.toml", default=None,
                    help="run each daemon on the emulated host its [[nodes]] host names (docs/emulate.md; needs root)")
    ap.add_argument("--engine", choices=["local", "ray"], default="local",
                    help="local: every daemon a process of this machine (default); ray: each a Ray actor (docs/ray.md)")
    ap.add_argument("--address", metavar="ADDR", default=None,
                    help="--engine ray: the Ray cluster to join (e.g. auto, 10.0.0.1:6379); default: start a local one")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.engine == "ray" and args.hosts:
        ap.error("--hosts is for the local engine; under Ray, [[nodes]] host names a Ray node (docs/ray.md)")
    if args.address and args.engine != "ray":
        ap.error("--address needs --engine ray")
    if args.engine == "ray":
        try:  # before anything slow: Ray missing is known in a fraction of a second
            import hmp.ray_engine  # noqa: F401
        except ImportError as exc:
            print(f"hmp-launch: --engine ray: {exc}", file=sys.stderr)
            return 2
    if args.check:
        if args.resume or args.hosts or args.timeout is not None:
            ap.error("--check starts nothing: no --resume, --hosts or --timeout with it")
    elif args.engine == "local":
        from hmp.nodes import forkserver

        if forkserver.enabled():
            forkserver.ForkServer.shared()  # LocalCluster forks every daemon from it; it starts importing now
    import uvloop

    try:
        return _check(args) if args.check else uvloop.run(_launch(args))
    except ConfigError as exc:
        print(f"hmp-launch: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. a folder made unwritable after the config was checked: one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"hmp-launch: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
