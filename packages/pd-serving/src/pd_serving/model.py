"""Where the demo's tiny models live, how they are made, and what vLLM needs to run each."""

from __future__ import annotations

import os
from pathlib import Path

# hybrid_connector.tiny_model imports nothing heavy at module level (torch and transformers only
# inside make_tiny_model), so the command line can list the archs without the vllm extra.
from hybrid_connector.tiny_model import TINY_ARCHES, TINY_ENGINE_ARGS

DEFAULT_ARCH = "qwen2"

__all__ = [
    "DEFAULT_ARCH",
    "TINY_ARCHES",
    "cache_dir",
    "default_model_dir",
    "engine_cli_args",
    "make_model",
]


def cache_dir() -> Path:
    """``$PDSERVE_CACHE`` or ``~/.cache/pd-serving``: generated models and run logs."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pd-serving"))


def default_model_dir(arch: str = DEFAULT_ARCH) -> Path:
    return cache_dir() / f"tiny-{arch}"


def make_model(path: str | os.PathLike[str], arch: str = DEFAULT_ARCH) -> Path:
    """The deterministic tiny model of `arch` (random weights, local tokenizer); reused if there."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from hybrid_connector.tiny_model import make_tiny_model

    return make_tiny_model(path, arch)


def engine_cli_args(arch: str) -> list[str]:
    """`TINY_ENGINE_ARGS[arch]` (vllm.LLM keyword names) as `vllm serve` options."""
    args: list[str] = []
    for key, value in TINY_ENGINE_ARGS[arch].items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args
