"""The fast paths of fused training: the hand-differentiated Linear/activation chain (as an
autograd node and as FusedArray's autograd-free step), the flat-buffer optimizer update and the
hand-written cross-entropy gradient. Each is checked against the plain path it replaces and
against B separately trained torch models."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hmp.hfta import FusedArray, FusedSGD, fuse
from hmp.hfta import flat
from hmp.hfta.chain import chain_params, chain_steps, linear_chain
from hmp.hfta.loss import cross_entropy_and_grad, fused_cross_entropy

TOL = dict(rtol=1e-4, atol=1e-5)

ACTS = {
    "relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
    "leaky": lambda: nn.LeakyReLU(0.2), "identity": nn.Identity,
}


def mlp(act: str, bias: bool = True) -> nn.Sequential:
    a = ACTS[act]
    return nn.Sequential(nn.Linear(6, 9, bias=bias), a(), nn.Linear(9, 5, bias=bias), a(),
                         nn.Linear(5, 3, bias=bias))


def batches(k=5, n=11, features=6, classes=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(k)]


def train_serial(factory, settings, data, seed=0):
    torch.manual_seed(seed)
    models = [factory() for _ in settings]
    for m, s in zip(models, settings):
        opt = torch.optim.SGD(m.parameters(), **s)
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    return models


def assert_members_equal(array, models):
    for b, m in enumerate(models):
        got = array.export_member(b).state_dict()
        for k, want in m.state_dict().items():
            torch.testing.assert_close(got[k], want, **TOL, msg=lambda s: f"member {b} {k}: {s}")


SETTINGS = [dict(lr=0.1, momentum=0.9), dict(lr=0.05, weight_decay=1e-2),
            dict(lr=0.2, momentum=0.5, dampening=0.1), dict(lr=0.3, momentum=0.8)]


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("bias", [True, False])
def test_direct_step_trains_each_member_like_torch(act, bias):
    """FusedArray.step on an MLP takes the autograd-free path and ends where B torch models
    trained one by one end, for every supported activation, with and without bias."""
    factory = lambda: mlp(act, bias)  # noqa: E731
    data = batches()
    models = train_serial(factory, SETTINGS, data)
    torch.manual_seed(0)
    array = FusedArray(factory, SETTINGS)
    x0 = data[0][0]
    assert array._direct_steps(x0) is not None, "the MLP must take the direct path"
    for x, y in data:
        array.step(x, y)
    # the gradients were written into the array's flat gradient buffer (no autograd copy)
    lo = array._grads.data_ptr()
    hi = lo + array._grads.numel() * array._grads.element_size()
    assert all(lo <= p.grad.data_ptr() < hi for p in array.model.parameters())
    assert_members_equal(array, models)


def test_direct_and_autograd_paths_agree_step_by_step():
    """The same array state stepped by the direct path and by autograd (forced by a hook that
    does nothing) gives the same losses and parameters."""
    data = batches(k=4)
    torch.manual_seed(1)
    a = FusedArray(lambda: mlp("tanh"), SETTINGS)
    torch.manual_seed(1)
    b = FusedArray(lambda: mlp("tanh"), SETTINGS)
    b.model[0].register_forward_hook(lambda *args: None)
    assert a._direct_steps(data[0][0]) is not None and b._direct_steps(data[0][0]) is None
    for x, y in data:
        torch.testing.assert_close(a.step(x, y), b.step(x, y), **TOL)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(pa, pb, **TOL)


def test_unsupported_activation_or_training_dropout_falls_back_to_autograd():
    """GELU (derivative needs the input) and Dropout in training mode are not chained; the
    array still trains them through autograd. Dropout in eval mode is the identity."""
    gelu = lambda: nn.Sequential(nn.Linear(6, 4), nn.GELU(), nn.Linear(4, 3))  # noqa: E731
    array = FusedArray(gelu, SETTINGS[:2])
    x, y = batches(k=1)[0]
    assert array._direct_steps(x) is None
    models = train_serial(gelu, SETTINGS[:2], [(x, y)])
    torch.manual_seed(0)
    array = FusedArray(gelu, SETTINGS[:2])
    array.step(x, y)
    assert_members_equal(array, models)

    fused = fuse(lambda: nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.5), nn.Linear(4, 3)), 2)
    run = list(fused)
    assert chain_steps(run) is None
    fused.eval()
    assert [k for k, _ in chain_steps(run)] == ["linear", "linear"]


@pytest.mark.parametrize("act", ["relu", "tanh", "sigmoid", "leaky"])
def test_linear_chain_gradcheck(act):
    """The chain's hand-written backward, as an autograd node, passes gradcheck (float64),
    input gradient included."""
    fused = fuse(lambda: mlp(act).double(), 3)
    run = list(fused)
    steps = chain_steps(run)
    params = [p.detach().clone().requires_grad_() for p in chain_params(run)]
    x = torch.randn(3, 6, 4, dtype=torch.float64, requires_grad=True)  # [B, in, N]
    # an input that is not an activation's own output: relu's kink is not at a sample point
    assert torch.autograd.gradcheck(lambda x, *ps: linear_chain(x, steps, ps), (x, *params))


def test_chain_inside_a_model_matches_per_op_autograd():
    """FusedSequential's chained forward/backward gives what per-op autograd gives, for an
    input that requires grad (the chain then returns the input's gradient too)."""
    fused = fuse(lambda: mlp("leaky"), 2)
    x = torch.randn(2, 7, 6, requires_grad=True)
    fused(x).square().sum().backward()
    chained = [p.grad.clone() for p in fused.parameters()] + [x.grad.clone()]
    for p in fused.parameters():
        p.grad = None
    x.grad = None
    import hmp.hfta.convert as convert

    original = convert.chain_steps
    convert.chain_steps = lambda run: None  # force the per-op path
    try:
        fused(x).square().sum().backward()
    finally:
        convert.chain_steps = original
    plain = [p.grad for p in fused.parameters()] + [x.grad]
    for a, b in zip(chained, plain):
        torch.testing.assert_close(a, b, **TOL)


def test_cross_entropy_and_grad_matches_autograd_and_rejects_bad_labels():
    for target_shape in [(6,), (4, 6)]:
        logits = torch.randn(4, 5, 6).transpose(1, 2).requires_grad_()  # [B, N, C], C=5
        y = torch.randint(0, 5, target_shape)
        fused_cross_entropy(logits, y).sum().backward()
        losses, grad = cross_entropy_and_grad(logits, y)
        torch.testing.assert_close(losses, fused_cross_entropy(logits, y).detach())
        torch.testing.assert_close(grad, logits.grad)
    with pytest.raises(ValueError, match=r"class indices must lie in \[0, 5\)"):
        cross_entropy_and_grad(torch.randn(2, 3, 5), torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="class indices"):
        cross_entropy_and_grad(torch.randn(2, 3, 5), torch.tensor([0, -1, 1]))
    with pytest.raises(TypeError, match="int64"):
        cross_entropy_and_grad(torch.randn(2, 3, 5), torch.tensor([0.0, 1.0, 1.0]))


def test_span_finds_back_to_back_tensors_only():
    buffer, views = flat.allocate_like([torch.empty(2, 3), torch.empty(2, 4)])
    s = flat.span(views)
    assert s is not None and s.numel() == 14
    s.fill_(2.0)
    assert all(bool((v == 2).all()) for v in views)  # a view, not a copy
    assert flat.span([views[1], views[0]]) is None  # out of order
    assert flat.span([torch.empty(2, 3), torch.empty(2, 4)]) is None  # separate storages
    assert flat.span([views[0].t()]) is None  # not contiguous
    v = flat.member_vector([1.0, 5.0], views)
    assert v.tolist() == [1.0] * 3 + [5.0] * 3 + [1.0] * 4 + [5.0] * 4


def _sgd_pair(settings, B=3):
    """Two FusedSGDs over equal parameter values: one flat (a shared buffer), one apart."""
    torch.manual_seed(5)
    shapes = [(B, 4, 3), (B, 4), (B, 2, 4)]
    values = [torch.randn(s) for s in shapes]
    _, views = flat.allocate_like(values)
    flat_params = [nn.Parameter(v) for v in views]
    with torch.no_grad():
        for p, v in zip(flat_params, values):
            p.copy_(v)
    apart = [nn.Parameter(v.clone()) for v in values]
    per_member = {k: [s[k] for s in settings] for k in settings[0]}
    return (FusedSGD(flat_params, **per_member), flat_params), (FusedSGD(apart, **per_member), apart)


@pytest.mark.parametrize("settings", [
    [dict(lr=0.1, momentum=0.9)] * 3,
    [dict(lr=0.1, momentum=0.9, weight_decay=0.0), dict(lr=0.01, momentum=0.5, weight_decay=0.1),
     dict(lr=0.3, momentum=0.0, weight_decay=0.0)],
    [dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.2, momentum=0.5, nesterov=True),
     dict(lr=0.05, momentum=0.1, nesterov=True)],
])
def test_flat_optimizer_update_equals_per_tensor_update(settings):
    (fo, fp), (ao, ap) = _sgd_pair(settings)
    g = torch.Generator().manual_seed(9)
    for _ in range(4):
        _, grad_views = flat.allocate_like(fp)
        for pf, pa, gv in zip(fp, ap, grad_views):
            gv.copy_(torch.randn(pf.shape, generator=g))
            pf.grad, pa.grad = gv, gv.clone()
        with torch.no_grad():
            fo.update()
            ao.update()
        assert fo._flat_cache[id(fo.param_groups[0])][1] is not None, "flat path not taken"
        assert ao._flat_cache.get(id(ao.param_groups[0]), (None, None))[1] is None
    for a, b in zip(fp, ap):
        torch.testing.assert_close(a, b, **TOL)
    # the momentum state is per parameter (views into one buffer) and loads into either
    state = fo.state_dict()  # holds the live buffers: each optimizer loads its own copy
    ao.load_state_dict(copy.deepcopy(state))
    fo.load_state_dict(copy.deepcopy(state))
    for pa in ap:
        pa.grad = torch.ones_like(pa)
    _, grad_views = flat.allocate_like(fp)
    for pf, gv in zip(fp, grad_views):
        gv.fill_(1.0)
        pf.grad = gv
    fo.step()
    ao.step()
    assert fo._flat_cache[id(fo.param_groups[0])][1] is not None, "loaded buffers not regathered"
    for a, b in zip(fp, ap):
        torch.testing.assert_close(a, b, **TOL)


