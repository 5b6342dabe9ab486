"""ParseBlock against an independent reference: numpy views built from the layouts' *shapes*.

The reference copier applies the IpcBlocks byte by byte to flat buffers; the check then reads the
destination through shaped numpy views (not through the layout's offsets), so a wrong offset or
stride in the layout code cannot cancel itself out.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import (
    IPCBLOCK_DTYPE,
    BlockIdOutOfRangeError,
    DuplicateDestinationError,
    InvalidLayoutError,
    LayerOutOfRangeError,
    LayoutMismatchError,
    LengthMismatchError,
    PagedKVLayout,
    RegionIdError,
    Segment,
    blocks_to_bytes,
    parse_blocks,
    stacked_layer_offsets,
)

KINDS = ("cpu", "kv_first", "blocks_first")


def layer_shape(kind: str, nb: int, heads: int, bs: int, hd: int) -> tuple[int, ...]:
    return {
        "cpu": (nb, heads, bs, 2 * hd),
        "kv_first": (2, nb, bs, heads, hd),
        "blocks_first": (nb, 2, bs, heads, hd),
    }[kind]


def block_view(kind: str, layer: np.ndarray, block: int) -> np.ndarray:
    """The data of one block in one layer, as a canonical array (K then V for split layouts)."""
    if kind == "cpu":
        return layer[block]
    if kind == "kv_first":
        return layer[:, block]
    return layer[block]


def make_layout(kind: str, offsets, nb: int, sc: dict, itemsize: int) -> PagedKVLayout:
    return getattr(PagedKVLayout, kind)(offsets, nb, sc["heads"], sc["bs"], sc["hd"], itemsize)


def apply_blocks(blocks: np.ndarray, sources: list[np.ndarray], dests: list[np.ndarray]) -> None:
    """Reference copier: what a data plane does, one record at a time."""
    for rec in blocks:
        s, d, n = int(rec["src_offset"]), int(rec["dst_offset"]), int(rec["length"])
        dests[rec["dst_region"]][d : d + n] = sources[rec["src_region"]][s : s + n]


@st.composite
def scenarios(draw):
    kind_src = draw(st.sampled_from(KINDS))
    # cpu interleaves K and V inside a block, so it only pairs with itself.
    kind_dst = "cpu" if kind_src == "cpu" else draw(st.sampled_from(KINDS[1:]))
    heads = draw(st.integers(1, 3))
    bs = draw(st.integers(1, 4))
    hd = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([np.uint8, np.float16, np.float32]))
    num_layers = draw(st.integers(1, 4))
    src_nb = draw(st.integers(1, 12))
    dst_nb = draw(st.integers(1, 12))
    n = draw(st.integers(0, min(src_nb, dst_nb)))
    src_ids = draw(st.lists(st.integers(0, src_nb - 1), min_size=n, max_size=n))
    dst_ids = draw(st.permutations(range(dst_nb)))[:n]
    layers = draw(
        st.none() | st.lists(st.integers(0, num_layers - 1), unique=True, max_size=num_layers)
    )
    # Layers either stacked in one buffer (one region) or one region per layer.
    src_per_layer_regions = draw(st.booleans())
    dst_per_layer_regions = draw(st.booleans())
    gap = draw(st.integers(0, 3)) * np.dtype(dtype).itemsize
    return {
        "kind_src": kind_src, "kind_dst": kind_dst, "heads": heads, "bs": bs, "hd": hd,
        "dtype": dtype, "num_layers": num_layers, "src_nb": src_nb, "dst_nb": dst_nb,
        "src_ids": src_ids, "dst_ids": dst_ids, "layers": layers, "gap": gap,
        "src_split": src_per_layer_regions, "dst_split": dst_per_layer_regions,
    }  # fmt: skip


def build_side(kind, nb, sc, split: bool, rng: np.random.Generator | None):
    """Flat region buffers plus shaped per-layer views and the matching layout."""
    shape = layer_shape(kind, nb, sc["heads"], sc["bs"], sc["hd"])
    itemsize = np.dtype(sc["dtype"]).itemsize
    layer_bytes = int(np.prod(shape)) * itemsize + sc["gap"]
    L = sc["num_layers"]
    if split:
        regions = [np.zeros(layer_bytes, np.uint8) for _ in range(L)]
        offsets = [0] * L
        region_ids = list(range(L))
    else:
        regions = [np.zeros(layer_bytes * L + 7, np.uint8)]
        offsets = stacked_layer_offsets(L, layer_bytes, base=7)
        region_ids = 0
    if rng is not None:
        for r in regions:
            r[:] = rng.integers(0, 256, r.size, dtype=np.uint8)
    views = []
    for layer in range(L):
        buf = regions[layer if split else 0]
        start = int(offsets[layer])
        raw = buf[start : start + int(np.prod(shape)) * itemsize]
        views.append(raw.view(sc["dtype"]).reshape(shape))
    layout = make_layout(kind, offsets, nb, sc, itemsize)
    return regions, views, layout, region_ids


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_reference_copier_reproduces_source_kv(sc, seed) -> None:
    rng = np.random.default_rng(seed)
    s_regions, s_views, s_layout, s_rid = build_side(
        sc["kind_src"], sc["src_nb"], sc, sc["src_split"], rng
    )
    d_regions, d_views, d_layout, d_rid = build_side(
        sc["kind_dst"], sc["dst_nb"], sc, sc["dst_split"], None
    )
    # Distinct region ids per side are looked up in their own table; the copier indexes by id.
    blocks = parse_blocks(
        s_layout, d_layout, sc["src_ids"], sc["dst_ids"], sc["layers"], s_rid, d_rid
    )
    assert blocks.dtype == IPCBLOCK_DTYPE
    before = [r.copy() for r in d_regions]
    apply_blocks(blocks, s_regions, d_regions)

    layers = range(sc["num_layers"]) if sc["layers"] is None else sc["layers"]
    touched = [np.zeros(r.size, bool) for r in d_regions]
    for layer in layers:
        for s, d in zip(sc["src_ids"], sc["dst_ids"], strict=True):
            got = block_view(sc["kind_dst"], d_views[layer], d)
            want = block_view(sc["kind_src"], s_views[layer], s)
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    # Nothing outside the requested blocks changed, and the records cover exactly those bytes.
    for rec in blocks:
        touched[rec["dst_region"]][rec["dst_offset"] : rec["dst_offset"] + rec["length"]] = True
    expected_bytes = len(list(layers)) * len(sc["dst_ids"]) * d_layout.block_nbytes
    assert sum(int(t.sum()) for t in touched) == expected_bytes == int(blocks["length"].sum())
    for region, old, mask in zip(d_regions, before, touched, strict=True):
        np.testing.assert_array_equal(region[~mask], old[~mask])
    # Tags are layer indices; merged records never straddle layers.
    assert set(blocks["tag"].tolist()) <= set(layers)


def cpu_layout(nb=8, layers=2):
    block = 2 * 2 * 16 * 8 * 2
    return PagedKVLayout.cpu(stacked_layer_offsets(layers, nb * block), nb, 2, 16, 8, 2)


def test_contiguous_ids_merge_into_one_record_per_layer() -> None:
    layout = cpu_layout(nb=64, layers=3)
    blocks = parse_blocks(layout, layout, np.arange(10, 40), np.arange(0, 30))
    assert blocks.size == 3
    assert blocks["length"].tolist() == [30 * layout.block_nbytes] * 3
    assert blocks["tag"].tolist() == [0, 1, 2]


def test_split_runs_and_layer_subset() -> None:
    layout = cpu_layout(nb=64, layers=4)
    blocks = parse_blocks(layout, layout, [1, 2, 3, 9, 10], [5, 6, 7, 8, 9], layers=[3, 1])
    # Per layer: 1..3 -> 5..7 is one run; at 9 -> 8 the destination continues (7 -> 8) but the
    # source jumps (3 -> 9), so a second run 9..10 -> 8..9 starts. Layers keep the given order.
    assert blocks["tag"].tolist() == [3, 3, 1, 1]
    assert (blocks["length"] // layout.block_nbytes).tolist() == [3, 2, 3, 2]


def test_blocks_first_merges_k_and_v_of_consecutive_blocks() -> None:
    layout = PagedKVLayout.blocks_first([0], 16, 2, 16, 8, 2)
    blocks = parse_blocks(layout, layout, [4, 5, 6], [0, 1, 2])
    assert blocks.size == 1
    assert int(blocks["length"][0]) == 3 * layout.block_nbytes


def test_kv_first_merges_per_plane() -> None:
    layout = PagedKVLayout.kv_first([0], 16, 2, 16, 8, 2)
    blocks = parse_blocks(layout, layout, [4, 5, 6], [0, 1, 2])
    assert blocks.size == 2  # one K run, one V run


def test_unmerged_has_one_record_per_block_segment_layer() -> None:
    layout = PagedKVLayout.kv_first([0, 10**6], 16, 2, 16, 8, 2)
    blocks = parse_blocks(layout, layout, [4, 5, 6], [0, 1, 2], merge=False)
    assert blocks.size == 2 * 2 * 3


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "error"),
    [
        ([0, 8], [0, 1], BlockIdOutOfRangeError),
        ([-1], [0], BlockIdOutOfRangeError),
        ([0], [8], BlockIdOutOfRangeError),
        ([0, 1], [0], LengthMismatchError),
        ([0, 1], [3, 3], DuplicateDestinationError),
        ([0.0], [1], BlockIdOutOfRangeError),
    ],
)
def test_bad_block_ids(src_ids, dst_ids, error) -> None:
    layout = cpu_layout()
    with pytest.raises(error):
        parse_blocks(layout, layout, src_ids, dst_ids)


def test_bad_layers_regions_and_layouts() -> None:
    layout = cpu_layout(layers=2)
    with pytest.raises(LayerOutOfRangeError):
        parse_blocks(layout, layout, [0], [0], layers=[2])
    with pytest.raises(LayerOutOfRangeError):
        parse_blocks(layout, layout, [0], [0], layers=[1, 1])
    with pytest.raises(LayerOutOfRangeError):
        parse_blocks(layout, cpu_layout(layers=3), [0], [0])
    with pytest.raises(RegionIdError):
        parse_blocks(layout, layout, [0], [0], src_region=70000)
    with pytest.raises(RegionIdError):
        parse_blocks(layout, layout, [0], [0], dst_region=[1, 2, 3])
    with pytest.raises(LayoutMismatchError):
        parse_blocks(layout, PagedKVLayout.blocks_first([0, 0], 8, 2, 16, 8, 2), [0], [0])
    with pytest.raises(LayoutMismatchError):
        parse_blocks(layout, PagedKVLayout.cpu([0, 0], 8, 2, 16, 8, 4), [0], [0])
    with pytest.raises(InvalidLayoutError):
        PagedKVLayout.cpu([0], 0, 2, 16, 8, 2)
    with pytest.raises(InvalidLayoutError):
        PagedKVLayout.cpu([-5], 4, 2, 16, 8, 2)
    with pytest.raises(InvalidLayoutError):
        PagedKVLayout.kv_first([0], 4, 0, 16, 8, 2)


def test_empty_inputs_give_empty_array() -> None:
    layout = cpu_layout()
    assert parse_blocks(layout, layout, [], []).size == 0
    assert parse_blocks(layout, layout, [1], [1], layers=[]).size == 0


def test_region_nbytes_covers_every_layer() -> None:
    layout = cpu_layout(nb=8, layers=3)
    assert layout.region_nbytes == 3 * 8 * layout.block_nbytes
    split = PagedKVLayout.kv_first([0], 8, 2, 16, 8, 2)
    assert split.region_nbytes == 8 * split.block_nbytes


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 9),
    st.integers(1, 40),
    st.integers(1, 50),
    st.booleans(),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["kv_first", "mla", "mixed"]),
)
def test_wide_writer_equals_field_by_field(num_layers, blocks, chunk, split, seed, kind) -> None:  # noqa: PLR0917
    """The two-pass 16-byte writer (large outputs) against the per-field writer: chunk edges,
    one or two segments, equal or different record lengths."""
    from unittest import mock

    import ipcblock.parse as parse_mod

    rng = np.random.default_rng(seed)
    bases = rng.integers(0, 2**40, num_layers)  # random layer bases
    if kind == "kv_first":  # two segments: equal lengths unless ids merge
        layout = PagedKVLayout.kv_first(bases, 64, 1, 4, 8, 2)
    elif kind == "mla":  # one segment: lengths equal unless ids merge
        layout = PagedKVLayout.mla(bases, 64, 4, 8)
    else:  # lengths differ in every layer
        layout = PagedKVLayout.from_segments(
            bases, 64, [Segment("a", 0, 64, 24), Segment("b", 24, 64, 40)]
        )
    src = rng.choice(64, blocks, replace=False)
    dst = rng.choice(64, blocks, replace=False)
    layers = rng.permutation(num_layers)[: rng.integers(1, num_layers + 1)]
    regions = {
        "src_region": rng.integers(0, 2**16, num_layers) if split else int(rng.integers(0, 2**16)),
        "dst_region": rng.integers(0, 2**16, num_layers),
    }
    narrow = parse_blocks(layout, layout, src, dst, layers, **regions)
    with (
        mock.patch.object(parse_mod, "_WIDE_WRITE_MIN", 0),
        mock.patch.object(parse_mod, "_CHUNK_RECORDS", chunk),
    ):
        wide = parse_blocks(layout, layout, src, dst, layers, **regions)
    assert wide.dtype == IPCBLOCK_DTYPE
    np.testing.assert_array_equal(wide, narrow)
    assert bytes(blocks_to_bytes(wide)) == bytes(blocks_to_bytes(narrow))
