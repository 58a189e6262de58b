"""Datasets, loaders, sharding and batch iteration (hmp.data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import dump_svmlight_file
from sklearn.metrics import roc_auc_score

from hmp.data import (
    ShuffledBatches,
    Dataset,
    DatasetSpec,
    generate_click_data,
    generate_dense_classification,
    generate_sparse_classification,
    load_dataset,
    load_digits_dataset,
    load_npz,
    load_svmlight,
    shard,
)
from hmp.models import click_model


def majority_baseline(d) -> float:
    """Test accuracy of always predicting the most frequent training class."""
    top = torch.bincount(d.y_train, minlength=d.num_classes).argmax()
    return float((d.y_test == top).double().mean())

torch.set_num_threads(1)


# ---------------------------------------------------------------------------- digits


def test_digits_shapes_scaling_and_stratified_split() -> None:
    """Digits come as float32 [N, 64] in [0, 1] with int64 labels, split 80/20 with class proportions kept."""
    d = load_digits_dataset()
    assert (d.name, d.num_classes, d.num_features, d.x_train.dtype) == ("digits", 10, 64, torch.float32)
    assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.x_train.min() >= 0 and d.x_train.max() == 1.0
    train_frac = torch.bincount(d.y_train, minlength=10) / len(d.y_train)
    test_frac = torch.bincount(d.y_test, minlength=10) / len(d.y_test)
    assert (train_frac - test_frac).abs().max() < 0.01


def test_digits_split_is_seeded() -> None:
    """The same seed gives the same split; another seed a different one."""
    a, b, c = load_digits_dataset(seed=1), load_digits_dataset(seed=1), load_digits_dataset(seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


# ---------------------------------------------------------------------------- click


def test_click_data_shape_range_and_determinism() -> None:
    """Click data is int64 ids [n, fields] in [0, buckets), about balanced 0/1 labels, fixed by the seed."""
    d = generate_click_data(5000, fields=6, buckets=300, seed=4)
    assert d.x_train.dtype == torch.int64 and d.x_train.shape == (4000, 6) and d.x_test.shape == (1000, 6)
    assert d.x_train.min() >= 0 and d.x_train.max() < 300
    assert 0.45 < float(d.y_train.double().mean()) < 0.55
    again = generate_click_data(5000, fields=6, buckets=300, seed=4)
    assert torch.equal(d.x_train, again.x_train) and torch.equal(d.y_train, again.y_train)
    assert not torch.equal(d.x_train, generate_click_data(5000, fields=6, buckets=300, seed=5).x_train)
    # Popularity skew: the most common bucket of a field is far above the uniform 1/300 share.
    assert torch.bincount(d.x_train[:, 0], minlength=300).max() > 20 * 4000 / 300
    skewed = generate_click_data(4000, positive_rate=0.2)
    assert 0.15 < float(skewed.y_train.double().mean()) < 0.25


def test_click_data_is_learnable_by_click_model() -> None:
    """click_model trained two epochs on 20k rows beats the majority baseline by a wide margin (accuracy and AUC)."""
    d = generate_click_data(20000)
    torch.manual_seed(0)
    model = click_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for idx in ShuffledBatches(len(d.y_train), 256, seed=0, epochs=2):
        xb, yb = d.x_train[idx], d.y_train[idx]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        logits = model(d.x_test)
    acc = float((logits.argmax(1) == d.y_test).double().mean())
    auc = roc_auc_score(d.y_test.numpy(), logits.softmax(1)[:, 1].numpy())
    assert acc > majority_baseline(d) + 0.15  # measured ~0.75 vs ~0.50
    assert auc > 0.78  # measured ~0.84


# ---------------------------------------------------------------------------- sparse


def test_sparse_classification_is_sparse_normalised_and_learnable() -> None:
    """Rows have exactly round(density * F) non-zeros, unit L2 norm, and a linear model learns the labels."""
    from sklearn.linear_model import LogisticRegression

    d = generate_sparse_classification(3000, 800, 0.02, seed=1)
    assert d.x_train.shape == (2400, 800) and d.x_train.dtype == torch.float32
    assert torch.all((d.x_train != 0).sum(1) == 16)
    torch.testing.assert_close(d.x_train.norm(dim=1), torch.ones(2400))
    clf = LogisticRegression(C=10, max_iter=300).fit(d.x_train.numpy(), d.y_train.numpy())
    assert clf.score(d.x_test.numpy(), d.y_test.numpy()) > majority_baseline(d) + 0.25  # measured ~0.87 vs ~0.52
    multi = generate_sparse_classification(2000, 300, 0.05, seed=2, num_classes=4, label_noise=0.1)
    assert multi.num_classes == 4 and torch.bincount(multi.y_train, minlength=4).min() > 250


# ---------------------------------------------------------------------------- synthetic (dense)


def test_dense_classification_shapes_balance_and_determinism() -> None:
    """Dense float32 rows, the last ceil(fraction * n) as test set, classes about balanced, fixed by the seed."""
    d = generate_dense_classification(2001, n_features=96, num_classes=5, seed=3, test_fraction=0.25)
    assert (d.name, d.num_classes, d.num_features) == ("synthetic-96", 5, 96)
    assert d.x_train.shape == (1500, 96) and d.x_test.shape == (501, 96)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64 and d.x_train.is_contiguous()
    assert (d.x_train != 0).all() and abs(float(d.x_train.std()) - 2 ** 0.5) < 0.1  # var 1 + noise**2
    counts = torch.bincount(torch.cat([d.y_train, d.y_test]), minlength=5)
    assert counts.min() > 0.8 * 2001 / 5 and counts.max() < 1.2 * 2001 / 5
    again = generate_dense_classification(2001, n_features=96, num_classes=5, seed=3, test_fraction=0.25)
    for a, b in ((d.x_train, again.x_train), (d.y_train, again.y_train), (d.x_test, again.x_test),
                 (d.y_test, again.y_test)):
        assert torch.equal(a, b)
    other = generate_dense_classification(2001, n_features=96, num_classes=5, seed=4, test_fraction=0.25)
    assert not torch.equal(d.x_train, other.x_train) and not torch.equal(d.y_train, other.y_train)
    noisy = generate_dense_classification(2001, n_features=96, num_classes=5, seed=3, test_fraction=0.25,
                                          label_noise=0.5)
    assert 0.3 < float((noisy.y_train != d.y_train).double().mean()) < 0.5  # half redrawn, 1/5 of those unchanged


def test_dense_classification_is_learnable() -> None:
    """A linear model beats the majority baseline by far; with no feature noise it does better still."""
    from sklearn.linear_model import LogisticRegression

    def score(noise: float) -> float:
        d = generate_dense_classification(3000, n_features=64, num_classes=4, seed=1, noise=noise)
        clf = LogisticRegression(max_iter=500).fit(d.x_train.numpy(), d.y_train.numpy())
        return clf.score(d.x_test.numpy(), d.y_test.numpy())

    d = generate_dense_classification(3000, n_features=64, num_classes=4, seed=1)
    noisy, clean = score(1.0), score(0.0)
    assert noisy > majority_baseline(d) + 0.3  # measured 0.70 vs 0.23
    assert clean > noisy + 0.05  # measured 0.86 (the labels are nonlinear in z: not 1.0 even without noise)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, "n must be a positive int, got 0"),
    ({"n_features": 2.5}, "n_features must be a positive int, got 2.5"),
    ({"num_classes": 1}, "num_classes must be >= 2, got 1"),
    ({"latent_dim": -1}, "latent_dim must be a positive int"),
    ({"hidden": True}, "hidden must be a positive int, got True"),
    ({"noise": -0.1}, r"noise must be a finite number >= 0, got -0.1"),
    ({"noise": float("nan")}, "noise must be a finite number >= 0, got nan"),
    ({"label_noise": 1.5}, r"label_noise must be in \[0, 1\], got 1.5"),
    ({"test_fraction": 0.0}, r"test_fraction must be in \(0, 1\), got 0.0"),
    ({"n": 3, "test_fraction": 0.9}, "test_fraction=0.9 of n=3 rows leaves no training rows"),
])
def test_dense_classification_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate_dense_classification(**{"n": 100, "n_features": 8, **kwargs})


def test_synthetic_kind_through_load_dataset_and_a_job_config(tmp_path: Path) -> None:
    """``kind = "synthetic"`` loads through a spec and a job's [data] table, with its args and seed."""
    from hmp import job
    from hmp.config import loads
    from hmp.errors import ConfigError

    d = load_dataset({"kind": "synthetic", "n": 400, "n_features": 16, "seed": 7, "test_fraction": 0.1})
    assert torch.equal(d.x_train, generate_dense_classification(400, 16, seed=7, test_fraction=0.1).x_train)
    with pytest.raises(ValueError, match=r"unknown option.*'features'"):
        load_dataset({"kind": "synthetic", "features": 16})

    def config(data: str) -> str:
        return (f'[data]\n{data}\n[[nodes]]\nid = "s"\nrole = "scheduler"\nbind = "tcp://127.0.0.1:5999"\n'
                '[[nodes]]\nid = "p"\nrole = "ps"\n[[nodes]]\nid = "w"\nrole = "cpu_worker"\n')

    cfg = loads(config('kind = "synthetic"\nseed = 7\ntest_fraction = 0.1\nargs = { n = 400, n_features = 16 }'),
                str(tmp_path / "job.toml"))
    assert torch.equal(job.dataset(cfg).x_test, d.x_test)
    bad = loads(config('kind = "synthetic"\nargs = { n = 400, noise = -1.0 }'), str(tmp_path / "job.toml"))
    with pytest.raises(ConfigError, match="noise must be a finite number >= 0"):
        job.dataset(bad)


