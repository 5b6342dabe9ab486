"""make_tiny_model: deterministic per arch, idempotent, loadable by transformers offline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hybrid_connector.tiny_model import (
    TINY_ARCHES,
    TINY_ENGINE_ARGS,
    TINY_MODEL_SPEC,
    TINY_SPECS,
    make_tiny_model,
)


def _digest(path: Path) -> dict[str, str]:
    names = ["model.safetensors", "tokenizer.json"]
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in names}


def test_tiny_model_is_deterministic_and_idempotent(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a")
    second = make_tiny_model(tmp_path / "b")
    assert _digest(first) == _digest(second)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_tiny_tokenizer_round_trips_and_has_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) <= int(TINY_MODEL_SPEC["vocab_size"])
    text = "Hello, world! Prefill and decode: ünïcödé too."
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


# sha256 of the qwen2 model.safetensors: the multi-arch recipe must keep qwen2's bytes (and its
# recipe version), so directories cached before it stay valid and tokens stay comparable.
QWEN2_SAFETENSORS_SHA256 = "071c679281ab5f5de7ffdf465032813e8c0c8f8e7c90b51309a45632f585cea9"


def test_qwen2_bytes_unchanged_by_the_multi_arch_recipe(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "q")
    assert _digest(path)["model.safetensors"] == QWEN2_SAFETENSORS_SHA256
    marker = json.loads((path / "tiny_model_complete.json").read_text())
    assert marker["recipe_version"] == 2
    assert "arch" not in marker


@pytest.mark.parametrize(
    ("arch", "model_type", "architecture"),
    [
        ("mla", "deepseek_v2", "DeepseekV2ForCausalLM"),
        ("gdn", "qwen3_next", "Qwen3NextForCausalLM"),
        ("qwen3-moe", "qwen3_moe", "Qwen3MoeForCausalLM"),
    ],
)
def test_each_arch_is_deterministic(
    tmp_path: Path, arch: str, model_type: str, architecture: str
) -> None:
    first = make_tiny_model(tmp_path / "a", arch)
    second = make_tiny_model(tmp_path / "b", arch)
    assert _digest(first) == _digest(second)
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["architectures"] == [architecture]
    assert make_tiny_model(tmp_path / "a", arch) == first  # reused


def test_a_directory_of_another_arch_is_rebuilt(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m")
    make_tiny_model(path, "mla")
    assert json.loads((path / "config.json").read_text())["model_type"] == "deepseek_v2"
    make_tiny_model(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model arch 'mamba'"):
        make_tiny_model(tmp_path / "m", "mamba")
    assert not (tmp_path / "m").exists()


def test_every_arch_has_engine_args_and_a_spec() -> None:
    assert set(TINY_ENGINE_ARGS) == set(TINY_ARCHES) == set(TINY_SPECS)
    assert TINY_ARCHES[0] == "qwen2"
    assert TINY_SPECS["qwen2"] is TINY_MODEL_SPEC
