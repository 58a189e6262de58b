"""Each daemon loads only what it trains on or evaluates (docs/data.md, "Loading a part"): a ring member the training
split (rank 0 also the test set), a pipeline stage worker the test set and, once it is stage 0, the training split,
a static PS worker its slice; an npz with its own test split is a view of the file, not a copy.

The jobs run real daemons on loopback; what each loaded is read from its log (``data_loaded``, ``training``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hmp.cluster import LocalCluster
from tests.support import digits_job_text, free_port, pipeline_config, write_config

DIGITS_TRAIN, DIGITS_TEST = 1437, 360


def events(run: Path, node: str, name: str) -> list[dict]:
    """The ``name`` events of ``node``'s log (JSON lines)."""
    out = []
    for line in (run / "logs" / f"{node}.log").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            out.append(record)
    return out


def _mapped_files() -> list[tuple[int, int, str]]:
    """This process's file-backed mappings: (start, end, path)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            lo, hi = (int(a, 16) for a in parts[0].split("-"))
            out.append((lo, hi, parts[5]))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from Linux's /proc")
def test_an_npz_with_its_own_test_split_is_a_view_of_the_file(tmp_path):
    """x and x_test of an uncompressed npz: the training split, a slice and the test set are tensors over the file's
    mapping (read when touched, shared through the page cache), not copies; writing them leaves the file as it was;
    an npz without a test split is gathered in the split's order (a copy)."""
    from hmp.data import load_npz

    rng = np.random.default_rng(0)
    x, xt = rng.random((400, 16), dtype=np.float32), rng.random((100, 16), dtype=np.float32)
    y, yt = rng.integers(0, 3, 400), rng.integers(0, 3, 100)
    path = tmp_path / "d.npz"
    np.savez(path, x=x, y=y, x_test=xt, y_test=yt)

    def in_file(t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return any(lo <= ptr < hi and name == str(path) for lo, hi, name in _mapped_files())

    whole = load_npz(path)
    assert in_file(whole.x_train) and in_file(whole.x_test)
    assert torch.equal(whole.x_train, torch.from_numpy(x)) and torch.equal(whole.x_test, torch.from_numpy(xt))
    part = load_npz(path, part="train", share=(1, 4))
    assert in_file(part.x_train) and part.train_offset == 100
    assert torch.equal(part.x_train, torch.from_numpy(x[100:200]))
    whole.x_train.mul_(2)  # copy-on-write: the process's pages change, the file does not
    with np.load(path) as z:
        assert np.array_equal(z["x"], x)
    np.savez(tmp_path / "split.npz", x=x, y=y)
    split = load_npz(tmp_path / "split.npz")
    assert not in_file(split.x_train) and len(split.y_train) + len(split.y_test) == 400


def _svmlight_variants(tmp: Path) -> list[tuple[Path, Path | None]]:
    """(file, test file) pairs: plain one-based, with comments, blank lines and qids, zero-based, a test file."""
    from sklearn.datasets import dump_svmlight_file

    rng = np.random.default_rng(1)
    x = (rng.random((900, 60)) < 0.1) * rng.random((900, 60))
    y = rng.integers(0, 3, 900) * 2 + 1
    dump_svmlight_file(x, y, str(tmp / "one.svm"), zero_based=False)
    dump_svmlight_file(x, y, str(tmp / "zero.svm"), zero_based=True)
    dump_svmlight_file(x[:200], y[:200], str(tmp / "test.svm"), zero_based=False)
    lines = []
    for i, line in enumerate((tmp / "one.svm").read_text().splitlines()):
        lines += ["# a comment"] * (i % 7 == 0) + [""] * (i % 11 == 0)
        label, _, rest = line.partition(" ")
        lines.append(f"{label} qid:{i % 4} {rest} # tail" if i % 5 == 0 and rest else line)
    (tmp / "noisy.svm").write_text("\n".join(lines) + "\n")
    return [(tmp / "one.svm", None), (tmp / "noisy.svm", None), (tmp / "zero.svm", None),
            (tmp / "one.svm", tmp / "test.svm")]


def test_svmlight_parts_parse_only_their_lines_and_equal_the_whole_load_cut(tmp_path):
    """A share or the test set of an svmlight file (dense or sparse) parses only its own lines, yet equals the
    whole load cut (rows, order, labels, feature count, offsets): one-based, zero-based, comments and qids, a
    separate test file. A NaN outside the part is not this load's to find; inside it, its line is named."""
    from hmp.data import load_svmlight, select
    from hmp.data.dataset import _split
    from hmp.data.loaders import _svmlight_index

    for path, test_path in _svmlight_variants(tmp_path):
        assert _svmlight_index(path) is not None  # the quick pass reads it: the parts below parse only their lines
        for sparse in (False, True):
            whole = load_svmlight(path, sparse=sparse, test_path=test_path)
            for part, share in (("train", (1, 3)), ("all", (0, 2)), ("test", None), ("all", (3, 4))):
                got = load_svmlight(path, sparse=sparse, test_path=test_path, part=part, share=share)
                want = select(whole, part, share)
                dense = (lambda x: x.to_dense()) if sparse else (lambda x: x)
                assert torch.equal(dense(got.x_train), dense(want.x_train)), (path, part, share)
                assert torch.equal(dense(got.x_test), dense(want.x_test)), (path, part, share)
                assert torch.equal(got.y_train, want.y_train) and torch.equal(got.y_test, want.y_test)
                assert (got.train_offset, got.n_train, got.label_values, got.num_features) == \
                    (want.train_offset, want.n_train, want.label_values, want.num_features)
    lines = (tmp_path / "one.svm").read_text().splitlines()
    y = np.array([int(line.split()[0]) for line in lines])
    train_rows = _split(np.arange(len(y)), y, 0.2, 0)[0]
    first, last = int(train_rows[0]), int(train_rows[-1])  # in share (0, 2), and in share (1, 2)
    for row in (first, last):
        bad = list(lines)
        bad[row] = bad[row].split()[0] + " 1:nan"
        (tmp_path / "nan.svm").write_text("\n".join(bad) + "\n")
        with pytest.raises(ValueError, match=rf"nan\.svm line {row + 1}: feature 1 is nan"):
            load_svmlight(tmp_path / "nan.svm", part="train", share=(0, 2) if row == first else (1, 2))
        other = load_svmlight(tmp_path / "nan.svm", part="train", share=(1, 2) if row == first else (0, 2))
        assert len(other.y_train) == 360  # the other half of the training rows: the bad line is not among them


async def test_ring_members_load_the_training_split_and_only_rank_0_the_test_set(tmp_path):
    """Two ring members: both load the training split only; rank 0 (w0, the evaluator) loads the test set too."""
    text = digits_job_text(tmp_path, name="ring", consistency="allreduce", target=0.99, epochs=2,
                           max_seconds=60, train_extra="batch_size = 32") + f"""
[[nodes]]
id = "scheduler"
role = "scheduler"
bind = "tcp://127.0.0.1:{free_port()}"
"""
    for i in range(2):
        text += f'\n[[nodes]]\nid = "w{i}"\nrole = "cpu_worker"\n'
    cfg = tmp_path / "job.toml"
    cfg.write_text(text)
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=120)
    assert report["final"]["evaluated_by"] == "w0" and report["final"]["test_accuracy"] > 0.5
    run = tmp_path / "run"
    loads = {w: [(e["part"], e["train_rows"], e["test_rows"]) for e in events(run, w, "data_loaded")]
             for w in ("w0", "w1")}
    assert loads == {"w0": [("train", DIGITS_TRAIN, 0), ("test", 0, DIGITS_TEST)], "w1": [("train", DIGITS_TRAIN, 0)]}