def test_update_runs_step_hooks_when_registered():
    """``update`` skips torch's step wrapper only while no step hook is registered."""
    (fo, fp), _ = _sgd_pair([dict(lr=0.1, momentum=0.0)] * 3)
    calls = []
    fo.register_step_post_hook(lambda *args: calls.append(1))
    for p in fp:
        p.grad = torch.ones_like(p)
    with torch.no_grad():
        fo.update()
    assert calls == [1]


# --- regressions found in review -------------------------------------------------------------

def _grads_both_ways(factory, x, B=2, loss=lambda y: y.square().sum()):
    """Parameter (and input) gradients of one fused model with the hand-written chain and with
    per-op autograd (``hand_backward = False``)."""
    torch.manual_seed(0)
    fused = fuse(factory, B)
    out = []
    for hand in (True, False):
        fused.hand_backward = hand
        xi = x.detach().clone().requires_grad_(x.requires_grad)
        for p in fused.parameters():
            p.grad = None
        loss(fused(xi)).backward()
        out.append([p.grad.clone() for p in fused.parameters()] + ([xi.grad] if x.requires_grad else []))
    return out


@pytest.mark.parametrize("middle", [
    [nn.Tanh(), nn.Sigmoid()], [nn.LeakyReLU(0.1), nn.Sigmoid()], [nn.Tanh(), nn.Dropout(0.0), nn.Tanh()],
    [nn.Sigmoid(), nn.Identity(), nn.ReLU()],
])
def test_two_activations_in_a_row_keep_their_saved_outputs(middle):
    """The second of two activations must not overwrite the first one's output in place (its
    backward reads it)."""
    import copy as _copy

    factory = lambda: nn.Sequential(nn.Linear(5, 6), *_copy.deepcopy(middle), nn.Linear(6, 3))  # noqa: E731
    hand, plain = _grads_both_ways(factory, torch.randn(2, 4, 5, requires_grad=True))
    for a, b in zip(hand, plain):
        torch.testing.assert_close(a, b, **TOL)
    # and FusedArray's direct path trains it like torch
    data = batches(k=3, features=5)
    models = train_serial(factory, SETTINGS[:2], data)
    torch.manual_seed(0)
    array = FusedArray(factory, SETTINGS[:2])
    assert array._direct_steps(data[0][0]) is not None
    for x, y in data:
        array.step(x, y)
    assert_members_equal(array, models)


