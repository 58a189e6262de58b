"""Target stop rules judged on the parameters a job hands back (pure; docs/report.md, ``final``).

A worker's evaluation is of its own replica, so a target it reaches is only a candidate: the
scheduler confirms it on the parameters pulled from the shards, which then are the job's result,
so that the stop and the final evaluation judge the same values (an allreduce job's rank 0 judges
its own, identical replica). :func:`target_reason` checks metrics against the targets;
:class:`TargetConfirmation` keeps one confirmation at a time and spaces out retries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from hmp.train.task import metric_direction


class _Targets(Protocol):
    """What :func:`target_reason` reads: ``[train]``'s targets (0: none)."""

    target_accuracy: float
    target_loss: float
    target_metric: str
    target: float
    target_mode: str


def target_reason(metrics: Mapping[str, Any], train: _Targets) -> str:
    """The stop reason when ``metrics`` (``test_accuracy``, ``test_loss``, the task's others) meet a target of
    ``train`` (``target_accuracy``, ``target_loss``, or ``target`` of ``target_metric`` in its direction), else ""."""
    acc, loss = metrics.get("test_accuracy"), metrics.get("test_loss")
    if train.target_accuracy and isinstance(acc, (int, float)) and acc >= train.target_accuracy:
        return f"target accuracy {train.target_accuracy} reached ({acc:.4f})"
    if train.target_loss and isinstance(loss, (int, float)) and loss <= train.target_loss:
        return f"target test loss {train.target_loss} reached ({loss:.4f})"
    name = getattr(train, "target_metric", "")  # (an object of the two older targets only has none)
    value = metrics.get(name) if name else None
    if isinstance(value, (int, float)) and value == value:
        lower = metric_direction(name, train.target_mode) == "min"
        if (value <= train.target) if lower else (value >= train.target):
            return f"target {name} {'<=' if lower else '>='} {train.target} reached ({value:.4f})"
    return ""


@dataclasses.dataclass
class TargetConfirmation:
    """Candidates (a worker reported a target reached) and their confirmations (the evaluation of the
    parameters that would be the result). ``retry_after_s``: after a rejection, the next candidate is
    taken no sooner (a worker's reports repeat its last evaluation until its next one)."""

    retry_after_s: float
    in_flight: bool = False
    next_at: float = float("-inf")
    #: candidates whose parameters did not meet the target: ``{t, candidate, metrics}``, the last 20
    rejected: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    rejections: int = 0

    def offer(self, now: float) -> bool:
        """A candidate at ``now``: True when it should be confirmed now (none in flight, not too soon)."""
        if self.in_flight or now < self.next_at:
            return False
        self.in_flight = True
        return True

    def judged(self, candidate: str, metrics: Mapping[str, Any], train: _Targets, now: float, t: float) -> str:
        """The confirmation's evaluation ``metrics``: the stop reason when they meet the target ("" when not:
        the rejection is recorded and the next candidate waits ``retry_after_s``). ``t``: the run's clock."""
        self.in_flight = False
        reason = target_reason(metrics, train)
        if not reason:
            self.rejections += 1
            self.next_at = now + self.retry_after_s
            self.rejected.append({"t": round(t, 4), "candidate": candidate,
                                  **{k: metrics[k] for k in ("test_accuracy", "test_loss", getattr(train, "target_metric", ""), "error")
                                     if k and k in metrics}})
            del self.rejected[:-20]
        return reason
