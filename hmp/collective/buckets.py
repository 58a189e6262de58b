"""Gradient buckets: slices of the flat gradient buffers that become ready during ``backward()``.

As in PyTorch's DDP, buckets group parameters in reverse order, so the ring can start all-reducing
the last layers' gradients while backward is still computing the first ones; each bucket is a
contiguous slice view of a flat per-dtype buffer, so reducing it in place updates the parameters'
``.grad`` with no copy. docs/collective.md, "Gradient buckets", explains the layout and the hooks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping

from torch import Tensor, nn

from hmp.flat import FlatLayout, ParamSlot, torch_dtype

#: DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """Elements ``[start, end)`` of the ``dtype`` gradient buffer: the gradients of ``params``
    (names, in reverse parameter order, i.e. the order autograd usually produces them)."""

    index: int
    dtype: str
    start: int
    end: int
    params: tuple[str, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def plan_buckets(layout: FlatLayout, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[Bucket, ...]:
    """Buckets of ``layout`` in reverse parameter order (see the module docstring); bucket 0 holds
    the last parameters. Each is contiguous; together they cover every flat buffer exactly once."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    groups: list[tuple[int, list[ParamSlot]]] = []  # (position of its first slot in reverse order, slots)
    open_: dict[str, tuple[int, list[ParamSlot], int]] = {}  # dtype -> (first position, slots, bytes)
    itemsizes = {}
    for pos, slot in enumerate(reversed(layout.slots)):
        size = itemsizes.get(slot.dtype)
        if size is None:
            size = itemsizes[slot.dtype] = torch_dtype(slot.dtype).itemsize
        first, slots, nbytes = open_.get(slot.dtype, (pos, [], 0))
        slots.append(slot)
        nbytes += slot.numel * size
        if nbytes >= bucket_bytes:
            groups.append((first, slots))
            open_.pop(slot.dtype, None)
        else:
            open_[slot.dtype] = (first, slots, nbytes)
    groups.extend((first, slots) for first, slots, _ in open_.values())
    groups.sort(key=lambda g: g[0])
    buckets = []
    for index, (_, slots) in enumerate(groups):
        for later, earlier in zip(slots, slots[1:]):  # reverse order: each one ends where the next starts
            if earlier.offset + earlier.numel != later.offset:
                raise AssertionError(f"parameters {earlier.name!r} and {later.name!r} are not adjacent in the "
                                     f"{later.dtype} buffer")
        d = slots[0].dtype
        buckets.append(Bucket(index, d, slots[-1].offset, slots[0].offset + slots[0].numel,
                              tuple(s.name for s in slots), itemsizes[d]))
    return tuple(buckets)


class GradientBuckets:
    """Bucket views of a bound model's flat gradients, and the hooks that say when each is ready.

    ``model`` must be bound to ``layout`` (``flat = layout.bind(model)``) and ``grads`` be
    ``flat.grads``; every parameter's ``.grad`` is checked to be its view. ``on_ready(index,
    view)`` is called once per bucket per backward pass, on the backward thread, in the order the
    buckets complete (reverse parameter order for a plain feed-forward model). Use as a context
    manager, or call :meth:`remove`, to take the hooks off again.
    """

    def __init__(self, model: nn.Module, layout: FlatLayout, grads: Mapping[str, Tensor],
                 on_ready: Callable[[int, Tensor], None], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.layout, self.on_ready, self.bucket_bytes = layout, on_ready, bucket_bytes
        self.buckets = plan_buckets(layout, bucket_bytes)
        self.views: tuple[Tensor, ...] = tuple(grads[b.dtype][b.start:b.end] for b in self.buckets)
        self._of: dict[str, int] = {name: b.index for b in self.buckets for name in b.params}
        slots = {s.name: s for s in layout.slots}
        self._lock = threading.Lock()
        self._left = [len(b.params) for b in self.buckets]
        self._fired = [False] * len(self.buckets)
        self._handles = []
        params = dict(model.named_parameters())
        missing = sorted(set(slots) - set(params))
        if missing:
            raise ValueError(f"model lacks the layout's parameters {missing}")
        for name, slot in slots.items():
            p = params[name]
            g = p.grad
            expected = grads[slot.dtype][slot.offset:slot.offset + slot.numel]
            if g is None or g.data_ptr() != expected.data_ptr() or g.numel() != slot.numel:
                raise ValueError(f"parameter {name!r}'s .grad is not its view of the flat {slot.dtype} gradient buffer "
                                 "(bind the model with FlatLayout.bind and pass flat.grads)")
        try:
            for name in slots:
                self._handles.append(params[name].register_post_accumulate_grad_hook(self._hook_for(name)))
        except BaseException:
            self.remove()
            raise

    def _hook_for(self, name: str) -> Callable[[Tensor], None]:
        index = self._of[name]

        def hook(_param: Tensor) -> None:
            with self._lock:
                if self._fired[index]:
                    raise RuntimeError(f"gradient bucket {index} (parameter {name!r}) completed twice without "
                                       "GradientBuckets.reset() in between")
                self._left[index] -= 1
                ready = self._left[index] == 0
                if ready:
                    self._fired[index] = True
            if ready:
                self.on_ready(index, self.views[index])

        return hook

    def __enter__(self) -> GradientBuckets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def pending(self) -> list[int]:
        """Buckets not fired yet in this pass."""
        with self._lock:
            return [i for i, fired in enumerate(self._fired) if not fired]

    def reset(self) -> None:
        """Re-arm every bucket for the next backward pass."""
        with self._lock:
            self._left = [len(b.params) for b in self.buckets]
            self._fired = [False] * len(self.buckets)

    def flush(self) -> list[int]:
        """Fire the buckets still pending (parameters that took no part in the pass), in order;
        returns their indices. Call after ``backward()`` returned."""
        with self._lock:
            todo = [i for i, fired in enumerate(self._fired) if not fired]
            for i in todo:
                self._fired[i] = True
        for i in todo:
            self.on_ready(i, self.views[i])
        return todo

    def remove(self) -> None:
        """Take every hook off the parameters (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


__all__ = ["Bucket", "DEFAULT_BUCKET_BYTES", "GradientBuckets", "plan_buckets"]
