"""Write a benchmark's table into a docs page between `<!-- MARK -->` and `<!-- /MARK -->`."""
from __future__ import annotations

import os
import re
import time
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


def footer(command: str, where: str = "") -> str:
    """The line under a benchmark's table: when (UTC), `where` (e.g. " on CPU", ", 2 threads"),
    how many CPUs, and the command that made it."""
    return f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{where}, {os.cpu_count()} CPUs: `{command}`."


def publish(text: str, page: str, mark: str, write: bool) -> None:
    """Print a benchmark's table and, with its --docs, write it into docs/`page`'s block `mark`."""
    print(text)
    if write:
        print(f"written to {write_block(page, mark, text)}")
