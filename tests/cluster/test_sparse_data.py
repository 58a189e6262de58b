"""Sparse svmlight from file to batch (``[data] sparse``): CSR rows that are never made dense, batches in the
``nn.EmbeddingBag`` convention (:class:`hmp.data.CSRBatch`), a sparse-input model of this file trained on them, the
config refusing what cannot be sparse, and the loader's memory against scikit-learn's on the same file.

The models are classes of this file, named in the configs by this file's path (the daemons import it by its path,
so it imports nothing relative to the tests package).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

THIS_FILE = Path(__file__).resolve()
ROOT = THIS_FILE.parents[2]
LAUNCH = str(Path(sys.executable).parent / "hmp-launch")


# ---------------------------------------------------------------------------- the user's sparse-input model


class SparseNet(nn.Module):
    """A sparse-input model of the user's own: an EmbeddingBag over a batch's nonzeros (weighted by their values),
    then a linear classifier. Takes an ``hmp.data.CSRBatch``."""

    def __init__(self, num_features: int, classes: int = 2, dim: int = 16) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(num_features, dim, mode="sum")
        self.out = nn.Linear(dim, classes)

    def forward(self, batch) -> torch.Tensor:
        return self.out(torch.relu(self.bag(batch.indices, batch.offsets, per_sample_weights=batch.values)))


# ---------------------------------------------------------------------------- data


def write_sparse_svmlight(path: Path, n: int, n_features: int, per_row: int, seed: int = 0,
                          labels: tuple[int, int] = (-1, 1)) -> None:
    """``n`` rows of about ``per_row`` nonzeros over ``n_features`` columns (one-based indices), labels from a hidden
    linear model (learnable by a linear model on the sparse rows)."""
    import scipy.sparse as sp
    from sklearn.datasets import dump_svmlight_file

    rng = np.random.default_rng(seed)
    cols = np.sort(rng.integers(0, n_features, size=(n, per_row)), axis=1)
    x = sp.csr_matrix((rng.uniform(0.5, 1.5, n * per_row).astype(np.float32), cols.ravel(),
                       np.arange(0, n * per_row + 1, per_row)), shape=(n, n_features))
    x.sum_duplicates()
    score = x @ rng.normal(size=n_features)
    y = np.where(score > np.median(score), labels[1], labels[0])
    dump_svmlight_file(x, y, str(path), zero_based=False)


def free_port() -> int:
    # Imported here, not at the top: the daemons import this file by its path, outside the tests package.
    from tests.support import free_port as pick

    return pick()


def job_text(tmp: Path, *, data: str, model: str | None = None, args: str = "{ num_features = 500 }",
             epochs: int = 3, extra: str = "", nodes: str = "") -> str:
    model = model or f"{os.path.relpath(THIS_FILE, tmp)}:SparseNet"
    return f"""
[job]
name = "sparse"
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
name = "adam"
lr = 0.01

[train]
batch_size = 64
epochs = {epochs}
max_seconds = 90
eval_every_s = 0.5
report_interval_s = 0.3
{extra}

