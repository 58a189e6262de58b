"""docs/own_loop.md shows examples/own_loop.py as it is (the cluster tier runs the script)."""

from __future__ import annotations

import re

from tests.support import ROOT


def test_the_docs_show_the_example_script():
    docs = (ROOT / "docs" / "own_loop.md").read_text()
    shown = re.findall(r"```python\n(.*?)```", docs, re.S)[0]
    assert shown.strip() in (ROOT / "examples" / "own_loop.py").read_text()
    assert "docs/own_loop.md" in (ROOT / "README.md").read_text()