# ---------------------------------------------------------------------------- files


def test_svmlight_text_with_plus_minus_one_labels(tmp_path: Path) -> None:
    """A one-based LIBSVM file reads densely with -1/+1 mapped to 0/1 and the mapping recorded."""
    train, test = tmp_path / "a.train", tmp_path / "a.test"
    train.write_text("+1 1:0.5 3:2\n-1 2:1\n+1 3:1.5\n-1 1:1 2:1\n")
    test.write_text("-1 3:4\n+1 1:1\n")
    d = load_svmlight(train, test_path=test)
    assert d.label_values == (-1, 1) and d.num_classes == 2 and d.name == "a"
    torch.testing.assert_close(d.x_train, torch.tensor([[0.5, 0, 2], [0, 1, 0], [0, 0, 1.5], [1, 1, 0]]))
    assert d.y_train.tolist() == [1, 0, 1, 0] and d.y_test.tolist() == [0, 1]
    torch.testing.assert_close(d.x_test, torch.tensor([[0.0, 0, 4], [1, 0, 0]]))
    assert load_svmlight(train, n_features=5).num_features == 5
    wider = tmp_path / "wide.test"
    wider.write_text("+1 5:1\n")  # a feature the train file never uses widens both sets
    d = load_svmlight(train, test_path=wider)
    assert d.x_train.shape == (4, 5) and d.x_test.tolist() == [[0, 0, 0, 0, 1]]
    with pytest.raises(FileNotFoundError, match="missing.svm"):
        load_svmlight(tmp_path / "missing.svm")


