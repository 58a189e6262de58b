"""Imports point one way: pure layers never import sockets or nodes."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hmp"
PURE = ["transport/codec.py", "messages.py", "errors.py", "sched", "kernels", "ps", "data.py", "models.py", "train"]
FORBIDDEN = ("zmq", "hmp.nodes", "hmp.transport.endpoint", "hmp.launch", "hmp.cluster")


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_pure_modules_import_no_sockets_or_nodes():
    """The codec, messages, scheduler policies, kernels and PS cores import neither zmq nor the node shells."""
    offenders = []
    for entry in PURE:
        p = ROOT / entry
        files = [p] if p.is_file() else sorted(p.rglob("*.py"))
        for f in files:
            for mod in _imports(f):
                if mod.startswith(FORBIDDEN):
                    offenders.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not offenders, offenders
