"""Where the model dimension B sits in a fused tensor, and moving between member and fused views.

Two arrangements, chosen so that each fused operator reaches its batched kernel without a copy:
``DENSE`` ``[B, N, *features]`` (Linear, LayerNorm, Embedding, activations) and ``IMAGE``
``[N, B, C, *spatial]`` (convolutions, pools, BatchNorm over B*C channels); ``nn.Flatten`` is the
one operator that changes arrangement. See docs/hfta.md, "Arrangements".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DENSE = "dense"
IMAGE = "image"
ARRANGEMENTS = (DENSE, IMAGE)


def member_dim(arrangement: str) -> int:
    """The dimension that indexes members: 0 for ``DENSE``, 1 for ``IMAGE``."""
    if arrangement == DENSE:
        return 0
    if arrangement == IMAGE:
        return 1
    raise ValueError(f"unknown arrangement {arrangement!r}; expected one of {ARRANGEMENTS}")


def broadcast(x: torch.Tensor, B: int, arrangement: str) -> torch.Tensor:
    """One input ``[N, *]`` shared by all members as a fused input, without copying.

    ``DENSE`` gives ``[B, N, *]``, ``IMAGE`` gives ``[N, B, *]``; the member dimension has stride 0,
    which the first fused convolution detects to run one ordinary convolution with B*C_out
    output channels (a Linear's batched matmul reads the stride-0 batch as is).
    """
    if x.dim() < 1:
        raise ValueError("expected an input of shape [N, ...], got a scalar")
    d = member_dim(arrangement)
    x = x.unsqueeze(d)
    shape = list(x.shape)
    shape[d] = B
    return x.expand(shape)


def stack(xs: Sequence[torch.Tensor], arrangement: str) -> torch.Tensor:
    """B per-member tensors ``[N, *]`` (one each) as one fused tensor in ``arrangement``."""
    return torch.stack(list(xs), dim=member_dim(arrangement))


def member(y: torch.Tensor, b: int, arrangement: str) -> torch.Tensor:
    """Member b's slice ``[N, *]`` of a fused tensor (a view)."""
    return y.select(member_dim(arrangement), b)


def member_major(y: torch.Tensor, arrangement: str) -> torch.Tensor:
    """A fused tensor as ``[B, N, *]`` whatever its arrangement (a view)."""
    return y if arrangement == DENSE else y.transpose(0, member_dim(arrangement))


def is_shared(x: torch.Tensor, dim: int) -> bool:
    """True when ``x`` repeats one tensor along ``dim`` (an expanded, stride-0 broadcast)."""
    return x.dim() > dim and x.shape[dim] > 1 and x.stride(dim) == 0
