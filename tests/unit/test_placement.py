"""Placement planner: the cost model's formulas, the gymnasium env, the planners and re-planning.

The cost model is checked against hand-computed figures and against a plain-Python restatement of
the formulas in docs/placement.md (``naive_cost``), not against itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from hmp.placement import cost_model
from hmp.placement.baselines import BruteForcePlanner, GreedyPlanner, RandomSearchPlanner, SpaceTooLarge
from hmp.placement.env import PlacementEnv
from hmp.placement.problem import LayerProfile, PlacementProblem, ResourceType
from hmp.placement.registry import PLANNERS, make_planner, replan
from hmp.placement.rl import RLPlanner
from hmp.placement.synthetic import random_problem

pytestmark = pytest.mark.timeout(60)


def hand_problem(bandwidth: float = 1e9, cpu_count: int = 4, gpu_count: int = 1, message_overhead_s: float = 0.0,
                 messages_per_batch: int = 1) -> PlacementProblem:
    """3 layers, cpu ($1/h) and gpu ($3/h); tau = 100 / 10_000 = 10 ms per batch; no per-message overhead
    unless given (a PlacementProblem built directly defaults to a pure-bandwidth link)."""
    layers = (
        LayerProfile("0", "sparse", {"cpu": 0.020, "gpu": 0.010}, out_bytes=1_000_000),
        LayerProfile("1", "dense", {"cpu": 0.030, "gpu": 0.004}, out_bytes=2_000_000),
        LayerProfile("2", "dense", {"cpu": 0.010, "gpu": 0.002}, out_bytes=8),
    )
    resources = (ResourceType("cpu", 1.0, cpu_count), ResourceType("gpu", 3.0, gpu_count, measured=False))
    return PlacementProblem(layers, resources, batch_size=100, samples_to_train=3.6e7, min_throughput=1e4, bandwidth_bytes_per_s=bandwidth,
                            message_overhead_s=message_overhead_s, messages_per_batch=messages_per_batch)


def naive_cost(p: PlacementProblem, a: tuple[int, ...]) -> tuple[bool, float, list[int]]:
    """docs/placement.md's formulas, one stage at a time: (feasible, cost, workers per stage)."""
    tau = p.batch_size / p.min_throughput
    stages, start = [], 0
    for i in range(1, len(a) + 1):
        if i == len(a) or a[i] != a[start]:
            stages.append((start, i, a[start]))
            start = i
    workers, times, feasible = [], [], True
    used = [0] * p.n_resources
    for s, e, r in stages:
        compute = sum(p.layers[i].time_s[p.resources[r].name] for i in range(s, e))
        crossing = (p.layers[s - 1].out_bytes if s > 0 else 0) + (p.layers[e - 1].out_bytes if e < len(a) else 0)
        boundaries = (s > 0) + (e < len(a))
        transfer = 2 * crossing / p.bandwidth_bytes_per_s + boundaries * 2 * p.messages_per_batch * p.message_overhead_s
        if transfer >= tau:
            feasible, w = False, 1
        else:
            w = 1
            while compute / w + transfer > tau * (1 + 1e-9):
                w += 1
        workers.append(w)
        times.append(compute / w + transfer)
        used[r] += w
    feasible = feasible and all(u <= res.count for u, res in zip(used, p.resources))
    throughput = min(p.batch_size / t for t in times)
    dollars_per_hour = sum(w * p.resources[r].price_per_hour for w, (_, _, r) in zip(workers, stages))
    cost = dollars_per_hour * p.samples_to_train / throughput / 3600 if feasible else math.inf
    return feasible, cost, workers


# ---------------------------------------------------------------- cost model


def test_cost_model_two_stage_plan_by_hand():
    """[cpu, gpu, gpu]: cpu stage C=20ms, X=2ms -> ceil(20/8)=3 workers, 8.667ms; gpu stage C=6ms, X=2ms
    -> 1 worker, 8ms; throughput 100/8.667ms = 11538/s; cost (3*$1 + 1*$3) * 3.6e7/11538 s / 3600 = $5.20."""
    p = hand_problem()
    plan = cost_model.evaluate(p, [0, 1, 1])
    assert plan.feasible, plan.reason
    assert [(s.start, s.stop, s.resource_name, s.workers) for s in plan.stages] == [(0, 1, "cpu", 3), (1, 3, "gpu", 1)]
    assert plan.stages[0].transfer_s == pytest.approx(0.002)
    assert plan.stages[1].transfer_s == pytest.approx(0.002)
    assert plan.stages[0].time_s == pytest.approx(0.020 / 3 + 0.002)
    assert plan.throughput == pytest.approx(100 / (0.020 / 3 + 0.002))
    assert plan.time_to_train_s == pytest.approx(3120.0)
    assert plan.cost == pytest.approx(5.2)
    assert plan.workers_by_type == (3, 1)


