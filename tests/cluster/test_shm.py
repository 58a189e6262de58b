"""Shared memory between peers on one host (hmp/transport/shm.py, docs/shm.md).

The codec's shared-memory references (round trips, malformed and fuzzed references), arenas and
reply slots, endpoint pairs that agree on shared memory or fall back to frames, pushes through real
shard daemons over shared memory against the TCP path, and the segments' lifetime: removed at a
normal exit, left by a SIGKILL and then removed by ``cleanup_stale`` and by the launcher.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hmp.errors import ProtocolError, RemoteError
from hmp.messages import Ack, Kind, ShmHello, Tensors
from hmp.nodes.forkserver import ForkedProcess, ForkServer
from hmp.transport import shm
from hmp.transport.codec import DTYPES, decode, encode
from hmp.transport import Client, Server

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def job():
    """A job name of this test's own; afterwards none of its segments may be left."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    shm.close_process_arena()
    gc.collect()
    shm.cleanup_stale(name)
    left = shm.list_segments(name)
    assert not left, f"segments left behind: {left}"


@pytest.fixture
def arenas(job):
    made: list[shm.Arena] = []

    def make(owner: str, **kw) -> shm.Arena:
        a = shm.Arena(job, owner, shm.ShmSettings(**kw))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


class FakeSegments:
    """A resolver over in-memory 'segments' (the codec's view of shared memory, without files)."""

    def __init__(self) -> None:
        self.segs: dict[str, bytearray] = {}
        self.calls: list[tuple[str, int, int, int]] = []

    def __call__(self, segment, offset, nbytes, slot):
        self.calls.append((segment, offset, nbytes, slot))
        buf = self.segs.get(segment)
        if buf is None or offset + nbytes > len(buf):
            raise ProtocolError("no such range", "bad_shm")
        return memoryview(buf)[offset:offset + nbytes]


# ----------------------------------------------------------------------------- codec

def test_codec_round_trips_tensors_by_reference_and_inline_side_by_side():
    fake = FakeSegments()
    tensors = [torch.arange(12, dtype=d).reshape(3, 4) if d is not torch.bool else torch.ones(3, 4, dtype=d)
               for d in DTYPES.values()]
    big = torch.randn(1000)

    def locate(t):
        if t.numel() < 1000:
            return None  # inline
        name = f"seg{len(fake.segs)}"
        fake.segs[name] = bytearray(64) + bytearray(t.numpy().tobytes())
        return [name, 64, 7]

    msg = Tensors(name="x", tensors=(*tensors, big), step=3)
    frames = encode(msg, locate=locate)
    assert len(frames) == 1 + len(tensors)  # the big one carries no frame
    got = decode(frames, resolve=fake)
    assert got == msg
    assert fake.calls == [("seg0", 64, 4000, 7)]
    with pytest.raises(ProtocolError) as info:
        decode(frames)  # a reference without shared memory agreed
    assert info.value.code == "bad_shm"


def _shm_frames(ref, dtype="float32", shape=(4,), frames=0, extra=None):
    import msgpack

    desc = {"field": "tensors", "dtype": dtype, "shape": list(shape), "frames": frames, "shm": ref}
    if extra:
        desc.update(extra)
    header = {"version": 1, "kind": "tensors", "sender": "", "rid": 5, "fields": {"name": "x"}, "tensors": [desc]}
    return [msgpack.packb(header, use_bin_type=True)]


@pytest.mark.parametrize("ref, code", [
    (["seg", 0, 0], None),
    ("seg", "bad_shm"), (["seg", 0], "bad_shm"), (["seg", -4, 0], "bad_shm"), (["seg", 0, -1], "bad_shm"),
    ([1, 0, 0], "bad_shm"), (["seg", 1.5, 0], "bad_shm"), (["seg", True, 0], "bad_shm"), (["seg", 2, 0], "bad_shm"),
    (["seg", 0, 0, 0], "bad_shm"), (["nope", 0, 0], "bad_shm"), (["seg", 60, 0], "bad_shm"), (None, "bad_shm"),
])
def test_malformed_references_are_protocol_errors(ref, code):
    fake = FakeSegments()
    fake.segs["seg"] = bytearray(64)
    frames = _shm_frames(ref)
    if code is None:
        assert decode(frames, resolve=fake).tensors[0].shape == (4,)
        return
    with pytest.raises(ProtocolError) as info:
        decode(frames, resolve=fake)
    assert info.value.code == code


