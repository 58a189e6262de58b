"""Learning-rate schedules over a shard's updates (``[optimizer] schedule``): pure closed forms.

The step ``s`` is the number of updates applied before the one being made (0 for the first), on a
PS shard the count of pushes (async, ssp) or rounds (sync) it has applied, in an allreduce job the
ring's step. With ``W = warmup_steps``, ``lr`` the optimizer's rate and ``t = s - W``:

* warm-up, ``s < W``: ``lr * (s + 1) / W``. The first update uses ``lr / W`` and the ``W``-th the
  full rate, so no update is spent at rate 0; this is torch's ``LinearLR(start_factor=1/W,
  end_factor=1, total_iters=W-1)``.
* ``constant``: ``lr``.
* ``step``: ``lr * gamma ** (t // step_size)`` (torch's ``StepLR`` at epoch ``t``).
* ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * min(t, T) / T)) / 2`` with
  ``T = total_steps`` (torch's ``CosineAnnealingLR`` at epoch ``t`` for ``t <= T``); it stays at
  ``min_lr`` after ``T``, where torch's closed form would climb again.

docs/optimizers.md has the same formulas with the optimizers they feed. :func:`step_decay` and
:func:`cosine_annealing` are the one implementation of those closed forms: the fused HFTA schedulers
(:mod:`hmp.hfta.lr_schedule`, per member and per epoch) use them too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

#: the values of ``[optimizer] schedule``
LR_SCHEDULES = ("constant", "step", "cosine")


def step_decay(base_lr: float, gamma: float, step_size: int, t: int) -> float:
    """torch ``StepLR``'s closed form: ``base_lr * gamma ** (t // step_size)``."""
    return base_lr * gamma ** (t // step_size)


def cosine_annealing(base_lr: float, eta_min: float, t_max: int, t: int) -> float:
    """torch ``CosineAnnealingLR``'s closed form: ``eta_min + (base_lr - eta_min) (1 + cos(pi t / t_max)) / 2``."""
    return eta_min + (base_lr - eta_min) * (1 + math.cos(math.pi * t / t_max)) / 2


class _LRScheduleSettings(Protocol):
    """What :func:`lr_at` reads: ``[optimizer]``'s keys (:class:`hmp.config.schema.OptimizerConfig`)."""

    lr: float
    schedule: str
    warmup_steps: int
    step_size: int
    gamma: float
    total_steps: int
    min_lr: float


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """A schedule's settings without the base rate (a chunk optimizer holds that): :meth:`lr` gives the
    rate of update ``step`` from a base rate. The defaults are a constant rate."""

    kind: str = "constant"
    warmup_steps: int = 0
    step_size: int = 1000
    gamma: float = 0.1
    total_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"schedule must be one of {list(LR_SCHEDULES)}, got {self.kind!r}")
        for name, low in (("warmup_steps", 0), ("step_size", 1), ("total_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if self.kind == "cosine" and self.total_steps < 1:
            raise ValueError("a cosine schedule needs total_steps >= 1")
        if not (math.isfinite(self.min_lr) and self.min_lr >= 0):
            raise ValueError(f"min_lr must be a finite number >= 0, got {self.min_lr!r}")

    @classmethod
    def of(cls, o: _LRScheduleSettings) -> LRSchedule:
        """The schedule of an ``[optimizer]`` section."""
        return cls(kind=str(o.schedule), warmup_steps=int(o.warmup_steps), step_size=int(o.step_size),
                   gamma=float(o.gamma), total_steps=int(o.total_steps), min_lr=float(o.min_lr))

    @property
    def constant(self) -> bool:
        """Every update uses the base rate."""
        return self.kind == "constant" and self.warmup_steps == 0

    def lr(self, base_lr: float, step: int) -> float:
        """The rate of the update made after ``step`` updates (module docstring)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        w = self.warmup_steps
        if step < w:
            return base_lr * (step + 1) / w
        t = step - w
        if self.kind == "step":
            return step_decay(base_lr, self.gamma, self.step_size, t)
        if self.kind == "cosine":
            return cosine_annealing(base_lr, self.min_lr, self.total_steps, min(t, self.total_steps))
        return base_lr

    def as_dict(self) -> dict[str, Any]:
        """The settings that matter for this kind (for logs and the run report)."""
        out: dict[str, Any] = {"schedule": self.kind, "warmup_steps": self.warmup_steps}
        if self.kind == "step":
            out.update(step_size=self.step_size, gamma=self.gamma)
        elif self.kind == "cosine":
            out.update(total_steps=self.total_steps, min_lr=self.min_lr)
        return out


def lr_at(step: int, o: _LRScheduleSettings) -> float:
    """The learning rate of the update made after ``step`` updates, for ``[optimizer]`` section ``o``."""
    return LRSchedule.of(o).lr(o.lr, step)