def test_svmlight_write_then_load_round_trips(tmp_path: Path) -> None:
    """sklearn's dump_svmlight_file then load_svmlight gives back the same dense matrix and labels (1..3 -> 0..2)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(40, 12, generator=gen) * (torch.rand(40, 12, generator=gen) < 0.3)
    x[:, 0] = 0  # an all-zero first column must not shift the indices
    y = torch.randint(1, 4, (40,), generator=gen)
    path = tmp_path / "rt.svm"
    dump_svmlight_file(x.numpy(), y.numpy(), str(path), zero_based=False)
    d = load_svmlight(path, n_features=12, test_path=path)
    torch.testing.assert_close(d.x_test, x)
    assert torch.equal(d.y_test, y - 1) and d.label_values == (1, 2, 3)
    split = load_svmlight(path, n_features=12, test_fraction=0.25, seed=3)
    assert split.x_train.shape == (30, 12) and split.x_test.shape == (10, 12)


def test_svmlight_rejects_non_integer_labels(tmp_path: Path) -> None:
    """Regression-style real labels raise ValueError naming the file."""
    path = tmp_path / "reg.svm"
    path.write_text("0.5 1:1\n1.5 2:1\n")
    with pytest.raises(ValueError, match="reg.svm.*integer"):
        load_svmlight(path)


def test_npz_loading_and_clear_errors(tmp_path: Path) -> None:
    """npz with x/y (and optional x_test/y_test) loads; a missing array's error names the file and the key."""
    full = tmp_path / "full.npz"
    np.savez(full, x=np.ones((10, 3)), y=np.arange(10) % 3, x_test=np.zeros((4, 3)), y_test=np.array([0, 1, 2, 4]))
    d = load_npz(full)
    assert d.x_train.dtype == torch.float32 and d.x_train.shape == (10, 3) and d.num_classes == 5
    ids = tmp_path / "ids.npz"
    np.savez(ids, x=np.arange(40).reshape(20, 2), y=np.arange(20) % 2)
    d = load_npz(ids, test_fraction=0.25)
    assert d.x_train.dtype == torch.int64 and d.x_train.shape == (15, 2) and d.x_test.shape == (5, 2)
    no_y = tmp_path / "no_y.npz"
    np.savez(no_y, x=np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"no_y\.npz.*'y'"):
        load_npz(no_y)
    half = tmp_path / "half.npz"
    np.savez(half, x=np.ones((3, 2)), y=np.zeros(3, dtype=np.int64), x_test=np.ones((1, 2)))
    with pytest.raises(ValueError, match=r"half\.npz.*'y_test'"):
        load_npz(half)
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((3, 2)), y=np.array([0.5, 1.0, 0.0]))
    with pytest.raises(ValueError, match=r"bad\.npz.*'y'.*integer"):
        load_npz(bad)
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        load_npz(tmp_path / "nowhere.npz")


