"""Fused operators against B separately built torch modules: outputs, gradients, K SGD steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hmp.hfta import (
    DENSE,
    IMAGE,
    FusedBatchNorm1d,
    FusedBatchNorm2d,
    FusedConv2d,
    FusedLayerNorm,
    FusedLinear,
    broadcast,
    fuse_models,
    member,
    stack,
)
from hmp.hfta.elementwise import ACTIVATIONS, CHANNELWISE
from hmp.models import FieldEmbedding

B = 3
N = 5
STEPS = 3
TOL = dict(rtol=1e-4, atol=1e-5)


def _models(make, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [make() for _ in range(B)]


def _check_against_torch(models, make_input, arrangement_in=DENSE, arrangement_out=None, shared=False,
                         steps=STEPS, lr=0.05, float_input=True, fused=None):
    """Train B torch modules and their fused module side by side with plain SGD on a fixed random
    linear loss; assert equal outputs, input and parameter gradients at every step, and equal
    parameters and buffers (exported member b vs module b) at the end."""
    arrangement_out = arrangement_out or arrangement_in
    if fused is None:
        fused = fuse_models(copy.deepcopy(models))
    for step in range(steps):
        torch.manual_seed(100 + step)
        if shared:
            x = make_input()
            xs = [x] * B
        else:
            xs = [make_input() for _ in range(B)]
        xt = [x.clone().requires_grad_(float_input) for x in xs]
        if shared:
            xf_leaf = xs[0].clone()
            xf = broadcast(xf_leaf, B, arrangement_in)
        else:
            xf_leaves = [x.clone().requires_grad_(float_input) for x in xs]
            xf = stack(xf_leaves, arrangement_in)
        outs = [m(x) for m, x in zip(models, xt)]
        out_f = fused(xf)
        probes = [torch.randn_like(o) for o in outs]
        for b in range(B):
            torch.testing.assert_close(member(out_f, b, arrangement_out), outs[b], **TOL,
                                       msg=lambda m: f"step {step} member {b} output: {m}")
        sum(((o * p).sum() for o, p in zip(outs, probes))).backward()
        (out_f * stack(probes, arrangement_out)).sum().backward()
        if float_input and not shared:
            for b in range(B):
                torch.testing.assert_close(xf_leaves[b].grad, xt[b].grad, **TOL)
        fused_params = dict(fused.named_parameters())
        for b, m in enumerate(models):
            for name, p in m.named_parameters():
                torch.testing.assert_close(fused_params[name].grad[b], p.grad, **TOL,
                                           msg=lambda s: f"step {step} member {b} grad {name}: {s}")
        with torch.no_grad():
            for p in list(fused.parameters()) + [p for m in models for p in m.parameters()]:
                p -= lr * p.grad
                p.grad = None
    for b, m in enumerate(models):
        exported = fused.export_member(b)
        assert type(exported) is type(m)
        want, got = m.state_dict(), exported.state_dict()
        assert want.keys() == got.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda s: f"member {b} {k}: {s}")
    return fused


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("extra_dims", [(), (2,)])
def test_linear_matches_torch(bias, extra_dims):
    """FusedLinear gives each member nn.Linear's outputs, gradients and SGD trajectory, with or
    without bias and with extra middle dimensions."""
    models = _models(lambda: nn.Linear(6, 4, bias=bias))
    _check_against_torch(models, lambda: torch.randn(N, *extra_dims, 6))


def test_linear_shared_input_fast_path_matches_torch():
    """One input broadcast to all members (the stride-0 fast path) gives each member its own
    nn.Linear result and gradients."""
    models = _models(lambda: nn.Linear(6, 4))
    _check_against_torch(models, lambda: torch.randn(N, 6), shared=True)


def test_linear_rejects_wrong_shape():
    """FusedLinear names the expected [B, N, *, in_features] shape when given another."""
    with pytest.raises(ValueError, match=r"\[B=3, N, \*, 6\]"):
        FusedLinear(6, 4, B=3)(torch.randn(N, 6))


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Conv1d(4, 6, 3, padding=1), (4, 9)),
    (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1), (3, 8, 8)),
    (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2, padding_mode="reflect", bias=False), (4, 7, 7)),
    (lambda: nn.Conv2d(2, 4, 3, padding="same", dilation=2, padding_mode="circular"), (2, 6, 6)),
], ids=["conv1d", "conv2d-stride", "conv2d-groups-reflect", "conv2d-same-dilated-circular"])
def test_conv_matches_torch(make, shape):
    """FusedConv1d/2d (one grouped convolution over B groups) give each member the torch
    convolution's outputs, gradients and SGD trajectory for every padding mode and grouping."""
    _check_against_torch(_models(make), lambda: torch.randn(N, *shape), arrangement_in=IMAGE)


