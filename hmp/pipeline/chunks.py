"""Parameter chunks that never straddle two layers, so each pipeline stage owns whole chunks.

The default layout (:class:`hmp.flat.FlatLayout`) cuts the flat buffer every ``chunk_bytes``
regardless of parameter boundaries. A stage pushes the gradients of its own layers only; a chunk
holding the tail of one stage's parameters and the head of the next would then receive partial
gradients from two workers, which a stateful optimizer (Adam's moments) on the PS would apply as
if the missing half were zero. Cutting at every layer boundary as well avoids that. A "layer" is
the planner's (``hmp.placement.profiler.split_layers``), so the plan's layer indices, the
stage modules and the chunks agree.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from hmp.flat import Chunk, FlatLayout
from hmp.placement.profiler import param_layers


def _layer_of(layout: FlatLayout, owner: Mapping[str, int]) -> Mapping[str, int]:
    missing = [s.name for s in layout.slots if s.name not in owner]
    if missing:
        raise ValueError(f"parameters {missing[:3]} are not in the model's layers")
    return owner


def layer_aligned_layout(model: nn.Module, chunk_bytes: int) -> FlatLayout:
    """``FlatLayout.from_model`` with an extra chunk boundary wherever the (planner's) layer changes."""
    base = FlatLayout.from_model(model, chunk_bytes)
    layer_of = _layer_of(base, param_layers(model)).__getitem__
    chunks: list[Chunk] = []
    for dtype, total in base.sizes:
        per_chunk = chunk_bytes // Chunk(0, dtype, 0, 1).nbytes
        slots = [s for s in base.slots if s.dtype == dtype]
        # Contiguous element ranges of one layer each (named_parameters() order is layer order).
        segments: list[list[int]] = []
        for s in slots:
            if segments and segments[-1][2] == layer_of(s.name):
                segments[-1][1] = s.offset + s.numel
            else:
                segments.append([s.offset, s.offset + s.numel, layer_of(s.name)])
        for lo, hi, _ in segments:
            for start in range(lo, hi, per_chunk):
                chunks.append(Chunk(len(chunks), dtype, start, min(per_chunk, hi - start)))
        assert sum(c.numel for c in chunks if c.dtype == dtype) == total
    return FlatLayout(base.slots, base.sizes, tuple(chunks), chunk_bytes)


def stage_chunk_keys(layout: FlatLayout, start: int, stop: int, owner: Mapping[str, int]) -> tuple[int, ...]:
    """Keys of the chunks holding the parameters of layers ``[start, stop)`` (a layer-aligned layout).

    ``owner`` maps parameter names to layer indices (``param_layers(model)``). Parameters are laid
    out in layer order, so a stage's parameters of one dtype are one contiguous element range of
    that dtype's buffer.
    """
    layer_of = _layer_of(layout, owner).__getitem__
    ranges: dict[str, tuple[int, int]] = {}
    for s in layout.slots:
        if start <= layer_of(s.name) < stop:
            lo, hi = ranges.get(s.dtype, (s.offset, s.offset + s.numel))
            ranges[s.dtype] = (min(lo, s.offset), max(hi, s.offset + s.numel))
    keys = []
    for c in layout.chunks:
        if c.dtype not in ranges:
            continue
        lo, hi = ranges[c.dtype]
        if lo <= c.start and c.end <= hi:
            keys.append(c.key)
        elif lo < c.end and c.start < hi:
            raise ValueError(f"chunk {c.key} straddles a stage boundary; use layer_aligned_layout")
    return tuple(keys)
