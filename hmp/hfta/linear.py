"""Fused ``nn.Linear``: B linear maps as one batched matmul (``baddbmm``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from .base import FusedModule


class FusedLinear(FusedModule):
    """B copies of ``nn.Linear(in_features, out_features)``.

    Input ``[B, N, *, in_features]`` (arrangement ``DENSE``), output ``[B, N, *, out_features]``.
    Parameters: ``weight [B, out_features, in_features]``, ``bias [B, out_features]``;
    ``weight[b]`` is member b's ``nn.Linear.weight``.
    """

    torch_type = nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, B: int,
                 device=None, dtype=None) -> None:
        super().__init__(B)
        kw = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(B, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(B, out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each member initialised as ``nn.Linear`` initialises itself (fan-in of one member)."""
        for b in range(self.B):
            nn.init.kaiming_uniform_(self.weight[b], a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                nn.init.uniform_(self.bias[b], -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or x.shape[0] != self.B or x.shape[-1] != self.in_features:
            raise ValueError(
                f"FusedLinear expects [B={self.B}, N, *, {self.in_features}], got {tuple(x.shape)}"
            )
        # y^T = W x^T per member: the weight gradient then comes out as [B, out, in], the
        # parameter's own arrangement, so autograd accumulates it without a copy (x W^T would give
        # it transposed). The output is a transposed view, which the next bmm reads for free.
        flat = x.dim() == 3  # [B, N, in]: no reshape/unflatten (two fewer autograd nodes)
        xt = (x if flat else x.reshape(self.B, -1, self.in_features)).transpose(1, 2)  # [B, in, N*]
        if self.bias is None:
            yt = torch.bmm(self.weight, xt)
        else:
            yt = torch.baddbmm(self.bias.unsqueeze(-1), self.weight, xt)
        y = yt.transpose(1, 2)
        return y if flat else y.unflatten(1, x.shape[1:-1])

    def forward_features_first(self, xt: torch.Tensor) -> torch.Tensor:
        """The same map on ``[B, in_features, N]`` (features before samples), giving
        ``[B, out_features, N]``: what ``forward`` computes between its two transposes. A
        ``FusedSequential`` runs a chain of Linear layers and activations in this form, so the
        transposes happen once per chain instead of twice per layer."""
        if self.bias is None:
            return torch.bmm(self.weight, xt)
        return torch.baddbmm(self.bias.unsqueeze(-1), self.weight, xt)

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        self._copy_in("weight", b, module.weight)
        self._copy_in("bias", b, module.bias)

    def export_member(self, b: int) -> nn.Linear:
        self._check_member(b)
        m = self._blank(nn.Linear, self.in_features, self.out_features, self.bias is not None)
        self._copy_out("weight", b, m.weight)
        self._copy_out("bias", b, m.bias)
        return m.train(self.training)

    @classmethod
    def from_torch(cls, m: nn.Linear, B: int) -> "FusedLinear":
        """An (uninitialised-member) fused op with ``m``'s configuration."""
        return cls(m.in_features, m.out_features, m.bias is not None, B=B,
                   device=m.weight.device, dtype=m.weight.dtype)

    def extra_repr(self) -> str:
        return (f"B={self.B}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
