"""Fused optimizers: one optimizer steps all B members, each with its own hyper-parameters.

Every parameter has the member dimension first (``[B, *]``). A per-member hyper-parameter is one
value or a sequence of B values, kept in ``param_groups`` as B values for the fused LR schedulers
to edit; shared values use plain scalars, differing ones a ``[B, 1, ..., 1]`` tensor. Member b's
update is exactly torch's single-tensor path with its hyper-parameters, up to float32 rounding.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Real

import torch
from torch.optim import optimizer as _torch_optimizer

from . import flat as _flat

Coef = float | torch.Tensor


def _per_member(name: str, value, B: int, pair: bool = False) -> list:
    """``value`` (one value, or B values) as a list of B values; a pair for ``betas``."""
    def is_one(v) -> bool:
        if pair:
            return isinstance(v, Sequence) and len(v) == 2 and all(isinstance(x, Real) for x in v)
        return isinstance(v, Real) and not isinstance(v, bool)

    if is_one(value):
        values = [tuple(float(x) for x in value) if pair else float(value)] * B
    elif isinstance(value, Sequence) and not isinstance(value, str) and all(is_one(v) for v in value):
        values = [tuple(float(x) for x in v) if pair else float(v) for v in value]
    else:
        kind = "a pair of numbers" if pair else "a number"
        raise ValueError(f"{name} must be {kind} or a sequence of B={B} of them, got {value!r}")
    if len(values) != B:
        raise ValueError(f"{name} has {len(values)} values, expected one per member (B={B})")
    return values


class _Coefs:
    """Per-member coefficients shaped to broadcast over parameters: a float when all members
    agree (torch's own scalar kernels), else a ``[B, 1, ..., 1]`` tensor. The ``[B]`` tensors
    are cached by value, so a step does not rebuild them (only a scheduler's change does)."""

    def __init__(self, limit: int = 256) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}
        self._limit = limit

    def _tensor(self, values: Sequence[float], p: torch.Tensor) -> torch.Tensor:
        key = (tuple(values), p.dtype, p.device)
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) >= self._limit:  # a schedule changes values every epoch
                self._cache.clear()
            t = self._cache[key] = torch.tensor(values, dtype=p.dtype, device=p.device)
        return t

    def each(self, values: Sequence[float], params: Sequence[torch.Tensor]) -> float | list[torch.Tensor]:
        """``values`` for a list of parameters at once (the ``torch._foreach_*`` operand): one
        float when all members agree, else one ``[B, 1, ..., 1]`` view per parameter."""
        first = values[0]
        if all(v == first for v in values):
            return float(first)
        t = self._tensor(values, params[0])
        B = len(values)
        return [t.view((B,) + (1,) * (p.dim() - 1)) for p in params]


def _foreach_add_scaled_(ys: list[torch.Tensor], xs: list[torch.Tensor], a) -> None:
    """``y += a * x`` for every pair, ``a`` a float or a list of broadcastable tensors."""
    if isinstance(a, float):
        torch._foreach_add_(ys, xs, alpha=a)
    else:
        torch._foreach_addcmul_(ys, xs, a)


def _foreach_add_scaled(ys: list[torch.Tensor], xs: list[torch.Tensor], a) -> list[torch.Tensor]:
    """``y + a * x`` for every pair (new tensors)."""
    if isinstance(a, float):
        return torch._foreach_add(ys, xs, alpha=a)
    return torch._foreach_addcmul(ys, xs, a)


def _foreach_scale_(xs: list[torch.Tensor], a) -> None:
    """``x *= a`` for every tensor, ``a`` a float or a list of broadcastable tensors."""
    if isinstance(a, float):
        if a != 1.0:
            torch._foreach_mul_(xs, a)
    else:
        torch._foreach_mul_(xs, a)


def _add_scaled(y: torch.Tensor, x: torch.Tensor, a: Coef, inplace: bool = False) -> torch.Tensor:
    """``y + a * x`` (in place into ``y`` when ``inplace``), ``a`` a float or a tensor."""
    if isinstance(a, float):
        return y.add_(x, alpha=a) if inplace else y.add(x, alpha=a)
    return y.addcmul_(x, a) if inplace else torch.addcmul(y, x, a)


