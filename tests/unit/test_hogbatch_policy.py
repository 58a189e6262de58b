"""Hogbatch and Adaptive Hogbatch batch-size policies, pure."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hmp.batching import hogbatch, simulator
from hmp.batching.hogbatch import (
    AdaptiveHogbatch,
    Assignment,
    BatchPolicy,
    StaticHogbatch,
    StaticPolicy,
    SyncSGD,
    WorkerReport,
    make_policy,
)
from hmp.batching.simulator import SimWorker, simulate

CPU_GPU = [("c0", "cpu"), ("g0", "gpu")]


TEN_X = {"c0": SimWorker("cpu", 1000.0), "g0": SimWorker("gpu", 10_000.0)}


def rep(worker_id: str, kind: str, speed: float, t: float, batch: int = 16, updates: int = 0) -> WorkerReport:
    return WorkerReport(worker_id, kind, speed, updates, 0.5, 1.0, batch, t)


def shares_sum_to_one(assign: dict[str, Assignment]) -> bool:
    return math.isclose(sum(a.data_share for a in assign.values()), 1.0, rel_tol=1e-9)


def test_sync_gives_every_worker_the_same_batch_and_share():
    """SyncSGD assigns one batch size and equal synchronous shares whatever the speeds."""
    policy = SyncSGD(64)
    first = policy.initial(CPU_GPU + [("g1", "gpu")])
    out = policy.update([rep("c0", "cpu", 100.0, 1.0), rep("g0", "gpu", 9000.0, 1.0), rep("g1", "gpu", 5000.0, 1.0)], 1.0)
    for assign in (first, out):
        assert {a.batch_size for a in assign.values()} == {64}
        assert all(a.sync for a in assign.values())
        assert all(a.data_share == pytest.approx(1 / 3) for a in assign.values())


def test_sync_simulation_waits_for_the_straggler():
    """Under SyncSGD every worker makes the same number of updates, paced by the slowest."""
    result = simulate(SyncSGD(100), TEN_X, seconds=20)
    updates = result.updates()
    assert updates["c0"] == updates["g0"]
    assert updates["c0"] == pytest.approx(20 * 1000 / 100, abs=1)  # the CPU's pace, not the GPU's


def test_static_hogbatch_shares_follow_throughput_and_batches_stay_fixed():
    """StaticHogbatch keeps per-kind batch sizes and hands out data in proportion to speed."""
    policy = StaticHogbatch(cpu_batch=16, gpu_batch=1024, smoothing=0.0)
    first = policy.initial(CPU_GPU)
    assert first["c0"].data_share == pytest.approx(0.5)  # nothing measured yet: equal
    out = policy.update([rep("c0", "cpu", 1000.0, 1.0), rep("g0", "gpu", 10_000.0, 1.0)], 1.0)
    assert (out["c0"].batch_size, out["g0"].batch_size) == (16, 1024)
    assert out["g0"].data_share == pytest.approx(10 / 11)
    assert not any(a.sync for a in out.values())


def test_static_hogbatch_leaves_most_updates_to_the_cpu():
    """With a 10x faster GPU on large batches, the CPU makes most model updates (paper: 86-99%)."""
    result = simulate(StaticHogbatch(16, 1024), TEN_X, seconds=60)
    assert result.update_share("cpu") > 0.85
    assert result.sample_share("gpu") > 0.85  # while the GPU processes most of the data


def test_adaptive_balances_update_counts_when_unclipped():
    """AdaptiveHogbatch with threshold 1 sizes batches by speed so updates split about evenly."""
    result = simulate(AdaptiveHogbatch(16, 1, 4096, threshold=1.0), TEN_X, seconds=60)
    assert 0.45 <= result.update_share("cpu", since_s=10) <= 0.55
    final = result.final
    assert final["g0"].batch_size == pytest.approx(10 * final["c0"].batch_size, rel=0.05)
    assert final["g0"].data_share == pytest.approx(10 / 11, rel=0.02)


@pytest.mark.parametrize("threshold", [2.0, 4.0])
def test_adaptive_threshold_bounds_the_cpu_update_share(threshold):
    """The threshold caps the CPU's update share at threshold/(1+threshold) and keeps it above half."""
    result = simulate(AdaptiveHogbatch(16, 1, 8192, threshold=threshold), TEN_X, seconds=60)
    share = result.update_share("cpu", since_s=10)
    assert 0.55 < share <= threshold / (1 + threshold) + 0.02
    assert share == pytest.approx(threshold / (1 + threshold), abs=0.03)


