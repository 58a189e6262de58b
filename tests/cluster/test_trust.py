"""Trust: job tokens, who may send what, two jobs on one port, CURVE, and logs under attack (docs/security.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from hmp.cluster import JobFailed, LocalCluster
from hmp.errors import RemoteError
from hmp.job import load
from hmp.messages import Ack, Heartbeat, Shutdown, Status
from hmp.nodes.forkserver import ForkServer
from hmp.transport.endpoint import Client, Server

from tests.support import curve_keys, write_config

TOKEN = "a" * 32


@contextlib.asynccontextmanager
async def _daemon(role: str, config: Path, node_id: str, token: str = TOKEN, log: Path | None = None):
    """One daemon, forked from the test process's fork server as ``python -m hmp.nodes.main`` would run it;
    stopped with SIGTERM (then waited for) however the test ends."""
    proc = await ForkServer.shared().spawn(
        [role, "--config", str(config), "--id", node_id, "--log-format", "json"],
        env={**os.environ, "HMP_JOB_TOKEN": token}, log=str(log or config.parent / f"{node_id}.log"))
    try:
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _until_serving(address: str, token: str = TOKEN, timeout_s: float = 30.0) -> dict:
    """The daemon's status once it answers (asked as the launcher may)."""
    deadline = time.monotonic() + timeout_s
    async with Client(address, name="launcher", job_token=token, timeout_s=2) as c:
        while True:
            try:
                reply = await c.request(Status(), timeout_s=1.0)
                assert isinstance(reply, Status)
                return reply.state
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def test_a_strangers_shutdown_is_refused_and_the_shard_keeps_serving(tmp_path):
    """A shutdown without the job token, with another job's token, or with the token but from a worker's id is
    refused `unauthorized` (naming the sender, never echoing a token); the shard keeps serving; the scheduler's
    own shutdown stops it (exit 0)."""
    path = write_config(tmp_path, fixed_ps_ports=True)
    cfg = load(path)
    address = cfg.node("ps0").bind
    async with _daemon("ps", path, "ps0") as proc:
        await _until_serving(address)
        cases = [("scheduler", ""), ("scheduler", "b" * 32), ("cpu0", TOKEN), ("intruder", TOKEN)]
        for sender, token in cases:
            async with Client(address, name=sender, job_token=token, timeout_s=5) as c:
                with pytest.raises(RemoteError) as info:
                    await c.request(Shutdown(reason="bye"))
            assert info.value.code == "unauthorized", (sender, token)
            assert repr(sender) in info.value.remote_message
            assert TOKEN not in info.value.remote_message and "b" * 32 not in info.value.remote_message
        async with Client(address, name="intruder", job_token=TOKEN, timeout_s=5) as c:
            with pytest.raises(RemoteError) as info:
                await c.request(Status())  # the job's state is for its nodes and its launcher only
            assert info.value.code == "unauthorized"
        state = await _until_serving(address)
        assert state["id"] == "ps0" and proc.returncode is None
        async with Client(address, name="scheduler", job_token=TOKEN, timeout_s=5) as c:
            reply = await c.request(Shutdown(reason="job over"))
        assert isinstance(reply, Ack)
        assert await asyncio.wait_for(proc.wait(), 15) == 0


async def test_an_address_in_use_is_one_line_and_exit_2(tmp_path):
    """A daemon whose bind address another process holds exits 2 with one line naming the node and the address."""
    path = write_config(tmp_path, fixed_ps_ports=True)
    address = load(path).node("ps0").bind
    log = tmp_path / "ps0-second.log"
    async with Server(address, {}, name="squatter"):
        async with _daemon("ps", path, "ps0", log=log) as proc:
            code = await asyncio.wait_for(proc.wait(), 30)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert code == 2, lines
    errors = [line for line in lines if "already in use" in line]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    assert errors[0].startswith("hmp-ps ps0: config error:") and address in errors[0], errors


