"""Shared memory between the processes of one host: arenas of segments, peers' segments, clean-up.

When two endpoints run on the same host, a tensor in a shared-memory segment travels as a reference
in the message header and the receiver reads it in place, so ZeroMQ carries only the header. This
module owns that memory: the segments a process allocates and lends as reply slots, the peers'
segments it maps read-only, the host identity, and the clean-up of segments a killed process left
behind; :mod:`hmp.transport.shm_link` decides, per peer, when to use it. See docs/shm.md and
docs/protocol.md, "Shared memory". It imports neither ZeroMQ nor the endpoint.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import fcntl
import functools
import itertools
import mmap
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from hmp.errors import ProtocolError

DEFAULT_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE
ALIGN = 64  #: slot blocks start on cache lines
PROBE_BYTES = PAGE
TOKEN_CHARS = 32
#: hmp.<job>.<owner>.<tag>.<n>; job and owner as :func:`_clean` makes them
NAME_RE = re.compile(r"^hmp\.([A-Za-z0-9_-]{1,40})\.([A-Za-z0-9_-]{1,40})\.([0-9]{1,10}(?:x[0-9]{1,4})?)\.([0-9]{1,9})$")
_TEMP = ".hmp-new."  #: a segment being created (locked, sized, then linked to its name)
_RECLAIM_EVERY_S = 1.0

log = structlog.get_logger("hmp.transport.shm")


@dataclasses.dataclass(frozen=True, slots=True)
class ShmSettings:
    """Shared-memory settings (config ``[shm]``)."""

    enabled: bool = True
    min_bytes: int = 1 << 16  #: smaller tensors travel inline
    directory: str = DEFAULT_DIR
    reply_pool_bytes: int = 256 << 20  #: at most this much memory lent as reply slots (0: no slots)
    segment_bytes: int = 64 << 20  #: size of each reply-pool segment (a larger reply gets its own)

    @classmethod
    def of(cls, settings: Any) -> ShmSettings:
        """The settings of a job's ``[shm]`` section (any object with these attributes)."""
        return cls(enabled=settings.enabled, min_bytes=settings.min_bytes, directory=settings.dir,
                   reply_pool_bytes=settings.reply_pool_bytes, segment_bytes=settings.segment_bytes)


def _clean(part: str) -> str:
    """A job or owner name as it may appear in a segment name."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(part))[:40] or "_"


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


@functools.cache
def host_id(directory: str = DEFAULT_DIR) -> str:
    """This host's identity for shared memory: host name, boot id, network namespace, and the device
    of ``directory``. Two processes that differ in any of these do not try shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    parts = [socket.gethostname(), boot]
    for label, path in (("net", "/proc/self/ns/net"), ("dev", directory)):
        try:
            st = os.stat(path)
            parts.append(f"{label}:{st.st_dev}:{st.st_ino}" if label == "net" else f"{label}:{st.st_dev}")
        except OSError:
            parts.append(f"{label}:-")
    return "|".join(parts)


