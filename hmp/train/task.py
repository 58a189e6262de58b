"""A job's task: how a batch becomes a loss, and how the model is scored on the test split (docs/task.md).

Every worker kind (PS workers, ring workers, Hogwild threads, a pipeline's last stage), the job manager's
profiler and the scheduler's final evaluation take their training step and their evaluation from one
:class:`Task`, built from ``[train] task`` by :func:`task_of`: the built-ins ``classification``
(cross-entropy; ``test_accuracy``, ``test_loss``) and ``regression`` (mean squared error; ``r2``, ``rmse``,
``test_loss``), or the user's own loss function or whole-model step (with an optional scorer), named by
an import path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from hmp import models
from hmp.config import Config
from hmp.data import whole_batch
from hmp.errors import ConfigError

#: ``(output, target) -> batch-mean loss``
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``(model, (x, y)) -> batch-mean loss``
StepFn = Callable[[torch.nn.Module, tuple[Any, torch.Tensor]], torch.Tensor]
#: ``(model, (x, y)) -> {metric name: number}``
ScoreFn = Callable[[torch.nn.Module, tuple[Any, torch.Tensor]], Mapping[str, float]]

BUILTIN_TASKS = ("classification", "regression")
TASK_KINDS = ("loss", "step")
TARGET_MODES = ("auto", "max", "min")

#: The metrics each built-in task reports, the first being what progress lines and plots show.
BUILTIN_METRICS = {"classification": ("test_accuracy", "test_loss"), "regression": ("r2", "rmse", "test_loss")}

#: Metric names whose better direction is known (``[train] target_mode = "auto"``); a name ending in
#: ``loss`` or ``error`` is lower-is-better too.
HIGHER_IS_BETTER = frozenset({"test_accuracy", "accuracy", "r2", "auc", "f1", "precision", "recall"})
LOWER_IS_BETTER = frozenset({"test_loss", "rmse", "mse", "mae"})

#: What workers report besides an evaluation: a scorer's metric may not take one of these names (the
#: report could not tell them apart), and an allreduce job's final evaluation is its last evaluating
#: report minus these (:func:`evaluation_of`).
PROGRESS_KEYS = frozenset({
    "t", "samples", "updates", "loss", "epoch", "samples_per_s", "busy_fraction", "batch_size", "busy_s",
    "bytes_out", "bytes_in", "version", "rows_pushed", "lr", "resyncs", "ring_generation", "step_s",
    "params_crc32", "model_exported", "plan", "stage", "aborted_micro_batches", "step", "push_s", "idle_s",
    "stage_samples_per_s", "stage_capacity", "stage_busy_fraction", "stage_push_fraction", "stage_idle_fraction",
    "plan_seconds", "pipeline_done", "evaluated_by", "parameters", "error"})


def evaluation_of(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The evaluation's metrics among a worker's ``metrics`` (its report): every number but the progress counters
    (:data:`PROGRESS_KEYS`, an HFTA member's ``member<b>_loss``)."""
    return {k: v for k, v in metrics.items() if k not in PROGRESS_KEYS and isinstance(v, (int, float))
            and not (k.startswith("member") and k.endswith("_loss"))}


def metric_direction(name: str, mode: str = "auto") -> str | None:
    """``"max"`` (higher is better) or ``"min"`` for metric ``name``; ``mode`` (``[train] target_mode``) other than
    ``"auto"`` decides itself. None: not known (a user's metric with ``mode = "auto"``)."""
    if mode in ("max", "min"):
        return mode
    if name in HIGHER_IS_BETTER:
        return "max"
    if name in LOWER_IS_BETTER or name.endswith(("loss", "error")):
        return "min"
    return None


def better(name: str, value: float, than: float | None, mode: str = "auto") -> bool:
    """Whether ``value`` of metric ``name`` beats ``than`` (None: nothing yet)."""
    if than is None or than != than:
        return True
    return value < than if metric_direction(name, mode) == "min" else value > than


