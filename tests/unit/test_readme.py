"""The README and the config reference agree with the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_current():
    """docs/config.md's configuration reference is exactly what ``hmp.config.reference`` generates from the code."""
    from hmp.config.reference import reference

    text = (ROOT / "docs" / "config.md").read_text()
    section = re.search(r"<!-- config-reference:[^\n]*-->\n(.*?)<!-- end config-reference -->", text, re.S)
    assert section, "docs/config.md lost its config-reference markers"
    assert section.group(1).strip() == reference().strip(), "regenerate it: make docs"