def test_dataset_rejects_inconsistent_tensors() -> None:
    """A Dataset whose x and y lengths or dtypes disagree raises ValueError at construction."""
    x, y = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"\[N, F\]"):
        Dataset(x, y[:3], x, y, "bad", 2)
    with pytest.raises(ValueError, match="int64"):
        Dataset(x, y.float(), x, y, "bad", 2)


# ---------------------------------------------------------------------------- specs


def test_load_dataset_dispatches_on_kind(tmp_path: Path) -> None:
    """Specs as mappings or DatasetSpec pick the loader, pass options through, and reject unknown kinds/options."""
    d = load_dataset({"kind": "click", "n": 1000, "fields": 3, "buckets": 20, "seed": 2})
    assert d.x_train.shape == (800, 3) and d.x_train.max() < 20
    assert torch.equal(d.x_train, generate_click_data(1000, fields=3, buckets=20, seed=2).x_train)
    assert load_dataset(DatasetSpec("digits", test_fraction=0.5)).x_test.shape == (899, 64)
    path = tmp_path / "s.npz"
    np.savez(path, x=np.ones((10, 3)), y=np.arange(10) % 2)
    assert load_dataset({"kind": "npz", "path": str(path)}).num_classes == 2
    assert load_dataset({"kind": "sparse", "n": 100, "n_features": 50, "density": 0.1}).num_features == 50
    with pytest.raises(ValueError, match="unknown dataset kind 'mnist'.*click"):
        load_dataset({"kind": "mnist"})
    with pytest.raises(ValueError, match=r"unknown option.*'bukets'"):
        load_dataset({"kind": "click", "n": 10, "bukets": 5})
    with pytest.raises(ValueError, match="needs a 'path'"):
        load_dataset({"kind": "svmlight"})
    with pytest.raises(ValueError, match="'n'"):
        load_dataset({"kind": "click"})
    with pytest.raises(ValueError, match="needs a 'kind'"):
        load_dataset({"path": "x"})


