"""Agree on where to go on after a ring lost a member: the survivors' completed steps, and the most
advanced member's state for the others.

A member lost mid-step may have let some survivors finish that step and not others, so on the new
ring they sum their completed-step counts and, where these differ, the lowest-ranked member with
the most steps sends its ``snapshot()`` to the others in an all-reduce to which they add zeros.
It fails like any all-reduce (``RingBroken``): the caller waits for the next ring and calls it
again. See docs/architecture.md, "Collective data path".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from hmp.collective.ring import Ring

#: Operations one call uses at most (the caller numbers its next operation after them).
OPS = 3


@dataclasses.dataclass(frozen=True)
class Resynced:
    """The outcome: the step everyone is at now, the rank whose state was sent (None: the steps
    agreed), and every member's step before (by rank)."""

    step: int
    source: int | None
    steps: tuple[int, ...]


async def resync(ring: Ring, step: int, snapshot: Callable[[], bytes], restore: Callable[[bytes], None],
                 first_op: int = 0) -> Resynced:
    """Agree with the other members of ``ring`` on the step to go on from (module docstring).

    ``step``: the steps this member completed; ``snapshot()`` is called on the source only,
    ``restore(state)`` on the members behind it. Uses ops ``first_op .. first_op + OPS - 1``.
    """
    n = ring.size
    steps = torch.zeros(n, dtype=torch.int64)
    steps[ring.rank] = step
    await ring.all_reduce(steps, first_op)
    best = int(steps.max())
    all_steps = tuple(int(s) for s in steps)
    if int(steps.min()) == best:
        return Resynced(best, None, all_steps)
    source = all_steps.index(best)
    size = torch.zeros(1, dtype=torch.int64)
    blob = torch.zeros(0, dtype=torch.uint8)
    if ring.rank == source:
        # A copy into a fresh tensor: snapshot() returns bytes, and the ring sums in place.
        blob = torch.frombuffer(bytearray(snapshot()), dtype=torch.uint8)
        size[0] = blob.numel()
    await ring.all_reduce(size, first_op + 1)
    if ring.rank != source:
        blob = torch.zeros(int(size[0]), dtype=torch.uint8)
    await ring.all_reduce(blob, first_op + 2)  # the others add zeros: everyone ends with the source's bytes
    if step < best:  # members at the best step already hold the same state as the source
        restore(blob.numpy().tobytes())
    return Resynced(best, source, all_steps)


__all__ = ["OPS", "Resynced", "resync"]
