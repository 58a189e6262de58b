"""The PS shard's sans-IO core: chunk ownership, aggregation, optimizer, and the consistency rules of a push.

No sockets, no awaiting, no clock: the node shell (:mod:`hmp.nodes.ps_shard`) calls it from its event-loop
thread, so the updates of a chunk never interleave (one owner per chunk, after PHub), and turns its
decisions into replies, waits and forwards to the group's backup. Events in, decisions out:

* :meth:`ShardCore.push` (a worker's :class:`~hmp.messages.Push`) -> :class:`ReplyNow` (answer with the
  current values), :class:`AwaitRound` (sync: answer when the round completes), :class:`AwaitStaleness`
  (ssp: the worker is more than ``staleness`` updates ahead of the slowest: answer once applied) or
  :class:`Refuse`; a malformed push raises :class:`~hmp.errors.RequestError`.
* :meth:`ShardCore.remove_worker` (a ``leave`` or ``drop``: no longer waited for). After it and after every
  push, :meth:`ShardCore.next_release` says, one at a time, which waiters are answered now: a finished
  sync round's members (:class:`RoundDone`) or a push that waited for the SSP bound (:class:`Released`).

What a decision applied comes with the :class:`~hmp.messages.Replicate` that feeds the group's backup
(docs/resilience.md: :meth:`ShardCore.apply`, :meth:`ShardCore.apply_round` there; the optimizers are
deterministic, so the copy is bit-identical). Retried pushes (docs/protocol.md, "Shard restarts") carry
the first try's ``seq``: one applied already (:attr:`ShardCore.last_seq`, saved in checkpoints with the
parameters that hold it) is answered, not applied again; one in the round in progress or waiting for the
SSP bound waits with it. Row-sparse tables (``row_dims``, docs/protocol.md, "Row-sparse tables"): a push
may carry gradients of some rows of a chunk; every update counts as a step of each row-sparse chunk,
touched or not, so that its step count (the schedule's, Adam's) is the shard's update count. Buffer chunks
(``buffer_keys``: module buffers such as BatchNorm running statistics, docs/buffers.md) travel in the same
pushes, replies, forwards and checkpoints as the parameters, but a push carries their values and
:class:`~hmp.ps.optim.BufferRule` applies them (last writer wins, a sync round's mean; maximum for
integers), never the optimizer. Checkpoint files: :mod:`hmp.ps.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from hmp.config import Consistency
from hmp.errors import RequestError
from hmp.messages import Push, Replicate, RowGrads
from hmp.ps import checkpoint
from hmp.ps.checkpoint import CheckpointError
from hmp.ps.optim import BufferRule, accumulate, make_chunk_optimizer, scale_


# ---------------------------------------------------------------- decisions (push)
@dataclasses.dataclass(frozen=True)
class ReplyNow:
    """Answer with the chunks' current values (and the rows the push wants), once ``forward`` (what the
    push applied; None: nothing, a retry of a push applied before) is with the group's backup."""

    forward: Replicate | None = None
    duplicate: bool = False


@dataclasses.dataclass(frozen=True)
class AwaitRound:
    """Sync: answer with the values of round ``round`` (the version it was contributed at) when it is
    done (:class:`RoundDone`); ``duplicate``: a retry of a contribution already in it."""

    round: int
    duplicate: bool = False


@dataclasses.dataclass(frozen=True)
class AwaitStaleness:
    """SSP: answer when push ``ticket`` is released (:class:`Released`); ``duplicate``: this is a retry of
    waiting push ``ticket`` (answered with the current values once that one is applied)."""

    ticket: int
    duplicate: bool = False


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Answer with an error: ``code`` and ``text`` as on the wire."""

    code: str
    text: str


# ---------------------------------------------------------------- releases (next_release)
@dataclasses.dataclass(frozen=True)
class RoundDone:
    """Sync round ``round`` is applied (now ``version``): its members are answered with ``reply_keys``'
    values copied now and the rows each wanted (``wanted``, by worker, gathered), once ``forward`` is
    with the backup (the next round may write the aggregation buffers only then: ``forward`` holds them)."""

    round: int
    version: int
    reply_keys: tuple[int, ...]
    wanted: dict[str, tuple[tuple[int, ...], tuple[torch.Tensor, ...]]]
    forward: Replicate


@dataclasses.dataclass(frozen=True)
class Released:
    """SSP: ``push`` (its :class:`AwaitStaleness` ``ticket``) is within the bound and applied now: answer it
    with the values as they are now, once ``forward`` is with the backup."""

    ticket: int
    push: Push
    forward: Replicate


@dataclasses.dataclass
class ChunkState:
    """One chunk's parameter values, optimizer and (sync mode) aggregation buffer."""

    key: int
    param: torch.Tensor  # [numel], owned by the shard
    optimizer: Any
    agg: torch.Tensor | None = None  # [numel]; sync mode only, allocated once
    contributors: int = 0
    dim: int = 0  #: a row-sparse chunk's row width (0: dense)
    buffer: bool = False  #: holds module buffers: ``optimizer`` is a BufferRule, pushes carry values
    touched: list[torch.Tensor] = dataclasses.field(default_factory=list)  # sync: the rows pushed this round

    @property
    def rows(self) -> int:
        """Whole rows of a row-sparse chunk (0 for a dense one)."""
        return self.param.numel() // self.dim if self.dim else 0


