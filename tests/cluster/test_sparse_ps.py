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


import pytest

from hmp import models

from tests.support import BUCKETS, DIM, FIELDS, sparse_click_config


@pytest.mark.parametrize("consistency", ["async", "sync"])
async def test_a_sparse_click_job_trains_and_pushes_only_the_touched_rows(tmp_path, consistency):
    from hmp.cluster import LocalCluster

    cfg = sparse_click_config(tmp_path, optimizer="adam", consistency=consistency, shards=2, workers=("cpu0", "cpu1"),
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