def test_adaptive_threshold_trades_balance_for_gpu_utilization():
    """On a GPU that needs big batches, a larger threshold buys GPU throughput with update imbalance."""
    workers = {"c0": SimWorker("cpu", 1000.0), "g0": SimWorker("gpu", 10_000.0, half_batch=256)}
    balanced = simulate(AdaptiveHogbatch(16, 1, 4096, threshold=1.0), workers, seconds=120)
    relaxed = simulate(AdaptiveHogbatch(16, 1, 4096, threshold=4.0), workers, seconds=120)
    gpu_rate = lambda r: r.samples(since_s=60)["g0"] / 60  # noqa: E731
    assert gpu_rate(relaxed) > 5 * gpu_rate(balanced)
    assert balanced.update_share("cpu", since_s=60) == pytest.approx(0.5, abs=0.05)
    assert relaxed.update_share("cpu", since_s=60) == pytest.approx(0.8, abs=0.05)


def test_adaptive_clips_batches_to_bounds():
    """Batch sizes stay in [min_batch, max_batch] even when balance would need more."""
    policy = AdaptiveHogbatch(base_batch=8, min_batch=4, max_batch=32, threshold=1.0, smoothing=0.0)
    policy.initial(CPU_GPU)
    out = policy.update([rep("c0", "cpu", 100.0, 1.0), rep("g0", "gpu", 100_000.0, 1.0)], 1.0)
    assert out["g0"].batch_size == 32
    assert out["c0"].batch_size == 8


def test_adaptive_gpu_starts_at_its_configured_batch_until_measured():
    """initial_gpu_batch holds until the GPU worker's own speed arrives; then speeds decide."""
    policy = AdaptiveHogbatch(base_batch=16, max_batch=4096, threshold=2.0, smoothing=0.0, initial_gpu_batch=256)
    assert policy.initial(CPU_GPU)["g0"].batch_size == 256
    out = policy.update([rep("c0", "cpu", 1000.0, 1.0)], 1.0)  # only the CPU has measured
    assert out["g0"].batch_size == 256 and out["c0"].batch_size == 16
    out = policy.update([rep("g0", "gpu", 4000.0, 1.0)], 2.0)  # GPU 4x the CPU's speed
    assert out["g0"].batch_size == round(2.0 * 16 * 4)
    with pytest.raises(ValueError, match="initial_gpu_batch"):
        AdaptiveHogbatch(base_batch=16, initial_gpu_batch=0)


def test_adaptive_follows_a_worker_that_slows_down_mid_run():
    """When the GPU slows 4x at t=30 s, its batch shrinks about 4x and updates rebalance."""
    workers = {"c0": SimWorker("cpu", 1000.0), "g0": SimWorker("gpu", 10_000.0, slow_at_s=30, slow_factor=0.25)}
    result = simulate(AdaptiveHogbatch(16, 1, 4096, threshold=1.0), workers, seconds=60)
    before, after = result.assignments_at(29)["g0"].batch_size, result.assignments_at(59)["g0"].batch_size
    assert before == pytest.approx(160, rel=0.05)
    assert after == pytest.approx(40, rel=0.05)
    assert 0.45 <= result.update_share("cpu", since_s=45) <= 0.55


def test_static_shares_shift_when_a_worker_slows_down():
    """StaticHogbatch moves data share away from a worker whose throughput drops."""
    workers = {"c0": SimWorker("cpu", 1000.0), "g0": SimWorker("gpu", 10_000.0, slow_at_s=30, slow_factor=0.1)}
    result = simulate(StaticHogbatch(16, 1024), workers, seconds=60)
    assert result.assignments_at(29)["g0"].data_share == pytest.approx(10 / 11, abs=0.01)
    assert result.assignments_at(59)["g0"].data_share == pytest.approx(0.5, abs=0.02)
    assert result.assignments_at(59)["g0"].batch_size == 1024


