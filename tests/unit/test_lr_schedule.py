"""Learning-rate schedules (hmp.ps.lr_schedule): the documented closed forms, torch's schedulers, and a real
shard core applying updates at the scheduled rates."""

from __future__ import annotations

import math

import pytest
import torch

from hmp.config import loads
from hmp.ps.optim import chunk_optimizer_of, make_chunk_optimizer
from hmp.ps.lr_schedule import LRSchedule, cosine_annealing, lr_at, step_decay
from hmp.ps.shard_core import ShardCore

NODES = """
[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:47399"  # parsed, never bound
[[nodes]]
id = "ps0"
role = "ps"
[[nodes]]
id = "cpu0"
role = "cpu_worker"
"""


def optimizer_config(optimizer: str, extra: str = ""):
    """A real config's [optimizer] section, validated by the config loader."""
    return loads(f"[optimizer]\n{optimizer}\n{extra}\n{NODES}")


def test_values_at_chosen_steps_are_the_documented_formulas() -> None:
    """The numbers of docs/optimizers.md, worked by hand: warm-up lr*(s+1)/W, then step or cosine on t = s - W."""
    step = optimizer_config('name = "sgd"\nlr = 0.1\nschedule = "step"\nwarmup_steps = 4\nstep_size = 3\ngamma = 0.5').optimizer
    assert [lr_at(s, step) for s in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    #         t = 0, 1, 2 -> 0.1; t = 3, 4, 5 -> 0.05; t = 6 -> 0.025
    assert [lr_at(s, step) for s in range(4, 11)] == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025])
    cos = optimizer_config('name = "adam"\nlr = 0.01\nschedule = "cosine"\nwarmup_steps = 2\ntotal_steps = 4\n'
                           'min_lr = 0.001').optimizer
    assert lr_at(0, cos) == pytest.approx(0.005)
    assert lr_at(1, cos) == pytest.approx(0.01)
    assert lr_at(2, cos) == pytest.approx(0.01)  # t = 0: cos 0 = 1
    assert lr_at(3, cos) == pytest.approx(0.001 + 0.009 * (1 + math.sqrt(0.5)) / 2)  # t = 1: cos(pi/4)
    assert lr_at(4, cos) == pytest.approx(0.0055)  # t = 2: half way
    assert lr_at(6, cos) == pytest.approx(0.001)  # t = T
    assert lr_at(60, cos) == pytest.approx(0.001)  # stays at min_lr after T (torch's form would climb again)
    const = optimizer_config('name = "sgd"\nlr = 0.2').optimizer
    assert {lr_at(s, const) for s in (0, 1, 10_000)} == {0.2}
    warm = optimizer_config('name = "sgd"\nlr = 0.2\nwarmup_steps = 5').optimizer
    assert [lr_at(s, warm) for s in (0, 4, 5, 99)] == pytest.approx([0.04, 0.2, 0.2, 0.2])


@pytest.mark.parametrize("kind", ["step", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_schedule_follows_torchs_schedulers_step_by_step(kind: str, warmup: int) -> None:
    """Stepping torch's LinearLR (warm-up) then StepLR / CosineAnnealingLR (SequentialLR) gives the same
    rates as the closed forms, update by update (within the cosine's T, where torch's form is the same)."""
    lr, steps = 0.1, 20
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=lr)
    sched = LRSchedule(kind=kind, warmup_steps=warmup, step_size=3, gamma=0.5, total_steps=12, min_lr=0.01)
    main = (torch.optim.lr_scheduler.StepLR(opt, 3, 0.5) if kind == "step"
            else torch.optim.lr_scheduler.CosineAnnealingLR(opt, 12, 0.01))
    if warmup > 1:
        warm = torch.optim.lr_scheduler.LinearLR(opt, 1 / warmup, 1.0, warmup - 1)
        torch_sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, main], milestones=[warmup])
    elif warmup == 1:  # one warm-up update at lr / 1 = lr: the same as none, shifted by one update
        torch_sched = torch.optim.lr_scheduler.SequentialLR(
            opt, [torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 1), main], milestones=[1])
    else:
        torch_sched = main
    for s in range(steps):
        if kind == "cosine" and s - warmup > 12:
            assert sched.lr(lr, s) == 0.01  # ours stays at min_lr; torch's closed form climbs again
            continue
        assert sched.lr(lr, s) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), s
        opt.step()
        torch_sched.step()


