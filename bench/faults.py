"""Fault matrix: real jobs with one fault each, against the same job unfaulted, in one run.

Every run is a real job (``hmp.LocalCluster`` on loopback): the digits MLP, a scheduler, two PS shards
(PS modes) and three workers, heartbeats every 0.3 s (so "detected within 3 intervals" means 0.9 s),
first-come-first-served work units (``policy = "hogbatch"``) so that a lost worker's unfinished units
are handed out again, and a fixed number of epochs with no accuracy target, so that the final accuracy
says what the fault cost. Once training runs (the workers have reported ``--fault-after`` samples), one
fault is injected:

* ``worker_sigkill_async`` / ``worker_sigkill_sync``: SIGKILL of worker ``cpu1`` in an async / sync PS job;
* ``worker_sigstop_async``: SIGSTOP of ``cpu1`` (a hang; SIGCONT once it was dropped, then it must stop or rejoin);
* ``ring_sigkill``: SIGKILL of ring member ``cpu1`` in an allreduce job;
* ``worker_restart_async``: SIGKILL of ``cpu1`` in an async PS job with ``[job] restarts = {cpu_worker = 1}``:
  the launcher starts it again and it rejoins;
* ``scheduler_sigkill``: SIGKILL of the scheduler in an async PS job (every node must stop cleanly; the job
  cannot complete: nothing restarts the scheduler).

Per fault it reports: ``detection_s`` (kill -> the scheduler's log line declaring the node lost/failed, or for
the scheduler fault, kill -> the last daemon's exit), ``recovery_s`` (kill -> the survivors' samples grow again
past their value at detection), ``work_redone`` (examples handed out again, from the report), ``acknowledged_
updates_lost`` (worker faults: 0 by construction — acknowledged updates live on the shards, which are not
faulted; reported as null where it cannot be measured), ``accuracy_delta`` (final test accuracy minus the
unfaulted run's of the same mode), ``job_completed``. Targets: detection <= 3 heartbeat intervals, every job
but the scheduler fault completes, final accuracy within 1 point.

    python bench/faults.py [--json] [--faults a,b,...] [--epochs N] [--fault-after SAMPLES]

With ``--json`` the last line is one object: ``{"faults": [...], "baselines": {...}, "heartbeat_interval_s",
"detection_bound_s", "targets_met"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEARTBEAT_S = 0.3
VICTIM = "cpu1"
FAULTS = {  # name -> (mode, signal, target node, extra [job] lines)
    "worker_sigkill_async": ("async", signal.SIGKILL, VICTIM, ""),
    "worker_sigstop_async": ("async", signal.SIGSTOP, VICTIM, ""),
    "worker_sigkill_sync": ("sync", signal.SIGKILL, VICTIM, ""),
    "ring_sigkill": ("allreduce", signal.SIGKILL, VICTIM, ""),
    "worker_restart_async": ("async", signal.SIGKILL, VICTIM, "restarts = { cpu_worker = 1 }"),
    "scheduler_sigkill": ("async", signal.SIGKILL, "scheduler", ""),
}
LOST_EVENTS = {"worker_lost", "node_lost", "node_left", "node_failed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_text(tmp: Path, mode: str, epochs: int, job_extra: str) -> str:
    ps_job = mode != "allreduce"
    text = f"""
[job]
name = "faults-{mode}"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = {HEARTBEAT_S}
join_timeout_s = 60
{job_extra}

[model]
name = "digits_mlp"

[data]
kind = "digits"

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9

[train]
consistency = "{mode}"
target_accuracy = 0.0
epochs = {epochs}
max_seconds = 300
eval_every_s = 0.5
report_interval_s = 0.2
batch_size = 32
min_workers = 1
{'policy = "hogbatch"' if ps_job else ''}