def test_smoothing_damps_a_single_noisy_report():
    """With smoothing 0.8 one 5x spike moves the batch size far less than with no smoothing."""
    sizes = {}
    for smoothing in (0.0, 0.8):
        policy = AdaptiveHogbatch(16, 1, 4096, threshold=1.0, smoothing=smoothing)
        policy.initial(CPU_GPU)
        for t in range(1, 6):
            out = policy.update([rep("c0", "cpu", 1000.0, t), rep("g0", "gpu", 10_000.0, t)], t)
        assert out["g0"].batch_size == 160
        out = policy.update([rep("c0", "cpu", 1000.0, 6), rep("g0", "gpu", 50_000.0, 6)], 6)
        sizes[smoothing] = out["g0"].batch_size
    assert sizes[0.0] == 800
    assert sizes[0.8] == pytest.approx(160 * (0.8 + 0.2 * 5), rel=0.02)  # 288: one step of the EMA


@pytest.mark.parametrize("policy", [SyncSGD(32, stale_after_s=3.0), StaticHogbatch(16, 512, stale_after_s=3.0),
                                    AdaptiveHogbatch(16, 1, 4096, stale_after_s=3.0)], ids=lambda p: p.name)
def test_silent_worker_is_dropped_and_its_share_redistributed(policy):
    """A worker silent for longer than stale_after_s disappears and the shares re-sum to 1."""
    policy.initial(CPU_GPU + [("c1", "cpu")])
    for t in (1.0, 2.0):
        out = policy.update([rep("c0", "cpu", 1000.0, t), rep("c1", "cpu", 1000.0, t), rep("g0", "gpu", 8000.0, t)], t)
    assert set(out) == {"c0", "c1", "g0"}
    for t in (3.0, 4.0, 5.0):  # c1 went quiet after t=2: 3 s of silence is still tolerated
        out = policy.update([rep("c0", "cpu", 1000.0, t), rep("g0", "gpu", 8000.0, t)], t)
        assert "c1" in out
    out = policy.update([rep("c0", "cpu", 1000.0, 5.5), rep("g0", "gpu", 8000.0, 5.5)], 5.5)
    assert set(out) == {"c0", "g0"}
    assert shares_sum_to_one(out)
    if policy.name != "sync":
        assert out["g0"].data_share == pytest.approx(8 / 9)


def test_simulated_departure_moves_its_data_to_the_others():
    """In the simulator a worker that leaves stops counting and its data share goes to the rest."""
    workers = {"c0": SimWorker("cpu", 1000.0), "c1": SimWorker("cpu", 1000.0, leave_at_s=20), "g0": SimWorker("gpu", 10_000.0)}
    result = simulate(StaticHogbatch(16, 1024, stale_after_s=2.5), workers, seconds=40)
    assert result.updates(since_s=21)["c1"] == 0
    assert set(result.final) == {"c0", "g0"}
    assert result.final["g0"].data_share == pytest.approx(10 / 11, abs=0.01)
    assert result.assignments_at(19)["g0"].data_share == pytest.approx(10 / 12, abs=0.01)


def test_forget_redistributes_and_rejects_unknown_workers():
    """forget() removes a worker at once, keeps shares summing to 1, and names unknown ids."""
    policy = StaticHogbatch(16, 1024, smoothing=0.0)
    policy.initial(CPU_GPU + [("c1", "cpu")])
    policy.update([rep("c0", "cpu", 1000.0, 1), rep("c1", "cpu", 3000.0, 1), rep("g0", "gpu", 6000.0, 1)], 1.0)
    out = policy.forget("c1")
    assert set(out) == {"c0", "g0"} and shares_sum_to_one(out)
    assert out["c0"].data_share == pytest.approx(1 / 7)
    with pytest.raises(KeyError, match="c1"):
        policy.forget("c1")
    policy.forget("c0")
    assert policy.forget("g0") == {}


