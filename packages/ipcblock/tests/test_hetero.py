"""Heterogeneous P and D: TP head slicing and different block sizes, against shaped numpy tensors.

The reference reads both caches through numpy views shaped like vLLM's tensors (not through the
layouts' offsets): every destination token of every copied head must equal the source's, and no
byte outside the destination blocks (or, for TP, outside the copied heads) may change.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import (
    BlockSizeRatioError,
    HeadRangeError,
    LayoutMismatchError,
    NotTokenMajorError,
    PagedKVLayout,
    TokenRangeError,
    parse_blocks,
    parse_blocks_resized,
    stacked_layer_offsets,
)

KINDS = ("cpu", "kv_first", "blocks_first")


def canonical(kind: str, layer: np.ndarray, nb: int, heads: int, bs: int, row: int) -> np.ndarray:  # noqa: PLR0917
    """A byte view of one layer indexed [block, k|v, head, token, byte] (no copy)."""
    if kind == "cpu":  # [nb, H, bs, 2*hd]: K and V halves of each token row
        return layer.reshape(nb, heads, bs, 2, row).transpose(0, 3, 1, 2, 4)
    if kind == "kv_first":  # [2, nb, bs, H, hd]
        return layer.reshape(2, nb, bs, heads, row).transpose(1, 0, 3, 2, 4)
    return layer.reshape(nb, 2, bs, heads, row).transpose(0, 1, 3, 2, 4)  # [nb, 2, bs, H, hd]


class Side:
    """One rank's cache: a flat region holding ``layers`` stacked layers, and its layout."""

    def __init__(self, kind, nb, heads, head_start, total, bs, hd, itemsize, layers, rng):  # noqa: PLR0917
        self.kind, self.nb, self.heads, self.bs, self.row = kind, nb, heads, bs, hd * itemsize
        self.head_start = head_start
        layer_bytes = nb * 2 * heads * bs * self.row
        self.region = rng.integers(0, 256, layer_bytes * layers + 3, dtype=np.uint8)
        offsets = stacked_layer_offsets(layers, layer_bytes, base=3)
        ctor = getattr(PagedKVLayout, kind)
        self.layout = ctor(
            offsets, nb, heads, bs, hd, itemsize, head_start=head_start, total_heads=total
        )
        self.views = [
            canonical(kind, self.region[o : o + layer_bytes], nb, heads, bs, self.row)
            for o in offsets
        ]


