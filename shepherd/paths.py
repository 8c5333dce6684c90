"""Where the shared real traces and profiles live.

A checkout keeps them in `shared/data` beside the repository (CI clones the
repo with shared/ next to it); SHEPHERD_DATA_DIR overrides.
"""
from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """The folder holding azure_llm_2023/, mooncake/, servegen/, vidur/, splitwise_sim/."""
    env = os.environ.get("SHEPHERD_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates += [_REPO.parent / "shared" / "data", _REPO / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(
        "shared trace data not found; looked in " + ", ".join(str(c) for c in candidates)
        + " (set SHEPHERD_DATA_DIR to the folder holding azure_llm_2023/, mooncake/, ...)")


def shared_data(*parts: str) -> Path:
    return shared_data_dir().joinpath(*parts)