class ShardCore:
    """State of one PS shard. ``version`` counts optimizer steps applied (the shard's clock)."""

    def __init__(self, shard_id: str, chunks: dict[int, torch.Tensor], optimizer: str, hyper: dict[str, Any],
                 consistency: str = Consistency.ASYNC, staleness: int = 0, workers: Iterable[str] = (),
                 row_dims: dict[int, int] | None = None, reject_nonfinite: bool = True, node: str = "",
                 buffer_keys: Iterable[int] = ()) -> None:
        """``row_dims``: ``{chunk key: row width}`` of the chunks that hold rows of a row-sparse table;
        ``buffer_keys``: the chunks that hold module buffers (:class:`~hmp.ps.optim.BufferRule`, no optimizer);
        ``reject_nonfinite``: refuse pushes with NaN or infinite gradients (:meth:`check_finite`); ``node``:
        the shard daemon serving it (default ``shard_id``), named when it refuses pushes on its way out."""
        if consistency not in tuple(Consistency):
            raise ValueError(f"consistency must be async, sync or ssp, got {consistency!r}")
        self.shard_id, self.node = shard_id, node or shard_id
        self.consistency = consistency
        self.staleness = staleness
        self.reject_nonfinite = reject_nonfinite
        self.optimizer_name, self.hyper = optimizer, dict(hyper)
        # Cloned once at start: the shard owns and mutates its chunks, while the given values are views of the
        # model (or of a received frame) that the caller keeps.
        row_dims = row_dims or {}
        buffers = set(buffer_keys)
        self.chunks = {k: ChunkState(k, v.detach().clone().reshape(-1),
                                     BufferRule(v.numel(), v.dtype) if k in buffers else
                                     make_chunk_optimizer(optimizer, v.numel(), dtype=v.dtype, **hyper),
                                     dim=int(row_dims.get(k, 0)), buffer=k in buffers)
                       for k, v in chunks.items()}
        #: the chunks holding module buffers
        self.buffer_keys = frozenset(k for k in self.chunks if k in buffers)
        for c in self.chunks.values():
            if c.dim and c.param.numel() % c.dim:
                raise ValueError(f"chunk {c.key} has {c.param.numel()} elements, not whole rows of width {c.dim}")
        #: the row-sparse chunks (ticked by updates that carry none of their rows)
        self.row_chunks = tuple(k for k, c in self.chunks.items() if c.dim)
        self.version = 0
        self.updates_applied = 0  # pushes applied (async/ssp) or rounds completed (sync)
        self.samples = 0
        # sync rounds and ssp clocks, per worker; the workers taken out (leave, drop), counted again if they push
        self.live_workers: set[str] = set()
        self.departed: set[str] = set()
        self.round_members: set[str] = set()
        self.clock: dict[str, int] = {}
        # Retried pushes: the last seq applied per worker (in checkpoints), and (sync) the seq each member
        # contributed to the round in progress, applied when the round is.
        self.last_seq: dict[str, int] = {}
        self.round_seq: dict[str, int] = {}
        self.round_samples = 0  # sync: the examples of the round in progress
        #: sync: the rows each member of the round in progress wants back (copies of a push's want_keys/want_rows)
        self.round_wants: dict[str, tuple[tuple[int, ...], tuple[torch.Tensor, ...]]] = {}
        #: sync: what the last finish_round applied, ``(keys, gradients, seqs, samples)``, for a backup
        #: (:meth:`apply_round`); the gradients are the aggregation buffers, valid until the next round starts
        self.last_round: tuple[tuple[int, ...], tuple[torch.Tensor, ...], dict[str, int], int] | None = None
        self._zero_after_forward: tuple[int, ...] = ()  # sync: row-sparse chunks the last round applied whole
        #: ssp: the pushes waiting for the bound, by ticket (:class:`AwaitStaleness`), in arrival order
        self.waiting: dict[int, Push] = {}
        self._tickets = 0
        self._rounds_done: list[RoundDone] = []  # sync: finished rounds not yet released (next_release)
        #: a backup: the last forward of its primary applied (``Replicate.fseq``; -1: a whole copy comes first)
        self.applied_forward = 0
        for w in workers:  # the job's workers, each counted in sync rounds and SSP bounds from the start
            self.add_worker(w)

    # ---------------------------------------------------------------- validation
    def check(self, keys: Sequence[int], tensors: Sequence[torch.Tensor], what: str) -> None:
        """Refuse unknown keys, duplicated keys, or tensors of the wrong dtype or shape."""
        if len(keys) != len(tensors):
            raise RequestError(f"{what}: {len(keys)} keys but {len(tensors)} tensors", "bad_request")
        if len(set(keys)) != len(keys):
            raise RequestError(f"{what}: duplicate keys", "bad_request")
        for k, t in zip(keys, tensors):
            c = self.chunks.get(k)
            if c is None:
                raise RequestError(f"{what}: shard {self.shard_id} does not own chunk {k}; owns "
                                   f"{min(self.chunks, default=None)}..{max(self.chunks, default=None)}", "unknown_key")
            if t.dtype != c.param.dtype:
                raise RequestError(f"{what}: chunk {k} is {c.param.dtype}, got {t.dtype}", "bad_dtype")
            if t.dim() != 1 or t.numel() != c.param.numel():
                raise RequestError(f"{what}: chunk {k} has shape [{c.param.numel()}], got {list(t.shape)}",
                                   "bad_shape")

    @staticmethod
    def check_finite(keys: Sequence[int], tensors: Sequence[torch.Tensor], what: str) -> None:
        """Refuse NaN or infinite values: applied, one would poison its chunk for every worker.

        The test is the chunk's sum, one fast reduction (a NaN or an infinity makes the sum NaN
        or infinite, and a sum of finite values is never NaN); only a non-finite sum, which a
        sum overflowing float range can also give, pays for the exact element-wise check
        (``torch.isfinite(t).all()`` is ~20x slower). ``[ps] reject_nonfinite`` turns it off."""
        for k, t in zip(keys, tensors):
            if not t.is_floating_point() or bool(torch.isfinite(t.sum())):
                continue
            if not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise RequestError(f"{what}: chunk {k} has {bad} NaN or infinite value(s); nothing was applied",
                                   "non_finite")

    def check_rows(self, row_keys: Sequence[int], rows: Sequence[torch.Tensor],
                   tensors: Sequence[torch.Tensor] | None, what: str, keys: Sequence[int] = ()) -> None:
        """Refuse a row-sparse part that cannot be applied (or, ``tensors`` None, rows that cannot be
        read): as many row tensors (and gradients) as ``row_keys``, no key twice or also in ``keys``
        (whole chunks), chunks this shard owns that are row-sparse, row ids int64, 1-D, strictly
        increasing (sorted, no duplicates) and in ``[0, rows of the chunk)``, gradients of the chunk's
        dtype shaped ``[len(rows), dim]``."""
        if len(rows) != len(row_keys) or (tensors is not None and len(tensors) != len(row_keys)):
            raise RequestError(f"{what}: {len(row_keys)} row keys but {len(rows)} row id tensors"
                               + ("" if tensors is None else f" and {len(tensors)} row gradients"), "bad_request")
        if len(set(row_keys)) != len(row_keys):
            raise RequestError(f"{what}: duplicate row keys", "bad_request")
        both = sorted(set(row_keys) & set(keys))
        if both:
            raise RequestError(f"{what}: chunks {both} are both whole and by rows", "bad_request")
        for i, (k, r) in enumerate(zip(row_keys, rows)):
            c = self.chunks.get(k)
            if c is None:
                raise RequestError(f"{what}: shard {self.shard_id} does not own chunk {k}; owns "
                                   f"{min(self.chunks, default=None)}..{max(self.chunks, default=None)}", "unknown_key")
            if not c.dim:
                raise RequestError(f"{what}: chunk {k} is dense (not rows of a row-sparse table); send it whole "
                                   "in keys", "bad_request")
            if r.dtype != torch.int64:
                raise RequestError(f"{what}: row ids of chunk {k} must be int64, got {r.dtype}", "bad_dtype")
            if r.dim() != 1:
                raise RequestError(f"{what}: row ids of chunk {k} must be 1-D, got shape {list(r.shape)}", "bad_shape")
            n = r.numel()
            if n:
                lo, hi = int(r.min()), int(r.max())
                if lo < 0 or hi >= c.rows:
                    bad = lo if lo < 0 else hi
                    raise RequestError(f"{what}: row id {bad} of chunk {k} is out of range [0, {c.rows})",
                                       "bad_request")
                if n > 1 and not bool((r[1:] > r[:-1]).all()):
                    dup = bool((r[1:] == r[:-1]).any()) or torch.unique(r).numel() != n
                    raise RequestError(f"{what}: row ids of chunk {k} must be strictly increasing ("
                                       f"{'duplicate ids' if dup else 'not sorted'})", "bad_request")
            if tensors is not None:
                g = tensors[i]
                if g.dtype != c.param.dtype:
                    raise RequestError(f"{what}: chunk {k} is {c.param.dtype}, got row gradients of {g.dtype}",
                                       "bad_dtype")
                if tuple(g.shape) != (n, c.dim):
                    raise RequestError(f"{what}: row gradients of chunk {k} must have shape [{n}, {c.dim}] "
                                       f"({n} rows of width {c.dim}), got {list(g.shape)}", "bad_shape")

    def row_values(self, row_keys: Sequence[int], rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Copies of rows ``rows[i]`` of chunk ``row_keys[i]``, each ``[len(rows[i]), dim]`` (a gather:
        the rows are not contiguous, and the copy keeps a reply from showing a later update)."""
        chunks = [self.chunks[k] for k in row_keys]
        return tuple(c.param.view(-1, c.dim).index_select(0, r.to(c.param.device)) for c, r in zip(chunks, rows))

    def _step_rows_and_tick(self, dense: Sequence[int], sparse: RowGrads) -> None:
        """The row-sparse part of one update: the rows of ``sparse`` stepped, every other row-sparse chunk
        not stepped whole (``dense``) ticked."""
        for k, r, g in zip(*sparse):
            c = self.chunks[k]
            c.optimizer.step_rows(c.param, r, g, c.dim)
        if self.row_chunks:
            stepped = set(dense) | set(sparse.keys)
            for k in self.row_chunks:
                if k not in stepped:
                    self.chunks[k].optimizer.tick()

    def check_keys(self, keys: Iterable[int]) -> None:
        for k in keys:
            if k not in self.chunks:
                raise RequestError(f"shard {self.shard_id} does not own chunk {k}", "unknown_key")

    def values(self, keys: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The chunks' current values (the shard's own tensors: send them, do not mutate them)."""
        return tuple(self.chunks[k].param for k in keys)

    # ---------------------------------------------------------------- membership
    def add_worker(self, worker: str) -> None:
        """Count ``worker`` in sync rounds and SSP bounds. One that joins (or comes back) late starts at the
        slowest live worker's clock: from 0 it would hold every other worker back until it caught up."""
        slowest = min((self.clock.get(w, 0) for w in self.live_workers), default=0)
        self.live_workers.add(worker)
        self.clock.setdefault(worker, slowest)
        self.departed.discard(worker)

    def remove_worker(self, worker: str) -> None:
        """Stop counting ``worker`` (leave, drop): a round or push waiting only for it is released
        (:meth:`next_release`). Counted again if it pushes again."""
        if worker in self.live_workers:
            self.departed.add(worker)
        self.live_workers.discard(worker)
        self.clock.pop(worker, None)
        if self.round_complete():
            self._rounds_done.append(self.finish_round())

    # ---------------------------------------------------------------- retried pushes
    def seen(self, worker: str, seq: int) -> str:
        """Whether ``worker``'s push number ``seq`` was seen before: ``"applied"`` (its update is in the
        parameters: answer with the current values), ``"pending"`` (sync: it is in the round in progress:
        answer when the round completes) or ``""`` (new, or ``seq`` 0: apply it)."""
        if seq <= 0:
            return ""
        if seq <= self.last_seq.get(worker, 0):
            return "applied"
        if self.round_seq.get(worker) == seq:
            return "pending"
        return ""

    # ---------------------------------------------------------------- the push
    def push(self, push: Push, stopping: bool = False) -> ReplyNow | AwaitRound | AwaitStaleness | Refuse:
        """Decide ``push`` (module docstring; raises RequestError for a malformed one). ``stopping``: the
        shard is on its way out: a sync round or the SSP bound would wait for workers stopping too."""
        worker, seq = push.sender, push.seq
        self.check(push.keys, push.grads, "push")
        self.check_rows(*push.sparse_grads, "push", push.keys)
        self.check_rows(push.want_keys, push.want_rows, None, "push (want_rows)")
        if self.reject_nonfinite:
            self.check_finite(push.keys, push.grads, "push")
            self.check_finite(push.row_keys, push.row_grads, "push (row_grads)")
        seen = self.seen(worker, seq)
        if seen == "applied":  # its reply was lost: answered, not applied twice
            return ReplyNow(duplicate=True)
        if seen == "pending" and not stopping:
            return AwaitRound(self.version, duplicate=True)
        for ticket, waiting in self.waiting.items():
            if seq and (waiting.sender, waiting.seq) == (worker, seq):
                return AwaitStaleness(ticket, duplicate=True)
        if worker in self.departed:  # left or dropped, and pushing again: it came back
            self.add_worker(worker)
        if self.consistency == Consistency.SYNC:
            if worker not in self.live_workers:
                return Refuse("bad_request", f"{worker} is not in this sync group ({sorted(self.live_workers)})")
            if stopping:
                return Refuse("shutting_down", f"shard {self.node} is stopping; sync round {self.version} will not "
                                               "complete")
            if worker in self.round_members:
                return Refuse("bad_request", f"{worker} pushed twice in sync round {self.version}")
            round_id = self.version
            if push.want_keys:  # copies of the ids (small): the frames are released before the round completes
                self.round_wants[worker] = (push.want_keys, tuple(r.clone() for r in push.want_rows))
            self.contribute(worker, push.keys, push.grads, push.samples, seq, push.sparse_grads)
            if self.round_complete():
                self._rounds_done.append(self.finish_round())
            return AwaitRound(round_id)
        if not self.ssp_ready(worker):
            if stopping:
                return Refuse("shutting_down", f"shard {self.node} is stopping; {worker}'s push waited for the SSP "
                                               "bound and was not applied")
            self._tickets += 1
            self.waiting[self._tickets] = push
            return AwaitStaleness(self._tickets)
        return ReplyNow(self._apply_push(push))

    def next_release(self) -> RoundDone | Released | None:
        """The next waiter to answer now, or None: a finished sync round, or a push that waited for the SSP
        bound and is within it now, applied by this call (one at a time: its reply is copied before the
        next one changes the chunks). Call after every :meth:`push` and :meth:`remove_worker`."""
        if self._rounds_done:
            return self._rounds_done.pop(0)
        for ticket, push in self.waiting.items():
            if self.ssp_ready(push.sender):
                del self.waiting[ticket]
                return Released(ticket, push, self._apply_push(push))
        return None

    def withdraw(self, ticket: int) -> None:
        """SSP: push ``ticket`` is no longer waiting (its request timed out, or the shard stops)."""
        self.waiting.pop(ticket, None)

    def _apply_push(self, push: Push) -> Replicate:
        self.apply(push.sender, push.keys, push.grads, push.samples, push.seq, push.sparse_grads)
        return Replicate(group=self.shard_id, fseq=0, op="push", keys=push.keys, grads=push.grads, worker=push.sender,
                         seq=push.seq, samples=push.samples, **push.sparse_grads.fields())

    # ---------------------------------------------------------------- async / ssp
    def ssp_ready(self, worker: str) -> bool:
        """SSP: may ``worker`` apply another update? Only within ``staleness`` of the slowest."""
        if self.consistency != Consistency.SSP or len(self.live_workers) <= 1:
            return True
        slowest = min(self.clock.get(w, 0) for w in self.live_workers)
        return self.clock.get(worker, 0) - slowest <= self.staleness

    def apply(self, worker: str, keys: Sequence[int], grads: Sequence[torch.Tensor], samples: int,
              seq: int = 0, sparse: RowGrads = RowGrads()) -> int:
        """Apply one worker's gradients at once (async, ssp); returns the new version. ``seq``: the
        push's number (0: none), remembered so that a retry of it is not applied again (:meth:`seen`).
        ``sparse``: its row-sparse part (checked: :meth:`check_rows`)."""
        for k, g in zip(keys, grads):
            c = self.chunks[k]
            c.optimizer.step(c.param, g)
        self._step_rows_and_tick(keys, sparse)
        self.version += 1
        self.updates_applied += 1
        self.samples += samples
        if worker in self.clock:
            self.clock[worker] += 1
        if seq > 0:
            self.last_seq[worker] = max(seq, self.last_seq.get(worker, 0))
        return self.version

    # ---------------------------------------------------------------- sync
    def contribute(self, worker: str, keys: Sequence[int], grads: Sequence[torch.Tensor], samples: int,
                   seq: int = 0, sparse: RowGrads = RowGrads()) -> None:
        """Sync: fold one worker's gradients into this round's aggregation buffers (``seq``: as for
        :meth:`apply`, remembered as applied when the round is; the row-sparse part as for :meth:`apply`)."""
        self.round_members.add(worker)
        self.zero_row_buffers()
        if seq > 0:
            self.round_seq[worker] = seq
        for k, g in zip(keys, grads):
            c = self.chunks[k]
            if c.agg is None:
                c.agg = torch.zeros_like(c.param) if c.dim else torch.empty_like(c.param)
            # First arrival copied (its receive frame is released after this request), later added in place.
            # A row-sparse chunk's buffer is kept at zero between rounds (rows may come first): always added.
            if c.buffer:  # values, not gradients: summed for the mean, or the maximum (BufferRule)
                c.optimizer.fold(c.agg, g, first=c.contributors == 0)
            else:
                accumulate(c.agg, g, first=c.contributors == 0 and not c.dim)
            c.contributors += 1
        for k, r, g in zip(*sparse):
            c = self.chunks[k]
            if c.agg is None:
                c.agg = torch.zeros_like(c.param)
            c.agg.view(-1, c.dim).index_add_(0, r, g)
            # A copy of the ids (small): the received ones are views of a frame released after this request.
            c.touched.append(r.clone())
        self.samples += samples
        self.round_samples += samples

    def zero_row_buffers(self) -> None:
        """Sync: zero the aggregation buffers of row-sparse chunks the last round applied whole (call before
        the next contribution; the round's forward has read them by then)."""
        for k in self._zero_after_forward:
            self.chunks[k].agg.zero_()
        self._zero_after_forward = ()

    def round_complete(self) -> bool:
        return bool(self.round_members) and self.live_workers <= self.round_members

    def finish_round(self) -> RoundDone:
        """Sync: average and apply the round's gradients (a member that did not touch a row of a row-sparse
        chunk contributed zero to it)."""
        round_id = self.version
        applied: list[int] = []
        members = max(1, len(self.round_members))
        row_keys: list[int] = []
        row_ids: list[torch.Tensor] = []
        row_grads: list[torch.Tensor] = []
        for c in self.chunks.values():
            if c.contributors:
                if c.buffer:  # the members' mean (or maximum) becomes the buffers' value
                    c.optimizer.finish(c.agg, c.contributors)
                elif c.dim:  # a row-sparse chunk pushed whole (by some member): every member's share counts
                    if members > 1:
                        scale_(c.agg, 1.0 / members)
                else:
                    if c.contributors > 1:
                        scale_(c.agg, 1.0 / c.contributors)
                c.optimizer.step(c.param, c.agg)
                c.contributors = 0
                c.touched.clear()
                applied.append(c.key)
            elif c.touched:
                rows = torch.unique(torch.cat(c.touched))  # sorted, each once
                c.touched.clear()
                agg = c.agg.view(-1, c.dim)
                g = agg.index_select(0, rows)
                if members > 1:
                    scale_(g, 1.0 / members)
                agg.index_fill_(0, rows, 0)  # zero again for the next round
                row_keys.append(c.key)
                row_ids.append(rows)
                row_grads.append(g)
        rows = RowGrads(tuple(row_keys), tuple(row_ids), tuple(row_grads))
        self._step_rows_and_tick(applied, rows)
        self.round_members.clear()
        for w, seq in self.round_seq.items():
            self.last_seq[w] = max(seq, self.last_seq.get(w, 0))
        keys, grads = tuple(applied), tuple(self.chunks[k].agg for k in applied)
        self.last_round = (keys, grads, dict(self.round_seq), self.round_samples)
        forward = Replicate(group=self.shard_id, fseq=0, op="round", keys=keys, grads=grads, samples=self.round_samples,
                            round_seqs=dict(self.round_seq), **rows.fields())
        # A row-sparse chunk pushed whole: its buffer goes back to zero (rows may come first next round), once
        # the backup has it (ps_shard waits for the round's forward before the next round writes buffers).
        self._zero_after_forward = tuple(k for k in applied if self.chunks[k].dim)
        self.round_seq.clear()
        self.round_samples = 0
        self.version += 1
        self.updates_applied += 1
        wants, self.round_wants = self.round_wants, {}
        # Row-sparse chunks only where pushed whole: their members want rows (gathered now: their copy).
        return RoundDone(round_id, self.version, tuple(k for k, c in self.chunks.items() if not c.dim or k in keys),
                         {w: (wk, self.row_values(wk, wr)) for w, (wk, wr) in wants.items()}, forward)

    def apply_round(self, keys: Sequence[int], grads: Sequence[torch.Tensor], samples: int,
                    seqs: dict[str, int], sparse: RowGrads = RowGrads()) -> int:
        """A backup (sync): apply a round its primary completed (:attr:`RoundDone.forward`: the averaged
        gradients and rows, the push numbers it applied per worker, its examples); returns the new version."""
        for k, g in zip(keys, grads):
            c = self.chunks[k]
            c.optimizer.step(c.param, g)
        self._step_rows_and_tick(keys, sparse)
        for w, seq in seqs.items():
            self.last_seq[w] = max(int(seq), self.last_seq.get(w, 0))
        self.samples += samples
        self.version += 1
        self.updates_applied += 1
        return self.version

    # ---------------------------------------------------------------- replicas
    def replicate(self, msg: Replicate) -> str:
        """A backup: apply its primary's forward ``msg`` in the primary's order (``fseq``: a repeat is
        acknowledged, not applied again; a gap is refused); returns the ack's detail."""
        group, last = msg.group, self.applied_forward
        if msg.op == "state":
            try:
                self.load_replica_bytes(msg.grads[0] if msg.grads else torch.empty(0, dtype=torch.uint8))
            except Exception as exc:  # another layout or a damaged copy: nothing changed
                raise RequestError(f"replicate of {group!r}: unusable copy ({exc.__class__.__name__}: {exc})",
                                   "bad_request") from None
            self.applied_forward = msg.fseq
            return f"copy of {group} at version {self.version}"
        if 0 <= msg.fseq <= last:  # a repeat (the primary retried): applied once
            return f"forward {msg.fseq} of {group} was applied already"
        if last < 0 or msg.fseq != last + 1:
            raise RequestError(f"replicate of {group!r}: forward {msg.fseq} out of order (last applied "
                               f"{'none: a copy is expected first' if last < 0 else last})", "out_of_order")
        self.check(msg.keys, msg.grads, "replicate")
        self.check_rows(*msg.sparse_grads, "replicate", msg.keys)
        if msg.op == "push":
            self.apply(msg.worker, msg.keys, msg.grads, msg.samples, msg.seq, msg.sparse_grads)
        elif msg.op == "round":
            self.apply_round(msg.keys, msg.grads, msg.samples, msg.round_seqs, msg.sparse_grads)
        elif msg.op == "init":
            self.set_values(msg.keys, msg.grads)
        else:
            raise RequestError(f"replicate: op must be push, round, init or state, got {msg.op!r}", "bad_request")
        self.applied_forward = msg.fseq
        return ""

    def replica_bytes(self) -> torch.Tensor:
        """A whole copy of this core for a new backup, serialized (uint8): its :meth:`state_dict` plus the
        workers counted in sync rounds and SSP bounds and their clocks. Serialized rather than sent as
        tensors: it happens once per new backup, and one tensor keeps the message's schema flat."""
        state = self.state_dict()
        state["live_workers"] = sorted(self.live_workers)
        state["departed"] = sorted(self.departed)
        state["clock"] = dict(self.clock)
        buf = io.BytesIO()
        torch.save(state, buf)
        return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)

    def load_replica_bytes(self, data: torch.Tensor) -> None:
        """Become the copy :meth:`replica_bytes` made (``ValueError`` for another layout or optimizer)."""
        state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        self.load_state_dict(state)
        self.live_workers = set(state.get("live_workers", self.live_workers))
        self.departed = set(state.get("departed", self.departed))
        self.clock = {str(w): int(c) for w, c in state.get("clock", {}).items()}
        self.round_members.clear()
        self.round_wants.clear()
        self.round_samples = 0
        for c in self.chunks.values():
            c.contributors = 0
            if c.dim and c.touched:
                c.touched.clear()
                c.agg.zero_()

    # ---------------------------------------------------------------- init / checkpoint
    def set_values(self, keys: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        for k, v in zip(keys, values):
            self.chunks[k].param.copy_(v)

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed shard needs, plus what a report wants to know of the checkpoint
        (``version``, ``updates_applied``, ``samples`` and ``written_at``, Unix time). ``last_seq``: the
        last push number applied per worker, with the parameters that hold those pushes (a sync round's
        contributions in progress are not in the parameters, so not in it either)."""
        return {"shard_id": self.shard_id, "version": self.version, "updates_applied": self.updates_applied,
                "samples": self.samples, "written_at": time.time(), "optimizer": self.optimizer_name,
                "last_seq": dict(self.last_seq),
                "params": {k: c.param for k, c in self.chunks.items()},
                "optim": {k: c.optimizer.state_dict() for k, c in self.chunks.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Become the state :meth:`state_dict` saved (``ValueError`` for another layout or optimizer). A
        checkpoint written before buffers were laid out lacks the buffer chunks: they keep their values."""
        if set(state["params"]) != set(self.chunks) and set(state["params"]) != set(self.chunks) - self.buffer_keys:
            raise ValueError(f"checkpoint of shard {state.get('shard_id')} holds chunks {sorted(state['params'])}, "
                             f"this shard owns {sorted(self.chunks)}: the layout or shard count changed")
        if state["optimizer"] != self.optimizer_name:
            raise ValueError(f"checkpoint used optimizer {state['optimizer']!r}, config says {self.optimizer_name!r}")
        for k, c in self.chunks.items():
            if k not in state["params"]:  # a buffer chunk of an older checkpoint (see above)
                continue
            c.param.copy_(state["params"][k])
            c.optimizer.load_state_dict(state["optim"][k])
        self.version = state["version"]
        self.updates_applied = state["updates_applied"]
        self.samples = state["samples"]
        # Checkpoints written before retried pushes were deduplicated have none: every retry is new.
        self.last_seq = {str(w): int(s) for w, s in state.get("last_seq", {}).items()}
        self.round_seq.clear()

    def snapshot(self) -> dict[str, Any]:
        """A :meth:`state_dict` that owns its tensors (copies): later updates do not change it,
        so it can be written by another thread while the shard goes on (:func:`hmp.ps.checkpoint.write`)."""
        state = self.state_dict()  # optimizer states are copies already
        state["params"] = {k: p.clone() for k, p in state["params"].items()}
        return state

    def save(self, path: Path, keep_previous: bool = True) -> None:
        """Write a checkpoint (:func:`hmp.ps.checkpoint.write`) on the calling thread."""
        checkpoint.write(self.state_dict(), path, keep_previous)

    def load(self, path: Path) -> None:
        """Load one checkpoint file, verified (:func:`hmp.ps.checkpoint.read`); :class:`CheckpointError` if
        it is unusable, ``ValueError`` if it belongs to another layout or optimizer."""
        self.load_state_dict(checkpoint.read(path))

    def resume(self, path: Path) -> tuple[Path, list[CheckpointError]]:
        """Load ``path``, or if it is unusable the checkpoint before it (``NAME.prev.pt``).
        Returns the file loaded and the errors of the files passed over (one at most); raises
        :class:`CheckpointError` naming both files when neither is usable."""
        errors: list[CheckpointError] = []
        for candidate in (path, checkpoint.previous_checkpoint(path)):
            try:
                state = checkpoint.read(candidate)
            except CheckpointError as exc:
                errors.append(exc)
                continue
            self.load_state_dict(state)
            return candidate, errors
        raise CheckpointError(path, "no usable checkpoint: " + "; ".join(str(e) for e in errors))
