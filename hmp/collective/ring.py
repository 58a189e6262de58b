"""Ring all-reduce over hmp's transport. A :class:`Ring` is one rank's place in a ring of
processes that run the same sequence of :meth:`Ring.all_reduce` calls; each call takes the ring,
recursive halving-doubling or the one-step small algorithm by the tensor's size, the same way on
every rank (their step layouts: :mod:`hmp.collective.plans`), for bit-identical sums everywhere.
Pieces are views of the tensor on both ends, most go one-way, every wait is bounded by
``timeout_s`` of no progress and a failure names the rank to blame (:class:`RingBroken`);
:class:`RingHost` routes pieces across ring generations. docs/collective.md has the whole story.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import ipaddress
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from hmp.collective.errors import RingBroken, RingError
from hmp.collective.plans import HalvingSteps, RingLayout, power_of_two
from hmp.collective.staging import Staging, host_buffer, side_stream
from hmp.errors import EndpointClosed, RemoteError, RequestError, RequestTimeout
from hmp.messages import Ack, Message, RingPiece
from hmp.transport.codec import DEFAULT_FRAME_BYTES, DEFAULT_LIMITS, DTYPES, Limits
from hmp.transport.eager import start_eager
from hmp.transport.endpoint import Client

#: Pipelining granularity: one piece is one message and one frame (a view on both ends). Each
#: message costs CPU in the transport on top of its bytes (encode, send, libzmq's wake-ups, decode,
#: pyzmq's zero-copy release), and on a small machine the ring is CPU-bound, so fewer, larger
#: pieces won the A/B runs (docs/collective.md, "Figures"); a segment smaller than a piece is one
#: piece anyway.
DEFAULT_PIECE_BYTES = 8 << 20
#: At or below this many bytes sent per member (``nbytes * (N - 1)``), the one-step algorithm.
DEFAULT_SMALL_BYTES = 256 << 10
#: ``RingPiece.step`` of the small algorithm (``part`` is then the sender's rank).
SMALL_STEP = -1

_ACK = Ack()
_REDUCIBLE = frozenset(d for d in DTYPES.values() if d is not torch.bool)
log = structlog.get_logger("hmp.collective")


def _wake(fut: asyncio.Future | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


#: ``Ring(algorithm=...)`` for tensors above the small threshold ("auto": halving where every member is on one host).
ALGORITHMS = ("auto", "ring", "halving")


def one_host(addresses: Sequence[str]) -> bool:
    """Whether every address is on this host by its form alone: ``ipc://``, or ``tcp://`` to a
    loopback address or ``localhost`` (a name or another address may be any host: False)."""
    for address in addresses:
        if address.startswith("ipc://"):
            continue
        if not address.startswith("tcp://"):
            return False
        host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
        if host == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return True


class _Op:
    """One running all-reduce on this rank: what every algorithm tracks (subclasses: each one's own)."""

    __slots__ = ("op", "work", "stage", "loop", "error", "done", "cond", "last_progress", "inflight", "unanswered",
                 "seen", "expected", "received", "pump_blocked")

    def __init__(self, op: int, work: torch.Tensor, stage: Staging | None, loop: asyncio.AbstractEventLoop) -> None:
        self.op, self.work, self.stage, self.loop = op, work, stage, loop
        self.error: BaseException | None = None
        self.done: asyncio.Future = loop.create_future()  # woken when cond() holds or on failure
        self.cond: Callable[[], bool] = lambda: False
        self.last_progress = loop.time()
        self.inflight = 0  # requests sent, not yet answered
        self.unanswered: collections.Counter[int] = collections.Counter()  # the same, per rank
        self.seen: set[tuple[int, int]] = set()  # (step, piece) received
        self.expected = 0
        self.received = 0
        self.pump_blocked: asyncio.Future | None = None  # the device copy the next send waits for

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        _wake(self.done)
        _wake(self.pump_blocked)


class _RingOp(_Op):
    __slots__ = ("layout", "queue", "sends", "prior_left", "prior_consumed")

    def __init__(self, op: int, work: torch.Tensor, stage: Staging | None, loop: asyncio.AbstractEventLoop,
                 layout: RingLayout) -> None:
        super().__init__(op, work, stage, loop)
        self.layout = layout
        self.queue: collections.deque[tuple[int, int]] = collections.deque()  # (step, piece) ready to send
        self.sends: dict[tuple[int, int], asyncio.Task] = {}  # region -> its latest send
        # pieces of the steps before the last still to consume ("prior" pieces); prior_consumed is
        # woken at 0: a last-step piece is answered only then (one-way pieces have no answer of their own)
        self.prior_left = 0
        self.prior_consumed: asyncio.Future = loop.create_future()

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        _wake(self.prior_consumed)


class _HalvingOp(_Op):
    # pieces applied; per step: pieces still to apply, woken at 0 (an all-gather step's first piece
    # is answered only then), and pieces not sent yet, in order; woken when any piece is applied
    __slots__ = ("layout", "applied", "step_left", "step_consumed", "pending", "applied_more")

    def __init__(self, op: int, work: torch.Tensor, stage: Staging | None, loop: asyncio.AbstractEventLoop,
                 layout: HalvingSteps) -> None:
        super().__init__(op, work, stage, loop)
        self.layout = layout
        self.applied: set[tuple[int, int]] = set()
        self.step_left = [layout.count(layout.recvs[t]) for t in range(layout.steps)]
        self.step_consumed = [loop.create_future() for _ in range(layout.steps)]
        self.pending = [collections.deque(range(layout.count(layout.sends[t]))) for t in range(layout.steps)]
        self.applied_more: asyncio.Future | None = None

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        _wake(self.applied_more)
        for fut in self.step_consumed:
            _wake(fut)


class _SmallOp(_Op):
    __slots__ = ("contrib", "got", "consumed")

    def __init__(self, op: int, work: torch.Tensor, stage: Staging | None, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(op, work, stage, loop)
        self.contrib: list[Any] | None = None  # by rank, until summed
        self.got = 0
        self.consumed: asyncio.Future = loop.create_future()  # the contributions were summed: answer them

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        _wake(self.consumed)


class Ring:
    """One member (``rank``) of a ring over ``addresses`` (every member's server, in rank order).

    ``generation`` numbers this ring among the rings the job forms over time (a new one after a
    member is lost); ``name`` is this member's sender id. ``piece_bytes`` is the pipelining
    granularity; ``small_bytes`` the threshold of the one-step algorithm (``nbytes * (N - 1) <=
    small_bytes``); ``timeout_s`` the longest wait without progress; ``window`` caps the pieces one
    operation has in flight to the next member, every piece then a request (None: as many as are
    ready, most of them one-way); ``max_ops_ahead`` the distinct operations not started here whose
    early pieces may wait (keep it above the number of all-reduces a member runs without waiting
    for the others, e.g. one step's buckets). Every member must use the same ``piece_bytes``,
    ``small_bytes``, ``algorithm`` and ``window`` (None or not). ``algorithm`` picks what tensors
    above the small threshold take (:data:`ALGORITHMS`): ``"ring"``; ``"halving"``, recursive
    halving-doubling with a power of two (>= 4) members (the ring's bytes in fewer messages), the
    ring otherwise; ``"auto"``, halving-doubling only where every member is on this host
    (:func:`one_host`), the ring elsewhere. ``stage``: run the algorithm on a host copy of the
    tensor (None: for tensors not on the CPU, i.e. CUDA; True also for CPU tensors, which tests use).
    ``job_token`` and ``security`` go to the clients to the other members (hmp.transport.Client;
    None: the process's settings, which a daemon sets: docs/protocol.md, "Trust").
    """

    def __init__(self, *, rank: int, addresses: Sequence[str], generation: int, name: str = "ring",
                 limits: Limits = DEFAULT_LIMITS, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 small_bytes: int = DEFAULT_SMALL_BYTES, timeout_s: float = 60.0, window: int | None = None,
                 max_ops_ahead: int = 32, frame_bytes: int = DEFAULT_FRAME_BYTES, stage: bool | None = None,
                 algorithm: str = "auto", ctx: Any = None, job_token: str | None = None,
                 security: Any = None) -> None:
        addresses = tuple(addresses)
        # The members' clients speak for the job: its token and CURVE keys (None: the process's, see
        # hmp.transport.set_process_settings).
        self._client_trust = {"job_token": job_token, "security": security}
        if not addresses or not all(isinstance(a, str) and a for a in addresses):
            raise ValueError(f"addresses must be a non-empty sequence of server addresses, got {addresses!r}")
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank {rank} is not in 0..{len(addresses) - 1}")
        if piece_bytes < 1 or piece_bytes > min(frame_bytes, limits.max_message_bytes):
            raise ValueError(f"piece_bytes must be in 1..{min(frame_bytes, limits.max_message_bytes)} "
                             f"(one frame, one message), got {piece_bytes}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        if small_bytes < 0 or timeout_s <= 0 or max_ops_ahead < 1 or (window is not None and window < 1):
            raise ValueError("small_bytes must be >= 0, timeout_s > 0, max_ops_ahead >= 1 and window None or >= 1")
        self.rank, self.addresses, self.size, self.generation = rank, addresses, len(addresses), generation
        self.name, self.limits, self.frame_bytes, self.ctx = name, limits, frame_bytes, ctx
        self.piece_bytes, self.small_bytes, self.timeout_s = piece_bytes, small_bytes, timeout_s
        self.window, self.max_ops_ahead, self.stage = window, max_ops_ahead, stage
        # Halving-doubling, where the members' number allows, is a little cheaper on one host (no
        # links to share; CPU per message counts) and loses on a network of per-host links: its
        # partners change from step to step, so a member a step ahead sends to one that still
        # receives from another, and two streams share a link (docs/collective.md, "Which algorithm").
        self.halving = (self.size >= 4 and power_of_two(self.size)
                        and (algorithm == "halving" or (algorithm == "auto" and one_host(addresses))))
        self.next, self.prev = (rank + 1) % self.size, (rank - 1) % self.size
        self._clients: dict[int, Client] = {}
        self._ops: dict[int, _Op] = {}
        self._early: dict[int, asyncio.Future] = {}  # op not started here -> woken when it starts
        self._last_op: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._copier: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict = {}
        self._hosts: dict[tuple, list[torch.Tensor]] = {}
        self.stats = {"ops": 0, "ring_ops": 0, "small_ops": 0, "halving_ops": 0, "pieces_sent": 0, "pieces_received": 0,
                      "bytes_sent": 0, "bytes_received": 0, "early_pieces": 0, "refused": 0,
                      "staged_in": 0, "staged_out": 0}
        self.log = log.bind(node=name, ring=generation, rank=rank)

    # ------------------------------------------------------------------ life cycle

    async def __aenter__(self) -> Ring:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open a client to every other member (the ring sends to the next; the small algorithm to all)."""
        if self._clients or self.size == 1:
            return
        for rank, address in enumerate(self.addresses):
            if rank == self.rank:
                continue
            # The request timeout is a backstop: the progress watchdog (timeout_s) fires first.
            client = Client(address, name=f"{self.name}->{rank}", limits=self.limits, frame_bytes=self.frame_bytes,
                            timeout_s=2 * self.timeout_s, ctx=self.ctx, on_refused=functools.partial(self._refused, rank),
                            **self._client_trust)
            await client.connect()
            self._clients[rank] = client

    async def close(self) -> None:
        """Fail what still runs (``RingError``), close the clients; the ring is unusable afterwards."""
        if self._closed:
            return
        if self._error is None:
            self.abort(RingError(f"{self.name}: ring generation {self.generation} closed"))
        self._closed = True
        for client in self._clients.values():
            await client.close()
        if self._copier is not None:
            self._copier.shutdown(wait=False)

    @property
    def error(self) -> BaseException | None:
        """Why the ring is unusable (abort, a failed operation, close), or None."""
        return self._error

    def abort(self, exc: BaseException) -> None:
        """Fail the running operations and every later one with ``exc``; never blocks.

        Pieces waiting here are answered ``ring_aborted``, our requests still unanswered fail at
        once. The tensors of the failed operations hold unspecified values (some members may
        have finished them): the caller must not use them, and forms a new ring generation.
        """
        if self._error is None:
            self._error = exc
            if self._ops:
                self.log.warning("ring_aborted", error=str(exc), ops=sorted(self._ops))
        for o in list(self._ops.values()):
            o.fail(exc)
        for fut in self._early.values():
            _wake(fut)
        self._early.clear()
        for client in self._clients.values():
            client.fail_pending(exc)

    # ------------------------------------------------------------------ all-reduce

    def algorithm(self, tensor: torch.Tensor) -> str:
        """What all_reduce would run: ``"small"``, ``"halving"`` (halving-doubling), ``"ring"``, or
        ``"none"`` (one member or no elements)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.size == 1 or nbytes == 0:
            return "none"
        if nbytes * (self.size - 1) <= self.small_bytes:
            return "small"
        return "halving" if self.halving else "ring"

    async def all_reduce(self, tensor: torch.Tensor, op: int) -> torch.Tensor:
        """Sum the 1-D contiguous ``tensor`` in place over all members; returns it.

        ``op`` is the operation's number, the same on every member and increasing from call to
        call. Raises :class:`RingBroken` (no progress for ``timeout_s``, or a member refused a
        piece), the exception given to :meth:`abort`, or ``RingError`` once closed.
        """
        if self._error is not None:
            raise self._error
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _REDUCIBLE:
            raise TypeError(f"cannot sum {tensor.dtype} tensors; expected one of "
                            f"{sorted(str(d).removeprefix('torch.') for d in _REDUCIBLE)}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"expected a 1-D contiguous tensor, got shape {list(tensor.shape)} "
                             f"strides {list(tensor.stride())}")
        if self._last_op is not None and op <= self._last_op:
            raise ValueError(f"op {op} after op {self._last_op}: operations must increase on every member")
        if self.size > 1 and not self._clients:
            raise RingError(f"{self.name}: call connect() before all_reduce()")
        if self.stage is False and tensor.device.type != "cpu":
            raise ValueError(f"stage=False but the tensor is on {tensor.device}")
        staged = tensor.device.type != "cpu" or self.stage is True
        self._last_op = op
        self.stats["ops"] += 1
        algo = self.algorithm(tensor)
        if algo == "none":
            _wake(self._early.pop(op, None))  # pieces for it make no sense: they get stale_op
            return tensor
        loop = asyncio.get_running_loop()
        result, tensor = tensor, tensor.detach()
        n = tensor.numel()
        work, stage = tensor, None
        if staged:
            work = self._take_host(n, tensor.dtype, pin=tensor.is_cuda)
            stage = Staging(tensor, work, self._copier_pool(), loop, side_stream(tensor.device, self._streams))
        per_piece = max(1, self.piece_bytes // tensor.element_size())
        o: _Op
        if algo == "small":
            o = _SmallOp(op, work, stage, loop)
        elif algo == "halving":
            o = _HalvingOp(op, work, stage, loop, HalvingSteps.of(self.rank, self.size, n, per_piece))
        else:
            o = _RingOp(op, work, stage, loop, RingLayout.of(self.rank, self.size, n, per_piece))
        self._ops[op] = o
        _wake(self._early.pop(op, None))  # early pieces of this op go on now
        ok = False
        try:
            self.stats[f"{algo}_ops"] += 1
            if isinstance(o, _SmallOp):
                await self._run_small(o)
            elif isinstance(o, _HalvingOp):
                await self._run_halving(o)
            else:
                await self._run_ring(o)
            ok = True
        except asyncio.CancelledError:
            # The others cannot finish this operation without us: the ring is broken for everyone.
            self.abort(RingError(f"{self.name}: all_reduce of op {op} was cancelled"))
            raise
        finally:
            self._ops.pop(op, None)
            if stage is not None:
                self.stats["staged_in"] += stage.copies_in
                self.stats["staged_out"] += stage.copies_out
            if staged and ok:  # after a failure the copier or the transport may still hold it: dropped
                self._give_host(work)
        return result

    async def _watch(self, o: _Op, cond: Callable[[], bool]) -> None:
        """Until ``cond()`` holds; RingBroken after ``timeout_s`` without progress; re-raises a failure."""
        o.cond = cond
        loop = o.loop
        while o.error is None and not cond():
            left = o.last_progress + self.timeout_s - loop.time()
            if left <= 0:
                self.abort(self._stalled(o))
                break
            if o.done.done():
                o.done = loop.create_future()
            await asyncio.wait({o.done}, timeout=left)
        if o.error is not None:
            raise o.error

    def _check(self, o: _Op) -> None:
        if o.stage is not None and o.stage.error is not None and o.error is None:
            self.abort(RingError(f"{self.name}: staging op {o.op} failed: {o.stage.error!r}"))
        if o.cond():
            _wake(o.done)

    def _stalled(self, o: _Op) -> RingBroken:
        if isinstance(o, _SmallOp):
            missing = [r for r in range(self.size) if r != self.rank and (o.contrib is None or o.contrib[r] is None)]
            if o.got < self.size - 1 and missing:
                rank, what = missing[0], "its contribution"
            else:
                rank = min(o.unanswered, default=self.next)
                what = "the answer to our contribution"
        elif o.inflight > 0:
            rank = self.next if isinstance(o, _RingOp) else o.unanswered.most_common(1)[0][0]
            what = f"answers to {o.inflight} pieces"
        else:
            assert isinstance(o, (_RingOp, _HalvingOp))
            rank, what = o.layout.silent(o.seen), f"{o.expected - o.received} pieces"
        return RingBroken(f"{self.name}: op {o.op} made no progress for {self.timeout_s} s; waiting for member "
                          f"{rank} ({self.addresses[rank]}): {what}", blamed=rank,
                          address=self.addresses[rank], code="timeout")

    def _refused(self, rank: int, exc: RemoteError) -> None:
        """Rank ``rank`` refused one of our one-way pieces: the ring is broken (as for a refused request)."""
        if self._error is None:
            self.abort(self._broken_by(rank, exc))

    def _broken_by(self, rank: int, exc: BaseException) -> BaseException:
        if self._error is not None:
            return self._error
        if isinstance(exc, RemoteError):
            code, what = exc.code, f"refused a piece: {exc.code}: {exc.remote_message}"
            # An aborted ring's refusals name the rank it blames, so that the blame travels around
            # instead of landing on an innocent neighbour: ours gave up on that rank, so do we.
            if exc.code == "ring_aborted" and exc.blamed in self.addresses and exc.blamed != self.addresses[self.rank]:
                rank = self.addresses.index(exc.blamed)
        elif isinstance(exc, RequestTimeout):
            code, what = "timeout", str(exc)
        elif isinstance(exc, EndpointClosed):
            code, what = "closed", str(exc)
        else:
            code, what = "error", f"{exc.__class__.__name__}: {exc}"
        return RingBroken(f"{self.name}: member {rank} ({self.addresses[rank]}) {what}", blamed=rank,
                          address=self.addresses[rank], code=code)

    # ------------------------------------------------------------------ sending

    async def _post(self, o: _Op, rank: int, msg: RingPiece) -> None:
        """One piece one-way to ``rank``; never raises (a failure fails the ring). Its region is
        not written again before that rank consumed it: the algorithm's data flow guarantees it
        (docs/collective.md, "One-way pieces")."""
        try:
            await self._clients[rank].send(msg, lend=True)
        except Exception as exc:  # noqa: BLE001 - the ring fails with a named error instead
            if o.error is None:
                self.abort(self._broken_by(rank, exc))
            return
        stats = self.stats
        stats["pieces_sent"] += 1
        stats["bytes_sent"] += msg.values.numel() * msg.values.element_size()

    async def _send(self, o: _Op, rank: int, msg: RingPiece) -> None:
        """One piece as a request; never raises (a failure fails the ring)."""
        o.inflight += 1
        o.unanswered[rank] += 1
        try:
            await self._clients[rank].request(msg)
        except Exception as exc:  # noqa: BLE001 - the ring fails with a named error instead
            o.inflight -= 1
            if o.error is None:
                self.abort(self._broken_by(rank, exc))
            return
        o.inflight -= 1
        o.unanswered[rank] -= 1
        o.last_progress = o.loop.time()
        stats = self.stats
        stats["pieces_sent"] += 1
        stats["bytes_sent"] += msg.values.numel() * msg.values.element_size()
        if o.error is None:
            if isinstance(o, _HalvingOp):
                self._pump_halving(o)
            elif isinstance(o, _RingOp) and o.queue:
                self._pump(o)
            self._check(o)

    def _pump(self, o: _RingOp) -> None:
        """Send the ready pieces, in order, while the window allows."""
        q, window, layout = o.queue, self.window, o.layout
        while q and o.error is None and (window is None or o.inflight < window):
            step, j = q[0]
            seg = layout.sent(step)
            if step == 0 and o.stage is not None:  # our own data: wait for its copy from the device
                fut = o.stage.ready((seg, j))
                if fut is not None:
                    if o.pump_blocked is not fut:
                        o.pump_blocked = fut
                        fut.add_done_callback(lambda _f: self._unblock(o))
                    return
                if o.stage.error is not None:
                    self._check(o)
                    return
            q.popleft()
            lo, hi = layout.region(seg, j)
            msg = RingPiece(ring=self.generation, op=o.op, step=step, part=j, values=o.work[lo:hi], sender=self.name)
            if window is None and not layout.answered(step):
                task = start_eager(self._post(o, self.next, msg), o.loop)
            else:
                task = start_eager(self._send(o, self.next, msg), o.loop)
            if task is not None:
                o.sends[(seg, j)] = task

    def _unblock(self, o: _RingOp | _HalvingOp) -> None:
        o.pump_blocked = None
        if o.error is None:
            if isinstance(o, _HalvingOp):
                self._pump_halving(o)
            else:
                self._pump(o)

    async def _run_ring(self, o: _RingOp) -> None:
        layout = o.layout
        o.expected = layout.expected()
        o.prior_left = o.expected - layout.counts[layout.received(layout.steps - 1)]
        if o.stage is not None:
            # In the order the ring needs them: what we send at step 0, then what we receive, by step.
            order = [layout.sent(t) for t in range(self.size)]
            o.stage.start([((seg, j), *layout.region(seg, j)) for seg in order for j in range(layout.counts[seg])])
        o.queue.extend((0, j) for j in range(layout.counts[self.rank]))
        self._pump(o)
        stage = o.stage
        await self._watch(o, lambda: (o.received == o.expected and o.inflight == 0 and not o.queue
                                      and (stage is None or stage.pending_out == 0)))

    async def _run_halving(self, o: _HalvingOp) -> None:
        hp = o.layout
        o.expected = sum(o.step_left)
        if o.stage is not None:
            # Step 0 sends one half and receives into the other: the whole tensor, in that order.
            send0, recv0 = hp.sends[0], hp.recvs[0]
            o.stage.start([(("send", j), *hp.region(send0, j)) for j in range(hp.count(send0))]
                          + [(("recv", j), *hp.region(recv0, j)) for j in range(hp.count(recv0))])
        self._pump_halving(o)
        stage = o.stage
        await self._watch(o, lambda: (o.received == o.expected and o.inflight == 0 and not any(o.pending)
                                      and (stage is None or stage.pending_out == 0)))

    def _pump_halving(self, o: _HalvingOp) -> None:
        """Send the ready pieces of every step, in order within a step, while the window allows.

        A piece is ready when the pieces of the earlier steps that share elements with it were
        applied here (step 0: when its device copy landed). One-way but for
        :meth:`~hmp.collective.plans.HalvingSteps.answered` ones (``window`` set: every piece is a request)."""
        hp, window, stage = o.layout, self.window, o.stage
        for t, pending in enumerate(o.pending):
            sent = hp.sends[t]
            while pending and o.error is None and (window is None or o.inflight < window):
                j = pending[0]
                lo, hi = hp.region(sent, j)
                if t == 0 and stage is not None:
                    fut = stage.ready(("send", j))
                    if fut is not None:
                        if o.pump_blocked is not fut:
                            o.pump_blocked = fut
                            fut.add_done_callback(lambda _f: self._unblock(o))
                        break
                    if stage.error is not None:
                        self._check(o)
                        return
                elif not hp.ready(t, lo, hi, o.applied):
                    break
                pending.popleft()
                msg = RingPiece(ring=self.generation, op=o.op, step=t, part=j, values=o.work[lo:hi], sender=self.name)
                if window is None and not hp.answered(t, j):
                    start_eager(self._post(o, hp.partners[t], msg), o.loop)
                else:
                    start_eager(self._send(o, hp.partners[t], msg), o.loop)

    async def _run_small(self, o: _SmallOp) -> None:
        size, work = self.size, o.work
        o.contrib = [None] * size
        if o.stage is not None:
            o.stage.start([((0, 0), 0, work.numel())])
            fut = o.stage.ready((0, 0))
            if fut is not None:
                fut.add_done_callback(lambda _f: self._check(o))
            await self._watch(o, lambda: o.stage.ready((0, 0)) is None)  # type: ignore[union-attr]
            self._check(o)
            if o.error is not None:
                raise o.error
        for rank in range(size):
            if rank != self.rank:
                msg = RingPiece(ring=self.generation, op=o.op, step=SMALL_STEP, part=self.rank, values=work,
                                sender=self.name)
                start_eager(self._send(o, rank, msg), o.loop)
        await self._watch(o, lambda: o.got == size - 1)
        contrib = o.contrib
        contrib[self.rank] = work
        total = contrib[0].clone()  # in rank order on every member: bit-identical results
        for c in contrib[1:]:
            total.add_(c)
        o.contrib = None  # the received frames may go
        _wake(o.consumed)  # our handlers answer the contributions now
        await self._watch(o, lambda: o.inflight == 0)  # nobody reads our tensor any more
        work.copy_(total)
        if o.stage is not None:
            o.stage.write_back(0, work.numel(), lambda: self._check(o))
            await self._watch(o, lambda: o.stage.pending_out == 0)  # type: ignore[union-attr]
            self._check(o)
            if o.error is not None:
                raise o.error

    # ------------------------------------------------------------------ receiving

    async def on_piece(self, msg: RingPiece, peer: bytes) -> Message:
        """The server's handler for :data:`Kind.RING`: returns the :class:`Ack` once the piece is consumed."""
        if msg.ring != self.generation:
            if msg.ring < self.generation:
                raise RequestError(f"{self.name}: piece of ring generation {msg.ring}; this ring is generation "
                                   f"{self.generation}", "stale_ring")
            raise RequestError(f"{self.name}: piece of ring generation {msg.ring}, newer than this ring's "
                               f"{self.generation}", "ring_ahead")
        if self._error is not None:
            raise self._aborted(self._error)
        o = self._ops.get(msg.op)
        if o is None:
            o = await self._wait_start(msg)
        if isinstance(o, _SmallOp):
            return await self._take_small(o, msg)
        if isinstance(o, _HalvingOp):
            return await self._take_halving(o, msg)
        assert isinstance(o, _RingOp)
        return await self._take_ring(o, msg)

    def _aborted(self, exc: BaseException) -> RequestError:
        """The refusal of a piece of an aborted ring; it names the rank blamed (``Error.blamed``: its address)."""
        if not isinstance(exc, RingBroken):
            return RequestError(f"{self.name}: ring aborted: {exc}", "ring_aborted")
        return RequestError(f"{self.name}: ring aborted [member={exc.blamed}]: {exc}", "ring_aborted", exc.address)

    def _refuse(self, msg: RingPiece, why: str, o: _Op | None = None, rank: int | None = None) -> RequestError:
        """A piece that makes no sense. Inside a running operation the members disagree (sizes,
        dtypes, thresholds): the operation cannot be right, so it fails (RingBroken)."""
        self.stats["refused"] += 1
        text = f"{self.name}: op {msg.op} step {msg.step} part {msg.part}: {why}"
        if o is not None and o.error is None and rank is not None:
            self.abort(RingBroken(f"{text} (from member {rank})", blamed=rank, address=self.addresses[rank],
                                  code="bad_piece"))
        return RequestError(text, "bad_piece")

    async def _wait_start(self, msg: RingPiece) -> _Op:
        """An early piece: wait (bounded) until all_reduce(msg.op) starts here."""
        size = self.size
        if not (msg.step == SMALL_STEP or 0 <= msg.step < 2 * size - 2) or msg.part < 0:
            raise self._refuse(msg, f"no such step or part in a ring of {size}")
        if self._last_op is not None and msg.op <= self._last_op:
            self.stats["refused"] += 1
            raise RequestError(f"{self.name}: op {msg.op} is not running here (last started: {self._last_op})",
                               "stale_op")
        fut = self._early.get(msg.op)
        if fut is None:
            if len(self._early) >= self.max_ops_ahead:
                self.stats["refused"] += 1
                raise RequestError(f"{self.name}: op {msg.op} is more than {self.max_ops_ahead} operations ahead "
                                   f"(waiting for ops {sorted(self._early)})", "too_far_ahead")
            fut = self._early[msg.op] = asyncio.get_running_loop().create_future()
        self.stats["early_pieces"] += 1
        done, _ = await asyncio.wait({fut}, timeout=self.timeout_s)
        if self._error is not None:
            raise self._aborted(self._error)
        if not done:
            if self._early.get(msg.op) is fut:
                del self._early[msg.op]
            raise RequestError(f"{self.name}: op {msg.op} did not start here within {self.timeout_s} s", "timeout")
        o = self._ops.get(msg.op)
        if o is None:  # over already, or nothing to exchange (one member, no elements)
            raise RequestError(f"{self.name}: op {msg.op} is not running here", "stale_op")
        return o

    async def _take_ring(self, o: _RingOp, msg: RingPiece) -> Message:
        layout, step, j = o.layout, msg.step, msg.part
        if not 0 <= step < layout.steps:
            raise self._refuse(msg, "not a ring step (the members disagree on the algorithm)", o, self.prev)
        seg = layout.received(step)
        if not 0 <= j < layout.counts[seg]:
            raise self._refuse(msg, f"segment {seg} has {layout.counts[seg]} pieces", o, self.prev)
        lo, hi = layout.region(seg, j)
        v = self._accept(o, msg, lo, hi, self.prev)
        # Before writing the region: our earlier send of it must be answered (the receiver is done
        # reading it), and on the first write its device copy must have landed in the host buffer.
        sent = o.sends.get((seg, j))
        if sent is not None and not sent.done():
            await asyncio.wait({sent})
        if o.stage is not None and layout.reduces(step):
            fut = o.stage.ready((seg, j))
            if fut is not None:
                await asyncio.wait({fut})
            self._check(o)
        self._apply(o, v, lo, hi, layout.reduces(step), layout.final(step))
        if step + 1 < layout.steps:  # forward it (pipelining: this piece only, now)
            o.queue.append((step + 1, j))
            self._pump(o)
            o.prior_left -= 1
            if o.prior_left == 0:
                _wake(o.prior_consumed)
        self._check(o)
        if self.window is None and step == layout.steps - 1 and o.prior_left:
            # The answer to a last-step piece also says that every one-way piece of the operation
            # from the sender was consumed: only then may the sender's all_reduce return and its
            # caller write the tensor (a one-way piece may be a view of it, in shared memory).
            return await self._ack_when(o, o.prior_consumed)
        return _ACK

    async def _take_halving(self, o: _HalvingOp, msg: RingPiece) -> Message:
        hp, step, j = o.layout, msg.step, msg.part
        if not 0 <= step < hp.steps:
            # Its sender is unknown (the step names it): it fails at once on our error reply.
            raise self._refuse(msg, "not a halving-doubling step (the members disagree on the algorithm)")
        span, partner = hp.recvs[step], hp.partners[step]
        if not 0 <= j < hp.count(span):
            raise self._refuse(msg, f"step {step} has {hp.count(span)} pieces", o, partner)
        lo, hi = hp.region(span, j)
        v = self._accept(o, msg, lo, hi, partner)
        if step == 0 and o.stage is not None:  # the first write of the region: after its device copy
            fut = o.stage.ready(("recv", j))
            if fut is not None:
                await asyncio.wait({fut})
            self._check(o)
        # The earlier steps' pieces of this region first: a partner may be a step ahead of another,
        # and the sums must be added in the same order on every run (and the all-gather must not
        # overwrite a region before its reduction is complete).
        while o.error is None and not hp.ready(step, lo, hi, o.applied):
            if o.applied_more is None or o.applied_more.done():
                o.applied_more = o.loop.create_future()
            await asyncio.wait({o.applied_more})
        self._apply(o, v, lo, hi, hp.reduces(step), hp.final(step))
        o.applied.add((step, j))
        _wake(o.applied_more)
        o.step_left[step] -= 1
        if o.step_left[step] == 0:
            _wake(o.step_consumed[step])
        self._pump_halving(o)
        self._check(o)
        if self.window is None and hp.answered(step, j) and o.step_left[step]:
            # The answer to an all-gather step's first piece says the whole step was applied: the
            # sender's all_reduce may return only then (its pieces may be views of its tensor).
            return await self._ack_when(o, o.step_consumed[step])
        return _ACK

    async def _take_small(self, o: _SmallOp, msg: RingPiece) -> Message:
        src = msg.part
        if msg.step != SMALL_STEP or not 0 <= src < self.size or src == self.rank:
            rank = src if 0 <= src < self.size and src != self.rank else self.prev
            raise self._refuse(msg, "not a contribution of another member (the members disagree on the "
                               "algorithm)", o, rank)
        v = msg.values
        if v.dtype != o.work.dtype or v.dim() != 1 or v.shape[0] != o.work.shape[0]:
            raise self._refuse(msg, f"got {v.dtype}{list(v.shape)}, expected {o.work.dtype}[{o.work.shape[0]}]",
                               o, src)
        if o.contrib is None or o.contrib[src] is not None:
            raise self._refuse(msg, "duplicate contribution")
        o.contrib[src] = v  # held (a view over its frame) until every contribution is in
        o.got += 1
        o.last_progress = o.loop.time()
        self.stats["pieces_received"] += 1
        self.stats["bytes_received"] += v.numel() * v.element_size()
        self._check(o)
        return await self._ack_when(o, o.consumed)

    def _accept(self, o: _Op, msg: RingPiece, lo: int, hi: int, sender: int) -> torch.Tensor:
        """The piece's values, once each, if they fit elements ``[lo, hi)`` (else the operation fails,
        blaming rank ``sender``)."""
        v = msg.values
        if v.dtype != o.work.dtype or v.dim() != 1 or v.shape[0] != hi - lo:
            raise self._refuse(msg, f"got {v.dtype}{list(v.shape)}, expected {o.work.dtype}[{hi - lo}]", o, sender)
        if (msg.step, msg.part) in o.seen:
            raise self._refuse(msg, "duplicate piece")
        o.seen.add((msg.step, msg.part))
        return v

    def _apply(self, o: _Op, v: torch.Tensor, lo: int, hi: int, reduce: bool, final: bool) -> None:
        """Add (reduce-scatter) or copy (all-gather) a piece straight from its received frame into
        the tensor; a ``final`` region goes back to the device. Raises the refusal of an aborted op."""
        if o.error is not None:
            raise self._aborted(o.error)
        if reduce:
            o.work[lo:hi].add_(v)
        else:
            o.work[lo:hi].copy_(v)
        o.received += 1
        o.last_progress = o.loop.time()
        self.stats["pieces_received"] += 1
        self.stats["bytes_received"] += (hi - lo) * v.element_size()
        if final and o.stage is not None:
            o.stage.write_back(lo, hi, lambda: self._check(o))

    async def _ack_when(self, o: _Op, fut: asyncio.Future) -> Message:
        """The answer to a piece once ``fut`` is woken (a refusal if the op failed meanwhile)."""
        await asyncio.wait({fut})
        if o.error is not None:
            raise self._aborted(o.error)
        return _ACK

    # ------------------------------------------------------------------ staging buffers

    def _copier_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._copier is None:
            self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-copy")
        return self._copier

    def _take_host(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        free = self._hosts.get((numel, dtype, pin))
        return free.pop() if free else host_buffer(numel, dtype, pin)

    def _give_host(self, host: torch.Tensor) -> None:
        self._hosts.setdefault((host.numel(), host.dtype, host.is_pinned()), []).append(host)


class RingHost:
    """Routes :data:`Kind.RING` to the current ring, across ring generations.

    The daemon registers ``host.on_piece`` as its server's handler once and :meth:`install` s each
    new :class:`Ring` (or :meth:`retire` s the generation when it is not a member of the new ring).
    A piece of the current generation goes to the ring; of an older one, error ``stale_ring``; of a
    newer one (a neighbour heard of the new ring first) it waits up to ``timeout_s`` for the
    install, at most ``max_waiting`` generations at once, else error ``unknown_ring``.
    """

    def __init__(self, *, timeout_s: float = 60.0, max_waiting: int = 4) -> None:
        self.ring: Ring | None = None
        self.timeout_s, self.max_waiting = timeout_s, max_waiting
        self._newest: int | None = None
        self._waiting: dict[int, asyncio.Future] = {}

    @property
    def generation(self) -> int | None:
        """The newest generation installed or retired (None before the first)."""
        return self._newest

    def install(self, ring: Ring) -> Ring | None:
        """Make ``ring`` current; returns the previous ring (the caller aborts or closes it)."""
        return self._switch(ring.generation, ring)

    def retire(self, generation: int) -> Ring | None:
        """Generation ``generation`` exists but this member is not in it: older pieces are stale."""
        return self._switch(generation, None)

    def _switch(self, generation: int, ring: Ring | None) -> Ring | None:
        if self._newest is not None and generation <= self._newest:
            raise ValueError(f"ring generation {generation} is not newer than {self._newest}")
        old, self.ring, self._newest = self.ring, ring, generation
        for g in [g for g in self._waiting if g <= generation]:
            _wake(self._waiting.pop(g))
        return old

    async def on_piece(self, msg: RingPiece, peer: bytes) -> Message:
        ring = self.ring
        if ring is not None and msg.ring == ring.generation:
            return await ring.on_piece(msg, peer)
        if self._newest is not None and msg.ring <= self._newest:
            raise RequestError(f"piece of ring generation {msg.ring}; the current one is {self._newest}", "stale_ring")
        fut = self._waiting.get(msg.ring)
        if fut is None:
            if len(self._waiting) >= self.max_waiting:
                raise RequestError(f"ring generation {msg.ring} is unknown here", "unknown_ring")
            fut = self._waiting[msg.ring] = asyncio.get_running_loop().create_future()
        await asyncio.wait({fut}, timeout=self.timeout_s)
        ring = self.ring
        if ring is not None and msg.ring == ring.generation:
            return await ring.on_piece(msg, peer)
        if self._newest is not None and msg.ring <= self._newest:
            raise RequestError(f"piece of ring generation {msg.ring}; the current one is {self._newest}", "stale_ring")
        if self._waiting.get(msg.ring) is fut:
            del self._waiting[msg.ring]
        raise RequestError(f"ring generation {msg.ring} was not installed here within {self.timeout_s} s",
                           "unknown_ring")


__all__ = ["ALGORITHMS", "DEFAULT_PIECE_BYTES", "DEFAULT_SMALL_BYTES", "SMALL_STEP", "Ring", "RingHost", "one_host",
           "power_of_two"]
