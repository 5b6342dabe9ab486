"""The tiny MoE model the RL loop trains: hybrid_connector's ``qwen3-moe`` tiny model when it has
one, else one built here with the same kind of config (transformers ``Qwen3MoeConfig``: 2 layers,
8 experts, top-2) and hybrid_connector's tokenizer recipe."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

ARCH = "qwen3-moe"
_MARKER = "rl_dataflow_moe.json"
_RECIPE = 1
MOE_SPEC = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
}


def tiny_moe_model(path: str | os.PathLike[str]) -> Path:
    """A deterministic tiny MoE model directory at ``path`` (reused when complete)."""
    from hybrid_connector import tiny_model

    try:
        return tiny_model.make_tiny_model(path, arch=ARCH)
    except ValueError:  # this hybrid_connector has no MoE tiny model
        pass
    target = Path(path).resolve()
    marker = target / _MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("recipe") == _RECIPE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build(tmp, tiny_model)
        marker_tmp = tmp / _MARKER
        marker_tmp.write_text(json.dumps({"recipe": _RECIPE, **MOE_SPEC}))
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build(out_dir: Path, tiny_model: object) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    eos = tiny_model._build_tokenizer(out_dir)  # type: ignore[attr-defined]
    config = Qwen3MoeConfig(
        **MOE_SPEC,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(1234)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": 0, "do_sample": False})
    )