def prefix_of(name: str) -> str | None:
    """``hmp.<job>.<owner>.<tag>`` of a segment name: the owning arena; None for a name that is not one."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        return None
    return name.rsplit(".", 1)[0]


# ----------------------------------------------------------------------------- segments

@dataclasses.dataclass(eq=False)
class _Segment:
    name: str
    size: int
    fd: int
    mm: mmap.mmap
    array: np.ndarray  #: uint8 over the whole mapping
    addr: int
    pool: bool = False


def _create(directory: str, name: str, size: int) -> tuple[int, mmap.mmap]:
    """Create segment ``name`` of ``size`` bytes, locked (the owner's mark of life), mapped read-write.

    The file is made under a temporary name, locked and sized first, then linked to its name (which
    fails if the name exists): nobody ever sees an unlocked segment under its final name."""
    tmp = os.path.join(directory, f"{_TEMP}{os.getpid()}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.link(tmp, os.path.join(directory, name))  # FileExistsError: the name is taken
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.unlink(tmp)
    try:
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
        raise


def _remove_files(files: list[tuple[str, int]], pid: int) -> None:
    """The arena's finalizer: unlink and unlock its segments (only in the process that made them:
    a forked child inherits the finalizer, not the segments)."""
    if os.getpid() != pid:
        return
    while files:
        path, fd = files.pop()
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)


def owner_alive(directory: str, name: str) -> bool:
    """Whether the process owning segment ``name`` still runs (it holds the segment's lock)."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge (another user's)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def cleanup_stale(job: str | None = None, directory: str = DEFAULT_DIR) -> list[str]:
    """Remove the hmp segments (of ``job``, or of every job) whose owner has exited; returns their names.

    A segment's owner holds its lock until it exits, so a segment whose lock can be taken is stale,
    whatever became of the owner's pid. Segments of live owners, and other users' files, stay."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    want = None if job is None else f"hmp.{_clean(job)}."
    removed = []
    for name in names:
        if name.startswith(_TEMP):
            pass
        elif not name.startswith("hmp.") or (want is not None and not name.startswith(want)) or not NAME_RE.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        try:  # nobody holds it: its owner is gone (the lock keeps a concurrent creator from racing us)
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        log.info("shm_stale_removed", count=len(removed), job=job, names=removed[:8])
    return removed


def list_segments(job: str | None = None, directory: str = DEFAULT_DIR) -> list[str]:
    """The hmp segment names in ``directory`` (of ``job``, or all), live or stale."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    want = "hmp." if job is None else f"hmp.{_clean(job)}."
    return sorted(n for n in names if n.startswith(want) and NAME_RE.match(n))


# ----------------------------------------------------------------------------- the reply pool

@dataclasses.dataclass(eq=False)
class _Lease:
    id: int
    seg: _Segment
    offset: int
    size: int
    local: bool = True  #: views of it still live in this process
    remote: collections.Counter = dataclasses.field(default_factory=collections.Counter)  #: peer -> references