_increment_version = torch.autograd.graph.increment_version


def _global_step_hooks() -> bool:
    """Whether any optimizer step hook is registered for all optimizers (torch keeps them in
    module-level dicts; absent in a torch without them)."""
    return bool(getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))


def _is_zero(c: Coef) -> bool:
    return isinstance(c, float) and c == 0.0


class _FusedOptimizer(torch.optim.Optimizer):
    """Shared machinery: B, normalising per-member hyper-parameters, checking parameter shapes."""

    _per_member_keys: tuple[str, ...] = ()
    _pair_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, B: int | None) -> None:
        params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
        if B is None:  # infer from the leading dimension of the first parameter
            first = params[0]["params"] if params and isinstance(params[0], dict) else params
            if not first or first[0].dim() == 0:
                raise ValueError("cannot infer B from an empty parameter list or a scalar parameter; pass B=")
            B = int(first[0].shape[0])
        if not isinstance(B, int) or B < 1:
            raise ValueError(f"B must be an int >= 1, got {B!r}")
        self.B = B
        self._coefs = _Coefs()
        self._plans: dict[tuple, object] = {}  # (id(param group), flat) -> cached step coefficients
        self._flat_cache: dict[int, tuple] = {}  # id(param group) -> (addresses, spans or None)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.dim() == 0 or p.shape[0] != self.B:
                raise ValueError(f"every fused parameter needs the member dimension first "
                                 f"([B={self.B}, *]), got a parameter of shape {tuple(p.shape)}")
        for key in self._per_member_keys:
            group[key] = _per_member(key, group[key], self.B, pair=key in self._pair_keys)
        self._check_group(group)

    def _check_group(self, group: dict) -> None:
        pass

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every member from the parameters' ``.grad``; returns ``closure()``'s
        loss if a closure is given (evaluated with gradients enabled, before the update)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def update(self) -> None:
        """``step()`` for a training loop that owns the optimizer: the same update, called
        inside ``torch.no_grad()`` by the caller, without what torch wraps around every
        ``Optimizer.step`` (a profiler range, the step hooks, a grad-mode switch). Those cost
        as much as the SGD update of a small fused MLP itself (docs/hfta.md). Falls back to
        ``step()`` when step hooks are registered, so they still run."""
        if (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_step_hooks()
                or "step" in self.__dict__  # patched on the instance (a scheduler's step counter, say)
                or getattr(type(self).step, "__wrapped__", None) is not _FusedOptimizer.__dict__["step"]):
            self.step()  # someone wraps or overrides step: go through it
        else:
            self._update()

    def _update(self) -> None:
        raise NotImplementedError


