"""Which piece of a tensor goes to which rank at which step of an all-reduce, for the ring
(:class:`RingLayout`) and for recursive halving-doubling (:class:`HalvingSteps`): pure arithmetic
on element ranges, apart from the sockets and timeouts of :mod:`hmp.collective.ring` that run them,
so that each layout can be checked on its own (docs/collective.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

#: An element range ``[lo, hi)`` of the tensor.
Span = tuple[int, int]


def power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _starts(size: int, numel: int) -> tuple[int, ...]:
    """Segment ``i`` is ``[starts[i], starts[i + 1])``: sizes differ by at most one, some empty when ``numel < size``."""
    return tuple(i * numel // size for i in range(size + 1))


@dataclasses.dataclass(frozen=True, slots=True)
class RingLayout:
    """Rank ``rank``'s part of the ring algorithm over ``size`` ranks: the tensor of ``numel``
    elements is cut into ``size`` segments (``starts``), segment ``i`` travelling as ``counts[i]``
    pieces of ``per_piece`` elements, piece ``j`` being ``region(i, j)``.

    Step ``t`` (``0 .. steps - 1``) sends segment ``sent(t)`` to rank ``next`` and receives segment
    ``received(t)`` from rank ``prev``: the first ``size - 1`` steps (the reduce-scatter) add what
    arrives, the rest (the all-gather) copy it. A received piece is forwarded at the next step.
    """

    rank: int
    size: int
    numel: int
    per_piece: int
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, rank: int, size: int, numel: int, per_piece: int) -> RingLayout:
        starts = _starts(size, numel)
        counts = tuple(-(-(starts[i + 1] - starts[i]) // per_piece) for i in range(size))
        return cls(rank, size, numel, per_piece, starts, counts)

    @property
    def steps(self) -> int:
        return 2 * self.size - 2

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    def sent(self, step: int) -> int:
        return (self.rank - step) % self.size

    def received(self, step: int) -> int:
        return (self.rank - step - 1) % self.size

    def reduces(self, step: int) -> bool:
        return step < self.size - 1

    def final(self, step: int) -> bool:
        """Whether what arrives at ``step`` is summed in full (the last reduce-scatter step on)."""
        return step >= self.size - 2

    def region(self, segment: int, piece: int) -> Span:
        lo = self.starts[segment] + piece * self.per_piece
        return lo, min(lo + self.per_piece, self.starts[segment + 1])

    def expected(self) -> int:
        """The pieces this rank receives in the whole operation."""
        return sum(self.counts[self.received(t)] for t in range(self.steps))

    def answered(self, step: int) -> bool:
        """Whether a step's pieces go as requests rather than one-way (without a window).

        The last step's: their answers tell the sender that the next rank consumed every piece of
        the operation. Step 0's, in rings of 3 or more: a rank that never starts an operation, or
        dies in it, leaves them unanswered, which names it."""
        return step == self.steps - 1 or (step == 0 and self.size > 2)

    def silent(self, seen: Collection[tuple[int, int]]) -> int:
        """The rank a stalled operation waits for, given the ``(step, piece)`` received here.

        One-way pieces have no answers that would show where they stopped; the steps received do.
        If rank ``m`` takes no part, rank ``m + k`` gets steps ``0 .. k - 2`` of the reduce-scatter
        (they come from the ranks between) and nothing of step ``k - 1``; so a rank that got nothing
        of its first incomplete step ``s < size - 1`` blames ``rank - s - 1``. Otherwise (a step in
        part, or the all-gather) the previous rank, which stopped sending. (The rank just before a
        silent one names it by its unanswered step-0 pieces instead; so that rank is never the next
        one, which answered ours: when ``rank - s - 1`` is the next rank, the previous one got its
        data to us and then died.)"""
        for step in range(self.size - 1):
            count = self.counts[self.received(step)]
            missing = sum((step, j) not in seen for j in range(count))
            if missing:
                silent = self.received(step)
                return silent if missing == count and silent != self.next else self.prev
        return self.prev


@dataclasses.dataclass(frozen=True, slots=True)
class HalvingSteps:
    """Rank ``rank``'s steps of recursive halving-doubling over ``size`` ranks (a power of two, >= 4).

    The tensor is cut into ``size`` segments as in :class:`RingLayout` (``starts``). Reduce-scatter
    step ``k`` (``0 .. L - 1``, ``L = log2(size)``) pairs each rank with ``rank ^ (size >> (k + 1))``:
    the two split the segments they still hold in half, each sends the other half and sums the half
    it keeps, so that after ``L`` steps rank ``r`` holds segment ``r`` summed. All-gather step
    ``L + i`` mirrors reduce-scatter step ``L - 1 - i`` (same partner): each sends what it kept
    there, now final, and receives what it sent there. Step ``t`` sends the elements ``sends[t]``
    to ``partners[t]`` and receives ``recvs[t]`` from it, each cut into pieces of ``per_piece``
    from its start (``region``).
    """

    rank: int
    size: int
    per_piece: int
    starts: tuple[int, ...]
    partners: tuple[int, ...]
    sends: tuple[Span, ...]
    recvs: tuple[Span, ...]

    @classmethod
    def of(cls, rank: int, size: int, numel: int, per_piece: int) -> HalvingSteps:
        if size < 4 or not power_of_two(size):
            raise ValueError(f"halving-doubling needs a power of two >= 4 members, got {size}")
        starts = _starts(size, numel)
        partners, send_segs, keep_segs = [], [], []
        a, b, d = 0, size, size // 2
        while d >= 1:
            m = (a + b) // 2
            keep, send = ((m, b), (a, m)) if rank & d else ((a, m), (m, b))
            partners.append(rank ^ d)
            send_segs.append(send)
            keep_segs.append(keep)
            (a, b), d = keep, d // 2
        partners += partners[::-1]
        send_segs, recv_segs = send_segs + keep_segs[::-1], keep_segs + send_segs[::-1]
        return cls(rank, size, per_piece, starts, tuple(partners),
                   tuple((starts[x], starts[y]) for x, y in send_segs),
                   tuple((starts[x], starts[y]) for x, y in recv_segs))

    @property
    def steps(self) -> int:
        return len(self.partners)

    @property
    def levels(self) -> int:
        """Reduce-scatter steps (``log2(size)``); the all-gather has as many."""
        return len(self.partners) // 2

    def reduces(self, step: int) -> bool:
        return step < self.levels

    def final(self, step: int) -> bool:
        """Whether what arrives at ``step`` is summed in full (the last reduce-scatter step on)."""
        return step >= self.levels - 1

    def count(self, span: Span) -> int:
        return -(-(span[1] - span[0]) // self.per_piece)

    def region(self, span: Span, piece: int) -> Span:
        lo = span[0] + piece * self.per_piece
        return lo, min(lo + self.per_piece, span[1])

    def overlapping(self, span: Span, lo: int, hi: int) -> range:
        """The pieces of ``span`` that share elements with ``[lo, hi)``."""
        lo, hi = max(lo, span[0]), min(hi, span[1])
        if lo >= hi:
            return range(0)
        return range((lo - span[0]) // self.per_piece, (hi - 1 - span[0]) // self.per_piece + 1)

    def answered(self, step: int, piece: int) -> bool:
        """Whether a piece goes as a request rather than one-way (without a window): an all-gather
        step's first, whose answer says that the partner applied the whole step. The first, not
        the last: a request is what starts a client's shared-memory handshake, and only one
        carrying arena memory, which a small last piece may not (it stays inline); the pieces after
        it then go by reference."""
        return step >= self.levels and piece == 0

    def ready(self, step: int, lo: int, hi: int, applied: Collection[tuple[int, int]]) -> bool:
        """Whether every piece of the steps before ``step`` that shares elements with ``[lo, hi)``
        is among the ``(step, piece)`` ``applied``."""
        return all((s, j) in applied for s in range(step) for j in self.overlapping(self.recvs[s], lo, hi))

    def silent(self, seen: Collection[tuple[int, int]]) -> int:
        """The rank a stalled operation waits for: the partner of the first step with pieces missing
        from the ``(step, piece)`` ``seen`` (best effort, as for the ring: that partner may itself
        wait for its own earlier partner)."""
        for t in range(self.steps):
            if any((t, j) not in seen for j in range(self.count(self.recvs[t]))):
                return self.partners[t]
        return self.partners[0]


__all__ = ["HalvingSteps", "RingLayout", "Span", "power_of_two"]
