"""Row-sparse tables on the parameter server (issue 14, "Sparse end to end"; docs/protocol.md, "Row-sparse
tables"): an ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True`` is laid out in whole rows, a
push carries only the rows its batch touched and asks for the next batch's rows, and the shard updates
only those rows with the optimizers' sparse rules.

Shard daemons in this process behind real sockets, workers as :class:`hmp.client.PSClient` s or raw
clients: a sparse push gives bit for bit what torch's own optimizers give on the same rows (SGD, Adagrad,
lazy Adam as ``torch.optim.SparseAdam``), dense parameters too; a re-sent push is applied once; a sync
round averages its members' rows; a backup stays identical to its primary; bad row pushes are refused
naming what is wrong and the shard keeps serving. Then a whole click job on loopback whose pushes carry
only the touched rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from hmp import job, models
from hmp.client import PSClient
from hmp.errors import ConfigError, RemoteError
from hmp.flat import FlatLayout
from hmp.job import load
from hmp.messages import Pull, Push, Replicas, RowGrads
from hmp.nodes.ps_shard import PSShardNode
from hmp.ps.sharding import initial_replicas

from .cluster_util import free_port
from .test_checkpoint import _as, _running
from .test_replication import _assert_identical
from .test_shard_node import _serving

FIELDS, BUCKETS, DIM = 4, 50, 8
TABLE = "0.table.weight"
OPTIMIZERS = {"sgd": 'name = "sgd"\nlr = 0.1', "adagrad": 'name = "adagrad"\nlr = 0.1',
              "adam": 'name = "adam"\nlr = 0.01'}


def _config(tmp: Path, *, optimizer: str = "adam", consistency: str = "async", shards: int = 1,
            workers: tuple[str, ...] = ("cpu0",), ps_extra: str = "", node_extra: str = "",
            train_extra: str = "", samples: int = 2000) -> Path:
    """A click job with a row-sparse table of ``FIELDS * BUCKETS`` rows of ``DIM`` (chunks of 32 rows) on
    loopback; shard ports fixed so that tests can dial them."""
    text = f"""
[job]
name = "sparse"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.25
join_timeout_s = 60

[model]
name = "click_model"
args = {{ fields = {FIELDS}, buckets = {BUCKETS}, dim = {DIM}, hidden = [16], sparse = true }}

[data]
kind = "click"
samples = {samples}
args = {{ fields = {FIELDS}, buckets = {BUCKETS} }}

[optimizer]
{OPTIMIZERS[optimizer]}

[train]
consistency = "{consistency}"
batch_size = 32
epochs = 2
target_accuracy = 0.0
max_seconds = 60
eval_every_s = 0.5
report_interval_s = 0.3
{train_extra}

[ps]
chunk_bytes = 1024
table_chunk_bytes = 0  # the tables too: several chunks per table, on both shards
checkpoint_dir = "{tmp / 'ckpt'}"
{ps_extra}

