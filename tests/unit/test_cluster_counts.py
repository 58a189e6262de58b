"""Topologies by count: a ``[cluster]`` table made into ``[[nodes]]``, its errors naming the ``cluster`` key,
the config written back (``hmp.config.toml_text``) loading to the same config, and the device check."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hmp import config, job
from hmp.config.toml_text import absolute_paths, dumps, resolved_text
from hmp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

COUNTS = """
[train]
consistency = "{consistency}"
batch_size = 32
[cluster]
scheduler_port = 47999
{cluster}
"""


def counts(cluster: str = "", consistency: str = "async", **kw) -> config.Config:
    text = COUNTS.format(cluster=cluster, consistency=consistency)
    if "scheduler_port" in cluster:  # the case's own port instead of the fixed one
        text = text.replace("scheduler_port = 47999\n", "", 1)
    return config.loads(text, "counts.toml", **kw)


def test_counts_make_the_nodes_with_their_roles_ids_and_free_ports():
    cfg = counts("ps = 2\ncpu_workers = 3\ngpu_workers = 1\ncpu_batch_size = 16\ngpu_batch_size = 128\n"
                 'gpu_device = "cpu"\nthreads = 2')
    assert [(n.id, n.role) for n in cfg.nodes] == [
        ("scheduler", "scheduler"), ("ps0", "ps"), ("ps1", "ps"), ("cpu0", "cpu_worker"), ("cpu1", "cpu_worker"),
        ("cpu2", "cpu_worker"), ("gpu0", "gpu_worker")]
    assert cfg.scheduler.bind == "tcp://127.0.0.1:47999"
    assert all(n.bind == "tcp://127.0.0.1:0" for n in cfg.nodes[1:])  # the OS picks each port
    assert [n.batch_size for n in cfg.workers] == [16, 16, 16, 128]
    assert cfg.node("gpu0").device == "cpu" and cfg.node("cpu0").device == ""
    assert {n.threads for n in cfg.nodes} == {2}
    assert cfg.nodes_from_counts and "cluster" not in cfg.raw and len(cfg.raw["nodes"]) == 7


def test_defaults_one_shard_one_cpu_worker_and_no_shard_in_a_ring():
    cfg = counts()
    assert [n.id for n in cfg.nodes] == ["scheduler", "ps0", "cpu0"]
    ring = counts("cpu_workers = 2", consistency="allreduce")
    assert [n.id for n in ring.nodes] == ["scheduler", "cpu0", "cpu1"] and not ring.shards


def test_a_picked_scheduler_port_and_port_0_without_a_picker():
    with pytest.raises(ConfigError) as info:
        config.loads("[cluster]\ncpu_workers = 1\n", "c.toml")
    assert info.value.key == "cluster.scheduler_port" and "hmp-launch picks a free one" in str(info.value)
    asked = []
    cfg = config.loads('[cluster]\nhost = "127.0.0.2"\n', "c.toml", free_port=lambda h: asked.append(h) or 41234)
    assert asked == ["127.0.0.2"] and cfg.scheduler.bind == "tcp://127.0.0.2:41234"
    assert cfg.node("ps0").bind == "tcp://127.0.0.2:0"


@pytest.mark.parametrize(("cluster", "consistency", "key", "words"), [
    ("ps = 1", "allreduce", "cluster.ps", "0 when train.consistency"),
    ("ps = 0", "async", "cluster.ps", "an integer >= 1"),
    ("cpu_workers = 0", "async", "cluster.cpu_workers", "at least one worker"),
    ("gpu_workers = -1", "async", "cluster.gpu_workers", ">= 0"),
    ('gpu_device = "tpu"', "async", "cluster.gpu_device", "'cpu', 'cuda' or 'cuda:N'"),
    ('host = "0.0.0.0"', "async", "cluster.host", "not a wildcard"),
    ("threads = 0", "async", "cluster.threads", ">= 1"),
    ("cpu_workers = 2\ncpu_batch_size = 8", "allreduce", "cluster.cpu_batch_size", "equal slice"),
    ("scheduler_port = 70000", "async", "cluster.scheduler_port", "1-65535"),
    ("workers = 2", "async", "cluster.workers", "unknown key"),
    ('cpu_workers = "two"', "async", "cluster.cpu_workers", "expected an integer"),
])
def test_bad_counts_name_the_cluster_key(cluster, consistency, key, words):
    with pytest.raises(ConfigError) as info:
        counts(cluster, consistency)
    assert info.value.key == key and words in str(info.value) and "counts.toml" in str(info.value), info.value


def test_cluster_and_nodes_at_once_is_an_error():
    text = COUNTS.format(cluster="", consistency="async") + '[[nodes]]\nid = "s"\nrole = "scheduler"\n'
    with pytest.raises(ConfigError) as info:
        config.loads(text, "both.toml")
    assert info.value.key == "cluster" and "not both" in str(info.value)


def test_min_workers_counts_the_made_workers():
    with pytest.raises(ConfigError, match="train.min_workers"):
        config.loads(COUNTS.format(cluster="cpu_workers = 2", consistency="async") + "", "m.toml",
                     overrides=["train.min_workers=3"])
    assert config.loads(COUNTS.format(cluster="cpu_workers = 3", consistency="async"), "m.toml",
                        overrides=["train.min_workers=3"]).train.min_workers == 3


def shipped() -> list[Path]:
    return sorted(p for p in (ROOT / "conf").glob("*.toml") if not p.name.startswith("hosts"))


@pytest.mark.parametrize("path", shipped(), ids=lambda p: p.name)
def test_written_back_a_config_loads_to_the_same_config_from_another_folder(path, tmp_path):
    """resolved_text(cfg) written anywhere loads to cfg again: every section, the nodes, and the paths that were
    relative to the config's folder (data files, model files) now absolute."""
    cfg = job.load(path, free_port=lambda host: 47998)
    again_path = tmp_path / "elsewhere" / "config.toml"
    again_path.parent.mkdir()
    again_path.write_text(resolved_text(cfg))
    again = config.load(again_path)
    for name in config.SECTIONS:
        if name not in ("data", "model", "cluster"):
            assert getattr(again, name) == getattr(cfg, name), name
    assert again.nodes == cfg.nodes and not again.nodes_from_counts
    if cfg.data.path:
        assert again.resolve(again.data.path) == cfg.resolve(cfg.data.path)
    assert again.model.args == cfg.model.args
    if ".py:" in cfg.model.name:
        assert again.model.name == f"{cfg.resolve(cfg.model.name.split(':')[0])}:{cfg.model.name.split(':')[1]}"
    else:
        assert again.model.name == cfg.model.name


