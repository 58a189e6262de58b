"""The PS shard's sans-IO core: chunk ownership, aggregation, optimizer, consistency, checkpoints.

No sockets and no awaiting here: the node shell (:mod:`hmp.nodes.ps_shard`) calls these methods
from its event-loop thread, so the updates of a chunk never interleave; each chunk has exactly one
owner, the shard's loop (after PHub's one-owner-per-chunk rule).

Data path per chunk (1-D tensors, one dtype):
* ``async`` and ``ssp``: the pushed gradient (a read-only view over the receive frame) goes straight
  into the optimizer, which updates the parameter in place; no copy.
* ``sync``: the first gradient of a round is copied into the chunk's aggregation buffer (allocated
  once), later ones are added in place; when every live worker has contributed, the sum is scaled
  by 1/contributors and the optimizer applies it.

Checkpoint files (:meth:`ShardCore.write`, :meth:`ShardCore.read`): a 52-byte header (magic
``HMPSHARD``, format version, payload length, SHA-256 of the payload), then the ``torch.save``
payload of a :meth:`ShardCore.state_dict`. A file is verified before anything in it is trusted:
a torn, truncated or corrupted one is a :class:`CheckpointError` naming the file and what is
wrong with it. Writing keeps the previous checkpoint as ``NAME.prev.pt`` (rotated by rename), so
:meth:`ShardCore.resume` has a good one to fall back to.

Retried pushes (docs/protocol.md, "Shard restarts"): a push may carry a ``seq``, increasing per worker.
The core remembers the last ``seq`` applied from each worker (:attr:`ShardCore.last_seq`, saved in
checkpoints with the parameters it belongs to), and :meth:`ShardCore.seen` tells the shell that a
push was applied already: it is answered with the current values, not applied twice. In sync mode
a contribution counts as applied once its round is (:attr:`ShardCore.round_seq` until then): a
shard restarted from a checkpoint taken mid-round expects the round's contributions again.

Replicas (``[ps] replicas = 2``, docs/resilience.md): a backup shard keeps a core of its primary's chunk
group fed with what the primary applied: :meth:`ShardCore.apply` with the forwarded push (async, ssp),
:meth:`ShardCore.apply_round` with the round's averaged gradients (sync, :attr:`ShardCore.last_round`).
The optimizers are deterministic, so the same gradients applied in the same order give a bit-identical
copy: values, optimizer state, version and push numbers. :meth:`ShardCore.replica_bytes` is a whole
copy, for a new backup (:meth:`ShardCore.load_replica_bytes`).

Row-sparse tables (docs/protocol.md, "Row-sparse tables"): a chunk built with a row width (``row_dims``)
holds whole rows of an embedding table, and a push may carry gradients of some of its rows only
(``row_keys``, ``rows``, ``row_grads``; :meth:`ShardCore.check_rows`): only those rows of the values and
of the optimizer state change (:meth:`hmp.ps.optim.ChunkOptimizer.step_rows`). Every update of the
shard counts as a step of each of its row-sparse chunks, touched or not, so that a chunk's step count
(the schedule's and Adam's bias corrections') is the shard's update count, as for dense chunks. In sync
mode a round sums the rows its members pushed into the chunk's aggregation buffer (kept at zero
between rounds) and applies the union of the touched rows, averaged over the round's members (a member
that did not touch a row contributed zero to it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from hmp.config import Consistency
from hmp.errors import HmpError, RequestError
from hmp.messages import RowGrads
from hmp.ps.optim import accumulate, make_chunk_optimizer, scale_


#: checkpoint header: magic, format version, payload bytes, SHA-256 of the payload (little-endian)
CHECKPOINT_HEADER = struct.Struct("<8sIQ32s")
CHECKPOINT_MAGIC = b"HMPSHARD"
CHECKPOINT_FORMAT = 1


class CheckpointError(HmpError):
    """A checkpoint file that cannot be used: missing, empty, truncated, corrupted or not one of ours.
    ``path`` is the file, ``why`` what is wrong with it (one line)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


