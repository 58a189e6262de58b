"""The converter (torch model -> fused model -> members) and the FusedArray sweep facade."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hmp.hfta import (
    DENSE,
    FUSED_OPS,
    IMAGE,
    FusedArray,
    FusedSequential,
    UnsupportedModuleError,
    broadcast,
    fuse,
    fuse_models,
)
from hmp.models import click_model, digits_mlp

TOL = dict(rtol=1e-4, atol=1e-5)


def small_cnn() -> nn.Sequential:
    """A tiny CNN using the main image-arrangement operators. (No bias before BatchNorm: its true
    gradient is zero, so Adam would amplify float noise into steps that differ run to run.)"""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(24, 16), nn.Dropout(0.0), nn.ReLU(), nn.Linear(16, 3),
    )


def _train_serial(factory, settings, optim_cls, batches, seed=0):
    """B torch models trained one after another (the reference): final models and losses."""
    torch.manual_seed(seed)
    models = [factory() for _ in settings]
    losses = []
    for m, s in zip(models, settings):
        opt = optim_cls(m.parameters(), **s)
        member_losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            member_losses.append(loss.item())
        losses.append(member_losses)
    return models, losses


def _train_fused(factory, settings, optimizer, batches, seed=0):
    torch.manual_seed(seed)
    array = FusedArray(factory, settings, optimizer=optimizer)
    losses = [array.step(x, y).tolist() for x, y in batches]
    return array, [list(col) for col in zip(*losses)]


def _assert_same(array, models):
    for b, m in enumerate(models):
        got = array.export_member(b).state_dict()
        for k, want in m.state_dict().items():
            torch.testing.assert_close(got[k], want, **TOL, msg=lambda s: f"member {b} {k}: {s}")


def _batches(shape, classes, k=4, n=16, ids=None):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(k):
        x = torch.randint(0, ids, (n, *shape), generator=g) if ids else torch.randn(n, *shape, generator=g)
        out.append((x, torch.randint(0, classes, (n,), generator=g)))
    return out


def test_fused_member_b_is_the_bth_model_the_factory_builds():
    """fuse(factory, B) under a seed holds exactly the models that B factory() calls would
    give under the same seed, in order."""
    torch.manual_seed(3)
    fused = fuse(digits_mlp, 4)
    torch.manual_seed(3)
    serial = [digits_mlp() for _ in range(4)]
    for b, m in enumerate(serial):
        for k, v in fused.export_member(b).state_dict().items():
            assert torch.equal(v, m.state_dict()[k]), (b, k)


def test_fused_state_dict_mirrors_the_unfused_names_with_a_leading_member_dimension():
    """Every fused parameter is an nn.Parameter named as in the unfused model, shaped [B, *shape]."""
    fused = fuse(small_cnn, 3)
    ref = small_cnn().state_dict()
    got = fused.state_dict()
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert tuple(got[k].shape) == (3, *v.shape), k
    assert all(isinstance(p, nn.Parameter) for p in fused.parameters())


def test_digits_mlp_array_trains_like_serial_sgd_with_per_member_settings():
    """FusedArray on digits_mlp with per-member lr/momentum/weight decay ends with the same
    weights, and reports the same per-step losses, as training the B models one by one."""
    settings = [dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.0, weight_decay=1e-3),
                dict(lr=0.2, momentum=0.5, dampening=0.1), dict(lr=0.01, momentum=0.9, nesterov=False)]
    batches = _batches((64,), 10, k=5)
    models, serial_losses = _train_serial(digits_mlp, settings, torch.optim.SGD, batches)
    array, fused_losses = _train_fused(digits_mlp, settings, "sgd", batches)
    _assert_same(array, models)
    for b in range(4):
        assert fused_losses[b] == pytest.approx(serial_losses[b], rel=1e-5)
    assert len({round(row[-1], 6) for row in fused_losses}) == 4  # settings made a difference


def test_cnn_array_trains_like_serial_adamw_and_evaluates_per_member():
    """A CNN (Conv2d, BatchNorm2d, pools, Flatten, Linear) fused and trained with per-member
    AdamW settings matches serial training, and evaluate() gives each exported member's
    eval-mode accuracy."""
    settings = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.99)), dict(lr=2e-2)]
    batches = _batches((1, 8, 8), 3, k=4)
    models, _ = _train_serial(small_cnn, settings, torch.optim.AdamW, batches)
    array, _ = _train_fused(small_cnn, settings, "adamw", batches)
    assert array.model.in_arrangement == IMAGE and array.model.out_arrangement == DENSE
    _assert_same(array, models)
    x, y = _batches((1, 8, 8), 3, k=1, n=40)[0]
    acc = array.evaluate(x, y)
    assert array.model.training  # evaluate restored training mode
    for b, m in enumerate(models):
        m.eval()
        want = (m(x).argmax(-1) == y).float().mean().item()
        assert acc[b] == pytest.approx(want)


def test_click_model_with_field_embedding_trains_like_serial():
    """The sparse click model (FieldEmbedding then MLP) converts and trains like serial Adam."""
    settings = [dict(lr=1e-2), dict(lr=5e-2, betas=(0.5, 0.9))]
    factory = lambda: click_model(fields=3, buckets=20, dim=4, hidden=(8,))  # noqa: E731
    batches = _batches((3,), 2, k=3, ids=20)
    models, _ = _train_serial(factory, settings, torch.optim.Adam, batches)
    array, _ = _train_fused(factory, settings, "adam", batches)
    _assert_same(array, models)


def test_parameter_server_can_overwrite_fused_parameters_in_place():
    """Writing new values into the fused parameters in place (as a PS does from its flat
    buffers) changes what the model computes: member b then equals a torch model loaded with
    those values, and the optimizer keeps stepping the same tensors."""
    array = FusedArray(digits_mlp, [dict(lr=0.1)] * 3)
    params = list(array.model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]) * 0.5  # "new values from the PS"
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
    x = torch.randn(5, 64)
    ref = digits_mlp()
    with torch.no_grad():
        for (name, p) in ref.named_parameters():
            p.copy_(dict(array.model.named_parameters())[name][1])
        torch.testing.assert_close(array.logits(x)[1], ref(x), **TOL)
    array.step(x, torch.zeros(5, dtype=torch.long))
    assert [p.data_ptr() for p in array.model.parameters()] == [p.data_ptr() for p in params]


def test_exported_member_continues_as_an_ordinary_model():
    """A member exported mid-sweep trains on as plain torch exactly as it would have in the array."""
    settings = [dict(lr=0.1, momentum=0.0), dict(lr=0.05, momentum=0.0)]
    array = FusedArray(digits_mlp, settings)
    batches = _batches((64,), 10, k=3)
    array.step(*batches[0])
    alone = array.export_member(1)
    opt = torch.optim.SGD(alone.parameters(), lr=0.05)
    for x, y in batches[1:]:
        array.step(x, y)
        opt.zero_grad()
        F.cross_entropy(alone(x), y).backward()
        opt.step()
    _assert_same_member = array.export_member(1).state_dict()
    for k, v in alone.state_dict().items():
        torch.testing.assert_close(_assert_same_member[k], v, **TOL)


def test_load_member_replaces_one_member_only():
    """load_member(b, module) overwrites member b with the module's weights and leaves the others."""
    array = FusedArray(digits_mlp, [dict(lr=0.1)] * 3)
    before = [array.export_member(b).state_dict() for b in range(3)]
    new = digits_mlp()
    array.load_member(1, new)
    after = [array.export_member(b).state_dict() for b in range(3)]
    for k in new.state_dict():
        assert torch.equal(after[1][k], new.state_dict()[k])
        assert torch.equal(after[0][k], before[0][k]) and torch.equal(after[2][k], before[2][k])