# ---------------------------------------------------------------------------- shard and batches


def test_shard_gives_contiguous_views_covering_everything() -> None:
    """Shards are views into x/y, differ in size by at most one, and concatenate back to the whole."""
    x, y = torch.arange(23 * 2, dtype=torch.float32).view(23, 2), torch.arange(23)
    parts = [shard(x, y, i, 5) for i in range(5)]
    assert [len(px) for px, _ in parts] == [5, 5, 5, 4, 4]
    assert torch.equal(torch.cat([px for px, _ in parts]), x) and torch.equal(torch.cat([py for _, py in parts]), y)
    px, py = parts[2]
    px[0, 0] = -1.0
    assert x[10, 0] == -1.0 and py.data_ptr() == y[10:].data_ptr()  # views, not copies
    assert [len(shard(x, y, i, 30)[0]) for i in range(30)] == [1] * 23 + [0] * 7
    with pytest.raises(ValueError, match="index"):
        shard(x, y, 5, 5)
    with pytest.raises(ValueError, match="count"):
        shard(x, y, 0, 0)


def test_shuffled_batches_cover_each_index_once_per_epoch_with_resizing() -> None:
    """One epoch serves every index exactly once even when the batch size changes mid-epoch; last batch is short."""
    it = ShuffledBatches(50, batch_size=8, seed=3)
    seen, sizes = [], []
    while sum(sizes) < 50:
        if len(sizes) == 2:
            it.batch_size = 5
        idx = next(it)
        assert it.epoch == 0 and idx.dtype == torch.int64
        seen += idx.tolist()
        sizes.append(len(idx))
    assert sorted(seen) == list(range(50)) and seen != list(range(50))
    assert sizes == [8, 8, 5, 5, 5, 5, 5, 5, 4]
    idx = it.next_batch(50)
    assert it.epoch == 1 and sorted(idx.tolist()) == list(range(50)) and idx.tolist() != seen
    assert torch.equal(idx, it.order(1)) and torch.equal(torch.tensor(seen), it.order(0))


def test_shuffled_batches_order_is_fixed_by_seed_and_epoch() -> None:
    """The same (seed, epoch) replays the same batches; a restart at epoch e replays epoch e; epochs stops it."""
    first = [b.tolist() for b in ShuffledBatches(30, 7, seed=1, epochs=2)]
    assert len(first) == 10  # 5 batches per epoch, 2 epochs
    assert first == [b.tolist() for b in ShuffledBatches(30, 7, seed=1, epochs=2)]
    assert first[5:] == [b.tolist() for b in ShuffledBatches(30, 7, seed=1, epoch=1, epochs=1)]
    assert first[:5] != first[5:]
    assert first != [b.tolist() for b in ShuffledBatches(30, 7, seed=2, epochs=2)]
    assert ShuffledBatches(30, seed=(1, 0)).order(0).tolist() != ShuffledBatches(30, seed=(1, 1)).order(0).tolist()
    done = ShuffledBatches(30, 30, epochs=1)
    assert done.next_batch() is not None and done.next_batch() is None
    with pytest.raises(ValueError, match="batch_size"):
        ShuffledBatches(30, 0)


# ---------------------------------------------------------------------------- any shape, partial loads, bad files


