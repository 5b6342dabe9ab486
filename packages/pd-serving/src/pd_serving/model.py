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


# The equal-hardware benchmark's model: the tiny model's tokenizer under a Qwen2 large enough
# that, on this CPU, a prompt of a few thousand tokens takes a second to prefill while a decode
# step takes tens of milliseconds (the tiny model prefills 4k tokens in tens of ms, so a long
# prompt would barely disturb decoding and PD would have nothing to fix). About 75M parameters,
# random weights (seeded), bfloat16; KV 12 KiB per token.
BENCH_MODEL_SPEC: dict[str, int] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "max_position_embeddings": 8192,
}
_BENCH_MARKER = "bench_model_complete.json"
_BENCH_RECIPE = 1
_BENCH_SEED = 4321


def default_bench_model_dir() -> Path:
    return cache_dir() / "bench-qwen2"


def make_bench_model(path: str | os.PathLike[str] | None = None) -> Path:
    """The benchmark model (``BENCH_MODEL_SPEC``) at ``path``; reused if complete."""
    import json
    import shutil
    import tempfile

    target = Path(path or default_bench_model_dir()).resolve()
    marker = target / _BENCH_MARKER
    want = {"recipe": _BENCH_RECIPE, "seed": _BENCH_SEED, **BENCH_MODEL_SPEC}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return target
    tiny = make_model(default_model_dir("qwen2"), "qwen2")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build_bench_model(tiny, tmp)
        (tmp / _BENCH_MARKER).write_text(json.dumps(want))
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_bench_model(tiny: Path, out: Path) -> None:
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)
    tiny_config = json.loads((tiny / "config.json").read_text())
    config = Qwen2Config(
        vocab_size=tiny_config["vocab_size"],
        **BENCH_MODEL_SPEC,
        # As the tiny model: a wide init spread makes greedy tokens depend on the prompt, so a
        # wrong KV cache shows as different tokens.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tiny_config["bos_token_id"],
        eos_token_id=tiny_config["eos_token_id"],
        pad_token_id=tiny_config["pad_token_id"],
        use_sliding_window=False,
    )
    torch.manual_seed(_BENCH_SEED)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
