"""``FusedArray``: a hyper-parameter sweep of B classifiers trained as one fused model.

This is what a sweep worker drives: build it from a model factory and one settings dict per
member, call ``step(x, y)`` per batch (one batch shared by every member), read per-member
losses and accuracies, and export any member as an ordinary ``torch.nn`` model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from . import layout as L
from .base import FusedModule
from .convert import fuse
from .loss import fused_cross_entropy
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
        self.optimizer: _FusedOptimizer = make_optimizer(optimizer, self.model.parameters(), settings)
        self._params = list(self.model.parameters())

    def fused_input(self, x: torch.Tensor) -> torch.Tensor:
        """A batch ``[N, *]`` shared by all members, as the fused model's input (no copy)."""
        return L.broadcast(x.to(self.device, non_blocking=True), self.B, self.model.in_layout)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output for a shared batch ``x [N, *]``, as ``[B, N, classes]``."""
        return L.member_major(self.model(self.fused_input(x)), self.model.out_layout)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step of every member on the shared batch ``x [N, *]``, labels ``y [N]``
        (int64 class indices; ``[B, N]`` gives each member its own labels).

        Returns the per-member mean cross-entropy ``[B]`` before the update (detached).
        """
        if not self.model.training:  # Module.train() walks every submodule: skip when set
            self.model.train()
        for p in self._params:  # what zero_grad(set_to_none=True) does, without its overhead
            p.grad = None
        losses = fused_cross_entropy(self.logits(x), y.to(self.device, non_blocking=True))
        # The sum, not the mean: member b's gradient is then exactly its own loss's gradient.
        losses.sum().backward()
        self.optimizer.step()
        return losses.detach()

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
