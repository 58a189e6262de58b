"""Shard checkpoints that survive: a checksum verified on load, the previous checkpoint kept and used when
the last one is damaged, a failed write that changes nothing, checkpoints by time, a final checkpoint on
every way out; the scheduler's drop on a shard; and the config errors found at load (unwritable folders,
a shard's share over the message limit), through the daemons and hmp-launch.

The file format (hmp.ps.checkpoint, through ShardCore's save and resume) is tested directly; the rest runs real shard daemons: in this process
(``PSShardNode.run()``, a real server on loopback, shared memory off so nothing is left in /dev/shm) or
as processes (``python -m hmp.nodes.main``, ``python -m hmp.launch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from hmp.errors import RemoteError
from hmp.job import load
from hmp.messages import Ack, Drop, Pull, Push
from hmp.nodes.ps_shard import PSShardNode
from hmp.ps import checkpoint
from hmp.ps.checkpoint import CheckpointError, previous_checkpoint
from hmp.ps.shard_core import ShardCore
from hmp.transport.endpoint import Client

from tests.support import HB_JOB, Daemons, client_of, daemon_env, running, shard_grads, shard_job_config, until

ROOT = Path(__file__).resolve().parents[2]


def _core(seed: float = 0.0) -> ShardCore:
    chunks = {0: torch.arange(64, dtype=torch.float32) / 7 + seed, 3: torch.linspace(-1, 1, 33)}
    core = ShardCore("ps0", chunks, "adam", {"lr": 0.01})
    core.add_worker("w")
    return core


def _push(core: ShardCore, times: int) -> None:
    for i in range(times):
        core.apply("w", (0, 3), (torch.full((64,), 0.5 + i), torch.full((33,), -1.0)), samples=16)


def _flip_16_bytes_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip 16 bytes in the middle of ``tensor``'s data inside the checkpoint file."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.numpy().tobytes())
    assert at > 0, "the tensor's bytes are stored as they are"
    middle = at + tensor.numel() * tensor.element_size() // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def _damage(path: Path, how: str, tensor: torch.Tensor) -> None:
    if how == "corrupted":
        _flip_16_bytes_of(path, tensor)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    else:
        path.write_bytes(b"")


# ----------------------------------------------------------------------------- the format (core)

@pytest.mark.parametrize(("how", "says"), [("corrupted", "corrupted: the payload's SHA-256 differs"),
                                           ("truncated", "truncated: the header announces"),
                                           ("empty", "empty file")])
def test_a_damaged_checkpoint_is_a_one_line_error_and_the_previous_one_restores_exactly(tmp_path, how, says):
    """Corrupted (16 flipped bytes in tensor data), truncated and empty files are refused naming the file;
    resume() falls back to the checkpoint before, which restores its values, counters and optimizer state."""
    path = tmp_path / "ps0.pt"
    core = _core()
    _push(core, 2)
    core.save(path)
    good = {k: c.param.clone() for k, c in core.chunks.items()}
    _push(core, 3)
    core.save(path)  # the first checkpoint is now ps0.prev.pt
    assert previous_checkpoint(path) == tmp_path / "ps0.prev.pt"
    assert checkpoint.read(previous_checkpoint(path))["version"] == 2 and checkpoint.read(path)["version"] == 5
    _damage(path, how, core.chunks[0].param)

    with pytest.raises(CheckpointError) as info:
        checkpoint.read(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and says in message and "\n" not in message

    resumed = _core(seed=100.0)  # other starting values: only the checkpoint can make them equal
    used, passed_over = resumed.resume(path)
    assert used == previous_checkpoint(path) and [e.path for e in passed_over] == [path]
    for k, want in good.items():
        assert torch.equal(resumed.chunks[k].param, want)
    assert (resumed.version, resumed.updates_applied, resumed.samples) == (2, 2, 32)
    _push(resumed, 1)  # Adam's moments came back too: the same next step as the original's after 2 pushes
    again = _core()
    _push(again, 2)
    _push(again, 1)
    assert torch.equal(resumed.chunks[0].param, again.chunks[0].param)


def test_flipped_tensor_bytes_would_load_silently_without_the_checksum(tmp_path):
    """Why the checksum: the damaged payload is still a valid torch file, with other parameter values."""
    path = tmp_path / "ps0.pt"
    core = _core()
    _push(core, 1)
    core.save(path)
    _flip_16_bytes_of(path, core.chunks[0].param)
    import io

    from hmp.ps.checkpoint import CHECKPOINT_HEADER
    state = torch.load(io.BytesIO(path.read_bytes()[CHECKPOINT_HEADER.size:]), weights_only=True)
    assert not torch.equal(state["params"][0], core.chunks[0].param)
    with pytest.raises(CheckpointError, match="corrupted"):
        checkpoint.read(path)


def test_without_a_usable_checkpoint_resume_names_both_files(tmp_path):
    path = tmp_path / "ps0.pt"
    core = _core()
    core.save(path)
    path.write_bytes(path.read_bytes()[:10])
    with pytest.raises(CheckpointError) as info:
        _core().resume(path)
    message = str(info.value)
    assert "\n" not in message and f"{path}: truncated" in message
    assert f"{previous_checkpoint(path)}: no such file" in message


def test_a_checkpoint_records_what_a_report_needs(tmp_path):
    core = _core()
    _push(core, 4)
    before = time.time()
    core.save(tmp_path / "ps0.pt")
    state = checkpoint.read(tmp_path / "ps0.pt")
    assert (state["version"], state["updates_applied"], state["samples"]) == (4, 4, 64)
    assert before <= state["written_at"] <= time.time()


# ----------------------------------------------------------------------------- the daemon, in this process


def _version_on_disk(path: Path) -> int | None:
    try:
        return checkpoint.read(path)["version"]
    except CheckpointError:
        return None


async def test_checkpoint_every_s_writes_checkpoints_during_a_run(tmp_path):
    """With updates and then none, the shard is checkpointed within checkpoint_every_s, the one before is
    kept as .prev; without new updates nothing is written again."""
    node = PSShardNode(load(shard_job_config(tmp_path, ps="checkpoint_every_s = 0.3")), "ps0")
    path = node.checkpoint_path
    keys, grads = shard_grads(node)
    async with running(node), client_of(node, "cpu0") as cpu:
        assert (await cpu.request(Push(keys=keys, grads=grads))).version == 1
        await until(lambda: _version_on_disk(path) == 1, what="a checkpoint of version 1")
        for _ in range(2):
            await cpu.request(Push(keys=keys, grads=grads))
        await until(lambda: _version_on_disk(path) == 3, what="a checkpoint of version 3")
        # 2 under a slow loop: the timer may have ticked between the two pushes
        assert _version_on_disk(previous_checkpoint(path)) in (1, 2)
        await asyncio.sleep(0.3)  # the write that renamed the file is counted just after its rename
        written = node.stats["checkpoints"]
        assert written in (2, 3)
        await asyncio.sleep(0.8)  # over two intervals without updates
        assert node.stats["checkpoints"] == written
    assert not list(path.parent.glob("*.tmp"))


@contextlib.contextmanager
def _small_tmpfs(folder: Path, size: str = "1m"):
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (a full disk)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


async def test_a_failed_write_keeps_the_previous_checkpoint_and_the_shard_serving(tmp_path):
    """Disk full during a checkpoint: an error naming the file and the OS error, the previous checkpoint
    intact, no temp file left, pushes still applied; once there is room again the next write succeeds."""
    with _small_tmpfs(tmp_path / "ckpt") as folder, capture_logs() as logs:
        node = PSShardNode(load(shard_job_config(tmp_path, ps="checkpoint_every_s = 0.2")), "ps0")
        path = node.checkpoint_path
        assert path.parent == folder
        keys, grads = shard_grads(node)
        async with running(node), client_of(node, "cpu0") as cpu:
            await cpu.request(Push(keys=keys, grads=grads))
            await until(lambda: _version_on_disk(path) == 1, what="the first checkpoint")
            good = path.read_bytes()
            free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
            filler = folder / "filler"
            with open(filler, "wb") as f:
                f.write(b"\0" * (free - 8192))
            assert (await cpu.request(Push(keys=keys, grads=grads))).version == 2
            await until(lambda: node.stats["checkpoint_failures"] >= 1, what="a failed write")
            assert path.read_bytes() == good and not list(folder.glob("*.tmp"))
            assert (await cpu.request(Push(keys=keys, grads=grads))).version == 3  # still serving
            filler.unlink()
            await until(lambda: _version_on_disk(path) == 3, what="a checkpoint once there is room")
            assert _version_on_disk(previous_checkpoint(path)) == 1
    failed = [e for e in logs if e["event"] == "checkpoint_failed"]
    assert failed and failed[0]["path"] == str(path) and "No space left on device" in failed[0]["error"]
    assert failed[0]["log_level"] == "error"


async def test_drop_completes_a_waiting_sync_round_and_only_the_scheduler_may_send_it(tmp_path):
    """Sync: cpu0's push waits for gpu0; a drop from anyone but the scheduler is refused (unauthorized) and
    changes nothing; the scheduler's completes the round at once; gpu0 pushing again is counted again."""
    node = PSShardNode(load(shard_job_config(tmp_path, consistency="sync")), "ps0")
    keys, grads = shard_grads(node)
    async with running(node), client_of(node, "cpu0") as cpu, client_of(node, "gpu0") as gpu, \
            client_of(node, "scheduler") as scheduler:
        waiting = asyncio.create_task(cpu.request(Push(keys=keys, grads=grads)))
        await asyncio.sleep(0.2)
        with pytest.raises(RemoteError) as info:
            await cpu.request(Drop(node="gpu0", reason="stranger"))
        assert info.value.code == "unauthorized"
        await asyncio.sleep(0.1)
        assert not waiting.done() and node.core.live_workers == {"cpu0", "gpu0"}
        t0 = time.monotonic()
        assert isinstance(await scheduler.request(Drop(node="gpu0", reason="lost")), Ack)
        assert (await asyncio.wait_for(waiting, 2)).version == 1 and time.monotonic() - t0 < 1
        assert node.core.live_workers == {"cpu0"} and node.stats["drops"] == 1
        # gpu0 comes back: its push now waits for cpu0's, and one round of both follows
        back = asyncio.create_task(gpu.request(Push(keys=keys, grads=grads)))
        await asyncio.sleep(0.2)
        assert not back.done() and node.core.live_workers == {"cpu0", "gpu0"}
        again = await cpu.request(Push(keys=keys, grads=grads))
        assert again.version == 2 and (await asyncio.wait_for(back, 2)).version == 2


