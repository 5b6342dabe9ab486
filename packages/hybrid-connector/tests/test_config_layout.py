"""Configuration parsing and KV-cache geometry discovery."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hybrid_connector.config import HybridConfig, parse_config
from hybrid_connector.errors import ConfigError, PeerError, UnsupportedLayoutError
from hybrid_connector.layout import KvCacheGeometry, KvGroup, describe_kv_cache_groups
from hybrid_connector.mapping import check_compatible


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor], block_size: int, num_blocks: int | None = None
) -> KvCacheGeometry:
    """One attention group holding every layer (a model with one KV-cache group)."""
    group = KvGroup("attention", tuple(kv_caches), block_size)
    cache = describe_kv_cache_groups(kv_caches, [group], num_blocks)
    (geometry,) = cache.groups
    return dataclasses.replace(geometry, buffers=cache.buffers)


def test_config_defaults_and_address() -> None:
    cfg = parse_config({"rpc_port": 7001, "advertise_host": "10.0.0.5"}, is_producer=True)
    assert cfg.lease_s == 30.0
    assert cfg.rpc_address == "10.0.0.5:7001"
    assert parse_config(None, is_producer=False) == HybridConfig()
    assert cfg.kvt_transport == "auto"
    assert cfg.transport is None  # kvt's own default: auto, or KVT_TRANSPORT if set
    assert parse_config({"kvt_transport": "tcp"}, is_producer=False).transport == "tcp"


@pytest.mark.parametrize(
    ("extra", "producer", "match"),
    [
        ({}, True, "fixed rpc_port"),
        ({"rpc_port": 70000}, False, "rpc_port"),
        ({"lease_s": 0}, False, "lease_s"),
        ({"lease_seconds": 3}, False, "lease_seconds"),
        ({"rpc_port": "x"}, False, "rpc_port"),
        ({"kvt_transport": "pigeon"}, False, "kvt_transport"),
    ],
)
def test_config_errors_name_the_key(extra: dict, producer: bool, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(extra, is_producer=producer)


def test_cpu_layers_in_one_buffer_are_one_region() -> None:
    buf = torch.zeros(3, 10, 2, 4, 16, dtype=torch.bfloat16)  # [L, nb, heads, bs, 2*hd]
    geo = describe_kv_caches({f"l{i}": buf[i] for i in range(3)}, block_size=4)
    assert len(geo.buffers) == 1
    assert geo.buffers[0].nbytes == buf.numel() * 2
    layer_bytes = 10 * 2 * 4 * 16 * 2
    assert geo.layer_offsets == (0, layer_bytes, 2 * layer_bytes)
    assert geo.num_blocks == 10
    (segment,) = geo.segments
    assert (segment.offset, segment.block_stride, segment.nbytes) == (0, 256, 256)


def test_layers_in_separate_buffers_are_separate_regions() -> None:
    layers = {f"l{i}": torch.zeros(10, 2, 4, 16, dtype=torch.bfloat16) for i in range(2)}
    geo = describe_kv_caches(layers, block_size=4)
    assert len(geo.buffers) == 2
    assert geo.buffer_index == (0, 1)
    assert geo.layer_offsets == (0, 0)
    spec = geo.spec(region_ids=[7, 9])
    assert spec.region_ids == [7, 9]


def test_kv_first_layout_has_k_and_v_segments() -> None:
    layer = torch.zeros(2, 10, 4, 2, 8, dtype=torch.float16)  # [2, nb, bs, heads, hd]
    geo = describe_kv_caches({"l0": layer}, block_size=4)
    half = 4 * 2 * 8 * 2
    assert [(s.name, s.offset, s.block_stride, s.nbytes) for s in geo.segments] == [
        ("k", 0, half, half),
        ("v", 10 * half, half, half),
    ]


def test_strided_blocks_are_refused() -> None:
    layer = torch.zeros(10, 2, 4, 32)[:, :, :, :16]  # blocks not dense
    with pytest.raises(UnsupportedLayoutError):
        describe_kv_caches({"l0": layer}, block_size=4)


def test_incompatible_peers_are_detected() -> None:
    a = describe_kv_caches({"l0": torch.zeros(10, 2, 4, 16)}, block_size=4).spec([1])
    b = describe_kv_caches({"l0": torch.zeros(12, 2, 4, 16)}, block_size=4).spec([3])
    check_compatible(a, b)  # block counts and region ids may differ
    c = describe_kv_caches({"l0": torch.zeros(10, 4, 4, 16)}, block_size=4).spec([1])
    with pytest.raises(PeerError, match="geometry"):
        check_compatible(a, c)
    d = describe_kv_caches({"l0": torch.zeros(10, 2, 8, 16)}, block_size=8).spec([1])
    with pytest.raises(PeerError, match="block_size"):
        check_compatible(a, d)
    e = describe_kv_caches({"other": torch.zeros(10, 2, 4, 16)}, block_size=4).spec([1])
    with pytest.raises(PeerError, match="layers"):
        check_compatible(a, e)


def _gdn_like(num_blocks: int = 6) -> tuple[dict[str, object], list[KvGroup]]:
    """As vLLM 0.32 allocates Qwen3-Next on CPU: each raw page buffer is shared by a linear
    layer (conv and ssm views, page-strided) and a full-attention layer."""
    page = 1024  # elements (bf16)
    kv: dict[str, object] = {}
    for i in range(2):
        raw = torch.zeros(num_blocks * page, dtype=torch.bfloat16)
        conv = raw.as_strided((num_blocks, 3, 16), (page, 16, 1), 0)
        ssm = raw.as_strided((num_blocks, 2, 8, 8), (page, 64, 8, 1), 48)
        kv[f"layers.{2 * i}.linear_attn"] = [conv, ssm]
        kv[f"layers.{2 * i + 1}.attn"] = raw.view(num_blocks, 1, 16, 64)
    groups = [
        KvGroup("state", ("layers.0.linear_attn", "layers.2.linear_attn"), 16, "bfloat16"),
        KvGroup("attention", ("layers.1.attn", "layers.3.attn"), 16, "bfloat16"),
    ]
    return kv, groups


def test_hybrid_groups_share_buffers_and_state_layers_are_two_segments() -> None:
    kv, groups = _gdn_like()
    geo = describe_kv_cache_groups(kv, groups, num_blocks=6)
    assert len(geo.buffers) == 2, "a state layer and an attention layer share one buffer"
    state, attention = geo.groups
    assert [(s.name, s.offset, s.block_stride, s.nbytes) for s in state.segments] == [
        ("state0", 0, 2048, 96),
        ("state1", 96, 2048, 256),
    ]
    assert [(s.name, s.block_stride, s.nbytes) for s in attention.segments] == [("kv", 2048, 2048)]
    assert state.layer_offsets == attention.layer_offsets == (0, 0)
    assert state.buffer_index == attention.buffer_index == (0, 1)
    spec = geo.spec([7, 8])
    assert [g.family for g in spec.groups] == ["state", "attention"]
    assert spec.groups[0].region_ids == [7, 8]
    assert spec.groups[0].dtype == "bfloat16"
    state_then_attention = ("layers.0.linear_attn", "layers.2.linear_attn", "layers.1.attn")
    assert geo.layer_names == (*state_then_attention, "layers.3.attn")


def test_unsupported_groups_and_state_tensors_are_refused() -> None:
    kv, groups = _gdn_like()
    with pytest.raises(UnsupportedLayoutError, match="chunked_local"):
        describe_kv_cache_groups(kv, [KvGroup("chunked_local", groups[1].layer_names, 16)], 6)
    with pytest.raises(UnsupportedLayoutError, match="no KV cache for layers"):
        describe_kv_cache_groups(kv, [KvGroup("attention", ("nope",), 16)], 6)
    split = {"l0": [torch.zeros(6, 4), torch.zeros(6, 4)]}
    with pytest.raises(UnsupportedLayoutError, match="separate buffers"):
        describe_kv_cache_groups(split, [KvGroup("state", ("l0",), 16)], 6)


def test_the_cpu_attention_isa_reaches_the_wire() -> None:
    kv = {f"l{i}": torch.zeros(6, 2, 32, 64, dtype=torch.bfloat16) for i in range(2)}
    group = KvGroup("attention", tuple(kv), 32, "bfloat16", attn_isa="amx")
    cache = describe_kv_cache_groups(kv, [group], 6)
    assert [g.attn_isa for g in cache.spec([0, 1]).groups] == ["amx"]
