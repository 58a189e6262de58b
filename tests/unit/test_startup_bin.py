"""bin/ holds one wrapper per console script of pyproject.toml, calling the same entry point."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_console_script_has_its_bin_wrapper_with_the_same_entry_point():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    wrappers = {p.name for p in (ROOT / "bin").iterdir() if p.name.startswith("hmp-")}
    assert wrappers == set(scripts)
    for name, entry in scripts.items():
        text = (ROOT / "bin" / name).read_text()
        assert text.startswith("#!/bin/sh\n"), name
        assert re.search(rf'/_entry" {re.escape(entry)} {re.escape(name)} "\$@"$', text, re.M), name
        assert (ROOT / "bin" / name).stat().st_mode & 0o111, f"bin/{name} is not executable"