@pytest.mark.parametrize("consistency", ["sync", "ssp"])
async def test_a_stop_answers_a_waiting_push_at_once(tmp_path, consistency):
    """A push waiting for a sync round or the SSP bound gets a `shutting_down` error when the shard stops (a
    worker then stops rather than fails), not at request_timeout_s."""
    node = PSShardNode(load(shard_job_config(tmp_path, consistency=consistency, extra_train="staleness = 0")), "ps0")
    keys, grads = shard_grads(node)
    async with running(node) as run, client_of(node, "cpu0") as cpu:
        if consistency == "ssp":  # one ahead of gpu0 already: the next push waits for the bound
            await cpu.request(Push(keys=keys, grads=grads))
        waiting = asyncio.create_task(cpu.request(Push(keys=keys, grads=grads)))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        t0 = time.monotonic()
        node.stopping.set()
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(waiting, 5)
        assert info.value.code == "shutting_down" and time.monotonic() - t0 < 2
        assert await asyncio.wait_for(asyncio.shield(run), 10) == 0


async def test_a_shard_that_loses_its_scheduler_writes_a_final_checkpoint(tmp_path):
    """The scheduler is killed: within 3 heartbeat intervals the shard declares it lost, writes a final
    checkpoint holding every applied update, and exits 1."""
    cfg_path = shard_job_config(tmp_path)  # checkpoint_every_s = 30: only the final checkpoint can be there
    with Daemons(cfg_path, tmp_path) as daemons:  # the scheduler, stopped on the way out whatever happens
        scheduler = daemons.start("scheduler", "scheduler")
        node = PSShardNode(load(cfg_path), "ps0")
        keys, grads = shard_grads(node)
        task = asyncio.create_task(node.run())
        try:
            await until(lambda: node.welcome is not None, 30, "the shard joins the scheduler")
            async with client_of(node, "cpu0") as cpu:
                for _ in range(3):
                    await cpu.request(Push(keys=keys, grads=grads))
            assert not node.checkpoint_path.exists()
            scheduler.kill()
            await until(lambda: node.failed is not None, 3 * HB_JOB + 2, "the scheduler declared lost")
            assert "scheduler lost" in node.failed
            assert await asyncio.wait_for(asyncio.shield(task), 15) == 1
            assert _version_on_disk(node.checkpoint_path) == 3
        finally:
            node.stopping.set()
            await asyncio.wait_for(task, 15)


