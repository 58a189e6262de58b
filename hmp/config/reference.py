"""The configuration reference (docs/config.md), generated from the config dataclasses' help texts.

``python -m hmp.config.reference --update`` (``make docs``) rewrites it; ``tests/unit/test_readme.py``
checks that it is current.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hmp.config.schema import SECTIONS, NodeConfig


def reference() -> str:
    """The config reference as Markdown (docs/config.md's tables), generated from the dataclasses."""
    out = []
    for name, cls in [*SECTIONS.items(), ("nodes", NodeConfig)]:
        out.append(f"### `[{name}]`" if name != "nodes" else "### `[[nodes]]` (one table per daemon)")
        out.append("| key | default | meaning |\n|---|---|---|")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            meaning = f.metadata.get("help", "").replace("|", "\\|")  # a bare | would end the table cell
            out.append(f"| `{f.name}` | `{default!r}` | {meaning} |")
        out.append("")
    return "\n".join(out)


def update(path: str | Path = "docs/config.md") -> None:
    """Rewrite the generated configuration reference between ``path``'s config-reference markers."""
    p = Path(path)
    text, n = re.subn(r"(<!-- config-reference:[^\n]*-->\n).*?(<!-- end config-reference -->)",
                      lambda m: m.group(1) + reference().strip() + "\n" + m.group(2), p.read_text(), flags=re.S)
    if n != 1:
        raise SystemExit(f"{p}: expected one config-reference block, found {n}")
    p.write_text(text)


if __name__ == "__main__":  # python -m hmp.config.reference [--update [docs/config.md]]
    import sys

    if sys.argv[1:2] == ["--update"]:
        update(*sys.argv[2:3])
    else:
        print(reference())
