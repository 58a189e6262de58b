"""Module buffers over real endpoints (docs/buffers.md): a worker's BatchNorm statistics reach the shard with its
push, and another client's pull writes them into its own model's buffers; the optimizer never touches them."""

from __future__ import annotations

import torch

from hmp import job
from hmp.client import PSClient
from hmp.nodes.ps_shard import PSShardNode

from tests.support import nodes_toml, scheduler_node, serving

MODEL = '''
from torch import nn


def bn_mlp():
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
'''


def _config(tmp_path):
    (tmp_path / "bn_mlp.py").write_text(MODEL)
    text = f"""
[job]
name = "buffers"
report_dir = "{tmp_path / 'run'}"

[model]
name = "bn_mlp.py:bn_mlp"

[data]
kind = "digits"

[optimizer]
name = "sgd"
lr = 0.1
momentum = 0.9
weight_decay = 0.01
""" + nodes_toml(scheduler_node(), ("ps0", "ps"), ("cpu0", "cpu_worker"),
                 ("cpu1", "cpu_worker"))
    path = tmp_path / "job.toml"
    path.write_text(text)
    return job.load(path)


async def test_a_push_carries_the_statistics_and_a_pull_brings_them_to_another_model(tmp_path):
    cfg = _config(tmp_path)
    node = PSShardNode(cfg, "ps0")
    assert node.core.buffer_keys == node.sharded.buffer_keys and node.core.buffer_keys
    async with serving(node):
        address = node.server.address
        trainer = PSClient(job.sharded_model(cfg), [("ps0", address)], name="cpu0", shm=False)
        reader = PSClient(job.sharded_model(cfg), [("ps0", address)], name="cpu1", shm=False)
        async with trainer, reader:
            await trainer.pull()
            model = trainer.model.train()
            torch.nn.functional.cross_entropy(model(torch.randn(16, 64) * 2 + 1), torch.randint(0, 10, (16,))).backward()
            bn = model[1]
            pushed = {"mean": bn.running_mean.clone(), "var": bn.running_var.clone()}
            assert int(bn.num_batches_tracked) == 1
            await trainer.push(samples=16)
            # the reply's values are the shard's: exactly what was pushed, no optimizer step on them
            assert torch.equal(bn.running_mean, pushed["mean"]) and torch.equal(bn.running_var, pushed["var"])
            other = reader.model[1]
            assert torch.equal(other.running_mean, torch.zeros(32))
            await reader.pull()
            assert torch.equal(other.running_mean, pushed["mean"]) and torch.equal(other.running_var, pushed["var"])
            assert int(other.num_batches_tracked) == 1
            # the parameters did go through the optimizer
            assert not torch.equal(reader.model[0].weight, job.sharded_model(cfg).model[0].weight)
