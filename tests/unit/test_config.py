"""Config loading: frozen dataclasses, and errors that name the file, the key and what was expected."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hmp.config import env_overrides
from hmp.config.reference import reference
from hmp.errors import ConfigError
from hmp.job import load, loads
from tests.support import GOOD_CONFIG

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    """Every job config in conf/ loads and has the roles a job needs (hosts*.toml are hmp-emulate's host files)."""
    for path in sorted(p for p in (ROOT / "conf").glob("*.toml") if not p.name.startswith("hosts")):
        cfg = load(path, free_port=lambda host: 47999)  # conf/counts.toml leaves the port to hmp-launch
        assert cfg.scheduler and cfg.workers, path
        assert bool(cfg.shards) == (cfg.train.consistency != "allreduce"), path  # a ring job has no PS


def test_allreduce_config_errors_name_the_key():
    """An allreduce job with PS shards, unequal batch sizes, a non-static policy or a bad [collective] number is
    refused naming the key; a PS job without shards too."""
    base = """
[train]
consistency = "allreduce"
{train}
[collective]
{collective}
[[nodes]]
id = "s"
role = "scheduler"
bind = "tcp://127.0.0.1:5555"
[[nodes]]
id = "w0"
role = "cpu_worker"
{worker}
{extra}
"""
    cases = [
        ({"extra": '[[nodes]]\nid = "ps0"\nrole = "ps"'}, "nodes", "no node with role 'ps'"),
        ({"worker": "batch_size = 7"}, "nodes[1].batch_size", "equal slice"),
        ({"train": 'policy = "hogbatch"'}, "train.policy", "lockstep"),
        ({"collective": "bucket_bytes = 3"}, "collective.bucket_bytes", ">= 64"),
        ({"collective": "timeout_s = -1"}, "collective.timeout_s", ">= 0"),
        ({"collective": 'algorithm = "tree"'}, "collective.algorithm", "one of 'auto', 'ring', 'halving'"),
        ({"collective": "piece = 5"}, "collective.piece", "unknown key"),
    ]
    for fill, key, words in cases:
        text = base.format(**{"train": "", "collective": "", "worker": "", "extra": "", **fill})
        with pytest.raises(ConfigError) as info:
            loads(text, "ring.toml")
        assert info.value.key == key and words in str(info.value) and "ring.toml" in str(info.value), (fill, info.value)
    with pytest.raises(ConfigError, match="at least one node with role 'ps'"):
        loads(base.format(train="", collective="", worker="", extra="").replace('"allreduce"', '"sync"'), "x.toml")


def test_local_default_topology():
    """conf/local.toml is 1 scheduler, 2 PS shards, 1 CPU worker and 1 GPU worker on the CPU."""
    cfg = load(ROOT / "conf/local.toml")
    roles = sorted(n.role for n in cfg.nodes)
    assert roles == ["cpu_worker", "gpu_worker", "ps", "ps", "scheduler"]
    assert cfg.by_role("gpu_worker")[0].device == "cpu"


def test_config_is_frozen_and_typed():
    """Loaded config is immutable and ints given for floats become floats."""
    cfg = loads(GOOD_CONFIG, "x.toml")
    assert cfg.train.consistency == "sync"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.epochs = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("patch", "key", "expected"),
    [
        (("[train]", "[train]\nepoch = 3"), "train.epoch", "unknown key"),
        (("[train]", "[train]\nepochs = \"many\""), "train.epochs", "expected an integer"),
        (('consistency = "sync"', 'consistency = "eventual"'), "train.consistency", "one of"),
        (('id = "p"', 'id = "s"'), "nodes[1].id", "unique id"),
        (('role = "ps"', 'role = "pserver"'), "nodes[1].role", "one of"),
        (('[[nodes]]\nid = "p"\nrole = "ps"\n', ""), "nodes", "at least one node with role 'ps'"),
        (("[train]", "[trainer]"), "trainer", "unknown section"),
        (("[train]", "[train]\nbatch_size = 0"), "train.batch_size", ">= 1"),
        (('bind = "tcp://127.0.0.1:5999"', 'bind = "http://x"'), "nodes[0].bind", "tcp://"),
    ],
)
def test_config_errors_name_file_key_and_expectation(patch, key, expected):
    """Each bad config is refused with the file name, the offending key and what was expected."""
    text = GOOD_CONFIG.replace(*patch, 1)
    with pytest.raises(ConfigError) as info:
        loads(text, "bad.toml")
    assert info.value.path == "bad.toml" and info.value.key == key
    assert expected in str(info.value) and "bad.toml" in str(info.value)


def test_duplicate_bind_address_is_an_error():
    """Two nodes binding the same fixed address are refused."""
    text = GOOD_CONFIG.replace('id = "p"\nrole = "ps"', 'id = "p"\nrole = "ps"\nbind = "tcp://127.0.0.1:5999"')
    with pytest.raises(ConfigError, match="unique address"):
        loads(text, "dup.toml")


def test_unreadable_file_and_bad_toml(tmp_path):
    """A missing file and invalid TOML are config errors naming the file."""
    with pytest.raises(ConfigError, match="nope.toml"):
        load(tmp_path / "nope.toml")
    p = tmp_path / "broken.toml"
    p.write_text("[train\n")
    with pytest.raises(ConfigError, match="broken.toml.*valid TOML"):
        load(p)


def test_env_overrides_are_typed():
    """HMP_* overrides replace their keys and a bad value names the variable."""
    cfg = loads(GOOD_CONFIG, "x.toml")
    assert env_overrides(cfg, {"HMP_MAX_SECONDS": "12"}).train.max_seconds == 12.0
    with pytest.raises(ConfigError, match="HMP_MAX_SECONDS"):
        env_overrides(cfg, {"HMP_MAX_SECONDS": "soon"})


