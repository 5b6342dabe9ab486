"""Shared fixtures of the cross-package tests: the tiny model, generated once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pd-serving's test helpers (stand_ins: waiting for processes and metrics) serve these tests too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "pd-serving" / "tests"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny Qwen2 (random weights, local tokenizer), made once for all tests."""
    from hybrid_connector.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
