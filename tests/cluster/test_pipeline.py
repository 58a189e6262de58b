"""Pipeline runtime: the sans-IO stage split, then real pipeline jobs on loopback (train, re-plan)."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch
from torch.nn import functional as F

from hmp.cluster import LocalCluster
from hmp.job import loads
from hmp.models import click_model, deep_mlp
from hmp.pipeline.assign import assign_workers, runnable
from hmp.pipeline.chunks import layer_aligned_layout, stage_chunk_keys
from hmp.pipeline.schedule import ExampleOrder, micro_batches_of
from hmp.pipeline.stage import StageCompute
from hmp.placement import cost_model
from hmp.placement.problem import NOT_MEASURED
from hmp.placement.profiler import param_layers, split_layers
from hmp.placement.registry import problem_from_config

from tests.cluster_util import free_port

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


async def test_stage_worker_keeps_messages_that_arrive_before_its_assignment(tmp_path):
    """A neighbour that got its stage_assign first may send step 0's activations before this worker has its own:
    they are held and replayed once the assignment arrives (dropping them stalled the pipeline for good), while
    messages of an older plan are dropped."""
    from hmp.messages import Activations, StageAssign
    from hmp.nodes.stage_worker import StageWorkerNode
    from hmp import job

    class FakePS:
        keys = ()
        shard_addresses = ()

        def restrict(self, keys):
            self.restricted = tuple(keys)

        def reset_buffers(self):
            pass

        async def pull(self):
            pass

    class FakePeer:
        async def connect(self):
            pass

    threads = torch.get_num_threads()
    try:
        cfg = pipeline_config(tmp_path)
        node = StageWorkerNode(cfg, "accel0")
    finally:
        torch.set_num_threads(threads)
    node.sharded, node.ps = job.sharded_model(cfg), FakePS()
    node.order = ExampleOrder(4096, 512, 4, 0)
    node.client = lambda address: FakePeer()

    def act(plan, m):
        return Activations(sender="cpu1", plan=plan, step=0, micro_batch=m, values=torch.zeros(128, 256),
                           labels=torch.zeros(128, dtype=torch.int64))

    early, stale = act(2, 1), act(1, 3)
    await node.handle(early)
    await node.handle(stale)
    assert node.held == [early, stale]
    await node.handle(StageAssign(plan=2, stage=1, stages=2, start=1, stop=6, index=0, width=1, prev=("tcp://a:1",),
                                  micro_batches=4, batch_size=512, start_step=0, steps=10))
    assert node.compute is not None and node.held == []
    assert node.events.get_nowait() is early and node.events.empty()


# ----------------------------------------------------------------------------- real jobs

def pipeline_config(tmp, *, epochs=2, max_seconds=25.0, workers=("cpu0", "cpu1", "accel0"), join_wait_s=10.0,
                    samples=16000):
    """The click model as a planned pipeline on loopback: embeddings on the measured 'cpu' type, the MLP on the
    scaled 'accel' type (the cheapest plan), parameters on two PS shards. Batch 512 and an accel at $0.04/h, 20x slower at lookups, keep
    the split clearly cheapest (by ~50%) under the cost model's per-message overhead, even when the profile is
    taken on a loaded machine; at batch 256 one cpu stage is cheaper (four messages each way per boundary)."""
    text = f"""
[job]
name = "pipe"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
join_timeout_s = 60

[model]
name = "click_model"
args = {{ fields = 16, buckets = 1000, dim = 16, hidden = [256, 128] }}

[data]
kind = "click"
samples = {samples}
args = {{ fields = 16, buckets = 1000 }}

[optimizer]
name = "adam"
lr = 0.003

[train]
batch_size = 512
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 0.5
report_interval_s = 0.3

[ps]
chunk_bytes = 65536

[placement]
enabled = true
planner = "bruteforce"
micro_batches = 4
min_throughput = 2000.0
bandwidth_bytes_per_s = 1e10
join_wait_s = {join_wait_s}
profile_repeats = 7
resources = [
  {{ name = "cpu", price_per_hour = 0.17 }},
  {{ name = "accel", price_per_hour = 0.04, measured = false, speed_scale = {{ sparse = 0.05, dense = 8.0, elementwise = 4.0 }} }},
]

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"

[[nodes]]
id = "ps0"
role = "ps"