def test_closed_forms_are_torchs() -> None:
    """step_decay and cosine_annealing are StepLR's and CosineAnnealingLR's closed forms (also beyond T_max)."""
    for t in range(0, 25):
        assert step_decay(0.3, 0.7, 4, t) == pytest.approx(0.3 * 0.7 ** (t // 4))
        assert cosine_annealing(0.3, 0.05, 10, t) == pytest.approx(0.05 + 0.25 * (1 + math.cos(math.pi * t / 10)) / 2)


@pytest.mark.parametrize(("settings", "message"), [
    ({"kind": "linear"}, "schedule must be one of"),
    ({"kind": "cosine"}, "total_steps >= 1"),
    ({"kind": "step", "step_size": 0}, "step_size must be an integer >= 1"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"gamma": 0.0}, "gamma must be in"),
    ({"min_lr": float("nan")}, "min_lr must be"),
])
def test_bad_settings_are_refused_naming_the_setting(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LRSchedule(**settings)
    with pytest.raises(ValueError, match="step must be >= 0"):
        LRSchedule().lr(0.1, -1)


def test_the_config_gives_the_shards_and_the_ring_the_schedule() -> None:
    """chunk_optimizer_of (what PS shards and ring workers build their optimizers from) carries the
    schedule; a constant rate carries none, and a sweep's delta-applying SGD at lr 1 never does."""
    cfg = optimizer_config('name = "adam"\nlr = 0.01\nschedule = "cosine"\ntotal_steps = 50\nwarmup_steps = 5')
    name, hyper = chunk_optimizer_of(cfg)
    assert name == "adam" and hyper["schedule"] == LRSchedule(kind="cosine", warmup_steps=5, total_steps=50)
    opt = make_chunk_optimizer(name, 4, **hyper)
    assert opt.schedule is hyper["schedule"] and opt.hyper()["schedule"] is hyper["schedule"]
    assert "schedule" not in chunk_optimizer_of(optimizer_config('name = "sgd"\nlr = 0.1'))[1]
    # A mapping (TOML, msgpack) is taken too; an unknown field is an error naming it.
    assert make_chunk_optimizer("sgd", 2, lr=0.1, schedule={"kind": "step", "step_size": 2}).schedule.kind == "step"
    with pytest.raises(ValueError, match="schedule:.*warmup"):
        make_chunk_optimizer("sgd", 2, lr=0.1, schedule={"warmup": 3})


def _hand_sgd(p0: torch.Tensor, grads: list[torch.Tensor], rates: list[float]) -> torch.Tensor:
    p = p0.clone()
    for g, lr in zip(grads, rates, strict=True):
        p = p - lr * g
    return p


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_shard_core_applies_updates_at_the_scheduled_rates(consistency: str) -> None:
    """A real ShardCore with plain SGD and a warm-up + step schedule: after N updates (pushes, or sync
    rounds of two workers) each chunk is p0 - sum_s lr_at(s) * g_s, computed here by hand; the optimizers'
    last_lr is the last update's rate; a checkpoint's state continues the schedule where it was."""
    cfg = optimizer_config('name = "sgd"\nlr = 0.5\nschedule = "step"\nwarmup_steps = 3\nstep_size = 2\ngamma = 0.5')
    name, hyper = chunk_optimizer_of(cfg)
    gen = torch.Generator().manual_seed(1)
    chunks = {0: torch.randn(5, generator=gen), 1: torch.randn(3, generator=gen)}
    workers = ["w0", "w1"] if consistency == "sync" else ["w0"]
    core = ShardCore("ps0", chunks, name, hyper, consistency, workers=workers)
    n = 9
    grads = {k: [torch.randn(v.numel(), generator=gen) for _ in range(n)] for k, v in chunks.items()}
    rates = [lr_at(s, cfg.optimizer) for s in range(n)]
    assert rates == pytest.approx([0.5 / 3, 1 / 3, 0.5, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125])

    def update(core: ShardCore, s: int) -> None:
        keys = list(chunks)
        if consistency == "sync":  # two workers whose pushes average to grads[k][s]
            for w, sign in (("w0", 1.0), ("w1", -1.0)):
                core.contribute(w, keys, [grads[k][s] + sign * 0.25 for k in keys], 4)
            assert core.round_complete()
            core.finish_round()
        else:
            core.apply("w0", keys, [grads[k][s] for k in keys], 4)

    for s in range(5):
        update(core, s)
    state = core.snapshot()
    for s in range(5, n):
        update(core, s)
    assert core.updates_applied == n
    for k, v in chunks.items():
        torch.testing.assert_close(core.chunks[k].param, _hand_sgd(v, grads[k], rates), rtol=1e-6, atol=1e-6)
        assert core.chunks[k].optimizer.last_lr == pytest.approx(rates[-1])
    # Resumed from the checkpoint state after 5 updates: the next update is at rate lr_at(5), not lr_at(0).
    resumed = ShardCore("ps0", chunks, name, hyper, consistency, workers=workers)
    resumed.load_state_dict(state)
    for s in range(5, n):
        update(resumed, s)
    for k in chunks:
        torch.testing.assert_close(resumed.chunks[k].param, core.chunks[k].param, rtol=0, atol=0)
