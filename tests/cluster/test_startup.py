"""Starting and reaching a job: daemons name themselves in ps, entry points answer --help without importing torch,
bin/ runs without an activated venv, and hmp-submit neither waits long for a manager that is not there nor
misses the end of one that stops."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hmp.cluster import LocalCluster
from hmp.manager.service import JobManager

from tests.support import free_port, until, write_config

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


async def test_each_daemon_names_its_role_and_id_in_ps(tmp_path):
    cfg = write_config(tmp_path, target=0.999, epochs=500)
    async with LocalCluster(cfg) as cluster:
        await until(lambda: all((tmp_path / "run" / "logs" / f"{n}.log").exists()
                                and '"event": "serving"' in (tmp_path / "run" / "logs" / f"{n}.log").read_text()
                                for n in cluster.procs), 60, "every daemon serves")
        shown = {nid: subprocess.run(["ps", "-o", "comm=,args=", "-p", str(p.pid)], capture_output=True,
                                     text=True).stdout.strip() for nid, p in cluster.procs.items()}
    for nid, role in (("scheduler", "scheduler"), ("ps0", "ps"), ("cpu0", "cpu-worker"), ("gpu0", "gpu-worker")):
        comm, args = shown[nid].split(None, 1)
        assert comm == f"hmp:{nid}", shown[nid]
        assert args.startswith(f"hmp-{role} {nid} --config"), shown[nid]


def test_entry_points_import_neither_torch_nor_zmq_before_parsing_arguments():
    """--help of a daemon or hmp-launch answers at once: torch, numpy and zmq come only after the arguments."""
    probe = ("import sys; import hmp.nodes.main, hmp.launch, hmp.manager.cli; "
             "print([m for m in ('torch', 'numpy', 'zmq', 'structlog') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    t0 = time.monotonic()
    helped = subprocess.run([sys.executable, "-m", "hmp.nodes.main", "ps", "--help"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert helped.returncode == 0 and "--resume" in helped.stdout, helped.stderr
    assert time.monotonic() - t0 < 5


def test_bin_wrappers_run_without_an_activated_venv():
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = "/usr/bin:/bin"
    if not (ROOT / ".venv" / "bin" / "python").exists():  # a checkout without its own venv (a worktree)
        env["HMP_PYTHON"] = sys.executable
    for name in ("hmp-ps", "hmp-launch", "hmp-keygen", "hmp-submit"):
        out = subprocess.run([str(ROOT / "bin" / name), "--help"], capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 0, (name, out.stderr)
        assert out.stdout.startswith(f"usage: {name}"), (name, out.stdout)


def test_hmp_submit_says_at_once_that_no_manager_listens():
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "import sys; from hmp.manager.cli import submit_main; "
                          "sys.exit(submit_main())", str(ROOT / "conf" / "jobs" / "digits_small.toml"),
                          "--manager", f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 1, out.stderr
    assert "no job manager at tcp://127.0.0.1:" in out.stderr
    assert time.monotonic() - t0 < 10  # was the 30 s request timeout


async def test_hmp_submit_wait_sees_its_job_stopped_when_the_manager_stops(tmp_path):
    job = tmp_path / "long.toml"
    job.write_text((ROOT / "conf" / "jobs" / "digits_small.toml").read_text()
                   .replace("epochs = 5 ", "epochs = 500 ").replace("target_accuracy = 0.95", "target_accuracy = 0.999"))
    address = f"tcp://127.0.0.1:{free_port()}"
    manager = JobManager(None, "fifo", run_dir=tmp_path / "jobs", bind=address, port_base=free_port(),
                         overrides={"train": {"max_seconds": 60}})
    async with manager:
        submit = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; from hmp.manager.cli import submit_main; sys.exit(submit_main())",
            str(job), "--manager", address, "--wait", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=ROOT)
        try:
            await until(lambda: any(r.status == "running" for r in manager.results.values()), 60, "the job runs")
            await manager.stop()
            out, err = await asyncio.wait_for(submit.communicate(), 15)
        finally:
            if submit.returncode is None:
                submit.kill()
                await submit.wait()
    assert submit.returncode == 1, err.decode()
    result = json.loads(out.decode().split("\n", 1)[1])
    assert result["status"] == "stopped", result


def test_the_connect_line_hmp_launch_prints_reaches_the_running_job(tmp_path):
    """The line `hmp-launch` prints (scheduler address, token file) is what the README's hmp.connect example needs."""
    cfg = write_config(tmp_path, target=0.999, epochs=500)
    launcher = subprocess.Popen([sys.executable, "-m", "hmp.launch", str(cfg)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while "await hmp.connect(" not in line:
            line = launcher.stdout.readline()
            assert line, "hmp-launch ended without printing how to reach the job"
        expr = line[line.index("await hmp.connect("):].strip()
        client = (f"import asyncio\nimport hmp\n\n\nasync def main():\n    async with {expr} as ps:\n"
                  f"        await ps.pull()\n        print(sum(p.numel() for p in ps.model.parameters()))\n\n\n"
                  f"asyncio.run(main())\n")
        out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stderr[-3000:]
        assert int(out.stdout.strip().splitlines()[-1]) > 1000  # the digits MLP's parameters, pulled from the shards
    finally:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
        launcher.stdout.close()


def test_readme_cluster_mode_snippet_runs_as_written(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    example = next(b for b in blocks if "JobManager" in b)
    script = tmp_path / "cluster_mode.py"
    script.write_text(example.replace('emulate=False)', f'emulate=False, run_dir={str(tmp_path / "jobs")!r})'))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("j1 done "), out.stdout  # after the log lines