def test_modifying_the_chain_output_in_place_is_caught_like_torch():
    """A run that ends with an activation returns the tensor its backward reads: modifying it in
    place must raise autograd's error, not give wrong gradients."""
    fused = fuse(lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3), nn.Tanh()), 2)
    y = fused(torch.randn(2, 6, 4))
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_hooks_on_a_runs_children_still_fire_and_autocast_still_works():
    fused = fuse(lambda: mlp("relu"), 2)
    calls = []
    fused[1].register_forward_hook(lambda *args: calls.append(1))
    fused(torch.randn(2, 3, 6)).sum().backward()
    assert calls == [1]

    fused = fuse(lambda: mlp("tanh"), 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused(torch.randn(2, 3, 6))
    y.float().sum().backward()
    assert all(p.grad is not None for p in fused.parameters())
    array = FusedArray(lambda: mlp("tanh"), SETTINGS[:2])
    x, y = batches(k=1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert array._direct_steps(x) is None
        losses = array.step(x, y)
    assert torch.isfinite(losses).all()


def test_torch_func_and_double_backward_have_a_way_through():
    """Inside torch.func transforms the chain steps aside (per-op autograd); double backward
    needs ``hand_backward = False`` and then works."""
    fused = fuse(lambda: mlp("tanh"), 2)
    params = dict(fused.named_parameters())
    x = torch.randn(2, 3, 6)
    grads = torch.func.grad(lambda p: torch.func.functional_call(fused, p, (x,)).sum())(params)
    fused(x).sum().backward()  # the hand-written chain, outside any transform
    for name, p in fused.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)

    fused.hand_backward = False
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fused(xg).square().sum(), xg, create_graph=True)
    g.square().sum().backward()  # a gradient penalty
    assert all(p.grad is not None for p in fused.parameters())


def test_update_goes_through_a_patched_or_overridden_step():
    array = FusedArray(lambda: mlp("relu"), SETTINGS[:2])
    calls = []
    original = array.optimizer.step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    array.optimizer.step = counting_step
    x, y = batches(k=1)[0]
    array.step(x, y)
    assert calls == [1]


def test_flat_update_bumps_every_parameters_version():
    """Autograd must see every parameter as modified after a flat update (a backward through a
    graph built before the update then fails, as with torch's optimizers)."""
    array = FusedArray(lambda: mlp("relu"), SETTINGS[:2])
    x, y = batches(k=1)[0]
    array.step(x, y)  # gradients now in the flat gradient buffer
    before = [p._version for p in array._params]
    with torch.no_grad():
        array.optimizer.update()
    assert array.optimizer._flat_cache[id(array.optimizer.param_groups[0])][1] is not None
    assert all(p._version > v for p, v in zip(array._params, before))
