"""``FusedArray``: a hyper-parameter sweep of B classifiers trained as one fused model.

This is what a sweep worker drives: build it from a model factory and one settings dict per
member, call ``step(x, y)`` per batch (one batch shared by every member), read per-member
losses and accuracies, and export any member as an ordinary ``torch.nn`` model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from hmp.flat import FlatLayout

from . import arrangement as L
from .base import FusedModule
from .chain import chain_backward, chain_forward, chain_steps, hand_backward_allowed
from .convert import FusedSequential, fuse
from .linear import FusedLinear
from .loss import cross_entropy_and_grad
from .optim import _FusedOptimizer, make_optimizer


class FusedArray:
    """B copies of ``factory()`` trained at once, member b with hyper-parameters ``settings[b]``.

    ``settings[b]`` holds optimizer keys named as in torch (``lr``, ``momentum``,
    ``dampening``, ``weight_decay``, ``nesterov`` for ``"sgd"``; ``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``amsgrad`` for ``"adam"``/``"adamw"``); a missing key takes torch's
    default. Member b starts from the b-th model ``factory()`` returns.

    ``model`` is the fused ``nn.Module``: every parameter is an ordinary ``nn.Parameter`` of
    shape ``[B, *member_shape]`` under the unfused model's name (``"0.weight"``), which a
    parameter server may hold and overwrite in place between steps. ``optimizer`` is the
    fused optimizer over ``model.parameters()``.
    """

    def __init__(self, factory: Callable[[], nn.Module], settings: Sequence[dict],
                 optimizer: str = "sgd", device: str | torch.device = "cpu") -> None:
        settings = [dict(s) for s in settings]
        if not settings:
            raise ValueError("settings must hold one dict per member, got an empty list")
        self.B = len(settings)
        self.settings = settings
        self.device = torch.device(device)
        self.model: FusedModule = fuse(factory, self.B, device=self.device)
        self._params = list(self.model.parameters())
        # Parameters and gradients each back to back in one buffer per dtype (what a parameter
        # server's FlatLayout.bind does; a one-time copy at build), so the fused optimizer updates
        # them all with one kernel per term (flat.py) and the direct step writes gradients there.
        buffers = FlatLayout.from_model(self.model).bind(self.model)
        self._grads = next(iter(buffers.grads.values())) if len(buffers.grads) == 1 else None
        self._grad_views: list[torch.Tensor] | None = (
            [p.grad for p in self._params] if all(p.grad is not None for p in self._params) else None)
        self.optimizer: _FusedOptimizer = make_optimizer(optimizer, self._params, settings)
        self._chain = self._whole_model_chain()
        self._modules = list(self.model.modules())  # for the hook check of every direct step

    def fused_input(self, x: torch.Tensor) -> torch.Tensor:
        """A batch ``[N, *]`` shared by all members, as the fused model's input (no copy)."""
        return L.broadcast(x.to(self.device, non_blocking=True), self.B, self.model.in_arrangement)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output for a shared batch ``x [N, *]``, as ``[B, N, classes]``."""
        return L.member_major(self.model(self.fused_input(x)), self.model.out_arrangement)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step of every member on the shared batch ``x [N, *]``, labels ``y [N]``
        (int64 class indices; ``[B, N]`` gives each member its own labels).

        Returns the per-member mean cross-entropy ``[B]`` before the update (detached).
        """
        if not self.model.training:  # Module.train() walks every submodule: skip when set
            self.model.train()
        y = y.to(self.device, non_blocking=True)
        steps = self._direct_steps(x)
        if steps is not None:
            return self._step_direct(x, y, steps)
        for p in self._params:  # what zero_grad(set_to_none=True) does, without its overhead
            p.grad = None
        logits = self.logits(x)
        # The loss's gradient by hand (softmax - onehot, over N): the gradient of the *sum* of
        # the members' losses, so member b's gradient is exactly its own loss's gradient, with
        # no autograd graph for the loss itself (loss.cross_entropy_and_grad).
        losses, grad = cross_entropy_and_grad(logits, y)
        logits.backward(grad)
        with torch.no_grad():
            self.optimizer.update()
        return losses

    def _whole_model_chain(self) -> list[FusedModule] | None:
        """The model's children when the whole model is one Linear/activation run (an MLP) that
        reads a dense input, else None (see ``_direct_steps``)."""
        m = self.model
        if not isinstance(m, FusedSequential) or m.in_arrangement != L.DENSE:
            return None
        runs = m._runs()
        if len(runs) != 1 or not runs[0][0]:
            return None
        return runs[0][1]

    def _direct_steps(self, x: torch.Tensor) -> list | None:
        """The chain's steps when ``step`` may train without autograd (``_step_direct``): the
        model is one Linear/activation run whose activations ``chain.py`` differentiates, the
        input is ``[N, in_features]``, every parameter is trained and no hook is registered
        (autograd would run hooks; the direct path has none to run)."""
        if self._chain is None or x.dim() != 2 or self._grad_views is None:
            return None
        steps = chain_steps(self._chain)  # per step: Dropout's mode may have changed
        first = self._chain[0]
        if steps is None or not isinstance(first, FusedLinear) or x.shape[1] != first.in_features:
            return None
        if not all(p.requires_grad for p in self._params) or not self.model.hand_backward:
            return None
        if not hand_backward_allowed(x, self._modules, self._params):
            return None
        return steps

    def _step_direct(self, x: torch.Tensor, y: torch.Tensor, steps: list) -> torch.Tensor:
        """``step`` for a fused MLP, by hand: ``chain_forward``, the loss's gradient
        (``cross_entropy_and_grad``), ``chain_backward`` writing each parameter's gradient
        straight into the flat gradient buffer, the optimizer. The same arithmetic as the
        autograd path (tests compare both with B separate torch models); what it saves is
        autograd's graph, engine and gradient accumulation, which for a small MLP cost more
        than the batched matmuls (docs/hfta.md)."""
        with torch.no_grad():
            xt = x.to(self.device, non_blocking=True).t().unsqueeze(0).expand(self.B, -1, -1)
            params = self._params
            out, saved = chain_forward(xt, steps, params)  # [B, classes, N]
            losses, grad = cross_entropy_and_grad(out.transpose(1, 2), y)
            chain_backward(grad.transpose(1, 2), steps, params, saved, need_input=False,
                           out=self._grad_views)
            for p, g in zip(params, self._grad_views):
                p.grad = g
            self.optimizer.update()
        return losses

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> list[float]:
        """Per-member accuracy (fraction in [0, 1]) on ``x [N, *]`` with labels ``y [N]``, in
        eval mode (BatchNorm uses each member's running statistics); the mode is restored."""
        was_training = self.model.training
        self.model.eval()
        try:
            pred = self.logits(x).argmax(-1)
        finally:
            self.model.train(was_training)
        correct = (pred == y.to(self.device).unsqueeze(0)).float().mean(1)
        return correct.tolist()

    def export_member(self, b: int) -> nn.Module:
        """Member b as an independent ordinary ``torch.nn`` model (a copy)."""
        return self.model.export_member(b)

    def load_member(self, b: int, module: nn.Module) -> None:
        """Overwrite member b's weights and buffers with ``module``'s (optimizer state is kept)."""
        self.model.load_member(b, module)

