"""Fused optimizers, schedulers and losses against per-member torch ones."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hmp.hfta import (
    FusedAdam,
    FusedAdamW,
    FusedCosineAnnealingLR,
    FusedSGD,
    FusedStepLR,
    fuse_models,
    fused_cross_entropy,
    fused_mse_loss,
    make_optimizer,
    stack,
)

B = 3
N = 6
STEPS = 6
TOL = dict(rtol=1e-4, atol=1e-6)


def _members(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(B)]


def _run_both(settings: list[dict], torch_cls, fused_cls, steps=STEPS, shared=None, sched=None):
    """Train B torch models (one torch optimizer each, member b's settings) and the fused
    model (one fused optimizer) on the same per-member batches; return both, trained."""
    models = _members()
    fused = fuse_models(copy.deepcopy(models))
    shared = shared or {}
    opts = [torch_cls(m.parameters(), **shared, **s) for m, s in zip(models, settings)]
    keys = set().union(*settings)
    defaults = inspect.signature(fused_cls).parameters
    per_member = {k: [s.get(k, defaults[k].default) for s in settings] for k in keys}
    fopt = fused_cls(fused.parameters(), **shared, **per_member)
    scheds = fsched = None
    if sched is not None:
        scheds = [sched[0](o, **sched[1]) for o in opts]
        fsched = sched[2](fopt, **sched[3])
    torch.manual_seed(1)
    for _ in range(steps):
        xs = [torch.randn(N, 5) for _ in range(B)]
        ys = [torch.randint(0, 3, (N,)) for _ in range(B)]
        for m, o, x, y in zip(models, opts, xs, ys):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        fopt.zero_grad()
        fused_cross_entropy(fused(stack(xs, "dense")), torch.stack(ys)).sum().backward()
        fopt.step()
        if sched is not None:
            for s in scheds:
                s.step()
            fsched.step()
    return models, fused, fopt


def _assert_members_equal(models, fused):
    for b, m in enumerate(models):
        for (name, want), got in zip(m.state_dict().items(), fused.export_member(b).state_dict().values()):
            torch.testing.assert_close(got, want, **TOL, msg=lambda s: f"member {b} {name}: {s}")


SGD_CASES = {
    "plain": ({}, [dict(lr=0.1), dict(lr=0.05), dict(lr=0.2)]),
    "momentum": ({}, [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.5), dict(lr=0.2, momentum=0.0)]),
    "dampening-wd": ({}, [dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
                          dict(lr=0.1, momentum=0.0, dampening=0.5, weight_decay=0.1),
                          dict(lr=0.05, momentum=0.7, dampening=0.0, weight_decay=0.0)]),
    "nesterov": ({"nesterov": True}, [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.8),
                                      dict(lr=0.02, momentum=0.5)]),
    "maximize-same": ({"maximize": True}, [dict(lr=0.01, momentum=0.9)] * 3),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_fused_sgd_matches_torch_sgd_per_member(case):
    """FusedSGD steps member b exactly as torch.optim.SGD with member b's lr, momentum,
    dampening and weight decay (a member with momentum 0 included)."""
    shared, settings = SGD_CASES[case]
    models, fused, _ = _run_both(settings, torch.optim.SGD, FusedSGD, shared=shared)
    _assert_members_equal(models, fused)


ADAM_CASES = {
    "adam": (torch.optim.Adam, FusedAdam, {}, [dict(lr=1e-2, betas=(0.9, 0.999)), dict(lr=3e-2, betas=(0.8, 0.99)),
                                               dict(lr=1e-3, betas=(0.5, 0.9), eps=1e-6)]),
    "adam-wd-amsgrad": (torch.optim.Adam, FusedAdam, {"amsgrad": True},
                        [dict(lr=1e-2, weight_decay=0.1), dict(lr=2e-2, weight_decay=0.0), dict(lr=5e-3, weight_decay=0.01)]),
    "adamw": (torch.optim.AdamW, FusedAdamW, {}, [dict(lr=1e-2, weight_decay=0.1), dict(lr=2e-2, weight_decay=0.5),
                                                  dict(lr=1e-2, weight_decay=0.0, betas=(0.7, 0.95))]),
    "adamw-same": (torch.optim.AdamW, FusedAdamW, {}, [dict(lr=1e-2, weight_decay=0.1)] * 3),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_fused_adam_matches_torch_per_member(case):
    """FusedAdam/FusedAdamW step member b exactly as torch Adam/AdamW with member b's lr,
    betas, eps and weight decay."""
    torch_cls, fused_cls, shared, settings = ADAM_CASES[case]
    models, fused, _ = _run_both(settings, torch_cls, fused_cls, shared=shared)
    _assert_members_equal(models, fused)


def test_per_member_hyperparameters_really_differ_in_effect():
    """Members built identically but given different learning rates end in different places,
    a member with lr 0 does not move, and members with equal settings stay equal."""
    torch.manual_seed(0)
    one = nn.Linear(4, 2)
    fused = fuse_models([copy.deepcopy(one) for _ in range(4)])
    start = fused.weight.detach().clone()
    opt = FusedSGD(fused.parameters(), lr=[0.0, 0.1, 0.1, 0.5], momentum=0.9)
    for _ in range(5):
        opt.zero_grad()
        x = torch.randn(8, 4)
        fused_mse_loss(fused(x.expand(4, 8, 4)), torch.zeros(8, 2)).sum().backward()
        opt.step()
    w = fused.weight.detach()
    assert torch.equal(w[0], start[0])
    assert torch.equal(w[1], w[2])
    assert not torch.allclose(w[1], w[3])
    assert not torch.allclose(w[1], start[1])


def test_optimizer_rejects_parameters_without_member_dimension_and_bad_settings():
    """A parameter whose first dimension is not B, or a per-member list of the wrong length,
    is refused with a message saying what was expected."""
    with pytest.raises(ValueError, match=r"member dimension first"):
        FusedSGD([nn.Parameter(torch.zeros(2, 3))], lr=0.1, B=3)
    with pytest.raises(ValueError, match=r"expected one per member \(B=3\)"):
        FusedAdam([nn.Parameter(torch.zeros(3, 2))], lr=[0.1, 0.2])
    with pytest.raises(ValueError, match=r"Nesterov"):
        FusedSGD([nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=[0.9, 0.0], nesterov=True)


def test_make_optimizer_reads_settings_and_refuses_unknown_or_inconsistent_keys():
    """make_optimizer builds per-member lists from settings dicts (defaults for missing keys)
    and refuses unknown keys and shared options that differ between members."""
    params = [nn.Parameter(torch.zeros(2, 3))]
    opt = make_optimizer("adamw", params, [{"lr": 0.1, "betas": [0.8, 0.9]}, {"weight_decay": 0.0}])
    assert opt.param_groups[0]["lr"] == [0.1, 1e-3]
    assert opt.param_groups[0]["betas"] == [(0.8, 0.9), (0.9, 0.999)]
    assert opt.param_groups[0]["weight_decay"] == [1e-2, 0.0]
    with pytest.raises(ValueError, match=r"unknown hyper-parameter 'momentum' for fused adam"):
        make_optimizer("adam", params, [{"momentum": 0.9}, {}])
    with pytest.raises(ValueError, match=r"nesterov must be the same in every member"):
        make_optimizer("sgd", params, [{"nesterov": True, "momentum": 0.9}, {"momentum": 0.9}])
    with pytest.raises(ValueError, match=r"unknown fused optimizer 'rmsprop'"):
        make_optimizer("rmsprop", params, [{}, {}])


def test_step_lr_matches_torch_per_member():
    """FusedStepLR gives member b torch StepLR's rate with b's own step_size and gamma, and the
    rates reach the parameters: training with it matches torch SGD + StepLR per member."""
    settings = [dict(lr=0.1, momentum=0.9), dict(lr=0.2, momentum=0.9), dict(lr=0.05, momentum=0.9)]
    step_size, gamma = [1, 2, 3], [0.5, 0.1, 0.9]
    torch_lrs = []
    for b in range(B):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=settings[b]["lr"])
        s = torch.optim.lr_scheduler.StepLR(opt, step_size[b], gamma[b])
        lrs = []
        for _ in range(8):
            lrs.append(s.get_last_lr()[0])
            opt.step()
            s.step()
        torch_lrs.append(lrs)
    opt = FusedSGD([nn.Parameter(torch.zeros(B, 1))], lr=[s["lr"] for s in settings])
    fs = FusedStepLR(opt, step_size, gamma)
    got = []
    for _ in range(8):
        got.append(fs.get_last_lr()[0])
        opt.step()
        fs.step()
    for b in range(B):
        assert [g[b] for g in got] == pytest.approx(torch_lrs[b], rel=1e-12)
    # end to end: same per-member schedule in both worlds (torch takes one gamma/step per model)
    models, fused, _ = _run_both([dict(lr=0.1, momentum=0.9)] * B, torch.optim.SGD, FusedSGD,
                                 sched=(torch.optim.lr_scheduler.StepLR, dict(step_size=2, gamma=0.5),
                                        FusedStepLR, dict(step_size=2, gamma=0.5)))
    _assert_members_equal(models, fused)


def test_cosine_matches_torch_per_member():
    """FusedCosineAnnealingLR gives member b torch CosineAnnealingLR's rate with b's own
    T_max and eta_min (past T_max too)."""
    lrs0, T_max, eta_min = [0.1, 0.3, 0.05], [4, 6, 10], [0.0, 0.01, 0.001]
    opt = FusedAdam([nn.Parameter(torch.zeros(B, 2))], lr=lrs0)
    fs = FusedCosineAnnealingLR(opt, T_max, eta_min)
    got = []
    for _ in range(12):
        got.append(fs.get_last_lr()[0])
        opt.step()
        fs.step()
    for b in range(B):
        o = torch.optim.Adam([nn.Parameter(torch.zeros(2))], lr=lrs0[b])
        s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max[b], eta_min[b])
        want = []
        for _ in range(12):
            want.append(s.get_last_lr()[0])
            o.step()
            s.step()
        assert [g[b] for g in got] == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_fused_cross_entropy_is_each_members_torch_loss():
    """fused_cross_entropy returns each member's torch cross-entropy (plain, and with
    ignore_index and label smoothing), for shared and per-member targets."""
    torch.manual_seed(0)
    logits = torch.randn(B, N, 4)
    shared_t = torch.randint(0, 4, (N,))
    per_t = torch.randint(0, 4, (B, N))
    per_t[1, :3] = -100
    for t in (shared_t, per_t):
        tb = [t] * B if t.dim() == 1 else list(t)
        got = fused_cross_entropy(logits, t, ignore_index=-100, label_smoothing=0.1)
        want = torch.stack([F.cross_entropy(logits[b], tb[b], label_smoothing=0.1) for b in range(B)])
        torch.testing.assert_close(got, want)
    got = fused_cross_entropy(logits, shared_t)  # the default, shorter path
    torch.testing.assert_close(got, torch.stack([F.cross_entropy(logits[b], shared_t) for b in range(B)]))
    with pytest.raises(ValueError, match=r"expected a target of shape \(6,\)"):
        fused_cross_entropy(logits, torch.zeros(N + 1, dtype=torch.long))


def test_sum_of_member_losses_gives_each_member_its_unfused_gradient():
    """Back-propagating the sum of the [B] losses gives member b exactly the gradient of its
    own mean loss (the mean over B would divide it by B)."""
    models = _members()
    fused = fuse_models(copy.deepcopy(models))
    x = torch.randn(N, 5)
    y = torch.randint(0, 3, (N,))
    fused_cross_entropy(fused(x.expand(B, N, 5)), y).sum().backward()
    for b, m in enumerate(models):
        F.cross_entropy(m(x), y).backward()
        torch.testing.assert_close(fused[0].weight.grad[b], m[0].weight.grad, **TOL)
    fused.zero_grad()
    fused_cross_entropy(fused(x.expand(B, N, 5)), y).mean().backward()
    torch.testing.assert_close(fused[0].weight.grad[0] * B, models[0][0].weight.grad, **TOL)


def test_fused_mse_is_each_members_torch_loss():
    """fused_mse_loss returns each member's F.mse_loss (mean over all its elements)."""
    out, target = torch.randn(B, N, 2, 3), torch.randn(N, 2, 3)
    want = torch.stack([F.mse_loss(out[b], target) for b in range(B)])
    torch.testing.assert_close(fused_mse_loss(out, target), want)
    assert math.isfinite(fused_mse_loss(out, out).sum().item())


