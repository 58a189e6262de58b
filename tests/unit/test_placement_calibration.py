"""Placement calibration against measured stage times, pure."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hmp.placement import cost_model
from hmp.placement.calibration import (
    MIN_CALIBRATION_STEPS,
    RuntimeCosts,
    StageLoad,
    StageMeasurement,
    available_cores,
    calibrate,
    calibrated_problem,
    messages_per_micro_batch,
    micro_batches_per_worker,
    predict,
)
from hmp.placement.problem import (
    NOT_MEASURED,
    LayerProfile,
    PlacementProblem,
    ResourceType,
)
from hmp.placement.profiler import micro_batch_times, problem_from_config

MS = 1e-3


TWO_STAGES = [StageLoad("cpu", 1 * MS, workers=2, param_bytes=1e6), StageLoad("accel", 3 * MS, workers=1, param_bytes=2e5)]


def costs(**kw) -> RuntimeCosts:
    base = dict(cores=4, message_s=0.1 * MS, sync_s_per_byte=2e-9, step_s=0.5 * MS, ps_s_per_byte=1e-9)
    return RuntimeCosts(**{**base, **kw})


def test_runtime_model_two_stages_by_hand():
    """docs/placement.md's example: n = (2, 4), u = (1.2, 3.2) ms, y = (2.5, 0.9) ms, W = (4.9, 13.7) ms;
    the accel stage's path 13.7 + 1.2 + (2.5 - 0.9) = 16.5 ms beats the cpu stage's 4.9 + 3.2 = 8.1 ms;
    CPU (2 x 4.9 + 13.7 + 2.2) / 4 = 6.425 ms; so 512 / 16.5 ms = 31,030 samples/s."""
    p = predict(TWO_STAGES, micro_batches=4, batch_size=512, costs=costs())
    assert [w / MS for w in p.worker_s] == pytest.approx([4.9, 13.7])
    assert [u / MS for u in p.micro_batch_s] == pytest.approx([1.2, 3.2])
    assert p.path_s / MS == pytest.approx(16.5)
    assert p.cpu_s / MS == pytest.approx(6.425)
    assert p.bottleneck == 1 and p.sharing == 1.0
    assert p.samples_per_s == pytest.approx(512 / 16.5e-3)
    # One core: the job's CPU work per step, 25.7 ms, is the step.
    one = predict(TWO_STAGES, micro_batches=4, batch_size=512, costs=costs(cores=1))
    assert one.step_s / MS == pytest.approx(25.7) and one.sharing == pytest.approx(25.7 / 16.5)


def test_message_counts_and_round_robin_micro_batches():
    assert [messages_per_micro_batch(k, 1) for k in range(1)] == [0]
    assert [messages_per_micro_batch(k, 3) for k in range(3)] == [2, 4, 2]
    assert [micro_batches_per_worker(4, w) for w in (1, 2, 3, 4)] == [4, 2, 2, 1]
    single = predict([StageLoad("cpu", 1 * MS, 1, 0.0)], 4, 64, costs(sync_s_per_byte=0.0))
    assert single.step_s / MS == pytest.approx(4 * 1 + 0.5)  # no messages, no neighbours to wait for


def test_cpu_sharing_lowers_throughput_as_cores_are_oversubscribed():
    """More workers of a data-parallel stage help the planner's cost model in proportion, the runtime model
    only while there are cores for them; fewer cores never raise the prediction."""
    B, m = 512, 8
    one_worker_s = 8 * MS  # compute of a batch (m micro-batches of 1 ms)
    rates, cost_rates = [], []
    for w in (1, 2, 4, 8):
        rates.append(predict([StageLoad("cpu", 1 * MS, w, 0.0)], m, B, costs(cores=2, step_s=0.0)).samples_per_s)
        cost_rates.append(B / (one_worker_s / w))
    assert rates[1] == pytest.approx(2 * rates[0])  # 2 workers on 2 cores: twice as fast
    assert rates[2] == pytest.approx(rates[1]) and rates[3] == pytest.approx(rates[1])  # oversubscribed: no gain
    assert cost_rates[3] == pytest.approx(8 * cost_rates[0])
    by_cores = [predict(TWO_STAGES, 4, 512, costs(cores=c)).samples_per_s for c in (8, 4, 2, 1, 0.5)]
    assert all(a >= b for a, b in zip(by_cores, by_cores[1:])) and by_cores[-1] < by_cores[0]
    assert available_cores() >= 1


def measurements(stages, m, true: RuntimeCosts, wall_factor: float = 1.0) -> list[StageMeasurement]:
    """What the stages' workers would report if the model's costs were ``true`` (wall = CPU x factor)."""
    out = []
    for k, s in enumerate(stages):
        n = micro_batches_per_worker(m, s.workers)
        busy = n * true.scale(s.resource) * s.compute_s
        other = n * messages_per_micro_batch(k, len(stages)) * true.message_s + true.step_s + true.sync_s_per_byte * s.param_bytes
        out.append(StageMeasurement(busy_s=busy * wall_factor, other_s=other * wall_factor, steps=50))
    return out


def test_calibration_recovers_known_costs_from_two_stages():
    """Two stages give two equations: the message cost and the sync cost per byte are solved for, the compute
    scale per type is the busy time over the profile, and the calibrated prediction is the true model's."""
    true = costs(message_s=0.6 * MS, sync_s_per_byte=5e-9, compute_scale={"cpu": 2.0, "accel": 9.0})
    cal = calibrate(TWO_STAGES, measurements(TWO_STAGES, 4, true), 4, 512, costs())
    assert cal.sharing == 1.0
    assert cal.costs.message_s == pytest.approx(true.message_s)
    assert cal.costs.sync_s_per_byte == pytest.approx(true.sync_s_per_byte)
    assert dict(cal.costs.compute_scale) == pytest.approx({"cpu": 2.0, "accel": 9.0})
    assert cal.predicted.samples_per_s == pytest.approx(predict(TWO_STAGES, 4, 512, true).samples_per_s)
    assert "calibrated on 50 steps" in cal.costs.source


