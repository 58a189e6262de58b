"""Imports point one way: the import-linter contracts in pyproject.toml hold for the whole package."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    """`lint-imports` finds no import against the layers, the codec's purity or the socket ban (a new
    circle between packages, or a core importing zmq, fails here)."""
    lint = pathlib.Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", ""), result.stdout