@pytest.mark.parametrize("torch_cls, fused_cls, settings", [
    (torch.optim.SGD, FusedSGD, [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.5), dict(lr=0.2, momentum=0.0)]),
    (torch.optim.Adam, FusedAdam, [dict(lr=1e-2), dict(lr=3e-2, betas=(0.8, 0.99)), dict(lr=1e-3)]),
], ids=["sgd", "adam"])
def test_parameters_without_gradient_are_skipped_like_torch(torch_cls, fused_cls, settings):
    """A layer with no gradient on some steps (frozen, or unused) is skipped by the fused
    optimizer exactly as torch skips it; its momentum / moments start when it first has one."""
    models = _members()
    fused = fuse_models(copy.deepcopy(models))
    opts = [torch_cls(m.parameters(), **s) for m, s in zip(models, settings)]
    keys = set().union(*settings)
    defaults = inspect.signature(fused_cls).parameters
    fopt = fused_cls(fused.parameters(), **{k: [s.get(k, defaults[k].default) for s in settings] for k in keys})
    torch.manual_seed(2)
    for step in range(5):
        x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
        frozen = step < 2  # the first layer has no gradient for two steps, then trains
        for m, o in zip(models, opts):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if frozen:
                m[0].weight.grad = m[0].bias.grad = None
            o.step()
        fopt.zero_grad()
        fused_cross_entropy(fused(x.expand(B, N, 5)), y).sum().backward()
        if frozen:
            fused[0].weight.grad = fused[0].bias.grad = None
        fopt.step()
    _assert_members_equal(models, fused)