def test_npz_of_images_keeps_its_shape_and_loads_parts_by_rows(tmp_path: Path) -> None:
    """x [N, C, H, W] stays 4-D; a share of the training split and the test part are exactly rows of the whole;
    a compressed npz (not memory-mapped) gives the same."""
    from hmp.data import select

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 2, 3, 3)).astype(np.float32), np.arange(60) % 3
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, x=x, y=y)
        whole = load_npz(path, test_fraction=0.25)
        assert whole.x_train.shape == (45, 2, 3, 3) and whole.feature_shape == (2, 3, 3) and whole.num_features == 18
        share = load_npz(path, test_fraction=0.25, part="train", share=(1, 2))
        assert share.train_offset == 22 and share.n_train == 45 and len(share.y_test) == 0
        assert torch.equal(share.x_train, whole.x_train[22:]) and torch.equal(share.y_train, whole.y_train[22:])
        test = load_npz(path, test_fraction=0.25, part="test")
        assert len(test.y_train) == 0 and torch.equal(test.x_test, whole.x_test)
        cut = select(whole, "train", (0, 2))
        assert torch.equal(cut.x_train, whole.x_train[:22]) and cut.x_train.data_ptr() != whole.x_train.data_ptr()
    assert load_dataset({"kind": "npz", "path": str(path), "test_fraction": 0.25}, part="test").n_train == 45


def test_bad_files_name_the_file_and_the_line_or_array(tmp_path: Path) -> None:
    """svmlight: an empty file, a bad token and a NaN name the line; npz: a 0-byte file, x/y of different lengths
    and an infinity name the array (and row)."""
    svm = tmp_path / "d.svm"
    svm.write_text("# a comment line\n1 1:0.5 2:1\n\n0 1:1 2:oops\n")
    with pytest.raises(ValueError, match=r"d\.svm line 4: '2:oops' is not INDEX:VALUE"):
        load_svmlight(svm)
    svm.write_text("1 1:0.5\n0 2:inf\n1 1:2\n")
    with pytest.raises(ValueError, match=r"d\.svm line 2: feature 2 is inf"):
        load_svmlight(svm)
    svm.write_text("# only a comment\n")
    with pytest.raises(ValueError, match=r"d\.svm: no examples"):
        load_svmlight(svm)
    npz = tmp_path / "d.npz"
    npz.write_bytes(b"")
    with pytest.raises(ValueError, match=r"d\.npz: empty file \(0 bytes\)"):
        load_npz(npz)
    npz.write_bytes(b"not a zip at all")
    with pytest.raises(ValueError, match=r"d\.npz: not a readable \.npz"):
        load_npz(npz)
    np.savez(npz, x=np.ones((4, 2)), y=np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match=r"arrays 'x' \(4 rows\) and 'y' \(3 labels\) differ in length"):
        load_npz(npz)
    x = np.ones((8, 2), dtype=np.float32)
    x[5, 1] = np.nan
    np.savez(npz, x=x[:6], y=np.arange(6) % 2, x_test=x[6:], y_test=np.array([0, 1]))
    with pytest.raises(ValueError, match=r"array 'x' row 5 holds NaN or infinity"):
        load_npz(npz)


def test_standardize_and_scale_advice() -> None:
    """standardize scales with the training rows' statistics only; scale_advice speaks only for wildly mixed scales."""
    from hmp.data import FeatureStats, scale_advice, standardize

    x_train = torch.tensor([[1.0, 1e5], [3.0, 3e5], [5.0, 5e5]])
    x_test = torch.tensor([[7.0, 7e5]])
    y = torch.zeros(3, dtype=torch.int64)
    d = Dataset(x_train.clone(), y, x_test.clone(), y[:1], "t", 2)
    assert "standardize = true" in scale_advice(d)
    standardize(d)
    torch.testing.assert_close(d.x_train.mean(0), torch.zeros(2))
    expected = 4.0 / FeatureStats.of(x_train).std[0].item()  # (7 - 3) / std, alike in both columns
    torch.testing.assert_close(d.x_test, torch.tensor([[expected, expected]]))
    assert scale_advice(d) is None
