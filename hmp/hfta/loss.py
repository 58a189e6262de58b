"""Per-member losses for a fused array.

Each function returns a ``[B]`` tensor: member b's loss, reduced exactly as the torch loss
reduces it for one model (the mean over that member's N samples). Back-propagate their
**sum**: member b's parameters only reach loss b, so ``losses.sum().backward()`` gives each
member exactly the gradient of its own unfused loss. ``losses.mean()`` would divide every
member's gradient by B (the same as dividing every learning rate by B).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _target_per_member(target: torch.Tensor, B: int, member_shape: tuple[int, ...]) -> torch.Tensor:
    """``target`` as ``[B, *member_shape]``: a shared ``member_shape`` target is broadcast."""
    if tuple(target.shape) == member_shape:
        return target.unsqueeze(0).expand(B, *member_shape)
    if tuple(target.shape) == (B, *member_shape):
        return target
    raise ValueError(f"expected a target of shape {member_shape} (shared by all members) or "
                     f"{(B, *member_shape)} (one per member), got {tuple(target.shape)}")


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int | None = None,
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-member ``F.cross_entropy`` (mean over N): logits ``[B, N, C]``, target ``[N]`` class
    indices shared by all members or ``[B, N]``; returns ``[B]``.

    With ``ignore_index`` set, samples whose target equals it are left out of the member's
    mean, as in torch. Unlike torch the default is ``None`` (every target must be a class
    index), which takes a shorter path: one ``cross_entropy`` over ``[B, C, N]``, one mean.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [B, N, C], got {tuple(logits.shape)}")
    B, N, C = logits.shape
    t = _target_per_member(target, B, (N,))
    if ignore_index is None and label_smoothing == 0.0:
        # Classes on dim 1 ([B, C, N], torch's "K-dimensional" form): one kernel pair for all
        # members, and for a FusedLinear head (whose output is a transposed view of a
        # contiguous [B, C, N]) the class dim needs no copy.
        return F.cross_entropy(logits.transpose(1, 2), t, reduction="none").mean(1)
    per_sample = F.cross_entropy(logits.reshape(B * N, C), t.reshape(B * N), reduction="none",
                                 ignore_index=-100 if ignore_index is None else ignore_index,
                                 label_smoothing=label_smoothing).view(B, N)
    if ignore_index is None:
        return per_sample.mean(1)
    counts = (t != ignore_index).sum(1).to(per_sample.dtype)
    return per_sample.sum(1) / counts  # 0/0 = nan when all are ignored, as torch gives


def fused_mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-member ``F.mse_loss`` (mean over all of a member's elements): output ``[B, N, *]``,
    target ``[N, *]`` shared or ``[B, N, *]``; returns ``[B]``."""
    if output.dim() < 2:
        raise ValueError(f"expected output [B, N, *], got {tuple(output.shape)}")
    t = _target_per_member(target, output.shape[0], tuple(output.shape[1:]))
    return (output - t).square().flatten(1).mean(1)


@torch.no_grad()
def cross_entropy_and_grad(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-member mean cross-entropy ``[B]`` and its gradient with respect to ``logits``, by hand.

    ``logits [B, N, C]``, ``target [N]`` (shared) or ``[B, N]`` int64 class indices. The
    gradient is ``(softmax(logits) - onehot(target)) / N``: exactly what
    ``fused_cross_entropy(logits, target).sum().backward()`` sends back, so
    ``logits.backward(grad)`` gives each member its unfused gradient. A training step that
    always back-propagates the summed loss saves the loss's autograd graph (five nodes, more
    than the rest of a small fused MLP's backward) by calling this instead.
    """
    if logits.dim() != 3:
        raise ValueError(f"expected logits [B, N, C], got {tuple(logits.shape)}")
    B, N, C = logits.shape
    t = _target_per_member(target, B, (N,))
    if t.dtype != torch.int64:
        raise TypeError(f"expected int64 class indices, got {t.dtype}")
    # [B, C, N]: classes on dim 1, a free view of a FusedLinear head's contiguous output
    log_p = torch.log_softmax(logits.detach().transpose(1, 2), dim=1)
    index = t.unsqueeze(1)  # [B, 1, N]
    try:  # gather checks every index before the in-place scatter below could run
        picked = log_p.gather(1, index)
    except RuntimeError as e:
        raise ValueError(f"class indices must lie in [0, {C}): {e}") from None
    losses = picked.view(B, N).mean(1).neg_()
    grad = log_p.exp_()  # softmax, reusing log_p's memory
    grad.scatter_add_(1, index, _minus_one(grad).expand(B, 1, N))
    grad.mul_(1.0 / N)
    return losses, grad.transpose(1, 2)


_MINUS_ONE: dict[tuple, torch.Tensor] = {}


def _minus_one(like: torch.Tensor) -> torch.Tensor:
    """A cached ``[1, 1, 1]`` tensor holding -1 in ``like``'s dtype and device."""
    key = (like.dtype, like.device)
    t = _MINUS_ONE.get(key)
    if t is None:
        t = _MINUS_ONE[key] = torch.full((1, 1, 1), -1.0, dtype=like.dtype, device=like.device)
    return t