async def test_two_jobs_on_one_port_the_second_fails_fast_and_the_first_completes(tmp_path):
    """A second job on the first one's ports: its scheduler and shards cannot bind (exit 2), its workers are refused
    by the first job's scheduler (another token) and stop at once; the first job goes on and ends cleanly."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    path = write_config(first_dir, fixed_ps_ports=True, target=1.0, epochs=1000, max_seconds=90)
    (second_dir / "job.toml").write_text(path.read_text().replace(str(first_dir), str(second_dir)))
    async with LocalCluster(load(path)) as first:
        await _until_serving(first.cfg.scheduler.bind, first.job_token)
        t0 = time.monotonic()
        async with LocalCluster(load(second_dir / "job.toml")) as second:
            assert second.job_token != first.job_token
            with pytest.raises(JobFailed):
                await second.wait(timeout_s=30)
            failed_in = time.monotonic() - t0
        assert failed_in < 15, failed_in
        logs = "".join(p.read_text() for p in (second_dir / "run" / "logs").glob("*.log"))
        assert "already in use" in logs
        # A worker of the second job (its token) dials the first job's scheduler: refused, it stops at once
        # (not after join_timeout_s = 60 s of retries), saying why in one line.
        t0 = time.monotonic()
        log = second_dir / "cpu0-alone.log"
        async with _daemon("cpu_worker", second_dir / "job.toml", "cpu0", token="b" * 32, log=log) as worker:
            code = await asyncio.wait_for(worker.wait(), 30)
        refused = [line for line in log.read_text().splitlines() if "refused the join" in line]
        assert code == 1 and time.monotonic() - t0 < 15, log.read_text()
        assert refused and "Is another job using these ports?" in refused[0] and "b" * 32 not in log.read_text()
        state = await first.status()
        assert state is not None and all(state["members"][n] in ("live", "suspect") for n in ("ps0", "ps1")), state
        await first.finish("the test is done")
        report = await first.train(timeout_s=60)  # raises JobFailed if any of its daemons exited non-zero
    assert report["final"]["best_reported_accuracy"] >= 0.5


async def test_a_job_with_curve_on_trains_to_its_target_and_refuses_a_wrong_key(tmp_path):
    """[security] curve = true: every daemon serves and dials with its keys, and the job reaches its target; a
    client with a key the job never issued fails within the handshake timeout, and the shard keeps serving."""
    from hmp.keygen import main as keygen
    from hmp.transport.security import Curve, HandshakeFailed

    path = write_config(tmp_path, fixed_ps_ports=True, target=0.9)
    path.write_text(path.read_text() + '\n[security]\ncurve = true\nkey_dir = "keys"\nhandshake_timeout_s = 1.0\n')
    assert keygen([str(tmp_path / "keys"), "--config", str(path)]) == 0
    other = curve_keys(tmp_path / "other", "cpu0")
    cfg = load(path)
    ps0 = cfg.node("ps0").bind
    async with LocalCluster(cfg) as cluster:
        launcher = Curve.load(tmp_path / "keys", "launcher", serve=False, handshake_timeout_s=1.0)
        stranger = Curve.load(other, "cpu0", serve=False, handshake_timeout_s=1.0)
        stranger = Curve(stranger.key_dir, "cpu0", stranger.public, stranger.secret, launcher.server_public, None,
                         {}, 1.0)
        t0 = time.monotonic()
        async with Client(ps0, name="cpu0", security=stranger, job_token=cluster.job_token, timeout_s=30) as c:
            with pytest.raises(HandshakeFailed):
                while True:  # until the shard is up: before that there is nothing to shake hands with
                    try:
                        await c.request(Heartbeat(), timeout_s=0.5)
                    except HandshakeFailed:
                        raise
                    except Exception:
                        await asyncio.sleep(0.1)
        assert time.monotonic() - t0 < 30
        async with Client(ps0, name="launcher", security=launcher, job_token=cluster.job_token, timeout_s=10) as c:
            state = (await c.request(Status())).state
        assert state["id"] == "ps0"
        report = await cluster.train(timeout_s=120)
    assert report["final"]["best_reported_accuracy"] >= 0.9
    logs = (tmp_path / "run" / "logs" / "ps0.log").read_text()
    assert "curve_refused" in logs and stranger.public.decode() in logs


async def test_keygen_and_missing_keys_are_clear_errors(tmp_path, capsys):
    """hmp-keygen writes server, launcher and one keypair per name (secrets 0600), keeps existing files, refuses a
    bad name (exit 2); a daemon whose key file is missing exits 2 with one line naming the file."""
    from hmp.keygen import main as keygen

    keys = tmp_path / "keys"
    assert keygen([str(keys), "--nodes", "ps0", "cpu0"]) == 0
    assert {p.name for p in keys.iterdir()} == {f"{n}.{ext}" for n in ("server", "launcher", "ps0", "cpu0")
                                                for ext in ("key", "key_secret")}
    assert all(p.stat().st_mode & 0o077 == 0 for p in keys.glob("*.key_secret"))
    before = (keys / "ps0.key").read_bytes()
    assert keygen([str(keys), "--nodes", "ps0"]) == 0 and (keys / "ps0.key").read_bytes() == before
    assert "kept existing" in capsys.readouterr().out
    assert keygen([str(keys), "--nodes", "bad/name"]) == 2
    assert keygen([str(keys), "--nodes", "server"]) == 2
    path = write_config(tmp_path, fixed_ps_ports=True)
    path.write_text(path.read_text() + '\n[security]\ncurve = true\nkey_dir = "keys"\n')
    (keys / "ps1.key_secret").unlink(missing_ok=True)  # ps1 never got keys
    log = tmp_path / "ps1.log"
    async with _daemon("ps", path, "ps1", log=log) as proc:
        code = await asyncio.wait_for(proc.wait(), 30)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert "security.key_dir" in lines[0] and str(keys / "ps1.key_secret") in lines[0], lines


CURVE_SECTION = '\n[security]\ncurve = true\nkey_dir = "keys"\nhandshake_timeout_s = 1.0\n'


async def _status_until(cluster: LocalCluster, ok, timeout_s: float = 90.0) -> dict:
    """The cluster's status (LocalCluster.status(), the launcher's own socket) once ``ok(state)``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await cluster.status()
        if state and ok(state):
            return state
        await asyncio.sleep(0.2)
    pytest.fail(f"LocalCluster.status() did not show the job going within {timeout_s} s")