[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"
{nodes or '''
[[nodes]]
id = "ps0"
role = "ps"

[[nodes]]
id = "cpu0"
role = "cpu_worker"
'''}
"""


def write_job(tmp: Path, **kw) -> Path:
    path = tmp / "job.toml"
    path.write_text(job_text(tmp, **kw))
    return path


# ---------------------------------------------------------------------------- CSR rows and batches


def test_sparse_svmlight_holds_the_dense_loaders_rows_as_csr_and_batches_gather_them(tmp_path):
    """``sparse=True`` gives the same split (rows, order, labels) as the dense load, as CSRRows; ``x[idx]`` is a
    CSRBatch in the EmbeddingBag convention whose rows are the dense rows; slices, shares and the test part agree."""
    from hmp.data import CSRBatch, CSRRows, load_dataset, load_svmlight

    path = tmp_path / "s.svm"
    write_sparse_svmlight(path, 600, 1000, 8, labels=(3, 7))
    dense, sparse = load_svmlight(path), load_svmlight(path, sparse=True)
    assert isinstance(sparse.x_train, CSRRows) and isinstance(sparse.x_test, CSRRows) and sparse.sparse
    assert not dense.sparse and sparse.label_values == dense.label_values == (3, 7)
    assert sparse.x_train.shape == dense.x_train.shape and sparse.num_features == dense.num_features == 1000
    assert sparse.feature_shape == (1000,) and len(sparse.x_test) == len(dense.x_test) == 120
    assert torch.equal(sparse.x_train.to_dense(), dense.x_train) and torch.equal(sparse.x_test.to_dense(), dense.x_test)
    assert torch.equal(sparse.y_train, dense.y_train) and torch.equal(sparse.y_test, dense.y_test)
    # The splits share the file's arrays: one copy of the nonzeros, not a dense matrix.
    assert sparse.x_train.values.data_ptr() == sparse.x_test.values.data_ptr()
    assert sparse.x_train.nbytes < dense.x_train.numel() * 4 / 10

    idx = torch.tensor([5, 3, 3, 0, len(dense.y_train) - 1, 17])
    batch = sparse.x_train[idx]
    assert isinstance(batch, CSRBatch) and len(batch) == 6 and batch.num_features == 1000
    assert (batch.indices.dtype, batch.offsets.dtype, batch.values.dtype) == (torch.int64, torch.int64, torch.float32)
    assert batch.offsets[0] == 0 and len(batch.indices) == len(batch.values) == int((dense.x_train[idx] != 0).sum())
    assert torch.equal(batch.to_dense(), dense.x_train[idx])
    # The EmbeddingBag convention: bag(indices, offsets, per_sample_weights=values) is the batch times the weight.
    bag = nn.EmbeddingBag(1000, 4, mode="sum")
    torch.testing.assert_close(bag(batch.indices, batch.offsets, per_sample_weights=batch.values),
                               dense.x_train[idx] @ bag.weight)
    assert torch.equal(sparse.x_train[40:90].to_dense(), dense.x_train[40:90])
    assert torch.equal(sparse.x_train[40:90][torch.tensor([1, 0])].to_dense(), dense.x_train[[41, 40]])
    assert torch.equal(sparse.x_train.take(idx).to_dense(), dense.x_train[idx])
    assert len(sparse.x_train[torch.tensor([], dtype=torch.int64)]) == 0
    with pytest.raises(IndexError, match="out of range"):
        sparse.x_train[torch.tensor([len(dense.y_train)])]

    spec = {"kind": "svmlight", "path": str(path), "sparse": True}
    part = load_dataset(spec, part="train", share=(1, 3))
    lo = part.train_offset
    assert (lo, part.n_train, len(part.x_test)) == (160, 480, 0) and part.x_train.compact
    assert torch.equal(part.x_train.to_dense(), dense.x_train[lo:lo + len(part.y_train)])
    assert part.x_train.values.numel() == part.x_train.nnz  # a compact copy: the rest of the file was freed
    test = load_dataset(spec, part="test")
    assert len(test.y_train) == 0 and test.n_train == 480 and torch.equal(test.x_test.to_dense(), dense.x_test)


def test_csr_rows_gather_empty_rows_and_refuse_bad_arrays():
    """Rows without nonzeros gather as empty bags; arrays that are not CSR are named by ``fault``."""
    from hmp.data import CSRRows

    x = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 3.0]])
    rows = CSRRows.from_dense(x)
    assert rows.fault() is None and rows.nnz == 3
    batch = rows[torch.tensor([1, 2, 1, 0])]
    assert batch.offsets.tolist() == [0, 0, 2, 2] and batch.indices.tolist() == [0, 2, 1]
    assert torch.equal(batch.to_dense(), x[[1, 2, 1, 0]])
    bad = CSRRows(rows.indptr, torch.tensor([1, 2, 0]), rows.values, 3)
    assert "increase within a row" in bad.fault()
    assert "column indices span" in CSRRows(rows.indptr, torch.tensor([1, 0, 5]), rows.values, 3).fault()
    with pytest.raises(ValueError, match="int64 indptr and indices"):
        CSRRows(rows.indptr.int(), rows.indices, rows.values, 3)


def test_a_sparse_model_trains_on_the_batches_and_evaluates_on_csr_rows(tmp_path):
    """This file's SparseNet trained with plain torch on ShuffledBatches of the CSR rows: the loss drops and the test
    accuracy (hmp.train.evaluate over the CSR test rows) clears the majority baseline by a wide margin."""
    from hmp.data import ShuffledBatches, load_svmlight
    from hmp.train.evaluate import evaluate

    path = tmp_path / "s.svm"
    write_sparse_svmlight(path, 4000, 300, 10)
    d = load_svmlight(path, sparse=True)
    torch.manual_seed(0)
    model = SparseNet(d.num_features)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for idx in ShuffledBatches(len(d.y_train), 64, seed=0, epochs=4):
        loss = F.cross_entropy(model(d.x_train[idx]), d.y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    result = evaluate(model, d.x_test, d.y_test, batch=300)  # several slices of the CSR test rows
    majority = max(float(d.y_test.double().mean()), 1 - float(d.y_test.double().mean()))
    print(f"sparse svmlight 4000 x 300: loss {first:.3f} -> {last:.3f}, test accuracy {result['test_accuracy']:.3f} "
          f"(majority {majority:.3f})")
    assert last < 0.6 * first
    assert result["test_accuracy"] > majority + 0.2


def test_hogwild_threads_train_on_a_unit_of_csr_rows(tmp_path):
    """``take_rows`` keeps a work unit of sparse rows as CSRRows (a tensor's rows as a tensor), from which Hogwild
    threads gather their own CSRBatches: two threads train SparseNet on it and the loss drops."""
    from hmp.data import CSRRows, load_svmlight, take_rows
    from hmp.train.hogwild import HogwildTrainer

    write_sparse_svmlight(tmp_path / "s.svm", 2000, 300, 10)
    d = load_svmlight(tmp_path / "s.svm", sparse=True)
    unit = torch.arange(0, 1200)
    rows = take_rows(d.x_train, unit)
    assert isinstance(rows, CSRRows) and rows.compact and torch.equal(rows.to_dense(), d.x_train[unit].to_dense())
    assert torch.equal(take_rows(d.x_train.to_dense(), unit), d.x_train[unit].to_dense())
    torch.manual_seed(0)
    model = SparseNet(d.num_features)
    trainer = HogwildTrainer(model, 2, 0.5, 32, F.cross_entropy)
    first = trainer.run(rows, d.y_train[unit], epochs=1).mean_loss
    last = trainer.run(rows, d.y_train[unit], epochs=3).mean_loss
    assert last < 0.8 * first, (first, last)


def csr_loader(broken: bool = False, seed: int = 0):
    """A user's loader returning sparse rows of its own (``broken``: a column beyond ``num_features``)."""
    from hmp.data import CSRRows, Dataset

    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(60, 20, generator=g) < 0.2) * torch.rand(60, 20, generator=g)
    rows = CSRRows.from_dense(x)
    if broken:
        rows = CSRRows(rows.indptr, rows.indices + 5, rows.values, 20)
    y = (x.sum(1) > x.sum(1).median()).long()
    return Dataset(rows[:50], y[:50], rows[50:], y[50:], "mine", 2)


def test_a_users_loader_may_return_csr_rows_and_bad_ones_are_refused():
    """A loader's CSRRows load (and cut into shares) like svmlight's; arrays that are not CSR rows are refused."""
    from hmp.data import load_dataset

    d = load_dataset({"kind": "mine"}, loader=csr_loader, part="train", share=(1, 2))
    assert d.sparse and len(d.y_train) == 25 and d.train_offset == 25 and d.n_train == 50
    assert torch.equal(d.x_train.to_dense(), csr_loader().x_train.to_dense()[25:])
    with pytest.raises(ValueError, match="x_train is not valid CSR rows: column indices span"):
        load_dataset({"kind": "mine", "broken": True}, loader=csr_loader)


# ---------------------------------------------------------------------------- the config


def test_sparse_is_refused_where_it_cannot_apply_naming_the_key(tmp_path):
    """``sparse = true`` with another kind, or with standardize, is a config error naming ``data.sparse``."""
    from hmp import job
    from hmp.errors import ConfigError

    write_sparse_svmlight(tmp_path / "s.svm", 200, 500, 5)
    np.savez(tmp_path / "d.npz", x=np.ones((10, 3), dtype=np.float32), y=np.zeros(10, dtype=np.int64))
    for data, says in (('kind = "npz"\npath = "d.npz"\nsparse = true', "only svmlight files"),
                       ('kind = "digits"\nsparse = true', "only svmlight files"),
                       ('kind = "svmlight"\npath = "s.svm"\nsparse = true\nstandardize = true', "makes every zero")):
        cfg = write_job(tmp_path, data=data)
        with pytest.raises(ConfigError) as err:
            job.load(cfg)
        assert err.value.key == "data.sparse" and says in str(err.value), str(err.value)


def test_launcher_checks_a_sparse_job_and_refuses_a_model_too_small_for_its_columns(tmp_path):
    """With the data: a sparse job with SparseNet over all the columns checks clean (the meta forward gets a
    CSRBatch); one whose EmbeddingBag has fewer rows than the data has columns is refused naming both, exit 2."""
    from hmp import job
    from hmp.errors import ConfigError

    write_sparse_svmlight(tmp_path / "s.svm", 300, 500, 5)
    data = 'kind = "svmlight"\npath = "s.svm"\nsparse = true'
    job.load(write_job(tmp_path, data=data, args="{ num_features = 500 }"), data=True)
    cfg = write_job(tmp_path, data=data, args="{ num_features = 400 }")
    with pytest.raises(ConfigError) as err:
        job.load(cfg, data=True)
    assert err.value.key == "model.name" and "400" in str(err.value) and "500 columns" in str(err.value), str(err.value)
    done = subprocess.run([LAUNCH, str(cfg)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "key 'model.name'" in lines[0], done.stderr[-2000:]


def test_bad_sparse_data_names_the_file_and_line(tmp_path):
    """The sparse load validates as the dense one does: NaN and an unparsable line name the file and the line."""
    from hmp.data import load_svmlight

    path = tmp_path / "s.svm"
    write_sparse_svmlight(path, 50, 40, 3)
    lines = path.read_text().splitlines()
    lines[6] = lines[6].rsplit(" ", 1)[0] + " 40:nan"
    (tmp_path / "nan.svm").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"nan\.svm line 7: feature 40 is nan"):
        load_svmlight(tmp_path / "nan.svm", sparse=True)
    (tmp_path / "empty.svm").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.svm: empty file"):
        load_svmlight(tmp_path / "empty.svm", sparse=True)


# ---------------------------------------------------------------------------- memory


_MEASURE = textwrap.dedent("""
    import json, sys
    import numpy as np, scipy.sparse, torch
    import sklearn.model_selection
    from sklearn.datasets import load_svmlight_file
    import hmp.data

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current size: only the load is measured
    before = status("VmRSS:")
    if sys.argv[1] == "sklearn":
        x, y = load_svmlight_file(sys.argv[2], dtype=np.float32)
        rows = x.shape[0]
    else:
        d = hmp.data.load_svmlight(sys.argv[2], sparse=True)
        rows = len(d.y_train) + len(d.y_test)
    print(json.dumps({"peak_growth": status("VmHWM:") - before, "rows": rows}))
""")


def _peak_growth(loader: str, path: Path) -> int:
    done = subprocess.run([sys.executable, "-c", _MEASURE, loader, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rows"] == 50000
    return out["peak_growth"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures the peak RSS through Linux's /proc")
def test_sparse_load_peak_memory_is_within_2x_of_scikit_learns_loader(tmp_path):
    """50k x 10k rows of ~20 nonzeros: the sparse load's peak memory growth (its own process) is within 2x of
    scikit-learn's load_svmlight_file on the same file (another process), and far below the dense matrix's 2 GB."""
    path = tmp_path / "big.svm"
    write_sparse_svmlight(path, 50000, 10000, 20)
    ours, peer = _peak_growth("hmp", path), _peak_growth("sklearn", path)
    dense = 50000 * 10000 * 4
    print(f"peak memory growth loading {path.stat().st_size / 1e6:.1f} MB of svmlight: hmp sparse {ours / 1e6:.1f} MB, "
          f"scikit-learn {peer / 1e6:.1f} MB (ratio {ours / peer:.2f}); dense would be {dense / 1e9:.1f} GB")
    assert peer > 0 and ours <= 2 * peer
    assert ours < dense / 50


# ---------------------------------------------------------------------------- a job


async def test_a_sparse_svmlight_job_trains_through_the_api(tmp_path):
    """Through ``hmp.LocalCluster``: a sparse svmlight file reaches this file's SparseNet as CSR batches in the
    worker, and the scheduler's evaluation (the CSR test rows) clears the majority baseline by a wide margin."""
    import hmp

    write_sparse_svmlight(tmp_path / "s.svm", 4000, 300, 10)
    cfg = write_job(tmp_path, data='kind = "svmlight"\npath = "s.svm"\nsparse = true',
                    args="{ num_features = 300 }", epochs=4)
    async with hmp.LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=120)
    d = hmp.load_dataset(hmp.load_config(cfg), "test")
    majority = max(float(d.y_test.double().mean()), 1 - float(d.y_test.double().mean()))
    acc = report["final"]["test_accuracy"]
    print(f"sparse svmlight job: test accuracy {acc:.3f} (majority {majority:.3f})")
    assert acc > majority + 0.2


def _peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM), MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def test_a_sparse_svmlight_jobs_daemons_stay_far_below_the_dense_size(tmp_path):
    """Peak memory per daemon of a sparse svmlight job (sparse_mlp), read from /proc while the daemons live:
    5,000 rows over 80,000 columns are 1.6 GB as a dense float32 matrix, which every daemon would hold (the
    scheduler its test rows, the worker its training rows); as CSR rows each daemon stays near its empty size."""
    import asyncio

    import hmp

    rows, columns = 5000, 80_000
    write_sparse_svmlight(tmp_path / "wide.svm", rows, columns, 10)
    # hmp's sparse_mlp: its row-sparse table's pushes and pulls carry only the rows a batch touches, too.
    cfg = write_job(tmp_path, data='kind = "svmlight"\npath = "wide.svm"\nsparse = true', model="sparse_mlp",
                    args=f"{{ num_features = {columns} }}", epochs=1)
    peak: dict[str, float] = {}
    async with hmp.LocalCluster(cfg) as cluster:
        train = asyncio.ensure_future(cluster.train(timeout_s=120))
        while not train.done():
            for node, proc in cluster.procs.items():
                if proc.returncode is None and (mib := _peak_rss_mib(proc.pid)) is not None:
                    peak[node] = max(peak.get(node, 0.0), mib)
            await asyncio.wait({train}, timeout=0.1)
        report = train.result()
    dense_mib = rows * columns * 4 / 2**20
    print(f"peak RSS per daemon (MiB): {peak}; the dense matrix alone: {dense_mib:.0f} MiB")
    assert set(peak) == {"scheduler", "ps0", "cpu0"} and report["final"]["stop_reason"]
    # The bound: a daemon holding even a fifth of the rows densely (the scheduler's test split) exceeds it.
    assert max(peak.values()) < 0.2 * dense_mib + 250, peak
