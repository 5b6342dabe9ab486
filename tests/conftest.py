"""Shared fixtures of the cross-package tests: the tiny model, generated once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny Qwen2 (random weights, local tokenizer), made once for all tests."""
    from hybrid_connector.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
