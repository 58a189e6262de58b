"""Parameter chunks that never straddle two layers, so each pipeline stage owns whole chunks.

The default layout (:class:`hmp.ps.layout.FlatLayout`) cuts the flat buffer every ``chunk_bytes``
regardless of parameter boundaries. A stage pushes the gradients of its own layers only; a chunk
holding the tail of one stage's parameters and the head of the next would then receive partial
gradients from two workers, which a stateful optimizer (Adam's moments) on the PS would apply as
if the missing half were zero. Cutting at every top-level layer boundary as well avoids that.
"""

from __future__ import annotations

from torch import nn

from hmp.ps.layout import Chunk, FlatLayout


def layer_of(param_name: str) -> int:
    """``"3.weight"`` -> 3: the top-level index of a parameter of an ``nn.Sequential``."""
    return int(param_name.split(".", 1)[0])


def layer_aligned_layout(model: nn.Sequential, chunk_bytes: int) -> FlatLayout:
    """``FlatLayout.from_model`` with an extra chunk boundary wherever the top-level layer changes."""
    base = FlatLayout.from_model(model, chunk_bytes)
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


def stage_chunk_keys(layout: FlatLayout, start: int, stop: int) -> tuple[int, ...]:
    """Keys of the chunks holding the parameters of layers ``[start, stop)`` (a layer-aligned layout).

    Parameters are laid out in layer order, so a stage's parameters of one dtype are one
    contiguous element range of that dtype's buffer.
    """
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
