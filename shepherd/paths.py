"""Where the real traces and profiles live.

The ones the README's commands and the cost models read ship inside the package, in
shepherd/data (with their licenses: shepherd/data/README.md), so an installed shepherd or a
bare clone finds them. Larger data stays outside: `shared/data` beside the checkout (as CI
clones it), or $SHEPHERD_DATA_DIR.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "data"
_REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """The folder of the larger data kept outside the repository ($SHEPHERD_DATA_DIR, else
    shared/data beside the checkout)."""
    env = os.environ.get("SHEPHERD_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates += [_REPO.parent / "shared" / "data", _REPO / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(
        "shared trace data not found; looked in " + ", ".join(str(c) for c in candidates)
        + " (set SHEPHERD_DATA_DIR to the folder holding the larger traces and profiles)")


def data_path(*parts: str) -> Path:
    """A trace or profile by its path under the data folder ("vidur", "profiling_compute", ...):
    the packaged copy if shepherd ships it, else the same path under shared_data_dir()."""
    p = PACKAGED.joinpath(*parts)
    if p.exists():
        return p
    try:
        return shared_data_dir().joinpath(*parts)
    except FileNotFoundError:
        return p     # neither: the caller's open() names the packaged path it expected