# ----------------------------------------------------------------------------- daemons and hmp-launch as processes

def _run(args: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], env=daemon_env(), capture_output=True, text=True,
                          timeout=timeout_s)


async def test_resume_falls_back_to_the_previous_checkpoint_and_fails_without_one(tmp_path):
    """hmp-ps --resume: a corrupted checkpoint is logged (one line naming it) and the previous one is served;
    with no usable checkpoint the daemon exits 2 with one line naming both files."""
    cfg_path = shard_job_config(tmp_path)
    cfg = load(cfg_path)
    writer = PSShardNode(cfg, "ps0")
    path = writer.checkpoint_path
    keys, grads = shard_grads(writer, 0.5)
    writer.core.apply("cpu0", keys, grads, 16)
    writer.core.save(path)
    good = {k: c.param.clone() for k, c in writer.core.chunks.items()}
    writer.core.apply("cpu0", keys, grads, 16)
    writer.core.save(path)
    _flip_16_bytes_of(path, writer.core.chunks[keys[0]].param)

    cmd = [sys.executable, "-m", "hmp.nodes.main", "ps", "--config", str(cfg_path), "--id", "ps0", "--resume",
           "--log-format", "json"]
    proc = subprocess.Popen(cmd, env=daemon_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        async with contextlib.AsyncExitStack() as stack:
            client = Client(cfg.node("ps0").bind, name="checker", timeout_s=2)
            await client.connect()
            stack.push_async_callback(client.close)
            for _ in range(100):
                try:
                    reply = await client.request(Pull(keys=keys))
                    break
                except Exception:
                    assert proc.poll() is None, proc.communicate()
                    await asyncio.sleep(0.2)
            assert reply.version == 1
            for k, v in zip(keys, reply.values, strict=True):
                assert torch.equal(v, good[k])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    events = [json.loads(line) for line in (out + err).splitlines() if line.startswith("{")]
    unusable = [e for e in events if e["event"] == "checkpoint_unusable"]
    fallback = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert unusable and unusable[0]["path"] == str(path) and "corrupted" in unusable[0]["error"]
    assert fallback and fallback[0]["using"] == str(previous_checkpoint(path))
    assert fallback[0]["instead_of"] == str(path)

    previous_checkpoint(path).unlink()
    done = _run(["hmp.nodes.main", "ps", "--config", str(cfg_path), "--id", "ps0", "--resume"])
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config error" in lines[0] and "--resume" in lines[0], done.stderr
    assert f"{path}: corrupted" in lines[0] and f"{previous_checkpoint(path)}: no such file" in lines[0]


@pytest.mark.parametrize("case", ["report_dir_is_under_a_file", "shard_share_over_max_message_bytes"])
def test_load_time_errors_exit_2_through_hmp_launch_with_one_line(tmp_path, case):
    """hmp-launch refuses before any daemon starts: exit 2, one line naming the file, the key and the fix."""
    (tmp_path / "a-file").write_text("not a folder")
    cfg_path = shard_job_config(tmp_path)
    text = cfg_path.read_text()
    if case == "report_dir_is_under_a_file":
        text = text.replace(f'report_dir = "{tmp_path / "run"}"', f'report_dir = "{tmp_path / "a-file" / "run"}"')
        key, says = "job.report_dir", f"{tmp_path / 'a-file'} is a file, so {tmp_path / 'a-file' / 'run'} cannot"
    else:
        text += "\n[limits]\nmax_message_bytes = 4096\n"
        key, says = "limits.max_message_bytes", "raise limits.max_message_bytes to at least"
    cfg_path.write_text(text)
    done = _run(["hmp.launch", str(cfg_path), "--timeout", "30"])
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"hmp-launch: config error: {cfg_path}: key '{key}'") and says in lines[0]
    assert not (tmp_path / "run" / "logs").exists()  # no daemon was started


def test_an_unwritable_checkpoint_dir_stops_a_shard_at_load(tmp_path):
    """Each daemon checks at load too: a shard started by hand exits 2 with one line naming the key."""
    (tmp_path / "a-file").write_text("not a folder")
    cfg_path = shard_job_config(tmp_path)
    cfg_path.write_text(cfg_path.read_text().replace(f'checkpoint_dir = "{tmp_path / "ckpt"}"',
                                                     f'checkpoint_dir = "{tmp_path / "a-file" / "ckpt"}"'))
    shard = _run(["hmp.nodes.main", "ps", "--config", str(cfg_path), "--id", "ps0"])
    lines = [line for line in shard.stderr.splitlines() if line.strip()]
    assert shard.returncode == 2 and len(lines) == 1, shard.stderr
    assert f"{cfg_path}: key 'ps.checkpoint_dir'" in lines[0] and f"{tmp_path / 'a-file'} is a file" in lines[0]