class FusedSGD(_FusedOptimizer):
    """``torch.optim.SGD`` for B members: ``lr``, ``momentum``, ``dampening`` and
    ``weight_decay`` per member; ``nesterov`` and ``maximize`` shared."""

    _per_member_keys = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(self, params: Iterable, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov: bool = False, *, maximize: bool = False, B: int | None = None) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, B)

    def _check_group(self, group: dict) -> None:
        for key in ("lr", "momentum", "weight_decay"):
            if any(v < 0 for v in group[key]):
                raise ValueError(f"SGD {key} must be >= 0 for every member, got {group[key]}")
        if group["nesterov"] and any(m <= 0 or d != 0 for m, d in zip(group["momentum"], group["dampening"])):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0 in every member")

    def _update(self) -> None:
        """One SGD step for every member (see ``step``).

        torch's single-tensor order of operations, each over all B members of a parameter at
        once: ``g += wd * p``; ``buf = momentum * buf + (1 - dampening) * g`` (one pass,
        ``torch.add(g, buf, alpha=momentum, out=buf)``, where momentum is alike in every member
        and there is no dampening); ``p -= lr * buf`` (``g + momentum * buf`` with Nesterov).
        The coefficients come from a plan cached per group (``_plan``). Per-tensor ops, not
        ``torch._foreach_*``: on CPU those loop over the same kernels and measured slower here.
        """
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            nesterov, maximize = group["nesterov"], group["maximize"]
            flat = self._flat_operands(group, params)
            if flat is not None:  # one kernel per term over all parameters (flat.py)
                P, G, buf, plan = flat
                new = self._sgd_tensor(P, G, buf, plan, 0, nesterov, maximize)
                for p in params[1:]:  # the span shares params[0]'s version counter only; autograd
                    _increment_version(p)  # must see every parameter as modified, as per tensor
                if buf is None and new is not None:  # first step: each parameter's state is a view
                    offset = 0
                    for p in params:
                        self.state[p]["momentum_buffer"] = new[offset:offset + p.numel()].view(p.shape)
                        offset += p.numel()
                continue
            plan = self._plan(group, params)
            for i, p in enumerate(params):
                state = self.state[p]
                buf = state.get("momentum_buffer") if plan.momentum is not None else None
                new = self._sgd_tensor(p, p.grad, buf, plan, i, nesterov, maximize)
                if buf is None and new is not None:
                    state["momentum_buffer"] = new

    @staticmethod
    def _sgd_tensor(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, plan: "_SGDPlan",
                    i: int, nesterov: bool, maximize: bool) -> torch.Tensor | None:
        """Update ``p`` (one parameter, or the span of all of them) from ``grad``; returns the
        momentum buffer (a new one on the first step, when ``buf`` is None)."""
        g = -grad if maximize else grad
        if plan.wd is not None:
            g = _add_scaled(g, p, plan.wd[i])
        if plan.momentum is not None:
            m = plan.momentum[i]
            if buf is None:  # torch's first step: buf = g, no dampening
                buf = g.clone().detach()
            elif plan.one_pass:
                torch.add(g, buf, alpha=m, out=buf)  # buf = m * buf + g, one pass
            else:
                buf.mul_(m)
                _add_scaled(buf, g, plan.keep[i], inplace=True)
            g = _add_scaled(g, buf, m) if nesterov else buf
        _add_scaled(p, g, plan.neg_lr[i], inplace=True)
        return buf

    def _flat_operands(self, group: dict, params: list[torch.Tensor]):
        """``(P, G, buf, plan)`` when the group's parameters, their gradients and their momentum
        buffers (if any yet) each lie back to back in one buffer (``flat.span``), else None.
        The spans are cached by the tensors' addresses (the cache keeps the storages alive, so
        an address cannot come back as another tensor's)."""
        grads = [p.grad for p in params]
        if not (_flat.back_to_back(params) and _flat.back_to_back(grads)):
            return None  # the usual case for autograd's own gradients: decided on addresses alone
        use_momentum = any(m != 0 for m in group["momentum"])
        bufs = [self.state[p].get("momentum_buffer") for p in params] if use_momentum else []
        if any(b is None for b in bufs):
            if not all(b is None for b in bufs):
                return None  # some members of the group have state, some not: per tensor
            bufs = []
        key = (tuple(t.data_ptr() for t in params), tuple(t.data_ptr() for t in grads),
               tuple(t.data_ptr() for t in bufs))
        cached = self._flat_cache.get(id(group))
        if cached is None or cached[0] != key:
            P, G = _flat.span(params), _flat.span(grads)
            if P is None or G is None or G.dtype != P.dtype:
                self._flat_cache[id(group)] = (key, None)
                return None
            buf = _flat.span(bufs) if bufs else None
            if bufs and buf is None:
                # Buffers apart (a loaded state dict, or steps taken on the per-tensor path):
                # gather them into one buffer, once, and make each parameter's state a view.
                buf, views = _flat.allocate_like(bufs)
                for p, old, view in zip(params, bufs, views):
                    view.copy_(old)
                    self.state[p]["momentum_buffer"] = view
                key = key[:2] + (tuple(v.data_ptr() for v in views),)
            cached = self._flat_cache[id(group)] = (key, (P, G, buf))
        if cached[1] is None:
            return None
        P, G, buf = cached[1]
        return P, G, buf, self._plan(group, params, flat=True)

    def _plan(self, group: dict, params: list[torch.Tensor], flat: bool = False) -> "_SGDPlan":
        """The step's coefficients for ``group``, rebuilt only when a hyper-parameter (say, a
        scheduler's lr) or the set of parameters with gradients changed. ``flat``: for the
        span of all parameters (one entry per list; a coefficient that differs between members
        is then a per-element vector, ``flat.member_vector``)."""
        key = (tuple(group["lr"]), tuple(group["momentum"]), tuple(group["dampening"]),
               tuple(group["weight_decay"]), tuple(map(id, params)), params[0].device, params[0].dtype, flat)
        plan = self._plans.get((id(group), flat))
        if plan is not None and plan.key == key:
            return plan
        c = self._coefs

        def each(values) -> list:
            if flat:
                first = values[0]
                return [float(first) if all(v == first for v in values) else _flat.member_vector(values, params)]
            v = c.each(values, params)
            return [v] * len(params) if isinstance(v, float) else v

        momentum = group["momentum"]
        use_momentum = any(m != 0 for m in momentum)
        # torch skips momentum for a member with momentum 0; with buf = 0*buf + 1*g the shared
        # buffer gives that member exactly g, so its dampening must count as 0.
        keep = [1.0 if m == 0 else 1.0 - d for m, d in zip(momentum, group["dampening"])]
        uniform_m = all(m == momentum[0] for m in momentum)
        plan = _SGDPlan(
            key=key,
            wd=None if all(w == 0 for w in group["weight_decay"]) else each(group["weight_decay"]),
            momentum=each(momentum) if use_momentum else None,
            keep=each(keep) if use_momentum else None,
            one_pass=uniform_m and all(k == 1.0 for k in keep),
            neg_lr=each([-v for v in group["lr"]]),
        )
        self._plans[(id(group), flat)] = plan
        return plan

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._plans.clear()
        self._flat_cache.clear()