def test_conv_shared_input_fast_path_matches_torch():
    """One image batch broadcast to all members runs as one plain convolution with B*C_out
    channels and still gives each member its own result and gradients."""
    _check_against_torch(_models(lambda: nn.Conv2d(3, 4, 3)), lambda: torch.randn(N, 3, 6, 6),
                         arrangement_in=IMAGE, shared=True)


def test_conv_rejects_dense_input():
    """FusedConv2d names the [N, B, C, H, W] arrangement it expects."""
    with pytest.raises(ValueError, match=r"\[N, B=3, 3"):
        FusedConv2d(3, 4, 3, B=3)(torch.randn(3, N, 3, 6))


@pytest.mark.parametrize("make, shape, arrangement", [
    (lambda: nn.BatchNorm1d(4), (4,), DENSE),
    (lambda: nn.BatchNorm1d(4, momentum=None), (4,), DENSE),
    (lambda: nn.BatchNorm1d(4), (4, 6), IMAGE),
    (lambda: nn.BatchNorm2d(3), (3, 4, 4), IMAGE),
    (lambda: nn.BatchNorm2d(3, affine=False), (3, 4, 4), IMAGE),
    (lambda: nn.BatchNorm2d(3, track_running_stats=False), (3, 4, 4), IMAGE),
], ids=["bn1d-dense", "bn1d-cumulative", "bn1d-image", "bn2d", "bn2d-noaffine", "bn2d-nostats"])
def test_batchnorm_matches_torch_in_train_and_eval(make, shape, arrangement):
    """Fused BatchNorm keeps each member's own running statistics: after K training steps the
    exported statistics equal each torch module's, and eval-mode outputs agree too."""
    models = _models(make)
    with torch.no_grad():
        for m in models:  # distinct affine parameters so members really differ
            if m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    fused = _check_against_torch(models, lambda: torch.randn(N, *shape) * 2 + 1, arrangement_in=arrangement)
    fused.eval()
    for m in models:
        m.eval()
    xs = [torch.randn(N, *shape) for _ in range(B)]
    out = fused(stack(xs, arrangement))
    for b in range(B):
        torch.testing.assert_close(member(out, b, arrangement), models[b](xs[b]), **TOL)


def test_batchnorm_members_keep_separate_statistics():
    """Members fed different data end up with different running means (no sharing across B)."""
    bn = FusedBatchNorm2d(2, B=2)
    x = torch.stack([torch.zeros(4, 2, 3, 3), torch.full((4, 2, 3, 3), 10.0)], dim=1)
    bn(x)
    assert bn.running_mean[0].abs().max() == 0
    torch.testing.assert_close(bn.running_mean[1], torch.full((2,), 1.0))
    assert bn.num_batches_tracked.tolist() == [1, 1]


def test_batchnorm1d_rejects_unknown_shape():
    """FusedBatchNorm1d names both accepted arrangements when given another shape."""
    with pytest.raises(ValueError, match=r"\[B=2, N, 4\] or \[N, B=2, 4, L\]"):
        FusedBatchNorm1d(4, B=2)(torch.randn(N, 4))


