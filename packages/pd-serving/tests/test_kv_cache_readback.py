"""kv_cache_readback on canned /metrics and /v1/models pages (no vLLM): the KV size asked for
passes, VLLM_CPU_KVCACHE_SPACE's 1 GiB in its place fails, as do blocks that do not add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_cache_readback import (
    assert_served_kv_cache_bytes,
    cache_config_labels,
    full_attention_bytes_per_block,
)

METRICS_URL = "http://127.0.0.1:9/metrics"
# The tiny Qwen2: 2 layers, 2 KV heads of 32, bf16; vLLM's CPU block of 128 tokens.
CONFIG = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_size": 128,
    "dtype": "bfloat16",
    "layer_types": ["full_attention", "full_attention"],
}
BYTES_PER_BLOCK = 2 * 2 * 2 * 32 * 128 * 2  # layers x (K, V) x heads x head_dim x tokens x bf16


def _metrics(budget: int, blocks: int) -> str:
    labels = (
        f'block_size="128",cache_dtype="auto",engine="0",kv_cache_memory_bytes="{budget}",'
        f'num_gpu_blocks="{blocks}",enable_prefix_caching="True"'
    )
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    )


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import kv_cache_readback

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    models = json.dumps({"data": [{"id": "m", "root": str(tmp_path)}]}).encode()

    def serve_metrics(budget: int, blocks: int) -> None:
        pages = {
            METRICS_URL: _metrics(budget, blocks).encode(),
            "http://127.0.0.1:9/v1/models": models,
        }
        monkeypatch.setattr(kv_cache_readback, "_get", pages.__getitem__)

    return serve_metrics


def test_labels_and_block_bytes() -> None:
    labels = cache_config_labels(_metrics(1 << 20, 7))
    assert labels["kv_cache_memory_bytes"] == str(1 << 20)
    assert labels["num_gpu_blocks"] == "7"
    assert full_attention_bytes_per_block(CONFIG, 128, "auto") == BYTES_PER_BLOCK
    with pytest.raises(ValueError, match="bytes_per_block"):
        full_attention_bytes_per_block({**CONFIG, "kv_lora_rank": 512}, 16, "auto")


def test_the_size_asked_for_passes_rounded_down_to_whole_blocks(serve) -> None:
    asked = 24 << 20
    serve(asked, asked // BYTES_PER_BLOCK)
    got = assert_served_kv_cache_bytes(METRICS_URL, asked)
    assert got.served_bytes == (asked // BYTES_PER_BLOCK) * BYTES_PER_BLOCK


def test_an_env_that_overrode_the_size_fails(serve) -> None:
    serve(1 << 30, (1 << 30) // BYTES_PER_BLOCK)  # VLLM_CPU_KVCACHE_SPACE=1 won
    with pytest.raises(AssertionError, match="KV budget 1073741824 bytes, asked for 25165824"):
        assert_served_kv_cache_bytes(METRICS_URL, 24 << 20)


def test_blocks_that_do_not_add_up_fail(serve) -> None:
    asked = 24 << 20
    serve(asked, asked // BYTES_PER_BLOCK - 1)  # a whole block short
    with pytest.raises(AssertionError, match="rounded down to whole blocks"):
        assert_served_kv_cache_bytes(METRICS_URL, asked)
