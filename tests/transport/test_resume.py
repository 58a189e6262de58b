"""Resuming nodes in one process."""

from __future__ import annotations

import pytest

from hmp import job
from hmp.config import load
from hmp.errors import ConfigError
from hmp.nodes.scheduler import SchedulerNode
from tests.support import write_config


def test_an_unreadable_scheduler_state_is_a_config_error_naming_it(tmp_path):
    cfg = load(write_config(tmp_path))
    state = job.checkpoint_dir(cfg) / "scheduler.json"
    state.parent.mkdir(parents=True)
    state.write_text("{ not json")
    with pytest.raises(ConfigError) as err:
        SchedulerNode(cfg, "scheduler", resume=True)
    assert str(state) in str(err.value) and "--resume" in str(err.value)
    state.unlink()
    assert SchedulerNode(cfg, "scheduler", resume=True).core.time_offset == 0.0  # none saved: from zero