def test_optimizer_state_dict_round_trip_continues_identically():
    """A fused optimizer saved after K steps and loaded into a fresh one continues exactly as
    the original does (momentum buffers and per-member settings included)."""
    settings = [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.5), dict(lr=0.2, momentum=0.7)]
    models, fused, fopt = _run_both(settings, torch.optim.SGD, FusedSGD, steps=3)
    twin = copy.deepcopy(fused)
    topt = FusedSGD(twin.parameters(), lr=0.0, B=B)
    topt.load_state_dict(copy.deepcopy(fopt.state_dict()))  # state_dict() does not copy tensors
    assert topt.param_groups[0]["lr"] == [0.1, 0.05, 0.2]
    x, y = torch.randn(N, 5), torch.randint(0, 3, (N,))
    for f, o in ((fused, fopt), (twin, topt)):
        o.zero_grad()
        fused_cross_entropy(f(x.expand(B, N, 5)), y).sum().backward()
        o.step()
    for p, q in zip(fused.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_adam_per_member_betas_and_eps_really_differ_in_effect():
    """Identical members given different Adam betas end in different places; members with the
    same settings stay bit-identical."""
    torch.manual_seed(0)
    one = nn.Linear(4, 2)
    fused = fuse_models([copy.deepcopy(one) for _ in range(3)])
    opt = FusedAdam(fused.parameters(), lr=0.05, betas=[(0.9, 0.999), (0.9, 0.999), (0.5, 0.9)], eps=[1e-8, 1e-8, 1e-3])
    for _ in range(4):
        opt.zero_grad()
        fused_mse_loss(fused(torch.randn(8, 4).expand(3, 8, 4)), torch.zeros(8, 2)).sum().backward()
        opt.step()
    w = fused.weight.detach()
    assert torch.equal(w[0], w[1])
    assert not torch.allclose(w[0], w[2])
