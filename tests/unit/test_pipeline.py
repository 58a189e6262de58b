"""Pipeline stages and micro-batch schedules, pure."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hmp.models import click_model, deep_mlp
from hmp.pipeline.assign import assign_workers, runnable
from hmp.pipeline.chunks import layer_aligned_layout, stage_chunk_keys
from hmp.pipeline.microbatches import ExampleOrder, micro_batches_of
from hmp.pipeline.stage import StageCompute
from hmp.placement import cost_model
from hmp.placement.problem import NOT_MEASURED
from hmp.placement.profiler import param_layers, split_layers
from hmp.placement.registry import problem_from_config

CLICK = (click_model, dict(fields=4, buckets=50, dim=8, hidden=(32, 16)), lambda n: torch.randint(0, 50, (n, 4)))


MLP = (deep_mlp, dict(in_features=12, width=24, depth=4, classes=5), lambda n: torch.randn(n, 12))


@pytest.mark.parametrize("factory,kwargs,inputs", [CLICK, MLP], ids=["click", "deep_mlp"])
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_stages_chained_give_the_whole_models_outputs_and_gradients(factory, kwargs, inputs, micro_batches):
    """A model cut into 3 stages, micro-batches sent through them forward and back, accumulates the same parameter
    gradients (mean over micro-batches) and the same loss as the whole model on the whole batch."""
    torch.manual_seed(0)
    whole = factory(**kwargs)
    torch.manual_seed(0)
    split = factory(**kwargs)
    x, y = inputs(32), torch.randint(0, 2, (32,))
    loss = F.cross_entropy(whole(x), y)
    loss.backward()

    cuts = [0, 1, 3, len(split)]
    stages = [StageCompute(split, a, b) for a, b in zip(cuts, cuts[1:])]
    losses = []
    for m, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        act = xm
        for s in stages:
            act = s.forward(m, act, ym)
        losses.append(float(act))
        grad = stages[-1].backward(m)
        for s in reversed(stages[:-1]):
            grad = s.backward(m, grad)
        assert grad is None  # the first stage sends nothing back
    assert all(not s.saved for s in stages)
    assert sum(losses) / micro_batches == pytest.approx(loss.item(), rel=1e-5)
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.grad / micro_batches, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_layer_aligned_chunks_belong_to_one_stage_each():
    """With chunks cut at layer boundaries, every stage split owns whole chunks, and the stages' keys partition
    the chunks; the default layout (chunks straddling layers) is refused."""
    model = click_model(fields=4, buckets=50, dim=8, hidden=(32, 16))
    layout = layer_aligned_layout(model, chunk_bytes=512)
    owner = param_layers(model)
    for cuts in ([0, 6], [0, 1, 6], [0, 1, 3, 4, 6], list(range(7))):
        keys = [stage_chunk_keys(layout, a, b, owner) for a, b in zip(cuts, cuts[1:])]
        flat = [k for ks in keys for k in ks]
        assert sorted(flat) == [c.key for c in layout.chunks]
    assert owner["3.weight"] == 3
    from hmp.flat import FlatLayout

    with pytest.raises(ValueError, match="straddles"):
        stage_chunk_keys(FlatLayout.from_model(model, 512), 0, 1, owner)


def test_runtime_layers_are_the_profilers_layers_for_nested_models():
    """A nested nn.Sequential: the plan's layer i (the profiler's split_layers, nesting flattened) is the layer
    stage i runs and the layer whose parameters its chunks hold, and the stages chained equal the whole model."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                          nn.Linear(8, 3))
    layers = split_layers(model)
    assert [lay.name for lay in layers] == ["0:Linear", "1:ReLU", "2:Linear", "3:Tanh", "4:Linear"]
    owner = param_layers(model)
    assert owner == {"0.0.weight": 0, "0.0.bias": 0, "1.0.weight": 2, "1.0.bias": 2, "2.weight": 4, "2.bias": 4}
    layout = layer_aligned_layout(model, chunk_bytes=64)
    keys = [stage_chunk_keys(layout, a, b, owner) for a, b in [(0, 1), (1, 3), (3, 5)]]
    assert sorted(k for ks in keys for k in ks) == [c.key for c in layout.chunks]
    stages = [StageCompute(model, a, b) for a, b in [(0, 1), (1, 3), (3, 5)]]
    assert stages[0].module[0] is layers[0].module and stages[2].last and not stages[1].last
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    act = x
    for s in stages:
        act = s.forward(0, act, y)
    assert float(act) == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)
    with pytest.raises(ValueError, match="outside"):
        StageCompute(model, 3, 6)


def test_schedule_is_deterministic_and_round_robin():
    """Micro-batches go round-robin over a stage's workers; (step, micro-batch) always names the same examples,
    and one step's micro-batches are disjoint."""
    assert micro_batches_of(1, 3, 7) == (1, 4)
    a, b = ExampleOrder(1000, 64, 4, seed=3), ExampleOrder(1000, 64, 4, seed=3)
    assert torch.equal(a.ids(20, 2), b.ids(20, 2))
    ids = torch.cat([a.ids(5, m) for m in range(4)])
    assert len(set(ids.tolist())) == 64
    assert a.epoch_of(a.per_epoch) == 1


def _problem(counts, min_throughput=1.0):
    model = click_model(fields=4, buckets=50, dim=8, hidden=(32, 16))
    res = [{"name": "cpu", "price_per_hour": 0.17}, {"name": "accel", "price_per_hour": 0.3, "measured": False,
                                                      "speed_scale": {"sparse": 0.5, "dense": 8.0}}]
    table = {"resources": res, "batch_size": 64, "samples": 1e5, "min_throughput": min_throughput,
             "bandwidth_bytes_per_s": 1e12, "reps": 2, "micro_batches": 4}
    return problem_from_config(table, model, torch.randint(0, 50, (64, 4)), counts=counts)


def test_workers_staff_the_plan_spares_join_their_type_and_missing_types_fall_back():
    """Each stage gets its plan's workers of its type, spare workers join a stage of their own type (capped by
    the micro-batches), and a plan needing a type with no live worker falls back to a one-type plan."""
    problem = _problem({"cpu": 3, "accel": 1})
    plan = cost_model.evaluate(problem, [0, 1, 1, 1, 1, 1])
    live = {"cpu": ["c0", "c1", "c2"], "accel": ["a0"]}
    stages = assign_workers(plan, problem, live, micro_batches=2)
    assert [s.workers for s in stages] == [("c0", "c1"), ("a0",)]
    assert [s.workers for s in assign_workers(plan, problem, live, micro_batches=4, use_spare=False)] == [("c0",), ("a0",)]
    kept = assign_workers(plan, problem, live, micro_batches=1, previous={"c2": (0, 1)})
    assert kept[0].workers == ("c2",)
    fallback = runnable(plan, problem.with_counts({"accel": 0}), {"cpu": ["c0"]})
    assert fallback.planner == "fallback" and set(fallback.assignment) == {0}
    assert problem.resources[1].provenance.startswith(NOT_MEASURED)
