"""The collective's pure parts: algorithm choice and gradient buckets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hmp.collective import GradientBuckets, Ring, plan_buckets
from hmp.collective.ring import ALGORITHMS, one_host
from hmp.config.schema import ALLREDUCE_ALGORITHMS
from hmp.flat import FlatLayout


def test_the_algorithm_is_halving_doubling_for_a_power_of_two_on_one_host_by_default():
    """"auto" (the default): halving-doubling for 4, 8, ... members on one host, the ring across
    hosts or for other sizes; "ring" and "halving" force it (halving: where the size allows)."""
    big = torch.zeros(1 << 20)
    local4 = [f"tcp://127.0.0.1:{i}" for i in range(1, 5)]
    hosts4 = [f"tcp://10.0.0.{i}:5000" for i in range(1, 5)]

    def algo(addresses: list[str], **kw: Any) -> str:
        return Ring(rank=0, addresses=addresses, generation=1, **kw).algorithm(big)

    assert algo(local4) == "halving" and algo(local4 * 2) == "halving"
    assert algo(local4[:3]) == "ring" and algo(local4[:2]) == "ring" and algo(local4 + local4[:2]) == "ring"
    assert algo(hosts4) == "ring" and algo(hosts4, algorithm="halving") == "halving"
    assert algo(local4, algorithm="ring") == "ring" and algo(local4[:3], algorithm="halving") == "ring"
    assert one_host(["tcp://127.0.0.1:1", "tcp://localhost:2", "tcp://[::1]:3", "ipc:///tmp/x", "tcp://127.9.9.9:4"])
    assert not one_host(["tcp://127.0.0.1:1", "tcp://node7:2"]) and not one_host(["tcp://[fe80::1]:1"])
    assert not one_host(["inproc://x"])
    assert ALGORITHMS == ALLREDUCE_ALGORITHMS  # the config's list is the ring's


class Mixed(nn.Module):
    """float32 layers around a float64 one: two flat buffers, parameters of both interleaved."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8).double()
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        x = torch.relu(self.b(x.double())).float()
        return self.d(torch.relu(self.c(x)))


def test_bucket_plan_is_contiguous_reverse_and_covers_every_buffer():
    """Buckets are contiguous slices taken from each buffer's end, in reverse parameter order, and
    cover every flat buffer exactly once; a parameter of bucket_bytes or more is a bucket of its own."""
    model = Mixed()
    layout = FlatLayout.from_model(model)
    buckets = plan_buckets(layout, bucket_bytes=200)
    names = [s.name for s in layout.slots]
    order = [names.index(b.params[0]) for b in buckets]
    assert order == sorted(order, reverse=True)  # bucket 0 starts with the last parameter
    for dtype, numel in layout.sizes:
        mine = sorted((b.start, b.end) for b in buckets if b.dtype == dtype)
        assert mine[0][0] == 0 and mine[-1][1] == numel
        assert all(x[1] == y[0] for x, y in zip(mine, mine[1:]))
        ends = [b.end for b in buckets if b.dtype == dtype]
        assert ends == sorted(ends, reverse=True)  # from the end of the buffer backwards
    assert any(len(b.params) > 1 for b in buckets)
    tiny = plan_buckets(layout, bucket_bytes=1)  # every parameter over the size: one bucket each
    assert [b.params for b in tiny] == [(s.name,) for s in reversed(layout.slots)]
    one = plan_buckets(layout, bucket_bytes=1 << 30)
    assert [(b.dtype, b.start, b.end) for b in one] == [("float32", 0, layout.numel("float32")),
                                                          ("float64", 0, layout.numel("float64"))]


def test_buckets_fire_in_reverse_order_exactly_once_per_backward():
    """A real model bound to flat buffers: each bucket's callback fires once per backward, in reverse
    order, with a view of the flat gradient buffer that already holds the finished gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32),
                          nn.ReLU(), nn.Linear(32, 4))
    layout = FlatLayout.from_model(model)
    flat = layout.bind(model)
    grad = flat.grads["float32"]
    fired: list[tuple[int, int, int, torch.Tensor]] = []

    def on_ready(index: int, view: torch.Tensor) -> None:
        fired.append((index, view.data_ptr(), view.numel(), view.clone()))

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with GradientBuckets(model, layout, flat.grads, on_ready, bucket_bytes=4096) as gb:
        assert len(gb) >= 3
        for step in range(2):
            fired.clear()
            flat.zero_grad()
            gb.reset()
            nn.functional.cross_entropy(model(x), y).backward()
            assert [f[0] for f in fired] == list(range(len(gb))), f"step {step}: {[f[0] for f in fired]}"
            assert gb.pending == []
            for index, ptr, numel, seen in fired:
                b = gb.buckets[index]
                assert ptr == grad[b.start:b.end].data_ptr() and numel == b.numel
                assert torch.equal(seen, grad[b.start:b.end])  # complete when it fired
            assert sum(f[2] for f in fired) == grad.numel()
        with pytest.raises(RuntimeError, match="reset"):
            nn.functional.cross_entropy(model(x), y).backward()  # no reset: a bucket would fire twice
        gb.reset()
        fired.clear()
        assert gb.flush() == list(range(len(gb))) and len(fired) == len(gb)  # e.g. unused parameters
    fired.clear()
    gb.reset()
    nn.functional.cross_entropy(model(x), y).backward()
    assert fired == []  # hooks removed


def test_buckets_refuse_a_model_that_is_not_bound():
    model = nn.Linear(4, 4)
    layout = FlatLayout.from_model(model)
    with pytest.raises(ValueError, match="bind"):
        GradientBuckets(model, layout, layout.allocate(), lambda i, v: None)