[[nodes]]
id = "ps1"
role = "ps"
"""
    for w in workers:
        role, res = ("gpu_worker", "accel") if w.startswith("accel") else ("cpu_worker", "cpu")
        text += f'\n[[nodes]]\nid = "{w}"\nrole = "{role}"\nresource = "{res}"\n' + (
            'device = "cpu"\n' if role == "gpu_worker" else "")
    path = tmp / "pipe.toml"
    path.write_text(text)
    return loads(text, str(path))


@pytest.mark.cluster
async def test_click_pipeline_trains_and_reports_plan_and_stage_throughputs(tmp_path):
    """The scheduler profiles and plans the click model into two stages (embeddings on cpu workers, the MLP on
    the accel worker), the stages train it over hmp to well above chance, and the report shows the plan, the
    predicted and measured throughput of each stage, the cost and the provenance of each type."""
    cfg = pipeline_config(tmp_path)
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=90)
    assert report["final"]["test_accuracy"] >= 0.68, report["final"]
    pipe = report["pipeline"]
    assert len(pipe["profile"]) == 6
    assert pipe["plans"][0]["layers"]["0:FieldEmbedding"] == "cpu"
    assert pipe["plans"][0]["layers"]["5:Linear"] == "accel"
    # On a busy 2-core machine a worker may miss heartbeats and be re-planned around, then back: the plan that
    # ran last is the same two-stage plan.
    plan = pipe["plans"][-1]
    assert plan["layers"] == pipe["plans"][0]["layers"]
    assert [s["workers"] for s in plan["stages"]] == [["cpu0", "cpu1"], ["accel0"]]
    assert plan["stages"][0]["provenance"] == "measured"
    assert plan["stages"][1]["provenance"].startswith(NOT_MEASURED)  # the label reports print for scaled types
    assert plan["cost"] > 0 and plan["predicted_throughput"] > 0
    for s, m in zip(plan["stages"], plan["measured"]):
        assert s["predicted_samples_per_s"] > 0 and m["samples_per_s"] > 0 and m["compute_samples_per_s"] > 0
    w = report["workers"]
    assert w["cpu0"]["samples"] > 0 and w["cpu1"]["samples"] > 0
    assert w["accel0"]["samples"] == pytest.approx(w["cpu0"]["samples"] + w["cpu1"]["samples"], rel=0.1)
    assert report["final"]["stop_reason"].startswith("epochs done")


async def _wait_for(cluster, pred, timeout_s=30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        st = await cluster.status()
        if st and pred(st):
            return st
        await asyncio.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout_s} s; status: {st}")


@pytest.mark.cluster
async def test_replans_when_a_worker_joins_late_and_when_one_leaves(tmp_path):
    """cpu1 is held back (SIGSTOP) so the first plan runs without it; when it joins the loop re-plans with it in
    the embedding stage; when accel0 leaves (SIGTERM) the loop re-plans onto the cpu workers alone, training goes
    on from the step it had reached, and the job finishes with every plan in the report."""
    # The re-plans below are over ~8 s after training starts (max_seconds counts from there); the job then
    # ends at max_seconds. (Not finish() right after them: the shards' accuracy swings between ~0.55 and ~0.72
    # within a second in plans 2-3, an open problem described in docs/pipeline.md.)
    cfg = pipeline_config(tmp_path, epochs=200, max_seconds=15.0, join_wait_s=1.0)
    async with LocalCluster(cfg) as cluster:
        cluster.kill("cpu1", signal.SIGSTOP)
        try:
            st = await _wait_for(cluster, lambda s: s.get("pipeline", {}).get("max_step", 0) > 3)
            assert st["pipeline"]["plan"] == 1
            assert [s["workers"] for s in st["pipeline"]["stages"]] == [["cpu0"], ["accel0"]]
        finally:
            cluster.kill("cpu1", signal.SIGCONT)
        st = await _wait_for(cluster, lambda s: s["pipeline"]["plan"] >= 2)
        assert [s["workers"] for s in st["pipeline"]["stages"]] == [["cpu0", "cpu1"], ["accel0"]]
        step = (await _wait_for(cluster, lambda s: s["pipeline"]["max_step"] > st["pipeline"]["max_step"] + 3))
        cluster.kill("accel0", signal.SIGTERM)
        st = await _wait_for(cluster, lambda s: s["pipeline"]["plan"] >= 3)
        assert [s["resource"] for s in st["pipeline"]["stages"]] == ["cpu"]
        await _wait_for(cluster, lambda s: s["pipeline"]["max_step"] > step["pipeline"]["max_step"] + 5)
        report = await cluster.train(timeout_s=60)
    plans = report["pipeline"]["plans"]
    assert report["pipeline"]["replans"] == 2 and [p["plan"] for p in plans] == [1, 2, 3]
    assert plans[1]["workers_available"] == {"cpu": 2, "accel": 1}
    assert plans[2]["workers_available"] == {"cpu": 2, "accel": 0}
    assert set(plans[2]["layers"].values()) == {"cpu"}
    assert plans[2]["start_step"] >= plans[1]["start_step"] > 0
    assert all(m["samples_per_s"] > 0 for p in plans for m in p["measured"])
    assert report["final"]["test_accuracy"] >= 0.68
    assert all(p.returncode == 0 for p in cluster.procs.values())
