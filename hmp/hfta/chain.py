"""A run of fused Linear layers and activations as one autograd node with a hand-written backward.

Through autograd a small fused MLP pays more for per-op bookkeeping and operand copies than for
its batched matmuls, so ``linear_chain`` runs a whole ``Linear, ReLU, ...`` run of
``FusedSequential`` as one ``torch.autograd.Function`` whose backward is two batched matmuls and a
sum per layer. Only activations whose derivative follows from their output are supported
(``chain_steps`` returns ``None`` otherwise and the caller falls back to autograd). See
docs/hfta.md, "The fused MLP's fast path".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as _torch_module

from .elementwise import FusedElementwise
from .linear import FusedLinear

LINEAR = "linear"
# activation kinds, each with an in-place forward and a backward from the output
RELU, LEAKY, TANH, SIGMOID = "relu", "leaky", "tanh", "sigmoid"

Step = tuple  # (LINEAR, has_bias) or (kind, slope)


def chain_steps(run: Sequence[nn.Module]) -> list[Step] | None:
    """The run as steps ``linear_chain`` understands, or ``None`` if any op is unsupported.

    Identity ops (``nn.Identity``, Dropout in eval mode or with ``p = 0``) are dropped.
    Depends on the modules' training mode (Dropout), so call it per forward.
    """
    steps: list[Step] = []
    for m in run:
        if isinstance(m, FusedLinear):
            steps.append((LINEAR, m.bias is not None))
            continue
        if type(m) is not FusedElementwise:
            return None
        fn = m.fn
        t = type(fn)
        if t is nn.ReLU:
            steps.append((RELU, 0.0))
        elif t is nn.LeakyReLU and fn.negative_slope > 0:
            steps.append((LEAKY, float(fn.negative_slope)))
        elif t is nn.Tanh:
            steps.append((TANH, 0.0))
        elif t is nn.Sigmoid:
            steps.append((SIGMOID, 0.0))
        elif t is nn.Identity or (t is nn.Dropout and (not fn.training or fn.p == 0)):
            continue
        else:
            return None
    return steps


def hooks_registered(modules: Sequence[nn.Module], params: Sequence[torch.Tensor] = ()) -> bool:
    """Whether a module hook (on any of ``modules``, or global) or a tensor hook on ``params``
    is set: ``Module.__call__`` and autograd would run it, the hand-written path would not."""
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks"):
        if getattr(_torch_module, name, None):
            return True
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return any(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None) for p in params)


def hand_backward_allowed(x: torch.Tensor, modules: Sequence[nn.Module],
                          params: Sequence[torch.Tensor] = ()) -> bool:
    """Whether the hand-written path may run on input ``x``: not under autocast (the backward
    would mix the autocast dtype with the float32 weights), not inside a ``torch.func``
    transform (the Function has no ``setup_context``/vmap rule), and no hook on ``modules``
    (every module the path replaces, submodules included) or ``params`` (they would be skipped)."""
    if torch.is_autocast_enabled(x.device.type):
        return False
    are_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if are_transforms_active is not None and are_transforms_active():
        return False
    return not hooks_registered(modules, params)


def chain_params(run: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The run's parameters in the order ``linear_chain`` takes them: weight, then bias if
    any, per Linear."""
    params: list[torch.Tensor] = []
    for m in run:
        if isinstance(m, FusedLinear):
            params.append(m.weight)
            if m.bias is not None:
                params.append(m.bias)
    return params


def _activate_(h: torch.Tensor, kind: str, slope: float, inplace: bool) -> torch.Tensor:
    if kind == RELU:
        return h.relu_() if inplace else torch.relu(h)
    if kind == LEAKY:
        return torch.nn.functional.leaky_relu(h, slope, inplace=inplace)
    if kind == TANH:
        return h.tanh_() if inplace else torch.tanh(h)
    return h.sigmoid_() if inplace else torch.sigmoid(h)


