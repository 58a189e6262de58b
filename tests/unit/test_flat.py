"""Flat parameter layout, model binding, chunk views and chunk placement (hmp.flat)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hmp.models import click_model, digits_mlp
from hmp.flat import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    FlatLayout,
    chunk_views,
)
from hmp.ps.sharding import assign_chunks, sharding_report

torch.set_num_threads(1)


def small_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))


def test_layout_slots_and_chunks_tile_the_buffer() -> None:
    """Slots are packed back to back in named_parameters order and chunks tile each buffer, none over chunk_bytes."""
    model = small_model()
    layout = FlatLayout.from_model(model, chunk_bytes=64)
    expected_offset = 0
    for slot, (name, p) in zip(layout.slots, model.named_parameters(), strict=True):
        assert (slot.name, slot.offset, slot.numel, slot.shape) == (name, expected_offset, p.numel(), tuple(p.shape))
        expected_offset += p.numel()
    assert layout.sizes == (("float32", expected_offset),)
    assert [c.key for c in layout.chunks] == list(range(len(layout.chunks)))
    assert layout.chunks[0].start == 0 and layout.chunks[-1].end == expected_offset
    for a, b in zip(layout.chunks, layout.chunks[1:]):
        assert a.end == b.start
    assert all(c.nbytes <= 64 for c in layout.chunks)
    assert all(c.numel == 16 for c in layout.chunks[:-1])
    assert FlatLayout.from_model(small_model(seed=5), chunk_bytes=64) == layout  # values do not matter


def test_default_chunk_size_is_one_mib() -> None:
    """Without chunk_bytes, chunks are cut at 1 MiB (262144 float32 elements)."""
    layout = FlatLayout.from_model(click_model(buckets=5000, dim=16))  # 640k-element embedding table
    assert layout.chunk_bytes == DEFAULT_CHUNK_BYTES == 1 << 20
    assert layout.chunks[0].numel == 262144 and len(layout.chunks) == 3


def test_bind_keeps_values_and_chunk_views_alias_params() -> None:
    """After bind the model computes the same outputs, and writing a chunk view changes the parameter."""
    model = small_model()
    x = torch.randn(4, 7)
    before = model(x).detach().clone()
    layout = FlatLayout.from_model(model, chunk_bytes=40)
    flat = layout.bind(model)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    views = chunk_views(flat.params, layout.chunks)
    assert list(views) == [c.key for c in layout.chunks]
    # Chunk 3 covers float32 elements [30, 40): inside weight 0 (91 elements).
    views[3].fill_(7.0)
    assert torch.all(model[0].weight.view(-1)[30:40] == 7.0)
    assert views[3].data_ptr() == flat.params["float32"].data_ptr() + 30 * 4
    # The other direction: an in-place update to a parameter shows in its chunk.
    with torch.no_grad():
        model[2].bias.add_(1.0)
    torch.testing.assert_close(flat.params["float32"][-5:], model[2].bias)


def test_gradients_accumulate_into_the_flat_grad_buffer() -> None:
    """backward() writes into the flat grad buffer in place, and a second backward adds to it."""
    model = small_model()
    reference = copy.deepcopy(model)
    layout = FlatLayout.from_model(model, chunk_bytes=64)
    flat = layout.bind(model)
    grad_ptrs = [p.grad.data_ptr() for p in model.parameters()]
    x, y = torch.randn(6, 7), torch.randint(0, 5, (6,))
    for _ in range(2):
        nn.functional.cross_entropy(model(x), y).backward()
        nn.functional.cross_entropy(reference(x), y).backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == grad_ptrs
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(flat.grads["float32"], expected)
    assert expected.abs().sum() > 0
    flat.zero_grad()
    assert all(torch.all(p.grad == 0) for p in model.parameters())


def test_bound_training_with_flat_sgd_matches_reference() -> None:
    """K SGD steps applied to the flat buffers give the same parameters as torch.optim.SGD on a copy."""
    model = small_model()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    layout = FlatLayout.from_model(model, chunk_bytes=48)
    flat = layout.bind(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 7, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        flat.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        # Update chunk by chunk, as a PS shard would.
        grads = chunk_views(flat.grads, layout.chunks)
        for key, p in chunk_views(flat.params, layout.chunks).items():
            p.add_(grads[key], alpha=-0.1)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        assert p.data_ptr() >= flat.params["float32"].data_ptr()  # still a view into the flat buffer


def test_zero_grad_set_to_none_unbinds_but_false_keeps_binding() -> None:
    """optimizer.zero_grad(set_to_none=False) keeps .grad bound to the flat buffer; the default set_to_none=True loses it."""
    model = small_model()
    flat = FlatLayout.from_model(model).bind(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 7)
    opt.zero_grad(set_to_none=False)
    model(x).sum().backward()
    assert flat.grads["float32"].abs().sum() > 0
    opt.zero_grad()  # default: set_to_none=True
    assert all(p.grad is None for p in model.parameters())
    flat.zero_grad()
    model(x).sum().backward()
    assert flat.grads["float32"].abs().sum() == 0  # gradients went to fresh tensors, not the buffer


def test_embedding_model_binds_and_trains() -> None:
    """The click model's embedding table gets its (dense) gradient in the flat buffer too."""
    torch.manual_seed(0)
    model = click_model(fields=4, buckets=50, dim=8)
    layout = FlatLayout.from_model(model, chunk_bytes=1024)
    flat = layout.bind(model)
    ids = torch.randint(0, 50, (16, 4))
    nn.functional.cross_entropy(model(ids), torch.randint(0, 2, (16,))).backward()
    table = next(s for s in layout.slots if s.name == "0.table.weight")
    assert flat.grads["float32"][table.offset : table.offset + table.numel].abs().sum() > 0
    assert model[0].table.weight.grad.data_ptr() == flat.grads["float32"].data_ptr()


