"""Tensors laid out back to back in one buffer, and the one 1-D tensor that spans them.

A fused optimizer updates every parameter with the same elementwise formula; when the
parameters (and their gradients, and the optimizer's state) are consecutive pieces of one
buffer, the update is one kernel per formula term over the whole buffer instead of one per
parameter (for the digits MLP at B=8: 2 kernels instead of 12). ``FusedArray`` allocates its
parameters and gradients this way; a parameter server's ``FlatLayout.bind`` does too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor covering ``tensors`` when they are contiguous, of one dtype and device,
    and lie back to back, in order, in one storage; else ``None``. A view: writing into it
    writes into the tensors (no copy)."""
    if not tensors:
        return None
    first = tensors[0]
    if not first.is_contiguous():
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.storage_offset() + first.numel()
    for t in tensors[1:]:
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.storage_offset() != end or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel()
    total = end - first.storage_offset()
    return first.detach().as_strided((total,), (1,), first.storage_offset())


def back_to_back(tensors: Sequence[torch.Tensor]) -> bool:
    """A cheap necessary condition for ``span``: each tensor starts where the previous ends."""
    for a, b in zip(tensors, tensors[1:]):
        if b.data_ptr() != a.data_ptr() + a.numel() * a.element_size():
            return False
    return True


def allocate_like(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One new zeroed buffer and views into it shaped like ``tensors`` (same dtype and device,
    which must agree), back to back in order."""
    first = tensors[0]
    total = sum(t.numel() for t in tensors)
    buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
    views, offset = [], 0
    for t in tensors:
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"tensors of one buffer must share dtype and device, got "
                             f"{first.dtype}/{first.device} and {t.dtype}/{t.device}")
        views.append(buffer[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return buffer, views


def member_vector(values: Sequence[float], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-element coefficients for the span of ``tensors`` (each ``[B, *]``): member b's value
    ``values[b]`` at every element of member b's slice of each tensor."""
    first = tensors[0]
    v = torch.tensor(list(values), dtype=first.dtype, device=first.device)
    return torch.cat([v.repeat_interleave(t[0].numel()) for t in tensors])
