"""Job files: a ring-all-reduce training job without its topology, plus a ``[submit]`` table.

A job file is an hmp config (``[job]``, ``[model]``, ``[data]``, ``[optimizer]``, ``[train]``,
``[collective]``, ...) with no ``[[nodes]]``: the job manager writes the nodes once the scheduler has
placed the job (:func:`topology`). ``[submit]`` says what the scheduler needs to know::

    [submit]
    min_workers = 1          # fewest ring workers the job accepts (default 1)
    max_workers = 4          # most it can use (default: workers)
    workers = 2              # what the user asks for (the trace's num_gpus; default min_workers)
    model_type = "mlp_wide"  # the cost model's name for this job's model (default: derived from [model])
    utility = { kind = "linear", value = 1.0, zero_at_s = 600 }   # value of finishing at a completion time
                                                                  # (hmp.manager.utility: linear, sigmoid, convergence)

The work is ``[train] epochs`` passes over the training set (``samples`` = epochs x training
examples; a job stops earlier at ``target_accuracy`` or ``max_seconds``). Every error is a
:class:`~hmp.errors.ConfigError` naming the file, the key and what was expected; the whole config,
with a stand-in topology of ``min_workers`` workers, goes through :func:`hmp.job.loads`, so a job
that loads here also loads in its daemons.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hmp import job as job_mod
from hmp.config import Config
from hmp.data import whole_batch
from hmp.emulate import dumps_toml
from hmp.errors import ConfigError
from hmp.gadget.interface import Utility
from hmp.manager.utility import UtilityError, make_utility

#: Keys of the ``[submit]`` table.
SUBMIT_KEYS = ("min_workers", "max_workers", "workers", "model_type", "utility")
#: Sections a job file may not have, as a file writes them: the manager writes the topology.
_MANAGED = {"nodes": "[[nodes]]", "cluster": "[cluster]"}


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """A loaded job file. ``raw`` holds its sections (no ``[[nodes]]``, no ``[submit]``) for :func:`topology`."""

    path: str
    name: str
    raw: dict[str, Any]
    min_workers: int
    max_workers: int
    workers: int                 # requested
    model_type: str
    utility_table: dict[str, Any]  # the [submit] utility table, as written (kind + parameters)
    utility: Utility
    train_examples: int          # examples in one epoch of the training set
    epochs: int
    batch_size: int              # per worker
    grad_bytes: int              # bytes of gradient a ring all-reduces per step (the model's parameters)
    cfg: Config                  # the config as checked (with a stand-in topology)

    @property
    def samples(self) -> float:
        """The work: training examples to process (epochs x training set)."""
        return float(self.epochs * self.train_examples)


def _int(path: str, key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(path, key, f"an integer >= {lo}, got {v!r}")
    return v


def loads_job(text: str, path: str = "<string>") -> JobSpec:
    """Parse and check a job file's text; ``path`` names it in errors and anchors relative data paths."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "<file>", f"valid TOML ({exc})") from None
    for key, written in _MANAGED.items():
        if key in raw:
            raise ConfigError(path, key, f"no {written} in a job file: the job manager places the workers "
                                         "([submit] min_workers/max_workers/workers say how many)")
    sub = raw.pop("submit", None)
    if sub is None:
        raise ConfigError(path, "submit", "a [submit] table (min_workers, max_workers, workers, utility)")
    if not isinstance(sub, dict):
        raise ConfigError(path, "submit", "a table")
    extra = sorted(set(sub) - set(SUBMIT_KEYS))
    if extra:
        raise ConfigError(path, f"submit.{extra[0]}", f"unknown key; expected one of {list(SUBMIT_KEYS)}")
    lo = _int(path, "submit.min_workers", sub.get("min_workers", 1), 1)
    want = _int(path, "submit.workers", sub.get("workers", lo), 1)
    hi = _int(path, "submit.max_workers", sub.get("max_workers", max(want, lo)), 1)
    if hi < lo:
        raise ConfigError(path, "submit.max_workers", f"at least min_workers ({lo}), got {hi}")
    if not lo <= want <= hi:
        raise ConfigError(path, "submit.workers", f"between min_workers ({lo}) and max_workers ({hi}), got {want}")
    table = sub.get("utility")
    if not isinstance(table, dict):
        raise ConfigError(path, "submit.utility", f"a table such as {{ kind = \"linear\", value = 1.0, zero_at_s = 600 }}, "
                                                 f"got {table!r}")
    try:
        utility = make_utility(table)
    except UtilityError as exc:
        raise ConfigError(path, f"submit.utility.{exc.key}", exc.expected) from None
    train = raw.setdefault("train", {})
    if not isinstance(train, dict):
        raise ConfigError(path, "train", "a table")
    consistency = train.setdefault("consistency", "allreduce")
    if consistency != "allreduce":
        raise ConfigError(path, "train.consistency", f"\"allreduce\" (the job manager runs ring jobs), got {consistency!r}")
    _absolute_data_paths(raw, path)
    cfg = _check(raw, path, lo)
    grad_bytes = _grad_bytes(cfg)
    # By default a model type per architecture and batch size: the cost model keys compute time on it.
    model_type = sub.get("model_type", f"{cfg.model.name}-{grad_bytes // 4}p-b{cfg.train.batch_size}")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(path, "submit.model_type", f"a non-empty string, got {model_type!r}")
    examples = _train_examples(cfg)
    if examples < hi * cfg.train.batch_size:
        raise ConfigError(path, "submit.max_workers", f"at most {examples // cfg.train.batch_size} workers: each step "
                                                     f"takes workers x batch_size ({cfg.train.batch_size}) of the "
                                                     f"{examples} training examples")
    return JobSpec(path=path, name=cfg.job.name, raw=raw, min_workers=lo, max_workers=hi, workers=want,
                   model_type=model_type, utility_table=dict(table), utility=utility, train_examples=examples,
                   epochs=cfg.train.epochs, batch_size=cfg.train.batch_size, grad_bytes=grad_bytes, cfg=cfg)


