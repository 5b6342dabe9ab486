"""mapping.plan_copy / check_compatible / source_ranks: which of P's bytes land in which of D's.

Every rank's cache is a flat uint8 region of stacked layers shaped like vLLM's tensors (CPU
``[nb, H, bs, 2*hd]``, FlashAttention ``[2, nb, bs, H, hd]``, MLA ``[nb, 1, bs, row]``), filled
from one global "logical KV" array ``[layer, token, head, k|v, byte]``. The plans are applied byte
by byte and D's tensors, read back through numpy views, must hold exactly the logical KV of its
heads for every token it asked for; nothing outside D's given blocks may change.
"""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_connector.config import HybridConfig, rank_address
from hybrid_connector.errors import ConfigError, PeerError
from hybrid_connector.mapping import (
    Source,
    check_compatible,
    ipc_layout,
    plan_copy,
    rank_heads,
    source_ranks,
)
from hybrid_connector.protocol import LayoutSpec, SegmentSpec
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import PagedKVLayout
from numpy.lib.stride_tricks import as_strided

KINDS = ("blocks_major", "kv_first", "mla")
ITEMSIZE = 2  # bfloat16


class RankCache:
    """One group of one rank: ``layers`` layers of vLLM-shaped bf16 blocks in one uint8 region.

    ``kind``: "blocks_major" (vLLM CPU ``[nb, H, bs, 2*hd]``, which inside each head holds K
    transposed as ``[hd, bs]`` and then V as ``[bs, hd]``), "kv_first" (``[2, nb, bs, H, hd]``)
    or "mla" (``[nb, bs, hd]``, one latent per token, replicated over TP).
    """

    def __init__(
        self,
        kind: str,
        *,
        layers: int,
        num_blocks: int,
        block_size: int,
        heads: range,
        total_heads: int,
        hd: int,
        rng: np.random.Generator,
        region_id: int = 0,
    ) -> None:
        self.kind, self.nb, self.bs, self.hd = kind, num_blocks, block_size, hd
        self.heads = range(0, 1) if kind == "mla" else heads
        self.parts = 1 if kind == "mla" else 2
        h = len(self.heads)
        self.block_nbytes = h * block_size * self.parts * hd * ITEMSIZE
        self.layer_nbytes = num_blocks * self.block_nbytes
        self.region = rng.integers(0, 256, layers * self.layer_nbytes, dtype=np.uint8)
        offsets = [i * self.layer_nbytes for i in range(layers)]
        if kind == "kv_first":
            half = self.block_nbytes // 2
            segments = [
                SegmentSpec("k", 0, half, half),
                SegmentSpec("v", num_blocks * half, half, half),
            ]
        else:
            segments = [SegmentSpec("kv", 0, self.block_nbytes, self.block_nbytes)]
        mla = kind == "mla"
        self.spec = LayoutSpec(
            layer_names=[f"model.layers.{i}.attn" for i in range(layers)],
            layer_offsets=offsets,
            region_ids=[region_id] * layers,
            num_blocks=num_blocks,
            block_size=block_size,
            segments=segments,
            kind="blocks_major" if mla else kind,
            family="mla" if mla else "attention",
            dtype="bfloat16",
            total_heads=0 if mla else total_heads,
            head_start=0 if mla else heads.start,
            num_heads=0 if mla else h,
        )

    def views(self, layer: int) -> list[np.ndarray]:
        """Per part (K, V; the latent for MLA), layer ``layer`` indexed [block, local head,
        token, dim, byte of the element] (strided views of the region, no copy)."""
        raw = self.region[layer * self.layer_nbytes : (layer + 1) * self.layer_nbytes]
        h, bs, hd, it = len(self.heads), self.bs, self.hd, ITEMSIZE
        shape = (self.nb, h, bs, hd, it)
        if self.kind == "blocks_major":
            head = 2 * bs * hd * it
            parts = [
                (0, (h * head, head, it, bs * it, 1)),
                (bs * hd * it, (h * head, head, hd * it, it, 1)),
            ]
        elif self.kind == "kv_first":
            block = bs * h * hd * it
            strides = (block, hd * it, h * hd * it, it, 1)
            parts = [(0, strides), (self.nb * block, strides)]
        else:
            parts = [(0, (bs * hd * it, 0, hd * it, it, 1))]
        return [
            as_strided(raw[offset:], shape=shape, strides=strides, writeable=True)
            for offset, strides in parts
        ]

    def fill(self, logical: np.ndarray, block_ids: list[int]) -> None:
        """Write ``logical[layer, token, global head, part, dim, byte]`` into the request's
        blocks."""
        tokens = np.arange(logical.shape[1])
        blocks = np.asarray(block_ids)[tokens // self.bs]
        for layer in range(logical.shape[0]):
            for part, view in enumerate(self.views(layer)):
                for i, head in enumerate(self.heads):
                    view[blocks, i, tokens % self.bs] = logical[layer, :, head, part]

    def read(self, block_ids: list[int], first_block: int, num_tokens: int) -> np.ndarray:
        """[layer, token, local head, part, dim, byte] for tokens [first_block*bs, num_tokens)."""
        tokens = np.arange(first_block * self.bs, num_tokens)
        blocks = np.asarray(block_ids)[tokens // self.bs - first_block]
        return np.stack(
            [
                np.stack([v[blocks, :, tokens % self.bs] for v in self.views(layer)], axis=2)
                for layer in range(self.layers)
            ]
        )

    def logical(self, rng: np.random.Generator, num_tokens: int, total_heads: int) -> np.ndarray:
        """Random logical KV ``[layer, token, head, part, dim, byte]`` for this group's shape."""
        heads = 1 if self.kind == "mla" else total_heads
        shape = (self.layers, num_tokens, heads, self.parts, self.hd, ITEMSIZE)
        return rng.integers(0, 256, shape, dtype=np.uint8)

    @property
    def layers(self) -> int:
        return len(self.spec.layer_names)

    def outside(self, block_ids: list[int]) -> np.ndarray:
        """A mask of the region's bytes that lie outside ``block_ids`` (must stay untouched)."""
        mask = np.ones(self.region.size, dtype=bool)
        for layer in range(self.layers):
            marker = np.zeros(self.region.size, dtype=np.uint8)
            raw = marker[layer * self.layer_nbytes : (layer + 1) * self.layer_nbytes]
            if self.kind == "kv_first":
                shaped = raw.reshape(2, self.nb, -1)
                shaped[:, block_ids] = 1
            else:
                raw.reshape(self.nb, -1)[block_ids] = 1
            mask &= marker == 0
        return mask


def apply(blocks: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy per IpcBlock records (one region per side), refusing overlapping writes."""
    touched = np.zeros(dst.size, dtype=bool)
    for rec in blocks:
        s, d, n = int(rec["src_offset"]), int(rec["dst_offset"]), int(rec["length"])
        assert not touched[d : d + n].any(), "two records write the same destination byte"
        dst[d : d + n] = src[s : s + n]
        touched[d : d + n] = True


def cpu_spec(num_blocks: int, heads: int, block_size: int, hd: int, **kw) -> LayoutSpec:
    return RankCache(
        kw.pop("kind", "blocks_major"),
        layers=kw.pop("layers", 2),
        num_blocks=num_blocks,
        block_size=block_size,
        heads=kw.pop("heads_range", range(heads)),
        total_heads=kw.pop("total_heads", heads),
        hd=hd,
        rng=np.random.default_rng(0),
    ).spec


# ------------------------------------------------------------------ the property
@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(KINDS))
    total = draw(st.sampled_from([1, 2, 4]))
    p_tp, d_tp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    g = draw(st.integers(1, 3))
    p_bs = g * draw(st.sampled_from([1, 2, 4]))
    d_bs = g * draw(st.sampled_from([1, 2, 4])) if p_bs == g else g
    first_block = draw(st.integers(0, 2))
    num_tokens = first_block * d_bs + draw(st.integers(1, 3 * max(p_bs, d_bs)))
    return {
        "kind": kind, "total": total, "tp": (p_tp, d_tp), "d_rank": draw(st.integers(0, d_tp - 1)),
        "bs": (p_bs, d_bs), "first_block": first_block, "num_tokens": num_tokens,
        "hd": draw(st.integers(1, 3)), "layers": draw(st.integers(1, 3)),
        "extra_p_blocks": draw(st.integers(0, 2)), "seed": draw(st.integers(0, 2**32 - 1)),
    }  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_plans_fill_d_rank_with_its_heads_for_every_token(sc: dict) -> None:
    """Any TP pair, block-size ratio, prefix hit and block ids: D's rank, after applying the plan
    of every P rank ``source_ranks`` names, holds the logical KV of its heads for every token it
    asked for, and no byte outside its new blocks changed."""
    rng = np.random.default_rng(sc["seed"])
    kind, total, (p_tp, d_tp), d_rank = sc["kind"], sc["total"], sc["tp"], sc["d_rank"]
    (p_bs, d_bs), first_block, num_tokens = sc["bs"], sc["first_block"], sc["num_tokens"]
    layers, hd = sc["layers"], sc["hd"]
    n_p = -(-num_tokens // p_bs) + sc["extra_p_blocks"]
    p_ranks = {}
    for p in range(p_tp):
        cache = RankCache(
            kind, layers=layers, num_blocks=n_p + 3, block_size=p_bs,
            heads=rank_heads(total, p_tp, p), total_heads=total, hd=hd, rng=rng,
        )  # fmt: skip
        p_ids = rng.permutation(cache.nb)[:n_p].tolist()
        if not p_ranks:
            logical = cache.logical(rng, num_tokens, total)
        cache.fill(logical[:, : min(num_tokens, n_p * p_bs)], p_ids)
        p_ranks[p] = (cache, p_ids)

    n_d = -(-num_tokens // d_bs) - first_block
    d = RankCache(
        kind, layers=layers, num_blocks=first_block + n_d + 2, block_size=d_bs,
        heads=rank_heads(total, d_tp, d_rank), total_heads=total, hd=hd, rng=rng,
    )  # fmt: skip
    d_ids = rng.permutation(d.nb)[:n_d].tolist()
    before, untouched = d.region.copy(), d.outside(d_ids)

    sources = source_ranks(p_tp, d_tp, d_rank, d.spec)
    covered = [h for s in sources for h in s.heads]
    if kind == "mla":
        assert sources == [Source(d_rank % p_tp, range(0))]
    else:
        assert covered == list(d.heads)  # every head of D's rank, each from one P rank
    for source in sources:
        p, p_ids = p_ranks[source.p_rank]
        check_compatible(p.spec, d.spec)
        blocks = plan_copy(
            p.spec, d.spec, p_ids, d_ids, first_block=first_block, num_tokens=num_tokens
        )
        apply(blocks, p.region, d.region)

    expected = logical[:, first_block * d_bs :][:, :, list(d.heads)]
    np.testing.assert_array_equal(d.read(d_ids, first_block, num_tokens), expected)
    np.testing.assert_array_equal(d.region[untouched], before[untouched])


# ------------------------------------------------------------------ counts and refusals
def test_same_block_size_copies_the_blocks_after_the_prefix_hit() -> None:
    rng = np.random.default_rng(0)
    p = RankCache(
        "blocks_major", layers=2, num_blocks=10, block_size=4, heads=range(2), total_heads=2,
        hd=8, rng=rng,
    )  # fmt: skip
    d = RankCache(
        "blocks_major", layers=2, num_blocks=12, block_size=4, heads=range(2), total_heads=2,
        hd=8, rng=rng,
    )  # fmt: skip
    expected = d.region.copy().reshape(2, 12, -1)
    # 14 tokens: 4 blocks of 4; D holds blocks 0..1 (8 tokens) already.
    blocks = plan_copy(p.spec, d.spec, [7, 2, 9, 4], [11, 0], first_block=2, num_tokens=14)
    apply(blocks, p.region, d.region)
    expected[:, [11, 0]] = p.region.reshape(2, 10, -1)[:, [9, 4]]
    np.testing.assert_array_equal(d.region.reshape(2, 12, -1), expected)
    assert blocks.size == 4  # one whole block per record and layer
    assert set(blocks["tag"].tolist()) == {0, 1}


def test_positional_form_copies_block_for_block() -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(12, 2, 4, 8)
    blocks = plan_copy(p, d, [3, 4, 5], [0, 1, 2])
    assert blocks.size == 2  # contiguous on both sides: one record per layer
    assert int(blocks["length"].sum()) == 2 * 3 * (2 * 4 * 2 * 8 * ITEMSIZE)


def test_tp_split_pulls_only_d_ranks_heads_in_one_piece_per_block() -> None:
    """P TP=1 (4 heads) -> D rank 1 of TP=2: heads 2..3 only, one record per block and layer
    (CPU blocks are head-major, so two heads of a block are contiguous on both sides)."""
    p = cpu_spec(8, 4, 4, 8)
    d = cpu_spec(8, 2, 4, 8, heads_range=range(2, 4), total_heads=4)
    blocks = plan_copy(p, d, [1, 5, 3], [2, 0, 7])
    assert blocks.size == 2 * 3
    head_nbytes = 4 * 2 * 8 * ITEMSIZE
    assert set(blocks["length"].tolist()) == {2 * head_nbytes}  # half of P's block
    assert set((blocks["src_offset"] % (4 * head_nbytes)).tolist()) == {2 * head_nbytes}


@pytest.mark.parametrize(
    ("p_ids", "d_ids", "first_block", "num_tokens", "match"),
    [
        ([1, 2, 3], [], 0, 12, "no destination block"),
        ([1, 2, 3], [4, 5], 0, 12, r"2 blocks after 0 cached ones for 12 tokens \(3 blocks"),
        ([1, 2, 3], [4, 5, 6], 1, 12, "after 1 cached"),
        ([1, 2], [4, 5, 6], 0, 12, "P holds 2 blocks"),
        ([1, 2, 3], [4], -1, 0, "negative"),
        ([1, 2, 3], [4, 4, 5], 0, 12, "duplicates"),
    ],
)
def test_counts_that_do_not_fit_are_refused(
    p_ids: list[int], d_ids: list[int], first_block: int, num_tokens: int, match: str
) -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(12, 2, 4, 8)
    with pytest.raises(PeerError, match=match):
        plan_copy(p, d, p_ids, d_ids, first_block=first_block, num_tokens=num_tokens)


def test_resized_counts_are_in_each_sides_block_size() -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(12, 2, 8, 8)  # P 4 -> D 8
    plan_copy(p, d, [1, 2, 3], [5, 6], num_tokens=12)  # 3 of P's, 2 of D's
    with pytest.raises(PeerError, match="P holds 2 blocks"):
        plan_copy(p, d, [1, 2], [5, 6], num_tokens=12)
    with pytest.raises(PeerError, match="blocks of 8"):
        plan_copy(p, d, [1, 2, 3], [5, 6, 7], num_tokens=12)


def test_block_id_out_of_range_is_a_peer_error() -> None:
    p, d = cpu_spec(10, 2, 4, 8), cpu_spec(4, 2, 4, 8)
    with pytest.raises(PeerError, match="out of range"):
        plan_copy(p, d, [1, 2], [3, 4], num_tokens=8)


def state_spec(num_slots: int, slot_bytes: int, block_size: int = 256) -> LayoutSpec:
    return LayoutSpec(
        layer_names=["model.layers.0.linear_attn"],
        layer_offsets=[0],
        region_ids=[0],
        num_blocks=num_slots,
        block_size=block_size,
        segments=[SegmentSpec("state", 0, slot_bytes, slot_bytes)],
        kind="blocks_major",
        family="state",
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


@pytest.mark.parametrize(
    ("p", "d", "match"),
    [
        (cpu_spec(4, 2, 4, 8), cpu_spec(4, 2, 6, 8), "not integer multiples"),
        (state_spec(4, 40, 32), state_spec(4, 40, 64), "state group block sizes differ"),
        (state_spec(4, 40), state_spec(4, 48), "geometry"),
        (cpu_spec(4, 2, 4, 8), cpu_spec(4, 2, 4, 8, kind="mla"), "group family"),
        (cpu_spec(4, 2, 4, 8), cpu_spec(4, 2, 4, 8, layers=3), "layers differ"),
        (cpu_spec(4, 2, 4, 8), cpu_spec(4, 2, 4, 16), "geometry"),
        (cpu_spec(4, 4, 4, 8), cpu_spec(4, 2, 4, 8), "KV heads differ"),
        (
            cpu_spec(4, 2, 4, 8, heads_range=range(2), total_heads=4),
            cpu_spec(4, 2, 4, 8, heads_range=range(2, 4), total_heads=4),
            "none in common",
        ),
        (
            cpu_spec(4, 2, 4, 8, kind="custom"),
            cpu_spec(4, 2, 8, 8, kind="custom"),
            "does not say where each token lies",
        ),
        (
            cpu_spec(4, 4, 4, 8, kind="custom"),
            cpu_spec(4, 2, 4, 8, kind="custom", heads_range=range(2), total_heads=4),
            "does not say where each head lies",
        ),
    ],
)
def test_what_cannot_be_mapped_is_refused_before_any_byte(
    p: LayoutSpec, d: LayoutSpec, match: str
) -> None:
    with pytest.raises(PeerError, match=match):
        check_compatible(p, d)
    with pytest.raises(PeerError, match=match):
        plan_copy(p, d, [0], [1], num_tokens=1)


def test_opaque_layouts_still_copy_whole_blocks() -> None:
    """A layout whose kind mapping does not know (no axes) keeps today's whole-block copy."""
    p, d = cpu_spec(4, 2, 4, 8, kind="custom"), cpu_spec(6, 2, 4, 8, kind="custom")
    check_compatible(p, d)
    assert plan_copy(p, d, [0, 1], [4, 5], num_tokens=8).size == 2


# ------------------------------------------------------------------ ranks and ports
@pytest.mark.parametrize(
    ("total", "tp", "expected"),
    [
        (4, 1, [range(4)]),
        (4, 2, [range(2), range(2, 4)]),
        (2, 4, [range(1), range(1), range(1, 2), range(1, 2)]),  # vLLM replicates
        (0, 2, [range(0), range(0)]),
    ],
)
def test_rank_heads_follow_vllms_sharding(total: int, tp: int, expected: list[range]) -> None:
    assert [rank_heads(total, tp, r) for r in range(tp)] == expected


def test_source_ranks() -> None:
    gqa = cpu_spec(4, 2, 4, 8, total_heads=4)
    mla = cpu_spec(4, 1, 4, 8, kind="mla")
    # P TP=1 -> D TP=2: each D rank from the one P rank, its own heads.
    assert source_ranks(1, 2, 1, gqa) == [Source(0, range(2, 4))]
    # P TP=2 -> D TP=1: both P ranks, two heads each.
    assert source_ranks(2, 1, 0, gqa) == [Source(0, range(2)), Source(1, range(2, 4))]
    # MLA: replicated latent, D's ranks spread over P's ranks.
    assert [source_ranks(2, 2, r, mla) for r in range(2)] == [
        [Source(0, range(0))],
        [Source(1, range(0))],
    ]
    assert [source_ranks(2, 4, r, mla)[0].p_rank for r in range(4)] == [0, 1, 0, 1]
    # P replicates its 2 heads over 4 ranks: D TP=2 rank r takes head r from one copy each.
    two = cpu_spec(4, 1, 4, 8, total_heads=2)
    assert source_ranks(4, 2, 0, two) == [Source(0, range(1))]
    assert source_ranks(4, 2, 1, two) == [Source(3, range(1, 2))]
    assert source_ranks(2, 2, 1, state_spec(4, 40)) == [Source(1, range(0))]
    with pytest.raises(PeerError, match="equal TP"):
        source_ranks(2, 1, 0, state_spec(4, 40))
    with pytest.raises(ConfigError):
        source_ranks(1, 2, 2, gqa)


def test_each_tp_rank_gets_its_own_ports() -> None:
    cfg = HybridConfig(rpc_port=7000, data_port=7100, metrics_port=None)
    assert cfg.for_rank(0, 2) == cfg
    rank1 = cfg.for_rank(1, 2)
    assert (rank1.rpc_port, rank1.data_port, rank1.metrics_port) == (7001, 7101, None)
    assert HybridConfig().for_rank(1, 2).data_port == 0  # ephemeral stays ephemeral
    assert rank_address(cfg.rpc_address, 1) == "127.0.0.1:7001"
    assert rank_address("[::1]:7000", 3) == "[::1]:7003"
    with pytest.raises(ConfigError, match="exceeds"):
        HybridConfig(rpc_port=65535).for_rank(0, 2)
    with pytest.raises(ConfigError, match="outside"):
        cfg.for_rank(2, 2)
    with pytest.raises(ConfigError, match="host:port"):
        rank_address("nohost", 1)


def test_state_slot_with_two_tensors_and_padded_stride_moves_only_that_slot() -> None:
    """A GDN layer's conv and ssm state as the worker describes them: two segments of one slot,
    the slot stride vLLM's padded page size."""
    conv, ssm, page = 24, 40, 80  # bytes per slot; page > conv + ssm (padding)
    spec = LayoutSpec(
        layer_names=["model.layers.0.linear_attn", "model.layers.2.linear_attn"],
        layer_offsets=[0, 6 * page],
        region_ids=[0, 0],
        num_blocks=6,
        block_size=256,
        segments=[SegmentSpec("state0", 0, page, conv), SegmentSpec("state1", conv, page, ssm)],
        kind="blocks_major",
        family="state",
    )
    rng = np.random.default_rng(3)
    p_mem = rng.integers(0, 256, 12 * page, dtype=np.uint8)
    d_mem = rng.integers(0, 256, 12 * page, dtype=np.uint8)
    before = d_mem.copy()
    apply(plan_copy(spec, spec, [4], [1]), p_mem, d_mem)
    p_slots, d_slots = p_mem.reshape(2, 6, page), d_mem.reshape(2, 6, page)
    np.testing.assert_array_equal(d_slots[:, 1, : conv + ssm], p_slots[:, 4, : conv + ssm])
    expected = before.reshape(2, 6, page).copy()
    expected[:, 1, : conv + ssm] = p_slots[:, 4, : conv + ssm]
    np.testing.assert_array_equal(d_slots, expected)  # padding and other slots untouched


def test_cpu_groups_use_ipcblocks_cpu_layout_and_resize_per_k_row() -> None:
    """mapping builds CPU blocks with PagedKVLayout.cpu (K transposed per head) and adds no
    layout arithmetic of its own; a resized copy is one record per head-dim row of K and one V
    piece, per head, per P block and layer (K rows are not contiguous in D's larger block)."""
    spec = cpu_spec(10, 2, 4, 8)
    expected = PagedKVLayout.cpu(spec.layer_offsets, 10, 2, 4, 8, ITEMSIZE)
    assert ipc_layout(spec).signature == expected.signature
    assert ipc_layout(spec).segments == expected.segments
    blocks = plan_copy(spec, cpu_spec(12, 2, 8, 8), [1, 2, 3], [5, 6], num_tokens=12)
    # 2 layers x 3 P blocks x 2 heads x (8 K rows + V), less one merge per layer: P blocks 2, 3
    # and D blocks 5, 6 are neighbours, so P block 2's last V piece runs on into block 3's K.
    assert blocks.size == 2 * (3 * 2 * (8 + 1) - 1)