def _activation_backward(g: torch.Tensor, y: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """The gradient through an activation, from its output ``y``."""
    if kind == RELU:
        return torch.ops.aten.threshold_backward(g, y, 0)
    if kind == LEAKY:  # slope > 0: y has x's sign
        return torch.ops.aten.leaky_relu_backward(g, y, slope, True)
    if kind == TANH:
        return torch.ops.aten.tanh_backward(g, y)
    return torch.ops.aten.sigmoid_backward(g, y)


def chain_forward(x: torch.Tensor, steps: Sequence[Step], params: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The run on features-first ``x [B, in, N]`` without autograd: ``(out [B, out, N], saved)``,
    ``saved`` holding per step what ``chain_backward`` needs (a Linear's input, an activation's
    output). Activations write in place into tensors made here (never into ``x``)."""
    saved: list[torch.Tensor] = []
    h, fresh, i = x, False, 0  # fresh: h is a Linear's new output, so an activation may overwrite it
    for kind, arg in steps:
        if kind == LINEAR:
            saved.append(h)
            w = params[i]
            if arg:
                h = torch.baddbmm(params[i + 1].unsqueeze(-1), w, h)
                i += 2
            else:
                h = torch.bmm(w, h)
                i += 1
        else:
            h = _activate_(h, kind, arg, inplace=fresh)
            saved.append(h)
        # Only a Linear's output may be overwritten in place: an activation's output is saved
        # for its own backward, so a second activation in a row must not write over it.
        fresh = kind == LINEAR
    return h, saved


def chain_backward(g: torch.Tensor, steps: Sequence[Step], params: Sequence[torch.Tensor],
                   saved: Sequence[torch.Tensor], need_input: bool,
                   need_param: Sequence[bool] | None = None,
                   out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor | None, list]:
    """Gradients of the run from the output's gradient ``g [B, out, N]``, without autograd.

    Returns ``(input gradient or None, parameter gradients in params' order)``. Per Linear
    (last to first): the weight gradient ``g h^T`` (``[B, out, in]``, the weight's own memory layout),
    the bias gradient ``g`` summed over samples, and ``W^T g`` for the layer below, skipped
    for the run's input unless ``need_input``. ``need_param[j]`` False skips parameter j.
    ``out[j]``, when given, is where parameter j's gradient is written (say, a view into a
    flat gradient buffer), saving the allocation and a later copy.
    """
    grads: list[torch.Tensor | None] = [None] * len(params)
    i = len(params)
    for s in range(len(steps) - 1, -1, -1):
        kind, arg = steps[s]
        if kind != LINEAR:
            g = _activation_backward(g, saved[s], kind, arg)
            continue
        h = saved[s]
        if arg:
            i -= 2
            if need_param is None or need_param[i + 1]:
                grads[i + 1] = g.sum(2) if out is None else torch.sum(g, 2, out=out[i + 1])
        else:
            i -= 1
        w = params[i]
        if need_param is None or need_param[i]:
            ht = h.transpose(1, 2)
            grads[i] = torch.bmm(g, ht) if out is None else torch.bmm(g, ht, out=out[i])
        if s == 0 and not need_input:
            return None, grads
        g = torch.bmm(w.transpose(1, 2), g)
    return g, grads


class _LinearChain(torch.autograd.Function):
    """``chain_forward``/``chain_backward`` as one autograd node (see the module doc)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, steps: list[Step], *params: torch.Tensor) -> torch.Tensor:
        h, saved = chain_forward(x, steps, params)
        ctx.steps = steps
        ctx.ends_with_activation = steps[-1][0] != LINEAR
        # Intermediates are never handed out, so nobody else can modify them; the inputs and,
        # when the run ends with an activation (whose backward reads it), the output are what
        # the caller holds: save_for_backward makes autograd check they were not modified.
        ctx.saved = saved[:-1] if ctx.ends_with_activation else saved
        ctx.save_for_backward(x, *params, *([h] if ctx.ends_with_activation else []))
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        _, *params = ctx.saved_tensors
        saved = ctx.saved  # kept: backward may run again (retain_graph=True)
        if ctx.ends_with_activation:
            saved = [*saved, params.pop()]
        need_input = ctx.needs_input_grad[0]
        gx, grads = chain_backward(g, ctx.steps, params, saved, need_input,
                                   need_param=ctx.needs_input_grad[2:])
        return (gx, None, *grads)


def linear_chain(x: torch.Tensor, steps: list[Step], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The run on features-first ``x [B, in, N]``, as one autograd node; ``[B, out, N]``."""
    return _LinearChain.apply(x, steps, *params)