def test_cost_model_per_message_overhead_by_hand():
    """The same plan with 0.25 ms per message and 4 micro-batches: each boundary adds 2 * 4 * 0.25 = 2 ms, so both
    stages have X = 2 + 2 = 4 ms; cpu: ceil(20 / (10 - 4)) = 4 workers, t = 5 + 4 = 9 ms; gpu: 1 worker,
    t = 6 + 4 = 10 ms (exactly tau); throughput 100 / 10 ms = 10,000/s; cost (4*$1 + 1*$3) * 3600 s / 3600 = $7."""
    p = hand_problem(message_overhead_s=0.25e-3, messages_per_batch=4)
    assert p.boundary_s[0] == pytest.approx(0.002 + 0.002)
    plan = cost_model.evaluate(p, [0, 1, 1])
    assert plan.feasible, plan.reason
    assert [s.transfer_s for s in plan.stages] == [pytest.approx(0.004), pytest.approx(0.004)]
    assert [s.workers for s in plan.stages] == [4, 1]
    assert plan.stages[0].time_s == pytest.approx(0.009)
    assert plan.throughput == pytest.approx(1e4)
    assert plan.cost == pytest.approx(7.0)
    # A homogeneous plan has no boundary: the overhead does not touch it.
    assert cost_model.evaluate(p, [0, 0, 0]).stages[0].transfer_s == 0.0
    # Enough messages make the stage transfer-bound: 2 boundaries x 2 x 4 x 1.25 ms = 20 ms > tau.
    heavy = cost_model.evaluate(hand_problem(message_overhead_s=1.25e-3, messages_per_batch=4, cpu_count=100,
                                             gpu_count=100), [0, 1, 0])
    assert not heavy.feasible and heavy.stages[1].transfer_bound
    with pytest.raises(ValueError, match="message_overhead_s"):
        hand_problem(message_overhead_s=-1.0)
    with pytest.raises(ValueError, match="messages_per_batch"):
        hand_problem(messages_per_batch=0)


def test_cost_model_fewest_workers_at_exact_budget():
    """cpu alone: C = 60 ms, no transfer; 6 workers give exactly tau = 10 ms -> 6 (not 7), cost 6 x $1 x 1 h."""
    p = hand_problem(cpu_count=6)
    plan = cost_model.evaluate(p, [0, 0, 0])
    assert plan.feasible and plan.stages[0].workers == 6
    assert plan.throughput == pytest.approx(1e4)
    assert plan.cost == pytest.approx(6.0)
    gpu = cost_model.evaluate(hand_problem(gpu_count=2), [1, 1, 1])  # C = 16 ms -> 2 workers, 8 ms
    assert gpu.feasible and gpu.stages[0].workers == 2 and gpu.throughput == pytest.approx(12500)


def test_cost_model_infeasible_when_a_type_runs_out():
    plan = cost_model.evaluate(hand_problem(), [0, 0, 0])  # C = 60 ms -> 6 cpu workers, 4 available
    assert not plan.feasible and plan.cost == math.inf
    assert plan.workers_by_type == (6, 0)
    assert "needs 6 cpu workers, 4 available" in plan.reason
    assert plan.shortfall == pytest.approx(2 / 4)


def test_cost_model_transfer_bound_stage_is_infeasible():
    """At 100 MB/s the middle stage moves 2*(1 MB + 2 MB) = 60 ms per batch > tau: no worker count helps."""
    p = hand_problem(bandwidth=1e8, cpu_count=100, gpu_count=100)
    plan = cost_model.evaluate(p, [0, 1, 0])
    assert not plan.feasible
    assert plan.stages[1].transfer_bound and plan.stages[1].transfer_s == pytest.approx(0.06)
    assert "transfer-bound" in plan.reason


def test_score_matches_the_formulas_on_random_problems():
    rng = np.random.default_rng(0)
    for seed in range(6):
        p = random_problem(seed, n_layers=int(rng.integers(2, 9)))
        if seed % 2:  # with a per-message overhead of up to a tenth of the budget per boundary crossing
            p = dataclasses.replace(p, message_overhead_s=float(rng.uniform(0, 0.1)) * p.batch_time_budget_s / 8,
                                    messages_per_batch=4)
        batch = rng.integers(0, p.n_resources, size=(50, p.n_layers))
        batch[0] = 0  # a homogeneous plan
        sc = cost_model.score(p, batch)
        for a, feasible, cost in zip(batch, sc.feasible, sc.cost):
            want_feasible, want_cost, want_workers = naive_cost(p, tuple(int(x) for x in a))
            assert feasible == want_feasible
            assert cost == pytest.approx(want_cost, rel=1e-9)
            assert [s.workers for s in cost_model.evaluate(p, a).stages] == want_workers