def test_calibration_of_one_stage_scales_all_overheads_alike():
    stage = [StageLoad("accel", 0.5 * MS, 1, 1.4e6)]
    measured = [StageMeasurement(busy_s=11 * MS, other_s=7.0 * MS, steps=20)]
    prior = costs(step_s=0.6 * MS, sync_s_per_byte=4e-9)
    cal = calibrate(stage, measured, 4, 64, prior)
    lam = 7.0 * MS / (0.6 * MS + 4e-9 * 1.4e6)
    assert cal.overhead_scale == pytest.approx(lam)
    assert cal.costs.step_s == pytest.approx(0.6 * MS * lam) and cal.costs.sync_s_per_byte == pytest.approx(4e-9 * lam)
    assert cal.costs.compute_scale["accel"] == pytest.approx(11 / (4 * 0.5))
    assert cal.costs.message_s == prior.message_s  # one stage sends no messages: nothing measured them
    # one stage, no neighbours: the step is the worker's measured work, 18 ms
    assert cal.predicted.step_s == pytest.approx(18 * MS)


def test_calibration_turns_shared_wall_times_into_cpu_figures():
    """On one core the true model is CPU-bound (sharing > 1); workers measure wall times inflated by that
    sharing. The calibration divides it out: it recovers the CPU costs, and predicts the measured step."""
    true = costs(cores=1, step_s=0.0, ps_s_per_byte=0.0, message_s=0.3 * MS, sync_s_per_byte=3e-9,
                 compute_scale={"cpu": 1.5, "accel": 4.0})
    truth = predict(TWO_STAGES, 4, 512, true)
    assert truth.sharing > 1.1
    prior = costs(cores=1, step_s=0.0, ps_s_per_byte=0.0)
    cal = calibrate(TWO_STAGES, measurements(TWO_STAGES, 4, true, wall_factor=truth.sharing), 4, 512, prior)
    assert cal.sharing == pytest.approx(truth.sharing)
    assert cal.costs.message_s == pytest.approx(true.message_s)
    assert cal.costs.sync_s_per_byte == pytest.approx(true.sync_s_per_byte)
    assert dict(cal.costs.compute_scale) == pytest.approx({"cpu": 1.5, "accel": 4.0})
    assert cal.predicted.step_s == pytest.approx(truth.step_s)