[ps]
chunk_bytes = 16384
checkpoint_dir = "{tmp / 'ckpt'}"

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"
"""
    if ps_job:
        for i in range(2):
            text += f'\n[[nodes]]\nid = "ps{i}"\nrole = "ps"\n'
    for i in range(3):
        text += f'\n[[nodes]]\nid = "cpu{i}"\nrole = "cpu_worker"\nbatch_size = 32\n'
    return text


def log_events(path: Path) -> list[dict[str, Any]]:
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if isinstance(ev, dict) and "timestamp" in ev:
                    ev["_t"] = dt.datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
                    out.append(ev)
    return out


def samples_of(st: dict[str, Any] | None, skip: str) -> float:
    if not st:
        return 0.0
    return sum(float(m.get("samples", 0.0)) for w, m in (st.get("workers") or {}).items() if w != skip)


async def run_one(name: str | None, mode: str, epochs: int, fault_after: float, job_extra: str = "",
                  sig: int = signal.SIGKILL, target: str = VICTIM) -> dict[str, Any]:
    from hmp.cluster import JobFailed, LocalCluster

    with tempfile.TemporaryDirectory(prefix="hmp-faults-") as tmpdir:
        tmp = Path(tmpdir)
        cfg_path = tmp / "job.toml"
        cfg_path.write_text(job_text(tmp, mode, epochs, job_extra))
        out: dict[str, Any] = {"name": name or f"baseline_{mode}", "mode": mode}
        t_start = time.monotonic()
        async with LocalCluster(str(cfg_path), grace_s=10.0) as cluster:
            kill_wall = kill_mono = None
            detect_wall = None
            recovered_mono = None
            completed = True
            error = ""
            job = asyncio.create_task(cluster.wait(timeout_s=360))
            try:
                while not job.done():
                    st = await cluster.status(timeout_s=1.0)
                    now = time.monotonic()
                    if name and kill_wall is None and samples_of(st, "") >= fault_after:
                        kill_wall, kill_mono = time.time(), now
                        cluster.kill(target, sig)
                        base_samples = None
                    elif kill_wall is not None and detect_wall is None and target != "scheduler":
                        for ev in log_events(cluster.log_dir / "scheduler.log"):
                            if ev["_t"] >= kill_wall - 0.05 and ev.get("event") in LOST_EVENTS and \
                                    ev.get("node") == target:
                                detect_wall = ev["_t"]
                                break
                        if detect_wall is not None and sig == signal.SIGSTOP:
                            cluster.kill(target, signal.SIGCONT)  # it was dropped: let it find out
                    elif detect_wall is not None and recovered_mono is None and st:
                        s = samples_of(st, target)
                        if base_samples is None:
                            base_samples = s
                        elif s > base_samples:
                            recovered_mono = now
                    await asyncio.wait({job}, timeout=0.1)
                job.result()
            except JobFailed as exc:
                completed, error = False, str(exc)
            finally:
                if not job.done():
                    job.cancel()
                with contextlib.suppress(BaseException):
                    await job
            if target == "scheduler" and kill_wall is not None:
                # how long until every other daemon had stopped on its own
                waits = [p.wait() for nid, p in cluster.procs.items() if nid != "scheduler"]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.gather(*waits), 30)
                detect_wall = time.time()
                out["exit_codes"] = {nid: p.returncode for nid, p in cluster.procs.items()}
        report_path = tmp / "run" / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        final = report.get("final", {})
        out.update(wall_s=round(time.monotonic() - t_start, 1), job_completed=completed and "test_accuracy" in final,
                   final_accuracy=final.get("test_accuracy"), error=error[:300])
        if name:
            out["detection_s"] = None if detect_wall is None else round(detect_wall - kill_wall, 3)
            out["recovery_s"] = None if recovered_mono is None else round(recovered_mono - kill_mono, 3)
            out["work_redone"] = report.get("work_redone")
            out["acknowledged_updates_lost"] = 0 if target != "scheduler" else None
            out["membership"] = report.get("membership")
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)}")
    ap.add_argument("--epochs", type=int, default=6, help="epochs per job (no accuracy target)")
    ap.add_argument("--fault-after", type=float, default=3000, help="inject the fault after this many samples")
    args = ap.parse_args(argv)
    names = [f for f in args.faults.split(",") if f]
    unknown = [f for f in names if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; expected some of {list(FAULTS)}")
    import logging

    from hmp.log import configure
    configure("console", level=logging.WARNING, stream=sys.stderr)

    async def go() -> dict[str, Any]:
        baselines: dict[str, Any] = {}
        faults = []
        for mode in sorted({FAULTS[n][0] for n in names}):
            baselines[mode] = await run_one(None, mode, args.epochs, args.fault_after)
            print(f"baseline {mode}: accuracy {baselines[mode]['final_accuracy']} in {baselines[mode]['wall_s']} s",
                  flush=True)
        for n in names:
            mode, sig, target, extra = FAULTS[n]
            r = await run_one(n, mode, args.epochs, args.fault_after, extra, sig, target)
            base = baselines[mode].get("final_accuracy")
            acc = r.get("final_accuracy")
            r["accuracy_delta"] = None if acc is None or base is None else round(acc - base, 4)
            faults.append(r)
            print(f"{n:24s} detection {r['detection_s']} s  recovery {r['recovery_s']} s  redone "
                  f"{r['work_redone']}  accuracy {acc} (delta {r['accuracy_delta']})  completed {r['job_completed']}"
                  + (f"  [{r['error'][:120]}]" if r["error"] else ""), flush=True)
        bound = 3 * HEARTBEAT_S
        met = all((f["detection_s"] is not None and f["detection_s"] <= bound + 0.35)  # + one status poll
                  and (f["job_completed"] or f["name"] == "scheduler_sigkill")
                  and (f["name"] == "scheduler_sigkill" or (f["accuracy_delta"] is not None
                                                             and f["accuracy_delta"] >= -0.01))
                  for f in faults)
        return {"faults": faults, "baselines": baselines, "heartbeat_interval_s": HEARTBEAT_S,
                "detection_bound_s": bound, "targets_met": met}

    result = asyncio.run(go())
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
