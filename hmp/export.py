"""The model a job hands back: ``<report_dir>/model.pt`` and :func:`load_model` (``hmp.load_model``).

At the end of a PS or allreduce job the parameters its report's ``final`` evaluation used are
written as an ordinary ``state_dict`` checkpoint of the user's model (``model.pt``), with
``model.json`` saying how to rebuild the model and which parameters these are, beside what else the
model needs to stand alone: the source file of a ``file.py:Class`` model (``source/``), the
``[data] standardize`` statistics (``standardize.pt``, applied by the loaded model to raw features) and
the config as the run read it (``config.toml``), so that the folder works from anywhere, after the
user's folder moved. The files and what ``parameters`` means are in docs/report.md (``final.model``).
A sweep job's fused parameters are not exported here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hmp import job, models
from hmp.config import Config
from hmp.config.schema import SECTIONS, ModelConfig
from hmp.config.toml_text import RUN_CONFIG, absolute_paths, dumps
from hmp.data import FeatureStats

MODEL_FILE = "model.pt"
MODEL_INFO = "model.json"
CONFIG_COPY = RUN_CONFIG  # the launcher's resolved config, when it wrote one, has the same name
#: ``[data] standardize``'s statistics: ``{"mean": tensor, "std": tensor}``
STANDARDIZE_FILE = "standardize.pt"
#: where a ``file.py:Class`` model's source file is copied
SOURCE_DIR = "source"
#: ``model.json``'s format; :func:`load_model` reads this one
EXPORT_FORMAT = 1
#: the values of ``model.json``'s ``parameters`` (docs/report.md, ``final.model``)
PARAMETERS = ("at_stop", "end", "ring")


class ExportError(ValueError):
    """An export that cannot be read back (missing, damaged, of another format or model); names the file."""


def exportable(cfg: Config) -> str:
    """Why ``cfg``'s job exports no ``model.pt`` ("" when it does)."""
    if cfg.sweep.members:
        return "a sweep job's members are fused into one array (hmp.hfta); no single model to export"
    return ""


def write_model(run_dir: str | os.PathLike, cfg: Config, model: nn.Module, *, parameters: str,
                metrics: Mapping[str, Any] | None = None, detail: Mapping[str, Any] | None = None,
                stats: FeatureStats | None = None) -> Path:
    """Write ``model.pt``, what the model needs to stand alone (``standardize.pt``, ``source/``, ``config.toml``)
    and ``model.json`` into ``run_dir`` (made if needed); returns the ``model.pt`` path.

    ``model``: the job's model holding the parameters to export (a :class:`hmp.client.PSClient`'s
    after a pull, a ring member's replica); it is read, not changed, and must not change meanwhile.
    ``parameters``: one of :data:`PARAMETERS`; ``metrics``: the evaluation of exactly these values
    (``test_accuracy``, ``test_loss``); ``detail``: more for ``model.json`` (e.g. the shards' versions);
    ``stats``: the training split's statistics the data was standardized by (``[data] standardize``; taken
    from the data when not given). Each file is written to a temporary name and renamed, ``model.json`` last."""
    why = exportable(cfg)
    if why:
        raise ValueError(f"job {cfg.job.name!r}: {why}")
    if parameters not in PARAMETERS:
        raise ValueError(f"parameters must be one of {list(PARAMETERS)}, got {parameters!r}")
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    # .cpu() copies only what is on a GPU: the file must load on a machine without one. The tensors of a
    # worker's model are views of its flat buffers; torch.save writes each shared buffer once.
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    model_path = out / MODEL_FILE
    write_atomically(model_path, lambda f: torch.save(state, f))
    digest = _sha256(model_path)
    standardize = None
    if cfg.data.standardize:
        stats = stats if stats is not None else job.dataset(cfg, "train").stats
        assert stats is not None  # dataset() standardizes with [data] standardize
        tensors = {"mean": stats.mean.detach().cpu(), "std": stats.std.detach().cpu()}
        write_atomically(out / STANDARDIZE_FILE, lambda f: torch.save(tensors, f))
        standardize = {"file": STANDARDIZE_FILE, "sha256": _sha256(out / STANDARDIZE_FILE),
                       "shape": list(stats.mean.shape)}
    model_section = dataclasses.asdict(cfg.model)
    source_file = _model_file(cfg)
    model_source = ""
    if source_file is not None:  # a file.py:Class model: its file beside the weights, named relative to run_dir
        (out / SOURCE_DIR).mkdir(exist_ok=True)
        write_atomically(out / SOURCE_DIR / source_file.name, lambda f: f.write(source_file.read_bytes()))
        model_source = str(source_file)
        model_section["name"] = f"{SOURCE_DIR}/{source_file.name}:{cfg.model.name.rpartition(':')[2]}"
    source = Path(cfg.path)
    config_copy = ""
    if source.is_file():
        text = _config_text(cfg, out, model_section["name"] if model_source else None)
        write_atomically(out / CONFIG_COPY, lambda f: f.write(text.encode()))
        config_copy = CONFIG_COPY
    info = {"format": EXPORT_FORMAT, "job": cfg.job.name, "written_at": time.time(),
            "model": model_section, "model_class": type(model).__qualname__, "model_source": model_source,
            "config_path": str(source.resolve()) if source.is_file() else cfg.path, "config_copy": config_copy,
            "parameters": parameters, "metrics": dict(metrics or {}), "detail": dict(detail or {}),
            "file": MODEL_FILE, "sha256": digest, "tensors": len(state),
            "numel": sum(t.numel() for t in state.values()), "standardize": standardize}
    write_atomically(out / MODEL_INFO, lambda f: f.write(json.dumps(info, indent=1, default=str).encode()))
    return model_path


