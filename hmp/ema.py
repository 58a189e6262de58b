"""The one exponential moving average of hmp (throughput estimates, training loss, RL baselines)."""

from __future__ import annotations


def ema(average: float | None, value: float, keep: float) -> float:
    """``keep * average + (1 - keep) * value``; ``value`` itself while there is no average yet
    (``average`` None or nan). ``keep`` in [0, 1) is the weight left on the old average."""
    if average is None or average != average:
        return value
    return keep * average + (1.0 - keep) * value
