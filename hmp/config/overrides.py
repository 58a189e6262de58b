"""Config values from the command line: ``hmp-launch JOB.toml train.lr=0.1 cluster.cpu_workers=8``.

An override is ``SECTION.KEY=VALUE`` (deeper for tables: ``model.args.hidden=[64,32]``; a node's key by its
id: ``nodes.gpu0.device=cuda``); the value is TOML
(``0.1``, ``true``, ``[64, 32]``, ``{ a = 1 }``, ``"text"``), and text without quotes is taken as a string
where it is not TOML or where the key is a string key (``train.consistency=sync``, ``job.name=2024``).
:func:`apply` sets the values into the file's tables, which then go through the same checks as the file's
own values; :func:`blame` makes an error an override caused name it and say it came from the command line.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tomllib
import typing
from collections.abc import Sequence
from typing import Any

from hmp.config.schema import SECTIONS
from hmp.errors import ConfigError

#: where an error in an override's own syntax says it came from
COMMAND_LINE = "the command line"
_KEY_PART = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclasses.dataclass(frozen=True)
class Override:
    """One ``KEY=VALUE`` of the command line: ``key`` split at its dots, ``value`` parsed, ``text`` as given."""

    key: tuple[str, ...]
    value: Any
    text: str

    @property
    def dotted(self) -> str:
        return ".".join(self.key)


def parse(text: str) -> Override:
    """``KEY=VALUE`` as an :class:`Override`; a ConfigError naming the argument when it is not one."""
    name, sep, value_text = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(COMMAND_LINE, name or text, f"KEY=VALUE (e.g. train.lr=0.1), got {text!r}")
    key = tuple(name.split("."))
    if len(key) < 2 or not all(_KEY_PART.match(part) for part in key):
        raise ConfigError(COMMAND_LINE, name, f"SECTION.KEY=VALUE with keys of letters, digits, _ and - (e.g. "
                                              f"train.lr=0.1, model.args.hidden=[64,32]), got {text!r}")
    if not value_text.strip():
        raise ConfigError(COMMAND_LINE, name, f"a value after '=' (TOML: 0.1, true, [64, 32], \"text\"), got {text!r}")
    return Override(key, _value(key, value_text.strip()), text)


def _value(key: tuple[str, ...], text: str) -> Any:
    """The value of ``text``: TOML; a string key's number, boolean or date is its text; text that is not TOML and
    does not start like a TOML string, array or table is a string."""
    field_type = _field_type(key)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        if text[0] in "\"'[{":
            raise ConfigError(COMMAND_LINE, ".".join(key), f"a TOML value ({exc}), got {text!r}") from None
        return text
    if field_type is str and not isinstance(value, str):
        return text
    return value


def _field_type(key: tuple[str, ...]) -> Any:
    """The type of the dataclass field ``key`` names (``SECTION.KEY``), or None (unknown, or inside a table)."""
    cls = SECTIONS.get(key[0])
    if cls is None or len(key) != 2:
        return None
    return typing.get_type_hints(cls).get(key[1])


def apply(raw: dict[str, Any], overrides: Sequence[Override], path: str) -> dict[str, Any]:
    """A copy of the TOML tables ``raw`` with each override's value set (later ones win); tables on the way are
    made. ``nodes.ID.KEY`` sets a key of the ``[[nodes]]`` table with that id. The caller blames the errors
    (:func:`blame`)."""
    out = copy.deepcopy(raw)
    for o in overrides:
        if o.key[0] == "nodes":
            table, rest = _node_table(out, o, path), o.key[2:]
        elif o.key[0] in SECTIONS:
            table, rest = out, o.key
        else:
            allowed = sorted([*SECTIONS, "nodes"])
            raise ConfigError(path, o.key[0], f"unknown section; expected one of {allowed}")
        done = len(o.key) - len(rest)
        for depth, part in enumerate(rest[:-1]):
            inner = table.setdefault(part, {})
            if not isinstance(inner, dict):
                where = ".".join(o.key[:done + depth + 1])
                raise ConfigError(path, where, f"a table to set {rest[depth + 1]!r} in, but it is "
                                               f"{type(inner).__name__} {inner!r}")
            table = inner
        table[rest[-1]] = o.value
    return out


def _node_table(raw: dict[str, Any], o: Override, path: str) -> dict[str, Any]:
    """The ``[[nodes]]`` table ``nodes.ID.KEY`` names (``raw`` is the caller's copy)."""
    nodes = raw.get("nodes")
    if len(o.key) < 3:
        raise ConfigError(path, o.dotted, f"nodes.ID.KEY=VALUE (e.g. nodes.gpu0.device=cuda), got {o.text!r}")
    if not isinstance(nodes, list):
        raise ConfigError(path, o.dotted, "a node of the config's [[nodes]] tables; this config has none (with "
                                          "[cluster] counts, set cluster keys: cluster.cpu_batch_size=16, ...)")
    for table in nodes:
        if isinstance(table, dict) and table.get("id") == o.key[1]:
            return table
    ids = [t.get("id") for t in nodes if isinstance(t, dict)]
    raise ConfigError(path, o.dotted, f"the id of a node of [[nodes]], one of {ids}; got {o.key[1]!r}")


def _related(key: str, o: Override) -> bool:
    """Whether the error at ``key`` is about the override's key (the key itself, inside it, or a table holding it;
    ``nodes[i].KEY`` for ``nodes.ID.KEY``, whichever node i is)."""
    d = o.dotted
    if o.key[0] == "nodes" and key.startswith("nodes[") and len(o.key) > 2:
        return key.partition("].")[2].split(".")[0] == o.key[2]
    return key == d or key.startswith((d + ".", d + "[")) or d.startswith(key + ".")


def blame(exc: ConfigError, overrides: Sequence[Override]) -> ConfigError:
    """``exc`` raised with ``overrides`` applied, its file named as coming with them: the overrides whose key the
    error is about when there are such (``conf/x.toml with train.lr=-1 from the command line: key 'train.lr':
    ...``), else all of them (a check across keys may blame another key)."""
    if not overrides or exc.path.startswith(COMMAND_LINE):
        return exc
    last = {o.dotted: o for o in overrides}  # of a key given twice, the value in effect
    named = [o for o in overrides if last[o.dotted] is o and _related(exc.key, o)] or list(overrides)
    return ConfigError(f"{exc.path} with {' '.join(o.text for o in named)} from the command line", exc.key,
                       exc.expected)