@dataclass(slots=True)
class _SGDPlan:
    """FusedSGD's per-parameter coefficients for one group (floats where members agree, else
    ``[B, 1, ...]`` views), valid while ``key`` (hyper-parameters, parameters) is unchanged."""

    key: tuple
    wd: list | None
    momentum: list | None
    keep: list | None
    one_pass: bool  # momentum alike in every member and no dampening: buf = m * buf + g
    neg_lr: list


class FusedAdam(_FusedOptimizer):
    """``torch.optim.Adam`` for B members: ``lr``, ``betas``, ``eps`` and ``weight_decay`` per
    member; ``amsgrad``, ``maximize`` and ``decoupled_weight_decay`` (AdamW) shared."""

    _per_member_keys = ("lr", "betas", "eps", "weight_decay")
    _pair_keys = ("betas",)

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, B: int | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults, B)

    def _check_group(self, group: dict) -> None:
        for key in ("lr", "eps", "weight_decay"):
            if any(v < 0 for v in group[key]):
                raise ValueError(f"Adam {key} must be >= 0 for every member, got {group[key]}")
        if any(not (0 <= b1 < 1 and 0 <= b2 < 1) for b1, b2 in group["betas"]):
            raise ValueError(f"Adam betas must lie in [0, 1) for every member, got {group['betas']}")

    def _update(self) -> None:
        """One Adam(W) step for every member (see ``step``).

        ``torch._foreach_*`` calls over all of a group's parameters, in torch's single-tensor
        order of operations (bias corrections computed per member in double precision).
        """
        c = self._coefs
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1 = [b[0] for b in group["betas"]]
            beta2 = [b[1] for b in group["betas"]]
            amsgrad = group["amsgrad"]
            # parameters bucketed by their step count (all alike unless some missed a step)
            buckets: dict[int, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                buckets.setdefault(state["step"], []).append(p)
            for step, params in buckets.items():
                states = [self.state[p] for p in params]
                grads = [p.grad for p in params]
                if group["maximize"]:
                    grads = torch._foreach_neg(grads)
                exp_avg = [s["exp_avg"] for s in states]
                exp_avg_sq = [s["exp_avg_sq"] for s in states]
                if any(v != 0 for v in wd):
                    if group["decoupled_weight_decay"]:
                        _foreach_scale_(params, c.each([1.0 - a * w for a, w in zip(lr, wd)], params))
                    else:
                        grads = _foreach_add_scaled(grads, params, c.each(wd, params))
                one_minus_b1 = c.each([1.0 - b for b in beta1], params)
                torch._foreach_lerp_(exp_avg, grads, one_minus_b1)
                _foreach_scale_(exp_avg_sq, c.each(beta2, params))
                one_minus_b2 = c.each([1.0 - b for b in beta2], params)
                if isinstance(one_minus_b2, float):
                    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=one_minus_b2)
                else:
                    torch._foreach_addcmul_(exp_avg_sq, torch._foreach_mul(grads, one_minus_b2), grads)
                if amsgrad:
                    second = [s["max_exp_avg_sq"] for s in states]
                    torch._foreach_maximum_(second, exp_avg_sq)
                else:
                    second = exp_avg_sq
                denom = torch._foreach_sqrt(second)
                # a float or a list of [B, 1, ...] tensors: both are foreach operands
                torch._foreach_div_(denom, c.each([math.sqrt(1 - b**step) for b in beta2], params))
                torch._foreach_add_(denom, c.each(eps, params))
                neg_step = c.each([-a / (1 - b**step) for a, b in zip(lr, beta1)], params)
                if isinstance(neg_step, float):
                    torch._foreach_addcdiv_(params, exp_avg, denom, value=neg_step)
                else:
                    torch._foreach_addcmul_(params, torch._foreach_div(exp_avg, denom), neg_step)