[shm]
enabled = false

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"
"""
    for i in range(shards):
        text += f'\n[[nodes]]\nid = "ps{i}"\nrole = "ps"\nbind = "tcp://127.0.0.1:{free_port()}"\n'
    for w in workers:
        text += f'\n[[nodes]]\nid = "{w}"\nrole = "cpu_worker"\nbatch_size = 32\n{node_extra}\n'
    path = tmp / "job.toml"
    path.write_text(text)
    return path


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, BUCKETS, (16, FIELDS), generator=gen), torch.randint(0, 2, (16,), generator=gen))
            for _ in range(n)]


def _reference_optimizers(name: str, model: torch.nn.Module, eps: float) -> list[torch.optim.Optimizer]:
    """torch's own optimizers, the sparse rule for the table: what the shard must match bit for bit."""
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1)]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1, eps=eps)]
    table = dict(model.named_parameters())[TABLE]
    dense = [p for n, p in model.named_parameters() if n != TABLE]
    return [torch.optim.Adam(dense, lr=0.01, eps=eps), torch.optim.SparseAdam([table], lr=0.01, eps=eps)]


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


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's own Adagrad, the reference
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
async def test_a_sparse_push_applies_exactly_the_touched_rows_as_torch_would(tmp_path, optimizer):
    cfg = load(_config(tmp_path, optimizer=optimizer))
    node = PSShardNode(cfg, "ps0")
    reference = models.from_config(cfg, seed=cfg.model.seed)
    opts = _reference_optimizers(optimizer, reference, cfg.optimizer.eps)
    batches = _batches(6)
    async with _serving(node, cfg.shards[0].bind):
        ps = PSClient(job.sharded_model(cfg), [("ps0", cfg.shards[0].bind)], name="cpu0", cfg=cfg, shm=False)
        await ps.connect()
        try:
            model, rows = ps.model, 0
            for i, (ids, y) in enumerate(batches):
                ps.sharded.flat.zero_grad()
                F.cross_entropy(model(ids), y).backward()
                following = batches[i + 1][0] if i + 1 < len(batches) else None
                await ps.push(samples=16, seq=i + 1, want=None if following is None else model.rows_touched(following))
                for o in opts:
                    o.zero_grad()
                F.cross_entropy(reference(ids), y).backward()
                table = dict(reference.named_parameters())[TABLE]
                # The ids a batch looks up twice summed first (coalesced, as the push sends them): SGD would
                # otherwise add them one by one, rounding differently.
                table.grad = table.grad.coalesce()
                for o in opts:
                    o.step()
                rows += model.rows_touched(ids)[TABLE].numel()
                # Only the touched rows travelled (and the next batch's came back).
                assert node.stats["rows_pushed"] == rows == ps.rows_pushed
                following_rows = 0 if following is None else model.rows_touched(following)[TABLE].numel()
                assert node.stats["rows_pulled"] == rows + following_rows - model.rows_touched(batches[0][0])[TABLE].numel()
        finally:
            await ps.close()
    layout = ps.sharded.layout
    want = FlatLayout.flatten(layout, reference)
    for c in layout.chunks:  # every chunk, table and dense, bit for bit (untouched rows: as they started)
        got = node.core.chunks[c.key].param
        assert torch.equal(got, want[c.dtype][c.start:c.end]), (optimizer, c)
    assert node.core.version == len(batches)


