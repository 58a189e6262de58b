"""``hmp-manager`` (the job manager daemon) and ``hmp-submit`` (its client); docs/jobs.md.

``hmp-manager --hosts HOSTS.toml --scheduler gadget [--bind ADDR]``: keeps the hosts' worker slots, runs
each submitted ring job on the slots the scheduler chose, prints a line per job event; runs until Ctrl-C
or SIGTERM, then stops every job's daemons and removes the emulated hosts. Exit 0 after such a stop, 1 when
emulated hosts cannot be made here, 2 on a config error (hosts file, scheduler name).
``hmp-manager --engine ray [--address ADDR]``: the hosts and slots are the Ray cluster's nodes, and each job runs
on them through the Ray engine (docs/jobs.md, "Slots from Ray"; needs ``pip install "hmp[ray]"``).

``hmp-submit JOB.toml [--manager ADDR] [--wait]``: sends the job file; prints the job's id. ``--wait``: until
the job ends, then its result. Exit 0 (submitted; with --wait: the job finished), 1 (the job failed, or no
manager answered), 2 (the manager refused the job file: the message names the file and key).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from hmp.errors import ConfigError, HmpError, RemoteError

# The transport (zmq), the event loop and logging are imported once the arguments are parsed: --help and a
# missing manager answer at once.

#: Where hmp-manager listens and hmp-submit looks by default (this machine only).
DEFAULT_ADDRESS = "tcp://127.0.0.1:47399"


def _line(event: str, r: Any) -> None:
    """One line per job event on stdout (the structured log goes to stderr)."""
    where = " ".join(f"{h}x{n}" for h, n in r.placement.items())
    if event == "job_started":
        print(f"{r.job_id} {r.name}: started on {where} after {r.queue_s:.1f} s in the queue", flush=True)
    elif event == "job_done":
        print(f"{r.job_id} {r.name}: done in {r.jct_s:.1f} s ({r.stop_reason}; accuracy {r.final_accuracy:.3f}, "
              f"{r.iteration_s * 1e3:.1f} ms/iteration, utility {r.utility:.3f})", flush=True)
    else:
        print(f"{r.job_id} {r.name}: {r.status}: {r.error}", flush=True)


async def _manage(args: argparse.Namespace) -> int:
    from hmp import log as hmp_log
    from hmp.emulate import EmulationUnavailable
    from hmp.manager.service import JobManager

    hmp_log.configure("auto")
    hosts: Any = args.hosts
    if args.engine == "ray":
        from hmp.manager.ray_inventory import RayInventory

        hosts = RayInventory(args.address)
    manager = JobManager(hosts, args.scheduler, emulate=not args.no_emulate, run_dir=args.run_dir,
                         bind=args.bind, seed=args.seed, on_event=_line)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with manager:
            where = "" if manager.emulated else (", under Ray" if manager.ray else ", on this machine")
            print(f"hmp-manager: {len(manager.host_names)} hosts from {manager.hosts_source} "
                  f"({manager.cluster.total_slots} slots{where}), "
                  f"scheduler {args.scheduler}, listening on {manager.address}", flush=True)
            await stop.wait()
            print("hmp-manager: stopping every job", flush=True)
    except EmulationUnavailable as exc:
        print(f"hmp-manager: no emulated hosts here: {exc} (--no-emulate runs on this machine)", file=sys.stderr)
        return 1
    print("hmp-manager: stopped", flush=True)
    return 0


def manager_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hmp-manager", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", metavar="HOSTS.toml", default=None,
                    help="hosts file with [[hosts]] slots (docs/emulate.md); default: one local host")
    ap.add_argument("--scheduler", default="gadget", help="gadget | fifo | first_fit | random | tiresias | optimal")
    ap.add_argument("--bind", default=DEFAULT_ADDRESS, help=f"where hmp-submit reaches it (default {DEFAULT_ADDRESS})")
    ap.add_argument("--run-dir", default="runs/jobs", help="each job's topology, logs, report and result go here")
    ap.add_argument("--no-emulate", action="store_true",
                    help="run every job on this machine's loopback (the hosts file then only gives slots)")
    ap.add_argument("--seed", type=int, default=0, help="seed of randomised schedulers")
    ap.add_argument("--engine", choices=["local", "ray"], default="local",
                    help="ray: the hosts and slots are a Ray cluster's nodes, jobs run under Ray (docs/jobs.md)")
    ap.add_argument("--address", metavar="ADDR", default=None,
                    help="--engine ray: the Ray cluster to join (e.g. auto, 10.0.0.1:6379); default: a local one")
    args = ap.parse_args(argv)
    if args.engine == "ray" and (args.hosts or args.no_emulate):
        ap.error("--hosts and --no-emulate are for the local engine; under Ray the hosts are the Ray nodes")
    if args.address and args.engine != "ray":
        ap.error("--address needs --engine ray")
    if args.engine == "ray":
        try:  # before anything slow: Ray missing is one line
            import ray  # noqa: F401
        except ImportError as exc:
            print(f"hmp-manager: --engine ray needs Ray: pip install \"hmp[ray]\" ({exc})", file=sys.stderr)
            return 2
    import uvloop

    try:
        return uvloop.run(_manage(args))
    except ConfigError as exc:
        print(f"hmp-manager: config error: {exc}", file=sys.stderr)
        return 2


#: seconds between hmp-submit --wait's status polls (below JobManager's status_linger_s, so that a stopping
#: manager's last answer is seen)
WAIT_POLL_S = 0.5
#: seconds hmp-submit tries to connect to the manager (again every 0.1 s while refused: a manager starting at the
#: same time) before saying that none listens there
PROBE_TIMEOUT_S = 2.0


def nobody_listening(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Why no manager can be at ``address`` ("" when something listens there, or it cannot be told): ZeroMQ
    connects lazily and would only let a request time out, so a plain connection is tried first."""
    import socket
    import time

    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        return "" if Path(path).exists() else f"no socket file {path}"
    if not address.startswith("tcp://"):
        return ""
    host, _, port = address[len("tcp://"):].rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return ""
        except ValueError:
            return ""
        except TimeoutError:
            return f"no answer to a connection within {timeout_s:g} s"
        except OSError as exc:
            if time.monotonic() > deadline:
                return f"{exc.strerror or exc}, for {timeout_s:g} s"
            time.sleep(0.1)