def r2_rmse(pred: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """R^2 (the mean over output columns of ``1 - SSE / SST``, as scikit-learn's ``r2_score``; a constant
    column scores 1.0 when predicted exactly, else 0.0) and the root mean squared error over all values."""
    p = pred.double().reshape(len(pred), -1)
    t = target.double().reshape(len(target), -1)
    sse = (p - t).square().sum(0)
    sst = (t - t.mean(0)).square().sum(0)
    per_column = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-300), (sse == 0).double())
    rmse = math.sqrt(float(sse.sum()) / max(1, t.numel()))
    return float(per_column.mean()), rmse


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of ``output`` against float ``target`` ``[N]`` or ``[N, k]``: an output ``[N, 1]`` for a
    target ``[N]`` is read as ``[N]`` (never broadcast to ``[N, N]``)."""
    if output.shape != target.shape:
        if output.numel() != target.numel():
            raise ValueError(f"regression: the model outputs {list(output.shape)} for targets {list(target.shape)}; "
                             f"expected one output per target value")
        output = output.reshape(target.shape)
    return F.mse_loss(output, target.to(output.dtype))


@dataclasses.dataclass(frozen=True)
class Task:
    """How a batch becomes a loss (:meth:`loss`) and how a model is scored (:meth:`evaluate`).

    ``name``: ``classification``, ``regression`` or the import path; ``loss_fn``: ``(output, target)`` ->
    loss, None for a whole-model step (``step_fn``); ``score_fn``: the user's scorer (None: the task's own
    metrics); ``targets``: ``"classes"`` (int64 class ids) or ``"values"`` (float targets), what the data
    is loaded as by default; ``metrics``: the metrics it reports as far as known before an evaluation (a
    scorer's names are known once it ran)."""

    name: str
    loss_fn: LossFn | None = None
    step_fn: StepFn | None = None
    score_fn: ScoreFn | None = None
    targets: str = "classes"
    metrics: tuple[str, ...] = ("test_loss",)

    def __post_init__(self) -> None:
        if (self.loss_fn is None) == (self.step_fn is None):
            raise ValueError("a Task needs exactly one of loss_fn (output, target) and step_fn (model, batch)")

    @property
    def builtin(self) -> bool:
        return self.name in BUILTIN_TASKS

    @property
    def primary(self) -> str:
        """The metric progress lines and plots show (the first of :attr:`metrics`)."""
        return self.metrics[0]

    def loss(self, model: torch.nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        """The batch-mean loss of ``model`` on ``(x, y)`` (a graph to call ``backward`` on)."""
        if self.step_fn is not None:
            out = self.step_fn(model, (x, y))
        else:
            out = self.loss_fn(model(x), y)
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise TypeError(f"task {self.name!r}: the loss must be a one-element tensor, got "
                            f"{type(out).__name__}{list(out.shape) if isinstance(out, torch.Tensor) else ''}")
        return out.reshape(())

    def evaluate(self, model: torch.nn.Module, x: Any, y: torch.Tensor, batch: int = 4096) -> dict[str, float]:
        """The test metrics of ``model`` on ``(x, y)``, ``batch`` rows at a time, in eval mode (restored after).
        ``x``: a feature tensor, or :class:`hmp.data.CSRRows`. Always ``test_loss`` (the mean of the task's
        loss); classification adds ``test_accuracy``, regression ``r2`` and ``rmse``, a scorer its own."""
        device = next(model.parameters()).device
        n = len(y)
        total, correct = 0.0, 0
        preds: list[torch.Tensor] = []
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for i in range(0, n, batch):
                    xb, yb = whole_batch(x[i:i + batch]).to(device), y[i:i + batch].to(device)
                    if self.name == "classification":
                        out = model(xb)
                        total += F.cross_entropy(out, yb, reduction="sum").item()
                        correct += (out.argmax(1) == yb).sum().item()
                    elif self.name == "regression":
                        out = model(xb)
                        out = out.reshape(yb.shape) if out.numel() == yb.numel() else out
                        total += mse_loss(out, yb).item() * len(yb)
                        preds.append(out.detach().cpu())
                    else:
                        total += self.loss(model, xb, yb).item() * len(yb)
                scores = self.score(model, x, y, device) if self.score_fn is not None else {}
        finally:
            model.train(was_training)
        out_metrics = {"test_loss": total / max(1, n)}
        if self.name == "classification":
            out_metrics["test_accuracy"] = correct / max(1, n)
        elif self.name == "regression" and n:
            out_metrics["r2"], out_metrics["rmse"] = r2_rmse(torch.cat(preds), y)
        out_metrics.update(scores)
        return out_metrics

    def score(self, model: torch.nn.Module, x: Any, y: torch.Tensor, device: torch.device) -> dict[str, float]:
        """The user's scorer on the whole test split, its metrics checked: numbers under names of their own."""
        got = self.score_fn(model, (whole_batch(x).to(device), y.to(device)))
        if not isinstance(got, Mapping):
            raise TypeError(f"task scorer of {self.name!r}: expected a dict of metrics, got {type(got).__name__}")
        out = {}
        for k, v in got.items():
            if not isinstance(k, str) or k in PROGRESS_KEYS:
                raise ValueError(f"task scorer of {self.name!r}: metric name {k!r} is taken by the worker's own "
                                 f"report ({sorted(PROGRESS_KEYS)}); choose another")
            out[k] = float(v.item() if isinstance(v, torch.Tensor) else v)
        return out


CLASSIFICATION = Task("classification", loss_fn=F.cross_entropy, targets="classes",
                      metrics=BUILTIN_METRICS["classification"])
REGRESSION = Task("regression", loss_fn=mse_loss, targets="values", metrics=BUILTIN_METRICS["regression"])


def resolve(task: str, kind: str = "loss", score: str = "", relative_to: str | Path | None = None) -> Task:
    """The :class:`Task` that ``task`` (a built-in name or an import path), ``kind`` (``"loss"``: it names
    ``(output, target) -> loss``; ``"step"``: ``(model, (x, y)) -> loss``) and ``score`` (an import path to
    ``(model, (x, y)) -> dict``, or "") name; import paths to files are relative to ``relative_to``. Raises
    :class:`ValueError` saying what is wrong (:func:`check_config` turns it into a ConfigError)."""
    if task in BUILTIN_TASKS:
        if score:
            raise ValueError(f"no scorer for the built-in task {task!r} (it reports {list(BUILTIN_METRICS[task])}); "
                             "a scorer goes with a task of your own")
        if kind != "loss":
            raise ValueError(f"task_kind = \"loss\" for the built-in task {task!r}, got {kind!r}")
        return CLASSIFICATION if task == "classification" else REGRESSION
    if not models.is_import_path(task):
        raise ValueError(f"one of {list(BUILTIN_TASKS)} or an import path to a function of your own "
                         f"('package.module:function' or 'path/to/file.py:function', relative to the config "
                         f"file), got {task!r}")
    if kind not in TASK_KINDS:
        raise ValueError(f"task_kind: one of {list(TASK_KINDS)}, got {kind!r}")
    fn = models.import_object(task, relative_to)
    score_fn = models.import_object(score, relative_to) if score else None
    if kind == "loss":
        return Task(task, loss_fn=fn, score_fn=score_fn, targets="classes")
    return Task(task, step_fn=fn, score_fn=score_fn, targets="classes")


@functools.cache
def _resolved(task: str, kind: str, score: str, relative_to: str) -> Task:
    return resolve(task, kind, score, relative_to)


def primary_metric(cfg: Config) -> str:
    """What progress lines, the scheduler's best figure and the plot follow: ``[train] target_metric``, else
    the task's first metric (test_accuracy, r2, or test_loss for a task of your own)."""
    t = cfg.train
    return t.target_metric or (BUILTIN_METRICS[t.task][0] if t.task in BUILTIN_METRICS else "test_loss")


def task_of(cfg: Config | None) -> Task:
    """The task of ``cfg``'s ``[train]`` (resolved once per process; no config: classification)."""
    if cfg is None:
        return CLASSIFICATION
    t = cfg.train
    return _resolved(t.task, t.task_kind, t.task_score, str(models.config_dir(cfg)))


def targets_of(cfg: Config) -> str:
    """What the data's targets are loaded as: ``[data] targets``, or the task's (``values`` for regression)."""
    if cfg.data.targets:
        return cfg.data.targets
    return "values" if cfg.train.task == "regression" else "classes"


def check_config(cfg: Config) -> None:
    """``[train] task``, ``task_kind`` and ``task_score`` name what can be called, and what the job's other
    parts need of the task holds: a pipeline's last stage takes a loss of the output (not a whole-model step),
    an HFTA sweep trains classifiers only. Every error a ConfigError naming the key."""
    p, t = cfg.path, cfg.train
    if t.task_score and t.task in BUILTIN_TASKS:
        raise ConfigError(p, "train.task_score", f"empty for the built-in task {t.task!r} (it reports "
                                                 f"{list(BUILTIN_METRICS[t.task])}); a scorer goes with a task of "
                                                 "your own (docs/task.md)")
    try:
        task = resolve(t.task, t.task_kind, "", models.config_dir(cfg))
    except (ValueError, models.ModelNotFound) as exc:
        raise ConfigError(p, "train.task", f"a loss function (task_kind = \"loss\") or step function "
                                           f"(task_kind = \"step\") to train with; {exc}"
                          if models.is_import_path(t.task) else str(exc)) from None
    if t.task_score:
        try:
            models.import_object(t.task_score, models.config_dir(cfg))
        except models.ModelNotFound as exc:
            raise ConfigError(p, "train.task_score", f"a scorer function (model, (x, y)) -> dict of metrics; "
                                                     f"{exc}") from None
    reported = task.metrics if task.builtin else ("test_loss", "<your scorer's metrics>" if t.task_score else "")
    if t.target_accuracy and "test_accuracy" not in task.metrics:
        raise ConfigError(p, "train.target_accuracy", f"0 for train.task = {t.task!r}: it reports no test_accuracy; "
                                                      "use target_metric and target")
    if t.target_metric:
        unknown = t.target_metric not in task.metrics and (task.builtin or not t.task_score)
        if unknown:
            raise ConfigError(p, "train.target_metric", f"a metric train.task = {t.task!r} reports, one of "
                                                        f"{[m for m in reported if m]}, got {t.target_metric!r}")
        if metric_direction(t.target_metric, t.target_mode) is None:
            raise ConfigError(p, "train.target_mode", f"\"max\" or \"min\" for target_metric = {t.target_metric!r}: "
                                                      "whether higher or lower is better is not known for that name")
    if cfg.placement.enabled and task.step_fn is not None:
        raise ConfigError(p, "train.task_kind", "\"loss\" in a [placement] job: the pipeline's last stage sees only "
                                                "its own layers' output, so it can apply a loss (output, target) "
                                                "but not a step of the whole model")
    if cfg.sweep.members and t.task != "classification":
        raise ConfigError(p, "train.task", f"\"classification\" in an HFTA sweep ([sweep] members): the fused "
                                           f"members train with a fused cross-entropy, got {t.task!r}")


__all__ = ["BUILTIN_METRICS", "BUILTIN_TASKS", "CLASSIFICATION", "HIGHER_IS_BETTER", "LOWER_IS_BETTER",
           "PROGRESS_KEYS", "REGRESSION", "TARGET_MODES", "TASK_KINDS", "Task", "better", "check_config", "evaluation_of",
           "metric_direction", "mse_loss", "primary_metric", "r2_rmse", "resolve", "targets_of", "task_of"]