def test_reference_lists_every_section():
    """The generated config reference documents every section and key."""
    ref = reference()
    for section in ("[job]", "[model]", "[data]", "[optimizer]", "[train]", "[ps]", "[limits]", "[[nodes]]"):
        assert section in ref
    assert "`consistency`" in ref and "`chunk_bytes`" in ref


PIPELINE = (ROOT / "conf/click_pipeline.toml").read_text()


@pytest.mark.parametrize(
    ("patch", "key", "expected"),
    [
        (("sparse = 0.1,", "sparse = -1.0,"), "placement.resources[1].speed_scale.sparse", "a number > 0"),
        (('{ name = "cpu", price_per_hour = 0.17,', '{ name = "cpu", cost = 0.17,'), "placement.resources[0].cost",
         "unknown key"),
        (("measured = false, speed_scale = { sparse = 0.1, dense = 8.0, elementwise = 4.0 }", "measured = false"),
         "placement.resources[1].speed_scale", "required for a type that is not measured"),
        (("min_gain = 0.1", "min_gain = 0.1\nmessage_overhead_s = -1.0"), "placement.message_overhead_s", ">= 0"),
        (('resource = "accel"', 'resource = "tpu"'), "nodes[5].resource", "one of the [placement] resources"),
        (("micro_batches = 4", "micro_batches = 3"), "train.batch_size", "a multiple of placement.micro_batches"),
    ],
)
def test_placement_errors_name_file_key_and_expectation(patch, key, expected):
    """[placement] is validated at load by the planner's own parse_spec (resources, link, demand) and the runtime's
    checks (workers' types, micro-batches): each error names the file, the key and what was expected."""
    assert patch[0] in PIPELINE
    with pytest.raises(ConfigError) as info:
        loads(PIPELINE.replace(*patch, 1), "pipe.toml")
    assert info.value.path == "pipe.toml" and info.value.key == key, str(info.value)
    assert expected in str(info.value)


def test_placement_message_overhead_default_is_the_planners():
    """[placement] message_overhead_s defaults to the figure the planner's spec uses (measured on this runtime)."""
    from hmp.placement.spec import DEFAULT_MESSAGE_OVERHEAD_S, parse_spec, spec_table

    cfg = load(ROOT / "conf/click_pipeline.toml")
    assert cfg.placement.message_overhead_s == DEFAULT_MESSAGE_OVERHEAD_S
    spec = parse_spec(spec_table(cfg, 1e5), counts={"cpu": 2, "accel": 1})
    assert spec.micro_batches == cfg.placement.micro_batches and spec.reps == cfg.placement.profile_repeats


def test_unwritable_folders_are_config_errors_naming_key_and_path(tmp_path):
    """A report or checkpoint folder that cannot be written or made is refused at load (every daemon and the
    launcher load the config) naming the key and the path; a folder that does not exist yet but can be
    made is fine, and nothing is made by the check."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    fine = tmp_path / "not" / "yet"
    cfg = loads(f'[job]\nreport_dir = "{fine}"\n' + GOOD_CONFIG)
    assert cfg.report_dir == fine and not (tmp_path / "not").exists()
    for section, key in (("job", "report_dir"), ("ps", "checkpoint_dir")):
        with pytest.raises(ConfigError) as info:
            loads(f'[{section}]\n{key} = "{blocker / "run"}"\n' + GOOD_CONFIG, "job.toml")
        assert info.value.key == f"{section}.{key}" and info.value.path == "job.toml"
        assert str(blocker) in info.value.expected and "is a file" in info.value.expected
    # With shards the default checkpoint folder lies in the report folder: an unwritable report folder is
    # named once, by its own key.
    with pytest.raises(ConfigError, match="job.report_dir"):
        loads(f'[job]\nreport_dir = "{blocker}"\n' + GOOD_CONFIG)


def test_a_shard_share_over_max_message_bytes_is_refused_with_the_fix():
    """A pull reply carries all of a shard's chunks: a share over limits.max_message_bytes is refused at load
    with the size to raise it to; that size itself loads, and so does the same limit with more shards."""
    from hmp.job import sharded_model

    cfg = loads(GOOD_CONFIG.replace('[train]', '[ps]\nchunk_bytes = 4096\n[train]'))
    share = max(sum(sharded_model(cfg).chunks[k].nbytes for k in keys)
                for keys in sharded_model(cfg).assignment.values())
    tight = GOOD_CONFIG.replace('[train]', f'[ps]\nchunk_bytes = 4096\n[limits]\nmax_message_bytes = {share - 1}\n[train]')
    with pytest.raises(ConfigError) as info:
        loads(tight)
    assert info.value.key == "limits.max_message_bytes"
    assert f"raise limits.max_message_bytes to at least {share} or add PS shards" in info.value.expected
    loads(tight.replace(f"max_message_bytes = {share - 1}", f"max_message_bytes = {share}"))
    two_shards = tight + '[[nodes]]\nid = "p2"\nrole = "ps"\n'
    loads(two_shards)


def test_resilience_keys_load():
    cfg = loads('[job]\nrestarts = { cpu_worker = 2, ps = 1 }\ntoken = "abc123"\n[ps]\ncheckpoint_every_s = 0\n'
                + GOOD_CONFIG.replace('consistency = "sync"', 'consistency = "sync"\nmin_workers = 1'))
    assert cfg.job.restarts == {"cpu_worker": 2, "ps": 1} and cfg.job.token == "abc123"
    assert cfg.ps.checkpoint_every_s == 0.0 and cfg.train.min_workers == 1
