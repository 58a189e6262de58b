"""Tasks other than classification end to end, real daemons on loopback (docs/task.md): a regression job on
scikit-learn's diabetes (PS async, and a ring), scored against scikit-learn's LinearRegression on the same split,
and tasks of the user's own, a loss by import path and a whole step with a scorer, checked against the model
the job hands back."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.nn import functional as F

from hmp import job, load_model
from hmp.cluster import LocalCluster
from tests.support import REPORT_SCHEMA, nodes_toml, scheduler_node, schema_errors

#: A linear model: deep_mlp with no hidden layer is one Linear(10, 1).
LINEAR = 'name = "deep_mlp"\nargs = { in_features = 10, width = 1, depth = 0, classes = 1 }'
#: R^2 of the job's result may trail scikit-learn's exact least squares on the same split by this much.
R2_MARGIN = 0.05

USER_TASK = """
from torch.nn import functional as F

def huber(output, target):
    return F.huber_loss(output.reshape(target.shape), target, delta=10.0)

def step(model, batch):
    x, y = batch
    return F.l1_loss(model(x).reshape(y.shape), y)

def score(model, batch):
    x, y = batch
    err = model(x).reshape(y.shape) - y
    return {"mae": err.abs().mean().item(), "max_error": err.abs().max().item()}
"""


def write_job(tmp: Path, *, workers: int = 2, consistency: str = "async", epochs: int = 30, train: str = "",
              optimizer: str = "", batch_size: int = 16, task: str = 'task = "regression"') -> Path:
    """A diabetes job (standardized features, float targets in their units) of ``workers`` CPU workers; ``task``:
    the [train] task lines."""
    shards = () if consistency == "allreduce" else (("ps0", "ps"),)
    text = f"""
