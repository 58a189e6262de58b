"""Fused BatchNorm1d/2d (each member keeps its own running statistics) and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .base import FusedModule
from .arrangement import DENSE, member_dim


class _FusedBatchNorm(FusedModule):
    """B copies of a torch BatchNorm, run as one BatchNorm over ``B * C`` channels.

    Parameters ``weight``/``bias`` ``[B, C]``; buffers ``running_mean``/``running_var`` ``[B, C]``
    and ``num_batches_tracked`` ``[B]``, so member b's statistics are its own and exported with it.
    Statistics are always computed over member b's own ``N`` (and spatial) positions.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, B: int,
                 device=None, dtype=None) -> None:
        super().__init__(B)
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = nn.Parameter(torch.ones(B, num_features, **kw))
            self.bias = nn.Parameter(torch.zeros(B, num_features, **kw))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(B, num_features, **kw))
            self.register_buffer("running_var", torch.ones(B, num_features, **kw))
            self.register_buffer("num_batches_tracked",
                                 torch.zeros(B, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def _flat(self, t: torch.Tensor | None) -> torch.Tensor | None:
        # A view, so running-stat updates made by F.batch_norm land in the [B, C] buffers.
        return None if t is None else t.view(-1)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """Batch-normalise ``x [N, B*C, *]`` as B*C independent channels (torch's own logic)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch does
                counts = self.num_batches_tracked
                if not bool((counts == counts[0]).all()):
                    raise ValueError("momentum=None needs every member to have seen the same "
                                     f"number of batches; got num_batches_tracked={counts.tolist()}")
                factor = 1.0 / float(counts[0])
        use_batch_stats = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        return F.batch_norm(
            x,
            self._flat(self.running_mean) if track else None,
            self._flat(self.running_var) if track else None,
            self._flat(self.weight), self._flat(self.bias),
            use_batch_stats, factor, self.eps,
        )

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        if module.num_features != self.num_features or module.affine != self.affine or \
                module.track_running_stats != self.track_running_stats:
            raise ValueError(f"{type(self).__name__}: member {b} ({module}) does not match {self}")
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            self._copy_in(name, b, getattr(module, name))

    def export_member(self, b: int) -> nn.Module:
        self._check_member(b)
        m = self._blank(self.torch_type, self.num_features, self.eps, self.momentum, self.affine,
                        self.track_running_stats)
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            self._copy_out(name, b, getattr(m, name))
        return m.train(self.training)

    @classmethod
    def from_torch(cls, m: nn.Module, B: int) -> "_FusedBatchNorm":
        like = m.weight if m.weight is not None else m.running_mean
        kw = {} if like is None else {"device": like.device, "dtype": like.dtype}
        return cls(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, B=B, **kw)

    def extra_repr(self) -> str:
        return (f"B={self.B}, {self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class FusedBatchNorm1d(_FusedBatchNorm):
    """B copies of ``nn.BatchNorm1d``.

    Input ``[B, N, C]`` (``DENSE``, after a Linear) or ``[N, B, C, L]`` (``IMAGE``, after a
    Conv1d); output of the same shape.
    """

    torch_type = nn.BatchNorm1d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C = self.B, self.num_features
        if x.dim() == 3 and x.shape[0] == B and x.shape[2] == C:
            n = x.shape[1]
            y = self._norm(x.transpose(0, 1).reshape(n, B * C))
            return y.view(n, B, C).transpose(0, 1)
        if x.dim() == 4 and x.shape[1] == B and x.shape[2] == C:
            n, length = x.shape[0], x.shape[3]
            return self._norm(x.reshape(n, B * C, length)).view(n, B, C, length)
        raise ValueError(f"FusedBatchNorm1d expects [B={B}, N, {C}] or [N, B={B}, {C}, L], "
                         f"got {tuple(x.shape)}")


class FusedBatchNorm2d(_FusedBatchNorm):
    """B copies of ``nn.BatchNorm2d``: ``[N, B, C, H, W]`` (``IMAGE``) in and out."""

    torch_type = nn.BatchNorm2d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C = self.B, self.num_features
        if x.dim() != 5 or x.shape[1] != B or x.shape[2] != C:
            raise ValueError(f"FusedBatchNorm2d expects [N, B={B}, {C}, H, W], got {tuple(x.shape)}")
        n, h, w = x.shape[0], x.shape[3], x.shape[4]
        return self._norm(x.reshape(n, B * C, h, w)).view(n, B, C, h, w)


class FusedLayerNorm(FusedModule):
    """B copies of ``nn.LayerNorm(normalized_shape)``.

    Input ``[B, N, *, *normalized_shape]`` (``DENSE``) or ``[N, B, *, *normalized_shape]``
    (``IMAGE``, pass ``arrangement=IMAGE``); output of the same shape. Parameters ``weight``/``bias``
    ``[B, *normalized_shape]``.
    """

    torch_type = nn.LayerNorm

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, B: int, arrangement: str = DENSE, device=None, dtype=None) -> None:
        super().__init__(B)
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        self.arrangement, self._bdim = arrangement, member_dim(arrangement)
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(B, *self.normalized_shape, **kw))
            self.bias = nn.Parameter(torch.zeros(B, *self.normalized_shape, **kw)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        if x.dim() < 2 + k or x.shape[self._bdim] != self.B or \
                tuple(x.shape[x.dim() - k:]) != self.normalized_shape:
            where = "[B, N, *, " if self.arrangement == DENSE else "[N, B, *, "
            raise ValueError(f"FusedLayerNorm ({self.arrangement}) expects {where}"
                             f"{', '.join(map(str, self.normalized_shape))}] with B={self.B}, "
                             f"got {tuple(x.shape)}")
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        if self.weight is None:
            return y
        # Per-member affine: [B, 1, ..., *shape] lines up with B at dim 0 (DENSE) or, aligned
        # from the right, at dim 1 (IMAGE).
        ones = [1] * (x.dim() - self._bdim - 1 - k)
        w = self.weight.view(self.B, *ones, *self.normalized_shape)
        if self.bias is None:
            return y * w
        return torch.addcmul(self.bias.view(self.B, *ones, *self.normalized_shape), y, w)

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        if tuple(module.normalized_shape) != self.normalized_shape:
            raise ValueError(f"FusedLayerNorm: member {b} normalises {module.normalized_shape}, "
                             f"expected {self.normalized_shape}")
        self._copy_in("weight", b, module.weight)
        self._copy_in("bias", b, module.bias)

    def export_member(self, b: int) -> nn.LayerNorm:
        self._check_member(b)
        m = self._blank(nn.LayerNorm, self.normalized_shape, self.eps, self.elementwise_affine,
                        bias=self.bias is not None)
        self._copy_out("weight", b, m.weight)
        self._copy_out("bias", b, m.bias)
        return m.train(self.training)

    @classmethod
    def from_torch(cls, m: nn.LayerNorm, B: int, arrangement: str = DENSE) -> "FusedLayerNorm":
        kw = {} if m.weight is None else {"device": m.weight.device, "dtype": m.weight.dtype}
        return cls(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None, B=B,
                   arrangement=arrangement, **kw)

    def extra_repr(self) -> str:
        return (f"B={self.B}, {self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, arrangement={self.arrangement}")