def test_mixed_dtypes_give_one_buffer_per_dtype() -> None:
    """float32 and float16 parameters in one model are laid out in two flat buffers with per-dtype chunks."""
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 30).half(), nn.Linear(30, 4))
    layout = FlatLayout.from_model(model, chunk_bytes=256)
    assert layout.sizes == (("float32", 220 + 124), ("float16", 630))
    slots = {s.name: s for s in layout.slots}
    assert slots["1.weight"].dtype == "float16" and slots["2.weight"].offset == 220
    assert {c.dtype for c in layout.chunks} == {"float32", "float16"}
    assert max(c.numel for c in layout.chunks if c.dtype == "float16") == 128
    assert layout.nbytes == 344 * 4 + 630 * 2
    flat = layout.bind(model)
    assert flat.params["float16"].dtype == torch.float16 and flat.grads["float16"].numel() == 630
    chunk_views(flat.params, layout.chunks)[layout.chunks[-1].key].fill_(1.0)
    assert torch.all(model[1].bias[-10:] == 1.0)


def test_frozen_parameters_are_left_out() -> None:
    """Parameters with requires_grad=False are not part of the layout and keep their own storage."""
    model = small_model()
    model[0].weight.requires_grad_(False)
    ptr = model[0].weight.data_ptr()
    layout = FlatLayout.from_model(model)
    assert [s.name for s in layout.slots] == ["0.bias", "2.weight", "2.bias"]
    layout.bind(model)
    assert model[0].weight.data_ptr() == ptr and model[0].weight.grad is None


def test_flatten_and_param_views_round_trip() -> None:
    """flatten copies current values (no binding) and param_views shows them with parameter shapes."""
    model = digits_mlp()
    layout = FlatLayout.from_model(model)
    flat = layout.flatten(model)
    views = layout.param_views(flat)
    for name, p in model.named_parameters():
        torch.testing.assert_close(views[name], p.detach())
    flat["float32"].zero_()
    assert model[0].weight.abs().sum() > 0  # a copy, not an alias


def test_mismatched_model_and_bad_inputs_are_rejected() -> None:
    """Binding a different model, chunk_bytes below one element, or views of the wrong dtype raise ValueError."""
    layout = FlatLayout.from_model(small_model())
    with pytest.raises(ValueError, match="0.weight"):
        layout.bind(nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 5)))
    with pytest.raises(ValueError, match="chunk_bytes"):
        FlatLayout.from_model(small_model(), chunk_bytes=2)
    with pytest.raises(ValueError, match="float16"):
        chunk_views(torch.zeros(200, dtype=torch.float16), layout.chunks)
    with pytest.raises(ValueError, match="spans"):
        chunk_views(torch.zeros(10), layout.chunks)