def test_references_with_frames_or_of_empty_tensors_are_refused():
    fake = FakeSegments()
    fake.segs["seg"] = bytearray(64)
    for frames, code in ((_shm_frames(["seg", 0, 0], frames=1) + [b"x" * 16], "bad_shm"),
                         (_shm_frames(["seg", 0, 0], shape=(0,)), "bad_shm"),
                         (_shm_frames(["seg", 0, 0], extra={"other": 1}), "malformed")):
        with pytest.raises(ProtocolError) as info:
            decode(frames, resolve=fake)
        assert info.value.code == code


def test_a_resolver_returning_the_wrong_size_or_a_non_buffer_is_refused():
    for bad in (lambda *a: memoryview(bytearray(8)), lambda *a: 42):
        with pytest.raises(ProtocolError):
            decode(_shm_frames(["seg", 0, 0]), resolve=bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ref=st.one_of(st.none(), st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                     st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=20), st.floats(),
                                        st.booleans(), st.none(), st.sampled_from(["seg", "seg"])), max_size=4)),
       dtype=st.sampled_from([*DTYPES, "complex64", ""]),
       shape=st.lists(st.integers(-2, 2**40), max_size=3), nframes=st.integers(-1, 2))
def test_fuzzed_references_raise_only_protocol_errors(ref, dtype, shape, nframes):
    fake = FakeSegments()
    fake.segs["seg"] = bytearray(256)
    try:
        decode(_shm_frames(ref, dtype, shape, nframes), resolve=fake)
    except ProtocolError:
        pass


# ----------------------------------------------------------------------------- arenas

def test_alloc_locate_and_a_peer_mapping(arenas):
    a = arenas("owner")
    t = a.alloc(1000, torch.float64)
    assert t.shape == (1000,) and t.dtype == torch.float64 and not t.any()
    name, off = a.locate(t[10:20])
    assert name.startswith(a.prefix + ".") and off == 80
    assert a.locate(torch.zeros(4)) is None
    t[10:20] = 7.0
    view = shm.map_peer(a.directory, a.prefix, name, off, 80)
    assert not view.flags.writeable
    assert np.frombuffer(view, dtype=np.float64).tolist() == [7.0] * 10
    assert shm.verify_probe(a.directory, a.probe, a.token)
    assert not shm.verify_probe(a.directory, a.probe, "0" * 32)
    with pytest.raises(ProtocolError):
        shm.map_peer(a.directory, "hmp.other.x.1", name, 0, 8)  # not that peer's segment
    with pytest.raises(ProtocolError):
        shm.map_peer(a.directory, a.prefix, name, 8192 - 72, 80)  # beyond the (page-rounded) segment
    assert a.free(t)
    assert name not in shm.list_segments(a.job)


def test_reply_slots_are_lent_until_local_views_die_and_peers_release(arenas):
    a = arenas("srv", min_bytes=1024, segment_bytes=1 << 16, reply_pool_bytes=1 << 17)
    src = [torch.randn(2000), torch.randn(100)]
    copies = a.reply_copies(src)
    assert all(torch.equal(c, s) for c, s in zip(copies, src))
    ref = a.reply_ref(copies[0])
    assert ref is not None and ref[2] > 0
    assert a.reply_ref(copies[1]) is None  # under min_bytes: inline
    assert a.reply_ref(a.alloc(4096)) is None  # not a reply slot
    a.hold([ref[2], ref[2]], "peer")  # two tensors named the slot
    del copies
    gc.collect()
    assert a.stats()["slots_lent"] == 1  # the peer still reads it
    assert a.release([ref[2]], "peer") == 0
    assert a.release([ref[2], 12345], "someone") == 2  # not theirs: ignored
    assert a.stats()["slots_lent"] == 1
    a.release([ref[2]], "peer")
    assert a.stats()["slots_lent"] == 0
    assert a.reply_copies([torch.zeros(10)]) is None  # small: the caller clones
    held = [a.reply_copies([torch.zeros(16000)]) for _ in range(2)]  # 2 x 64 KB: the whole pool
    assert all(h is not None for h in held)
    assert a.reply_copies([torch.zeros(16000)]) is None  # full: the caller clones, nothing waits
    del held
    gc.collect()
    assert a.reply_copies([torch.zeros(16000)]) is not None


