"""From B copies of a torch model to one fused model, and back.

``FUSED_OPS`` maps each supported ``torch.nn`` module type (exact type: a subclass may have
changed ``forward``) to a ``FusionRule``: how to build its fused operator and which arrangement
(``arrangement.DENSE`` ``[B, N, F]`` or ``arrangement.IMAGE`` ``[N, B, C, H, W]``) it reads and writes.
``nn.Sequential`` (nested too) is walked child by child and becomes ``FusedSequential``, whose
parameter names are the unfused model's (``"0.weight"``) with a leading ``[B]``. Anything
else raises ``UnsupportedModuleError`` naming the module and where it sits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hmp.errors import HmpError
from hmp.models import FieldEmbedding

from .base import FusedModule
from .chain import chain_params, chain_steps, hand_backward_allowed, linear_chain
from .conv import FusedConv1d, FusedConv2d
from .elementwise import ACTIVATIONS, CHANNELWISE, FusedChannelwise, FusedElementwise, FusedFlatten, FusedSoftmax
from .embedding import FusedEmbedding, FusedFieldEmbedding
from .arrangement import DENSE, IMAGE
from .linear import FusedLinear
from .norm import FusedBatchNorm1d, FusedBatchNorm2d, FusedLayerNorm


class UnsupportedModuleError(HmpError, TypeError):
    """A module the converter cannot fuse; the message names it, where it sits and why."""


@dataclass(frozen=True, slots=True)
class FusionRule:
    """How one torch module type is fused.

    ``build(module, B, arrangement)`` returns the fused operator (``arrangement`` is the arrangement its input
    arrives in, ``DENSE`` when nothing before it fixed one). ``arrangement_in``: the arrangement it needs
    (``None``: any). ``arrangement_out``: the arrangement it produces (``None``: the same as its input).
    """

    build: Callable[[nn.Module, int, str], FusedModule]
    arrangement_in: str | None = None
    arrangement_out: str | None = None


def _channelwise(m: nn.Module, B: int, arrangement: str) -> FusedModule:
    if getattr(m, "return_indices", False):
        raise ValueError("return_indices=True is not supported (expected a single tensor output)")
    return FusedChannelwise(m, B=B, spatial_dims=CHANNELWISE[type(m)])


FUSED_OPS: dict[type[nn.Module], FusionRule] = {
    nn.Linear: FusionRule(lambda m, B, _: FusedLinear.from_torch(m, B), DENSE, DENSE),
    nn.Conv1d: FusionRule(lambda m, B, _: FusedConv1d.from_torch(m, B), IMAGE, IMAGE),
    nn.Conv2d: FusionRule(lambda m, B, _: FusedConv2d.from_torch(m, B), IMAGE, IMAGE),
    nn.BatchNorm1d: FusionRule(lambda m, B, _: FusedBatchNorm1d.from_torch(m, B)),
    nn.BatchNorm2d: FusionRule(lambda m, B, _: FusedBatchNorm2d.from_torch(m, B), IMAGE, IMAGE),
    nn.LayerNorm: FusionRule(lambda m, B, lay: FusedLayerNorm.from_torch(m, B, lay)),
    nn.Embedding: FusionRule(lambda m, B, _: FusedEmbedding.from_torch(m, B), DENSE, DENSE),
    FieldEmbedding: FusionRule(lambda m, B, _: FusedFieldEmbedding.from_torch(m, B), DENSE, DENSE),
    nn.Flatten: FusionRule(lambda m, B, lay: FusedFlatten(m, B=B, arrangement=lay), None, DENSE),
    nn.Softmax: FusionRule(lambda m, B, lay: FusedSoftmax(m, B=B, arrangement=lay)),
    nn.LogSoftmax: FusionRule(lambda m, B, lay: FusedSoftmax(m, B=B, arrangement=lay)),
    **{t: FusionRule(lambda m, B, _: FusedElementwise(m, B=B)) for t in ACTIVATIONS},
    **{t: FusionRule(_channelwise, IMAGE, IMAGE) for t in CHANNELWISE},
}
"""Supported torch module type -> how to fuse it. Extend with ``register_fused_op``."""


def register_fused_op(torch_type: type[nn.Module], rule: FusionRule) -> None:
    """Teach the converter a new module type (e.g. a project-specific layer)."""
    if not (isinstance(torch_type, type) and issubclass(torch_type, nn.Module)):
        raise TypeError(f"expected an nn.Module subclass, got {torch_type!r}")
    FUSED_OPS[torch_type] = rule


class FusedSequential(FusedModule):
    """B copies of an ``nn.Sequential``: its children fused, under the same names, in order.

    ``in_arrangement``/``out_arrangement`` say what the first operator reads and the last one writes
    (``arrangement.DENSE`` or ``arrangement.IMAGE``).
    """

    torch_type = nn.Sequential
    hand_backward: bool = True
    """Differentiate Linear/activation runs by hand (``chain.py``): one autograd node per run,
    and ``FusedArray`` trains a fused MLP without autograd. Set False on an instance for
    per-op autograd, e.g. to back-propagate twice (``create_graph=True``), which the
    hand-written backward does not support."""

    def __init__(self, children: "OrderedDict[str, FusedModule]", *, B: int,
                 in_arrangement: str = DENSE, out_arrangement: str = DENSE) -> None:
        super().__init__(B)
        for name, child in children.items():
            self.add_module(name, child)
        self.in_arrangement, self.out_arrangement = in_arrangement, out_arrangement

    def _runs(self) -> list[tuple[bool, list[FusedModule]]]:
        """The children in order, grouped: ``(True, run)`` for two or more ``FusedLinear`` with
        only elementwise ops (activations, Dropout) between or around them, which ``forward``
        computes features-first (``[B, F, N]``: one transpose in, one out, none per layer);
        ``(False, [child])`` for anything else. Cached on first use."""
        cached = self.__dict__.get("_runs_cache")
        if cached is not None and cached[0] == list(self._modules.values()):
            return cached[1]
        children = list(self._modules.values())
        runs: list[tuple[bool, list[FusedModule]]] = []
        current: list[FusedModule] = []

        def flush() -> None:
            if sum(isinstance(c, FusedLinear) for c in current) >= 2:
                runs.append((True, list(current)))
            else:
                runs.extend((False, [c]) for c in current)
            current.clear()

        for child in children:
            if isinstance(child, FusedLinear) or type(child) is FusedElementwise:
                current.append(child)
            else:
                flush()
                runs.append((False, [child]))
        flush()
        self.__dict__["_runs_cache"] = (children, runs)
        return runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for chain, run in self._runs():
            if chain and x.dim() == 3:
                first = next(c for c in run if isinstance(c, FusedLinear))
                if x.shape[0] != self.B or x.shape[2] != first.in_features:
                    return first(x)  # raises the shape error naming [B, N, in_features]
                h = x.transpose(1, 2)  # [B, F, N]
                steps = (chain_steps(run) if torch.is_grad_enabled() and self.hand_backward
                         and hand_backward_allowed(h, [sub for m in run for sub in m.modules()]) else None)
                if steps is not None:  # one autograd node, hand-written backward (chain.py)
                    h = linear_chain(h, steps, chain_params(run))
                else:
                    for child in run:
                        h = child.forward_features_first(h) if isinstance(child, FusedLinear) else child(h)
                x = h.transpose(1, 2)
            else:
                for child in run:
                    x = child(x)
        return x

    def __getitem__(self, i: int) -> FusedModule:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def load_member(self, b: int, module: nn.Module) -> None:
        self._check_member(b, module)
        names = list(module._modules)
        if names != list(self._modules):
            raise ValueError(f"FusedSequential: member {b} has children {names}, "
                             f"expected {list(self._modules)}")
        for name, child in self._modules.items():
            try:
                child.load_member(b, module._modules[name])
            except (TypeError, ValueError) as e:
                raise type(e)(f"child {name!r}: {e}") from e

    def export_member(self, b: int) -> nn.Sequential:
        self._check_member(b)
        m = nn.Sequential(OrderedDict((name, child.export_member(b)) for name, child in self._modules.items()))
        return m.train(self.training)


def _needed_arrangement(module: nn.Module) -> str | None:
    """The arrangement ``module``'s input must arrive in, ``None`` when any will do."""
    if type(module) is nn.Sequential:
        for child in module._modules.values():
            need = _needed_arrangement(child)
            if need is not None:
                return need
            rule = FUSED_OPS.get(type(child))
            if rule is not None and rule.arrangement_out is not None:
                return None  # a arrangement-changing op (Flatten) accepts either arrangement
        return None
    rule = FUSED_OPS.get(type(module))
    return None if rule is None else rule.arrangement_in