def test_measurement_from_worker_reports():
    """Per step and worker: busy = busy fraction x plan seconds / steps; other = the rest minus the idle time;
    too few steps from any worker: no measurement yet."""
    r1 = {"plan_seconds": 2.0, "stage_samples_per_s": 6400.0, "stage_busy_fraction": 0.25, "stage_idle_fraction": 0.5}
    r2 = {**r1, "stage_busy_fraction": 0.15}
    m = StageMeasurement.from_reports([r1, r2], [256, 256])  # 12800 samples / 256 = 50 steps each
    assert m is not None and m.steps == pytest.approx(50)
    assert m.busy_s == pytest.approx((0.5 / 50 + 0.3 / 50) / 2)
    assert m.other_s == pytest.approx((0.5 / 50 + 0.7 / 50) / 2)
    short = {**r1, "plan_seconds": 0.1, "stage_samples_per_s": 256 * (MIN_CALIBRATION_STEPS - 1) / 0.1}
    assert StageMeasurement.from_reports([r1, short], [256, 256]) is None
    assert StageMeasurement.from_reports([], []) is None
    # since an earlier report: only the time between them counts (here 1 s, 25 steps, a busier second)
    later = {"plan_seconds": 3.0, "stage_samples_per_s": 19200 / 3.0, "stage_busy_fraction": 0.75 / 3.0,
             "stage_idle_fraction": 1.3 / 3.0}
    d = StageMeasurement.from_reports([later], [256], [r1])
    assert d is not None and d.steps == pytest.approx(25)
    assert d.busy_s == pytest.approx(0.25 / 25) and d.other_s == pytest.approx((1.0 - 0.25 - 0.3) / 25)
    assert StageMeasurement.from_reports([later], [256], [r1], min_seconds=1.5) is None


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="workers"):
        StageLoad("cpu", 1e-3, 0)
    with pytest.raises(ValueError, match="cores"):
        RuntimeCosts(cores=0, message_s=1e-4)
    with pytest.raises(ValueError, match="message_s"):
        RuntimeCosts(cores=1, message_s=-1.0)
    with pytest.raises(ValueError, match="compute_scale"):
        RuntimeCosts(cores=1, message_s=0.0, compute_scale={"cpu": math.nan})
    with pytest.raises(ValueError, match="one measurement per stage"):
        calibrate(TWO_STAGES, [], 4, 512, costs())
    with pytest.raises(ValueError, match="at least one stage"):
        predict([], 4, 512, costs())


def test_calibrated_problem_scales_times_and_relabels_the_type():
    layers = (LayerProfile("0:Embedding", "sparse", {"cpu": 1e-3, "accel": 5e-3}, 100, 10),
              LayerProfile("1:Linear", "dense", {"cpu": 4e-3, "accel": 0.5e-3}, 10, 10))
    res = (ResourceType("cpu", 0.17, 2), ResourceType("accel", 0.08, 1, speed_scale=8.0, measured=False, source="scaled"))
    problem = PlacementProblem(layers, res, 64, 1e5, 1000.0, 1e10, message_overhead_s=1e-4, messages_per_batch=4)
    fitted = RuntimeCosts(cores=2, message_s=5e-4, compute_scale={"accel": 8.0})
    cal = calibrated_problem(problem.with_counts({"cpu": 1}), fitted, problem)
    assert cal.layers[1].time_s == {"cpu": 4e-3, "accel": 4e-3}
    assert cal.message_overhead_s == 5e-4 and cal.counts.tolist() == [1, 1]
    assert cal.resources[1].measured and cal.resources[1].provenance == "measured (calibrated on the running workers)"
    assert problem.resources[1].provenance.startswith(NOT_MEASURED)
    # the planner now sees the accel type as it ran: no faster at the dense layer than the cpu
    assert cost_model.evaluate(cal, [0, 1]).stages[1].compute_s == pytest.approx(4e-3)


def test_micro_batch_profile_measures_cpu_and_scales_the_rest():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cfg = {"resources": [{"name": "cpu", "price_per_hour": 0.1, "count": 1},
                         {"name": "gpu", "price_per_hour": 2.5, "count": 1, "measured": False, "overhead_s": 1e-5,
                          "speed_scale": {"dense": 20, "elementwise": 4}},
                         {"name": "tpu", "price_per_hour": 4.0, "count": 1, "measured": False, "times_s": [4e-3, 8e-3, 4e-3]}],
           "bandwidth_bytes_per_s": 1e9, "samples": 1e4, "min_throughput": 100.0, "batch_size": 16, "reps": 2,
           "warmup": 1, "num_threads": 1}
    x = torch.randn(16, 8)
    problem = problem_from_config(cfg, model, x)
    times = micro_batch_times(model, problem, x, 4, reps=3, warmup=1)
    assert len(times) == 3
    for t, kind in zip(times, ["dense", "elementwise", "dense"]):
        assert t["cpu"] > 0
        assert t["gpu"] == pytest.approx(t["cpu"] / (20 if kind == "dense" else 4) + 1e-5)
    assert [t["tpu"] for t in times] == pytest.approx([1e-3, 2e-3, 1e-3])
    with pytest.raises(ValueError, match="divide"):
        micro_batch_times(model, problem, x, 3)