def test_assign_chunks_is_greedy_largest_first_with_low_index_ties() -> None:
    """Largest chunk goes first to the least-loaded shard, ties to the lowest shard index, result deterministic."""
    chunks = [Chunk(0, "float32", 0, 10), Chunk(1, "float32", 10, 40), Chunk(2, "float32", 50, 10), Chunk(3, "float32", 60, 30)]
    placement = assign_chunks(chunks, 2)
    # 40 -> s0; 30 -> s1; 10 (key 0) -> s1 (30 < 40); 10 (key 2) -> tie 40/40 -> s0.
    assert placement == {0: [1, 2], 1: [0, 3]}
    assert assign_chunks(list(reversed(chunks)), 2) == placement
    assert assign_chunks(chunks, 6) == {0: [1], 1: [3], 2: [0], 3: [2], 4: [], 5: []}
    report = sharding_report(chunks, placement)
    assert report.bytes_per_shard == (200, 160) and report.chunks_per_shard == (2, 2)
    assert report.mean_bytes == 180 and report.imbalance == pytest.approx(200 / 180)
    assert report.largest_chunk_bytes == 160


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=5000), min_size=1, max_size=60),
    num_shards=st.integers(min_value=1, max_value=9),
)
def test_placement_balance_bound(sizes: list[int], num_shards: int) -> None:
    """Every chunk is placed exactly once and the busiest shard holds at most mean + the largest chunk."""
    chunks, start = [], 0
    for key, n in enumerate(sizes):
        chunks.append(Chunk(key, "float32", start, n))
        start += n
    placement = assign_chunks(chunks, num_shards)
    report = sharding_report(chunks, placement)  # raises unless each chunk is placed once
    assert sorted(placement) == list(range(num_shards))
    assert report.total_bytes == 4 * sum(sizes)
    assert report.max_bytes <= report.mean_bytes + report.largest_chunk_bytes
    assert assign_chunks(chunks, num_shards) == placement


def test_sharding_report_rejects_bad_placements() -> None:
    """A chunk placed twice, never, or an unknown key makes sharding_report raise ValueError."""
    chunks = [Chunk(0, "float32", 0, 4), Chunk(1, "float32", 4, 4)]
    with pytest.raises(ValueError, match="more than one"):
        sharding_report(chunks, {0: [0, 1], 1: [1]})
    with pytest.raises(ValueError, match="not placed"):
        sharding_report(chunks, {0: [0]})
    with pytest.raises(ValueError, match="unknown"):
        sharding_report(chunks, {0: [0, 1, 7]})
    with pytest.raises(ValueError, match="num_shards"):
        assign_chunks(chunks, 0)


def test_real_model_placement_is_balanced() -> None:
    """The click model cut into 16 KiB chunks over 4 shards is within 10% of perfect balance."""
    layout = FlatLayout.from_model(click_model(), chunk_bytes=16 * 1024)
    report = sharding_report(layout.chunks, assign_chunks(layout.chunks, 4))
    assert report.imbalance < 1.1
    assert sum(report.chunks_per_shard) == len(layout.chunks)


def test_row_sparse_tables_are_cut_by_table_chunk_bytes_and_dense_parameters_by_chunk_bytes():
    """A sparse=True embedding's rows go into chunks of ``table_chunk_bytes`` (0: ``chunk_bytes``), whole rows each;
    the dense parameters around it keep ``chunk_bytes``; the layout records both and ``check`` accepts the model."""
    from torch import nn

    model = nn.Sequential(nn.Embedding(1000, 8, sparse=True), nn.Linear(8, 300))  # table 32,000 B; linear 2,700 x 4 B
    coarse = FlatLayout.from_model(model, chunk_bytes=1024, table_chunk_bytes=8000)
    table = [c for c in coarse.chunks if c.table]
    assert [c.numel for c in table] == [2000] * 4  # 8000 B = 250 rows of 8 float32
    assert all(c.nbytes <= 1024 for c in coarse.chunks if not c.table)
    assert coarse.table_chunk_bytes == 8000
    coarse.check(model)
    same = FlatLayout.from_model(model, chunk_bytes=1024, table_chunk_bytes=0)
    assert [c.numel for c in same.chunks if c.table] == [256] * 31 + [64]  # 1024 B = 32 rows
    with pytest.raises(ValueError, match="table_chunk_bytes must be an int >= 0"):
        FlatLayout.from_model(model, chunk_bytes=1024, table_chunk_bytes=-1)