def _model_file(cfg: Config) -> Path | None:
    """The source file of a ``path/to/file.py:Class`` ``[model] name`` (None for a registry name or a module)."""
    where, sep, _ = cfg.model.name.rpartition(":")
    if not sep or not (where.endswith(".py") or "/" in where or "\\" in where):
        return None
    path = Path(where).expanduser()
    path = (path if path.is_absolute() else models.config_dir(cfg) / path).resolve()
    return path if path.is_file() else None


def _config_text(cfg: Config, out: Path, model_name: str | None) -> str:
    """``config.toml`` of the run folder ``out``: the config as the run read it (command-line overrides applied, the
    nodes written out), paths relative to the config's folder made absolute, and ``model_name`` (the copied
    source, relative to the run folder) as ``[model] name``. The header of a config the launcher resolved into
    this very file (hmp.config.toml_text.write_run_config) is kept: it says where the config came from."""
    source = Path(cfg.path)
    raw = cfg.raw or tomllib.loads(source.read_text())
    raw = absolute_paths(raw, source.resolve().parent)
    if model_name:
        raw["model"] = {**raw.get("model", {}), "name": model_name}
    if source.resolve() == (out / CONFIG_COPY).resolve():
        header = list(itertools.takewhile(lambda line: line.startswith("#"), source.read_text().splitlines()))
    else:
        header = [f"# {cfg.path} as the job {cfg.job.name!r} ran it (hmp.export): relative paths made absolute"]
        if cfg.overrides:
            header.append("# command-line overrides: " + " ".join(cfg.overrides))
    copied = "# [model] name: the copy of the model's source file in this folder"
    if model_name and copied not in header:
        header.append(copied)
    return "\n".join(header) + "\n\n" + dumps(raw)