class _Pool:
    """Reply slots: first-fit blocks of pool segments, lent until local views die and peers release.

    Finalizers only queue a lease id (``_dead``); every operation first settles the queue under the
    lock, so a finalizer that fires in the middle of an operation (any thread, any time) never
    touches the structures."""

    def __init__(self, arena: Arena, limit: int, segment_bytes: int) -> None:
        self.arena, self.limit, self.segment_bytes = arena, limit, max(segment_bytes, PAGE)
        self.lock = threading.Lock()
        self.total = 0
        self.free: dict[_Segment, list[list[int]]] = {}  # segment -> sorted [offset, size] blocks
        self.leases: dict[int, _Lease] = {}
        self.starts: dict[_Segment, list[int]] = {}  # segment -> sorted lease offsets
        self.at: dict[_Segment, dict[int, _Lease]] = {}
        self.ids = itertools.count(1)
        self._dead: collections.deque[int] = collections.deque()
        self._last_reclaim = 0.0

    # all under self.lock
    def _settle(self) -> None:
        while self._dead:
            lease = self.leases.get(self._dead.popleft())
            if lease is not None:
                lease.local = False
                self._maybe_free(lease)

    def _maybe_free(self, lease: _Lease) -> None:
        if lease.local or any(v > 0 for v in lease.remote.values()):
            return
        del self.leases[lease.id]
        seg = lease.seg
        starts = self.starts[seg]
        del starts[bisect.bisect_left(starts, lease.offset)]
        del self.at[seg][lease.offset]
        blocks = self.free[seg]
        i = bisect.bisect_left(blocks, [lease.offset, 0])
        blocks.insert(i, [lease.offset, lease.size])
        if i + 1 < len(blocks) and blocks[i][0] + blocks[i][1] == blocks[i + 1][0]:  # merge with the next
            blocks[i][1] += blocks[i + 1][1]
            del blocks[i + 1]
        if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == blocks[i][0]:  # and with the previous
            blocks[i - 1][1] += blocks[i][1]
            del blocks[i]

    def _fit(self, size: int) -> tuple[_Segment, int] | None:
        for seg, blocks in self.free.items():
            for b in blocks:
                if b[1] >= size:
                    off = b[0]
                    b[0] += size
                    b[1] -= size
                    if b[1] == 0:
                        blocks.remove(b)
                    return seg, off
        return None

    def take(self, nbytes: int) -> tuple[_Lease, np.ndarray] | None:
        size = _round(max(nbytes, 1), ALIGN)
        with self.lock:
            self._settle()
            spot = self._fit(size)
            if spot is None:
                seg_size = _round(max(size, self.segment_bytes), PAGE)
                if self.total + seg_size > self.limit:
                    return None
                seg = self.arena._new_segment(seg_size, pool=True)
                self.total += seg_size
                self.free[seg] = [[0, seg_size]]
                self.starts[seg], self.at[seg] = [], {}
                spot = self._fit(size)
                assert spot is not None
            seg, off = spot
            lease = _Lease(next(self.ids), seg, off, size)
            self.leases[lease.id] = lease
            bisect.insort(self.starts[seg], off)
            self.at[seg][off] = lease
        base = seg.array[off:off + size]
        weakref.finalize(base, self._dead.append, lease.id)  # the last local view is gone
        return lease, base

    def lease_at(self, seg: _Segment, offset: int, nbytes: int) -> _Lease | None:
        with self.lock:
            starts = self.starts.get(seg)
            if not starts:
                return None
            i = bisect.bisect_right(starts, offset) - 1
            if i < 0:
                return None
            lease = self.at[seg][starts[i]]
            return lease if offset + nbytes <= lease.offset + lease.size else None

    def hold(self, ids: Sequence[int], who: str) -> None:
        with self.lock:
            for i in ids:
                lease = self.leases.get(i)
                if lease is not None:
                    lease.remote[who] += 1

    def release(self, ids: Sequence[int], who: str) -> int:
        """Drop one reference of ``who`` per id; returns how many ids it did not hold (ignored)."""
        unknown = 0
        with self.lock:
            self._settle()
            for i in ids:
                lease = self.leases.get(i) if isinstance(i, int) else None
                if lease is None or lease.remote[who] <= 0:
                    unknown += 1
                    continue
                lease.remote[who] -= 1
                if lease.remote[who] == 0:
                    del lease.remote[who]
                self._maybe_free(lease)
        return unknown

    def reclaim(self, force: bool = False) -> int:
        """Drop the references held by peers that have exited (at most once a second unless forced);
        returns how many leases were freed."""
        now = time.monotonic()
        if not force and now - self._last_reclaim < _RECLAIM_EVERY_S:
            return 0
        self._last_reclaim = now
        with self.lock:
            peers = {who for lease in self.leases.values() for who in lease.remote}
        dead = {who for who in peers if not owner_alive(self.arena.directory, f"{who}.0")}
        if not dead:
            return 0
        freed = 0
        with self.lock:
            self._settle()
            for lease in list(self.leases.values()):
                if dead & lease.remote.keys():
                    for who in dead:
                        lease.remote.pop(who, None)
                    self._maybe_free(lease)
                    freed += lease.id not in self.leases
        log.info("shm_slots_reclaimed", peers=sorted(dead), leases=freed)
        return freed

    def stats(self) -> dict[str, int]:
        with self.lock:
            self._settle()
            return {"pool_bytes": self.total, "slots_lent": len(self.leases),
                    "slot_bytes_lent": sum(lease.size for lease in self.leases.values()),
                    "slots_remote": sum(1 for lease in self.leases.values() if lease.remote)}


# ----------------------------------------------------------------------------- arenas

