"""How a launcher learns a daemon's address from the daemon itself (hmp/nodes/main.py): ``--ready-file`` gets
``{"address", "pid"}`` once it serves (the Ray engine's actors read it), and ``python -m hmp.nodes.main -`` takes
its arguments as one JSON line on stdin (what the Ray engine's keeper starts before the arguments are known)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time


from tests.support import write_config


def test_a_daemon_writes_the_address_it_bound_to_its_ready_file(tmp_path):
    cfg = write_config(tmp_path)  # ps0 binds tcp://127.0.0.1:0: the OS picks the port
    ready, log = tmp_path / "ready.json", tmp_path / "ps0.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hmp.nodes.main", "-"], stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        proc.stdin.write((json.dumps(["ps", "--config", str(cfg), "--id", "ps0", "--ready-file", str(ready)])
                          + "\n").encode())
        proc.stdin.close()
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid
        assert info["address"].startswith("tcp://127.0.0.1:") and int(info["address"].rsplit(":", 1)[1]) > 0
        serving = [json.loads(line) for line in log.read_text().splitlines() if '"event": "serving"' in line]
        assert serving[0]["address"] == info["address"]  # what it logs is what it reported
        assert not list(tmp_path.glob("ready.json.*"))  # written whole (a temporary file, renamed)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_arguments_on_stdin_exits_0_without_starting():
    """The actor went away before it knew what to run: the daemon's process ends quietly."""
    done = subprocess.run([sys.executable, "-m", "hmp.nodes.main", "-"], input=b"", capture_output=True, timeout=120)
    assert done.returncode == 0 and done.stdout == b"" and done.stderr == b""
