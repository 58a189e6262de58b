"""The model a job hands back: ``<report_dir>/model.pt`` and :func:`load_model` (``hmp.load_model``).

At the end of a PS or allreduce job the parameters its report's ``final`` evaluation used are
written as an ordinary ``state_dict`` checkpoint of the user's model (``model.pt``), with
``model.json`` saying how to rebuild the model and which parameters these are, so that nothing of
hmp is needed to use the result. The files and what ``parameters`` means are in docs/report.md
(``final.model``). A sweep job's fused parameters are not exported here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hmp import job
from hmp.config import Config
from hmp.config.schema import SECTIONS, ModelConfig

MODEL_FILE = "model.pt"
MODEL_INFO = "model.json"
CONFIG_COPY = "config.toml"
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
                metrics: Mapping[str, Any] | None = None, detail: Mapping[str, Any] | None = None) -> Path:
    """Write ``model.pt``, ``config.toml`` (a copy of ``cfg.path`` when it is a file) and ``model.json``
    into ``run_dir`` (made if needed); returns the ``model.pt`` path.

    ``model``: the job's model holding the parameters to export (a :class:`hmp.client.PSClient`'s
    after a pull, a ring member's replica); it is read, not changed, and must not change meanwhile.
    ``parameters``: one of :data:`PARAMETERS`; ``metrics``: the evaluation of exactly these values
    (``test_accuracy``, ``test_loss``); ``detail``: more for ``model.json`` (e.g. the shards' versions).
    Each file is written to a temporary name and renamed, ``model.json`` last."""
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
    source = Path(cfg.path)
    config_copy = ""
    if source.is_file():
        write_atomically(out / CONFIG_COPY, lambda f: f.write(source.read_bytes()))
        config_copy = CONFIG_COPY
    info = {"format": EXPORT_FORMAT, "job": cfg.job.name, "written_at": time.time(),
            "model": dataclasses.asdict(cfg.model), "model_class": type(model).__qualname__,
            "config_path": str(source.resolve()) if source.is_file() else cfg.path, "config_copy": config_copy,
            "parameters": parameters, "metrics": dict(metrics or {}), "detail": dict(detail or {}),
            "file": MODEL_FILE, "sha256": digest, "tensors": len(state),
            "numel": sum(t.numel() for t in state.values())}
    write_atomically(out / MODEL_INFO, lambda f: f.write(json.dumps(info, indent=1, default=str).encode()))
    return model_path


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


def load_model(run_dir: str | os.PathLike, *, map_location: str | torch.device = "cpu",
               verify: bool = True) -> nn.Module:
    """The model a job exported into ``run_dir`` (its report folder), built as the job built it and
    loaded from ``model.pt``, in eval mode, on ``map_location``. ``verify``: check ``model.pt``
    against the SHA-256 recorded at export (a file replaced or damaged since is an error)."""
    run = Path(run_dir)
    info = model_info(run)
    model_path = run / str(info.get("file", MODEL_FILE))
    if verify:
        try:
            digest = _sha256(model_path)
        except FileNotFoundError:
            raise ExportError(f"{model_path}: missing (model.json describes it)") from None
        if digest != info.get("sha256"):
            raise ExportError(f"{model_path}: its SHA-256 differs from the one model.json recorded at export "
                              "(replaced or damaged since)")
    try:
        model_cfg = ModelConfig(**info["model"])
    except (KeyError, TypeError) as exc:
        raise ExportError(f"{run / MODEL_INFO}: 'model' is not a [model] section this hmp knows ({exc})") from None
    model = job.sharded_model(_config_for(model_cfg, str(info.get("config_path", "<string>")))).model
    try:
        state = torch.load(model_path, map_location=map_location, weights_only=True)
        model.load_state_dict(state)
    except FileNotFoundError:
        raise ExportError(f"{model_path}: missing (model.json describes it)") from None
    except (RuntimeError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        raise ExportError(f"{model_path}: does not load into {model_cfg.name}({model_cfg.args}): {first}") from None
    return model.to(map_location).eval()


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

