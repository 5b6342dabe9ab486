"""Configuration parsing and KV-cache geometry discovery."""

from __future__ import annotations

import pytest
import torch
from hybrid_connector.config import HybridConfig, parse_config
from hybrid_connector.errors import ConfigError, PeerError, UnsupportedLayoutError
from hybrid_connector.layout import describe_kv_caches
from hybrid_connector.mapping import check_compatible


def test_config_defaults_and_address() -> None:
    cfg = parse_config({"rpc_port": 7001, "advertise_host": "10.0.0.5"}, is_producer=True)
    assert cfg.lease_s == 30.0
    assert cfg.rpc_address == "10.0.0.5:7001"
    assert parse_config(None, is_producer=False) == HybridConfig()


@pytest.mark.parametrize(
    ("extra", "producer", "match"),
    [
        ({}, True, "fixed rpc_port"),
        ({"rpc_port": 70000}, False, "rpc_port"),
        ({"lease_s": 0}, False, "lease_s"),
        ({"lease_seconds": 3}, False, "lease_seconds"),
        ({"rpc_port": "x"}, False, "rpc_port"),
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