async def test_a_resent_sparse_push_is_applied_once_and_bad_ones_are_refused_while_the_shard_serves(tmp_path):
    cfg = load(_config(tmp_path, optimizer="sgd"))
    node = PSShardNode(cfg, "ps0")
    core = node.core
    table = [k for k, c in core.chunks.items() if c.dim]
    dense = [k for k, c in core.chunks.items() if not c.dim]
    k = table[1]
    rows, grads = torch.tensor([0, 3, 7]), torch.ones(3, DIM)
    async with _serving(node) as as_worker:
        cpu = await as_worker("cpu0")
        before = core.chunks[k].param.clone().view(-1, DIM)
        push = Push(keys=(), grads=(), row_keys=(k,), rows=(rows,), row_grads=(grads,), seq=5,
                    want_keys=(k,), want_rows=(torch.tensor([3, 4]),))
        first = await cpu.request(push)
        after = core.chunks[k].param.view(-1, DIM)
        assert torch.equal(after[rows], before[rows] - 0.1) and torch.equal(after[4], before[4])
        assert first.row_keys == (k,) and torch.equal(first.row_values[0], after[torch.tensor([3, 4])])
        again = await cpu.request(push)  # its reply was lost, say: answered, not applied twice
        assert again.version == first.version == 1 and node.stats["duplicates"] == 1
        assert torch.equal(core.chunks[k].param.view(-1, DIM)[rows], before[rows] - 0.1)

        bad = {
            "out of range": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([1, 32]),),
                                  row_grads=(torch.ones(2, DIM),)), "bad_request", "row id 32 of chunk"),
            "duplicate": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([2, 2]),),
                               row_grads=(torch.ones(2, DIM),)), "bad_request", "duplicate ids"),
            "unsorted": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([5, 2]),),
                              row_grads=(torch.ones(2, DIM),)), "bad_request", "not sorted"),
            "int32 ids": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([1], dtype=torch.int32),),
                               row_grads=(torch.ones(1, DIM),)), "bad_dtype", "must be int64"),
            "2-D ids": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([[1]]),),
                             row_grads=(torch.ones(1, DIM),)), "bad_shape", "must be 1-D"),
            "wrong width": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([1]),),
                                 row_grads=(torch.ones(1, DIM + 1),)), "bad_shape", f"[1, {DIM}]"),
            "float64 rows": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([1]),),
                                  row_grads=(torch.ones(1, DIM, dtype=torch.float64),)), "bad_dtype", "float64"),
            "dense chunk": (Push(keys=(), grads=(), row_keys=(dense[0],), rows=(torch.tensor([0]),),
                                 row_grads=(torch.ones(1, DIM),)), "bad_request", "is dense"),
            "whole and rows": (Push(keys=(k,), grads=(torch.ones(core.chunks[k].param.numel()),), row_keys=(k,),
                                    rows=(torch.tensor([0]),), row_grads=(torch.ones(1, DIM),)), "bad_request",
                               "both whole and by rows"),
            "missing grads": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([0]),)), "bad_request",
                              "0 row gradients"),
            "nan": (Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([0]),),
                         row_grads=(torch.full((1, DIM), float("nan")),)), "non_finite", "NaN"),
            "want out of range": (Push(keys=(), grads=(), want_keys=(k,), want_rows=(torch.tensor([-1]),)),
                                  "bad_request", "row id -1"),
            "pull of a stranger's chunk": (Pull(keys=(), row_keys=(10_000,), rows=(torch.tensor([0]),)),
                                           "unknown_key", "does not own chunk 10000"),
        }
        version = core.version
        snapshot = {key: c.param.clone() for key, c in core.chunks.items()}
        for what, (msg, code, text) in bad.items():
            with pytest.raises(RemoteError) as refused:
                await cpu.request(msg)
            assert refused.value.code == code and text in str(refused.value), (what, refused.value)
        assert core.version == version and all(torch.equal(c.param, snapshot[key]) for key, c in core.chunks.items())
        # Still serving: a good pull of rows and a good push.
        pulled = await cpu.request(Pull(keys=(dense[0],), row_keys=(k,), rows=(torch.tensor([0, 31]),)))
        assert torch.equal(pulled.row_values[0], core.chunks[k].param.view(-1, DIM)[torch.tensor([0, 31])])
        reply = await cpu.request(Push(keys=(), grads=(), row_keys=(k,), rows=(torch.tensor([1]),),
                                       row_grads=(torch.ones(1, DIM),), seq=6))
        assert reply.version == version + 1


async def test_a_sync_round_averages_its_members_rows_and_answers_each_with_the_rows_it_wants(tmp_path):
    cfg = load(_config(tmp_path, optimizer="sgd", consistency="sync", workers=("cpu0", "cpu1")))
    node = PSShardNode(cfg, "ps0")
    core = node.core
    k = next(k for k, c in core.chunks.items() if c.dim)
    dense = tuple(k for k, c in core.chunks.items() if not c.dim)
    ones = tuple(torch.ones(core.chunks[d].param.numel()) for d in dense)
    a, b = torch.randn(2, DIM), torch.randn(2, DIM)
    async with _serving(node) as as_worker:
        cpu0, cpu1 = await as_worker("cpu0"), await as_worker("cpu1")
        before = core.chunks[k].param.clone().view(-1, DIM)
        dense_before = core.chunks[dense[0]].param.clone()
        r0, r1 = await _gather(
            cpu0.request(Push(keys=dense, grads=ones, row_keys=(k,), rows=(torch.tensor([0, 2]),), row_grads=(a,),
                              seq=1)),
            cpu1.request(Push(keys=dense, grads=ones, row_keys=(k,), rows=(torch.tensor([2, 5]),), row_grads=(b,),
                              seq=1, want_keys=(k,), want_rows=(torch.tensor([0, 5, 9]),))))
        after = core.chunks[k].param.view(-1, DIM)
        assert torch.allclose(after[0], before[0] - 0.1 * a[0] / 2)
        assert torch.allclose(after[2], before[2] - 0.1 * (a[1] + b[0]) / 2)
        assert torch.allclose(after[5], before[5] - 0.1 * b[1] / 2)
        assert torch.equal(after[9], before[9])  # untouched
        assert torch.allclose(core.chunks[dense[0]].param, dense_before - 0.1)
        assert r0.version == r1.version == 1 and r0.row_keys == ()
        assert r1.row_keys == (k,) and torch.equal(r1.row_values[0], after[torch.tensor([0, 5, 9])])
        # The aggregation buffer is back at zero: a second round with one row only moves that row.
        mid = after.clone()
        await _gather(cpu0.request(Push(keys=dense, grads=ones, row_keys=(k,), rows=(torch.tensor([1]),),
                                        row_grads=(torch.ones(1, DIM),), seq=2)),
                      cpu1.request(Push(keys=dense, grads=ones, seq=2)))
        moved = (core.chunks[k].param.view(-1, DIM) != mid).any(1).nonzero().view(-1).tolist()
        assert moved == [1]


