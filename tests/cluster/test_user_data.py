"""A user's own model and data: import-path models and loaders, npz of any shape (images for a CNN),
``[data] standardize``, and bad data refused at load (file, line or array, exit 2) rather than mid-training.

The datasets are scikit-learn's bundled breast_cancer and wine (never used elsewhere in hmp), written as
svmlight and npz into the test's folder; the models are classes of this file (not ``nn.Sequential``),
named in the configs by this file's path. The daemons import this file by its path, so it imports
nothing relative to the tests package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

THIS_FILE = Path(__file__).resolve()
ROOT = THIS_FILE.parents[2]
LAUNCH = str(Path(sys.executable).parent / "hmp-launch")  # the console script of the environment under test


# ---------------------------------------------------------------------------- the user's models and loaders


class TabularNet(nn.Module):
    """A small MLP of the user's own (a plain module, not an nn.Sequential): features in, logits out."""

    def __init__(self, in_features: int, classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class SmallCNN(nn.Module):
    """A CNN for [N, 1, 8, 8] images: one convolution, a pooling, a linear classifier."""

    def __init__(self, classes: int = 10, channels: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.fc = nn.Linear(channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.max_pool2d(F.relu(self.conv(x)), 2).flatten(1))


def not_a_model(size: int = 3) -> list:
    return [size]


def failing_factory() -> nn.Module:
    raise RuntimeError("no weights for you")


def wine_loader(seed: int = 0, test_fraction: float = 0.2, scale: float = 1.0):
    """A user's loader: scikit-learn's wine, split and scaled by the user's own code."""
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    from hmp.data import Dataset

    d = load_wine()
    x = (d.data * scale).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=test_fraction, random_state=seed, stratify=d.target)
    return Dataset(torch.from_numpy(xtr), torch.from_numpy(ytr).long(), torch.from_numpy(xte),
                   torch.from_numpy(yte).long(), "wine-by-user", 3)


def tuple_loader():
    return (np.zeros((4, 2)), np.zeros(4))


# ---------------------------------------------------------------------------- helpers


def free_port() -> int:
    # Imported here, not at the top: the daemons import this file by its path, outside the tests package.
    from tests.support import free_port as pick

    return pick()


def write_data(tmp: Path) -> dict[str, Path]:
    """breast_cancer and wine as svmlight and npz files, and digits' 8x8 images as an [N, 1, 8, 8] npz."""
    from sklearn.datasets import dump_svmlight_file, load_breast_cancer, load_digits, load_wine

    out = {}
    for name, d in (("bc", load_breast_cancer()), ("wine", load_wine())):
        out[f"{name}.svm"] = tmp / f"{name}.svm"
        dump_svmlight_file(d.data, d.target, str(out[f"{name}.svm"]), zero_based=False)
        out[f"{name}.npz"] = tmp / f"{name}.npz"
        np.savez(out[f"{name}.npz"], x=d.data, y=d.target)
    digits = load_digits()
    out["images.npz"] = tmp / "images.npz"
    np.savez(out["images.npz"], x=(digits.images[:, None] / 16.0).astype(np.float32), y=digits.target)
    return out


def job_text(tmp: Path, *, model: str, args: str, data: str, train: str = "", optimizer: str = "",
             name: str = "user", epochs: int = 20, batch_size: int = 32, max_seconds: float = 90) -> str:
    from tests.support import nodes_toml, scheduler_node  # here, not at the top: see free_port

    return f"""
[job]
name = "{name}"
report_dir = "{tmp / 'run'}"
heartbeat_interval_s = 0.5
plot = false  # the tests read report.json; drawing loss.png is the slow part of a short job's end
join_timeout_s = 60

[model]
name = "{model}"
args = {args}

[data]
{data}

[optimizer]
{optimizer or 'name = "adam"'}
lr = 0.01

[train]
batch_size = {batch_size}
epochs = {epochs}
max_seconds = {max_seconds}
eval_every_s = 0.5
report_interval_s = 0.3
{train}

""" + nodes_toml(scheduler_node(), ("ps0", "ps"), ("cpu0", "cpu_worker"))


def write_job(tmp: Path, **kw) -> Path:
    path = tmp / "job.toml"
    path.write_text(job_text(tmp, **kw))
    return path


def model_ref(tmp: Path, cls: str) -> str:
    """This file's ``cls`` as an import path relative to the config's folder ``tmp``."""
    return f"{os.path.relpath(THIS_FILE, tmp)}:{cls}"


def launch(cfg: Path, timeout_s: float = 120, forkserver: bool = True) -> subprocess.CompletedProcess:
    """``hmp-launch cfg``; on a timeout the launcher gets SIGTERM (it stops its daemons) rather than SIGKILL."""
    env = {**os.environ, "HMP_FORKSERVER": "1" if forkserver else "0"}
    proc = subprocess.Popen([LAUNCH, str(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"hmp-launch ran over {timeout_s} s: {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def final_accuracy(stdout: str) -> float:
    found = re.search(r"final test accuracy: (\d\.\d+)", stdout)
    assert found, stdout
    return float(found.group(1))


def logistic_regression_accuracy(cfg_path: Path) -> float:
    """scikit-learn's LogisticRegression on exactly the split (and scaling) the job trained on: the peer."""
    from sklearn.linear_model import LogisticRegression

    from hmp import job

    d = job.dataset(job.load(cfg_path))
    lr = LogisticRegression(max_iter=5000).fit(d.x_train.numpy(), d.y_train.numpy())
    return float(lr.score(d.x_test.numpy(), d.y_test.numpy()))


# ---------------------------------------------------------------------------- models by import path


def test_import_path_models_build_and_refuse_clearly(tmp_path):
    """``[model] name`` takes ``file.py:factory`` (relative to the config) and ``package.module:factory``; a missing
    file or attribute, a factory that raises or returns no module, and a non-Sequential model for a sweep are
    one-line ConfigErrors naming the file and the key."""
    from hmp import job, models
    from hmp.errors import ConfigError

    files = write_data(tmp_path)
    (tmp_path / "mine.py").write_text("from torch import nn\n\ndef net(width=4):\n    return nn.Linear(30, width)\n")
    data = f'kind = "npz"\npath = "{files["bc.npz"].name}"\nstandardize = true'

    def load(model: str, args: str = "{}", extra: str = "") -> object:
        path = tmp_path / "job.toml"
        path.write_text(job_text(tmp_path, model=model, args=args, data=data) + extra)
        return job.load(path, data=True)

    cfg = load("mine.py:net", "{ width = 2 }")
    assert isinstance(models.from_config(cfg), nn.Linear) and models.from_config(cfg).out_features == 2
    cfg = load(model_ref(tmp_path, "TabularNet"), "{ in_features = 30, classes = 2 }")
    built = job.sharded_model(cfg).model
    assert type(built).__name__ == "TabularNet" and not isinstance(built, nn.Sequential)
    cfg = load("hmp.models:deep_mlp", "{ in_features = 30, width = 8, depth = 1, classes = 2 }")
    assert isinstance(models.from_config(cfg), nn.Sequential)

    job_toml = str(tmp_path / "job.toml")
    cases = [
        ("nowhere.py:net", "{}", "model.name", f"no such file {tmp_path / 'nowhere.py'}"),
        ("mine.py:nett", "{}", "model.name", f"{tmp_path / 'mine.py'} has no attribute 'nett'"),
        ("hmp_no_such_package.mod:f", "{}", "model.name", "no module 'hmp_no_such_package'"),
        ("mine.py:net", "{ depth = 3 }", "model.args", "unexpected keyword argument 'depth'"),
        (model_ref(tmp_path, "failing_factory"), "{}", "model.name", "RuntimeError: no weights for you"),
        (model_ref(tmp_path, "not_a_model"), "{}", "model.name", "returned a list"),
        ("mlp_of_my_dreams", "{}", "model.name", "one of ['click_model', 'deep_mlp', 'digits_mlp', 'sparse_mlp'] or an import path"),
    ]
    for model, args, key, says in cases:
        with pytest.raises(ConfigError) as info:
            load(model, args)
        line = str(info.value)
        assert line.startswith(f"{job_toml}: key '{key}'") and says in line and "\n" not in line, line
    sweep = '\n[sweep]\nmembers = [{ lr = 0.1 }, { lr = 0.01 }]\n'
    with pytest.raises(ConfigError, match=r"key 'model.name': a factory returning an nn.Sequential for a \[sweep\]"):
        load(model_ref(tmp_path, "TabularNet"), "{ in_features = 30, classes = 2 }", sweep)


def test_a_model_that_does_not_fit_the_data_is_refused_at_load_naming_both_shapes(tmp_path):
    """One forward pass at load: a wrong input width names the model's and the data's shapes; too few outputs for
    the labels names both counts; a CNN takes [N, 1, 8, 8] images as they are."""
    from hmp import job
    from hmp.errors import ConfigError

    files = write_data(tmp_path)
    path = write_job(tmp_path, model=model_ref(tmp_path, "TabularNet"), args="{ in_features = 20, classes = 2 }",
                     data=f'kind = "svmlight"\npath = "{files["bc.svm"]}"\nstandardize = true')
    with pytest.raises(ConfigError) as info:
        job.load(path, data=True)
    assert "expects rows of 20 features" in str(info.value) and "data has rows of shape [30]" in str(info.value)
    assert str(files["bc.svm"]) in str(info.value)
    path = write_job(tmp_path, model="deep_mlp", args="{ in_features = 13, width = 8, depth = 1, classes = 2 }",
                     data=f'kind = "npz"\npath = "{files["wine.npz"]}"\nstandardize = true')
    with pytest.raises(ConfigError, match=r"key 'model.args'.*outputs 2 logits per row but the labels go up to 2 "
                                          r"\(3 classes"):
        job.load(path, data=True)
    path = write_job(tmp_path, model=model_ref(tmp_path, "SmallCNN"), args="{ classes = 10 }",
                     data=f'kind = "npz"\npath = "{files["images.npz"]}"')
    d = job.dataset(job.load(path, data=True))
    assert d.x_train.shape[1:] == (1, 8, 8) and d.feature_shape == (1, 8, 8) and d.num_features == 64


# ---------------------------------------------------------------------------- data: shapes, parts, scaling


def test_standardize_uses_training_statistics_only_and_partial_loads_agree(tmp_path):
    """``standardize``: the training split's mean and std (as scikit-learn's StandardScaler fitted on it), applied to
    train and test; a worker's share and the scheduler's test part are exactly the rows of the whole load."""
    from sklearn.preprocessing import StandardScaler

    from hmp import job
    from hmp.errors import ConfigError

    files = write_data(tmp_path)
    raw = job.load(write_job(tmp_path, model="deep_mlp", args="{ in_features = 30, classes = 2, depth = 1 }",
                             data=f'kind = "npz"\npath = "{files["bc.npz"]}"'))
    cfg = raw.replace(data=dataclasses.replace(raw.data, standardize=True))
    plain, scaled = job.dataset(raw), job.dataset(cfg)
    scaler = StandardScaler().fit(plain.x_train.double().numpy())
    np.testing.assert_allclose(scaled.x_train.numpy(), scaler.transform(plain.x_train.double().numpy()), atol=1e-4)
    np.testing.assert_allclose(scaled.x_test.numpy(), scaler.transform(plain.x_test.double().numpy()), atol=1e-4)
    assert abs(float(scaled.x_test.mean())) > 1e-3  # the test set's own statistics were not used
    shares = [job.dataset(cfg, "train", (i, 3)) for i in range(3)]
    assert [s.train_offset for s in shares] == [0, 151, 303] and all(s.n_train == 455 for s in shares)
    assert all(len(s.y_test) == 0 for s in shares)
    torch.testing.assert_close(torch.cat([s.x_train for s in shares]), scaled.x_train)
    assert torch.equal(torch.cat([s.y_train for s in shares]), scaled.y_train)
    test = job.dataset(cfg, "test")
    assert len(test.y_train) == 0 and test.n_train == 455
    torch.testing.assert_close(test.x_test, scaled.x_test)
    # The same through a generic source (svmlight: loaded whole, then cut)
    svm = raw.replace(data=dataclasses.replace(raw.data, kind="svmlight", path=str(files["bc.svm"])))
    whole, second = job.dataset(svm), job.dataset(svm, "train", (1, 2))
    torch.testing.assert_close(second.x_train, whole.x_train[227:])
    with pytest.raises(ConfigError, match="key 'data.standardize': false for integer features"):
        click = raw.replace(model=dataclasses.replace(raw.model, name="click_model", args={}),
                            data=dataclasses.replace(raw.data, kind="click", path="", samples=200, standardize=True))
        job.dataset(click)


def test_raw_features_of_wildly_different_scales_warn_once(tmp_path):
    """breast_cancer's raw features span 5 orders of magnitude: loading warns (one line) to standardize; with
    ``standardize = true``, or on digits, nothing is said."""
    from hmp import job
    from hmp.data import DataWarning

    files = write_data(tmp_path)
    data = f'kind = "svmlight"\npath = "{files["bc.svm"]}"'
    path = write_job(tmp_path, model="deep_mlp", args="{ in_features = 30, classes = 2, depth = 1 }", data=data)
    with pytest.warns(DataWarning, match=r"scales differ by a factor of .*set \[data\] standardize = true") as caught:
        job.load(path, data=True)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    for data in (data + "\nstandardize = true", 'kind = "digits"'):
        path = write_job(tmp_path, model="deep_mlp", args="{ in_features = 64, classes = 10, depth = 1 }"
                         if "digits" in data else "{ in_features = 30, classes = 2, depth = 1 }", data=data)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DataWarning)
            job.load(path, data=True)


def test_a_loader_by_import_path_and_its_errors(tmp_path):
    """``[data] kind`` as an import path calls the user's loader with ``[data] args`` (and seed, test_fraction);
    a missing loader or one that returns no Dataset is a ConfigError naming data.kind."""
    from hmp import job
    from hmp.errors import ConfigError

    write_data(tmp_path)
    base = job.load(write_job(tmp_path, model="deep_mlp", args="{ in_features = 13, classes = 3, depth = 1 }",
                              data='kind = "digits"'))

    def with_kind(kind: str, **args):
        return base.replace(data=dataclasses.replace(base.data, kind=kind, args=args, seed=3))

    d = job.dataset(with_kind(model_ref(tmp_path, "wine_loader"), scale=2.0))
    assert d.name == "wine-by-user" and d.x_train.shape == (142, 13) and d.num_classes == 3
    assert job.check_data(with_kind(model_ref(tmp_path, "wine_loader"))) != []  # raw wine: advice to standardize
    for kind, says in ((model_ref(tmp_path, "no_loader"), "has no attribute 'no_loader'"),
                       (model_ref(tmp_path, "tuple_loader"), "returned a tuple; expected hmp.data.Dataset")):
        with pytest.raises(ConfigError, match="key 'data.kind'") as info:
            job.dataset(with_kind(kind))
        assert says in str(info.value)


BAD_DATA = {
    # case: (file name, how to write it, key, what the one line says)
    "empty svmlight": ("empty.svm", lambda p, f: p.write_bytes(b""), "data.path", "empty.svm: empty file (0 bytes)"),
    "bad svmlight line": ("bad.svm", lambda p, f: _edit_line(f["bc.svm"], p, 7, lambda s: s.replace("3:", "3:x", 1)),
                          "data.path", "bad.svm line 7: '3:x"),
    "NaN in svmlight": ("nan.svm", lambda p, f: _edit_line(f["bc.svm"], p, 10, lambda s: s + " 31:nan"),
                        "data.path", "nan.svm line 10: feature 31 is nan"),
    "0-byte npz": ("empty.npz", lambda p, f: p.write_bytes(b""), "data.path", "empty.npz: empty file (0 bytes)"),
    "missing y": ("noy.npz", lambda p, f: np.savez(p, x=np.ones((5, 30))), "data.path",
                  "noy.npz: missing array 'y'; expected 'x' and 'y' (found ['x'])"),
    "x/y length mismatch": ("short.npz", lambda p, f: np.savez(p, x=np.ones((50, 30)), y=np.zeros(49, dtype=int)),
                            "data.path", "short.npz: arrays 'x' (50 rows) and 'y' (49 labels) differ in length"),
    "inf in npz": ("inf.npz", lambda p, f: _npz_with_inf(p), "data.path",
                   "inf.npz: array 'x' row 100 holds NaN or infinity"),
    "labels beyond the outputs": ("wine.npz", lambda p, f: None, "model.name",
                                  "outputs 2 logits per row but the labels go up to 2 (3 classes"),
    "model does not fit": ("bc.npz", lambda p, f: None, "model.name",
                           "expects rows of 13 features (its first layer: Linear(in_features=13"),
}


def _edit_line(src: Path, dst: Path, number: int, edit) -> None:
    lines = src.read_text().splitlines()
    lines[number - 1] = edit(lines[number - 1])
    dst.write_text("\n".join(lines) + "\n")


def _npz_with_inf(path: Path) -> None:
    from sklearn.datasets import load_breast_cancer

    d = load_breast_cancer()
    x = d.data.copy()
    x[100, 3] = np.inf
    np.savez(path, x=x, y=d.target)


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_exits_2_through_hmp_launch_with_one_line(tmp_path, case, monkeypatch, capsys):
    """hmp-launch refuses bad data before any daemon starts: exit 2, one line naming the config, the key, the data
    file and the line (svmlight) or array (npz), and what was expected. The first case runs the hmp-launch command;
    the others call its main() in this process (the same code, without a Python start-up per case)."""
    files = write_data(tmp_path)
    name, write, key, says = BAD_DATA[case]
    path = tmp_path / name
    write(path, files)
    kind = "svmlight" if name.endswith(".svm") else "npz"
    inputs = 13 if name in ("wine.npz", "bc.npz") else 30  # the last two cases: a model that does not fit
    cfg = write_job(tmp_path, model=model_ref(tmp_path, "TabularNet"), args=f"{{ in_features = {inputs}, classes = 2 }}",
                    data=f'kind = "{kind}"\npath = "{name}"\nstandardize = true')
    if case == next(iter(BAD_DATA)):
        done = launch(cfg, timeout_s=60, forkserver=False)
        code, err = done.returncode, done.stderr
    else:
        from hmp.launch import main as launch_main

        monkeypatch.setenv("HMP_FORKSERVER", "0")
        code, err = launch_main([str(cfg)]), capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"hmp-launch: config error: {cfg}: key '{key}'"), lines[0]
    assert says in lines[0], lines[0]
    assert not (tmp_path / "run" / "logs").exists()  # no daemon was started


def _daemon(cfg: Path, role: str, node: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hmp.nodes.main", role, "--config", str(cfg), "--id", node],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        p.communicate(timeout=60)


def test_a_scheduler_started_by_hand_refuses_bad_data_with_the_same_line(tmp_path):
    """The scheduler's own load (its test set) of a file whose x and y differ in length: one line, exit 2."""
    np.savez(tmp_path / "short.npz", x=np.ones((50, 30)), y=np.zeros(49, dtype=int))
    cfg = write_job(tmp_path, model=model_ref(tmp_path, "TabularNet"), args="{ in_features = 30, classes = 2 }",
                    data='kind = "npz"\npath = "short.npz"')
    proc = _daemon(cfg, "scheduler", "scheduler")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _stop([proc])
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("hmp-scheduler") and f"config error: {cfg}: key 'data.path'" in lines[0]
    assert "short.npz: arrays 'x' (50 rows) and 'y' (49 labels) differ in length" in lines[0]


def test_a_worker_finds_a_bad_row_of_its_own_share_and_exits_2(tmp_path):
    """Started by hand (no launcher check), the scheduler loads only the test set and serves; the worker loads its
    training rows after joining, finds the infinity in one of them and exits 2 with the one-line error."""
    from sklearn.datasets import load_breast_cancer

    from hmp.data.dataset import _split

    d = load_breast_cancer()
    train_rows = _split(np.arange(len(d.target)), d.target, 0.2, 0)[0]
    bad = int(train_rows[7])
    x = d.data.copy()
    x[bad, 3] = np.inf
    np.savez(tmp_path / "inf.npz", x=x, y=d.target)
    cfg = write_job(tmp_path, model=model_ref(tmp_path, "TabularNet"), args="{ in_features = 30, classes = 2 }",
                    data='kind = "npz"\npath = "inf.npz"')
    others = [_daemon(cfg, "scheduler", "scheduler"), _daemon(cfg, "ps", "ps0")]
    worker = _daemon(cfg, "cpu_worker", "cpu0")
    try:
        _, err = worker.communicate(timeout=90)
        assert all(p.poll() is None for p in others), "the scheduler or the shard stopped"
    finally:
        _stop([worker, *others])
    assert worker.returncode == 2 and "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "config error" in line]
    assert len(said) == 1 and f"{cfg}: key 'data.path'" in said[0], err[-3000:]
    assert f"inf.npz: array 'x' row {bad} holds NaN or infinity" in said[0]


# ---------------------------------------------------------------------------- training on the user's data


def test_breast_cancer_through_hmp_launch_raw_then_standardized(tmp_path):
    """The issue's case: raw breast_cancer (svmlight) warns once to standardize; standardized (npz) with a model
    class of this file reaches ~0.9+. scikit-learn's LogisticRegression on the same split is printed beside it."""
    files = write_data(tmp_path)
    ref = model_ref(tmp_path, "TabularNet")
    raw = write_job(tmp_path, model=ref, args="{ in_features = 30, classes = 2 }", epochs=2,
                    data=f'kind = "svmlight"\npath = "{files["bc.svm"].name}"')
    done = launch(raw)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("standardize = true") == 1, done.stderr[-3000:]
    raw_acc = final_accuracy(done.stdout)
    cfg = write_job(tmp_path, model=ref, args="{ in_features = 30, classes = 2 }", train="target_accuracy = 0.93",
                    data=f'kind = "npz"\npath = "{files["bc.npz"].name}"\nstandardize = true')
    done = launch(cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "standardize" not in done.stderr, done.stderr[-3000:]
    acc, peer = final_accuracy(done.stdout), logistic_regression_accuracy(cfg)
    print(f"breast_cancer: hmp raw (2 epochs) {raw_acc:.3f}, standardized {acc:.3f}; "
          f"scikit-learn LogisticRegression on the same split {peer:.3f}")
    assert acc >= 0.9


async def test_wine_svmlight_and_an_image_cnn_through_the_api(tmp_path):
    """Through ``hmp.LocalCluster``: wine (svmlight, 3 classes, standardized) with a model class of this file, then
    digits' images as an [N, 1, 8, 8] npz reaching a CNN of this file unchanged."""
    import hmp

    files = write_data(tmp_path)
    cfg = write_job(tmp_path, model=model_ref(tmp_path, "TabularNet"), args="{ in_features = 13, classes = 3 }",
                    data=f'kind = "svmlight"\npath = "{files["wine.svm"].name}"\nstandardize = true',
                    train="target_accuracy = 0.9")
    async with hmp.LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=120)
    acc, peer = report["final"]["test_accuracy"], logistic_regression_accuracy(cfg)
    print(f"wine: hmp {acc:.3f}; scikit-learn LogisticRegression on the same split {peer:.3f}")
    assert acc >= 0.85

    cfg = write_job(tmp_path, model=model_ref(tmp_path, "SmallCNN"), args="{ classes = 10 }",
                    data=f'kind = "npz"\npath = "{files["images.npz"].name}"',
                    batch_size=64, epochs=15, train="target_accuracy = 0.9")
    async with hmp.LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=120)
    print(f"digits images, SmallCNN: {report['final']['test_accuracy']:.3f}")
    assert report["final"]["test_accuracy"] >= 0.85


# ---------------------------------------------------------------------------- the package's API


def test_hmp_exports_what_the_readme_uses():
    """Every ``hmp.NAME`` the README's code (blocks and `spans`) mentions is an attribute or a module of hmp."""
    import importlib

    import hmp

    readme = (ROOT / "README.md").read_text()
    code = re.findall(r"```.*?```", readme, re.S)
    code += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", readme, flags=re.S))
    names = {n for c in code for n in re.findall(r"\bhmp\.([A-Za-z_]\w*)", c)}
    assert {"LocalCluster", "PSClient"} <= names  # the check reads what it should
    missing = []
    for name in sorted(names):
        if hasattr(hmp, name):
            continue
        try:
            importlib.import_module(f"hmp.{name}")
        except ImportError:
            missing.append(name)
    assert not missing, f"README uses hmp.{missing} which hmp does not export"
    for name in hmp.__all__:
        assert getattr(hmp, name) is not None


async def test_connect_builds_a_client_from_the_config_path_and_the_scheduler_address(tmp_path):
    """``hmp.connect(config path, scheduler address, token=...)``: the shards come from the scheduler's ``discover``;
    the client pulls the job's parameters and evaluates them; a config of another model is refused."""
    import hmp
    from hmp.errors import ConfigError

    cfg = write_job(tmp_path, model="digits_mlp", args="{}", data='kind = "digits"',
                    epochs=500, max_seconds=60, optimizer='name = "sgd"\nmomentum = 0.9')
    other = tmp_path / "other.toml"
    other.write_text(cfg.read_text().replace('name = "digits_mlp"\nargs = {}',
                                             'name = "digits_mlp"\nargs = { hidden = [32] }'))
    async with hmp.LocalCluster(cfg) as cluster:
        address = cluster.cfg.scheduler.bind
        async with await hmp.connect(str(cfg), address, token=cluster.job_token, name="outsider") as ps:
            await ps.pull()
            first = ps.version
            for _ in range(100):
                await asyncio.sleep(0.1)
                await ps.pull()
                if ps.version > first:
                    break
            assert ps.version > first  # the workers' updates reach this client's copy
            scores = ps.evaluate()
            assert 0.0 <= scores["test_accuracy"] <= 1.0
        with pytest.raises(ConfigError, match="chunk layout"):
            await hmp.connect(str(other), address, token=cluster.job_token, name="outsider")
        await cluster.finish("test done")
        await cluster.train(timeout_s=60)


def test_the_shipped_breast_cancer_config_checks_clean(tmp_path):
    """conf/breast_cancer.toml (model class in conf/user_model.py, data written by that file's script) loads, its
    data checks against its model without advice (it standardizes), and its model is the user's class."""
    from hmp import job, models

    subprocess.run([sys.executable, str(ROOT / "conf" / "user_model.py"), str(tmp_path)], check=True, timeout=120,
                   capture_output=True)
    cfg = job.load(ROOT / "conf" / "breast_cancer.toml")
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, path=str(tmp_path / "breast_cancer.npz")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert job.check_data(cfg) == []
    assert type(models.from_config(cfg)).__name__ == "TabularNet"
