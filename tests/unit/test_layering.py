"""Every package is in the import contract."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_contracts_cover_every_package():
    """Every subpackage and top-level module of hmp is in the layers contract, so none escapes the check."""
    import tomllib

    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    pkg = ROOT / "hmp"
    present = {f"hmp.{p.stem}" for p in pkg.iterdir()
               if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert present <= named, f"not in any layer: {sorted(present - named)}"
