"""Write a benchmark's table into a docs page between `<!-- MARK -->` and `<!-- /MARK -->`."""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def write_block(page: str, mark: str, text: str) -> Path:
    """Replace the block marked `mark` in docs/`page` with `text` (appended at the end when
    the page has no such block yet); returns the page's path."""
    path = DOCS / page
    doc = path.read_text()
    block = f"<!-- {mark} -->\n{text.rstrip()}\n<!-- /{mark} -->"
    pat = re.compile(rf"<!-- {re.escape(mark)} -->.*?<!-- /{re.escape(mark)} -->", re.S)
    doc = pat.sub(lambda _: block, doc) if pat.search(doc) else doc.rstrip() + "\n\n" + block + "\n"
    path.write_text(doc)
    return path