def load_job(path: str | os.PathLike) -> JobSpec:
    p = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(p, "<file>", f"a readable job file ({exc.strerror})") from None
    return loads_job(text, p)


def _absolute_data_paths(raw: dict[str, Any], path: str) -> None:
    """Relative data paths are relative to the job file; the derived topology lives elsewhere."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return
    base = Path(path).resolve().parent if not path.startswith("<") else Path.cwd()
    for key in ("path", "test_path"):
        if isinstance(data.get(key), str) and data[key] and not Path(data[key]).is_absolute():
            data[key] = str(base / data[key])


def _nodes(placement: Sequence[tuple[str, int]], port: int) -> list[dict[str, Any]]:
    """A scheduler on the host with the most workers (its fixed port: the job's rendezvous) and one
    cpu_worker per slot, ``w0``.. in host order."""
    hosts = [h for h, n in placement if n > 0]
    first = max(hosts, key=lambda h: dict(placement)[h])
    nodes: list[dict[str, Any]] = [{"id": "scheduler", "role": "scheduler", "host": first,
                                    "bind": f"tcp://127.0.0.1:{port}"}]
    for h, n in placement:
        for _ in range(n):
            nodes.append({"id": f"w{len(nodes) - 1}", "role": "cpu_worker", "host": h, "bind": "tcp://127.0.0.1:0"})
    return nodes


def _check(raw: dict[str, Any], path: str, workers: int) -> Config:
    """The config checked as the daemons will load it, with a stand-in topology of ``workers`` on one host."""
    text = dumps_toml({**raw, "nodes": _nodes([("h", workers)], 1)})
    return job_mod.loads(text, path)


def _train_examples(cfg: Config) -> int:
    """Examples in the training set: the dataset is loaded once (digits, click: a fraction of a second)."""
    return len(job_mod.dataset(cfg).y_train)


def _grad_bytes(cfg: Config) -> int:
    """Bytes of the model's parameters (= its gradient), counted on the meta device (nothing allocated)."""
    import torch

    from hmp import models

    with torch.device("meta"):
        model = models.from_config(cfg)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def profile_compute_s(spec: JobSpec, steps: int = 5) -> float:
    """Seconds of one worker's forward, backward and SGD step on a batch of ``batch_size`` (median of
    ``steps``, after one warm-up), on this machine's CPU: the cost model's first guess of compute time."""
    import statistics
    import time

    import torch

    from hmp.train.task import task_of

    data = job_mod.dataset(spec.cfg)
    task = task_of(spec.cfg)
    torch.set_num_threads(1)  # as each worker daemon computes: one thread (this process trains nothing else)
    torch.manual_seed(0)
    from hmp import models

    model = models.from_config(spec.cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = whole_batch(data.x_train[:spec.batch_size]), data.y_train[:spec.batch_size]
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def topology(spec: JobSpec, *, job_name: str, placement: Mapping[str, int], port: int, report_dir: str | os.PathLike,
             extra: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The job as a full topology (TOML text): ``[job] name``/``report_dir`` set, one worker per slot of
    ``placement`` (host -> workers, in host order) on that host, the scheduler on ``port``.
    ``extra``: further section keys to set (e.g. ``{"train": {"max_seconds": 30}}``)."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in spec.raw.items()}
    raw.setdefault("job", {})
    raw["job"].update(name=job_name, report_dir=str(report_dir))
    # The job accepts no fewer workers than it asked for: below that, losing a worker fails it (else the
    # ring re-forms from the survivors and it goes on).
    raw.setdefault("train", {}).setdefault("min_workers", min(spec.min_workers, sum(placement.values())))
    for section, keys in (extra or {}).items():
        raw.setdefault(section, {}).update(keys)
    raw["nodes"] = _nodes([(h, n) for h, n in placement.items()], port)
    return f"# {spec.path} placed by the job manager (hmp.manager): {dict(placement)}\n" + dumps_toml(raw)


def epochs_for(samples: float, train_examples: int) -> int:
    """Whole epochs that cover ``samples`` training examples (at least one)."""
    return max(1, math.ceil(samples / train_examples))


__all__ = ["JobSpec", "SUBMIT_KEYS", "epochs_for", "load_job", "loads_job", "profile_compute_s", "topology"]
