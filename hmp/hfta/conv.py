"""Fused ``nn.Conv1d``/``nn.Conv2d``: B convolutions as one grouped convolution."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .base import FusedModule
from .arrangement import is_shared


class _FusedConvNd(FusedModule):
    """B copies of a ``torch.nn`` convolution, run as one convolution with ``B * groups`` groups.

    Input ``[N, B, C_in, *spatial]`` (arrangement ``IMAGE``), output ``[N, B, C_out, *spatial']``.
    Parameters: ``weight [B, C_out, C_in / groups, *kernel]``, ``bias [B, C_out]``; ``weight[b]``
    is member b's ``weight``. Every torch argument (stride, padding including ``"same"``,
    dilation, groups, padding_mode) is accepted and means what it means in torch.
    """

    _conv = staticmethod(F.conv2d)

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros", *,
                 B: int, device=None, dtype=None) -> None:
        super().__init__(B)
        # A meta-device prototype validates the arguments exactly as torch does and
        # normalises them (tuples, the reversed padding used by non-zero padding modes).
        proto = self.torch_type(in_channels, out_channels, kernel_size, stride, padding, dilation,
                                groups, bias, padding_mode, device="meta")
        self._args = dict(in_channels=in_channels, out_channels=out_channels,
                          kernel_size=proto.kernel_size, stride=proto.stride, padding=proto.padding,
                          dilation=proto.dilation, groups=groups, bias=bias,
                          padding_mode=padding_mode)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.stride, self.padding, self.dilation = proto.stride, proto.padding, proto.dilation
        self.padding_mode = padding_mode
        self._pad = proto._reversed_padding_repeated_twice
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(B, *proto.weight.shape, **kw))
        self.bias = nn.Parameter(torch.empty(B, out_channels, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each member initialised as torch initialises one convolution."""
        for b in range(self.B):
            fan_in = self.weight[b][0].numel()
            bound = 1 / fan_in**0.5 if fan_in > 0 else 0
            nn.init.kaiming_uniform_(self.weight[b], a=5**0.5)
            if self.bias is not None:
                nn.init.uniform_(self.bias[b], -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nd = len(self._args["kernel_size"])
        if x.dim() != nd + 3 or x.shape[1] != self.B or x.shape[2] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__} expects [N, B={self.B}, {self.in_channels}, *{nd} spatial], "
                f"got {tuple(x.shape)}"
            )
        n, spatial = x.shape[0], x.shape[3:]
        weight = self.weight.reshape(self.B * self.out_channels, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(-1)
        if is_shared(x, 1) and self.groups == 1:
            # One input for all members: an ordinary convolution with B*C_out output channels.
            x = x[:, 0]
            groups = 1
        else:
            x = x.reshape(n, self.B * self.in_channels, *spatial)
            groups = self.B * self.groups
        if self.padding_mode != "zeros":
            x = F.pad(x, self._pad, mode=self.padding_mode)
            padding = 0
        else:
            padding = self.padding
        y = self._conv(x, weight, bias, self.stride, padding, self.dilation, groups)
        if y.dim() == 4 and y.device.type == "cpu":
            # CPU: keep the B*C_out channels innermost (channels_last). The activations and
            # pools that follow then vectorise over channels; torch's NCHW max pool walks
            # one small H x W plane per channel and is far slower at these sizes. Values
            # are unchanged, and oneDNN convolutions accept this format as input.
            y = y.contiguous(memory_format=torch.channels_last)
        return y.view(n, self.B, self.out_channels, *y.shape[2:])

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        for key in ("stride", "padding", "dilation", "groups", "padding_mode"):
            if getattr(module, key) != getattr(self, key):
                raise ValueError(
                    f"{type(self).__name__}: member {b} has {key}={getattr(module, key)!r}, "
                    f"expected {getattr(self, key)!r}"
                )
        self._copy_in("weight", b, module.weight)
        self._copy_in("bias", b, module.bias)

    def export_member(self, b: int) -> nn.Module:
        self._check_member(b)
        m = self._blank(self.torch_type, **self._args)
        self._copy_out("weight", b, m.weight)
        self._copy_out("bias", b, m.bias)
        return m.train(self.training)

    @classmethod
    def from_torch(cls, m: nn.Module, B: int) -> "_FusedConvNd":
        return cls(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                   m.groups, m.bias is not None, m.padding_mode, B=B,
                   device=m.weight.device, dtype=m.weight.dtype)

    def extra_repr(self) -> str:
        a = self._args
        return (f"B={self.B}, {a['in_channels']}, {a['out_channels']}, kernel_size={a['kernel_size']}, "
                f"stride={a['stride']}, padding={a['padding']}, groups={a['groups']}")


class FusedConv1d(_FusedConvNd):
    """B copies of ``nn.Conv1d``: ``[N, B, C_in, L]`` to ``[N, B, C_out, L']``."""

    torch_type = nn.Conv1d
    _conv = staticmethod(F.conv1d)


class FusedConv2d(_FusedConvNd):
    """B copies of ``nn.Conv2d``: ``[N, B, C_in, H, W]`` to ``[N, B, C_out, H', W']``."""

    torch_type = nn.Conv2d
    _conv = staticmethod(F.conv2d)