def test_load_member_refuses_another_architecture():
    """Loading a member with different layer sizes fails with the shapes in the message."""
    fused = fuse(digits_mlp, 2)
    with pytest.raises(ValueError, match=r"child '0'.*shape \(100, 64\), expected \(128, 64\)"):
        fused.load_member(0, digits_mlp(hidden=(100, 64)))
    with pytest.raises(ValueError, match=r"children"):
        fused.load_member(0, nn.Sequential(nn.Linear(64, 10)))


class PReLUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2


@pytest.mark.parametrize("make, pattern", [
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.PReLU()), r"model\.1 \(torch\.nn\.modules\.activation\.PReLU\)"),
    (lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 4), PReLUNet())), r"model\.0\.1 \(.*PReLUNet\).*own forward"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.Linear(4, 4)), r"model\.1 \(Linear\).*needs dense.*nn\.Flatten"),
    (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2, return_indices=True)), r"return_indices"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.Flatten(0)), r"start_dim=1"),
], ids=["prelu", "custom-forward", "missing-flatten", "return-indices", "flatten-dim"])
def test_unsupported_modules_are_named_in_a_clear_error(make, pattern):
    """Anything the converter cannot fuse raises UnsupportedModuleError naming the module,
    its path in the model and why."""
    with pytest.raises(UnsupportedModuleError, match=pattern):
        fuse(make, 2)


def test_conversion_table_covers_the_issue_operators():
    """The table maps every operator the issue lists to a fused one."""
    wanted = {nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.Embedding,
              nn.Dropout, nn.MaxPool2d, nn.AvgPool2d, nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.Flatten}
    assert wanted <= set(FUSED_OPS)


def test_nested_sequential_and_broadcast_input():
    """Nested Sequentials fuse recursively and a shared input broadcast in the model's arrangement
    gives each member its own model's output."""
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Sequential(nn.Linear(3, 5), nn.GELU()), nn.LayerNorm(5), nn.Linear(5, 2))  # noqa: E731
    models = [make() for _ in range(3)]
    fused = fuse_models(copy.deepcopy(models), device="cpu")
    assert isinstance(fused[0], FusedSequential)
    x = torch.randn(7, 3)
    out = fused(broadcast(x, 3, fused.in_arrangement))
    for b, m in enumerate(models):
        torch.testing.assert_close(out[b], m(x), **TOL)


def test_array_refuses_empty_settings_and_wrong_labels():
    """FusedArray needs at least one member and labels [N] or [B, N]."""
    with pytest.raises(ValueError, match=r"one dict per member"):
        FusedArray(digits_mlp, [])
    array = FusedArray(digits_mlp, [{}, {}])
    with pytest.raises(ValueError, match=r"expected a target of shape \(4,\)"):
        array.step(torch.randn(4, 64), torch.zeros(5, dtype=torch.long))