class Arena:
    """The shared-memory segments this process owns (module docstring).

    ``Arena(job, owner, settings)`` creates the probe segment at once (OSError where the directory
    cannot hold segments). Thread-safe. ``close()`` removes every segment (views keep their memory
    until they die); it also happens at garbage collection and interpreter exit.
    """

    def __init__(self, job: str = "job", owner: str = "proc", settings: ShmSettings = ShmSettings()) -> None:
        self.settings = settings
        self.directory = settings.directory
        self.job, self.owner = _clean(job), _clean(owner)
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._files: list[tuple[str, int]] = []  # what the finalizer removes
        self._segments: list[_Segment] = []
        self._index: tuple[tuple[int, ...], tuple[_Segment, ...]] = ((), ())
        self._numbers = itertools.count(1)
        self.closed = False
        self._finalizer = weakref.finalize(self, _remove_files, self._files, self.pid)
        probe = None
        for k in range(64):
            tag = str(self.pid) if k == 0 else f"{self.pid}x{k}"
            try:
                probe = self._add(f"hmp.{self.job}.{self.owner}.{tag}.0", PROBE_BYTES)
                break
            except FileExistsError:
                continue
        if probe is None:
            raise FileExistsError(f"no free segment name for hmp.{self.job}.{self.owner}.{self.pid}")
        self.probe = probe.name
        self.prefix = probe.name[:-2]
        self.token = secrets.token_hex(TOKEN_CHARS // 2)
        probe.array[:TOKEN_CHARS] = np.frombuffer(self.token.encode(), dtype=np.uint8)
        self._pool = _Pool(self, settings.reply_pool_bytes, settings.segment_bytes)

    def __repr__(self) -> str:
        return f"Arena({self.prefix}, {len(self._segments)} segments{', closed' if self.closed else ''})"

    # ---------------------------------------------------------------- segments
    def _add(self, name: str, size: int, pool: bool = False) -> _Segment:
        fd, mm = _create(self.directory, name, size)
        self._files.append((os.path.join(self.directory, name), fd))
        array = np.frombuffer(mm, dtype=np.uint8)
        seg = _Segment(name, size, fd, mm, array, array.ctypes.data, pool)
        self._segments.append(seg)
        order = sorted(self._segments, key=lambda s: s.addr)
        self._index = (tuple(s.addr for s in order), tuple(order))
        return seg

    def _new_segment(self, size: int, pool: bool = False) -> _Segment:
        """A new segment of ``size`` bytes (the caller holds no arena lock, or the pool's)."""
        with self._lock:
            if self.closed:
                raise ValueError(f"{self!r} is closed")
            for _ in range(1000):
                try:
                    return self._add(f"{self.prefix}.{next(self._numbers)}", size, pool)
                except FileExistsError:  # left by a dead process that had our pid: skip the number
                    continue
            raise FileExistsError(f"no free segment number under {self.prefix}")

    def alloc(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D tensor of ``numel`` elements in a segment of its own. Requests carrying it (or
        any view of it of at least ``min_bytes``) send a reference, not the bytes, to peers that can
        map this arena; the memory is lent until the request's reply arrives (module docstring)."""
        nbytes = int(numel) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(0, dtype=dtype)
        seg = self._new_segment(_round(nbytes, PAGE))
        return torch.frombuffer(seg.mm, dtype=dtype, count=int(numel))

    def free(self, tensor: torch.Tensor) -> bool:
        """Remove the ``alloc`` segment holding ``tensor`` (its memory lives on while views of it do).
        Returns False when the tensor is not in one."""
        hit = self._find(tensor)
        if hit is None or hit[0].pool or hit[0].name == self.probe:
            return False
        seg = hit[0]
        with self._lock:
            self._segments.remove(seg)
            order = sorted(self._segments, key=lambda s: s.addr)
            self._index = (tuple(s.addr for s in order), tuple(order))
            path = os.path.join(self.directory, seg.name)
            if (path, seg.fd) in self._files:
                self._files.remove((path, seg.fd))
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        return True

    def _find(self, t: torch.Tensor) -> tuple[_Segment, int] | None:
        if self.closed or t.device.type != "cpu":
            return None
        p = t.data_ptr()
        starts, segs = self._index
        i = bisect.bisect_right(starts, p) - 1
        if i < 0:
            return None
        seg = segs[i]
        off = p - seg.addr
        if off + t.numel() * t.element_size() > seg.size:
            return None
        return seg, off

    def locate(self, t: torch.Tensor) -> tuple[str, int] | None:
        """``(segment, byte offset)`` of a tensor's first element when its bytes lie in this arena."""
        hit = self._find(t)
        return None if hit is None else (hit[0].name, hit[1])

    def request_ref(self, t: torch.Tensor) -> list[Any] | None:
        """The wire reference ``[segment, offset, 0]`` of a contiguous tensor of at least ``min_bytes``
        in this arena (a request lends its memory until the reply), else None."""
        if t.numel() * t.element_size() < self.settings.min_bytes:
            return None
        hit = self._find(t)
        if hit is None or hit[0].name == self.probe:
            return None
        return [hit[0].name, hit[1], 0]

    def reply_ref(self, t: torch.Tensor) -> list[Any] | None:
        """``[segment, offset, slot]`` of a tensor of at least ``min_bytes`` inside a lent reply slot,
        else None (other memory may change after the reply, so it travels inline)."""
        nbytes = t.numel() * t.element_size()
        if nbytes < self.settings.min_bytes:
            return None
        hit = self._find(t)
        if hit is None or not hit[0].pool:
            return None
        lease = self._pool.lease_at(hit[0], hit[1], nbytes)
        return None if lease is None else [hit[0].name, hit[1], lease.id]

    # ---------------------------------------------------------------- reply slots
    def reply_copies(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        """Copies of ``tensors`` in one reply slot (the one copy a reply needs), or None when none is
        worth it (every tensor under ``min_bytes``) or free (the caller copies as before). The slot is
        lent while views of it live here and until each peer it was sent to releases it."""
        if self.closed or not tensors or any(t.device.type != "cpu" for t in tensors):
            return None
        sizes = [t.numel() * t.element_size() for t in tensors]
        if max(sizes) < self.settings.min_bytes:
            return None
        total = sum(_round(s, ALIGN) for s in sizes)
        got = self._pool.take(total)
        if got is None and self._pool.reclaim():
            got = self._pool.take(total)
        if got is None:
            return None
        _, base = got
        whole = torch.from_numpy(base)  # keeps base, and so the lease, alive
        out = []
        pos = 0
        with torch.no_grad():
            for t, n in zip(tensors, sizes):
                v = whole[pos:pos + n].view(t.dtype).view(t.shape)
                v.copy_(t)
                out.append(v)
                pos += _round(n, ALIGN)
        return tuple(out)

    def hold(self, slots: Sequence[int], who: str) -> None:
        """``who`` (a peer's arena prefix) was sent one reference per entry of ``slots``."""
        if slots:
            self._pool.hold(slots, who)

    def release(self, slots: Sequence[int], who: str) -> int:
        """``who`` is done with one reference per entry; returns how many it did not hold."""
        return self._pool.release(slots, who)

    def stats(self) -> dict[str, int]:
        return {"segments": len(self._segments), "bytes": sum(s.size for s in self._segments), **self._pool.stats()}

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Remove every segment of this arena. Views keep their memory until they die."""
        with self._lock:
            self.closed = True
        self._finalizer()


# ----------------------------------------------------------------------------- the process arena

_process_arena: Arena | None = None
_process_lock = threading.Lock()


def open_process_arena(job: str, owner: str, settings: ShmSettings = ShmSettings()) -> Arena | None:
    """This process's arena, created on the first call (stale segments of ``job`` are removed first);
    later calls return the same one whatever their arguments. None when ``settings.enabled`` is
    false or no segment can be created here (logged). Endpoints use it unless told otherwise."""
    global _process_arena
    if not settings.enabled:
        return None
    with _process_lock:
        if _process_arena is not None and not _process_arena.closed:
            return _process_arena
        cleanup_stale(job, settings.directory)
        try:
            _process_arena = Arena(job, owner, settings)
        except OSError as exc:
            log.warning("shm_unavailable", directory=settings.directory, error=str(exc))
            return None
        return _process_arena


def process_arena() -> Arena | None:
    """The arena :func:`open_process_arena` opened, if any (and not closed)."""
    a = _process_arena
    return a if a is not None and not a.closed else None


def close_process_arena() -> None:
    """Close and forget the process arena (tests; a daemon's is removed at exit anyway)."""
    global _process_arena
    with _process_lock:
        a, _process_arena = _process_arena, None
    if a is not None:
        a.close()


# ----------------------------------------------------------------------------- peers' segments

@dataclasses.dataclass(eq=False)
class _Mapped:
    array: np.ndarray  #: uint8, read-only, over the whole segment
    size: int


_maps: dict[str, _Mapped] = {}
_maps_lock = threading.Lock()
_tokens: dict[str, str] = {}  # peer prefix -> the token of its last handshake


def _map(directory: str, name: str) -> _Mapped:
    path = os.path.join(directory, name)
    m = _maps.get(path)
    if m is not None:
        return m
    with _maps_lock:
        m = _maps.get(path)
        if m is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
            finally:
                os.close(fd)
            arr = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.zeros(0, dtype=np.uint8)
            m = _maps[path] = _Mapped(arr, size)
        return m


def _forget(directory: str, prefix: str) -> None:
    """Drop the cached mappings of ``prefix``'s segments (views keep theirs until they die)."""
    start = os.path.join(directory, prefix + ".")
    with _maps_lock:
        for path in [p for p in _maps if p.startswith(start)]:
            del _maps[path]


def _prune() -> None:
    """Drop cached mappings of segments that are gone (their owner exited or freed them): the pages
    of a removed file live as long as a mapping does."""
    with _maps_lock:
        for path in [p for p in _maps if not os.path.exists(p)]:
            del _maps[path]


def verify_probe(directory: str, segment: str, token: str) -> bool:
    """Whether this process maps a peer's probe ``segment`` and reads ``token`` in it (the proof that
    it can map the peer's segments). A new token for a known peer forgets its cached mappings, and
    mappings of removed segments are dropped (a handshake is rare, the cache small)."""
    prefix = prefix_of(segment)
    if prefix is None or not segment.endswith(".0") or not isinstance(token, str) or len(token) != TOKEN_CHARS:
        return False
    _prune()
    if _tokens.get(prefix) != token:
        _forget(directory, prefix)
    try:
        m = _map(directory, segment)
        ok = m.size >= TOKEN_CHARS and bytes(m.array[:TOKEN_CHARS]) == token.encode()
    except (OSError, ValueError):
        return False
    if ok:
        _tokens[prefix] = token
    return ok


def map_peer(directory: str, prefix: str, segment: str, offset: int, nbytes: int) -> np.ndarray:
    """Read-only uint8 view of ``nbytes`` at ``offset`` of ``prefix``'s segment; ProtocolError
    ``bad_shm`` when the name is not one of ``prefix``'s, the segment cannot be mapped, or the range
    lies outside it."""
    if not isinstance(segment, str) or prefix_of(segment) != prefix:
        raise ProtocolError(f"shared-memory segment {str(segment)[:80]!r} is not one of {prefix}'s", "bad_shm")
    try:
        m = _map(directory, segment)
    except (OSError, ValueError) as exc:
        raise ProtocolError(f"shared-memory segment {segment} cannot be mapped: {exc}", "bad_shm") from None
    if offset < 0 or nbytes <= 0 or offset + nbytes > m.size:
        raise ProtocolError(f"shared-memory range [{offset}, {offset + nbytes}) outside segment {segment} of "
                            f"{m.size} bytes", "bad_shm")
    return m.array[offset:offset + nbytes]


class RequestResolver:
    """Resolves the shared-memory references of requests from one peer (``prefix``): slot 0 only."""

    __slots__ = ("directory", "prefix", "accept", "replies")

    def __init__(self, directory: str, prefix: str, accept: bool) -> None:
        self.directory, self.prefix = directory, prefix
        self.accept = accept  #: the peer proved we map its segments
        self.replies = False  #: the peer proved it maps ours (reply slots)

    def __call__(self, segment: str, offset: int, nbytes: int, slot: int) -> np.ndarray:
        if not self.accept:
            raise ProtocolError("shared-memory reference from a peer whose segments this process cannot map",
                                "bad_shm")
        if slot != 0:
            raise ProtocolError(f"a request's shared-memory reference must have slot 0, got {slot}", "bad_shm")
        return map_peer(self.directory, self.prefix, segment, offset, nbytes)


class ReplyResolver:
    """Resolves the references of replies from one peer; each slot reference is released (through
    ``release(slot)``, which may be called from any thread) once the last view of it is gone."""

    __slots__ = ("directory", "prefix", "release")

    def __init__(self, directory: str, prefix: str, release: Callable[[int], None]) -> None:
        self.directory, self.prefix, self.release = directory, prefix, release

    def __call__(self, segment: str, offset: int, nbytes: int, slot: int) -> np.ndarray:
        if slot == 0:
            raise ProtocolError("a reply's shared-memory reference must name a reply slot (slot > 0)", "bad_shm")
        try:
            view = map_peer(self.directory, self.prefix, segment, offset, nbytes)
        except ProtocolError:
            self.release(slot)  # unreadable, but the peer counts it as lent
            raise
        # A view of its own per reference: its death (the last tensor over it) returns the slot.
        view = view[:]
        weakref.finalize(view, self.release, slot)
        return view
