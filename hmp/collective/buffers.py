"""A ring's module buffers (BatchNorm running statistics) averaged over its members at every step.

The members' parameters stay identical (they step on the same summed gradients), but each forward
pass updates a replica's running statistics from its own slice of the global batch. Each step's
control all-reduce (stop votes, loss) carries the buffers too, as float64 after its own slots, and
every member takes the members' mean: the replicas' buffers are then identical again, as their
parameters are, and follow the statistics of the whole global batch. Why the mean rather than DDP's
broadcast from rank 0: docs/buffers.md.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


class BufferMean:
    """Packs a replica's flat buffer tensors (``{dtype: 1-D tensor}``, :attr:`hmp.flat.FlatBuffers.buffers`)
    into a float64 slice and writes the members' mean back. Integer and bool buffers take the mean rounded
    to the nearest value (counters such as ``num_batches_tracked`` are equal on every member: the mean is
    that value); float64 holds integers exactly up to 2**53."""

    def __init__(self, buffers: Mapping[str, Tensor]) -> None:
        self.buffers = tuple(b for _, b in sorted(buffers.items()) if b.numel())
        #: float64 elements the buffers take in the all-reduced tensor
        self.numel = sum(b.numel() for b in self.buffers)

    def pack(self, out: Tensor) -> None:
        """Copy the buffers' current values into ``out`` (float64, :attr:`numel` elements)."""
        pos = 0
        for b in self.buffers:
            out[pos:pos + b.numel()].copy_(b.detach())
            pos += b.numel()

    def unpack(self, summed: Tensor, members: int) -> None:
        """Write ``summed`` (every member's :meth:`pack` added up) divided by ``members`` into the buffers."""
        if members < 1:
            raise ValueError(f"members must be >= 1, got {members}")
        pos = 0
        with torch.no_grad():
            for b in self.buffers:
                mean = summed[pos:pos + b.numel()] / members
                if not (b.is_floating_point() or b.is_complex()):
                    mean = mean.round()
                b.copy_(mean.to(b.device))
                pos += b.numel()


__all__ = ["BufferMean"]