@pytest.mark.parametrize("policy", ["static", "hogbatch"])
async def test_ps_workers_load_their_slice_or_with_first_come_first_served_the_split(tmp_path, policy):
    """Static slices: each PS worker trains on (and loaded) its half of the training rows. First-come-first-served
    (the Hogbatch policy): each loaded the whole training split, since a work unit may be any of its rows."""
    cfg = write_config(tmp_path, target=0.99, epochs=1, policy=policy)
    async with LocalCluster(cfg) as cluster:
        await cluster.train(timeout_s=120)
    run = tmp_path / "run"
    samples = sorted(events(run, w, "training")[0]["samples"] for w in ("cpu0", "gpu0"))
    half = DIGITS_TRAIN // 2
    assert samples == ([half, DIGITS_TRAIN - half] if policy == "static" else [DIGITS_TRAIN] * 2), samples


async def test_pipeline_stage_workers_load_training_rows_only_for_stage_0(tmp_path):
    """The click pipeline (embeddings on the cpu workers, the MLP on the accel worker): the stage-0 workers load
    the training split when assigned stage 0; the last stage's worker only the test set (its labels come with the
    activations)."""

    cfg = pipeline_config(tmp_path, epochs=1, samples=8000)
    async with LocalCluster(cfg) as cluster:
        report = await cluster.train(timeout_s=90)
    run = Path(cfg.report_dir)
    plans = report["pipeline"]["plans"]
    ever_stage_0 = {w for p in plans for w in p["stages"][0]["workers"]}
    workers = {w for p in plans for st in p["stages"] for w in st["workers"]}
    assert ever_stage_0 and workers - ever_stage_0, plans  # both kinds of stage worker ran
    for w in workers:
        parts = [e["part"] for e in events(run, w, "data_loaded")]
        assert parts == (["test", "train"] if w in ever_stage_0 else ["test"]), (w, parts, plans)
