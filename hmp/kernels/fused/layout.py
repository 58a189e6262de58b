"""Where the model dimension B sits in a fused tensor, and moving between member and fused views.

Two layouts, chosen so that each fused operator needs no copy to reach its batched kernel:

``DENSE``  ``[B, N, *features]``: member-major. Linear is one ``baddbmm`` over the leading B,
           LayerNorm/Embedding/activations act on it as is. Output of a fused MLP.
``IMAGE``  ``[N, B, C, *spatial]``: batch-major. Reshaping to ``[N, B*C, *spatial]`` is free, and a
           convolution over B groups (or a pool, or a per-channel BatchNorm) then treats the
           B members' channels as independent channels.

``nn.Flatten`` is the one operator that changes layout (``IMAGE`` in, ``DENSE`` out), as in a CNN
whose convolutional trunk feeds a Linear head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DENSE = "dense"
IMAGE = "image"
LAYOUTS = (DENSE, IMAGE)


def member_dim(layout: str) -> int:
    """The dimension that indexes members: 0 for ``DENSE``, 1 for ``IMAGE``."""
    if layout == DENSE:
        return 0
    if layout == IMAGE:
        return 1
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def broadcast(x: torch.Tensor, B: int, layout: str) -> torch.Tensor:
    """One input ``[N, *]`` shared by all members as a fused input, without copying.

    ``DENSE`` gives ``[B, N, *]``, ``IMAGE`` gives ``[N, B, *]``; the member dimension has stride 0,
    which the first fused convolution detects to run one ordinary convolution with B*C_out
    output channels (a Linear's batched matmul reads the stride-0 batch as is).
    """
    if x.dim() < 1:
        raise ValueError("expected an input of shape [N, ...], got a scalar")
    d = member_dim(layout)
    x = x.unsqueeze(d)
    shape = list(x.shape)
    shape[d] = B
    return x.expand(shape)


def stack(xs: Sequence[torch.Tensor], layout: str) -> torch.Tensor:
    """B per-member tensors ``[N, *]`` (one each) as one fused tensor in ``layout``."""
    return torch.stack(list(xs), dim=member_dim(layout))


def member(y: torch.Tensor, b: int, layout: str) -> torch.Tensor:
    """Member b's slice ``[N, *]`` of a fused tensor (a view)."""
    return y.select(member_dim(layout), b)


def member_major(y: torch.Tensor, layout: str) -> torch.Tensor:
    """A fused tensor as ``[B, N, *]`` whatever its layout (a view)."""
    return y if layout == DENSE else y.transpose(0, member_dim(layout))


def is_shared(x: torch.Tensor, dim: int) -> bool:
    """True when ``x`` repeats one tensor along ``dim`` (an expanded, stride-0 broadcast)."""
    return x.dim() > dim and x.shape[dim] > 1 and x.stride(dim) == 0
