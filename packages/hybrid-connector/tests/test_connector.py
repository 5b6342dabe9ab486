"""The vLLM-facing class (imports vLLM): metadata and results cross the boundary intact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hybrid_connector.metadata import HybridConnectorMetadata, TransferResults

base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")


class _Worker:
    def drain(self) -> TransferResults:
        return TransferResults({"d-ok", "d-bad"}, {"d-bad"})


def test_failed_receives_reach_vllm() -> None:
    from hybrid_connector.connector import HybridConnector

    connector = object.__new__(HybridConnector)  # the worker role without a vLLM engine
    connector._worker = _Worker()  # type: ignore[assignment]
    results = connector.get_transfer_results(set())
    assert results.finished_sending == set(), "P's blocks go back by SEND_DONE, never here"
    assert results.finished_recving == {"d-ok", "d-bad"}
    assert results.failed_recving == {"d-bad"}
    # No override of the older get_finished hook, which has no place for failed receives.
    assert HybridConnector.get_finished is base.KVConnectorBase_V1.get_finished


def test_plain_metadata_is_vllm_metadata() -> None:
    import hybrid_connector.connector  # noqa: F401  (registers the class with vLLM's ABC)

    assert isinstance(HybridConnectorMetadata(), base.KVConnectorMetadata)


def test_vllm_groups_become_kv_groups() -> None:
    """Each vLLM KV-cache spec maps to a group family, its block size, dtype and this rank's heads;
    a kind the connector cannot move is refused at startup."""
    import torch
    from hybrid_connector.connector import kv_groups
    from hybrid_connector.errors import UnsupportedLayoutError
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    bf16 = torch.bfloat16
    specs = [
        MambaSpec(block_size=256, shapes=((3, 8), (2, 4, 4)), dtypes=(bf16, bf16)),
        FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=32, dtype=bf16),
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=bf16),
        SlidingWindowSpec(
            block_size=32, num_kv_heads=2, head_size=32, dtype=bf16, sliding_window=128
        ),
    ]
    config = SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    )
    groups = kv_groups(config, 16, total_kv_heads=4, tp_size=2, tp_rank=1)  # type: ignore[arg-type]
    assert groups is not None
    assert [(g.family, g.block_size, g.dtype) for g in groups] == [
        ("state", 256, "bfloat16,bfloat16"),
        ("attention", 256, "bfloat16"),
        ("mla", 16, "bfloat16"),
        ("sliding_window", 32, "bfloat16"),
    ]
    assert [(g.total_heads, g.head_start, g.num_heads) for g in groups] == [
        (0, 0, 0),
        (4, 2, 2),
        (0, 0, 0),
        (4, 2, 2),
    ]
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=bf16, attention_chunk_size=64
    )
    with pytest.raises(UnsupportedLayoutError, match="ChunkedLocalAttentionSpec"):
        kv_groups(SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["c"], chunked)]), 16)  # type: ignore[arg-type]


def test_attention_groups_carry_the_cpu_kernel_that_stores_them() -> None:
    """The ISA is asked as vLLM's CPU backend asks it: AMX only for bf16 at multiples of 32 on a
    CPU with AMX tiles; it travels to the peer in the group's LayoutSpec."""
    import torch
    from hybrid_connector.connector import cpu_attn_isa, kv_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec

    def isa_of(dtype: torch.dtype, block_size: int) -> str:
        config = SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype),
            cache_config=SimpleNamespace(cache_dtype="auto"),
        )
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=dtype)
        return cpu_attn_isa(config)(spec)  # type: ignore[arg-type]

    amx = torch.cpu._is_amx_tile_supported()
    assert isa_of(torch.bfloat16, 64) == ("amx" if amx else "vec")
    assert isa_of(torch.float32, 64) == "vec"

    specs = [
        FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16),
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
    ]
    config = SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    )
    groups = kv_groups(config, 32, attn_isa=lambda spec: f"isa{spec.block_size}")  # type: ignore[arg-type]
    assert groups is not None
    assert [g.attn_isa for g in groups] == ["isa32", ""]


def _vllm_config(block_size: int = 16, mamba_cache_mode: str = "none") -> SimpleNamespace:
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            block_size=block_size, cache_dtype="auto", mamba_cache_mode=mamba_cache_mode
        ),
        model_config=SimpleNamespace(model="/models/m", revision=None, dtype="bfloat16"),
    )


def test_kvs_takes_a_hybrid_model_only_with_its_states_kept_at_block_boundaries() -> None:
    from hybrid_connector.config import ConfigError, parse_config
    from hybrid_connector.connector import _kv_events, _kvs_scheduler
    from hybrid_connector.layout import KvGroup
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    config = parse_config({"kvs": {"store": "s", "load": False}}, is_producer=False)
    state = [KvGroup("attention", ("a",), 16), KvGroup("state", ("s",), 16)]
    # Prefix caching off (mamba_cache_mode "none"): no state at a block boundary to store.
    with pytest.raises(ConfigError, match=r"state KV-cache group.*enable_prefix_caching"):
        _kvs_scheduler(_vllm_config(), config, state, 1)  # type: ignore[arg-type]
    hybrid = _kvs_scheduler(_vllm_config(mamba_cache_mode="align"), config, state, 1)  # type: ignore[arg-type]
    assert hybrid is not None
    hybrid.close()
    kvs = _kvs_scheduler(_vllm_config(), config, [KvGroup("attention", ("a",), 16)], 1)  # type: ignore[arg-type]
    assert kvs is not None
    kvs.close()
    stored, removed = _kv_events(
        [("stored", [b"c" * 16], None, list(range(16)), 16), ("removed", [b"c" * 16])]
    )
    assert isinstance(stored, BlockStored)
    assert stored.medium == "KVS"
    assert stored.token_ids == list(range(16))
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [b"c" * 16]
