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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from hmp.config import Consistency
from hmp.errors import RequestError
from hmp.ps.optim import accumulate, make_chunk_optimizer, scale_


@dataclasses.dataclass
class ChunkState:
    """One chunk's parameter values, optimizer and (sync mode) aggregation buffer."""

    key: int
    param: torch.Tensor  # [numel], owned by the shard
    optimizer: Any
    agg: torch.Tensor | None = None  # [numel]; sync mode only, allocated once
    contributors: int = 0


class ShardCore:
    """State of one PS shard. ``version`` counts optimizer steps applied (the shard's clock)."""

    def __init__(self, shard_id: str, chunks: dict[int, torch.Tensor], optimizer: str, hyper: dict[str, Any],
                 consistency: str = Consistency.ASYNC, staleness: int = 0, workers: Iterable[str] = ()) -> None:
        if consistency not in tuple(Consistency):
            raise ValueError(f"consistency must be async, sync or ssp, got {consistency!r}")
        self.shard_id = shard_id
        self.consistency = consistency
        self.staleness = staleness
        self.optimizer_name, self.hyper = optimizer, dict(hyper)
        # Cloned once at start: the shard owns and mutates its chunks, while the given values are views of the
        # model (or of a received frame) that the caller keeps.
        self.chunks = {k: ChunkState(k, v.detach().clone().reshape(-1),
                                     make_chunk_optimizer(optimizer, v.numel(), dtype=v.dtype, **hyper))
                       for k, v in chunks.items()}
        self.version = 0
        self.updates_applied = 0  # pushes applied (async/ssp) or rounds completed (sync)
        self.samples = 0
        # sync rounds and ssp clocks, per worker
        self.live_workers: set[str] = set()
        self.round_members: set[str] = set()
        self.clock: dict[str, int] = {}
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

    def check_keys(self, keys: Iterable[int]) -> None:
        for k in keys:
            if k not in self.chunks:
                raise RequestError(f"shard {self.shard_id} does not own chunk {k}", "unknown_key")

    def values(self, keys: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The chunks' current values (the shard's own tensors: send them, do not mutate them)."""
        return tuple(self.chunks[k].param for k in keys)

    # ---------------------------------------------------------------- membership
    def add_worker(self, worker: str) -> None:
        self.live_workers.add(worker)
        self.clock.setdefault(worker, 0)

    def remove_worker(self, worker: str) -> None:
        self.live_workers.discard(worker)
        self.clock.pop(worker, None)

    # ---------------------------------------------------------------- async / ssp
    def ssp_ready(self, worker: str) -> bool:
        """SSP: may ``worker`` apply another update? Only within ``staleness`` of the slowest."""
        if self.consistency != Consistency.SSP or len(self.live_workers) <= 1:
            return True
        slowest = min(self.clock.get(w, 0) for w in self.live_workers)
        return self.clock.get(worker, 0) - slowest <= self.staleness

    def apply(self, worker: str, keys: Sequence[int], grads: Sequence[torch.Tensor], samples: int) -> int:
        """Apply one worker's gradients at once (async, ssp); returns the new version."""
        for k, g in zip(keys, grads):
            c = self.chunks[k]
            c.optimizer.step(c.param, g)
        self.version += 1
        self.updates_applied += 1
        self.samples += samples
        if worker in self.clock:
            self.clock[worker] += 1
        return self.version

    # ---------------------------------------------------------------- sync
    def contribute(self, worker: str, keys: Sequence[int], grads: Sequence[torch.Tensor], samples: int) -> None:
        """Sync: fold one worker's gradients into this round's aggregation buffers."""
        if worker in self.round_members:
            raise RequestError(f"{worker} pushed twice in sync round {self.version}", "bad_request")
        self.round_members.add(worker)
        for k, g in zip(keys, grads):
            c = self.chunks[k]
            if c.agg is None:
                c.agg = torch.empty_like(c.param)
            # First arrival copied (its receive frame is released after this request), later added in place.
            accumulate(c.agg, g, first=c.contributors == 0)
            c.contributors += 1
        self.samples += samples

    def round_complete(self) -> bool:
        return bool(self.round_members) and self.live_workers <= self.round_members

    def finish_round(self) -> int:
        """Sync: average and apply the round's gradients; returns the new version."""
        for c in self.chunks.values():
            if c.contributors:
                if c.contributors > 1:
                    scale_(c.agg, 1.0 / c.contributors)
                c.optimizer.step(c.param, c.agg)
                c.contributors = 0
        self.round_members.clear()
        self.version += 1
        self.updates_applied += 1
        return self.version

    # ---------------------------------------------------------------- init / checkpoint
    def set_values(self, keys: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        for k, v in zip(keys, values):
            self.chunks[k].param.copy_(v)

    def state_dict(self) -> dict[str, Any]:
        return {"shard_id": self.shard_id, "version": self.version, "updates_applied": self.updates_applied,
                "samples": self.samples, "optimizer": self.optimizer_name,
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

    def snapshot(self) -> dict[str, Any]:
        """A :meth:`state_dict` that owns its tensors (copies): later updates do not change it,
        so it can be written by another thread while the shard goes on (:meth:`write`)."""
        state = self.state_dict()  # optimizer states are copies already
        state["params"] = {k: p.clone() for k, p in state["params"].items()}
        return state

    @staticmethod
    def write(state: dict[str, Any], path: Path) -> None:
        """Write a state dict atomically (temp file, fsync, rename); touches no shard state, so it
        may run in a thread (on a :meth:`snapshot`)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def save(self, path: Path) -> None:
        """Write a checkpoint atomically (temp file, fsync, rename), on the calling thread."""
        self.write(self.state_dict(), path)

    def load(self, path: Path) -> None:
        self.load_state_dict(torch.load(path, weights_only=True))
