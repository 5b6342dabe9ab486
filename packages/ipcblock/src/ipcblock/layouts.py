"""Layouts: where one block of one layer lives, in bytes, inside a registered region.

A layout reduces any paged cache format to the same small description, so ParseBlock never grows a
branch per format:

* ``layer_offsets[l]``: byte offset of layer ``l``'s base from the region base;
* ``segments``: for every layer, the pieces one block is split into. A segment is contiguous for
  one block (``nbytes``), starts at ``offset`` from the layer base for block 0 and moves by
  ``block_stride`` per block id.

Examples (``B`` = bytes of one block of K, i.e. ``block_size * kv_heads * head_dim * itemsize``)::

    layout (per layer)                      segments as name(offset, block_stride, nbytes)
    CPU   [nb, kv_heads, block_size, 2*hd]  kv(0, 2B, 2B)
    FA    [2, nb, block_size, kv_heads, hd] k(0, B, B), v(nb*B, B, B)
    FI    [nb, 2, block_size, kv_heads, hd] k(0, 2B, B), v(B, 2B, B)
    cross-layer [nb, L, ...]                layer_offsets[l] = l*2B; kv(0, L*2B, 2B)

New formats (MLA's one latent segment, DSA's extra indexer-cache segment, linear-attention state
slots where a "block" is a request's state slot) are new constructors that emit segments; the parser
and the data plane stay as they are. Two layouts can exchange blocks when their segment signatures
(names and bytes per block, in order) are equal; num_blocks, strides and layer offsets may differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ipcblock.errors import InvalidLayoutError


@dataclass(frozen=True)
class Segment:
    """One contiguous per-block piece of a layer (e.g. the K half or the V half)."""

    name: str
    offset: int
    block_stride: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class PagedKVLayout:
    """Geometry of a paged cache: per-layer base offsets and per-block segments.

    Build one with a constructor named after the backend (:meth:`cpu`, :meth:`kv_first`,
    :meth:`blocks_first`) or :meth:`from_segments` for anything else.
    """

    layer_offsets: np.ndarray
    num_blocks: int
    segments: tuple[Segment, ...]
    kind: str = "custom"
    _signature: tuple[tuple[str, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        offsets = np.asarray(self.layer_offsets, dtype=np.int64).reshape(-1)
        offsets.setflags(write=False)
        object.__setattr__(self, "layer_offsets", offsets)
        object.__setattr__(self, "num_blocks", int(self.num_blocks))
        object.__setattr__(self, "segments", tuple(self.segments))
        object.__setattr__(self, "_signature", tuple((s.name, s.nbytes) for s in self.segments))
        self._validate()

    def _validate(self) -> None:
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
            if self.num_blocks > 1 and seg.block_stride < seg.nbytes:
                raise InvalidLayoutError(f"segment {seg.name!r}: blocks overlap ({seg})")

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_segments(
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        segments: Sequence[Segment],
        kind: str = "custom",
    ) -> PagedKVLayout:
        return cls(np.asarray(layer_offsets), num_blocks, tuple(segments), kind)

    @classmethod
    def cpu(  # noqa: PLR0917 - the contract allows positional dims
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        itemsize: int,
    ) -> PagedKVLayout:
        """vLLM's CPU backend: ``[num_blocks, kv_heads, block_size, 2*head_dim]`` per layer.

        K and V are interleaved inside a block, so a block is one ``kv`` segment; layers are views
        of one buffer, so the region is that buffer and ``layer_offsets`` locate each layer in it.
        """
        block = _positive(kv_heads, block_size, head_dim, itemsize) * 2
        return cls(np.asarray(layer_offsets), num_blocks, (Segment("kv", 0, block, block),), "cpu")

    @classmethod
    def kv_first(  # noqa: PLR0917 - the contract allows positional dims
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        itemsize: int,
    ) -> PagedKVLayout:
        """FlashAttention's classic ``[2, num_blocks, block_size, kv_heads, head_dim]``.

        A K plane then a V plane: two segments, each contiguous per block.
        """
        half = _positive(kv_heads, block_size, head_dim, itemsize)
        segments = (Segment("k", 0, half, half), Segment("v", num_blocks * half, half, half))
        return cls(np.asarray(layer_offsets), num_blocks, segments, "kv_first")

    @classmethod
    def blocks_first(  # noqa: PLR0917 - the contract allows positional dims
        cls,
        layer_offsets: Sequence[int] | np.ndarray,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_dim: int,
        itemsize: int,
    ) -> PagedKVLayout:
        """FlashInfer's ``[num_blocks, 2, block_size, kv_heads, head_dim]``.

        K and V halves inside each block: two segments that merge back when blocks are consecutive.
        """
        half = _positive(kv_heads, block_size, head_dim, itemsize)
        segments = (Segment("k", 0, 2 * half, half), Segment("v", half, 2 * half, half))
        return cls(np.asarray(layer_offsets), num_blocks, segments, "blocks_first")

    # ----------------------------------------------------------------- queries
    @property
    def num_layers(self) -> int:
        return int(self.layer_offsets.size)

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
            s.offset + (self.num_blocks - 1) * s.block_stride + s.nbytes for s in self.segments
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


def stacked_layer_offsets(num_layers: int, layer_nbytes: int, base: int = 0) -> np.ndarray:
    """Offsets of ``num_layers`` layers laid end to end (e.g. views of one ``[L, ...]`` buffer)."""
    return base + np.arange(num_layers, dtype=np.int64) * int(layer_nbytes)


def _positive(*dims: int) -> int:
    product = 1
    for dim in dims:
        if int(dim) <= 0:
            raise InvalidLayoutError(f"dimensions must be positive, got {dims}")
        product *= int(dim)
    return product