def test_cost_model_rejects_bad_assignments():
    p = hand_problem()
    with pytest.raises(ValueError, match="resource indices"):
        cost_model.evaluate(p, [0, 2, 0])
    with pytest.raises(ValueError, match="shape"):
        cost_model.evaluate(p, [0, 1])


def test_problem_rejects_bad_inputs():
    with pytest.raises(ValueError, match="time_s"):
        LayerProfile("x", "dense", {"cpu": -1.0}, out_bytes=4)
    with pytest.raises(ValueError, match="count"):
        ResourceType("cpu", 1.0, -1)
    with pytest.raises(ValueError, match="no time for resource types"):
        PlacementProblem((LayerProfile("x", "dense", {"cpu": 1.0}, 4),), (ResourceType("cpu", 1, 1), ResourceType("gpu", 1, 1)), 1, 1, 1, 1)
    with pytest.raises(ValueError, match="min_throughput"):
        PlacementProblem((LayerProfile("x", "dense", {"cpu": 1.0}, 4),), (ResourceType("cpu", 1, 1),), 1, 1, 0, 1)


def test_reports_label_types_not_measured():
    p = hand_problem()
    text = cost_model.evaluate(p, [0, 1, 1]).describe(p)
    assert "NOT_MEASURED" in text.splitlines()[2] and "NOT_MEASURED" not in text.splitlines()[1]
    assert p.describe_resources()[1].startswith("gpu") and "NOT_MEASURED" in p.describe_resources()[1]


# ---------------------------------------------------------------- environment


def test_env_passes_gymnasium_check_env():
    check_env(PlacementEnv(random_problem(3, n_layers=6)), skip_render_check=True)


def test_env_episode_reward_is_the_cost_models():
    p = hand_problem()
    env = PlacementEnv(p)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    rewards = {}
    for a in ([0, 1, 1], [0, 0, 0]):
        env.reset()
        for i, action in enumerate(a):
            obs, r, terminated, truncated, info = env.step(action)
            assert env.observation_space.contains(obs)
            assert terminated == (i == 2) and not truncated
        assert info["plan"] == cost_model.evaluate(p, a)
        rewards[tuple(a)] = r
    assert rewards[(0, 1, 1)] == pytest.approx(-math.log1p(5.2 / cost_model.lower_bound_cost(p)))
    assert rewards[(0, 0, 0)] <= -cost_model.INFEASIBLE_PENALTY < rewards[(0, 1, 1)]
    with pytest.raises(RuntimeError, match="reset"):
        env.step(0)


# ---------------------------------------------------------------- planners


def fast(name: str):
    """Each registered planner with a budget small enough for a test."""
    kwargs = {"rl": {"iterations": 30, "batch": 32, "budget": 2000, "polish_budget": 500}, "random": {"budget": 2000}, "ga": {"budget": 2000}}
    return make_planner(name, **kwargs.get(name, {}))


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_returns_a_valid_plan(name):
    p = random_problem(11)  # 8 layers, 2 types
    plan = fast(name).plan(p)
    assert plan.planner == name
    assert len(plan.assignment) == p.n_layers and all(0 <= r < p.n_resources for r in plan.assignment)
    assert plan == cost_model.evaluate(p, plan.assignment)  # the planner field is not compared
    assert plan.stages[0].start == 0 and plan.stages[-1].stop == p.n_layers
    assert all(a.stop == b.start and a.resource != b.resource for a, b in zip(plan.stages, plan.stages[1:]))
    assert plan.feasible


@pytest.mark.parametrize("seed", [11, 14, 23, 5])
def test_bruteforce_is_optimal(seed):
    p = random_problem(seed, n_layers=min(random_problem(seed).n_layers, 6))
    best = min((naive_cost(p, a)[1], a) for a in itertools.product(range(p.n_resources), repeat=p.n_layers))
    plan = BruteForcePlanner(chunk=100).plan(p)  # small chunks: the best must survive across chunks
    assert plan.cost == pytest.approx(best[0], rel=1e-12)


def test_bruteforce_refuses_a_large_space():
    with pytest.raises(SpaceTooLarge, match="exceed"):
        BruteForcePlanner(max_plans=1000).plan(random_problem(0))


