"""make_tiny_model: deterministic, idempotent, loadable by transformers' tokenizer offline."""

from __future__ import annotations

import hashlib
from pathlib import Path

from hybrid_connector.tiny_model import TINY_MODEL_SPEC, make_tiny_model


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
