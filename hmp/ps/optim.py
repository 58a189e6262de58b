"""Optimizers that update one flat 1-D parameter chunk in place (the PS shard's update kernels).

A PS shard owns chunks (see :mod:`hmp.flat`), not modules, so torch.optim does not fit: each chunk
gets its own optimizer holding that chunk's state, following torch.optim's update rules exactly and
allocating nothing per step. Also here: :func:`accumulate` and :func:`scale_`, the sync-mode
gradient aggregation, and :class:`BufferRule`, what stands in for the optimizer of a chunk holding
module buffers (they take values, not gradients: docs/buffers.md). The rules, schedules and
allocation are in docs/optimizers.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hmp.config import Config
from hmp.ps.lr_schedule import LRSchedule


def accumulate(dst: Tensor, src: Tensor, first: bool) -> None:
    """Aggregate a pushed gradient into ``dst`` in place: ``first`` copies, later pushes add."""
    if dst.shape != src.shape:
        raise ValueError(f"cannot accumulate shape {list(src.shape)} into {list(dst.shape)}")
    if first:
        dst.copy_(src)
    else:
        dst.add_(src)


def scale_(dst: Tensor, factor: float) -> Tensor:
    """Multiply ``dst`` by ``factor`` in place (``1 / n`` to average ``n`` pushes); returns ``dst``."""
    return dst.mul_(factor)


class BufferRule:
    """How a chunk of module buffers (BatchNorm running statistics, ``num_batches_tracked``) takes pushed values.

    A push carries a buffer chunk's *values* (the worker's buffers after its forward passes), never a
    gradient, and no optimizer, learning rate or schedule touches them. Floating-point chunks: an applied
    value replaces the chunk (last writer wins: async, ssp) and a sync round applies its members' mean.
    Other dtypes (counters such as ``num_batches_tracked``, flags): the element-wise maximum, so a count never
    goes back when a worker that pulled earlier pushes later. Why these rules: docs/buffers.md. The
    interface is the part of :class:`ChunkOptimizer` a shard calls (``step``, ``tick``, state dicts) plus
    the sync round's :meth:`fold` and :meth:`finish`."""

    name = "buffer"

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.numel, self.dtype = numel, dtype
        #: floating-point values are averaged in sync rounds and replaced otherwise; the rest take the maximum
        self.averages = dtype.is_floating_point or dtype.is_complex
        self.steps = 0

    def _check(self, what: str, t: Tensor) -> None:
        if t.shape != (self.numel,) or t.dtype != self.dtype:
            raise ValueError(f"buffer chunk: {what} is {t.dtype}{list(t.shape)}; expected {self.dtype}[{self.numel}]")

    def step(self, param: Tensor, value: Tensor) -> None:
        """Apply pushed (or a round's folded) ``value`` to ``param`` in place: replace, or the maximum."""
        self._check("value", value)
        self.steps += 1
        with torch.no_grad():
            if self.averages:
                param.copy_(value)
            else:
                torch.maximum(param, value.to(param.device), out=param)

    def fold(self, agg: Tensor, value: Tensor, first: bool) -> None:
        """Sync: fold one member's ``value`` into the round's buffer (``first`` copies; later ones add, or
        take the maximum)."""
        self._check("value", value)
        if first:
            agg.copy_(value)
        elif self.averages:
            agg.add_(value)
        else:
            torch.maximum(agg, value, out=agg)

    def finish(self, agg: Tensor, contributors: int) -> None:
        """Sync: the folded sum of ``contributors`` values becomes their mean (a maximum stays)."""
        if self.averages and contributors > 1:
            agg.div_(contributors)

    def tick(self) -> None:
        """An update that carried no value for this chunk: nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.name, "numel": self.numel, "step": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("optimizer") != self.name or state.get("numel") != self.numel:
            raise ValueError(f"state_dict is for {state.get('optimizer')!r} of {state.get('numel')} elements, "
                             f"not a buffer chunk of {self.numel}")
        self.steps = int(state.get("step", 0))


class ChunkOptimizer:
    """Base class: state for one 1-D chunk of ``numel`` elements of ``dtype`` on ``device``.

    Subclasses define ``name``, ``_state_names`` and ``_update``. ``step`` counts updates
    the way torch.optim's ``state['step']`` does. ``schedule``: the learning rate over those
    updates (None: constant); ``last_lr`` is the rate of the last update (the base rate before any).
    """

    name: str = ""
    _state_names: tuple[str, ...] = ()

    lr: float

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | str | None,
                 schedule: LRSchedule | None = None) -> None:
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"chunk optimizers need a floating-point dtype, got {dtype}")
        # Resolve "cuda" to "cuda:0" so that step's device check compares like with like.
        self.numel, self.dtype, self.device = numel, dtype, torch.empty(0, device=device).device
        self.steps = 0
        if schedule is not None and not isinstance(schedule, LRSchedule):
            raise ValueError(f"schedule must be an hmp.ps.lr_schedule.LRSchedule or None, got {schedule!r}")
        self.schedule = schedule
        self._lr = math.nan  # this update's rate, set by step() before _update (subclasses set lr first)

    @property
    def last_lr(self) -> float:
        """The rate of the last update (the base rate ``lr`` before the first)."""
        return self.lr if math.isnan(self._lr) else self._lr

    def _zeros(self) -> Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def step(self, param: Tensor, grad: Tensor) -> None:
        """Update ``param`` (1-D, ``numel`` elements) in place from ``grad`` (same shape)."""
        for what, t in (("param", param), ("grad", grad)):
            if t.shape != (self.numel,) or t.dtype != self.dtype or t.device != self.device:
                raise ValueError(
                    f"{self.name}: {what} is {t.dtype}{list(t.shape)} on {t.device}; "
                    f"expected {self.dtype}[{self.numel}] on {self.device}"
                )
        self.steps += 1
        self._lr = self.lr if self.schedule is None else self.schedule.lr(self.lr, self.steps - 1)
        with torch.no_grad():
            self._update(param, grad)

    def _update(self, param: Tensor, grad: Tensor) -> None:
        raise NotImplementedError

    def step_rows(self, param: Tensor, rows: Tensor, grad: Tensor, dim: int) -> None:
        """Update rows ``rows`` (int64, strictly increasing, each in ``[0, numel // dim)``) of ``param``
        (1-D, ``numel`` elements, viewed as ``[numel // dim, dim]``) from ``grad`` (``[len(rows), dim]``):
        a row-sparse push (docs/protocol.md, "Row-sparse tables"). Only those rows of the parameter and
        of the optimizer state change; the update counts as one step (the schedule's and the bias
        corrections' count), like a dense one. The caller has checked the rows."""
        if param.shape != (self.numel,) or param.dtype != self.dtype or param.device != self.device:
            raise ValueError(f"{self.name}: param is {param.dtype}{list(param.shape)} on {param.device}; "
                             f"expected {self.dtype}[{self.numel}] on {self.device}")
        if dim < 1 or self.numel % dim or grad.shape != (rows.numel(), dim) or grad.dtype != self.dtype:
            raise ValueError(f"{self.name}: row gradient is {grad.dtype}{list(grad.shape)} for {rows.numel()} "
                             f"rows of width {dim} of a {self.numel}-element chunk")
        self.steps += 1
        self._lr = self.lr if self.schedule is None else self.schedule.lr(self.lr, self.steps - 1)
        if rows.numel() == 0:
            return
        rows = rows.to(self.device)
        grad = grad.to(self.device)
        with torch.no_grad():
            self._update_rows(param.view(-1, dim), rows, grad, dim)

    def tick(self) -> None:
        """Count an update that carried no row of this chunk (a row-sparse chunk stays at its shard's
        update count, which the schedule and the bias corrections read)."""
        self.steps += 1
        self._lr = self.lr if self.schedule is None else self.schedule.lr(self.lr, self.steps - 1)

    def _rows(self, state: Tensor, dim: int) -> Tensor:
        return state.view(-1, dim)

    def _update_rows(self, table: Tensor, rows: Tensor, grad: Tensor, dim: int) -> None:
        raise NotImplementedError

    def hyper(self) -> dict[str, Any]:
        """The hyper-parameters this optimizer was built with (for logs and checks)."""
        return {k: getattr(self, k) for k in _HYPER[self.name]}

    def state_dict(self) -> dict[str, Any]:
        """Copies of the state: ``{"optimizer", "numel", "step", <state tensors>}`` (tensors, ints, a str)."""
        out: dict[str, Any] = {"optimizer": self.name, "numel": self.numel, "step": self.steps}
        for k in self._state_names:
            out[k] = getattr(self, k).detach().clone()  # a copy: the shard keeps updating its own
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore state saved by :meth:`state_dict` of the same optimizer kind and size."""
        if state.get("optimizer") != self.name:
            raise ValueError(f"state_dict is for optimizer {state.get('optimizer')!r}, not {self.name!r}")
        if state.get("numel") != self.numel:
            raise ValueError(f"state_dict is for {state.get('numel')} elements, this chunk has {self.numel}")
        missing = [k for k in ("step", *self._state_names) if k not in state]
        if missing:
            raise ValueError(f"{self.name} state_dict lacks {missing}")
        for k in self._state_names:
            t = state[k]
            if not isinstance(t, Tensor) or t.shape != (self.numel,):
                raise ValueError(f"{self.name} state {k!r} must be a tensor of shape [{self.numel}]")
            getattr(self, k).copy_(t)  # copy_ keeps our buffer's dtype/device
        self.steps = int(state["step"])


class ChunkSGD(ChunkOptimizer):
    """``torch.optim.SGD`` on one chunk: momentum, dampening, L2 weight decay, Nesterov."""

    name = "sgd"

    def __init__(
        self,
        numel: int,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__(numel, dtype, device, schedule)
        _check_nonneg(lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening == 0 (as in torch.optim.SGD)")
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self._state_names = ("momentum_buffer",) if momentum else ()
        if momentum:
            self.momentum_buffer = self._zeros()
        # Scratch for grad + wd * param, or for the Nesterov direction: both are
        # temporaries torch allocates each step; we allocate once.
        self._scratch = self._zeros() if (weight_decay or nesterov) else None

    def _update(self, param: Tensor, grad: Tensor) -> None:
        d_p = grad
        if self.weight_decay:
            d_p = torch.add(grad, param, alpha=self.weight_decay, out=self._scratch)
        if self.momentum:
            buf = self.momentum_buffer
            if self.steps == 1:
                buf.copy_(d_p)  # torch starts the buffer at the first gradient, undamped
            else:
                buf.mul_(self.momentum).add_(d_p, alpha=1 - self.dampening)
            if self.nesterov:
                d_p = torch.add(d_p, buf, alpha=self.momentum, out=self._scratch)  # d_p may alias scratch: elementwise, safe
            else:
                d_p = buf
        param.add_(d_p, alpha=-self._lr)

    def _update_rows(self, table: Tensor, rows: Tensor, grad: Tensor, dim: int) -> None:
        # Rows only: weight decay reaches the touched rows only, and momentum is lazy (a row's buffer
        # moves only when the row is touched).
        p = table.index_select(0, rows)  # a gather: the rows are not contiguous
        d_p = grad
        if self.weight_decay:
            d_p = torch.add(grad, p, alpha=self.weight_decay)
        if self.momentum:
            # A row's buffer starts at zero, so its first update is (1 - dampening) * g: torch's first
            # step (the buffer set to g) when dampening is 0, and no per-row "started" state to keep.
            bufs = self._rows(self.momentum_buffer, dim)
            buf = bufs.index_select(0, rows)
            buf.mul_(self.momentum).add_(d_p, alpha=1 - self.dampening)
            bufs.index_copy_(0, rows, buf)
            d_p = torch.add(d_p, buf, alpha=self.momentum) if self.nesterov else buf
        table.index_copy_(0, rows, p.add_(d_p, alpha=-self._lr))


class ChunkAdam(ChunkOptimizer):
    """``torch.optim.Adam`` on one chunk (L2 weight decay, or AdamW with ``decoupled_weight_decay``)."""

    name = "adam"
    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        numel: int,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__(numel, dtype, device, schedule)
        b1, b2 = betas
        _check_nonneg(lr=lr, eps=eps, weight_decay=weight_decay)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must each be in [0, 1), got {betas!r}")
        self.lr, self.betas, self.eps = lr, (float(b1), float(b2)), eps
        self.weight_decay, self.decoupled_weight_decay = weight_decay, decoupled_weight_decay
        self.exp_avg, self.exp_avg_sq = self._zeros(), self._zeros()
        # One scratch: first holds grad + wd * param (L2 decay), then the denominator.
        self._scratch = self._zeros()

    def _update(self, param: Tensor, grad: Tensor) -> None:
        b1, b2 = self.betas
        if self.weight_decay:
            if self.decoupled_weight_decay:
                param.mul_(1 - self._lr * self.weight_decay)
            else:
                grad = torch.add(grad, param, alpha=self.weight_decay, out=self._scratch)
        self.exp_avg.lerp_(grad, 1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        step_size = self._lr / (1 - b1**self.steps)
        bc2_sqrt = (1 - b2**self.steps) ** 0.5
        # grad is no longer needed, so the scratch it may occupy can take the denominator.
        denom = torch.sqrt(self.exp_avg_sq, out=self._scratch).div_(bc2_sqrt).add_(self.eps)
        param.addcdiv_(self.exp_avg, denom, value=-step_size)

    def _update_rows(self, table: Tensor, rows: Tensor, grad: Tensor, dim: int) -> None:
        # Lazy Adam, as torch.optim.SparseAdam computes it (same operations in the same order, so the
        # same bits): the moments of the touched rows only; the step count t is the chunk's, which
        # counts every update of its shard (ChunkOptimizer.tick), touched or not.
        b1, b2 = self.betas
        if self.weight_decay:  # SparseAdam has none: L2 (or decoupled) on the touched rows only
            p = table.index_select(0, rows)
            if self.decoupled_weight_decay:
                table.index_copy_(0, rows, p.mul_(1 - self._lr * self.weight_decay))
            else:
                grad = torch.add(grad, p, alpha=self.weight_decay)
        exp_avg, exp_avg_sq = self._rows(self.exp_avg, dim), self._rows(self.exp_avg_sq, dim)
        old_exp_avg = exp_avg.index_select(0, rows)
        exp_avg_update = grad.sub(old_exp_avg).mul_(1 - b1)
        exp_avg.index_copy_(0, rows, old_exp_avg + exp_avg_update)
        old_exp_avg_sq = exp_avg_sq.index_select(0, rows)
        exp_avg_sq_update = grad.pow(2).sub_(old_exp_avg_sq).mul_(1 - b2)
        exp_avg_sq.index_copy_(0, rows, old_exp_avg_sq + exp_avg_sq_update)
        numer = exp_avg_update.add_(old_exp_avg)
        exp_avg_sq_update.add_(old_exp_avg_sq)
        denom = exp_avg_sq_update.sqrt_().add_(self.eps)
        step_size = self._lr * math.sqrt(1 - b2**self.steps) / (1 - b1**self.steps)
        table.index_copy_(0, rows, table.index_select(0, rows) + (-step_size * numer.div_(denom)))


class ChunkAdagrad(ChunkOptimizer):
    """``torch.optim.Adagrad`` on one chunk."""

    name = "adagrad"
    _state_names = ("sum",)

    def __init__(
        self,
        numel: int,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        lr_decay: float = 0.0,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__(numel, dtype, device, schedule)
        _check_nonneg(
            lr=lr, eps=eps, weight_decay=weight_decay, initial_accumulator_value=initial_accumulator_value, lr_decay=lr_decay
        )
        self.lr, self.eps, self.weight_decay = lr, eps, weight_decay
        self.initial_accumulator_value, self.lr_decay = initial_accumulator_value, lr_decay
        self.sum = self._zeros().fill_(initial_accumulator_value)
        self._std = self._zeros()  # sqrt(sum) + eps, needed alongside grad
        self._scratch = self._zeros() if weight_decay else None  # grad + wd * param

    def _update(self, param: Tensor, grad: Tensor) -> None:
        if self.weight_decay:
            grad = torch.add(grad, param, alpha=self.weight_decay, out=self._scratch)
        clr = self._lr / (1 + (self.steps - 1) * self.lr_decay)
        self.sum.addcmul_(grad, grad, value=1)
        std = torch.sqrt(self.sum, out=self._std).add_(self.eps)
        param.addcdiv_(grad, std, value=-clr)

    def _update_rows(self, table: Tensor, rows: Tensor, grad: Tensor, dim: int) -> None:
        # torch.optim.Adagrad's sparse path (same operations in the same order): the accumulators of
        # the touched rows only; weight decay (which torch refuses with sparse gradients) on those rows.
        if self.weight_decay:
            grad = torch.add(grad, table.index_select(0, rows), alpha=self.weight_decay)
        clr = self._lr / (1 + (self.steps - 1) * self.lr_decay)
        sums = self._rows(self.sum, dim)
        new_sum = sums.index_select(0, rows) + grad.pow(2)
        sums.index_copy_(0, rows, new_sum)
        std = new_sum.sqrt_().add_(self.eps)
        table.index_copy_(0, rows, table.index_select(0, rows).add_(grad / std, alpha=-clr))


def _check_nonneg(**values: float) -> None:
    for k, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{k} must be a finite number >= 0, got {v!r}")


OPTIMIZERS: dict[str, type[ChunkOptimizer]] = {"sgd": ChunkSGD, "adam": ChunkAdam, "adagrad": ChunkAdagrad}

# Hyper-parameter names per optimizer: the constructor's keywords minus the plumbing.
_HYPER: dict[str, tuple[str, ...]] = {
    name: tuple(k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "numel", "dtype", "device"))
    for name, cls in OPTIMIZERS.items()
}


def make_chunk_optimizer(
    name: str,
    numel: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    **hyper: Any,
) -> ChunkOptimizer:
    """Build the optimizer ``name`` ("sgd", "adam", "adagrad") for a chunk of ``numel`` elements.

    ``hyper`` are the torch.optim keyword names (``lr``, ``momentum``, ``betas``, ...), plus
    ``schedule`` (an :class:`~hmp.ps.lr_schedule.LRSchedule`, or a mapping of its fields);
    unknown names or hyper-parameters raise ``ValueError`` listing the accepted ones.
    """
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise ValueError(f"unknown chunk optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}")
    unknown = sorted(set(hyper) - set(_HYPER[name]))
    if unknown:
        raise ValueError(f"unknown hyper-parameter(s) {unknown} for {name!r}; expected some of {list(_HYPER[name])}")
    if name == "sgd" and "lr" not in hyper:
        raise ValueError("'sgd' needs an explicit lr")
    if "betas" in hyper:
        hyper["betas"] = tuple(hyper["betas"])  # TOML/msgpack give lists
    if isinstance(hyper.get("schedule"), Mapping):
        try:
            hyper["schedule"] = LRSchedule(**hyper["schedule"])
        except TypeError as exc:
            raise ValueError(f"schedule: {exc}") from None
    return cls(numel, dtype=dtype, device=device, **hyper)


def chunk_optimizer_of(cfg: Config) -> tuple[str, dict[str, Any]]:
    """The shards' chunk optimizer (the ring's too), with ``[optimizer] schedule`` unless it is a
    constant rate. A sweep job's workers run the fused per-member optimizer themselves and push
    parameter deltas, which the shards apply as plain SGD at lr 1 (no schedule: a sweep's rates
    are its members', ``[sweep]``)."""
    if cfg.sweep.members:
        return "sgd", {"lr": 1.0}
    hyper = _hyper(cfg)
    schedule = LRSchedule.of(cfg.optimizer)
    if not schedule.constant:
        hyper["schedule"] = schedule
    return cfg.optimizer.name, hyper


def _hyper(cfg: Config) -> dict[str, Any]:
    o = cfg.optimizer
    if o.name == "sgd":
        return {"lr": o.lr, "momentum": o.momentum, "weight_decay": o.weight_decay, "nesterov": o.nesterov}
    if o.name == "adam":
        return {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    return {"lr": o.lr, "eps": o.eps, "weight_decay": o.weight_decay}