def _convert(module: nn.Module, B: int, arrangement: str, path: str) -> tuple[FusedModule, str]:
    """Fuse ``module`` whose input arrives in ``arrangement``; returns it and its output arrangement."""
    if type(module) is nn.Sequential:
        children: OrderedDict[str, FusedModule] = OrderedDict()
        start = arrangement
        for name, child in module._modules.items():
            children[name], arrangement = _convert(child, B, arrangement, f"{path}.{name}")
        return FusedSequential(children, B=B, in_arrangement=start, out_arrangement=arrangement), arrangement
    rule = FUSED_OPS.get(type(module))
    if rule is None:
        names = sorted({t.__name__ for t in FUSED_OPS} | {"Sequential"})
        why = ("a module with its own forward cannot be fused automatically: build the model "
               "as nn.Sequential of supported layers, or register_fused_op() for it"
               if module._modules else "no fused operator is registered for it")
        raise UnsupportedModuleError(
            f"cannot fuse {path} ({type(module).__module__}.{type(module).__qualname__}): {why}; "
            f"supported: {', '.join(names)}")
    if rule.arrangement_in is not None and arrangement != rule.arrangement_in:
        shapes = {DENSE: "[B, N, F]", IMAGE: "[N, B, C, *spatial]"}
        raise UnsupportedModuleError(
            f"cannot fuse {path} ({type(module).__name__}): it needs {rule.arrangement_in} input "
            f"{shapes[rule.arrangement_in]} but gets {arrangement} {shapes[arrangement]} from the layer before "
            f"it (a Linear after a convolution needs an nn.Flatten between them)")
    try:
        fused = rule.build(module, B, arrangement)
    except ValueError as e:
        raise UnsupportedModuleError(f"cannot fuse {path} ({type(module).__name__}): {e}") from e
    fused.in_arrangement, fused.out_arrangement = arrangement, rule.arrangement_out or arrangement
    return fused, fused.out_arrangement


