"""Fused operators without parameters: activations, dropout, pooling, flatten, softmax.

None of these hold member state, so member b's module is a copy of the one torch module they
wrap; fusing them is only a matter of feeding the torch module a tensor of the right shape.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .base import FusedModule
from .arrangement import DENSE, IMAGE, member_dim


class FusedElementwise(FusedModule):
    """B copies of a parameter-free elementwise module (ReLU, GELU, Dropout, ...), any arrangement.

    The wrapped module is applied to the fused tensor as is; its output has the input's shape.
    ``nn.Dropout`` draws an independent mask per element, hence per member, as B separate
    dropouts would (but not the same masks as B separate runs: the random streams differ).
    """

    def __init__(self, module: nn.Module, *, B: int) -> None:
        super().__init__(B)
        self.fn = module
        self.torch_type = type(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        if repr(module) != repr(self.fn):
            raise ValueError(f"{type(self).__name__}: member {b} is {module!r}, expected {self.fn!r} "
                             "(parameter-free ops must be configured alike in every member)")

    def export_member(self, b: int) -> nn.Module:
        self._check_member(b)
        return copy.deepcopy(self.fn).train(self.training)

    def extra_repr(self) -> str:
        return f"B={self.B}"


class FusedChannelwise(FusedElementwise):
    """B copies of a module that treats channels independently: pooling, Dropout1d/2d.

    Input ``[N, B, C, *spatial]`` (``IMAGE``) is viewed as ``[N, B*C, *spatial]`` for the torch
    module, whose output is viewed back as ``[N, B, C, *spatial']``.
    """

    def __init__(self, module: nn.Module, *, B: int, spatial_dims: int) -> None:
        super().__init__(module, B=B)
        self.spatial_dims = spatial_dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 + self.spatial_dims or x.shape[1] != self.B:
            raise ValueError(f"fused {self.torch_type.__name__} expects [N, B={self.B}, C, "
                             f"*{self.spatial_dims} spatial], got {tuple(x.shape)}")
        n, c = x.shape[0], x.shape[2]
        x = x.reshape(n, self.B * c, *x.shape[3:])
        if x.dim() == 4 and x.device.type == "cpu":
            # channels_last: torch's CPU pools vectorise over channels in this format (the
            # B*C channels here), while the NCHW kernels walk small planes one at a time.
            x = x.contiguous(memory_format=torch.channels_last)
        y = self.fn(x)
        return y.view(n, self.B, c, *y.shape[2:])


class FusedFlatten(FusedElementwise):
    """B copies of ``nn.Flatten()`` (``start_dim=1, end_dim=-1`` only).

    ``IMAGE`` input ``[N, B, C, *spatial]`` becomes ``DENSE`` ``[B, N, C * prod(spatial)]``: the
    hand-over from a convolutional trunk to a Linear head. ``DENSE`` input ``[B, N, *]`` becomes
    ``[B, N, prod(*)]``.
    """

    def __init__(self, module: nn.Flatten, *, B: int, arrangement: str) -> None:
        super().__init__(module, B=B)
        if (module.start_dim, module.end_dim) != (1, -1):
            raise ValueError(f"fused Flatten supports start_dim=1, end_dim=-1 only, got "
                             f"start_dim={module.start_dim}, end_dim={module.end_dim}")
        member_dim(arrangement)  # validates
        self.arrangement = arrangement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = member_dim(self.arrangement)
        if x.dim() < 2 or x.shape[d] != self.B:
            raise ValueError(f"fused Flatten ({self.arrangement}) expects B={self.B} at dim {d}, "
                             f"got {tuple(x.shape)}")
        if self.arrangement == IMAGE:
            x = x.transpose(0, 1)
        # contiguous: the next op is a batched matmul, which would otherwise copy anyway
        return x.flatten(2).contiguous()

    def extra_repr(self) -> str:
        return f"B={self.B}, arrangement={self.arrangement} -> {DENSE}"


class FusedSoftmax(FusedElementwise):
    """B copies of ``nn.Softmax(dim)`` / ``nn.LogSoftmax(dim)``, the member's dim mapped to the
    fused tensor's dim (negative dims are unchanged; a non-negative dim moves right by one, except
    dim 0 (the batch) which is dim 1 in ``DENSE`` and stays 0 in ``IMAGE``)."""

    def __init__(self, module: nn.Module, *, B: int, arrangement: str) -> None:
        super().__init__(module, B=B)
        if module.dim is None:
            raise ValueError(f"fused {type(module).__name__} needs an explicit dim, got dim=None")
        d = module.dim
        if d < 0:
            self.dim = d
        elif d == 0:
            self.dim = 1 if arrangement == DENSE else 0
        else:
            self.dim = d + 1
        self.arrangement = arrangement

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, self.dim) if isinstance(self.fn, nn.Softmax) else torch.log_softmax(x, self.dim)


ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Dropout,
)
"""Parameter-free elementwise modules fused by ``FusedElementwise`` (any arrangement)."""

CHANNELWISE: dict[type[nn.Module], int] = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.AvgPool1d: 1, nn.AvgPool2d: 2,
    nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveMaxPool1d: 1,
    nn.AdaptiveMaxPool2d: 2, nn.Dropout1d: 1, nn.Dropout2d: 2,
}
"""Per-channel modules fused by ``FusedChannelwise`` (``IMAGE`` arrangement), with their spatial rank."""