def test_late_joiner_is_registered_with_a_fair_first_share():
    """A report from an unknown worker registers it; until measured it counts as average speed."""
    policy = AdaptiveHogbatch(16, 1, 4096, smoothing=0.0)
    policy.initial(CPU_GPU)
    policy.update([rep("c0", "cpu", 1000.0, 1), rep("g0", "gpu", 9000.0, 1)], 1.0)
    out = policy.update([rep("c2", "cpu", 0.0, 2)], 2.0)  # joined, nothing processed yet
    assert set(out) == {"c0", "g0", "c2"} and shares_sum_to_one(out)
    assert out["c2"].data_share == pytest.approx(5000 / 15000)
    out = policy.update([rep("c2", "cpu", 2000.0, 3)], 3.0)
    assert out["c2"].batch_size == 32  # twice the slowest worker's speed: twice base_batch


def test_out_of_order_report_is_ignored():
    """A report older than one already counted for the same worker does not move the estimate."""
    policy = StaticHogbatch(16, 1024, smoothing=0.0)
    policy.initial(CPU_GPU)
    policy.update([rep("c0", "cpu", 1000.0, 5.0), rep("g0", "gpu", 4000.0, 5.0)], 5.0)
    policy.update([rep("g0", "gpu", 100.0, 4.0)], 6.0)
    assert policy.estimates()["g0"] == 4000.0


def test_make_policy_builds_each_policy_and_names_the_problem():
    """make_policy maps names to policies and rejects unknown names, unknown and missing knobs."""
    assert isinstance(make_policy("sync", batch_size=8), SyncSGD)
    assert isinstance(make_policy("hogbatch", cpu_batch=4, gpu_batch=256), StaticHogbatch)
    adaptive = make_policy("adaptive", base_batch=16, min_batch=2, max_batch=512, threshold=2.0, smoothing=0.3)
    assert isinstance(adaptive, AdaptiveHogbatch) and adaptive.threshold == 2.0
    assert isinstance(make_policy("static", batch_sizes={"c0": 4}, default_batch=8), StaticPolicy)
    for p in (make_policy("sync", batch_size=8), adaptive):
        assert isinstance(p, BatchPolicy)
    with pytest.raises(ValueError, match="expected one of"):
        make_policy("hogwild")
    with pytest.raises(ValueError, match="accepted knobs"):
        make_policy("sync", batch_size=8, threshold=2.0)
    with pytest.raises(ValueError, match="needs knob"):
        make_policy("hogbatch", cpu_batch=4)


@pytest.mark.parametrize(
    "build",
    [
        lambda: WorkerReport("w", "tpu", 1.0, 0, 0.0, 0.5, 8, 0.0),
        lambda: WorkerReport("w", "cpu", -1.0, 0, 0.0, 0.5, 8, 0.0),
        lambda: WorkerReport("w", "cpu", 1.0, 0, 0.0, 1.5, 8, 0.0),
        lambda: WorkerReport("w", "cpu", 1.0, 0, 0.0, 0.5, 0, 0.0),
        lambda: WorkerReport("", "cpu", 1.0, 0, 0.0, 0.5, 8, 0.0),
        lambda: WorkerReport("w", "cpu", math.inf, 0, 0.0, 0.5, 8, 0.0),
        lambda: SyncSGD(0),
        lambda: StaticHogbatch(16, 2.5),
        lambda: AdaptiveHogbatch(16, min_batch=64, max_batch=32),
        lambda: AdaptiveHogbatch(128, min_batch=1, max_batch=64),
        lambda: AdaptiveHogbatch(16, threshold=0.5),
        lambda: AdaptiveHogbatch(16, smoothing=1.0),
        lambda: StaticHogbatch(16, 64, stale_after_s=0.0),
        lambda: SyncSGD(8).initial([("a", "cpu"), ("a", "gpu")]),
        lambda: SyncSGD(8).initial([("a", "fpga")]),
        lambda: simulate(SyncSGD(8), {}, 1.0),
        lambda: SimWorker("cpu", 0.0),
    ],
)
def test_invalid_inputs_raise_value_errors(build):
    """Bad reports, knobs, worker tables and simulator inputs raise ValueError."""
    with pytest.raises(ValueError):
        build()


