"""Chunk optimizers and gradient aggregation (hmp.ps.optim) against torch.optim."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hmp.ps.optim import (
    ChunkAdagrad,
    ChunkAdam,
    ChunkSGD,
    accumulate,
    make_chunk_optimizer,
    scale_,
)
from hmp.flat import FlatLayout, chunk_views
from hmp.ps.lr_schedule import LRSchedule

torch.set_num_threads(1)

STEPS = 6

# (name, hyper-parameters): the same keywords go to torch.optim and make_chunk_optimizer.
CASES = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.1, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.05, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.02}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.05}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("adagrad", {"lr": 0.1}),
    ("adagrad", {"lr": 0.1, "weight_decay": 0.05, "initial_accumulator_value": 0.5, "eps": 1e-6, "lr_decay": 0.01}),
]
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 17), nn.Tanh(), nn.Linear(17, 3))  # 170 + 54 = 224 parameters


def random_grads(m: nn.Module, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=gen) for p in m.parameters()]


class ChunkedPS:
    """What a shard does: one chunk optimizer per chunk of the flat buffer, stepping in place."""

    def __init__(self, m: nn.Module, name: str, hyper: dict, chunk_bytes: int = 100, **more) -> None:
        self.layout = FlatLayout.from_model(m, chunk_bytes=chunk_bytes)  # 25 elements: cuts across parameters
        self.flat = self.layout.bind(m)
        self.params = chunk_views(self.flat.params, self.layout.chunks)
        self.grads = chunk_views(self.flat.grads, self.layout.chunks)
        self.opts = {c.key: make_chunk_optimizer(name, c.numel, **hyper, **more) for c in self.layout.chunks}

    def step(self, m: nn.Module, grads: list[torch.Tensor]) -> None:
        for p, g in zip(m.parameters(), grads, strict=True):
            p.grad.copy_(g)  # lands in the flat grad buffer
        for key, opt in self.opts.items():
            opt.step(self.params[key], self.grads[key])


@pytest.mark.parametrize(("name", "hyper"), CASES, ids=[f"{n}-{sorted(h)}" for n, h in CASES])
def test_chunked_optimizer_matches_torch_optim(name: str, hyper: dict) -> None:
    """Chunk-wise updates over a flat buffer equal torch.optim on the unflattened parameters after K steps."""
    reference, chunked = model(), model()
    ref_opt = TORCH[name](reference.parameters(), **hyper)
    ps = ChunkedPS(chunked, name, hyper)
    assert len(ps.layout.chunks) >= 8
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS):
        grads = random_grads(reference, gen)
        for p, g in zip(reference.parameters(), grads, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        ps.step(chunked, grads)
    for p, q in zip(chunked.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    moved = sum((p - q).abs().sum() for p, q in zip(chunked.parameters(), model().parameters()))
    assert moved > 0.1  # the updates did something


# Schedules against torch's: warm-up is LinearLR(1/W, 1, W-1), then StepLR or CosineAnnealingLR (SequentialLR);
# the cosine within its total_steps (after them ours stays at min_lr, torch's climbs again).
SCHEDULED = [(CASES[3], LRSchedule(kind="step", warmup_steps=3, step_size=2, gamma=0.5)),
             (CASES[8], LRSchedule(kind="cosine", warmup_steps=2, total_steps=8, min_lr=0.001)),
             (CASES[10], LRSchedule(kind="step", step_size=3, gamma=0.3)),
             (CASES[7], LRSchedule(kind="constant", warmup_steps=4))]


def torch_scheduler(opt: torch.optim.Optimizer, schedule: LRSchedule):
    S = torch.optim.lr_scheduler
    main = {"step": lambda: S.StepLR(opt, schedule.step_size, schedule.gamma),
            "cosine": lambda: S.CosineAnnealingLR(opt, schedule.total_steps, schedule.min_lr),
            "constant": lambda: S.ConstantLR(opt, 1.0, 0)}[schedule.kind]()
    w = schedule.warmup_steps
    if w < 2:  # W = 1 is a warm-up at the full rate: a constant start
        assert w == 0
        return main
    return S.SequentialLR(opt, [S.LinearLR(opt, 1 / w, 1.0, w - 1), main], milestones=[w])


@pytest.mark.parametrize(("case", "schedule"), SCHEDULED, ids=[f"{c[0]}-{s.kind}" for c, s in SCHEDULED])
def test_scheduled_chunk_optimizer_matches_torch_optim_with_its_scheduler(case, schedule: LRSchedule) -> None:
    """A chunk optimizer with a schedule, stepped over a flat buffer, equals torch.optim stepped with torch's
    schedulers (the rate read by each update: lr of update s + 1 = schedule.lr(lr, s)), for SGD with momentum,
    AdamW (the decoupled decay uses the scheduled rate) and Adagrad with lr_decay."""
    name, hyper = case
    reference, chunked = model(), model()
    ref_opt = TORCH[name](reference.parameters(), **hyper)
    ref_sched = torch_scheduler(ref_opt, schedule)
    ps = ChunkedPS(chunked, name, hyper, schedule=schedule)
    gen = torch.Generator().manual_seed(5)
    for s in range(10):
        grads = random_grads(reference, gen)
        for p, g in zip(reference.parameters(), grads, strict=True):
            p.grad = g.clone()
        ref_opt.step()
        ps.step(chunked, grads)
        assert all(o.last_lr == pytest.approx(ref_opt.param_groups[0]["lr"]) for o in ps.opts.values())
        ref_sched.step()
    for p, q in zip(chunked.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # Not the constant rate's result: the schedule changed something.
    constant = model()
    ChunkedPS(constant, name, hyper)
    assert any(not torch.allclose(p, q) for p, q in zip(chunked.parameters(), constant.parameters()))


@pytest.mark.parametrize(("name", "hyper"), [CASES[5], CASES[7], CASES[10]], ids=["sgd", "adam", "adagrad"])
def test_state_dict_round_trip_continues_identically(name: str, hyper: dict) -> None:
    """Saving state after some steps and loading it into a fresh optimizer continues bit-identically."""
    gen = torch.Generator().manual_seed(7)
    param = torch.randn(50, generator=gen)
    grads = [torch.randn(50, generator=gen) for _ in range(8)]
    opt = make_chunk_optimizer(name, 50, **hyper)
    for g in grads[:4]:
        opt.step(param, g)
    saved, saved_param = opt.state_dict(), param.clone()
    assert set(saved) >= {"optimizer", "numel", "step"} and saved["step"] == 4
    assert all(isinstance(v, (torch.Tensor, int, str)) for v in saved.values())
    for g in grads[4:]:
        opt.step(param, g)
    restored = make_chunk_optimizer(name, 50, **hyper)
    restored.load_state_dict(saved)
    for g in grads[4:]:
        restored.step(saved_param, g)
    assert torch.equal(saved_param, param)
    after = opt.state_dict()
    for k, v in restored.state_dict().items():
        assert torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]


def test_state_dict_is_a_copy_and_load_checks_kind_and_size() -> None:
    """state_dict tensors do not change with later steps; loading another kind or size raises ValueError."""
    opt = ChunkAdam(10, lr=0.1)
    param = torch.zeros(10)
    opt.step(param, torch.ones(10))
    saved = opt.state_dict()
    opt.step(param, torch.ones(10))
    assert not torch.equal(saved["exp_avg"], opt.exp_avg)
    with pytest.raises(ValueError, match="adam"):
        ChunkAdagrad(10).load_state_dict(saved)
    with pytest.raises(ValueError, match="elements"):
        ChunkAdam(11).load_state_dict(saved)
    with pytest.raises(ValueError, match="lacks"):
        ChunkAdam(10).load_state_dict({"optimizer": "adam", "numel": 10, "step": 1})


def test_step_updates_in_place_and_leaves_grad_alone() -> None:
    """step writes into the given param storage, reuses its state buffers, and does not modify grad."""
    opt = ChunkSGD(32, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1)
    param, grad = torch.randn(32), torch.randn(32)
    grad_before, ptrs = grad.clone(), (param.data_ptr(), opt.momentum_buffer.data_ptr())
    for _ in range(3):
        opt.step(param, grad)
    assert (param.data_ptr(), opt.momentum_buffer.data_ptr()) == ptrs
    assert torch.equal(grad, grad_before)
    flat = torch.zeros(100)
    ChunkAdam(20, lr=0.5).step(flat[40:60], torch.ones(20))  # a view into a bigger buffer
    assert torch.all(flat[40:60] < 0) and torch.all(flat[:40] == 0) and torch.all(flat[60:] == 0)


def test_step_rejects_mismatched_tensors() -> None:
    """A param or grad of the wrong size or dtype raises ValueError naming what was expected."""
    opt = make_chunk_optimizer("adagrad", 8, lr=0.1)
    with pytest.raises(ValueError, match=r"float32\[8\]"):
        opt.step(torch.zeros(9), torch.zeros(9))
    with pytest.raises(ValueError, match="grad"):
        opt.step(torch.zeros(8), torch.zeros(8, dtype=torch.float64))


def test_make_chunk_optimizer_rejects_unknown_names_and_hyper_parameters() -> None:
    """Unknown optimizers, unknown or invalid hyper-parameters give ValueErrors that list the accepted ones."""
    with pytest.raises(ValueError, match="adagrad.*adam.*sgd"):
        make_chunk_optimizer("rmsprop", 4, lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        make_chunk_optimizer("adam", 4, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="lr"):
        make_chunk_optimizer("sgd", 4)
    with pytest.raises(ValueError, match="nesterov"):
        make_chunk_optimizer("sgd", 4, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="lr"):
        make_chunk_optimizer("sgd", 4, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        make_chunk_optimizer("adam", 4, betas=(0.9, 1.0))
    opt = make_chunk_optimizer("adam", 4, lr=0.1, betas=[0.5, 0.6])  # lists (from TOML) are accepted
    assert opt.hyper()["betas"] == (0.5, 0.6)


def test_float16_chunk_keeps_state_in_its_dtype() -> None:
    """A float16 chunk optimizer keeps float16 state and matches the float32 update to half precision."""
    p16, p32 = torch.linspace(-1, 1, 16, dtype=torch.float16), torch.linspace(-1, 1, 16)
    g = torch.linspace(0.5, -0.5, 16)
    o16 = make_chunk_optimizer("sgd", 16, dtype=torch.float16, lr=0.1, momentum=0.9)
    o32 = make_chunk_optimizer("sgd", 16, lr=0.1, momentum=0.9)
    for _ in range(3):
        o16.step(p16, g.half())
        o32.step(p32, g)
    assert o16.state_dict()["momentum_buffer"].dtype == torch.float16
    torch.testing.assert_close(p16.float(), p32, rtol=1e-2, atol=1e-2)


def test_accumulate_and_scale_average_pushes() -> None:
    """First push copies, later pushes add in place, and scale_ by 1/n gives the mean."""
    dst = torch.full((5,), 99.0)  # stale contents must not leak into the sum
    pushes = [torch.randn(5) for _ in range(3)]
    ptr = dst.data_ptr()
    for i, g in enumerate(pushes):
        accumulate(dst, g, first=(i == 0))
    assert scale_(dst, 1 / 3) is dst and dst.data_ptr() == ptr
    torch.testing.assert_close(dst, torch.stack(pushes).mean(0))
    with pytest.raises(ValueError, match="shape"):
        accumulate(dst, torch.zeros(4), first=False)


def test_sync_average_then_chunk_sgd_matches_large_batch_step() -> None:
    """Averaging per-worker chunk gradients then stepping equals torch.optim.SGD on the mean gradient."""
    reference, chunked = model(), model()
    ps = ChunkedPS(chunked, "sgd", {"lr": 0.1, "momentum": 0.5})
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    gen = torch.Generator().manual_seed(11)
    agg = {c.key: torch.empty(c.numel) for c in ps.layout.chunks}
    for _ in range(3):
        worker_grads = [torch.randn(ps.flat.grads["float32"].shape, generator=gen) for _ in range(4)]
        for w, g in enumerate(worker_grads):
            for key, view in chunk_views(g, ps.layout.chunks).items():
                accumulate(agg[key], view, first=(w == 0))
        for key, opt in ps.opts.items():
            opt.step(ps.params[key], scale_(agg[key], 0.25))
        mean = torch.stack(worker_grads).mean(0)
        for p, view in zip(reference.parameters(), ps.layout.param_views({"float32": mean}).values(), strict=True):
            p.grad = view.clone()
        ref_opt.step()
    for p, q in zip(chunked.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_optimizers_run_on_the_chunk_device(device: str) -> None:
    """Built with device=..., each optimizer keeps its state there and matches the CPU result."""
    gen = torch.Generator().manual_seed(5)
    p0, g = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    for name, hyper in (CASES[5], CASES[7], CASES[10]):
        on_dev, on_cpu = p0.to(device), p0.clone()
        opt_dev = make_chunk_optimizer(name, 64, device=device, **hyper)
        opt_cpu = make_chunk_optimizer(name, 64, **hyper)
        for _ in range(3):
            opt_dev.step(on_dev, g.to(device))
            opt_cpu.step(on_cpu, g)
        assert all(v.device == on_dev.device for v in opt_dev.state_dict().values() if isinstance(v, torch.Tensor))
        torch.testing.assert_close(on_dev.cpu(), on_cpu, rtol=1e-5, atol=1e-6)
