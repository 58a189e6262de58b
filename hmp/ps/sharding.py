"""Which PS shard owns which parameter chunk, identical on every node.

Every node builds the model with the same seed, lays it out in flat buffers (:mod:`hmp.flat`) and
assigns the chunks with the same deterministic greedy rule (:func:`assign_chunks`), so no node
needs to be told where a chunk lives; :class:`ShardedModel` holds the result. A layout's buffer chunks
(module buffers, docs/buffers.md) are assigned with the parameter chunks. With ``[ps] replicas
= 2`` each shard's chunks form a group backed up on the next shard (:func:`initial_replicas`,
:func:`next_backup`; docs/resilience.md).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hmp.flat import Chunk, FlatBuffers, FlatLayout, chunk_views


@dataclasses.dataclass
class ShardedModel:
    model: nn.Module
    layout: FlatLayout
    flat: FlatBuffers  # the model's parameters and gradients live here
    assignment: dict[int, list[int]]  # shard index -> chunk keys
    array: Any = None  # a FusedArray when the job is an HFTA sweep; ``model`` is then its fused model

    @classmethod
    def of(cls, model: nn.Module, layout: FlatLayout, num_shards: int, array: Any = None) -> ShardedModel:
        """Bind ``model``'s parameters to ``layout``'s flat buffers and assign the chunks to shards
        (none: an allreduce job's replica, no PS)."""
        flat = layout.bind(model)
        every = layout.chunks + layout.buffer_chunks
        return cls(model, layout, flat, assign_chunks(every, num_shards) if num_shards else {}, array)

    @property
    def chunks(self) -> dict[int, Chunk]:
        """Every chunk by key: the parameters' and the buffers'."""
        return {c.key: c for c in self.layout.chunks + self.layout.buffer_chunks}

    @property
    def buffer_keys(self) -> frozenset[int]:
        """The keys of the chunks that hold module buffers, not parameters (docs/buffers.md)."""
        return frozenset(c.key for c in self.layout.buffer_chunks)

    def initial_chunks(self, shard_index: int) -> dict[int, torch.Tensor]:
        views = {**self.param_views(), **self.buffer_views()}
        return {k: views[k].detach().cpu() for k in self.assignment[shard_index]}

    def param_views(self) -> dict[int, torch.Tensor]:
        """``{chunk key: 1-D view}`` into the flat parameter buffers (no copies)."""
        return chunk_views(self.flat.params, self.layout.chunks)

    def buffer_views(self) -> dict[int, torch.Tensor]:
        """``{chunk key: 1-D view}`` into the module buffers' flat buffers (no copies; empty without buffers)."""
        return chunk_views(self.flat.buffers, self.layout.buffer_chunks)

    def grad_views(self) -> dict[int, torch.Tensor]:
        """``{chunk key: 1-D view}`` into the flat gradient buffers (no copies)."""
        return chunk_views(self.flat.grads, self.layout.chunks)

    def report(self) -> ShardingReport:
        return sharding_report(self.layout.chunks + self.layout.buffer_chunks, self.assignment)


def initial_replicas(shard_ids: list[str], replicas: int = 2) -> dict[str, tuple[str, str]]:
    """``{group: (primary, backup)}`` at the start of a job: each shard is primary of its own group and
    backup of the previous shard's (``backup`` "" with ``replicas`` 1 or a single shard)."""
    n = len(shard_ids)
    return {s: (s, shard_ids[(i + 1) % n] if replicas > 1 and n > 1 else "") for i, s in enumerate(shard_ids)}


def next_backup(shard_ids: list[str], primary: str, live: set[str] | frozenset[str]) -> str:
    """The backup for a group whose primary is ``primary``: the first live shard after it in shard
    order (cyclically), never the primary itself; "" when no other shard is live."""
    i = shard_ids.index(primary)
    for step in range(1, len(shard_ids)):
        candidate = shard_ids[(i + step) % len(shard_ids)]
        if candidate in live:
            return candidate
    return ""


def assign_chunks(chunks: Iterable[Chunk], num_shards: int) -> dict[int, list[int]]:
    """Assign chunks to shards: ``{shard index: sorted chunk keys}``, every shard present.

    Greedy LPT: chunks in order of decreasing size (ties: lower key first), each to the
    shard with the fewest bytes so far (ties: lower shard index). Deterministic, and the
    most-loaded shard carries at most ``mean + largest chunk`` bytes.
    """
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
    items = sorted(chunks, key=lambda c: (-c.nbytes, c.key))
    if len({c.key for c in items}) != len(items):
        raise ValueError("chunk keys must be unique")
    heap = [(0, s) for s in range(num_shards)]  # (bytes so far, shard): heap order gives the tie rule
    assignment: dict[int, list[int]] = {s: [] for s in range(num_shards)}
    for c in items:
        load, s = heapq.heappop(heap)
        assignment[s].append(c.key)
        heapq.heappush(heap, (load + c.nbytes, s))
    for keys in assignment.values():
        keys.sort()
    return assignment


@dataclass(frozen=True, slots=True)
class ShardingReport:
    """How evenly an assignment spreads bytes. ``imbalance`` = max / mean (1.0 is perfect)."""

    bytes_per_shard: tuple[int, ...]
    chunks_per_shard: tuple[int, ...]
    total_bytes: int
    max_bytes: int
    mean_bytes: float
    largest_chunk_bytes: int
    imbalance: float

    def as_dict(self) -> dict:
        """Plain dict for JSON output."""
        return {
            "bytes_per_shard": list(self.bytes_per_shard),
            "chunks_per_shard": list(self.chunks_per_shard),
            "total_bytes": self.total_bytes,
            "max_bytes": self.max_bytes,
            "mean_bytes": self.mean_bytes,
            "largest_chunk_bytes": self.largest_chunk_bytes,
            "imbalance": self.imbalance,
        }


def sharding_report(chunks: Iterable[Chunk], assignment: Mapping[int, Iterable[int]]) -> ShardingReport:
    """Summarise ``assignment``; raises ``ValueError`` unless every chunk is placed exactly once."""
    by_key = {c.key: c for c in chunks}
    shards = sorted(assignment)
    if shards != list(range(len(shards))):
        raise ValueError(f"assignment shards must be 0..n-1, got {shards}")
    seen: set[int] = set()
    per_bytes, per_count = [], []
    for s in shards:
        keys = list(assignment[s])
        for k in keys:
            if k not in by_key:
                raise ValueError(f"shard {s} holds unknown chunk key {k}")
            if k in seen:
                raise ValueError(f"chunk {k} is placed on more than one shard")
            seen.add(k)
        per_bytes.append(sum(by_key[k].nbytes for k in keys))
        per_count.append(len(keys))
    missing = by_key.keys() - seen
    if missing:
        raise ValueError(f"chunks not placed on any shard: {sorted(missing)[:10]}")
    total = sum(per_bytes)
    mean = total / len(shards) if shards else 0.0
    largest = max((c.nbytes for c in by_key.values()), default=0)
    mx = max(per_bytes, default=0)
    return ShardingReport(
        tuple(per_bytes), tuple(per_count), total, mx, mean, largest, mx / mean if mean else 1.0
    )