def model_info(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``model.json`` of an export: :class:`ExportError` naming the file when it is missing or unreadable."""
    path = Path(run_dir) / MODEL_INFO
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{path}: no exported model here (the job did not finish, exports none, or "
                          f"this is not a run folder)") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: unreadable ({exc})") from None
    if not isinstance(info, dict) or info.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path}: export format {info.get('format') if isinstance(info, dict) else None!r}; "
                          f"this hmp reads format {EXPORT_FORMAT}")
    return info


class Standardized(nn.Module):
    """A model trained on standardized features (``[data] standardize``), taking raw ones: ``forward(x)`` is
    ``model((x - mean) / std)`` with the training split's statistics (buffers ``mean`` and ``std``); ``model``
    is the user's own module, which takes standardized features."""

    def __init__(self, model: nn.Module, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> Any:
        return self.model((x - self.mean) / self.std)


def load_model(run_dir: str | os.PathLike, *, map_location: str | torch.device = "cpu",
               verify: bool = True, raw_features: bool = True) -> nn.Module:
    """The model a job exported into ``run_dir`` (its report folder), built as the job built it and
    loaded from ``model.pt``, in eval mode, on ``map_location``; from any working directory, a
    ``file.py:Class`` model from the copy of its file in ``run_dir``. A job that standardized its data
    gives a :class:`Standardized` model taking raw features (``raw_features=False``: the user's model
    alone, taking standardized ones). ``verify``: check the files against the SHA-256 recorded at export
    (a file replaced or damaged since is an error)."""
    run = Path(run_dir)
    info = model_info(run)
    model_path = run / str(info.get("file", MODEL_FILE))
    if verify:
        _verify(model_path, info.get("sha256"))
    try:
        model_cfg = ModelConfig(**info["model"])
    except (KeyError, TypeError) as exc:
        raise ExportError(f"{run / MODEL_INFO}: 'model' is not a [model] section this hmp knows ({exc})") from None
    # A copied source file is named relative to the run folder; otherwise as the job named it, from its config's.
    where = str(run.resolve() / CONFIG_COPY) if info.get("model_source") else str(info.get("config_path", "<string>"))
    try:
        model = job.sharded_model(_config_for(model_cfg, where)).model
    except models.ModelNotFound as exc:
        raise ExportError(f"{run / MODEL_INFO}: the model cannot be built: {exc}") from None
    try:
        state = torch.load(model_path, map_location=map_location, weights_only=True)
        model.load_state_dict(state)
    except FileNotFoundError:
        raise ExportError(f"{model_path}: missing (model.json describes it)") from None
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ExportError(f"{model_path}: does not load into {model_cfg.name}({model_cfg.args}): {first}") from None
    standardize = info.get("standardize")
    if standardize and raw_features:
        stats_path = run / str(standardize.get("file", STANDARDIZE_FILE))
        if verify:
            _verify(stats_path, standardize.get("sha256"))
        try:
            stats = torch.load(stats_path, map_location=map_location, weights_only=True)
            model = Standardized(model, stats["mean"], stats["std"])
        except FileNotFoundError:
            raise ExportError(f"{stats_path}: missing (model.json describes it)") from None
        except (RuntimeError, ValueError, OSError, KeyError, TypeError) as exc:
            raise ExportError(f"{stats_path}: not the standardize statistics ({exc})") from None
    return model.to(map_location).eval()


def _verify(path: Path, recorded: Any) -> None:
    try:
        digest = _sha256(path)
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (model.json describes it)") from None
    if digest != recorded:
        raise ExportError(f"{path}: its SHA-256 differs from the one model.json recorded at export "
                          "(replaced or damaged since)")


def _config_for(model_cfg: ModelConfig, path: str) -> Config:
    """A config holding ``[model]`` and defaults elsewhere: what :func:`hmp.job.sharded_model` needs to build
    the model (``path``: where relative paths in the model's name are resolved from)."""
    sections = {name: cls() for name, cls in SECTIONS.items()}
    sections["model"] = model_cfg
    return Config(path=path, nodes=(), **sections)


def write_atomically(path: Path, write: Any) -> None:
    """``write(f)`` into a temp file beside ``path`` (binary), fsync, rename over ``path``: a reader sees the
    old file or the whole new one, never a torn one; a failed write leaves no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

