"""Pure tests of the Hogbatch policies: scripted reports and the virtual-time simulator."""

from __future__ import annotations

from hmp.batching.adapter import PolicyAdapter
from hmp.batching.simulator import SimWorker
from hmp.job import load

from tests.support import write_config

CPU_GPU = [("c0", "cpu"), ("g0", "gpu")]
TEN_X = {"c0": SimWorker("cpu", 1000.0), "g0": SimWorker("gpu", 10_000.0)}


# ----------------------------------------------------------------------------- factory and validation


def test_a_worker_dropped_as_stale_before_it_joined_can_still_join(tmp_path):
    """With stale_after_s, a slow-starting worker is dropped before its first report; its join
    then gets its configured batch, and its first report registers it again."""
    cfg = load(write_config(tmp_path, policy="adaptive", extra_train="policy_args = { stale_after_s = 2.0 }"))
    adapter = PolicyAdapter(cfg)
    for t in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0):
        adapter.update("cpu0", {"samples": 100 * t, "busy_s": 0.1 * t, "updates": int(10 * t), "batch_size": 16}, t)
    assert "gpu0" not in adapter.policy.live
    assert adapter.initial("gpu0") == 128  # its configured batch
    batch, share = adapter.update("gpu0", {"samples": 1280, "busy_s": 0.1, "updates": 10, "batch_size": 128}, 3.5)
    assert "gpu0" in adapter.policy.live and batch >= 1 and 0 < share < 1