class _DigestWriter:
    """A file's ``write`` that also counts and hashes what goes through (what ``torch.save`` needs of a file)."""

    def __init__(self, f: Any) -> None:
        self.f, self.nbytes, self.sha256 = f, 0, hashlib.sha256()
        #: the OSError a write raised: torch.save reports it as a RuntimeError of its zip writer
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.nbytes += view.nbytes
        try:
            return self.f.write(view)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def previous_checkpoint(path: Path) -> Path:
    """Where the checkpoint before ``path`` is kept: ``ps0.pt`` -> ``ps0.prev.pt``."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


@dataclasses.dataclass
class ChunkState:
    """One chunk's parameter values, optimizer and (sync mode) aggregation buffer."""

    key: int
    param: torch.Tensor  # [numel], owned by the shard
    optimizer: Any
    agg: torch.Tensor | None = None  # [numel]; sync mode only, allocated once
    contributors: int = 0
    dim: int = 0  #: a row-sparse chunk's row width (0: dense)
    touched: list[torch.Tensor] = dataclasses.field(default_factory=list)  # sync: the rows pushed this round

    @property
    def rows(self) -> int:
        """Whole rows of a row-sparse chunk (0 for a dense one)."""
        return self.param.numel() // self.dim if self.dim else 0


class ShardCore:
    """State of one PS shard. ``version`` counts optimizer steps applied (the shard's clock)."""

    def __init__(self, shard_id: str, chunks: dict[int, torch.Tensor], optimizer: str, hyper: dict[str, Any],
                 consistency: str = Consistency.ASYNC, staleness: int = 0, workers: Iterable[str] = (),
                 row_dims: dict[int, int] | None = None) -> None:
        """``row_dims``: ``{chunk key: row width}`` of the chunks that hold rows of a row-sparse table."""
        if consistency not in tuple(Consistency):
            raise ValueError(f"consistency must be async, sync or ssp, got {consistency!r}")
        self.shard_id = shard_id
        self.consistency = consistency
        self.staleness = staleness
        self.optimizer_name, self.hyper = optimizer, dict(hyper)
        # Cloned once at start: the shard owns and mutates its chunks, while the given values are views of the
        # model (or of a received frame) that the caller keeps.
        row_dims = row_dims or {}
        self.chunks = {k: ChunkState(k, v.detach().clone().reshape(-1),
                                     make_chunk_optimizer(optimizer, v.numel(), dtype=v.dtype, **hyper),
                                     dim=int(row_dims.get(k, 0)))
                       for k, v in chunks.items()}
        for c in self.chunks.values():
            if c.dim and c.param.numel() % c.dim:
                raise ValueError(f"chunk {c.key} has {c.param.numel()} elements, not whole rows of width {c.dim}")
        #: the row-sparse chunks (ticked by updates that carry none of their rows)
        self.row_chunks = tuple(k for k, c in self.chunks.items() if c.dim)
        self.version = 0
        self.updates_applied = 0  # pushes applied (async/ssp) or rounds completed (sync)
        self.samples = 0
        # sync rounds and ssp clocks, per worker
        self.live_workers: set[str] = set()
        self.round_members: set[str] = set()
        self.clock: dict[str, int] = {}
        # Retried pushes: the last seq applied per worker (in checkpoints), and (sync) the seq each member
        # contributed to the round in progress, applied when the round is.
        self.last_seq: dict[str, int] = {}
        self.round_seq: dict[str, int] = {}
        self.round_samples = 0  # sync: the examples of the round in progress
        #: sync: what the last finish_round applied, ``(keys, gradients, seqs, samples)``, for a backup
        #: (:meth:`apply_round`); the gradients are the aggregation buffers, valid until the next round starts
        self.last_round: tuple[tuple[int, ...], tuple[torch.Tensor, ...], dict[str, int], int] | None = None
        #: sync: the row-sparse part of the last round, ``(row keys, rows, averaged row gradients)`` (new tensors)
        self._zero_after_forward: tuple[int, ...] = ()  # sync: row-sparse chunks the last round applied whole
        self.last_round_rows = RowGrads()
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
        out = []
        for k, r in zip(row_keys, rows):
            c = self.chunks[k]
            out.append(c.param.view(-1, c.dim).index_select(0, r.to(c.param.device)))
        return tuple(out)

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

    def remove_worker(self, worker: str) -> None:
        self.live_workers.discard(worker)
        self.clock.pop(worker, None)

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
        if worker in self.round_members:
            raise RequestError(f"{worker} pushed twice in sync round {self.version}", "bad_request")
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

    def finish_round(self) -> int:
        """Sync: average and apply the round's gradients; returns the new version."""
        applied: list[int] = []
        members = max(1, len(self.round_members))
        row_keys: list[int] = []
        row_ids: list[torch.Tensor] = []
        row_grads: list[torch.Tensor] = []
        for c in self.chunks.values():
            if c.contributors:
                if c.dim:  # a row-sparse chunk pushed whole (by some member): every member's share counts
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
        self.last_round_rows = RowGrads(tuple(row_keys), tuple(row_ids), tuple(row_grads))
        self._step_rows_and_tick(applied, self.last_round_rows)
        self.round_members.clear()
        for w, seq in self.round_seq.items():
            self.last_seq[w] = max(seq, self.last_seq.get(w, 0))
        self.last_round = (tuple(applied), tuple(self.chunks[k].agg for k in applied), dict(self.round_seq),
                           self.round_samples)
        # A row-sparse chunk pushed whole: its buffer goes back to zero (rows may come first next round), once
        # the backup has it (ps_shard waits for the round's forward before the next round writes buffers).
        self._zero_after_forward = tuple(k for k in applied if self.chunks[k].dim)
        self.round_seq.clear()
        self.round_samples = 0
        self.version += 1
        self.updates_applied += 1
        return self.version

    def apply_round(self, keys: Sequence[int], grads: Sequence[torch.Tensor], samples: int,
                    seqs: dict[str, int], sparse: RowGrads = RowGrads()) -> int:
        """A backup (sync): apply a round its primary completed (:attr:`last_round`: the averaged
        gradients, the push numbers it applied per worker, its examples; :attr:`last_round_rows`: its
        row-sparse part); returns the new version."""
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
    def replica_bytes(self) -> torch.Tensor:
        """A whole copy of this core for a new backup, serialized (uint8): its :meth:`state_dict` plus the
        workers counted in sync rounds and SSP bounds and their clocks. Serialized rather than sent as
        tensors: it happens once per new backup, and one tensor keeps the message's schema flat."""
        state = self.state_dict()
        state["live_workers"] = sorted(self.live_workers)
        state["clock"] = dict(self.clock)
        buf = io.BytesIO()
        torch.save(state, buf)
        return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)

    def load_replica_bytes(self, data: torch.Tensor) -> None:
        """Become the copy :meth:`replica_bytes` made (``ValueError`` for another layout or optimizer)."""
        state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
        self.load_state_dict(state)
        self.live_workers = set(state.get("live_workers", self.live_workers))
        self.clock = {str(w): int(c) for w, c in state.get("clock", {}).items()}
        self.round_members.clear()
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
        if set(state["params"]) != set(self.chunks):
            raise ValueError(f"checkpoint of shard {state.get('shard_id')} holds chunks {sorted(state['params'])}, "
                             f"this shard owns {sorted(self.chunks)}: the layout or shard count changed")
        if state["optimizer"] != self.optimizer_name:
            raise ValueError(f"checkpoint used optimizer {state['optimizer']!r}, config says {self.optimizer_name!r}")
        for k, c in self.chunks.items():
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
        so it can be written by another thread while the shard goes on (:meth:`write`)."""
        state = self.state_dict()  # optimizer states are copies already
        state["params"] = {k: p.clone() for k, p in state["params"].items()}
        return state

    @staticmethod
    def write(state: dict[str, Any], path: Path, keep_previous: bool = True) -> None:
        """Write a state dict with its checksum header, atomically (temp file, fsync, rename); the
        checkpoint it replaces becomes :func:`previous_checkpoint` (unless ``keep_previous`` is false:
        then the previous one is left as it is). Touches no shard state, so it may run in a thread (on
        a :meth:`snapshot`). A failed write (``OSError``: disk full, unwritable folder) leaves no temp
        file, and the checkpoints that were there as they were."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                # Streamed through the digest, not serialized in memory first (that would cost a second
                # copy of the shard); the header, known only at the end, goes into the room left for it.
                f.write(bytes(CHECKPOINT_HEADER.size))
                payload = _DigestWriter(f)
                try:
                    torch.save(state, payload)
                except Exception:
                    if payload.error is not None:  # the disk's error, not torch's wrapper of it
                        raise payload.error from None
                    raise
                f.seek(0)
                f.write(CHECKPOINT_HEADER.pack(CHECKPOINT_MAGIC, CHECKPOINT_FORMAT, payload.nbytes,
                                               payload.sha256.digest()))
                f.flush()
                os.fsync(f.fileno())
            if keep_previous and path.exists():
                # Between these two renames only the previous checkpoint exists: resume() falls back to it.
                os.replace(path, previous_checkpoint(path))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # The renames themselves are durable only once the folder is.
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        """A checkpoint's state dict, verified against its header first; :class:`CheckpointError`
        (naming the file and what is wrong) for a missing, empty, truncated, corrupted or foreign file."""
        try:
            with open(path, "rb") as f:
                head = f.read(CHECKPOINT_HEADER.size)
                if not head:
                    raise CheckpointError(path, "empty file")
                if not head.startswith(CHECKPOINT_MAGIC):
                    raise CheckpointError(path, "not an hmp shard checkpoint (no HMPSHARD header; a bare "
                                                "torch.save file or another file)")
                if len(head) < CHECKPOINT_HEADER.size:
                    raise CheckpointError(path, f"truncated: {len(head)} bytes, shorter than the "
                                                f"{CHECKPOINT_HEADER.size}-byte header")
                _, fmt, length, digest = CHECKPOINT_HEADER.unpack(head)
                if fmt != CHECKPOINT_FORMAT:
                    raise CheckpointError(path, f"checkpoint format {fmt}; this hmp reads format {CHECKPOINT_FORMAT}")
                payload = f.read(length + 1)  # one more byte than announced: trailing bytes are an error too
        except FileNotFoundError:
            raise CheckpointError(path, "no such file") from None
        except IsADirectoryError:
            raise CheckpointError(path, "a directory, not a checkpoint file") from None
        except OSError as exc:
            raise CheckpointError(path, f"unreadable ({exc.strerror or exc})") from None
        if len(payload) < length:
            raise CheckpointError(path, f"truncated: the header announces {length} payload bytes, the file holds "
                                        f"{len(payload)}")
        if len(payload) > length:
            raise CheckpointError(path, f"more bytes than the header's {length}: not one whole checkpoint")
        if hashlib.sha256(payload).digest() != digest:
            raise CheckpointError(path, "corrupted: the payload's SHA-256 differs from the header's")
        try:
            state = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as exc:  # a checksummed payload torch cannot read: written by something else
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(path, f"unreadable payload ({exc.__class__.__name__}: {first[:200]})") from None
        if not isinstance(state, dict) or not {"params", "optim", "version"} <= set(state):
            raise CheckpointError(path, "not a shard state (params, optim, version missing)")
        return state

    def save(self, path: Path, keep_previous: bool = True) -> None:
        """Write a checkpoint (:meth:`write`) on the calling thread."""
        self.write(self.state_dict(), path, keep_previous)

    def load(self, path: Path) -> None:
        """Load one checkpoint file, verified (:meth:`read`); :class:`CheckpointError` if it is unusable,
        ``ValueError`` if it belongs to another layout or optimizer."""
        self.load_state_dict(self.read(path))

    def resume(self, path: Path) -> tuple[Path, list[CheckpointError]]:
        """Load ``path``, or if it is unusable the checkpoint before it (:func:`previous_checkpoint`).
        Returns the file loaded and the errors of the files passed over (one at most); raises
        :class:`CheckpointError` naming both files when neither is usable."""
        errors: list[CheckpointError] = []
        for candidate in (path, previous_checkpoint(path)):
            try:
                state = self.read(candidate)
            except CheckpointError as exc:
                errors.append(exc)
                continue
            self.load_state_dict(state)
            return candidate, errors
        raise CheckpointError(path, "no usable checkpoint: " + "; ".join(str(e) for e in errors))