async def _gather(*requests):
    import asyncio

    return await asyncio.gather(*requests)


@pytest.mark.parametrize("consistency", ["async", "sync"])
async def test_a_backup_stays_identical_to_its_primary_after_sparse_pushes(tmp_path, consistency):
    cfg = load(_config(tmp_path, optimizer="adam", consistency=consistency, shards=2, ps_extra="replicas = 2"))
    ps0, ps1 = PSShardNode(cfg, "ps0"), PSShardNode(cfg, "ps1")
    batches = _batches(5, seed=1)
    async with _running(ps0), _running(ps1), _as(ps0, "scheduler") as sched0, _as(ps1, "scheduler") as sched1:
        shards = tuple((s.id, s.bind) for s in cfg.shards)
        start = Replicas(groups=tuple((g, p, b) for g, (p, b) in initial_replicas(["ps0", "ps1"]).items()),
                         shards=shards, epoch=1)
        await _gather(sched0.request(start), sched1.request(start))
        ps = PSClient(job.sharded_model(cfg), list(shards), name="cpu0", cfg=cfg, shm=False)
        await ps.connect()
        try:
            for i, (ids, y) in enumerate(batches):
                ps.sharded.flat.zero_grad()
                F.cross_entropy(ps.model(ids), y).backward()
                following = batches[i + 1][0] if i + 1 < len(batches) else batches[0][0]
                await ps.push(samples=16, seq=i + 1, want=ps.model.rows_touched(following))
        finally:
            await ps.close()
        assert ps0.core.version == ps1.core.version == len(batches)
        assert ps0.stats["rows_pushed"] > 0 and ps1.stats["rows_pushed"] > 0  # both groups hold table rows
        _assert_identical(ps0.core, ps1.backups["ps0"])
        _assert_identical(ps1.core, ps0.backups["ps1"])


def test_jobs_that_would_drop_sparse_gradients_are_refused_at_load(tmp_path):
    with pytest.raises(ConfigError) as hogwild:
        load(_config(tmp_path, node_extra="hogwild_threads = 2"))
    assert hogwild.value.key == "nodes[2].hogwild_threads" and TABLE in str(hogwild.value)
    assert isinstance(load(_config(tmp_path)), object)  # the same job with one thread loads


@pytest.mark.parametrize("consistency", ["async", "sync"])
async def test_a_sparse_click_job_trains_and_pushes_only_the_touched_rows(tmp_path, consistency):
    from hmp.cluster import LocalCluster

    cfg = _config(tmp_path, optimizer="adam", consistency=consistency, shards=2, workers=("cpu0", "cpu1"),
                  samples=4000)
    cfg.write_text(cfg.read_text().replace('name = "adam"\nlr = 0.01', 'name = "adam"\nlr = 0.02'))
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=120)
    assert report["consistency"] == consistency
    model = models.click_model(fields=FIELDS, buckets=BUCKETS, dim=DIM, hidden=[16])
    table_bytes = FIELDS * BUCKETS * DIM * 4
    dense_bytes = sum(p.numel() * 4 for p in model.parameters())  # what a dense push carries
    # generate_click_data's labels come from a few features: the model must learn them (majority ~0.5-0.6).
    assert report["final"]["test_accuracy"] >= 0.7, report["final"]
    for w in report["workers"].values():
        per_push = w["bytes_out"] / w["updates"]
        # 32 examples x 4 fields touch at most 128 of the 200 rows (and fewer unique): well under the table.
        assert per_push < dense_bytes - table_bytes + 128 * (DIM * 4 + 8), (per_push, dense_bytes)
        assert per_push < 0.75 * dense_bytes


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