def fuse_models(models: Sequence[nn.Module], *, device=None) -> FusedModule:
    """One fused model whose member b is ``models[b]`` (weights, buffers and train/eval mode).

    All models must have the same architecture; the first is the template. The fused module
    is on ``device`` (default: where the models are) and has ``in_arrangement``/``out_arrangement``.
    """
    models = list(models)
    if not models:
        raise ValueError("expected at least one model to fuse, got none")
    B, template = len(models), models[0]
    # Building fused ops runs their initialisers; keep the global RNG untouched so that a run
    # that fuses its models draws the same random numbers afterwards as one that does not.
    devices = sorted({p.device.index or 0 for p in template.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        fused, _ = _convert(template, B, _needed_arrangement(template) or DENSE, "model")
    for b, m in enumerate(models):
        if type(m) is not type(template):
            raise TypeError(f"model {b} is a {type(m).__name__}, model 0 a {type(template).__name__}; "
                            "all members must share one architecture")
        fused.load_member(b, m)
    fused.train(template.training)
    return fused if device is None else fused.to(device)


def fuse(factory: Callable[[], nn.Module], B: int, *, device=None) -> FusedModule:
    """Call ``factory()`` B times (member b gets the b-th model, initialised as it would be if
    the B models were built one after another) and fuse the results; see ``fuse_models``."""
    if not isinstance(B, int) or B < 1:
        raise ValueError(f"B must be an int >= 1, got {B!r}")
    return fuse_models([factory() for _ in range(B)], device=device)