[job]
name = "diabetes"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json (tests/unit/test_task.py checks the plot's test-metric panel)

[model]
{LINEAR}

[data]
kind = "diabetes"
standardize = true

[optimizer]
{optimizer or 'name = "sgd"'}

[train]
{task}
consistency = "{consistency}"
batch_size = {batch_size}
epochs = {epochs}
max_seconds = 60
eval_every_s = 0.3
report_interval_s = 0.2
{train}
""" + nodes_toml(scheduler_node(), *shards, *((f"w{i}", "cpu_worker") for i in range(workers)))
    path = tmp / "job.toml"
    path.write_text(text)
    return path


def least_squares_r2(cfg_path: Path) -> float:
    """scikit-learn's LinearRegression on exactly the split (and scaling) the job trained on: the peer."""
    from sklearn.linear_model import LinearRegression

    d = job.dataset(job.load(cfg_path))
    fit = LinearRegression().fit(d.x_train.numpy(), d.y_train.numpy())
    return float(fit.score(d.x_test.numpy(), d.y_test.numpy()))


async def run(cfg: Path) -> dict:
    async with LocalCluster(cfg) as cluster:
        return await cluster.train()


# Cosine to 0 over the PS's updates (a shard counts every push): the last steps are small, so the result is
# near the least-squares fit rather than one noisy SGD step from it.
COSINE = 'name = "sgd"\nlr = 0.01\nmomentum = 0.9\nschedule = "cosine"\ntotal_steps = {steps}'


async def test_diabetes_regression_on_a_ps_matches_least_squares(tmp_path):
    """Two async PS workers fit a linear model to diabetes by SGD; the report's final R^2 and RMSE (by name) are
    the exported model's on the test split, R^2 within R2_MARGIN of LinearRegression's, and the report keeps its
    schema (r2, rmse, the followed metric)."""
    epochs = 30
    steps = epochs * 2 * math.ceil(353 / 2 / 16)
    cfg = write_job(tmp_path, epochs=epochs, optimizer=COSINE.format(steps=steps))
    report = await run(cfg)
    final = report["final"]
    peer = least_squares_r2(cfg)
    print(f"diabetes, PS async x2, linear, SGD {epochs} epochs: R^2 {final['r2']:.4f} (RMSE {final['rmse']:.2f}); "
          f"scikit-learn LinearRegression R^2 {peer:.4f}")
    assert final["parameters"] == "end" and final["stop_reason"] == "epochs done"
    assert final["r2"] >= peer - R2_MARGIN, (final, peer)
    assert math.isclose(final["rmse"], math.sqrt(final["test_loss"]), rel_tol=1e-4)
    assert final["best_reported_metric"] == "r2" and "best_reported_accuracy" not in final
    assert "test_accuracy" not in final
    assert schema_errors(report, REPORT_SCHEMA) == []
    # the result is the model handed back: its R^2 on the test split is the report's
    data = job.dataset(job.load(cfg))
    model = load_model(tmp_path / "run", raw_features=False)  # x_test is standardized already
    pred = model(data.x_test).detach().squeeze(1)
    r2 = 1 - float(((pred - data.y_test) ** 2).sum() / ((data.y_test - data.y_test.mean()) ** 2).sum())
    assert math.isclose(r2, final["r2"], abs_tol=1e-4)
    # the evaluating worker's series carries r2, which the plot's test-metric panel draws
    assert any("r2" in p for p in report["series"]["w0"])


async def test_diabetes_regression_on_a_ring(tmp_path):
    """Two ring workers (no PS) fit the same linear model; rank 0's final evaluation is the report's, by name,
    the replicas end identical and R^2 is within R2_MARGIN of LinearRegression's."""
    epochs = 40
    cfg = write_job(tmp_path, consistency="allreduce", epochs=epochs,
                    optimizer=COSINE.format(steps=epochs * (353 // 32)))
    report = await run(cfg)
    final = report["final"]
    peer = least_squares_r2(cfg)
    print(f"diabetes, ring x2, linear, SGD {epochs} epochs: R^2 {final['r2']:.4f} (RMSE {final['rmse']:.2f}); "
          f"scikit-learn LinearRegression R^2 {peer:.4f}")
    assert final["evaluated_by"] == "w0" and final["parameters"] == "ring"
    assert final["r2"] >= peer - R2_MARGIN, (final, peer)
    assert {"r2", "rmse", "test_loss"} <= set(final) and "params_crc32" not in final
    assert len({report["series"][w][-1]["params_crc32"] for w in ("w0", "w1")}) == 1


async def test_a_user_loss_by_import_path_trains_and_scores(tmp_path):
    """``task = "task.py:huber"``: the workers train with the user's Huber loss and the report's test_loss is
    its mean over the test split for the model handed back (not the mean squared error)."""
    (tmp_path / "task.py").write_text(USER_TASK)
    cfg = write_job(tmp_path, workers=1, epochs=15, task='task = "task.py:huber"',
                    optimizer='name = "sgd"\nlr = 0.05\nmomentum = 0.9')
    report = await run(cfg)
    final = report["final"]
    data = job.dataset(job.load(cfg))
    model = load_model(tmp_path / "run", raw_features=False)  # x_test is standardized already
    with torch.no_grad():
        out = model(data.x_test).squeeze(1)
        huber = F.huber_loss(out, data.y_test, delta=10.0).item()
        mse = F.mse_loss(out, data.y_test).item()
    print(f"user Huber loss job: test_loss {final['test_loss']:.3f} (Huber of model.pt {huber:.3f}, MSE {mse:.1f})")
    assert math.isclose(final["test_loss"], huber, rel_tol=1e-4), (final, huber)
    assert final["best_reported_metric"] == "test_loss" and "r2" not in final
    start = F.huber_loss(torch.zeros_like(data.y_test), data.y_test, delta=10.0).item()
    assert final["test_loss"] < 0.5 * start  # it learned: half the loss of predicting 0


async def test_a_user_step_and_scorer_stop_on_their_metric(tmp_path):
    """``task_kind = "step"`` with a scorer: the workers train with the user's whole step (an L1 loss), the
    report carries the scorer's metrics by name, and ``target_metric = "mae"`` (lower is better, by its name)
    stops the job once the shards' parameters reach it."""
    (tmp_path / "task.py").write_text(USER_TASK)
    cfg = write_job(tmp_path, workers=2, epochs=200, optimizer='name = "sgd"\nlr = 0.5',
                    task='task = "task.py:step"\ntask_kind = "step"\ntask_score = "task.py:score"',
                    train='target_metric = "mae"\ntarget = 60.0')
    report = await run(cfg)
    final = report["final"]
    data = job.dataset(job.load(cfg))
    model = load_model(tmp_path / "run", raw_features=False)  # x_test is standardized already
    with torch.no_grad():
        err = model(data.x_test).squeeze(1) - data.y_test
    print(f"user step + scorer job: {final['stop_reason']}; mae {final['mae']:.2f}, max_error "
          f"{final['max_error']:.1f}, test_loss {final['test_loss']:.2f}")
    assert "target mae <= 60.0 reached" in final["stop_reason"] and final["parameters"] == "at_stop"
    assert final["mae"] <= 60.0 and math.isclose(final["mae"], err.abs().mean().item(), rel_tol=1e-4)
    assert math.isclose(final["test_loss"], final["mae"], rel_tol=1e-4)  # the step's loss is L1 too
    assert math.isclose(final["max_error"], err.abs().max().item(), rel_tol=1e-4)
    assert final["best_reported_metric"] == "mae"
    assert schema_errors(report, REPORT_SCHEMA) == []
