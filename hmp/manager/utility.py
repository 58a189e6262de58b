"""A job file's ``[submit] utility`` table -> the utility function the schedulers maximise (hmp.gadget.jobs).

    utility = { kind = "linear", value = 1.0, zero_at_s = 600 }                  # value x max(0, 1 - t / zero_at_s)
    utility = { kind = "sigmoid", value = 1.0, deadline_s = 300, width_s = 30 }  # value / (1 + exp((t - deadline_s) / width_s))
    utility = { kind = "convergence", value = 1.0, converge_s = 120, grace_s = 300 }  # full value until converge_s,
                                                                                  # then linearly down to 0 by converge_s + grace_s

``t`` is the job's completion time (seconds from submission to its end). Errors are :class:`UtilityError`
naming the key (the caller makes a :class:`~hmp.errors.ConfigError` of it, adding the file).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hmp.gadget.interface import Utility
from hmp.gadget.jobs import ConvergenceStop, LinearDecay, SigmoidDeadline, check_utility

#: kind -> (class, its parameters in order, defaults)
KINDS: dict[str, tuple[type, tuple[str, ...], dict[str, float]]] = {
    "linear": (LinearDecay, ("value", "zero_at_s"), {"value": 1.0}),
    "sigmoid": (SigmoidDeadline, ("value", "deadline_s", "width_s"), {"value": 1.0}),
    "convergence": (ConvergenceStop, ("value", "converge_s", "grace_s"), {"value": 1.0}),
}


class UtilityError(ValueError):
    """A bad utility table: ``key`` (inside the table) and what was ``expected``."""

    def __init__(self, key: str, expected: str) -> None:
        super().__init__(f"utility.{key}: {expected}")
        self.key, self.expected = key, expected


def make_utility(table: Mapping[str, Any]) -> Utility:
    """The utility a ``[submit] utility`` table describes; :class:`UtilityError` otherwise."""
    kind = table.get("kind")
    if kind not in KINDS:
        raise UtilityError("kind", f"one of {sorted(KINDS)}, got {kind!r}")
    cls, params, defaults = KINDS[kind]
    extra = sorted(set(table) - {"kind", *params})
    if extra:
        raise UtilityError(extra[0], f"unknown key for a {kind} utility; expected {list(params)}")
    args = []
    for p in params:
        v = table.get(p, defaults.get(p))
        if v is None:
            raise UtilityError(p, f"a number > 0 (a {kind} utility needs {list(params)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise UtilityError(p, f"a number > 0, got {v!r}")
        args.append(float(v))
    u = cls(*args)
    check_utility(u, horizon_s=10 * max(args))
    return u


__all__ = ["KINDS", "UtilityError", "make_utility"]