async def _submit(args: argparse.Namespace) -> int:
    try:
        text = Path(args.job).read_text()
    except OSError as exc:
        print(f"hmp-submit: config error: {args.job}: key '<file>': a readable job file ({exc.strerror})",
              file=sys.stderr)
        return 2
    why = await asyncio.to_thread(nobody_listening, args.manager)
    if why:
        print(f"hmp-submit: no job manager at {args.manager} ({why}); start one with hmp-manager, or name it "
              f"with --manager ADDR", file=sys.stderr)
        return 1
    from hmp.messages import Ack, Status, Submit
    from hmp.transport.endpoint import Client

    client = Client(args.manager, name="hmp-submit", timeout_s=args.timeout)
    await client.connect()
    try:
        try:
            reply = await client.request(Submit(job=text, path=str(Path(args.job).resolve())))
        except RemoteError as exc:
            kind = "config error" if exc.code == "bad_config" else "refused"
            print(f"hmp-submit: {kind}: {exc.remote_message}", file=sys.stderr)
            return 2 if exc.code == "bad_config" else 1
        except HmpError as exc:
            print(f"hmp-submit: no answer from a job manager at {args.manager}: {exc}", file=sys.stderr)
            return 1
        assert isinstance(reply, Ack)
        job_id = reply.detail
        print(job_id, flush=True)
        if not args.wait:
            return 0
        while True:
            await asyncio.sleep(WAIT_POLL_S)
            try:
                st = await client.request(Status(), timeout_s=min(args.timeout, 5.0))
            except HmpError as exc:
                print(f"hmp-submit: lost the job manager at {args.manager} while job {job_id} ran: {exc}",
                      file=sys.stderr)
                return 1
            r = st.state.get("jobs", {}).get(job_id, {}) if isinstance(st, Status) else {}
            if r.get("status") in ("done", "failed", "stopped"):
                print(json.dumps(r, indent=1), flush=True)
                return 0 if r["status"] == "done" else 1
    finally:
        await client.close()


def submit_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hmp-submit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help="job TOML file (an hmp config without [[nodes]], plus [submit])")
    ap.add_argument("--manager", default=DEFAULT_ADDRESS, help=f"the job manager's address (default {DEFAULT_ADDRESS})")
    ap.add_argument("--wait", action="store_true", help="wait for the job to end and print its result")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each answer of the manager")
    args = ap.parse_args(argv)
    import uvloop

    return uvloop.run(_submit(args))


if __name__ == "__main__":
    sys.exit(manager_main())
