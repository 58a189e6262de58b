"""hmp.collective.plans: which piece goes to which rank at which step (pure; no sockets)."""

from __future__ import annotations

import pytest

from hmp.collective.plans import HalvingSteps, RingLayout, power_of_two


def test_ring_layout_cuts_segments_and_pieces():
    """Segments differ by at most one element (empty ones when numel < N); pieces cover them exactly."""
    p = RingLayout.of(0, 3, 10, 2)
    assert p.starts == (0, 3, 6, 10) and p.counts == (2, 2, 2)
    assert [p.region(2, j) for j in range(2)] == [(6, 8), (8, 10)]
    small = RingLayout.of(0, 4, 2, 5)
    assert small.starts == (0, 0, 1, 1, 2) and small.counts == (0, 1, 0, 1)
    for size, numel, per in [(2, 1001, 16), (3, 7, 1), (4, 3, 2), (5, 1 << 12, 100)]:
        layout = RingLayout.of(0, size, numel, per)
        covered = sorted(layout.region(s, j) for s in range(size) for j in range(layout.counts[s]))
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_ring_steps_pass_each_segment_once_around_the_ring(size):
    """What rank r sends at step t is what rank r + 1 receives at step t; a segment is reduced at
    every rank but the one after its start (where it is final) and copied around after that;
    each rank receives every segment twice but two."""
    layouts = [RingLayout.of(r, size, 1000, 7) for r in range(size)]
    for r, layout in enumerate(layouts):
        assert layout.steps == 2 * size - 2 and layout.next == (r + 1) % size and layout.prev == (r - 1) % size
        for t in range(layout.steps):
            assert layouts[layout.next].received(t) == layout.sent(t)
            assert layout.reduces(t) == (t < size - 1)
            if t + 1 < layout.steps:
                assert layout.sent(t + 1) == layout.received(t)  # a received piece is forwarded at the next step
        assert layout.received(size - 2) == (r + 1) % size  # summed here at the last reduce-scatter step
        assert [t for t in range(layout.steps) if layout.final(t)] == list(range(size - 2, layout.steps))
        # never its own segment (it starts there), nor in the all-gather the one it summed
        assert layout.expected() == sum(layout.counts) * 2 - layout.counts[r] - layout.counts[(r + 1) % size]
    assert [s for s in range(layouts[0].steps) if layouts[0].answered(s)] == ([0, 2 * size - 3] if size > 2 else [1])


def test_a_stalled_ring_blames_the_silent_rank_from_the_steps_received():
    """Rank 4 of 5 takes no part: rank 1 gets nothing of step 1 (rank 4's segment via rank 0),
    so it blames rank 4; a step received in part, or the all-gather, blames the previous rank;
    the next rank is never blamed that way (it answered our step-0 pieces)."""
    layout = RingLayout.of(1, 5, 100, 10)  # every segment two pieces
    assert layout.silent({(0, 0), (0, 1)}) == 4
    assert layout.silent({(0, 0), (0, 1), (1, 0)}) == 0  # step 1 in part: the previous rank
    assert layout.silent(set()) == 0  # nothing of step 0: rank 0, the previous one
    everything = {(t, j) for t in range(layout.size - 1) for j in range(2)}
    assert layout.silent(everything) == 0  # the reduce-scatter is complete: the previous rank
    assert RingLayout.of(1, 3, 100, 10).silent({(0, 0), (0, 1)}) == 0  # rank 2 is the next: the previous instead


@pytest.mark.parametrize("size", [4, 8, 16])
def test_halving_steps_pair_ranks_and_cover_the_tensor(size):
    """Partners pair up (each sends what the other receives), the reduce-scatter leaves rank r
    with segment r, the all-gather brings back every other element exactly once, and every
    rank sends 2 (N - 1) / N of the tensor, as in the ring."""
    for numel, per in [(10007, 64), (3, 1), (size, 2), (1 << 12, 1 << 20)]:
        ranks = [HalvingSteps.of(r, size, numel, per) for r in range(size)]
        for r, hs in enumerate(ranks):
            assert hs.steps == 2 * hs.levels and 1 << hs.levels == size
            for t in range(hs.steps):
                q = ranks[hs.partners[t]]
                assert q.partners[t] == r and q.recvs[t] == hs.sends[t], (r, t)
            assert hs.recvs[hs.levels - 1] == (hs.starts[r], hs.starts[r + 1])  # own segment, summed
            assert [t for t in range(hs.steps) if hs.final(t)] == list(range(hs.levels - 1, hs.steps))
            assert [t for t in range(hs.steps) if hs.reduces(t)] == list(range(hs.levels))
            gathered = sorted([hs.recvs[hs.levels - 1], *hs.recvs[hs.levels:]])
            assert gathered[0][0] == 0 and gathered[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(gathered, gathered[1:]))
            sent = sum(hi - lo for lo, hi in hs.sends)
            assert abs(sent - 2 * (size - 1) * numel / size) <= 2 * hs.levels
            for t in range(hs.steps):  # pieces cover each range exactly
                span = hs.sends[t]
                regions = [hs.region(span, j) for j in range(hs.count(span))]
                assert sum(hi - lo for lo, hi in regions) == span[1] - span[0]
                assert list(hs.overlapping(span, *span)) == list(range(hs.count(span)))
    with pytest.raises(ValueError, match="power of two"):
        HalvingSteps.of(0, 6, 100, 10)
    assert [power_of_two(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [False, True, True, False, True, False, True]


def test_halving_piece_is_ready_once_the_earlier_steps_overlapping_it_were_applied():
    """Rank 0 of 4 over 40 elements in pieces of 5: step 1 sends [10, 20), which step 0 received
    as pieces 2 and 3 of [0, 20); the all-gather's first piece of each step is a request, the rest
    one-way; a stall blames the partner of the first step with pieces missing."""
    hs = HalvingSteps.of(0, 4, 40, 5)
    assert hs.partners == (2, 1, 1, 2) and hs.recvs[0] == (0, 20) and hs.sends[1] == (10, 20)
    lo, hi = hs.region(hs.sends[1], 0)
    assert list(hs.overlapping(hs.recvs[0], lo, hi)) == [2]
    assert not hs.ready(1, lo, hi, {(0, 0), (0, 1), (0, 3)})
    assert hs.ready(1, lo, hi, {(0, 2)}) and hs.ready(0, lo, hi, set())
    assert [(t, j) for t in range(hs.steps) for j in range(2) if hs.answered(t, j)] == [(2, 0), (3, 0)]
    step0 = {(0, j) for j in range(hs.count(hs.recvs[0]))}
    assert hs.silent(set()) == 2 and hs.silent(step0) == 1 and hs.silent(step0 | {(1, 0), (1, 1)}) == 1
