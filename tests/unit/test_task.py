"""The job's task (hmp/train/task.py): built-in losses and metrics (R^2 and RMSE against scikit-learn), tasks of
the user's own by import path, the stop rule and the scheduler's followed metric, float targets in the data,
and every config error naming its key."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hmp.errors import ConfigError
from hmp.train import task as task_mod
from tests.support import nodes_toml

USER_TASK = """
import torch
from torch.nn import functional as F

def huber(output, target):
    return F.huber_loss(output.reshape(target.shape), target, delta=5.0)

def step(model, batch):
    x, y = batch
    return F.mse_loss(model(x).reshape(y.shape), y)

def score(model, batch):
    x, y = batch
    return {"mae": (model(x).reshape(y.shape) - y).abs().mean().item()}

def bad_score(model, batch):
    return {"loss": 1.0}

def broken(output, target):
    raise RuntimeError("the user's loss is broken")
"""


def job_text(tmp: Path, *, train: str = "", data: str = 'kind = "diabetes"', model: str = "deep_mlp",
             args: str = "{ in_features = 10, width = 8, depth = 1, classes = 1 }", extra: str = "",
             task: str = 'task = "regression"') -> str:
    return f"""
[job]
name = "t"
report_dir = "{tmp / 'run'}"

[model]
name = "{model}"
args = {args}

[data]
{data}