@pytest.mark.parametrize("make, shape, arrangement", [
    (lambda: nn.LayerNorm(6), (6,), DENSE),
    (lambda: nn.LayerNorm(6, bias=False), (2, 6), DENSE),
    (lambda: nn.LayerNorm((4, 4)), (3, 4, 4), IMAGE),
], ids=["dense", "dense-nobias-extra-dim", "image-hw"])
def test_layernorm_matches_torch(make, shape, arrangement):
    """FusedLayerNorm applies each member's own affine parameters in both arrangements."""
    models = _models(make)
    with torch.no_grad():
        for m in models:
            m.weight.uniform_(0.5, 1.5)
            if m.bias is not None:
                m.bias.uniform_(-0.5, 0.5)
    fused = None
    if arrangement == IMAGE:  # a standalone LayerNorm cannot tell its arrangement: say it
        fused = FusedLayerNorm((4, 4), B=B, arrangement=IMAGE)
        for b, m in enumerate(models):
            fused.load_member(b, m)
    _check_against_torch(models, lambda: torch.randn(N, *shape), arrangement_in=arrangement, fused=fused)


def test_layernorm_in_image_model_is_converted_with_image_layout():
    """A LayerNorm after a convolution is converted for [N, B, C, H, W] input and trains like torch."""
    make = lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.LayerNorm((4, 4)), nn.ReLU())  # noqa: E731
    _check_against_torch(_models(make), lambda: torch.randn(N, 2, 6, 6), arrangement_in=IMAGE)


def test_embedding_matches_torch_with_padding_idx():
    """FusedEmbedding looks member b's ids up in member b's table and, like torch, never
    updates the padding row."""
    models = _models(lambda: nn.Embedding(7, 3, padding_idx=0))
    with torch.no_grad():
        for m in models:
            m.weight[0].uniform_(1, 2)  # a non-zero padding row must stay put too
    ids = lambda: torch.randint(0, 7, (N, 4))  # noqa: E731
    fused = _check_against_torch(models, ids, float_input=False)
    for b, m in enumerate(models):
        torch.testing.assert_close(fused.weight[b, 0], m.weight[0])


def test_embedding_scale_grad_by_freq_matches_torch():
    """scale_grad_by_freq counts each member's own ids, as B separate embeddings would."""
    models = _models(lambda: nn.Embedding(4, 2, scale_grad_by_freq=True))
    _check_against_torch(models, lambda: torch.randint(0, 4, (N, 3)), float_input=False)


def test_field_embedding_matches_project_module():
    """hmp.models.FieldEmbedding is fused too, so click_model-style sweeps work."""
    models = _models(lambda: FieldEmbedding(fields=3, buckets=10, dim=2))
    _check_against_torch(models, lambda: torch.randint(0, 10, (N, 3)), float_input=False)


@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a is not nn.Dropout], ids=lambda a: a.__name__)
def test_activations_match_torch(act):
    """Every supported elementwise activation gives each member torch's outputs and input gradients."""
    make = lambda: nn.Sequential(nn.Linear(4, 5), act())  # noqa: E731
    _check_against_torch(_models(make), lambda: torch.randn(N, 4), steps=2)


@pytest.mark.parametrize("pool", list(CHANNELWISE), ids=lambda t: t.__name__)
def test_channelwise_ops_match_torch(pool):
    """Pools (and Dropout1d/2d with p=0) see each member's channels as their own."""
    args = {nn.MaxPool1d: (2,), nn.MaxPool2d: (2,), nn.AvgPool1d: (3, 2, 1), nn.AvgPool2d: (3, 2, 1),
            nn.AdaptiveAvgPool1d: (3,), nn.AdaptiveAvgPool2d: ((2, 3),), nn.AdaptiveMaxPool1d: (3,),
            nn.AdaptiveMaxPool2d: (2,), nn.Dropout1d: (0.0,), nn.Dropout2d: (0.0,)}[pool]
    one_d = pool in (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d, nn.Dropout1d)
    conv = nn.Conv1d if one_d else nn.Conv2d
    shape = (2, 8) if one_d else (2, 6, 6)
    make = lambda: nn.Sequential(conv(2, 3, 1), pool(*args))  # noqa: E731
    _check_against_torch(_models(make), lambda: torch.randn(N, *shape), arrangement_in=IMAGE, steps=2)


