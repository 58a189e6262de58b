"""The runtime model: what a staffed plan sustains on the running system, and its calibration.

The planner's cost model (:mod:`hmp.placement.cost_model`) sizes stages from per-layer compute and
boundary transfers alone; a pipeline here also pays micro-batch fill/drain, per-message CPU, the
per-step PS sync and the cores every daemon shares. This module predicts a plan's step time with
those terms and :func:`calibrate` refits them to what the running job measured, so that other
plans can be predicted on the same system. The formulas and the calibration are in
docs/placement.md, "Runtime model and calibration". Pure: no torch, no sockets.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hmp.placement.problem import PlacementProblem

#: Worker seconds per parameter byte of a stage's per-step PS sync (encode and send the gradient
#: chunks, receive the reply, write the new values back), before calibration: from the calibrated
#: runs of bench/pipeline.py (docs/placement.md, "Runtime model and calibration").
DEFAULT_SYNC_S_PER_BYTE = 4e-9
#: Fixed worker seconds per step (the drain's bookkeeping: averaging, switching gradient buffers,
#: stage 0's gather of the micro-batches, dispatching the push's replies), before calibration.
DEFAULT_STEP_S = 6e-4
#: Shard seconds per pushed byte (decode, the optimizer's update, the reply), before calibration.
DEFAULT_PS_S_PER_BYTE = 1.5e-9
#: A calibration needs at least this many steps from every worker of the plan's stages ...
MIN_CALIBRATION_STEPS = 8
#: ... over at least this many seconds of each worker's wall time, counted from its first report
#: under the plan (the plan's first moments, pulls and warm-up on a machine still busy with the
#: other daemons' start, are left out: calibrated on them the model predicted the MLP pipeline
#: too slow; docs/placement.md).
MIN_CALIBRATION_S = 1.0


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _non_negative(value: float, what: str) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class StageLoad:
    """One stage of a staffed plan, as the runtime model sees it.

    Attributes:
        resource: the stage's resource type name.
        compute_s: forward + backward of one micro-batch of the stage's layers on one worker.
        workers: workers of the stage (data parallel within it).
        param_bytes: bytes of the stage's parameters (pushed, and written back, once per step).
    """

    resource: str
    compute_s: float
    workers: int
    param_bytes: float = 0.0

    def __post_init__(self) -> None:
        _non_negative(self.compute_s, f"stage on {self.resource!r}: compute_s")
        _non_negative(self.param_bytes, f"stage on {self.resource!r}: param_bytes")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ValueError(f"stage on {self.resource!r}: workers must be an int >= 1, got {self.workers!r}")


@dataclass(frozen=True)
class RuntimeCosts:
    """What the running system costs beyond the layers' compute (see the module docstring).

    Attributes:
        cores: CPU cores the job's daemons share.
        message_s: CPU seconds per activation/gradient message at each end.
        sync_s_per_byte: worker seconds per parameter byte of the per-step push and write-back.
        step_s: fixed worker seconds per step.
        ps_s_per_byte: shard seconds per pushed byte.
        compute_scale: per resource type, what its profiled compute is multiplied by (1 where
            not calibrated; a calibration sets it from the running workers' busy time).
        source: ``"defaults"`` or what the figures were calibrated from (reports print it).
    """

    cores: float
    message_s: float
    sync_s_per_byte: float = DEFAULT_SYNC_S_PER_BYTE
    step_s: float = DEFAULT_STEP_S
    ps_s_per_byte: float = DEFAULT_PS_S_PER_BYTE
    compute_scale: Mapping[str, float] = field(default_factory=dict)
    source: str = "defaults"

    def __post_init__(self) -> None:
        if not (isinstance(self.cores, (int, float)) and math.isfinite(self.cores) and self.cores > 0):
            raise ValueError(f"cores must be a finite number > 0, got {self.cores!r}")
        for name in ("message_s", "sync_s_per_byte", "step_s", "ps_s_per_byte"):
            _non_negative(getattr(self, name), name)
        for r, s in self.compute_scale.items():
            if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0):
                raise ValueError(f"compute_scale[{r!r}] must be a finite number > 0, got {s!r}")

    def scale(self, resource: str) -> float:
        return float(self.compute_scale.get(resource, 1.0))

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> RuntimeCosts:
        """The inverse of :meth:`as_dict` (a run report's ``runtime_costs``)."""
        return cls(cores=float(d["cores"]), message_s=float(d["message_us"]) * 1e-6,  # type: ignore[arg-type]
                   sync_s_per_byte=float(d["sync_ns_per_byte"]) * 1e-9, step_s=float(d["step_us"]) * 1e-6,  # type: ignore[arg-type]
                   ps_s_per_byte=float(d["ps_ns_per_byte"]) * 1e-9,  # type: ignore[arg-type]
                   compute_scale=dict(d.get("compute_scale") or {}), source=str(d.get("source", "")))  # type: ignore[call-overload]

    def as_dict(self) -> dict[str, object]:
        return {"cores": self.cores, "message_us": self.message_s * 1e6, "sync_ns_per_byte": self.sync_s_per_byte * 1e9,
                "step_us": self.step_s * 1e6, "ps_ns_per_byte": self.ps_s_per_byte * 1e9,
                "compute_scale": dict(self.compute_scale), "source": self.source}


@dataclass(frozen=True)
class Prediction:
    """The runtime model's figures for one staffed plan (seconds are per step of one batch).

    Attributes:
        samples_per_s: ``batch_size / step_s``, the pipeline's (and so every stage's) throughput.
        step_s: ``max(path_s, cpu_s)``.
        path_s: the critical path ``T_path``.
        cpu_s: the CPU bound ``T_cpu``.
        worker_s: ``W_k`` per stage, one worker's work per step (scaled compute included).
        micro_batch_s: ``u_k`` per stage.
        bottleneck: the stage ``k`` that sets ``T_path``.
        sharing: ``step_s / path_s`` (>= 1): how much sharing the cores slows the critical path.
    """

    samples_per_s: float
    step_s: float
    path_s: float
    cpu_s: float
    worker_s: tuple[float, ...]
    micro_batch_s: tuple[float, ...]
    bottleneck: int
    sharing: float

    def as_dict(self) -> dict[str, object]:
        return {"samples_per_s": self.samples_per_s, "step_ms": self.step_s * 1e3, "path_ms": self.path_s * 1e3,
                "cpu_ms": self.cpu_s * 1e3, "worker_ms": [w * 1e3 for w in self.worker_s],
                "bottleneck": self.bottleneck, "sharing": self.sharing}


def messages_per_micro_batch(stage: int, n_stages: int) -> int:
    """``h_k``: messages a worker of stage ``stage`` handles per micro-batch (each way, in and out)."""
    return 2 * (int(stage > 0) + int(stage < n_stages - 1))


def micro_batches_per_worker(micro_batches: int, workers: int) -> int:
    """``n_k``: micro-batches the busiest worker of a stage handles per step (round-robin)."""
    return -(-micro_batches // workers)


def predict(stages: Sequence[StageLoad], micro_batches: int, batch_size: int, costs: RuntimeCosts) -> Prediction:
    """The runtime model's step time and throughput for ``stages`` (see the module docstring)."""
    if not stages:
        raise ValueError("a prediction needs at least one stage")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    S = len(stages)
    u = [costs.scale(s.resource) * s.compute_s + messages_per_micro_batch(k, S) * costs.message_s
         for k, s in enumerate(stages)]
    W = [micro_batches_per_worker(micro_batches, s.workers) * u[k] + costs.step_s + costs.sync_s_per_byte * s.param_bytes
         for k, s in enumerate(stages)]
    y = [costs.step_s + costs.sync_s_per_byte * s.param_bytes for s in stages]
    total_u = sum(u)
    paths = [W[k] + total_u - u[k] + max(0.0, max(y[:k], default=0.0) - y[k]) for k in range(S)]
    bottleneck = max(range(S), key=lambda k: paths[k])
    path = paths[bottleneck]
    cpu = (sum(s.workers * W[k] for k, s in enumerate(stages))
           + costs.ps_s_per_byte * sum(s.workers * s.param_bytes for s in stages)) / costs.cores
    step = max(path, cpu)
    return Prediction(samples_per_s=batch_size / step if step > 0 else math.inf, step_s=step, path_s=path, cpu_s=cpu,
                      worker_s=tuple(W), micro_batch_s=tuple(u), bottleneck=bottleneck,
                      sharing=step / path if path > 0 else 1.0)


@dataclass(frozen=True)
class StageMeasurement:
    """What a stage's workers measured under the running plan, per worker and step (wall seconds).

    Attributes:
        busy_s: forward + backward per step (the busiest worker's, or the workers' mean).
        other_s: the rest of a step that is not waiting for a message: the messages' handling,
            the push (and waiting for its reply), bookkeeping.
        steps: steps the figures average over (the fewest of the stage's workers).
    """

    busy_s: float
    other_s: float
    steps: float

    @classmethod
    def from_reports(cls, reports: Sequence[Mapping[str, float]], samples_per_step: Sequence[float],
                     since: Sequence[Mapping[str, float] | None] | None = None, *,
                     min_steps: float = MIN_CALIBRATION_STEPS, min_seconds: float = 0.0) -> StageMeasurement | None:
        """From the stage workers' reports (``hmp/nodes/stage_worker.py``'s ``stage_*`` metrics, which
        cover the plan's wall time so far, ``plan_seconds``), or None when any worker has fewer than
        ``min_steps`` steps or ``min_seconds`` of wall time yet.

        ``samples_per_step``: per report, the samples that worker handles per step (its micro-batches).
        ``since``: per report, an earlier report of the same worker under the same plan (or None): the
        figures then cover only the time between the two."""
        if not reports or len(samples_per_step) != len(reports) or min(samples_per_step) <= 0:
            return None
        since = list(since) if since is not None else [None] * len(reports)
        if len(since) != len(reports):
            raise ValueError(f"expected one earlier report (or None) per report, got {len(since)} for {len(reports)}")

        def totals(r: Mapping[str, float] | None) -> tuple[float, float, float, float]:
            if r is None:
                return 0.0, 0.0, 0.0, 0.0
            wall = float(r.get("plan_seconds", 0.0))
            return (wall, float(r.get("stage_samples_per_s", 0.0)) * wall,
                    float(r.get("stage_busy_fraction", 0.0)) * wall, float(r.get("stage_idle_fraction", 0.0)) * wall)

        busy, other, steps = [], [], []
        for r, base, per_step in zip(reports, since, samples_per_step):
            wall, samples, b, idle = (x - y for x, y in zip(totals(r), totals(base)))
            n = samples / per_step
            if n < max(min_steps, 1e-9) or wall <= 0 or wall < min_seconds:
                return None
            busy.append(b / n)
            other.append(max(0.0, wall - b - idle) / n)
            steps.append(n)
        return cls(busy_s=sum(busy) / len(busy), other_s=sum(other) / len(other), steps=min(steps))


@dataclass(frozen=True)
class Calibration:
    """The result of :func:`calibrate`: the calibrated costs and what they predict for the plan measured.

    Attributes:
        costs: the calibrated :class:`RuntimeCosts` (CPU figures: apply them to any plan).
        predicted: the calibrated model's prediction for the plan that was measured.
        overhead_scale: what the message, sync and per-step costs were multiplied by.
        sharing: the sharing factor the measured wall times were divided by.
        measured: the measurements it was fitted to, one per stage.
    """

    costs: RuntimeCosts
    predicted: Prediction
    overhead_scale: float
    sharing: float
    measured: tuple[StageMeasurement, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return {"costs": self.costs.as_dict(), "overhead_scale": self.overhead_scale, "sharing": self.sharing,
                "predicted": self.predicted.as_dict()}


def calibrate(stages: Sequence[StageLoad], measured: Sequence[StageMeasurement], micro_batches: int, batch_size: int,
              costs: RuntimeCosts) -> Calibration:
    """Fit the model's constants to what the running plan ``stages`` measured (one entry per stage).

    1. Per resource type ``r``: ``compute_scale[r] = sum busy / sum (n_k * c_k)`` over its stages
       (the real worker's forward + backward against the profile).
    2. The other per-step costs, ``other_k = n_k * h_k * message_s + step_s + sync_s_per_byte * P_k``:
       with ``step_s`` kept, ``message_s`` and ``sync_s_per_byte`` solve the stages' equations by
       least squares when there are two or more independent ones and the solution is positive;
       otherwise (one stage, or a degenerate fit) one factor ``lambda`` scales all three,
       ``other_k ~ lambda * (n_k * h_k * message_s + y_k)``, keeping their modelled proportions (a cost
       the plan does not incur, e.g. messages in a one-stage plan, keeps its figure).
       ``overhead_scale`` reports ``lambda`` (or, for the two-figure fit, the fitted over the modelled
       total).
    3. The figures so far are wall times under the running plan's sharing; the model's sharing
       factor on them, ``sigma = max(1, T_cpu / T_path)``, divides both scales, leaving CPU
       figures. On the running plan the calibrated prediction is then its critical path on the
       measured figures: the waiting (fill/drain) is what it predicts.
    """
    if len(measured) != len(stages):
        raise ValueError(f"expected one measurement per stage ({len(stages)}), got {len(measured)}")
    S = len(stages)
    n = [micro_batches_per_worker(micro_batches, s.workers) for s in stages]
    busy: dict[str, float] = {}
    profiled: dict[str, float] = {}
    for k, (s, m) in enumerate(zip(stages, measured)):
        busy[s.resource] = busy.get(s.resource, 0.0) + m.busy_s
        profiled[s.resource] = profiled.get(s.resource, 0.0) + n[k] * s.compute_s
    wall_scale = {r: busy[r] / profiled[r] for r in busy if profiled[r] > 0 and busy[r] > 0}
    msgs = [n[k] * messages_per_micro_batch(k, S) for k in range(S)]
    modelled = [msgs[k] * costs.message_s + costs.step_s + costs.sync_s_per_byte * s.param_bytes
                for k, s in enumerate(stages)]
    fit = _fit_message_and_sync(msgs, [s.param_bytes for s in stages], [m.other_s - costs.step_s for m in measured])
    if fit is not None:
        message_s, sync_s_per_byte, step_s = fit[0], fit[1], costs.step_s
        lam = sum(m.other_s for m in measured) / sum(modelled) if sum(modelled) > 0 else 1.0
    else:
        den = sum(a * a for a in modelled)
        lam = sum(a * m.other_s for a, m in zip(modelled, measured)) / den if den > 0 else 1.0
        lam = max(lam, 1e-3)  # the costs stay positive (a plan's figures never say a message is free)
        # A cost the measured plan does not incur (no messages: one stage) is not scaled: nothing measured it.
        message_s = costs.message_s * (lam if any(msgs) else 1.0)
        sync_s_per_byte = costs.sync_s_per_byte * (lam if any(s.param_bytes for s in stages) else 1.0)
        step_s = costs.step_s * lam
    wall = RuntimeCosts(cores=costs.cores, message_s=message_s, sync_s_per_byte=sync_s_per_byte,
                        step_s=step_s, ps_s_per_byte=costs.ps_s_per_byte,
                        compute_scale={**costs.compute_scale, **wall_scale}, source="calibrating")
    on_wall = predict(stages, micro_batches, batch_size, wall)
    sigma = max(1.0, on_wall.cpu_s / on_wall.path_s) if on_wall.path_s > 0 else 1.0
    # The shards' cost (never measured here) stays the CPU figure it was.
    cpu = replace(wall, message_s=wall.message_s / sigma, sync_s_per_byte=wall.sync_s_per_byte / sigma,
                  step_s=wall.step_s / sigma,
                  compute_scale={r: (s / sigma if r in wall_scale else s) for r, s in wall.compute_scale.items()},
                  source=f"calibrated on {sum(m.steps for m in measured) / len(measured):.0f} steps of the running plan")
    return Calibration(costs=cpu, predicted=predict(stages, micro_batches, batch_size, cpu), overhead_scale=lam,
                       sharing=sigma, measured=tuple(measured))


def _fit_message_and_sync(msgs: Sequence[float], param_bytes: Sequence[float],
                          target: Sequence[float]) -> tuple[float, float] | None:
    """Least squares ``target_k ~ o * msgs_k + s * param_bytes_k`` for ``(o, s)``, both > 0; None when
    the equations cannot separate them (fewer than two independent ones) or the fit is not positive."""
    a11 = sum(a * a for a in msgs)
    a22 = sum(b * b for b in param_bytes)
    a12 = sum(a * b for a, b in zip(msgs, param_bytes))
    det = a11 * a22 - a12 * a12
    if a11 <= 0 or a22 <= 0 or det <= 1e-9 * a11 * a22:  # collinear (or a single stage): not separable
        return None
    r1 = sum(a * t for a, t in zip(msgs, target))
    r2 = sum(b * t for b, t in zip(param_bytes, target))
    o, s = (a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det
    return (o, s) if o > 0 and s > 0 else None


def calibrated_problem(problem: PlacementProblem, costs: RuntimeCosts, profiled: PlacementProblem | None = None) -> PlacementProblem:
    """``problem`` (its counts) with the calibrated figures, for the planner: every layer's time on
    type ``r`` is the profiled one (``profiled``, default ``problem``) times ``compute_scale[r]``,
    and the per-message overhead is the calibrated ``message_s``. A type whose scale was fitted on
    the running workers is labelled measured (its source says so)."""
    base = profiled if profiled is not None else problem
    if [lay.name for lay in base.layers] != [lay.name for lay in problem.layers]:
        raise ValueError("the profiled problem and the problem have different layers")
    layers = tuple(replace(lay, time_s={r: t * costs.scale(r) for r, t in lay.time_s.items()}) for lay in base.layers)
    resources = tuple(replace(r, measured=True, source="calibrated on the running workers")
                      if r.name in costs.compute_scale and not r.measured else r for r in problem.resources)
    return replace(problem, layers=layers, resources=resources, message_overhead_s=costs.message_s)