[train]
{task}
{train}
{extra}
""" + nodes_toml(("scheduler", "scheduler", 'bind = "tcp://127.0.0.1:5555"'), ("ps0", "ps"),
                 ("cpu0", "cpu_worker"))


def load(tmp: Path, **kw):
    from hmp import job

    path = tmp / "job.toml"
    path.write_text(job_text(tmp, **kw))
    return job.load(path)


def config_error(tmp: Path, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp, **kw)
    return info.value


# ---------------------------------------------------------------------------- losses and metrics


def test_builtin_losses_are_cross_entropy_and_mse():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x, labels = torch.randn(8, 4), torch.randint(0, 3, (8,))
    assert torch.allclose(task_mod.CLASSIFICATION.loss(model, x, labels), F.cross_entropy(model(x), labels))
    one = nn.Linear(4, 1)
    y = torch.randn(8)
    loss = task_mod.REGRESSION.loss(one, x, y)
    # [N, 1] against [N] is read as [N], not broadcast to [N, N]
    assert torch.allclose(loss, ((one(x).squeeze(1) - y) ** 2).mean())
    with pytest.raises(ValueError, match="one output per target value"):
        task_mod.REGRESSION.loss(nn.Linear(4, 2), x, y)


@pytest.mark.parametrize("columns", [1, 3])
def test_r2_and_rmse_match_scikit_learn(columns):
    from sklearn.metrics import mean_squared_error, r2_score

    rng = np.random.default_rng(columns)
    target = rng.normal(size=(50, columns)).astype(np.float32) * 40 + 100
    pred = target + rng.normal(size=(50, columns)).astype(np.float32) * 15
    if columns == 1:
        target, pred = target[:, 0], pred[:, 0]
    r2, rmse = task_mod.r2_rmse(torch.from_numpy(pred), torch.from_numpy(target))
    assert r2 == pytest.approx(r2_score(target, pred), abs=1e-6)
    assert rmse == pytest.approx(math.sqrt(mean_squared_error(target, pred)), rel=1e-6)


def test_regression_evaluation_reports_r2_rmse_and_loss_by_name():
    from sklearn.metrics import r2_score

    torch.manual_seed(1)
    model = nn.Linear(5, 1)
    x = torch.randn(300, 5)
    y = (x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.3 * torch.randn(300)).float()
    got = task_mod.REGRESSION.evaluate(model, x, y, batch=64)  # batches: the metrics are of the whole split
    pred = model(x).detach().squeeze(1).numpy()
    assert set(got) == {"r2", "rmse", "test_loss"}
    assert got["r2"] == pytest.approx(r2_score(y.numpy(), pred), abs=1e-5)
    assert got["rmse"] == pytest.approx(math.sqrt(got["test_loss"]), rel=1e-5)
    assert model.training  # the mode is restored


def test_classification_evaluation_is_accuracy_and_cross_entropy():
    torch.manual_seed(2)
    model = nn.Linear(4, 3)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    got = task_mod.CLASSIFICATION.evaluate(model, x, y, batch=7)
    out = model(x).detach()
    assert got["test_accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item())
    assert got["test_loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-5)


# ---------------------------------------------------------------------------- tasks of the user's own


def test_user_loss_step_and_scorer_by_import_path(tmp_path):
    (tmp_path / "mine.py").write_text(USER_TASK)
    torch.manual_seed(3)
    model = nn.Linear(3, 1)
    x, y = torch.randn(16, 3), torch.randn(16)
    huber = task_mod.resolve("mine.py:huber", "loss", "", tmp_path)
    assert huber.loss_fn is not None and huber.step_fn is None
    assert torch.allclose(huber.loss(model, x, y), F.huber_loss(model(x).squeeze(1), y, delta=5.0))
    step = task_mod.resolve("mine.py:step", "step", "mine.py:score", tmp_path)
    assert step.step_fn is not None and step.loss_fn is None
    got = step.evaluate(model, x, y)
    pred = model(x).detach().squeeze(1)
    assert got["test_loss"] == pytest.approx(F.mse_loss(pred, y).item(), rel=1e-5)
    assert got["mae"] == pytest.approx((pred - y).abs().mean().item(), rel=1e-5)
    clashing = task_mod.resolve("mine.py:step", "step", "mine.py:bad_score", tmp_path)
    with pytest.raises(ValueError, match="'loss' is taken"):
        clashing.evaluate(model, x, y)


def test_import_path_errors_say_what_is_missing(tmp_path):
    (tmp_path / "mine.py").write_text(USER_TASK)
    with pytest.raises(ValueError, match="no such file"):
        task_mod.resolve("gone.py:huber", "loss", "", tmp_path)
    with pytest.raises(ValueError, match="has no attribute 'hubber'"):
        task_mod.resolve("mine.py:hubber", "loss", "", tmp_path)
    with pytest.raises(ValueError, match="one of \\['classification', 'regression'\\]"):
        task_mod.resolve("regresion")
    with pytest.raises(ValueError, match="no scorer for the built-in task"):
        task_mod.resolve("regression", "loss", "mine.py:score", tmp_path)


# ---------------------------------------------------------------------------- config errors


def test_config_errors_name_the_key(tmp_path):
    (tmp_path / "mine.py").write_text(USER_TASK)
    cases = [
        (dict(task='task = "regresion"'), "train.task", "one of ['classification', 'regression']"),
        (dict(task='task = "gone.py:loss"'), "train.task", "no such file"),
        (dict(task='task = "mine.py:hubber"'), "train.task", "has no attribute 'hubber'"),
        (dict(task='task = "regression"\ntask_kind = "step"'), "train.task_kind", "\"loss\" for the built-in"),
        (dict(task='task = "mine.py:step"\ntask_kind = "whole"'), "train.task_kind", "one of ['loss', 'step']"),
        (dict(train='task_score = "mine.py:score"'), "train.task_score", "empty for the built-in task"),
        (dict(task='task = "mine.py:step"\ntask_kind = "step"\ntask_score = "mine.py:scor"'), "train.task_score",
         "has no attribute 'scor'"),
        (dict(train='target_metric = "accuracy"'), "train.target_metric", "one of ['r2', 'rmse', 'test_loss']"),
        (dict(train="target_accuracy = 0.9"), "train.target_accuracy", "it has no accuracy"),
        (dict(task='task = "mine.py:step"\ntask_kind = "step"\ntask_score = "mine.py:score"',
              train='target_metric = "medae"'), "train.target_mode", "\"max\" or \"min\""),
        (dict(task='task = "classification"', args="{ in_features = 10, classes = 3 }"), "train.task",
         "float targets"),
        (dict(data='kind = "npz"\npath = "x.npz"\ntargets = "floats"'), "data.targets", "one of ['classes', 'values']"),
        (dict(task='task = "mine.py:step"\ntask_kind = "step"',
              extra='[placement]\nenabled = true\nresources = [{ name = "cpu_worker", price_per_hour = 1.0 }]'),
         "train.task_kind", "pipeline's last stage"),
        (dict(args="{ in_features = 10, classes = 3 }", extra='[sweep]\nmembers = [{ lr = 0.1 }, { lr = 0.2 }]'),
         "train.task", "HFTA sweep"),
    ]
    for kw, key, expected in cases:
        err = config_error(tmp_path, **kw)
        assert err.key == key, (kw, str(err))
        assert expected in str(err), (kw, str(err))


def test_a_user_task_that_fails_on_the_data_is_refused_at_load(tmp_path):
    from hmp import job

    (tmp_path / "mine.py").write_text(USER_TASK)
    cfg = load(tmp_path, task='task = "mine.py:broken"')
    with pytest.raises(ConfigError) as info:
        job.check_data(cfg)
    assert info.value.key == "train.task" and "the user's loss is broken" in str(info.value)
    job.check_data(load(tmp_path, task='task = "mine.py:step"\ntask_kind = "step"\ntask_score = "mine.py:score"'))


def test_regression_model_must_give_one_output_per_target(tmp_path):
    from hmp import job

    cfg = load(tmp_path, args="{ in_features = 10, width = 8, depth = 1, classes = 2 }")
    with pytest.raises(ConfigError, match="one output per target value") as info:
        job.check_data(cfg)
    assert info.value.key == "model.args"


# ---------------------------------------------------------------------------- data with float targets


def test_diabetes_is_float_targets_in_their_units(tmp_path):
    from hmp import job

    ds = job.dataset(load(tmp_path, data='kind = "diabetes"\nstandardize = true'))
    assert ds.regression and ds.y_train.dtype == torch.float32 and ds.num_classes == 0
    assert (len(ds.y_train), len(ds.y_test)) == (353, 89)
    assert 25 <= float(ds.y_train.min()) and float(ds.y_train.max()) <= 346  # targets are not standardized
    assert abs(float(ds.x_train.mean())) < 1e-5  # the features are


def test_npz_and_svmlight_float_targets_under_regression(tmp_path):
    from sklearn.datasets import dump_svmlight_file

    from hmp import job

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 10)).astype(np.float32)
    y = (x[:, 0] * 3.5 + 0.25).astype(np.float64)
    np.savez(tmp_path / "r.npz", x=x, y=y)
    dump_svmlight_file(x, y, str(tmp_path / "r.svm"), zero_based=False)
    for data in ('kind = "npz"\npath = "r.npz"', 'kind = "svmlight"\npath = "r.svm"'):
        ds = job.dataset(load(tmp_path, data=data))
        assert ds.y_train.dtype == torch.float32
        both = torch.cat([ds.y_train, ds.y_test]).sort().values
        assert torch.allclose(both, torch.from_numpy(np.sort(y).astype(np.float32)), atol=1e-5)
    with pytest.raises(ConfigError, match="non-negative integer labels, got float64"):
        job.dataset(load(tmp_path, data='kind = "npz"\npath = "r.npz"', task='task = "classification"',
                         args="{ in_features = 10, classes = 2 }"))
    bad = y.copy()
    bad[3] = np.nan
    np.savez(tmp_path / "nan.npz", x=x, y=bad)
    with pytest.raises(ConfigError, match="'y' row 3 holds NaN"):
        job.dataset(load(tmp_path, data='kind = "npz"\npath = "nan.npz"'))


# ---------------------------------------------------------------------------- targets and the followed metric


class _Train:
    target_accuracy = 0.0
    target_loss = 0.0
    target_metric = ""
    target = 0.0
    target_mode = "auto"

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_target_metric_in_its_direction():
    from hmp.train.stop_rule import target_reason

    r2 = _Train(target_metric="r2", target=0.4)
    assert target_reason({"r2": 0.39}, r2) == ""
    assert "target r2 >= 0.4 reached" in target_reason({"r2": 0.41}, r2)
    rmse = _Train(target_metric="rmse", target=55.0)
    assert target_reason({"rmse": 56.0}, rmse) == ""
    assert "target rmse <= 55.0" in target_reason({"rmse": 54.0}, rmse)
    custom = _Train(target_metric="medae", target=3.0, target_mode="min")
    assert target_reason({"medae": 2.0}, custom) and not target_reason({"medae": 4.0}, custom)
    assert task_mod.metric_direction("val_error") == "min" and task_mod.metric_direction("kappa") is None


def test_scheduler_follows_the_task_metric(tmp_path):
    from hmp.scheduler.core import SchedulerCore

    cfg = load(tmp_path, train='target_metric = "rmse"\ntarget = 50.0')
    core = SchedulerCore(cfg, n_train=353)
    core.start(0.0)
    core.join("ps0", "ps", "tcp://ps0", 1, 0.0)
    core.join("cpu0", "cpu_worker", "tcp://cpu0", 2, 0.0)
    for t, rmse in ((1.0, 70.0), (2.0, 60.0), (3.0, 65.0)):
        core.report("cpu0", {"samples": 10, "updates": 1, "loss": 1.0, "rmse": rmse, "r2": 0.1, "test_loss": 1.0}, False, t)
    assert core.status(3.0)["best_metric"] == {"name": "rmse", "value": 60.0}  # lower is better
    assert not core.stop_reason
    core.report("cpu0", {"samples": 10, "updates": 2, "rmse": 49.0, "test_loss": 1.0}, False, 4.0)
    assert "target rmse <= 50.0 reached" in core.stop_reason
    final = core.finish_report({"r2": 0.4, "rmse": 49.0, "test_loss": 2401.0}, 5.0).final
    assert final["best_reported_metric"] == "rmse" and final["best_reported_value"] == 49.0
    assert "best_reported_accuracy" not in final  # a classification key only


def test_plot_draws_the_test_metric(tmp_path):
    from hmp.plots import PANELS, plot_report

    series = {"cpu0": [{"t": t, "loss": 3.0 - t, "r2": 0.1 * t, "samples": 100 * t, "updates": 10 * t}
                       for t in (1.0, 2.0, 3.0)]}
    drawn = plot_report({"series": series, "final": {"best_reported_metric": "r2"}}, tmp_path / "f.png")
    assert "test metric" in PANELS and drawn["test metric"] == {"cpu0 r2": 3}
