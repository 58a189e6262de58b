"""The interface every fused operator shares: B members, loading and exporting member b."""

from __future__ import annotations

import torch
from torch import nn


class FusedModule(nn.Module):
    """A module that computes B independent copies of one ``torch.nn`` module at once.

    Every parameter and buffer that belongs to members has a leading dimension of size B;
    ``param[b]`` is exactly member b's tensor of the same name in the torch module (same
    shape, same meaning), so a parameter server can hold the fused tensors and write new
    values back into them in place.

    Subclasses set ``torch_type`` (the module they mirror) and implement ``load_member`` and
    ``export_member``.
    """

    torch_type: type[nn.Module] = nn.Module
    in_arrangement: str = "dense"  # arrangement.DENSE or arrangement.IMAGE; set by the converter
    out_arrangement: str = "dense"

    def __init__(self, B: int) -> None:
        super().__init__()
        if not isinstance(B, int) or B < 1:
            raise ValueError(f"B (number of fused members) must be an int >= 1, got {B!r}")
        self.B = B

    def load_member(self, b: int, module: nn.Module) -> None:
        """Copy ``module``'s parameters and buffers into member b (no autograd history)."""
        raise NotImplementedError

    def export_member(self, b: int) -> nn.Module:
        """Member b as a new, independent ``torch.nn`` module (copies, same device and mode)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"B={self.B}"

    # helpers for subclasses ---------------------------------------------------------------

    def _check_member(self, b: int, module: nn.Module | None = None) -> None:
        if not isinstance(b, int) or not 0 <= b < self.B:
            raise IndexError(f"member index must be an int in [0, {self.B}), got {b!r}")
        if module is not None and type(module) is not self.torch_type:
            raise TypeError(
                f"{type(self).__name__} member {b} expects a {self.torch_type.__name__}, "
                f"got {type(module).__name__}"
            )

    def _copy_in(self, name: str, b: int, src: torch.Tensor | None) -> None:
        """``self.<name>[b] = src`` with shape checking; ``None`` on both sides is fine."""
        dst = getattr(self, name)
        if dst is None or src is None:
            if (dst is None) != (src is None):
                raise ValueError(
                    f"{type(self).__name__}.{name}: the fused op and member {b} disagree on "
                    f"whether {name} exists"
                )
            return
        if tuple(dst.shape[1:]) != tuple(src.shape):
            raise ValueError(
                f"{type(self).__name__}.{name}: member {b} has shape {tuple(src.shape)}, "
                f"expected {tuple(dst.shape[1:])}"
            )
        with torch.no_grad():
            dst[b].copy_(src)

    def _copy_out(self, name: str, b: int, dst: torch.Tensor | None) -> None:
        src = getattr(self, name)
        if src is None or dst is None:
            return
        with torch.no_grad():
            dst.copy_(src[b])

    def _like(self) -> dict:
        """``device``/``dtype`` of this module's first floating parameter or buffer."""
        for t in list(self.parameters()) + list(self.buffers()):
            if t.is_floating_point():
                return {"device": t.device, "dtype": t.dtype}
        for t in self.buffers():
            return {"device": t.device}
        return {}

    def _blank(self, ctor, *args, **kwargs) -> nn.Module:
        """``ctor(*args, **kwargs)`` built on the meta device, then given uninitialised storage
        on this module's device and dtype: no init work, no draw from the global RNG (exporting
        a member must not change what later training does). Every tensor must then be copied in.
        """
        like = self._like()
        with torch.device("meta"):
            m = ctor(*args, **kwargs)
        m = m.to_empty(device=like.get("device", "cpu"))
        return m.to(dtype=like["dtype"]) if "dtype" in like else m
