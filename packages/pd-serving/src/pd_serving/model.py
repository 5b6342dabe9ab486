"""Where the demo's tiny model lives, and how it is made."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$PDSERVE_CACHE`` or ``~/.cache/pd-serving``: generated models and run logs."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pd-serving"))


def default_model_dir() -> Path:
    return cache_dir() / "tiny-qwen2"


def make_model(path: str | os.PathLike[str]) -> Path:
    """The deterministic tiny Qwen2 (random weights, local tokenizer); reused when already there."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from hybrid_connector.tiny_model import make_tiny_model

    return make_tiny_model(path)
