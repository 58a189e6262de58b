"""Fused learning-rate schedulers: one schedule per member, over a fused optimizer's lr lists.

Each scheduler sets ``group["lr"]`` (a list of B learning rates) from each member's initial
learning rate and its own schedule arguments (one value for all members, or B values), with
the closed forms of torch's ``StepLR`` and ``CosineAnnealingLR`` that the PS's schedules use too
(:mod:`hmp.ps.lr_schedule`). As in torch, constructing a scheduler sets the epoch-0 rates and
``step()`` is called once per epoch after the optimizer's.
"""

from __future__ import annotations

from hmp.ps.lr_schedule import cosine_annealing, step_decay

from .optim import _FusedOptimizer, _per_member


class FusedLRScheduler:
    """Base class: ``last_epoch`` counting, ``base_lrs`` ``[group][member]``, state dicts."""

    def __init__(self, optimizer: _FusedOptimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, _FusedOptimizer):
            raise TypeError(f"expected a fused optimizer (FusedSGD, FusedAdam, FusedAdamW), "
                            f"got {type(optimizer).__name__}")
        self.optimizer, self.B = optimizer, optimizer.B
        for group in optimizer.param_groups:
            if last_epoch == -1:
                group["initial_lr"] = list(group["lr"])
            elif "initial_lr" not in group:
                raise KeyError("param group has no 'initial_lr'; resume with last_epoch=-1 or "
                               "load a scheduler state")
        self.base_lrs: list[list[float]] = [list(g["initial_lr"]) for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self.step()

    def lr_at(self, b: int, base_lr: float, epoch: int) -> float:
        """Member b's learning rate at ``epoch`` given its initial rate."""
        raise NotImplementedError

    def step(self) -> None:
        """Advance one epoch and write every member's rate into the optimizer."""
        self.last_epoch += 1
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = [self.lr_at(b, base[b], self.last_epoch) for b in range(self.B)]

    def get_last_lr(self) -> list[list[float]]:
        """The rates last set, ``[group][member]``."""
        return [list(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class FusedStepLR(FusedLRScheduler):
    """``lr_b = initial_lr_b * gamma_b ** (epoch // step_size_b)`` (torch ``StepLR``)."""

    def __init__(self, optimizer: _FusedOptimizer, step_size, gamma=0.1, last_epoch: int = -1) -> None:
        B = optimizer.B
        self.step_size = [int(s) for s in _per_member("step_size", step_size, B)]
        if any(s < 1 for s in self.step_size):
            raise ValueError(f"step_size must be >= 1 for every member, got {self.step_size}")
        self.gamma = _per_member("gamma", gamma, B)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, b: int, base_lr: float, epoch: int) -> float:
        return step_decay(base_lr, self.gamma[b], self.step_size[b], epoch)


class FusedCosineAnnealingLR(FusedLRScheduler):
    """``lr_b = eta_min_b + (initial_lr_b - eta_min_b) (1 + cos(pi epoch / T_max_b)) / 2``
    (torch ``CosineAnnealingLR``)."""

    def __init__(self, optimizer: _FusedOptimizer, T_max, eta_min=0.0, last_epoch: int = -1) -> None:
        B = optimizer.B
        self.T_max = [int(t) for t in _per_member("T_max", T_max, B)]
        if any(t < 1 for t in self.T_max):
            raise ValueError(f"T_max must be >= 1 for every member, got {self.T_max}")
        self.eta_min = _per_member("eta_min", eta_min, B)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, b: int, base_lr: float, epoch: int) -> float:
        return cosine_annealing(base_lr, self.eta_min[b], self.T_max[b], epoch)