def test_flatten_hands_image_over_to_dense():
    """A conv trunk, Flatten and a Linear head train exactly like the torch CNN."""
    make = lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 4))  # noqa: E731
    _check_against_torch(_models(make), lambda: torch.randn(N, 2, 6, 6), arrangement_in=IMAGE, arrangement_out=DENSE)


@pytest.mark.parametrize("dim", [-1, 1])
@pytest.mark.parametrize("kind", [nn.Softmax, nn.LogSoftmax])
def test_softmax_dims_map_to_member_dims(kind, dim):
    """Softmax/LogSoftmax over a member's dim d act on the same dim of each member."""
    make = lambda: nn.Sequential(nn.Linear(4, 5), kind(dim=dim))  # noqa: E731
    _check_against_torch(_models(make), lambda: torch.randn(N, 4))


def test_dropout_masks_members_independently_and_is_identity_in_eval():
    """Fused Dropout zeroes about p of each member's activations and scales the rest by
    1/(1-p) in training, and is the identity in eval mode."""
    torch.manual_seed(0)
    fused = fuse_models([nn.Sequential(nn.Dropout(0.5)) for _ in range(B)])
    x = torch.ones(B, 4000, 2)
    y = fused(x)
    for b in range(B):
        zero_fraction = (y[b] == 0).float().mean().item()
        assert 0.45 < zero_fraction < 0.55
        assert set(y[b].unique().tolist()) == {0.0, 2.0}
    assert not torch.equal(y[0], y[1])  # members do not share one mask
    fused.eval()
    assert torch.equal(fused(x), x)


def test_dropout2d_drops_whole_member_channels():
    """Fused Dropout2d drops entire channels of one member, never part of one."""
    torch.manual_seed(0)
    fused = fuse_models([nn.Sequential(nn.Conv2d(1, 8, 1), nn.Dropout2d(0.5)) for _ in range(B)])
    with torch.no_grad():
        fused[0].weight.fill_(1.0)
        fused[0].bias.zero_()
        y = fused(broadcast(torch.ones(4, 1, 3, 3), B, IMAGE))
    per_channel = y.flatten(3)  # [N, B, C, H*W]
    dropped = (per_channel == 0).all(-1)
    kept = (per_channel == 2.0).all(-1)
    assert bool((dropped | kept).all())
    assert 0.3 < dropped.float().mean().item() < 0.7


def test_member_export_round_trip_and_no_rng_draw():
    """load_member then export_member returns member b's exact weights, and exporting does not
    advance the global RNG (exporting mid-run must not change later dropout masks)."""
    models = _models(lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(),
                                           nn.Linear(12, 2), nn.LayerNorm(2)))
    fused = fuse_models(models)
    state = torch.get_rng_state()
    exported = [fused.export_member(b) for b in range(B)]
    assert torch.equal(torch.get_rng_state(), state)
    for m, e in zip(models, exported):
        for (k, v), (k2, v2) in zip(m.state_dict().items(), e.state_dict().items()):
            assert k == k2 and torch.equal(v, v2)
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        fused.export_member(3)


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.0), nn.ReLU(), nn.Linear(6, 3)),
    lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Dropout(0.0), nn.Dropout2d(0.0), nn.Flatten(), nn.Linear(48, 2)),
], ids=["dense", "image"])
def test_dropout_p0_trains_exactly_like_torch(make):
    """Dropout(p=0) (and Dropout2d) in training mode is the identity in both worlds: outputs,
    gradients and K SGD steps match the torch members exactly."""
    models = _models(make)
    image = isinstance(models[0][0], nn.Conv2d)
    shape = (2, 6, 6) if image else (4,)
    _check_against_torch(models, lambda: torch.randn(N, *shape), arrangement_in=IMAGE if image else DENSE,
                         arrangement_out=DENSE)


