"""mapping.plan_copy / check_compatible: which of P's bytes land in which of D's.

Caches are numpy arrays shaped like vLLM's CPU tensors; the records a plan returns are applied
byte by byte and the result compared with a reference built by indexing the tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_connector.errors import PeerError
from hybrid_connector.mapping import check_compatible, plan_copy
from hybrid_connector.protocol import LayoutSpec, SegmentSpec


def cpu_spec(
    num_blocks: int,
    heads: int,
    block_size: int,
    row: int,
    layers: int = 2,
    *,
    group: str = "attention",
    head_start: int = 0,
    total_heads: int | None = None,
) -> LayoutSpec:
    """A LayoutSpec for ``layers`` CPU layers ``[num_blocks, heads, block_size, row]`` (uint8)
    stacked in one region, as layout.describe_kv_caches reports them."""
    block = heads * block_size * row
    return LayoutSpec(
        layer_names=[f"model.layers.{i}.attn" for i in range(layers)],
        layer_offsets=[i * num_blocks * block for i in range(layers)],
        region_ids=[0] * layers,
        num_blocks=num_blocks,
        block_size=block_size,
        segments=[SegmentSpec("kv", 0, block, block)],
        kind="blocks_major",
        group=group,
        total_heads=heads if total_heads is None else total_heads,
        head_start=head_start,
        num_heads=heads,
    )


def region_of(spec: LayoutSpec, rng: np.random.Generator) -> np.ndarray:
    block = spec.segments[0].nbytes
    return rng.integers(0, 256, len(spec.layer_names) * spec.num_blocks * block, dtype=np.uint8)


def apply(blocks: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy per IpcBlock records (one region per side), refusing overlapping writes."""
    touched = np.zeros(dst.size, dtype=bool)
    for rec in blocks:
        s, d, n = int(rec["src_offset"]), int(rec["dst_offset"]), int(rec["length"])
        assert not touched[d : d + n].any(), "two records write the same destination byte"
        dst[d : d + n] = src[s : s + n]
        touched[d : d + n] = True


def test_same_block_size_copies_the_blocks_after_the_prefix_hit() -> None:
    rng = np.random.default_rng(0)
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(12, 2, 4, 8)
    p_mem, d_mem = region_of(p, rng), region_of(d, rng)
    before = d_mem.copy()
    p_ids = [7, 2, 9, 4]  # 14 tokens: 4 blocks of 4
    d_new = [11, 0]  # D holds blocks 0..1 (8 tokens) already
    blocks = plan_copy(p, d, p_ids, d_new, first_block=2, num_tokens=14)
    apply(blocks, p_mem, d_mem)
    p_view = p_mem.reshape(2, 10, -1)
    d_view = d_mem.reshape(2, 12, -1)
    expected = before.reshape(2, 12, -1).copy()
    expected[:, [11, 0]] = p_view[:, [9, 4]]
    np.testing.assert_array_equal(d_view, expected)
    assert set(blocks["tag"].tolist()) == {0, 1}


def test_positional_form_copies_block_for_block() -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(12, 2, 4, 8)
    blocks = plan_copy(p, d, [3, 4, 5], [0, 1, 2])
    assert blocks.size == 2  # contiguous on both sides: one record per layer
    assert int(blocks["length"].sum()) == 2 * 3 * 2 * 4 * 8


@pytest.mark.parametrize(
    ("p_ids", "d_ids", "first_block", "num_tokens", "match"),
    [
        ([1, 2, 3], [], 0, 12, "no destination block"),
        ([1, 2, 3], [4, 5], 0, 12, r"2 blocks after 0 cached ones for 12 tokens \(3 blocks"),
        ([1, 2, 3], [4, 5, 6], 1, 12, "after 1 cached"),
        ([1, 2], [4, 5, 6], 0, 12, "P holds 2 blocks"),
        ([1, 2, 3], [4], -1, 0, "negative"),
    ],
)
def test_counts_that_do_not_fit_are_refused(
    p_ids: list[int], d_ids: list[int], first_block: int, num_tokens: int, match: str
) -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(12, 2, 4, 8)
    with pytest.raises(PeerError, match=match):
        plan_copy(p, d, p_ids, d_ids, first_block=first_block, num_tokens=num_tokens)


def test_block_id_out_of_range_is_a_peer_error() -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(4, 2, 4, 8)
    with pytest.raises(PeerError, match="out of range"):
        plan_copy(p, d, [1, 2], [3, 4], num_tokens=8)


def state_spec(num_slots: int, slot_bytes: int) -> LayoutSpec:
    return LayoutSpec(
        layer_names=["model.layers.0.linear_attn"],
        layer_offsets=[0],
        region_ids=[0],
        num_blocks=num_slots,
        block_size=256,
        segments=[SegmentSpec("state", 0, slot_bytes, slot_bytes)],
        kind="blocks_major",
        group="state",
    )


def test_state_slots_are_copied_one_to_one_without_token_arithmetic() -> None:
    rng = np.random.default_rng(1)
    p, d = state_spec(6, 40), state_spec(4, 40)
    p_mem = rng.integers(0, 256, 6 * 40, dtype=np.uint8)
    d_mem = np.zeros(4 * 40, dtype=np.uint8)
    # num_tokens / first_block mean nothing to a state slot.
    blocks = plan_copy(p, d, [5], [2], first_block=3, num_tokens=1000)
    apply(blocks, p_mem, d_mem)
    np.testing.assert_array_equal(d_mem.reshape(4, 40)[2], p_mem.reshape(6, 40)[5])
    assert not d_mem.reshape(4, 40)[[0, 1, 3]].any()
    with pytest.raises(PeerError, match="state slots"):
        plan_copy(p, d, [5, 1], [2], num_tokens=1000)


def test_group_kinds_must_match() -> None:
    with pytest.raises(PeerError, match="group kind"):
        check_compatible(cpu_spec(4, 2, 4, 8), cpu_spec(4, 2, 4, 8, group="mla"))
