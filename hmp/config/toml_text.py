"""A loaded config written back as TOML: what a run's daemons read and what its run folder keeps.

:func:`resolved_text` writes :attr:`Config.raw` (the file's tables, command-line overrides applied,
``[cluster]`` counts as ``[[nodes]]``) with the paths that were relative to the config file's folder made
absolute, so that the text loads to the same config from any folder. :func:`dumps` knows what config
files hold (tables, inline tables, arrays, strings, numbers, booleans) and checks that its text reads back.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from hmp.config.schema import Config
from hmp.errors import ConfigError

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
#: the resolved config's name in the report folder (hmp.export keeps the run's copy under the same name)
RUN_CONFIG = "config.toml"


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k, ensure_ascii=False)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else repr(v)  # repr: the shortest text that reads back; inf as inf
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")  # JSON's escapes are TOML's
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def dumps(raw: dict[str, Any]) -> str:
    """TOML text for config tables: each section a ``[table]`` (tables inside it inline), ``nodes`` as
    ``[[nodes]]``. Raises TypeError for a value config files do not hold, ValueError if the text would not
    read back as ``raw``."""
    lines: list[str] = []
    for name, value in raw.items():
        if not isinstance(value, dict) and not (name == "nodes" and isinstance(value, list)):
            lines.append(f"{_key(name)} = {_value(value)}")
    for name, value in raw.items():
        if isinstance(value, dict):
            lines += ["", f"[{_key(name)}]", *(f"{_key(k)} = {_value(v)}" for k, v in value.items())]
        elif name == "nodes" and isinstance(value, list):
            for node in value:
                lines += ["", f"[[{_key(name)}]]", *(f"{_key(k)} = {_value(v)}" for k, v in node.items())]
    text = "\n".join(lines).lstrip("\n") + "\n"
    if tomllib.loads(text) != raw:
        raise ValueError("the config's tables do not read back from the TOML written for them")
    return text


def _absolute_import_path(ref: str, folder: Path) -> str:
    """``path/to/file.py:attr`` relative to ``folder`` made absolute; a module path (``pkg.mod:attr``) as it is."""
    where, sep, attr = ref.rpartition(":")
    if not sep or not (where.endswith(".py") or "/" in where or "\\" in where):
        return ref
    path = Path(where).expanduser()
    return ref if path.is_absolute() else f"{folder / path}:{attr}"


def absolute_paths(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A copy of the tables ``raw`` in which every path the config takes relative to its file's folder
    (``folder``) is absolute: the data files, ``[security] key_dir``, and the files of import paths in
    ``[model] name`` and ``[data] kind``. Paths relative to the working directory (``report_dir``,
    ``checkpoint_dir``) stay as they are."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for section, key in (("data", "path"), ("data", "test_path"), ("security", "key_dir")):
        table = out.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            table[key] = str(folder / value)
    for section, key in (("model", "name"), ("data", "kind")):
        table = out.get(section)
        if isinstance(table, dict) and isinstance(table.get(key), str):
            table[key] = _absolute_import_path(table[key], folder)
    return out


def resolved_text(cfg: Config, header: str = "") -> str:
    """``cfg`` as TOML that loads to the same config from any folder (:attr:`Config.raw`, relative paths made
    absolute), after a comment saying where it came from (``header``: more of it). Environment overrides
    (``HMP_*``) are not in it: each daemon reads those itself."""
    folder = Path(cfg.path).resolve().parent
    lines = [f"# {cfg.path} as this run read it: relative paths made absolute"]
    if cfg.nodes_from_counts:
        lines.append("# [cluster] counts written out as [[nodes]]")
    if cfg.overrides:
        lines.append("# command-line overrides: " + " ".join(cfg.overrides))
    if header:
        lines.append(f"# {header}")
    try:
        body = dumps(absolute_paths(cfg.raw, folder))
    except (TypeError, ValueError) as exc:
        raise ConfigError(cfg.path, "<file>", f"values hmp can write back as TOML ({exc})") from None
    return "\n".join(lines) + "\n\n" + body


def write_run_config(cfg: Config) -> Path:
    """:func:`resolved_text` of ``cfg`` written to ``<report_dir>/config.toml`` (atomically; the folder made):
    the file a launcher's daemons read when ``cfg`` is not its file's (command-line overrides, ``[cluster]``
    counts). Returns its path."""
    path = cfg.report_dir / RUN_CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(resolved_text(cfg))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