class FusedAdamW(FusedAdam):
    """``torch.optim.AdamW`` for B members (Adam with decoupled weight decay, default 1e-2)."""

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, B: int | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, B=B)


OPTIMIZERS: dict[str, type[_FusedOptimizer]] = {"sgd": FusedSGD, "adam": FusedAdam, "adamw": FusedAdamW}
"""Fused optimizers by the name a settings file uses."""


def check_settings(name: str, settings: Sequence[dict]) -> None:
    """Raise ``ValueError`` if ``make_optimizer(name, ..., settings)`` would refuse the settings
    (unknown optimizer or key, a shared option that differs, a value of the wrong type or out of
    range), without building an optimizer: ``torch.optim.Optimizer`` imports ``torch._dynamo``
    (~1 s), too slow for validating a config file in every daemon."""
    cls, kwargs = _optimizer_kwargs(name, settings)
    params = inspect.signature(cls.__init__).parameters.values()
    group = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    group.update(kwargs)
    for key in cls._per_member_keys:
        group[key] = _per_member(key, group[key], len(settings), pair=key in cls._pair_keys)
    cls._check_group(cls.__new__(cls), group)  # the same range checks add_param_group runs


def _optimizer_kwargs(name: str, settings: Sequence[dict]) -> tuple[type[_FusedOptimizer], dict]:
    """The optimizer class and its keyword arguments for per-member ``settings``."""
    try:
        cls = OPTIMIZERS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown fused optimizer {name!r}; expected one of {sorted(OPTIMIZERS)}") from None
    B = len(settings)
    if B < 1:
        raise ValueError("settings must hold one dict per member, got none")
    sig = inspect.signature(cls.__init__)
    allowed = [k for k in sig.parameters if k not in ("self", "params", "B")]
    kwargs: dict = {}
    for key in sorted({k for s in settings for k in s}):
        if key not in allowed:
            raise ValueError(f"unknown hyper-parameter {key!r} for fused {name}; expected some of {allowed}")
        default = sig.parameters[key].default
        values = [s.get(key, default) for s in settings]
        if key in cls._per_member_keys:
            kwargs[key] = values
        elif any(v != values[0] for v in values):
            raise ValueError(f"{key} must be the same in every member (it is not per-member), got {values}")
        else:
            kwargs[key] = values[0]
    return cls, kwargs


def make_optimizer(name: str, params: Iterable, settings: Sequence[dict]) -> _FusedOptimizer:
    """The fused optimizer ``name`` over ``params`` with member b's hyper-parameters taken from
    ``settings[b]`` (keys as in torch: ``lr``, ``momentum``, ``betas``, ...; a missing key takes
    torch's default). Shared options (``nesterov``, ``amsgrad``, ``maximize``) must agree."""
    cls, kwargs = _optimizer_kwargs(name, settings)
    return cls(params, B=len(settings), **kwargs)
