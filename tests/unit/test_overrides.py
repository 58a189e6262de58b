"""Command-line overrides (``hmp-launch JOB.toml train.lr=0.1``): TOML values, bare strings, and errors worded as
the file's are, naming the key and saying the value came from the command line."""

from __future__ import annotations

import pytest

from hmp import config, job
from hmp.config import overrides
from hmp.errors import ConfigError
from tests.support import GOOD_CONFIG


@pytest.mark.parametrize(("text", "key", "value"), [
    ("optimizer.lr=0.1", ("optimizer", "lr"), 0.1),
    ("train.epochs=3", ("train", "epochs"), 3),
    ("model.args.hidden=[64,32]", ("model", "args", "hidden"), [64, 32]),
    ("model.args={ hidden = [8] }", ("model", "args"), {"hidden": [8]}),
    ("train.consistency=sync", ("train", "consistency"), "sync"),
    ('train.consistency="ssp"', ("train", "consistency"), "ssp"),
    ("job.name=2024", ("job", "name"), "2024"),            # a string key takes the text as it is
    ("data.standardize=true", ("data", "standardize"), True),
    ("model.name=conf/user_model.py:TabularNet", ("model", "name"), "conf/user_model.py:TabularNet"),
    ("model.args.act=relu", ("model", "args", "act"), "relu"),  # not TOML, not a string key: still a string
    ("job.name = spaced ", ("job", "name"), "spaced"),
])
def test_values_are_toml_and_bare_text_is_a_string(text, key, value):
    o = overrides.parse(text)
    assert o.key == key and o.value == value and type(o.value) is type(value) and o.text == text


@pytest.mark.parametrize(("text", "key", "words"), [
    ("optimizer.lr", "optimizer.lr", "KEY=VALUE"),
    ("lr=0.1", "lr", "SECTION.KEY=VALUE"),
    ("optimizer.lr=", "optimizer.lr", "a value after '='"),
    ("model.args.hidden=[64,", "model.args.hidden", "a TOML value"),
    ("=3", "=3", "KEY=VALUE"),
    ("train..epochs=3", "train..epochs", "SECTION.KEY=VALUE"),
])
def test_malformed_overrides_name_the_argument(text, key, words):
    with pytest.raises(ConfigError) as info:
        overrides.parse(text)
    assert info.value.path == "the command line" and info.value.key == key and words in str(info.value)


def test_overrides_replace_the_files_values_and_are_recorded():
    cfg = config.loads(GOOD_CONFIG, "x.toml", overrides=["optimizer.lr=0.5", "train.epochs=2", "model.args.hidden=[7]",
                                                         "train.epochs=4"])
    assert cfg.optimizer.lr == 0.5 and cfg.train.epochs == 4 and cfg.model.args == {"hidden": [7]}
    assert cfg.overrides == ("optimizer.lr=0.5", "train.epochs=2", "model.args.hidden=[7]", "train.epochs=4")
    assert cfg.raw["optimizer"] == {"lr": 0.5} and cfg.raw["train"]["epochs"] == 4
    assert config.loads(GOOD_CONFIG, "x.toml").overrides == ()
    # the environment's overrides still apply on top
    assert config.env_overrides(cfg, {"HMP_MAX_SECONDS": "7"}).train.max_seconds == 7.0


