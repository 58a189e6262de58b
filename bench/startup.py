"""Start-up: where the time from ``make run`` (``hmp-launch conf/local.toml``) to the first training step goes.

Each run starts ``hmp-launch`` (the console script beside this Python, as ``make run`` does) on a copy of
``conf/local.toml`` (its own report folder and a free scheduler port, so that a job of someone else's on the
default port cannot answer), and takes each phase's time, in seconds since the launcher process was
started, from the launcher's and the daemons' structured logs:

* ``launcher``: the launcher has imported what it needs and checked the config and the data (``config_checked``);
* ``forkserver``: the fork server has imported torch and the daemons' modules (``forkserver_ready``);
* ``forked.<id>``: the launcher has forked daemon ``<id>`` (``daemon_started``);
* ``serving.<id>``: the daemon has built what it builds before serving (the scheduler its test set and
  the model's layout) and serves (``serving``);
* ``joined``: every worker and shard has been welcomed by the scheduler (the last ``joined``);
* ``first_step``: the first worker starts its first training step (``training``: joined, its data loaded,
  the parameters pulled).

The launcher is then interrupted (SIGINT), which stops the job. Each phase is the median over ``--runs``
runs (each with its spread). ``--help`` of each daemon entry point (``python -m hmp.nodes.main ROLE --help``,
``bin/hmp-ps --help``, ``hmp-launch --help``) is timed too, as the median wall time of ``--help-runs``
runs. The figures and their history are in docs/benchmarks.md, "Start-up".

    python bench/startup.py [--json] [--runs N] [--help-runs N] [--config conf/local.toml]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import CpuMeter, cpu_line, free_port, is_quiet, load_average, spread

import hmp  # light: the checkout measured

#: the checkout whose hmp is imported (PYTHONPATH): the launcher runs there, since ``python -m`` (the fork server)
#: puts the working folder first on the import path
HMP_ROOT = Path(hmp.__file__).resolve().parents[1]

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).parent / "hmp-launch"
#: seconds one run may take to reach its first training step before it counts as failed
RUN_TIMEOUT_S = 120.0


def _config(source: Path, folder: Path) -> Path:
    """``source`` with its report folder in ``folder`` and its scheduler on a free loopback port."""
    text = source.read_text()
    text = re.sub(r'(?m)^report_dir\s*=.*$', f'report_dir = "{folder / "run"}"', text, count=1)
    text = re.sub(r'tcp://127\.0\.0\.1:47100', f"tcp://127.0.0.1:{free_port()}", text)
    path = folder / source.name
    path.write_text(text)
    return path


def _stamp(line: str) -> tuple[str, float, dict[str, Any]] | None:
    """``(event, epoch seconds, fields)`` of one JSON log line (None: not one)."""
    try:
        rec = json.loads(line)
        t = datetime.datetime.fromisoformat(rec["timestamp"]).timestamp()
        return rec["event"], t, rec
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _events(path: Path) -> list[tuple[str, float, dict[str, Any]]]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [e for e in map(_stamp, lines) if e is not None]


def one_run(config: Path, folder: Path) -> dict[str, float]:
    """Launch the job, wait for its first training step, interrupt it; each phase in seconds since the launch."""
    cfg = _config(config, folder)
    logs = folder / "run" / "logs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stderr_lines: list[str] = []
    t0 = time.time()
    proc = subprocess.Popen([str(LAUNCH), str(cfg)], cwd=HMP_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    reader = threading.Thread(target=lambda: stderr_lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    phases: dict[str, float] = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while "first_step" not in phases:
            if proc.poll() is not None:
                raise RuntimeError(f"hmp-launch exited with {proc.returncode} before training:\n"
                                   + "".join(stderr_lines[-20:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"no training step within {RUN_TIMEOUT_S} s")
            time.sleep(0.05)
            for event, t, rec in _events(logs / "cpu0.log") + _events(logs / "gpu0.log"):
                if event == "training":
                    phases["first_step"] = min(phases.get("first_step", float("inf")), t - t0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    for event, t, rec in (e for e in map(_stamp, stderr_lines) if e is not None):
        if event == "config_checked":
            phases["launcher"] = t - t0
        elif event == "forkserver_ready":
            phases["forkserver"] = float(rec["at"]) - t0
        elif event == "daemon_started":
            phases[f"forked.{rec['node']}"] = t - t0
    joined = []
    for log in sorted(logs.glob("*.log")):
        node = log.name.split(".")[0]
        for event, t, _ in _events(log):
            if event == "serving":
                phases[f"serving.{node}"] = t - t0
            elif event == "joined":
                joined.append(t - t0)
    if joined:
        phases["joined"] = max(joined)
    return phases


def time_help(cmd: list[str], runs: int) -> dict[str, Any] | None:
    """Wall seconds of ``cmd`` (a ``--help``), over ``runs`` runs; None when it fails."""
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=HMP_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
                              check=False)
        if done.returncode != 0:
            return None
        walls.append(time.perf_counter() - t)
    return spread(walls)


ORDER = ["launcher", "forkserver", "forked.scheduler", "serving.scheduler", "serving.ps0", "serving.ps1",
         "serving.cpu0", "serving.gpu0", "joined", "first_step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print every figure as one JSON object, the last line")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--help-runs", type=int, default=5)
    ap.add_argument("--config", default=str(ROOT / "conf" / "local.toml"))
    args = ap.parse_args()
    load_before = load_average()
    meter = CpuMeter()
    meter.start()
    t_start = time.monotonic()
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="hmp-bench-startup-") as folder:
            runs.append(one_run(Path(args.config).resolve(), Path(folder)))
    names = sorted({k for r in runs for k in r}, key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))
    phases = {k: spread([r[k] for r in runs if k in r]) for k in names}
    bins = Path(sys.executable).parent
    helps = {f"hmp.nodes.main {role} --help": [sys.executable, "-m", "hmp.nodes.main", role, "--help"]
             for role in ("scheduler", "ps", "cpu_worker", "gpu_worker")}
    helps["bin/hmp-ps --help"] = [str(HMP_ROOT / "bin" / "hmp-ps"), "--help"]
    helps["hmp-launch --help"] = [str(bins / "hmp-launch"), "--help"]
    help_s = {name: time_help(cmd, args.help_runs) for name, cmd in helps.items()}
    wall = round(time.monotonic() - t_start, 1)
    cpu = meter.stop()
    res = {"config": args.config, "runs": args.runs, "phases_s": phases,
           "first_step_s": phases.get("first_step", {}).get("median"), "help_s": help_s,
           "loadavg_before_after": [load_before, load_average()], "cpu": cpu, "quiet": is_quiet(cpu),
           "python": sys.version.split()[0]}
    print(f"hmp-launch {args.config}: seconds since the launcher process started (median of {args.runs} runs "
          f"[min .. max])")
    for k, s in phases.items():
        print(f"  {k:<22}{s['median']:7.2f}  [{s['min']:.2f} .. {s['max']:.2f}]  n={s['n']}")
    print("--help, wall seconds (median [min .. max]):")
    for k, s in help_s.items():
        print(f"  {k:<36}" + (f"{s['median']:6.2f}  [{s['min']:.2f} .. {s['max']:.2f}]" if s else "  failed"))
    print(cpu_line(cpu, load_before, load_average(), wall))
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