def _updates(state: dict, worker: str = "cpu0") -> int:
    return state.get("workers", {}).get(worker, {}).get("updates", 0)


async def test_with_curve_the_launcher_and_an_api_client_reach_the_job(tmp_path):
    """[security] curve = true: LocalCluster.status() answers during the job and finish() ends it with a report
    (the launcher's key); a PSClient with its own client key (PSClient.from_config reads it from key_dir) pulls
    the shards' parameters; one with a key the job never issued, or with another job's keys, fails with
    HandshakeFailed within the handshake timeout."""
    from hmp.client import PSClient
    from hmp.job import sharded_model
    from hmp.keygen import main as keygen
    from hmp.transport.security import Curve, HandshakeFailed

    path = write_config(tmp_path, fixed_ps_ports=True, target=1.0, epochs=1000, max_seconds=90, workers="cpu")
    path.write_text(path.read_text() + CURVE_SECTION)
    keys = tmp_path / "keys"
    assert keygen([str(keys), "--config", str(path), "--client", "api"]) == 0
    other_job = curve_keys(tmp_path / "other-job", "api")
    unissued = curve_keys(tmp_path / "unissued", "api")
    (unissued / "server.key").write_bytes((keys / "server.key").read_bytes())  # the job's server, not its key
    cfg = load(path)
    shards = [(s.id, s.bind) for s in cfg.shards]
    async with LocalCluster(cfg) as cluster:
        await _status_until(cluster, lambda st: _updates(st) > 0)
        async with PSClient.from_config(cluster.cfg, shards, name="api") as ps:
            await ps.pull()
        assert ps.version > 0  # the workers' updates, read over CURVE
        for folder in (unissued, other_job):
            wrong = PSClient(sharded_model(cfg), shards, name="api", cfg=cluster.cfg, shm=False,
                             security=Curve.load(folder, "api", serve=False, handshake_timeout_s=1.0))
            t0 = time.monotonic()
            async with wrong:
                with pytest.raises(HandshakeFailed) as failed:
                    await wrong.pull()
            assert time.monotonic() - t0 < 1.0 + 1.5, folder
            assert "CURVE handshake" in str(failed.value) and any(a in str(failed.value) for _, a in shards)
        assert _updates(await _status_until(cluster, lambda st: True)) > 0  # still serving the launcher
        await cluster.finish("the test is done")
        report = await cluster.train(timeout_s=60)
    assert "the test is done" in report["final"]["stop_reason"]
    assert all(p.returncode == 0 for p in cluster.procs.values())


async def test_with_curve_status_and_finish_reach_a_scheduler_on_an_emulated_host(tmp_path):
    """CURVE on emulated hosts, with a key_dir relative to the config: the daemons (reading the derived config in
    a temporary folder) find their keys, and status() and finish() go through the relay with the launcher's key."""
    from hmp.emulate import EmulationUnavailable
    from hmp.keygen import main as keygen

    hosts = tmp_path / "hosts.toml"
    hosts.write_text("[network]\nsubnet = '10.231.31.0/24'\n" + "".join(
        f"\n[[hosts]]\nname = '{n}'\nbandwidth_mbit = 1000\ndelay_ms = 0.0\n" for n in ("a", "b")))
    path = write_config(tmp_path, target=1.0, epochs=1000, max_seconds=90, workers="cpu")
    text = path.read_text() + CURVE_SECTION
    for nid, host in (("scheduler", "a"), ("ps0", "a"), ("ps1", "b"), ("cpu0", "b")):
        text = text.replace(f'id = "{nid}"\n', f'id = "{nid}"\nhost = "{host}"\n')
    path.write_text(text)
    assert keygen([str(tmp_path / "keys"), "--config", str(path)]) == 0
    cluster = LocalCluster(load(path), hosts=hosts, grace_s=5)
    try:
        async with cluster:
            await _status_until(cluster, lambda st: _updates(st) > 3, timeout_s=120)
            await cluster.finish("the test is done", timeout_s=10.0)
            report = await cluster.train(timeout_s=60)
    except EmulationUnavailable as exc:
        pytest.skip(f"no emulated hosts here: {exc}")
    assert "the test is done" in report["final"]["stop_reason"]
    assert all(p.returncode == 0 for p in cluster.procs.values())
    assert '"curve": true' in (tmp_path / "run" / "logs" / "ps1.log").read_text()
