"""``hmp-launch --check``: the config (with command-line overrides), the data and the model checked, one forward
pass, a summary and exit 0, or one line naming the key and exit 2; no daemon started either way. A gpu_worker on
CUDA where there is none is refused at once, by --check and by a launch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hmp.launch import main as launch_main
from hmp.models import digits_mlp
from tests.support import digits_job_text

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = str(Path(sys.executable).parent / "hmp-launch")
#: the missing-CUDA job's join_timeout_s: a launch that waited for its GPU worker would take this long; refusing
#: it takes seconds (under a minute on a loaded machine)
JOIN_TIMEOUT_S = 120


def counts_job(tmp: Path) -> Path:
    path = tmp / "job.toml"
    path.write_text(digits_job_text(tmp, name="check", target=0.0, epochs=2) + "\n[cluster]\nps = 1\ncpu_workers = 1\n")
    return path


def run(*args: str, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_check_of_a_good_job_says_what_would_run_and_starts_nothing(tmp_path):
    path = counts_job(tmp_path)
    done = run("--check", str(path), "cluster.cpu_workers=2", "model.args.hidden=[32]")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == f"hmp-launch: {path}: ready to run; checked the config, the data and the model, started no daemon"
    assert "overrides: cluster.cpu_workers=2 model.args.hidden=[32]" in done.stdout
    assert "nodes: 4: scheduler at tcp://127.0.0.1:" in done.stdout and "cpu_worker cpu0 cpu1" in done.stdout
    assert "data: digits: 1437 training and 360 test rows of [64] torch.float32, 10 classes" in done.stdout
    params = sum(p.numel() for p in digits_mlp(hidden=[32]).parameters())
    assert f"model: digits_mlp: {params:,} parameters; a batch of 32 rows gives [32, 10]" in done.stdout
    assert not (tmp_path / "run").exists()  # no daemon, no report folder, no config written


@pytest.mark.parametrize(("override", "key", "words"), [
    ("optimizer.lr=-1", "optimizer.lr", "a number > 0"),
    ("train.epochs=many", "train.epochs", "expected an integer, got str 'many'"),
    ("cluster.cpu_workers=0", "cluster.cpu_workers", "at least one worker"),
    ("model.args.depth=3", "model.args", "depth"),
    ("data.kind=npz", "data.path", "a file path for data.kind = 'npz'"),
])
def test_check_of_a_bad_value_exits_2_naming_the_key_and_the_command_line(tmp_path, override, key, words, capsys,
                                                                         monkeypatch):
    """Called in this process (the command's own main): one line, exit 2, the key and its override named."""
    monkeypatch.setenv("HMP_FORKSERVER", "0")
    path = counts_job(tmp_path)
    code = launch_main(["--check", str(path), override])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"hmp-launch: config error: {path} with {override} from the command line: key '{key}"), \
        lines[0]
    assert words in lines[0]


def test_a_gpu_worker_without_cuda_is_refused_at_once_by_check_and_by_launch(tmp_path, capsys):
    """CUDA hidden (CUDA_VISIBLE_DEVICES=""): a gpu_worker left on its default device is exit 2 naming
    nodes[i].device, from --check and from a launch, before the job's join_timeout_s, with no daemon
    started; the same job with the device set to cpu checks clean."""
    path = counts_job(tmp_path)
    path.write_text(path.read_text().replace("join_timeout_s = 60", f"join_timeout_s = {JOIN_TIMEOUT_S}"))
    assert f"join_timeout_s = {JOIN_TIMEOUT_S}" in path.read_text()
    for args in (["--check", str(path), "cluster.gpu_workers=1"], [str(path), "cluster.gpu_workers=1"]):
        t0 = time.monotonic()
        done = run(*args, timeout_s=JOIN_TIMEOUT_S + 30, CUDA_VISIBLE_DEVICES="")
        took = time.monotonic() - t0
        assert done.returncode == 2, (args, done.stderr[-3000:])
        assert f"hmp-launch: config error: {path} with cluster.gpu_workers=1 from the command line: key " \
               "'nodes[3].device'" in done.stderr, done.stderr
        assert "torch.cuda.is_available() is false" in done.stderr and "cluster.gpu_device=cpu" in done.stderr
        assert took < JOIN_TIMEOUT_S, took  # it did not wait for a worker that never came
        assert not (tmp_path / "run").exists(), args
    code = launch_main(["--check", str(path), "cluster.gpu_workers=1", "cluster.gpu_device=cpu"])
    out = capsys.readouterr()
    assert code == 0 and "gpu_worker gpu0 (cpu)" in out.out, out.err[-3000:]