def apply(blocks, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    touched = np.zeros(dst.size, bool)
    for rec in blocks:
        s, d, n = int(rec["src_offset"]), int(rec["dst_offset"]), int(rec["length"])
        assert not touched[d : d + n].any(), "two records write the same destination byte"
        dst[d : d + n] = src[s : s + n]
        touched[d : d + n] = True
    return touched


@st.composite
def hetero(draw):
    kind_src = draw(st.sampled_from(KINDS))
    kind_dst = "cpu" if kind_src == "cpu" else draw(st.sampled_from(KINDS[1:]))
    total = draw(st.integers(1, 4))
    ranges = []
    for _ in range(2):
        start = draw(st.integers(0, total - 1))
        ranges.append((start, draw(st.integers(1, total - start))))
    g = draw(st.integers(1, 3))
    s_bs = g * draw(st.sampled_from([1, 2, 4]))
    d_bs = g * draw(st.sampled_from([1, 2, 4])) if s_bs == g else g
    dst_first = draw(st.integers(0, 2))
    start = dst_first * d_bs
    end = start + draw(st.integers(0, 3 * max(s_bs, d_bs)))
    return {
        "kinds": (kind_src, kind_dst), "total": total, "ranges": ranges, "bs": (s_bs, d_bs),
        "hd": draw(st.integers(1, 3)), "itemsize": draw(st.sampled_from([1, 2])),
        "layers": draw(st.integers(1, 3)), "dst_first": dst_first, "end": end,
        "extra_src": draw(st.integers(0, 1)), "seed": draw(st.integers(0, 2**32 - 1)),
    }  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(hetero())
def test_heads_and_block_sizes_copy_the_right_bytes(sc) -> None:
    rng = np.random.default_rng(sc["seed"])
    (p_start, p_heads), (d_start, d_heads) = sc["ranges"]
    s_bs, d_bs = sc["bs"]
    start, end = sc["dst_first"] * d_bs, sc["end"]
    n_src = -(-end // s_bs) + sc["extra_src"]
    n_dst = -(-(end - start) // d_bs)
    common = {k: sc[k] for k in ("total", "hd", "itemsize", "layers")}
    src = Side(sc["kinds"][0], n_src + 2, p_heads, p_start, bs=s_bs, rng=rng, **common)
    dst = Side(sc["kinds"][1], n_dst + 3, d_heads, d_start, bs=d_bs, rng=rng, **common)
    src_ids = rng.permutation(src.nb)[:n_src]
    dst_ids = rng.permutation(dst.nb)[:n_dst]

    lo, hi = max(p_start, d_start), min(p_start + p_heads, d_start + d_heads)
    if lo >= hi:  # no head in common: narrowing P to D's heads refuses
        with pytest.raises(HeadRangeError):
            src.layout.select_heads(d_start, d_heads)
        return
    s_layout = src.layout.select_heads(lo, hi - lo)
    d_layout = dst.layout.select_heads(lo, hi - lo)
    if s_bs == d_bs:
        assert s_layout.signature == d_layout.signature
    blocks = parse_blocks_resized(
        s_layout.token_major(), d_layout.token_major(), src_ids, dst_ids,
        num_tokens=end, dst_first_block=sc["dst_first"], src_region=0, dst_region=0,
    )  # fmt: skip
    before = dst.region.copy()
    touched = apply(blocks, src.region, dst.region)

    g = min(s_bs, d_bs)
    copied_end = start + -(-(end - start) // g) * g  # whole sub-blocks
    expect_touched = np.zeros_like(touched)
    for layer in range(sc["layers"]):
        sv, dv = src.views[layer], dst.views[layer]
        for t in range(start, copied_end):
            s_b, d_b = src_ids[t // s_bs], dst_ids[t // d_bs - sc["dst_first"]]
            want = sv[s_b, :, lo - p_start : hi - p_start, t % s_bs]
            got = dv[d_b, :, lo - d_start : hi - d_start, t % d_bs]
            np.testing.assert_array_equal(got, want)
            _mark(expect_touched, dst, layer, d_b, lo - d_start, hi - d_start, t % d_bs)
    np.testing.assert_array_equal(touched, expect_touched)
    np.testing.assert_array_equal(dst.region[~touched], before[~touched])

    if s_bs == d_bs and sc["dst_first"] == 0 and end == n_dst * d_bs:
        # Same block size: plain parse_blocks on the head-narrowed layouts gives the same bytes.
        plain = parse_blocks(s_layout, d_layout, src_ids[:n_dst], dst_ids)
        assert int(plain["length"].sum()) == int(blocks["length"].sum())
        assert sorted(_byte_pairs(plain)) == sorted(_byte_pairs(blocks))


def _mark(mask, side, layer, block, h_lo, h_hi, token) -> None:  # noqa: PLR0917
    base = 3 + layer * side.nb * 2 * side.heads * side.bs * side.row
    flat = np.arange(side.nb * 2 * side.heads * side.bs * side.row)
    view = canonical(side.kind, flat, side.nb, side.heads, side.bs, side.row)
    mask[base + view[block, :, h_lo:h_hi, token].ravel()] = True


def _byte_pairs(blocks):
    return [
        (int(r["src_offset"]) + i, int(r["dst_offset"]) + i)
        for r in blocks
        for i in range(int(r["length"]))
    ]


def test_cpu_head_slice_is_one_piece_per_block_and_names_carry_heads() -> None:
    full = PagedKVLayout.cpu([0], 32, 4, 16, 8, 2)
    rank1 = PagedKVLayout.cpu([0], 32, 2, 16, 8, 2, head_start=2, total_heads=4)
    assert full.signature[0][0] == "kv"
    assert rank1.signature[0][0] == "kv[h2:4]"
    sliced = full.select_heads(2, 2)
    assert sliced.signature == rank1.signature
    blocks = parse_blocks(sliced, rank1, [3, 9], [0, 1])
    assert blocks.size == 2  # one contiguous piece per block (heads are outermost)
    # Reverse: D holds every head, P rank 1 writes its two heads into the middle of D's block.
    back = parse_blocks(rank1, full.select_heads(2, 2), [0], [5])
    assert back.size == 1
    assert int(back["dst_offset"][0]) == 5 * full.block_nbytes + 2 * 16 * 32


def test_fa_head_slice_is_one_piece_per_token() -> None:
    full = PagedKVLayout.kv_first([0], 8, 4, 16, 8, 2)
    rank = PagedKVLayout.kv_first([0], 8, 1, 16, 8, 2, head_start=3, total_heads=4)
    blocks = parse_blocks(full.select_heads(3, 1), rank, [1], [2])
    assert blocks.size == 2 * 16
    assert set(blocks["length"].tolist()) == {16}


def test_resized_consecutive_halves_merge() -> None:
    small = PagedKVLayout.blocks_first([0], 64, 2, 16, 8, 2)
    big = PagedKVLayout.blocks_first([0], 64, 2, 32, 8, 2)
    # P blocks 4, 5 fill D block 3's first and second half: k and v each one record.
    blocks = parse_blocks_resized(small, big, [4, 5], [3])
    assert blocks.size == 4  # per P block a k and a v piece (P's k/v alternate, D's do not)
    assert int(blocks["length"].sum()) == big.block_nbytes
    kv_first_small = PagedKVLayout.kv_first([0], 64, 2, 16, 8, 2)
    kv_first_big = PagedKVLayout.kv_first([0], 64, 2, 32, 8, 2)
    assert parse_blocks_resized(kv_first_small, kv_first_big, [4, 5], [3]).size == 2


def test_resized_partial_last_block_stays_inside_destination_blocks() -> None:
    p = PagedKVLayout.kv_first([0], 16, 1, 32, 4, 1)
    d = PagedKVLayout.kv_first([0], 16, 1, 16, 4, 1)
    # 40 tokens: D needs 3 blocks of 16 (the last one holds 8 valid tokens); P's 2nd block is
    # split, only its first half goes.
    blocks = parse_blocks_resized(p, d, [0, 1], [7, 8, 9], num_tokens=40)
    assert int(blocks["length"].sum()) == 2 * 48 * 4
    with pytest.raises(TokenRangeError):
        parse_blocks_resized(p, d, [0, 1], [7, 8, 9, 10], num_tokens=40)  # one block too many
    with pytest.raises(TokenRangeError):
        parse_blocks_resized(p, d, [0], [7, 8, 9], num_tokens=40)  # P does not hold token 39
    # D already holds its first block (16 tokens): P block 0's second half onwards.
    tail = parse_blocks_resized(p, d, [0, 1], [8, 9], num_tokens=40, dst_first_block=1)
    assert int(tail["length"].sum()) == 2 * 32 * 4
    assert int(tail["src_offset"].min()) == 16 * 4


def test_typed_errors_for_impossible_combinations() -> None:
    cpu16 = PagedKVLayout.cpu([0], 8, 2, 16, 8, 2)
    cpu24 = PagedKVLayout.cpu([0], 8, 2, 24, 8, 2)
    with pytest.raises(NotTokenMajorError):
        parse_blocks_resized(cpu16, cpu16, [0], [0])
    with pytest.raises(BlockSizeRatioError):
        parse_blocks_resized(cpu16.token_major(), cpu24.token_major(), [0, 1, 2], [0, 1])
    with pytest.raises(HeadRangeError):
        cpu16.select_heads(1, 2)
    with pytest.raises(HeadRangeError):
        PagedKVLayout.cpu([0], 8, 2, 16, 8, 2, head_start=2, total_heads=4).select_heads(0, 2)
    rank0 = PagedKVLayout.cpu([0], 8, 1, 16, 8, 2, head_start=0, total_heads=2)
    rank1 = PagedKVLayout.cpu([0], 8, 1, 16, 8, 2, head_start=1, total_heads=2)
    with pytest.raises(LayoutMismatchError):  # same bytes per block, other heads
        parse_blocks(rank0, rank1, [0], [0])
    with pytest.raises(LayoutMismatchError):  # token-major vs head-major bytes
        parse_blocks(cpu16.token_major(), PagedKVLayout.kv_first([0], 8, 2, 16, 16, 2), [0], [0])
    fa = PagedKVLayout.kv_first([0], 8, 2, 16, 8, 2)
    with pytest.raises(LayoutMismatchError):  # other head_dim, same bytes per token
        parse_blocks_resized(fa, PagedKVLayout.kv_first([0], 8, 4, 16, 4, 2), [0], [0])