def test_dumps_reads_back_and_refuses_what_toml_cannot_hold():
    raw = {"job": {"name": 'a "quoted" name\n', "restarts": {"cpu_worker": 2}}, "optimizer": {"eps": 1e-08},
           "train": {"max_seconds": float("inf")}, "placement": {"resources": [{"name": "cpu", "speed_scale": 1.5}]},
           "model": {"args": {"hidden": [64, 32], "odd key": True}}, "nodes": [{"id": "s", "role": "scheduler"}]}
    assert tomllib.loads(dumps(raw)) == raw
    with pytest.raises(TypeError, match="cannot write"):
        dumps({"job": {"name": object()}})


def test_absolute_paths_leave_module_paths_and_absolute_paths():
    raw = {"model": {"name": "pkg.models:build"}, "data": {"kind": "loaders.py:load", "path": "/abs/x.npz",
                                                             "test_path": "t.svm"}, "security": {"key_dir": "keys"}}
    out = absolute_paths(raw, Path("/cfg"))
    assert out == {"model": {"name": "pkg.models:build"}, "data": {"kind": "/cfg/loaders.py:load",
                                                                   "path": "/abs/x.npz", "test_path": "/cfg/t.svm"},
                   "security": {"key_dir": "/cfg/keys"}}
    assert raw["data"]["kind"] == "loaders.py:load"  # the input is not changed


def test_a_gpu_worker_on_cuda_without_cuda_names_its_device_key():
    cfg = counts("gpu_workers = 2")
    with pytest.raises(ConfigError) as info:
        job.check_devices(cfg, cuda_available=False)
    assert info.value.key == "nodes[3].device" and "torch.cuda.is_available() is false" in str(info.value)
    assert "cluster.gpu_device=cpu" in str(info.value)
    job.check_devices(cfg, cuda_available=True, cuda_devices=1)
    with pytest.raises(ConfigError, match="1 CUDA device"):
        job.check_devices(counts('gpu_workers = 1\ngpu_device = "cuda:1"'), cuda_available=True, cuda_devices=1)
    job.check_devices(counts('gpu_workers = 1\ngpu_device = "cpu"'), cuda_available=False)
    explicit = config.loads(COUNTS.format(cluster="", consistency="async").split("[cluster]")[0]
                            + '[[nodes]]\nid = "s"\nrole = "scheduler"\nbind = "tcp://127.0.0.1:5000"\n'
                            + '[[nodes]]\nid = "p"\nrole = "ps"\n[[nodes]]\nid = "g"\nrole = "gpu_worker"\n',
                            "explicit.toml")
    with pytest.raises(ConfigError) as info:
        job.check_devices(explicit, cuda_available=False)
    assert info.value.key == "nodes[2].device" and "'cuda'" in str(info.value) and "cluster" not in str(info.value)
