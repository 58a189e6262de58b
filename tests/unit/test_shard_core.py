"""The PS shard core without sockets: validation, consistency modes, optimizer application, checkpoints."""

from __future__ import annotations

import pytest
import torch

from hmp.errors import RequestError
from hmp.ps.shard_core import ShardCore


def _core(consistency="async", staleness=0, optimizer="sgd", hyper=None):
    chunks = {0: torch.zeros(4), 5: torch.ones(3)}
    core = ShardCore("ps0", chunks, optimizer, hyper or {"lr": 0.5}, consistency, staleness)
    for w in ("a", "b"):
        core.add_worker(w)
    return core


def test_async_push_applies_at_once():
    """In async mode each push is applied immediately: p -= lr * g."""
    core = _core()
    core.apply("a", (0,), (torch.full((4,), 2.0),), samples=8)
    assert torch.equal(core.values((0,))[0], torch.full((4,), -1.0))
    assert core.version == 1 and core.samples == 8


def test_sync_round_averages_every_live_worker():
    """In sync mode nothing changes until every live worker contributed; then the mean gradient is applied once."""
    core = _core("sync")
    core.contribute("a", (0,), (torch.full((4,), 2.0),), 1)
    assert not core.round_complete()
    assert torch.equal(core.values((0,))[0], torch.zeros(4))
    core.contribute("b", (0,), (torch.full((4,), 4.0),), 1)
    assert core.round_complete()
    core.finish_round()
    assert torch.allclose(core.values((0,))[0], torch.full((4,), -1.5))


def test_ssp_bounds_how_far_a_worker_runs_ahead():
    """In ssp mode a worker more than `staleness` updates ahead of the slowest must wait."""
    core = _core("ssp", staleness=1)
    g = (torch.ones(4),)
    core.apply("a", (0,), g, 1)
    assert core.ssp_ready("a")
    core.apply("a", (0,), g, 1)
    assert not core.ssp_ready("a") and core.ssp_ready("b")
    core.apply("b", (0,), g, 1)
    assert core.ssp_ready("a")


@pytest.mark.parametrize(
    ("keys", "grads", "code"),
    [((7,), (torch.zeros(4),), "unknown_key"), ((0,), (torch.zeros(4, dtype=torch.float64),), "bad_dtype"),
     ((0,), (torch.zeros(5),), "bad_shape"), ((0,), (torch.zeros(2, 2),), "bad_shape"),
     ((0, 0), (torch.zeros(4), torch.zeros(4)), "bad_request"), ((0, 5), (torch.zeros(4),), "bad_request")],
)
def test_bad_pushes_are_refused_with_codes(keys, grads, code):
    """Unknown keys, wrong dtype or shape and mismatched lists raise RequestError with the wire code."""
    with pytest.raises(RequestError) as info:
        _core().check(keys, grads, "push")
    assert info.value.code == code


def test_checkpoint_round_trip_continues_identically(tmp_path):
    """A saved and reloaded shard (Adam state included) continues exactly as the original."""
    a = _core(optimizer="adam", hyper={"lr": 0.1})
    g = (torch.tensor([1.0, -2.0, 3.0, 0.5]),)
    for _ in range(3):
        a.apply("a", (0,), g, 1)
    a.save(tmp_path / "ps0.pt")
    b = _core(optimizer="adam", hyper={"lr": 0.1})
    b.load(tmp_path / "ps0.pt")
    assert b.version == a.version
    a.apply("a", (0,), g, 1)
    b.apply("a", (0,), g, 1)
    assert torch.equal(a.values((0,))[0], b.values((0,))[0])
    assert not list(tmp_path.glob("*.tmp"))


def test_a_worker_counted_again_starts_at_the_slowest_clock():
    """SSP: a dropped worker that comes back starts level with the slowest live worker; from clock 0 it
    would hold every other worker back until it had caught up."""
    core = _core("ssp", staleness=1)
    g = (torch.ones(4),)
    for _ in range(3):
        core.apply("a", (0,), g, 1)
        core.apply("b", (0,), g, 1)
    core.remove_worker("b")
    assert core.ssp_ready("a")
    core.add_worker("b")
    assert core.clock["b"] == 3 and core.ssp_ready("a")
    core.apply("a", (0,), g, 1)
    core.apply("a", (0,), g, 1)
    assert not core.ssp_ready("a")  # the bound holds again, against the returned worker
