"""Module buffers (BatchNorm running statistics) as part of the model, without sockets: their flat layout and
binding, the shard core's buffer rules in each consistency mode (never the optimizer), checkpoints, and the
ring's per-step mean (docs/buffers.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hmp.collective import BufferMean
from hmp.errors import RequestError
from hmp.flat import FlatLayout, persistent_buffers
from hmp.messages import Push
from hmp.ps.optim import BufferRule
from hmp.ps.shard_core import ReplyNow, ShardCore
from hmp.ps.sharding import ShardedModel


class WithConstants(nn.Module):
    """A BatchNorm MLP with a non-persistent buffer (made by the module itself: not part of the model's state)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * self.scale)


def _bn_model() -> WithConstants:
    torch.manual_seed(0)
    return WithConstants()


# ---------------------------------------------------------------- layout and binding
def test_buffers_are_laid_out_after_the_parameters_in_their_own_chunks():
    model = _bn_model()
    layout = FlatLayout.from_model(model, chunk_bytes=16, buffers=True)
    assert [s.name for s in layout.buffers] == ["net.1.running_mean", "net.1.running_var",
                                                "net.1.num_batches_tracked"]
    assert layout.buffer_sizes == (("float32", 16), ("int64", 1))
    keys = [c.key for c in layout.buffer_chunks]
    assert keys == list(range(len(layout.chunks), len(layout.chunks) + len(keys)))  # after every parameter chunk
    assert [(c.dtype, c.numel) for c in layout.buffer_chunks] == [("float32", 4)] * 4 + [("int64", 1)]
    assert FlatLayout.from_model(model, chunk_bytes=16).buffers == ()  # only when asked for
    assert layout.chunks == FlatLayout.from_model(model, chunk_bytes=16).chunks  # parameters' chunks unchanged


def test_bound_buffers_are_views_that_forward_updates_and_state_dict_shows():
    model = _bn_model()
    sharded = ShardedModel.of(model, FlatLayout.from_model(model, buffers=True), num_shards=2)
    flat = sharded.flat.buffers
    bn = model.net[1]
    assert bn.running_mean.data_ptr() == flat["float32"].data_ptr()
    assert torch.equal(flat["float32"][8:], torch.ones(8))  # running_var's initial ones were copied in
    model.train()
    model(torch.randn(32, 4) * 3 + 1)
    assert int(flat["int64"][0]) == 1 and flat["float32"][:8].abs().sum() > 0  # the forward wrote the flat buffers
    state = model.state_dict()
    assert torch.equal(state["net.1.running_mean"], flat["float32"][:8]) and "scale" not in state
    # every chunk, parameters' and buffers', is on exactly one shard; the buffer views are the flat buffers
    placed = sorted(k for keys in sharded.assignment.values() for k in keys)
    assert placed == sorted(sharded.chunks) and sharded.buffer_keys <= set(placed)
    views = sharded.buffer_views()
    assert torch.equal(torch.cat([views[c.key] for c in sharded.layout.buffer_chunks if c.dtype == "float32"]),
                       flat["float32"])
    assert [n for n, _ in persistent_buffers(model)] == [s.name for s in sharded.layout.buffers]


def test_a_layout_with_buffers_refuses_a_model_whose_buffers_differ():
    layout = FlatLayout.from_model(_bn_model(), buffers=True)
    other = _bn_model()
    other.net[1].register_buffer("extra", torch.zeros(2))
    with pytest.raises(ValueError, match="buffers do not match layout"):
        layout.bind(other)


# ---------------------------------------------------------------- the shard core's rules
BUF, COUNT = 1, 2  # chunk keys: 0 a parameter chunk, 1 float buffers, 2 an integer counter


def _core(consistency: str = "async", workers=("a", "b")) -> ShardCore:
    chunks = {0: torch.zeros(4), BUF: torch.zeros(3), COUNT: torch.zeros(1, dtype=torch.int64)}
    # momentum and weight decay: an optimizer that would visibly change any value it touched
    return ShardCore("ps0", chunks, "sgd", {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1}, consistency,
                     workers=workers, buffer_keys=(BUF, COUNT))


def _push(worker: str, grad: float, buf: list[float], count: int, seq: int = 0) -> Push:
    return Push(sender=worker, keys=(0, BUF, COUNT),
                grads=(torch.full((4,), grad), torch.tensor(buf), torch.tensor([count])), samples=1, seq=seq)


@pytest.mark.parametrize("consistency", ["async", "ssp"])
def test_async_buffers_take_the_last_pushed_values_and_counters_the_maximum(consistency):
    core = _core(consistency)
    assert isinstance(core.chunks[BUF].optimizer, BufferRule) and core.buffer_keys == {BUF, COUNT}
    assert isinstance(core.push(_push("a", 1.0, [1.0, 2.0, 3.0], 5)), ReplyNow)
    assert torch.equal(core.chunks[BUF].param, torch.tensor([1.0, 2.0, 3.0]))  # as pushed: no optimizer
    assert torch.equal(core.chunks[0].param, torch.full((4,), -0.5))  # the parameters did go through it
    core.push(_push("b", 1.0, [0.5, 0.5, 0.5], 3))  # pulled earlier, pushed later
    assert torch.equal(core.chunks[BUF].param, torch.tensor([0.5, 0.5, 0.5]))  # the last writer's values
    assert int(core.chunks[COUNT].param) == 5  # a count never goes back
    assert core.version == 2


def test_a_sync_round_takes_its_members_mean_and_a_backup_applies_the_same():
    core = _core("sync")
    backup = _core("sync")
    core.push(_push("a", 1.0, [1.0, 2.0, 3.0], 4))
    assert torch.equal(core.chunks[BUF].param, torch.zeros(3))  # nothing applied before the round completes
    core.push(_push("b", 3.0, [3.0, 4.0, 8.0], 6))
    done = core.next_release()
    assert torch.equal(core.chunks[BUF].param, torch.tensor([2.0, 3.0, 5.5]))
    assert int(core.chunks[COUNT].param) == 6
    assert set(done.reply_keys) == {0, BUF, COUNT}  # the members' replies carry the buffers
    fwd = done.forward
    backup.replicate(fwd.replace(fseq=1))
    for k in (0, BUF, COUNT):
        assert torch.equal(backup.chunks[k].param, core.chunks[k].param), k
    # the next round starts afresh: one member's values are not added to the last round's
    core.push(_push("a", 0.0, [1.0, 1.0, 1.0], 7))
    core.push(_push("b", 0.0, [3.0, 3.0, 3.0], 7))
    core.next_release()
    assert torch.equal(core.chunks[BUF].param, torch.tensor([2.0, 2.0, 2.0]))


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_a_row_sparse_push_carries_buffer_values_beside_its_rows(consistency):
    """A sparse job: the table's chunk is stepped by rows, the buffer chunk takes values, in the same push."""
    table = 3
    core = ShardCore("ps0", {table: torch.zeros(6), BUF: torch.zeros(3)}, "adam", {"lr": 0.1}, consistency,
                     workers=("a",), row_dims={table: 2}, buffer_keys=(BUF,))
    push = Push(sender="a", keys=(BUF,), grads=(torch.tensor([1.0, 2.0, 3.0]),), samples=1, row_keys=(table,),
                rows=(torch.tensor([1]),), row_grads=(torch.ones(1, 2),))
    core.push(push)
    core.next_release()  # sync: the round (one member) is complete
    assert torch.equal(core.chunks[BUF].param, torch.tensor([1.0, 2.0, 3.0]))
    rows = core.chunks[table].param.view(3, 2)
    assert torch.equal(rows[0], torch.zeros(2)) and torch.equal(rows[2], torch.zeros(2))  # untouched rows
    assert bool((rows[1] < 0).all())  # the pushed row took an Adam step
    assert core.version == 1


def test_nonfinite_buffer_values_are_refused():
    core = _core()
    with pytest.raises(RequestError, match="chunk 1 has 1 NaN"):
        core.push(_push("a", 1.0, [1.0, float("nan"), 3.0], 1))
    assert core.version == 0


def test_buffers_survive_a_checkpoint_and_an_older_checkpoint_without_them_still_loads():
    core = _core()
    core.push(_push("a", 1.0, [1.0, 2.0, 3.0], 9))
    state = core.snapshot()
    resumed = _core()
    resumed.load_state_dict(state)
    for k in (0, BUF, COUNT):
        assert torch.equal(resumed.chunks[k].param, core.chunks[k].param), k
    old = {**state, "params": {0: state["params"][0]}, "optim": {0: state["optim"][0]}}  # before buffers
    older = _core()
    older.load_state_dict(old)
    assert torch.equal(older.chunks[0].param, core.chunks[0].param)
    assert torch.equal(older.chunks[BUF].param, torch.zeros(3))  # kept at its initial values
    with pytest.raises(ValueError, match="layout or shard count changed"):
        older.load_state_dict({**state, "params": {BUF: state["params"][BUF]}})


# ---------------------------------------------------------------- the ring's mean
def test_buffer_mean_packs_and_averages_every_dtype():
    members = [{"float32": torch.tensor([1.0, 4.0]), "int64": torch.tensor([7])},
               {"float32": torch.tensor([3.0, 0.0]), "int64": torch.tensor([7])}]
    means = [BufferMean(m) for m in members]
    assert means[0].numel == 3
    summed = torch.zeros(3, dtype=torch.float64)
    for m in means:
        part = torch.zeros(3, dtype=torch.float64)
        m.pack(part)
        summed += part
    for m in means:
        m.unpack(summed, 2)
    for m in members:
        assert torch.equal(m["float32"], torch.tensor([2.0, 2.0])) and torch.equal(m["int64"], torch.tensor([7]))
    with pytest.raises(ValueError):
        means[0].unpack(summed, 0)

