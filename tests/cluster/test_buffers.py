"""BatchNorm statistics travel with the parameters (docs/buffers.md): a user's BatchNorm MLP on scikit-learn's
wine, standardized, trained by real daemons for a fixed few epochs in PS (async, sync) and ring jobs, evaluates
in eval mode about as well as its BatchNorm-free twin on the same job, and its model.pt holds the running
statistics the shards hold at the end (their final checkpoints) or the ring members hold (their fingerprint)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hmp import job
from hmp.cluster import LocalCluster
from hmp.errors import ConfigError
from hmp.export import MODEL_FILE, load_model
from hmp.nodes.ring_worker import params_crc32
from hmp.ps import checkpoint
from hmp.train.evaluate import evaluate

from tests.support import nodes_toml, pipeline_config, scheduler_node

MODEL_SOURCE = '''
import torch
from torch import nn


class WineNet(nn.Module):
    """Linear, BatchNorm1d (or nothing: the twin), ReLU, Linear."""

    def __init__(self, in_features, classes, hidden=32, batchnorm=True):
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.norm = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.hidden(x))))
'''


def _wine_job(tmp: Path, name: str, consistency: str, batchnorm: bool) -> Path:
    """A wine job of two CPU workers, with two PS shards unless it is a ring; model and data in ``tmp``."""
    from sklearn.datasets import load_wine

    if not (tmp / "wine.npz").exists():
        d = load_wine()
        np.savez(tmp / "wine.npz", x=d.data.astype(np.float32), y=d.target)
        (tmp / "wine_net.py").write_text(MODEL_SOURCE)
    shards = () if consistency == "allreduce" else (("ps0", "ps"), ("ps1", "ps"))
    text = f"""
[job]
name = "{name}"
report_dir = "{tmp / name}"
heartbeat_interval_s = 1.0
join_timeout_s = 60

[model]
name = "wine_net.py:WineNet"
args = {{ in_features = 13, classes = 3, hidden = 32, batchnorm = {str(batchnorm).lower()} }}

[data]
kind = "npz"
path = "wine.npz"
test_fraction = 0.25
standardize = true

[optimizer]
name = "sgd"
lr = 0.05
momentum = 0.9

[train]
consistency = "{consistency}"
batch_size = 16
epochs = 12
max_seconds = 60
eval_every_s = 0.5
report_interval_s = 0.3

[ps]
chunk_bytes = 1024
checkpoint_dir = "{tmp / name / 'ckpt'}"
""" + nodes_toml(scheduler_node(), *shards, ("cpu0", "cpu_worker"), ("cpu1", "cpu_worker"))
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


async def _train(path: Path) -> tuple[dict, object]:
    cfg = job.load(path)
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=90)
    return report, cfg


@pytest.mark.parametrize("consistency", ["async", "sync", "allreduce"])
async def test_a_batchnorm_model_trains_as_well_as_its_twin_and_exports_the_statistics_it_trained(
        tmp_path: Path, consistency: str) -> None:
    report, cfg = await _train(_wine_job(tmp_path, "bn", consistency, batchnorm=True))
    twin, _ = await _train(_wine_job(tmp_path, "twin", consistency, batchnorm=False))
    run = cfg.report_dir
    assert (run / MODEL_FILE).exists(), report["final"]
    model = load_model(run)
    model = getattr(model, "model", model)  # the user's module itself, should the export wrap it (raw features)
    data = job.dataset(cfg)
    accuracy = evaluate(model, data.x_test, data.y_test)["test_accuracy"]  # in eval mode: the running statistics
    assert accuracy == report["final"]["test_accuracy"]
    bn = model.norm
    assert int(bn.num_batches_tracked) > 0 and bn.running_mean.abs().sum() > 0  # not the initial statistics
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    # about the twin's (a 45-row test set: one row is 0.022)
    assert accuracy >= twin["final"]["test_accuracy"] - 0.15 and accuracy >= 0.8, (accuracy, twin["final"])

    exported = job.sharded_model(cfg)  # the model as laid out, holding model.pt's values
    exported.model.load_state_dict(torch.load(run / MODEL_FILE, weights_only=True))
    if consistency == "allreduce":
        finals = [report["series"][w][-1] for w in ("cpu0", "cpu1")]
        assert len({f["buffers_crc32"] for f in finals}) == 1  # every member holds the same statistics
        assert finals[0]["buffers_crc32"] == float(params_crc32(exported.flat.buffers))  # and model.pt holds them
        return
    # the PS: model.pt's buffers are what the shards held at the end (their final checkpoints)
    views = exported.buffer_views()
    held = {}
    for shard in ("ps0", "ps1"):
        held.update(checkpoint.read(job.checkpoint_dir(cfg) / f"{shard}.pt")["params"])
    assert exported.buffer_keys <= held.keys()
    for key in exported.buffer_keys:
        assert torch.equal(held[key], views[key]), key


# ---------------------------------------------------------------- pipelines: refused, not silently wrong
def test_a_pipeline_job_of_a_model_with_buffers_is_a_config_error(tmp_path):
    pipeline_config(tmp_path)
    path = tmp_path / "pipe.toml"
    (tmp_path / "bn_net.py").write_text(
        "from torch import nn\n\n\ndef bn_net():\n"
        "    return nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))\n")
    text = path.read_text()
    model = text[text.index("[model]"):text.index("[data]")]
    text = text.replace(model, '[model]\nname = "bn_net.py:bn_net"\n\n')
    with pytest.raises(ConfigError, match=r"placement.enabled.*\(1.running_mean, 1.running_var"):
        job.loads(text, str(path))
    (tmp_path / "ln_net.py").write_text((tmp_path / "bn_net.py").read_text().replace("BatchNorm1d", "LayerNorm"))
    job.loads(text.replace("bn_net.py:bn_net", "ln_net.py:bn_net"), str(path))  # its LayerNorm twin loads