def test_slots_of_a_peer_that_died_are_reclaimed(arenas, job):
    a = arenas("srv", min_bytes=1024, segment_bytes=1 << 16, reply_pool_bytes=1 << 16)
    dead = _child_arena(job, "w9", kill=True)  # its probe is left behind, unlocked
    copies = a.reply_copies([torch.zeros(16000)])
    slot = a.reply_ref(copies[0])[2]
    a.hold([slot], dead)
    del copies
    gc.collect()
    assert a.reply_copies([torch.zeros(16000)]) is not None  # reclaimed from the dead peer
    shm.cleanup_stale(job)


def _child_arena(job: str, owner: str, kill: bool, extra: str = "") -> str:
    """A process that opens an arena (and allocates), then is SIGKILLed or exits; returns its prefix."""
    code = textwrap.dedent(f"""
        import sys, time, torch
        from hmp.transport import shm
        a = shm.open_process_arena({job!r}, {owner!r})
        t = a.alloc(1 << 16)
        {extra}
        print(a.prefix, flush=True)
        if {kill}:
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        prefix = p.stdout.readline().strip()
        assert prefix.startswith(f"hmp.{job}.{owner}."), prefix
        if kill:
            p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return prefix


def test_segments_are_gone_after_a_normal_exit_and_cleaned_up_after_a_kill(job, arenas):
    _child_arena(job, "calm", kill=False)
    assert not shm.list_segments(job)  # removed at exit
    prefix = _child_arena(job, "killed", kill=True)
    left = shm.list_segments(job)
    assert left and all(n.startswith(prefix) for n in left)  # a SIGKILL leaves them ...
    live = arenas("alive")
    live.alloc(10)
    removed = shm.cleanup_stale(job)  # ... until the launcher or the next start removes them
    assert sorted(removed) == left
    assert all(n.startswith(live.prefix) for n in shm.list_segments(job))  # a live owner's stay


# ----------------------------------------------------------------------------- endpoints

async def _echo_in_slots(msg, peer, arena):
    copies = arena.reply_copies(msg.tensors) if arena is not None else None
    return Tensors(name="r", tensors=copies if copies is not None else tuple(t.clone() for t in msg.tensors))


async def test_a_same_host_pair_sends_headers_only_and_returns_slots(arenas):
    srv_arena, cli_arena = arenas("srv"), arenas("cli")

    async def handler(msg, peer):
        return await _echo_in_slots(msg, peer, srv_arena)

    async with Server("tcp://127.0.0.1:0", {Kind.TENSORS: handler}, shm=srv_arena) as server:
        async with Client(server.address, shm=cli_arena, timeout_s=10) as client:
            x = cli_arena.alloc(1 << 20)
            x.uniform_()
            small = torch.arange(10.0)
            reply = await client.request(Tensors(name="x", tensors=(x, small)))
            assert client.shm_active
            assert torch.equal(reply.tensors[0], x) and torch.equal(reply.tensors[1], small)
            assert client.stats["shm_bytes_out"] == 4 << 20 and client.stats["bytes_out"] == 40
            assert server.stats["shm_bytes_out"] == 4 << 20 and server.stats["bytes_out"] == 40
            assert srv_arena.stats()["slots_remote"] == 1
            del reply
            for _ in range(100):  # the release is one-way: wait until it has arrived
                await asyncio.sleep(0.01)
                if srv_arena.stats()["slots_lent"] == 0:
                    break
            assert srv_arena.stats()["slots_lent"] == 0
            # not arena memory: frames as ever
            y = torch.randn(1 << 16)
            assert torch.equal((await client.request(Tensors(name="y", tensors=(y,)))).tensors[0], y)


async def test_peers_without_shared_memory_still_work(arenas):
    cli_arena = arenas("cli")
    x = cli_arena.alloc(1 << 18)
    x.normal_()

    async def plain(msg, peer):
        return Tensors(name="r", tensors=tuple(t.clone() for t in msg.tensors))

    # a server that offers none, and one that does not know the handshake at all
    for shm_opt, internal in ((False, True), (None, False)):
        async with Server("tcp://127.0.0.1:0", {Kind.TENSORS: plain}, shm=shm_opt) as server:
            if not internal:
                server._internal = {}  # an implementation without shared memory: unknown_op
            async with Client(server.address, shm=cli_arena, timeout_s=10) as client:
                for _ in range(2):
                    reply = await client.request(Tensors(name="x", tensors=(x,)))
                    assert torch.equal(reply.tensors[0], x)
                assert not client.shm_active and client.stats["shm_bytes_out"] == 0


async def test_a_server_that_opens_its_arena_later_is_asked_again(job, arenas, monkeypatch):
    from hmp.transport import shm_link

    monkeypatch.setattr(shm_link, "RETRY_S", 0.2)
    cli_arena = arenas("cli")
    x = cli_arena.alloc(1 << 16)

    async def handler(msg, peer):
        return Ack()

    async with Server("tcp://127.0.0.1:0", {Kind.TENSORS: handler}) as server:  # the process arena: none yet
        async with Client(server.address, shm=cli_arena, timeout_s=10) as client:
            await client.request(Tensors(name="x", tensors=(x,)))
            assert not client.shm_active  # the server offers none (yet)
            assert shm.open_process_arena(job, "srv") is not None
            await client.request(Tensors(name="x", tensors=(x,)))
            assert not client.shm_active  # not asked again so soon
            await asyncio.sleep(0.3)
            await client.request(Tensors(name="x", tensors=(x,)))
            assert client.shm_active and client.stats["shm_bytes_out"] == 1 << 18


async def test_another_host_is_never_offered_shared_memory(arenas):
    srv_arena = arenas("srv")
    other = arenas("other")
    async with Server("tcp://127.0.0.1:0", {}, shm=srv_arena) as server:
        async with Client(server.address, shm=False, timeout_s=10) as client:
            reply = await client.request(ShmHello(host="elsewhere|boot|net:1|dev:1", segment=other.probe,
                                                  token=other.token))
            assert isinstance(reply, ShmHello) and not reply.mapped
            reply = await client.request(ShmHello(host=shm.host_id(), segment=other.probe, token="f" * 32))
            assert not reply.mapped  # a wrong token: the probe was not read
            # references from a connection that has no agreement are refused, whatever they name
            with pytest.raises(RemoteError) as info:
                await client._request(Tensors(name="x", tensors=(other.alloc(1 << 16),)), 5.0, other.request_ref)
            assert info.value.code == "bad_shm"


async def test_a_server_that_lost_the_agreement_gets_the_request_again_inline(arenas):
    srv_arena, cli_arena = arenas("srv"), arenas("cli")
    seen = []

    async def handler(msg, peer):
        seen.append(msg.tensors[0].sum().item())
        return Ack()

    async with Server("tcp://127.0.0.1:0", {Kind.TENSORS: handler}, shm=srv_arena) as server:
        async with Client(server.address, shm=cli_arena, timeout_s=10) as client:
            x = cli_arena.alloc(1 << 16)
            x.fill_(1.0)
            await client.request(Tensors(name="x", tensors=(x,)))
            server._shm.peers.clear()  # as if the server had restarted
            await client.request(Tensors(name="x", tensors=(x,)))  # refused (bad_shm), then sent inline
            assert not client.shm_active and server.stats["errors"] == 1
            await client.request(Tensors(name="x", tensors=(x,)))  # shakes hands again
            assert client.shm_active
    assert seen == [float(1 << 16)] * 3


async def test_the_process_arena_is_used_once_a_request_carries_its_memory(job):
    arena = shm.open_process_arena(job, "proc")
    assert shm.open_process_arena(job, "other") is arena

    async def handler(msg, peer):
        return Ack()

    async with Server("tcp://127.0.0.1:0", {Kind.TENSORS: handler}) as server:
        async with Client(server.address, timeout_s=10) as client:
            await client.request(Tensors(name="x", tensors=(torch.zeros(1 << 16),)))
            assert client._shm.state == "new"  # nothing in the arena yet: no handshake
            await client.request(Tensors(name="x", tensors=(arena.alloc(1 << 16),)))
            assert client.shm_active and client.stats["shm_bytes_out"] == 1 << 18


@pytest.mark.parametrize("size", [3, 4], ids=["ring", "halving"])
async def test_a_rings_one_way_pieces_travel_by_reference(job, size):
    """Three ring members (four: halving-doubling) whose tensors lie in the process arena: after
    the first requests shook hands, every piece, one-way ones included (Client.send(lend=True)),
    goes as a reference, and the sums are right op after op (the sender's memory is read only
    before it is written again)."""
    from hmp.collective import Ring, RingHost

    arena = shm.open_process_arena(job, "ring")
    n = 3 * (1 << 16) + 5
    hosts = [RingHost(timeout_s=10) for _ in range(size)]
    servers = [Server("tcp://127.0.0.1:0", {Kind.RING: h.on_piece}, name=f"m{r}") for r, h in enumerate(hosts)]
    rings: list[Ring] = []
    ts: list[torch.Tensor] = []
    try:
        addresses = [await srv.start() for srv in servers]
        for r in range(size):
            ring = Ring(rank=r, addresses=addresses, generation=1, name=f"m{r}", piece_bytes=1 << 16, small_bytes=0,
                        timeout_s=10)
            await ring.connect()
            hosts[r].install(ring)
            rings.append(ring)
        ts += [arena.alloc(n, torch.float32) for _ in range(size)]
        for op in range(3):
            for r, t in enumerate(ts):
                t.copy_(torch.arange(n, dtype=torch.float32) * (r + 1) + op)
            inline = sum(srv.stats["bytes_in"] for srv in servers)
            await asyncio.wait_for(asyncio.gather(*(rings[r].all_reduce(ts[r], op) for r in range(size))), 30)
            assert rings[0].stats["halving_ops" if size == 4 else "ring_ops"] == op + 1
            want = torch.arange(n, dtype=torch.float32) * (size * (size + 1) // 2) + size * op
            for r, t in enumerate(ts):
                assert torch.equal(t, want), f"op {op} member {r}"
            if op > 0:  # handshakes done: no piece's bytes travel inline
                assert sum(srv.stats["bytes_in"] for srv in servers) - inline < n, op
    finally:
        for ring in rings:
            await ring.close()
        for srv in servers:
            await srv.close()


# ----------------------------------------------------------------------------- the PS data path, real daemons

def _ps_config(tmp: Path, job: str, shm_enabled: bool) -> Path:
    text = f"""
[job]
name = "{job}"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end
join_timeout_s = 120

[model]
name = "deep_mlp"
args = {{ in_features = 255, width = 1, depth = 0, classes = 256 }}

[data]
kind = "digits"

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9

[train]
consistency = "async"

[ps]
chunk_bytes = 65536
checkpoint_dir = "{tmp / 'ckpt'}"

[shm]
enabled = {str(shm_enabled).lower()}
min_bytes = 4096
"""
    nodes = [("scheduler", "scheduler"), ("ps0", "ps"), ("ps1", "ps"), ("w0", "cpu_worker")]
    for nid, role in nodes:
        text += f'\n[[nodes]]\nid = "{nid}"\nrole = "{role}"\nbind = "tcp://127.0.0.1:{free_port()}"\n'
    path = tmp / f"{job}.toml"
    path.write_text(text)
    return path


async def _start_daemons(cfg_path: Path, log_dir: Path) -> dict[str, ForkedProcess]:
    """The scheduler and two shards, forked as LocalCluster forks them (hmp/nodes/forkserver.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ForkServer.shared()
    return {nid: await server.spawn([role, "--config", str(cfg_path), "--id", nid], env=dict(os.environ),
                                    log=str(log_dir / f"{nid}.log"), cwd=str(ROOT))
            for role, nid in (("scheduler", "scheduler"), ("ps", "ps0"), ("ps", "ps1"))}


async def _stop(procs: dict[str, ForkedProcess]) -> None:
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            await asyncio.wait_for(p.wait(), 20)
        except TimeoutError:
            p.kill()
            await p.wait()


@pytest.mark.slow
async def test_pushes_through_real_shards_over_shared_memory_equal_the_tcp_path(tmp_path, job):
    """Shards with shared memory serve a client on this host over it and another client over TCP; the
    parameters each client writes equal a local replay of the same pushes. A shard stopped by
    SIGTERM removes its segments; one killed by SIGKILL leaves them to cleanup_stale."""
    from hmp.client import PSClient
    from hmp.job import load, sharded_model
    from hmp.ps.optim import chunk_optimizer_of
    from hmp.ps.shard_core import ShardCore

    cfg = load(_ps_config(tmp_path, job, shm_enabled=True))
    procs = await _start_daemons(cfg.path, tmp_path / "logs")
    shards = [(s.id, s.bind) for s in cfg.shards]
    try:
        fast = PSClient.from_config(cfg, shards, name="w0")
        slow = PSClient(sharded_model(cfg), shards, name="tcp", cfg=cfg, shm=False)
        assert fast.arena is not None and slow.arena is None
        assert all(fast.arena.locate(g) is not None for g in fast.sharded.flat.grads.values())
        ref_model = sharded_model(cfg)
        refs = [ShardCore(s.id, ref_model.initial_chunks(i), *chunk_optimizer_of(cfg), "async")
                for i, s in enumerate(cfg.shards)]
        async with fast, slow:
            for _ in range(600):  # the shards start meanwhile
                try:
                    await fast.pull()
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            await slow.pull()
            gen = torch.Generator().manual_seed(1)
            for step, ps in enumerate((fast, slow, fast, fast, slow)):
                grads = ps.sharded.flat.grads
                for g in grads.values():
                    g.copy_(torch.randn(g.shape, generator=gen) * 0.01)
                for i, (_, _, keys) in enumerate(ps.shards):
                    views = ps.sharded.grad_views()
                    refs[i].apply("x", keys, [views[k] for k in keys], 1)
                await ps.push(samples=1)
                for i, (_, _, keys) in enumerate(ps.shards):
                    mine = ps.sharded.param_views()
                    for k in keys:
                        assert torch.equal(mine[k], refs[i].chunks[k].param), (step, k)
            assert all(c.shm_active for _, c, _ in fast.shards)
            assert all(not c.shm_active for _, c, _ in slow.shards)
            assert sum(c.stats["shm_bytes_out"] for _, c, _ in fast.shards) > 0
            assert sum(c.stats["bytes_out"] for _, c, _ in fast.shards) < 4096  # headers only
        owners = {nid: [n for n in shm.list_segments(job) if f".{nid}." in n] for nid in ("ps0", "ps1")}
        assert all(len(v) >= 2 for v in owners.values()), owners  # probe + reply pool each
        procs["ps1"].send_signal(signal.SIGKILL)
        procs["ps0"].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(procs["ps0"].wait(), 30) == 0
        await asyncio.wait_for(procs["ps1"].wait(), 30)
        left = shm.list_segments(job)
        assert not any(".ps0." in n for n in left)  # removed at its exit
        assert sorted(n for n in left if ".ps1." in n) == sorted(owners["ps1"])  # a SIGKILL leaves them
        removed = shm.cleanup_stale(job)
        assert sorted(removed) == sorted(owners["ps1"])
    finally:
        await _stop(procs)
        shm.close_process_arena()


@pytest.mark.slow
async def test_a_shard_without_shared_memory_serves_a_client_with_it(tmp_path, job):
    from hmp.client import PSClient
    from hmp.job import load

    cfg = load(_ps_config(tmp_path, job, shm_enabled=False))
    procs = await _start_daemons(cfg.path, tmp_path / "logs")
    try:
        ps = PSClient.from_config(cfg.replace(shm=type(cfg.shm)(enabled=True)), [(s.id, s.bind) for s in cfg.shards],
                                  name="w0")
        assert ps.arena is not None
        async with ps:
            for _ in range(600):
                try:
                    await ps.pull()
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            before = ps.version
            assert await ps.push(samples=1) > before
            assert not any(c.shm_active for _, c, _ in ps.shards)
    finally:
        await _stop(procs)
        shm.close_process_arena()
    assert not shm.list_segments(job)


@pytest.mark.slow
async def test_the_launcher_removes_a_killed_daemons_segments(tmp_path, job):
    """A sync job on LocalCluster uses shared memory; a shard SIGKILLed mid-run fails the job, and
    leaving the cluster removes every segment of the job."""
    from hmp.cluster import JobFailed, LocalCluster
    from hmp.job import load

    from tests.support import write_config

    path = write_config(tmp_path, consistency="sync", target=0.99, epochs=50, max_seconds=60)
    path.write_text(path.read_text().replace('name = "test"', f'name = "{job}"') + "\n[shm]\nmin_bytes = 4096\n")
    cfg = load(path)  # 16 KiB chunks: under the default min_bytes
    async with LocalCluster(cfg) as cluster:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until ps0 lends reply slots: workers push over shm
            if len([n for n in shm.list_segments(job) if ".ps0." in n]) >= 2:
                break
            await asyncio.sleep(0.2)
        assert [n for n in shm.list_segments(job) if ".ps0." in n][1:], "ps0 never used shared memory"
        cluster.kill("ps0")
        with pytest.raises(JobFailed):
            await cluster.train(timeout_s=60)
    assert not shm.list_segments(job)
    logs = "".join((tmp_path / "run" / "logs" / f"{w}.log").read_text() for w in ("cpu0", "gpu0"))
    assert "shm_on" in logs