def test_update_rejects_duplicate_reports_kind_changes_and_bad_time():
    """update() refuses duplicate reports, kind changes, non-reports and non-finite now_s, atomically."""
    policy = StaticHogbatch(16, 1024)
    policy.initial(CPU_GPU)
    with pytest.raises(ValueError, match="one report per worker"):
        policy.update([rep("c0", "cpu", 1.0, 1), rep("c0", "cpu", 2.0, 2)], 1.0)
    with pytest.raises(ValueError, match="registered as 'cpu'"):
        policy.update([rep("c0", "gpu", 1.0, 1)], 1.0)
    with pytest.raises(ValueError, match="now_s"):
        policy.update([], math.nan)
    with pytest.raises(ValueError, match="WorkerReport"):
        policy.update([{"worker_id": "c0"}], 1.0)
    with pytest.raises(ValueError, match="registered as 'gpu'"):  # nothing applied before the bad one
        policy.update([rep("c0", "cpu", 5.0, 1), rep("g0", "cpu", 1.0, 1)], 1.0)
    assert policy.estimates() == {"c0": None, "g0": None}


@settings(max_examples=60, deadline=None)
@given(
    speeds=st.lists(st.tuples(st.sampled_from(["cpu", "gpu"]), st.floats(0.0, 1e6)), min_size=1, max_size=6),
    threshold=st.floats(1.0, 16.0),
    smoothing=st.floats(0.0, 0.99),
)
def test_assignments_are_always_well_formed(speeds, threshold, smoothing):
    """For any speeds every live worker gets a batch in bounds and shares that sum to 1."""
    workers = [(f"w{i}", kind) for i, (kind, _) in enumerate(speeds)]
    for policy in (SyncSGD(32), StaticHogbatch(8, 512, smoothing=smoothing),
                   AdaptiveHogbatch(16, 2, 1024, threshold=threshold, smoothing=smoothing)):
        policy.initial(workers)
        for t in (1.0, 2.0):
            out = policy.update([rep(w, k, s, t) for (w, k), (_, s) in zip(workers, speeds)], t)
            assert set(out) == {w for w, _ in workers}
            assert shares_sum_to_one(out)
            assert all(a.data_share >= 0 for a in out.values())
            low, high = (2, 1024) if isinstance(policy, AdaptiveHogbatch) else (1, 1 << 30)
            assert all(low <= a.batch_size <= high and isinstance(a.batch_size, int) for a in out.values())


@pytest.mark.parametrize("module", [hogbatch, simulator], ids=lambda m: m.__name__)
def test_policy_module_imports_no_network_or_nodes(module):
    """The policies and the simulator stay pure: they import neither zmq nor torch nor hmp.nodes nor hmp.transport."""
    tree = ast.parse(Path(module.__file__).read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {n for n in names if n.split(".")[0] in {"zmq", "torch"} or n.startswith(("hmp.nodes", "hmp.transport"))}


def test_static_keeps_configured_batches_and_equal_shares():
    """StaticPolicy: each worker's configured batch (else the default), equal asynchronous shares."""
    policy = StaticPolicy({"c0": 16, "g0": 256}, default_batch=32)
    policy.initial(CPU_GPU)
    out = policy.update([rep("c0", "cpu", 100.0, 1.0), rep("g0", "gpu", 9000.0, 1.0), rep("c1", "cpu", 50.0, 1.0)], 1.0)
    assert {k: a.batch_size for k, a in out.items()} == {"c0": 16, "g0": 256, "c1": 32}
    assert shares_sum_to_one(out) and not any(a.sync for a in out.values())
    assert out["g0"].data_share == pytest.approx(1 / 3)


def test_simulator_runs_as_a_tool(capsys):
    """python -m hmp.batching.simulator prints the shares of a simulated run as JSON."""
    import json

    assert simulator.main(["hogbatch", "--knob", "cpu_batch=16", "--knob", "gpu_batch=1024", "--worker", "c0=cpu:1000",
                           "--worker", "g0=gpu:10000", "--seconds", "30"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["update_share"]["cpu"] > 0.85 and out["final"]["g0"]["batch_size"] == 1024