def myopic_problem() -> PlacementProblem:
    """24 layers: 10 sparse, 4 dense, 10 sparse; 1 gpu that runs only the dense block within budget.

    Optimum: the dense block on the gpu (20 cpu workers + 1 gpu, $30/h). Greedy tries "the rest on
    the gpu" from each layer, always infeasible, so it keeps all on the cpu (60 workers, $60/h);
    random i.i.d. plans put some sparse layer on the gpu and are infeasible with odds 1 - 2**-20.
    """
    layers = [LayerProfile(f"{i}", "sparse", {"cpu": 0.01, "gpu": 0.05}, out_bytes=0) for i in range(10)]
    layers += [LayerProfile(f"{i}", "dense", {"cpu": 0.10, "gpu": 0.002}, out_bytes=0) for i in range(10, 14)]
    layers += [LayerProfile(f"{i}", "sparse", {"cpu": 0.01, "gpu": 0.05}, out_bytes=0) for i in range(14, 24)]
    resources = (ResourceType("cpu", 1.0, 100), ResourceType("gpu", 10.0, 1, measured=False))
    return PlacementProblem(tuple(layers), resources, batch_size=100, samples_to_train=3.6e7, min_throughput=1e4, bandwidth_bytes_per_s=1e12)


def test_rl_beats_greedy_and_random_where_greedy_is_myopic():
    p = myopic_problem()
    optimum = cost_model.evaluate(p, [0] * 10 + [1] * 4 + [0] * 10)
    assert optimum.cost == pytest.approx(30.0)  # (10 + 10) cpu x $1 + 1 gpu x $10, for 1 hour
    greedy = GreedyPlanner().plan(p)
    rl = RLPlanner(seed=0, iterations=100, polish_budget=0).train(p)  # no local-search polish
    random = RandomSearchPlanner(budget=rl.evaluations).plan(p)
    assert greedy.feasible and greedy.cost == pytest.approx(2 * optimum.cost)
    assert not random.feasible
    assert rl.plan.feasible and rl.plan.cost == pytest.approx(optimum.cost)


@pytest.mark.timeout(120)
def test_rl_close_to_bruteforce_on_small_problems():
    """The RL planner without its local-search polish: within 3% of the optimum (here: on it)."""
    for seed in (14, 23, 11):
        p = random_problem(seed)
        best = BruteForcePlanner().plan(p)
        res = RLPlanner(seed=0, iterations=100, polish_budget=0).train(p)
        assert res.plan == res.sampled
        assert res.plan.cost <= 1.03 * best.cost, (p.name, res.plan.cost / best.cost)


def test_pure_reinforce_learns_past_a_greedy_trap():
    """No greedy warm start and no polish: the policy alone finds the optimum greedy misses by 2%."""
    p = random_problem(109, n_layers=12, n_resources=2)
    best = BruteForcePlanner().plan(p)
    assert GreedyPlanner().plan(p).cost > 1.01 * best.cost
    res = RLPlanner(seed=0, iterations=100, batch=32, warm_start=False, polish_budget=0).train(p)
    assert res.plan.cost <= 1.03 * best.cost
    assert res.history[-1] > res.history[0]  # the policy improved, not just a lucky first batch


def test_planners_are_deterministic_given_a_seed():
    p = random_problem(1)
    for name in ("random", "ga", "rl"):
        assert fast(name).plan(p).assignment == fast(name).plan(p).assignment


def test_make_planner_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown planner 'dqn'"):
        make_planner("dqn")


# ---------------------------------------------------------------- re-planning


def test_replan_keeps_the_plan_when_a_worker_joins():
    p = hand_problem()
    first = make_planner("bruteforce").plan(p)
    assert first.assignment == (0, 1, 1)
    again = replan(p, {"cpu": 5}, "bruteforce", current=first.assignment, min_gain=0.1)
    assert again.planner == "kept" and again.assignment == first.assignment


def test_replan_changes_the_plan_when_a_worker_leaves():
    p = hand_problem(cpu_count=6, gpu_count=2)
    first = make_planner("bruteforce").plan(p)
    assert 1 in first.assignment
    gone = replan(p, {"gpu": 0}, "bruteforce", current=first.assignment)
    assert not cost_model.evaluate(p.with_counts({"gpu": 0}), first.assignment).feasible
    assert gone.planner == "bruteforce" and gone.feasible and gone.assignment == (0, 0, 0)
    assert replan(p, [6, 0], "bruteforce").assignment == gone.assignment  # counts as a list, by type order


def test_replan_moves_to_a_much_cheaper_plan_when_workers_join():
    p = hand_problem(cpu_count=6, gpu_count=0)
    first = make_planner("bruteforce").plan(p)
    assert first.assignment == (0, 0, 0)
    joined = replan(p, {"gpu": 1}, "bruteforce", current=first.assignment, min_gain=0.1)
    assert joined.planner == "bruteforce" and joined.cost < 0.9 * cost_model.evaluate(p.with_counts({"gpu": 1}), first.assignment).cost


def test_replan_rejects_bad_counts():
    p = hand_problem()
    with pytest.raises(ValueError, match="unknown resource types"):
        replan(p, {"tpu": 1}, "greedy")
    with pytest.raises(ValueError, match="expected 2 counts"):
        replan(p, [1], "greedy")
    with pytest.raises(ValueError, match="count"):
        replan(p, {"cpu": -1}, "greedy")
