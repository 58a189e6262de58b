"""Row-sparse tables on the shards: the pure rules."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from hmp import models
from hmp.flat import FlatLayout
from hmp.messages import RowGrads
from tests.support import BUCKETS, DIM, FIELDS


TABLE = "0.table.weight"


def test_a_sparse_table_is_laid_out_in_whole_rows_and_its_gradient_stays_sparse():
    model = models.click_model(fields=FIELDS, buckets=BUCKETS, dim=DIM, hidden=[16], sparse=True)
    layout = FlatLayout.from_model(model, chunk_bytes=1000)  # 31.25 rows: chunks of 31 rows
    table = [c for c in layout.chunks if c.dim]
    assert [t.name for t in layout.tables] == [TABLE]
    assert all(c.numel % DIM == 0 and c.rows <= 31 for c in table)
    assert sum(c.rows for c in table) == FIELDS * BUCKETS and table[1].row0 == 31
    dense = models.click_model(fields=FIELDS, buckets=BUCKETS, dim=DIM, hidden=[16])
    assert FlatLayout.from_model(dense, 1000).tables == ()  # sparse = false: the layout as always
    flat = layout.bind(model)
    flat.zero_grad()
    ids = torch.tensor([[0, 1, 2, 3]])
    model(ids).sum().backward()
    grad = dict(model.named_parameters())[TABLE].grad
    assert grad.is_sparse and grad.coalesce().indices()[0].tolist() == [0, 51, 102, 153]
    (name, rows), = model.rows_touched(ids).items()
    assert name == TABLE and torch.equal(rows, grad.coalesce().indices()[0])
    flat.zero_grad()
    assert dict(model.named_parameters())[TABLE].grad is None


def test_a_table_chunk_counts_every_update_of_its_shard_like_sparse_adams_step():
    """Lazy Adam's bias correction reads the chunk's step count, which counts the shard's updates whether
    they touched the chunk or not: rows of the second chunk first pushed at update 3 get t = 3, as
    ``torch.optim.SparseAdam`` gives the rows of one table parameter at its third step."""
    from hmp.ps.shard_core import ShardCore

    table = torch.randn(8, 4)
    core = ShardCore("ps0", {0: table[:4].reshape(-1), 1: table[4:].reshape(-1)}, "adam", {"lr": 0.01},
                     row_dims={0: 4, 1: 4})
    reference = torch.nn.Parameter(table.clone())
    opt = torch.optim.SparseAdam([reference], lr=0.01, eps=1e-8)
    steps = [(0, torch.tensor([1, 2])), (0, torch.tensor([2])), (1, torch.tensor([0, 3]))]
    gen = torch.Generator().manual_seed(5)
    for key, rows in steps:
        g = torch.randn(len(rows), 4, generator=gen)
        core.apply("cpu0", (), (), 1, sparse=RowGrads((key,), (rows,), (g,)))
        reference.grad = torch.sparse_coo_tensor((rows + 4 * key)[None], g, (8, 4), check_invariants=True)
        opt.step()
    got = torch.cat([core.chunks[0].param, core.chunks[1].param]).view(8, 4)
    assert torch.equal(got, reference.detach())
    assert core.chunks[1].optimizer.steps == core.chunks[0].optimizer.steps == 3


def test_sgd_weight_decay_and_momentum_reach_only_the_touched_rows():
    from hmp.ps.optim import make_chunk_optimizer

    p = torch.ones(12)  # 3 rows of 4
    opt = make_chunk_optimizer("sgd", 12, lr=0.5, momentum=0.9, weight_decay=0.1)
    opt.step_rows(p, torch.tensor([1]), torch.ones(1, 4), 4)
    row = p.view(3, 4)
    assert torch.equal(row[0], torch.ones(4)) and torch.equal(row[2], torch.ones(4))  # untouched: no decay
    first = 1 - 0.5 * (1 + 0.1 * 1)  # g + wd * p, the buffer starting at that (dampening 0)
    assert torch.allclose(row[1], torch.full((4,), first))
    opt.step_rows(p, torch.tensor([1, 2]), torch.zeros(2, 4), 4)
    buf1 = 0.9 * 1.1 + 0.1 * first  # row 1's buffer moves on; row 2's starts now
    assert torch.allclose(row[1], torch.full((4,), first - 0.5 * buf1))
    assert torch.allclose(row[2], torch.full((4,), 1 - 0.5 * 0.1))
    assert torch.equal(row[0], torch.ones(4))


def test_sparse_mlp_reads_csr_batches_and_says_which_rows_they_touch():
    from hmp.data import CSRRows

    gen = torch.Generator().manual_seed(2)
    dense = (torch.rand(6, 40, generator=gen) > 0.85).float() * torch.rand(6, 40, generator=gen)
    batch = CSRRows.from_dense(dense)[torch.tensor([4, 0, 2])]
    model = models.sparse_mlp(num_features=40, dim=4, hidden=[8])
    layout = FlatLayout.from_model(model, chunk_bytes=64)  # 4 rows of 4 float32 per table chunk
    assert [t.name for t in layout.tables] == ["0.weight"] and sum(c.rows for c in layout.chunks) == 40
    flat = layout.bind(model)
    flat.zero_grad()
    out = model(batch)
    bag = dict(model.named_parameters())["0.weight"]
    # The bag is the batch times its table: the first layer of a linear model on the sparse rows.
    assert torch.allclose(model[0](batch), dense[torch.tensor([4, 0, 2])] @ bag.detach(), atol=1e-6)
    F.cross_entropy(out, torch.tensor([0, 1, 1])).backward()
    (name, rows), = model.rows_touched(batch).items()
    assert name == "0.weight" and bag.grad.is_sparse
    assert torch.equal(rows, torch.unique(batch.indices)) and torch.equal(rows, bag.grad.coalesce().indices()[0])
    dense_model = models.sparse_mlp(num_features=40, dim=4, hidden=[8], sparse=False)
    assert FlatLayout.from_model(dense_model, 64).tables == ()  # the bench's dense peer