@pytest.mark.parametrize(("override", "file_patch", "key"), [
    ("optimizer.lr=fast", ("[train]", "[optimizer]\nlr = \"fast\"\n[train]"), "optimizer.lr"),
    ("train.epochs=0", ("[train]", "[train]\nepochs = 0"), "train.epochs"),
    ("train.epoch=3", ("[train]", "[train]\nepoch = 3"), "train.epoch"),
    ("trainer.lr=1", ("[train]", "[trainer]\nlr = 1\n[train]"), "trainer"),
    ("train.consistency=eventual", ('consistency = "sync"', 'consistency = "eventual"'), "train.consistency"),
])
def test_an_overrides_error_is_the_files_naming_the_command_line(override, file_patch, key):
    """The same bad value from the file and from the command line: the same key and words; the command line's
    names the override and says where it came from."""
    with pytest.raises(ConfigError) as from_file:
        config.loads(GOOD_CONFIG.replace(*file_patch, 1), "x.toml")
    with pytest.raises(ConfigError) as from_cli:
        config.loads(GOOD_CONFIG, "x.toml", overrides=["train.epochs=2", override])
    assert from_cli.value.key == from_file.value.key == key
    assert from_cli.value.expected == from_file.value.expected
    assert from_cli.value.path == f"x.toml with {override} from the command line"
    assert str(from_cli.value).startswith(f"x.toml with {override} from the command line: key '{key}': ")


def test_a_check_across_keys_names_every_override():
    with pytest.raises(ConfigError) as info:
        config.loads(GOOD_CONFIG, "x.toml", overrides=["train.epochs=2", "train.consistency=allreduce"])
    assert info.value.key == "nodes" and "no node with role 'ps'" in str(info.value)
    assert info.value.path == "x.toml with train.epochs=2 train.consistency=allreduce from the command line"


def test_a_subsystems_check_names_the_override_too():
    """hmp.job's checks (here the model's arguments) blame the override like the config's own checks."""
    with pytest.raises(ConfigError) as info:
        job.loads(GOOD_CONFIG, "x.toml", overrides=["model.args.depth=3"])
    assert info.value.key.startswith("model.args") and "with model.args.depth=3 from the command line" in str(info.value)


def test_counts_from_the_command_line():
    counted = GOOD_CONFIG.split("[[nodes]]")[0] + "[cluster]\nscheduler_port = 5999\nps = 1\n"
    cfg = config.loads(counted, "c.toml", overrides=["cluster.cpu_workers=4", "cluster.ps=2"])
    assert [n.id for n in cfg.workers] == ["cpu0", "cpu1", "cpu2", "cpu3"] and len(cfg.shards) == 2
    with pytest.raises(ConfigError) as info:  # the file has [[nodes]]: counts too would be both
        config.loads(GOOD_CONFIG, "x.toml", overrides=["cluster.cpu_workers=4"])
    assert info.value.key == "cluster" and "with cluster.cpu_workers=4 from the command line" in str(info.value)


def test_a_nodes_key_by_id_and_what_is_refused():
    cfg = config.loads(GOOD_CONFIG, "x.toml", overrides=["nodes.w.batch_size=3", "nodes.w.device=cpu"])
    assert cfg.node("w").batch_size == 3 and cfg.node("w").device == "cpu"
    with pytest.raises(ConfigError) as info:
        config.loads(GOOD_CONFIG, "x.toml", overrides=["nodes.w.batch_size=-3"])
    assert info.value.key == "nodes[2].batch_size" and ">= 0" in str(info.value)
    assert info.value.path == "x.toml with nodes.w.batch_size=-3 from the command line"
    with pytest.raises(ConfigError) as info:
        config.loads(GOOD_CONFIG, "x.toml", overrides=["nodes.worker.batch_size=3"])
    assert info.value.key == "nodes.worker.batch_size" and "one of ['s', 'p', 'w']" in str(info.value)
    counted = GOOD_CONFIG.split("[[nodes]]")[0] + "[cluster]\nscheduler_port = 5999\n"
    with pytest.raises(ConfigError) as info:
        config.loads(counted, "c.toml", overrides=["nodes.cpu0.batch_size=3"])
    assert "cluster.cpu_batch_size=16" in str(info.value)
    with pytest.raises(ConfigError, match="nodes.ID.KEY=VALUE"):
        config.loads(GOOD_CONFIG, "x.toml", overrides=["nodes.w=3"])
    with pytest.raises(ConfigError) as info:
        config.loads(GOOD_CONFIG, "x.toml", overrides=["train.epochs=2", "train.epochs.max=3"])
    assert info.value.key == "train.epochs" and "a table to set 'max' in" in str(info.value)