def test_dropout_in_eval_mode_matches_torch_eval():
    """With p=0.5 in eval mode every member's output equals its torch model's (no masking)."""
    models = _models(lambda: nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 3)))
    fused = fuse_models(copy.deepcopy(models)).eval()
    x = torch.randn(N, 4)
    out = fused(broadcast(x, B, DENSE))
    for b, m in enumerate(models):
        torch.testing.assert_close(out[b], m.eval()(x), **TOL)


@pytest.mark.parametrize("p", [0.2, 0.7])
def test_dropout_training_mask_rate_and_gradient_per_member(p):
    """In training, each member drops about p of its own activations (its own mask), scales the
    rest by 1/(1-p), and back-propagates through exactly the mask it used forward."""
    torch.manual_seed(1)
    Bm, n = 4, 3000
    fused = fuse_models([nn.Sequential(nn.Dropout(p)) for _ in range(Bm)])
    x = torch.ones(Bm, n, 4, requires_grad=True)
    y = fused(x)
    y.sum().backward()
    for b in range(Bm):
        dropped = y[b] == 0
        rate = dropped.float().mean().item()
        assert abs(rate - p) < 4 * (p * (1 - p) / (n * 4)) ** 0.5 + 1e-3, (b, rate)
        torch.testing.assert_close(y[b][~dropped], torch.full_like(y[b][~dropped], 1 / (1 - p)))
        torch.testing.assert_close(x.grad[b], (~dropped).float() / (1 - p))
    masks = [(y[b] == 0) for b in range(Bm)]
    assert all(not torch.equal(masks[0], masks[b]) for b in range(1, Bm))


def test_dropout_members_must_share_p():
    """Parameter-free ops are configured alike in every member: a member with another p is refused."""
    fused = fuse_models([nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)) for _ in range(2)])
    with pytest.raises(ValueError, match=r"member 1 .*Dropout\(p=0\.3.*expected Dropout\(p=0\.5"):
        fused.load_member(1, nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.3)))


@pytest.mark.parametrize("extra_dims", [(), (2,)], ids=["features-first-chain", "extra-dim-fallback"])
def test_linear_chain_with_softmax_and_activations_matches_torch(extra_dims):
    """A chain of Linear layers and activations (run features-first inside FusedSequential),
    and the per-layer path taken for inputs with extra dims, both match torch; a Softmax inside
    the chain splits it (it is not elementwise)."""
    make = lambda: nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 6), nn.Softmax(dim=-1),  # noqa: E731
                                 nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    _check_against_torch(_models(make), lambda: torch.randn(N, *extra_dims, 5))


def test_linear_chain_rejects_wrong_shape_with_the_layer_message():
    """The features-first chain reports a bad input like FusedLinear does."""
    fused = fuse_models([nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)) for _ in range(B)])
    with pytest.raises(ValueError, match=r"\[B=3, N, \*, 6\]"):
        fused(torch.randn(B, N, 5))


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
def test_device_argument_places_fused_model_and_members(device):
    """fuse_models(device=...) / the operators' device= put every parameter and buffer there,
    outputs match the torch members computed on the same device, and exported members come
    back on it (CPU here; the same code runs on CUDA where one is present)."""
    models = _models(lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
                                           nn.Flatten(), nn.Linear(12, 4), nn.LayerNorm(4)))
    fused = fuse_models(copy.deepcopy(models), device=device)
    assert all(t.device.type == device for t in list(fused.parameters()) + list(fused.buffers()))
    x = torch.randn(N, 2, 6, 6)
    out = fused(broadcast(x.to(device), B, IMAGE))
    for b, m in enumerate(models):
        torch.testing.assert_close(out[b].cpu(), m(x), **TOL)
        assert all(p.device.type == device for p in fused.export_member(b).parameters())
    lin = FusedLinear(3, 2, B=2, device=device, dtype=torch.float64)
    assert lin.weight.device.type == device and lin.weight.dtype == torch.float64
    assert lin.export_member(1).weight.dtype == torch.float64
