"""What one pipeline stage computes, without I/O: forward keeps each micro-batch's graph until
its backward; the last stage computes the loss (the job's task's loss function, cross-entropy by
default) and starts the backward at once.

Used by the stage worker daemon and, all stages chained in one process, by the tests that check a
split model gives the whole model's outputs and gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn
from torch.nn import functional as F

from hmp.placement.profiler import split_layers, stage_module

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageCompute:
    """Layers ``[start, stop)`` of a model, as the planner's profiler splits it into layers
    (``split_layers``: nested ``nn.Sequential``s flattened), as one pipeline stage."""

    def __init__(self, model: nn.Module, start: int, stop: int, loss_fn: LossFn = F.cross_entropy) -> None:
        self.module = stage_module(model, start, stop)  # shares the model's layers (and so its flat buffers)
        self.first, self.last = start == 0, stop == len(split_layers(model))
        self.loss_fn = loss_fn
        # micro-batch key -> (stage input, stage output or loss); dropped at backward or abort.
        self.saved: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, key: Hashable, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Run the stage on micro-batch ``key``. Returns the activations to send on, or (last stage)
        the loss, whose backward :meth:`backward` with no gradient runs."""
        if not self.first and x.is_floating_point():
            # A leaf that collects the gradient to send back; detach() also drops the read-only
            # receive frame from autograd's view (it is only read).
            x = x.detach().requires_grad_()
        out = self.module(x)
        if self.last:
            if labels is None:
                raise ValueError("the last stage needs the labels to compute the loss")
            out = self.loss_fn(out, labels)
        self.saved[key] = (x, out)
        return out.detach()

    def backward(self, key: Hashable, grad: torch.Tensor | None = None) -> torch.Tensor | None:
        """Backward of micro-batch ``key`` (parameter gradients accumulate into ``.grad``). Returns
        the gradient with respect to the stage's input, to send to the previous stage (None for
        the first stage)."""
        x, out = self.saved.pop(key)
        if self.last:
            out.backward()
        else:
            out.backward(grad)
        return None if self.first or x.grad is None else x.grad

    def abort(self) -> int:
        """Forget every micro-batch in flight (a new plan replaced this one); returns how many."""
        n = len(self.saved)
        self.saved.clear()
        return n
