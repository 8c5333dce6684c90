"""Every repository path that README.md and docs/*.md name exists, so that a reader who follows
one lands on a file (the docs named moved folders and a DESIGN.md outside the repository).

What counts as a path (and nothing else, so that a failure is always a stale name):
- a token starting with a top-level folder of the repository: `shepherd/...`, `benchmarks/...`,
  `docs/...`, `tests/...` (not preceded by another path part, so a URL's `.../docs/x` is not one);
- a token in backticks starting with a subpackage of shepherd (`scheduler/policy.py`,
  `routing/`): resolved under shepherd/, as the docs write them;
- a relative Markdown link target (`[x](SCHEDULING.md)`), resolved from the document's folder.
A trailing `:line`, `:a-b` or `::test_name` is dropped; tokens with a wildcard or a placeholder
(`*`, `{`, `<`, `...`, `N`) are patterns, not paths, and are skipped.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("shepherd", "benchmarks", "docs", "tests")
SUBPACKAGES = tuple(sorted(p.name for p in (ROOT / "shepherd").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))))

_CHARS = r"[\w./*{}<>-]"
TOP_RE = re.compile(rf"(?<![\w./-])(?:{'|'.join(TOP)})/{_CHARS}*")
SUB_RE = re.compile(rf"`((?:{'|'.join(SUBPACKAGES)})/{_CHARS}*)(?::[\w-]+)*`")
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _clean(token: str) -> str | None:
    if any(c in token for c in "*{}<>") or "..." in token:
        return None
    return re.sub(r"(::\w+|:\d+(-\d+)?)$", "", token).rstrip(".,:;")


def paths_named(doc: Path) -> set[tuple[str, Path]]:
    """(as written, resolved) for every repository path `doc` names."""
    text = doc.read_text()
    found = set()
    for m in TOP_RE.finditer(text):
        t = _clean(m.group(0))
        if t:
            found.add((t, ROOT / t))
    for m in SUB_RE.finditer(text):
        t = _clean(m.group(1))
        if t:
            found.add((t, ROOT / "shepherd" / t))
    for m in LINK_RE.finditer(text):
        t = m.group(1)
        if "://" in t or t.startswith("mailto:"):
            continue
        found.add((t, (doc.parent / t).resolve()))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_path_a_doc_names_exists(doc):
    missing = sorted(t for t, p in paths_named(doc) if not p.exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_path_finder_finds_paths_and_only_paths(tmp_path):
    """The rules above, on a sample: what must be caught, and what must not."""
    doc = tmp_path / "x.md"
    doc.write_text("see `shepherd/nowhere.py:12`, tests/test_gone.py::test_a and `scheduler/gone.py`;\n"
                   "[a link](GONE.md), [web](https://github.com/x/docs/a.md), `vllm/docs/y.md`,\n"
                   "`shepherd/data/*/SOURCE.md`, benchmarks/<name>.py, shepherd/...\n")
    named = {t for t, _ in paths_named(doc)}
    assert named == {"shepherd/nowhere.py", "tests/test_gone.py", "scheduler/gone.py", "GONE.md"}
