"""Row-sparse push and pull against shards in one process."""

from __future__ import annotations


import pytest
import torch
from torch.nn import functional as F

from hmp import job, models
from hmp.client import PSClient
from hmp.errors import ConfigError, RemoteError
from hmp.flat import FlatLayout
from hmp.job import load
from hmp.messages import Pull, Push, Replicas
from hmp.nodes.ps_shard import PSShardNode
from hmp.ps.sharding import initial_replicas
from tests.support import BUCKETS, DIM, FIELDS, TABLE, assert_cores_identical, client_of, running, serving, sparse_click_config


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


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's own Adagrad, the reference
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
async def test_a_sparse_push_applies_exactly_the_touched_rows_as_torch_would(tmp_path, optimizer):
    cfg = load(sparse_click_config(tmp_path, optimizer=optimizer))
    node = PSShardNode(cfg, "ps0")
    reference = models.from_config(cfg, seed=cfg.model.seed)
    opts = _reference_optimizers(optimizer, reference, cfg.optimizer.eps)
    batches = _batches(6)
    async with serving(node, cfg.shards[0].bind):
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
    cfg = load(sparse_click_config(tmp_path, optimizer="sgd"))
    node = PSShardNode(cfg, "ps0")
    core = node.core
    table = [k for k, c in core.chunks.items() if c.dim]
    dense = [k for k, c in core.chunks.items() if not c.dim]
    k = table[1]
    rows, grads = torch.tensor([0, 3, 7]), torch.ones(3, DIM)
    async with serving(node) as as_worker:
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
    cfg = load(sparse_click_config(tmp_path, optimizer="sgd", consistency="sync", workers=("cpu0", "cpu1")))
    node = PSShardNode(cfg, "ps0")
    core = node.core
    k = next(k for k, c in core.chunks.items() if c.dim)
    dense = tuple(k for k, c in core.chunks.items() if not c.dim)
    ones = tuple(torch.ones(core.chunks[d].param.numel()) for d in dense)
    a, b = torch.randn(2, DIM), torch.randn(2, DIM)
    async with serving(node) as as_worker:
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
    cfg = load(sparse_click_config(tmp_path, optimizer="adam", consistency=consistency, shards=2, ps_extra="replicas = 2"))
    ps0, ps1 = PSShardNode(cfg, "ps0"), PSShardNode(cfg, "ps1")
    batches = _batches(5, seed=1)
    async with running(ps0), running(ps1), client_of(ps0, "scheduler") as sched0, client_of(ps1, "scheduler") as sched1:
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
        assert_cores_identical(ps0.core, ps1.backups["ps0"])
        assert_cores_identical(ps1.core, ps0.backups["ps1"])


def test_jobs_that_would_drop_sparse_gradients_are_refused_at_load(tmp_path):
    with pytest.raises(ConfigError) as hogwild:
        load(sparse_click_config(tmp_path, node_extra="hogwild_threads = 2"))
    assert hogwild.value.key == "nodes[2].hogwild_threads" and TABLE in str(hogwild.value)
    assert isinstance(load(sparse_click_config(tmp_path)), object)  # the same job with one thread loads
