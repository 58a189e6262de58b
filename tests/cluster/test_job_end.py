"""However a job ends once training has begun, hmp-launch leaves its report and model with a status saying how
(--timeout, Ctrl-C, a diverging model), a failure is one line naming the daemon, the cause and a hint, and a
worker that cannot start fails the job at once (or the job goes on without it) instead of after join_timeout_s."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import write_config

pytestmark = pytest.mark.timeout(120)


def _launch(cfg: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hmp.launch", str(cfg), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def _report(tmp: Path) -> dict:
    return json.loads((tmp / "run" / "report.json").read_text())


def _wait_for_training(tmp: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    log = tmp / "run" / "logs" / "cpu0.log"
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and '"event": "training"' in log.read_text(errors="replace")):
        assert proc.poll() is None, f"hmp-launch exited with {proc.returncode} before training"
        assert time.monotonic() < deadline, "cpu0 did not start training"
        time.sleep(0.1)


def test_timeout_writes_the_report_and_the_model_with_status_timeout(tmp_path):
    cfg = write_config(tmp_path, target=0.999, epochs=500)
    proc = _launch(cfg, "--timeout", "8")
    code, out, err = _finish(proc)
    assert code == 1, out + err
    assert "timeout: the job ran longer than --timeout 8 s" in err
    assert f"job token in {tmp_path / 'run' / 'job.token'}" in out and "scheduler at tcp://127.0.0.1:" in out
    final = _report(tmp_path)["final"]
    assert final["status"] == "timeout" and final["model"], final
    assert (tmp_path / "run" / "model.pt").stat().st_size > 1000
    assert "status timeout" in err and "model.pt" in err
    assert not (tmp_path / "run" / "job.token").exists()  # removed with the job


def test_ctrl_c_writes_the_report_and_the_model_with_status_interrupted(tmp_path):
    cfg = write_config(tmp_path, target=0.999, epochs=500)
    proc = _launch(cfg)
    try:
        _wait_for_training(tmp_path, proc)
        proc.send_signal(signal.SIGINT)
        code, out, err = _finish(proc, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130, out + err
    final = _report(tmp_path)["final"]
    assert final["status"] == "interrupted" and final["model"] and "test_accuracy" in final, final
    assert (tmp_path / "run" / "model.pt").exists()
    assert "interrupted; every daemon stopped" in err and "status interrupted" in err


def test_a_diverging_job_fails_in_one_line_with_a_hint_and_still_reports(tmp_path):
    cfg = write_config(tmp_path, epochs=500, optimizer='name = "sgd"\nlr = 1e6\nmomentum = 0.9')
    code, out, err = _finish(_launch(cfg))
    assert code == 1, out + err
    line = next(ln for ln in err.splitlines() if ln.startswith("hmp-launch: job failed: "))
    assert line.split(": ", 2)[2].split(" ")[0] in ("cpu0", "gpu0"), line
    assert "non_finite" in line and "hint: the model diverged: lower the learning rate" in line, line
    final = _report(tmp_path)["final"]
    assert final["status"] == "failed" and "workers remain" in final["stop_reason"], final


# A CUDA device on a machine without CUDA: hmp-launch refuses it before any daemon starts (tests/cluster/test_check.py);
# through the API (LocalCluster, like daemons started by hand or on other hosts) the worker itself finds it out.
async def test_a_worker_with_an_unusable_device_fails_the_job_at_once(tmp_path):
    """min_workers = 2: the job cannot go on without it, and says so within seconds, not after join_timeout_s."""
    from hmp.cluster import JobFailed, LocalCluster

    cfg = write_config(tmp_path, extra_train="min_workers = 2")
    cfg.write_text(cfg.read_text().replace('device = "cpu"', 'device = "cuda:7"'))  # gpu0; no CUDA here
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as info:
        async with LocalCluster(cfg, grace_s=5) as cluster:
            await cluster.train(timeout_s=60)
    took = time.monotonic() - t0
    assert took < 30, f"{took:.1f} s: waited for join_timeout_s (60 s)?"
    assert "gpu0" in info.value.cause and "CUDA" in info.value.cause, info.value.cause
    report = tmp_path / "run" / "report.json"  # written only if cpu0 began training before gpu0's failure arrived
    assert not report.exists() or json.loads(report.read_text())["final"]["status"] == "failed"


async def test_a_worker_with_an_unusable_device_is_left_out_when_min_workers_allow(tmp_path):
    from hmp.cluster import LocalCluster

    cfg = write_config(tmp_path, target=0.9, epochs=3)
    cfg.write_text(cfg.read_text().replace('device = "cpu"', 'device = "cuda:7"'))
    async with LocalCluster(cfg, grace_s=5) as cluster:
        report = await cluster.train(timeout_s=60)
    assert report["final"]["status"] == "completed"
    assert [(e["node"], e["event"]) for e in report["membership"]] == [("gpu0", "failed")]
    assert "cannot start" in report["membership"][0]["why"]
    assert report["workers"]["cpu0"]["updates"] > 0
