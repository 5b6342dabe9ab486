"""Describe vLLM's KV cache tensors as registered regions plus an ipcblock layout.

vLLM hands the worker one tensor per attention layer. On the CPU backend each is
``[num_blocks, kv_heads, block_size, 2*head_dim]`` and all layers are views of one buffer; on
other backends a layer may be ``[2, num_blocks, ...]`` (K plane then V plane) and layers may live
in separate buffers. This module finds the distinct buffers (they become kvt regions) and the
per-layer byte geometry, without assuming either arrangement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from ipcblock import PagedKVLayout, Segment

from hybrid_connector.errors import PeerError, UnsupportedLayoutError
from hybrid_connector.protocol import LayoutSpec, SegmentSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Buffer:
    """One distinct memory buffer holding the KV of one or more layers."""

    address: int
    nbytes: int


@dataclass(frozen=True)
class KvCacheGeometry:
    """Buffers (to register) and the layout of the layers inside them (region = buffer index)."""

    buffers: tuple[Buffer, ...]
    layer_names: tuple[str, ...]
    layer_offsets: tuple[int, ...]
    buffer_index: tuple[int, ...]
    num_blocks: int
    block_size: int
    segments: tuple[Segment, ...]
    kind: str

    def spec(self, region_ids: list[int]) -> LayoutSpec:
        """The wire description, with buffer indexes replaced by registered region ids."""
        return LayoutSpec(
            layer_names=list(self.layer_names),
            layer_offsets=list(self.layer_offsets),
            region_ids=[region_ids[i] for i in self.buffer_index],
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            segments=[
                SegmentSpec(s.name, s.offset, s.block_stride, s.nbytes) for s in self.segments
            ],
            kind=self.kind,
        )


def _block_segments(tensor: torch.Tensor, num_blocks: int) -> tuple[tuple[Segment, ...], str]:
    """Per-block segments of one layer tensor, from its shape and strides."""
    itemsize = tensor.element_size()
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())

    def contiguous_tail(dims: tuple[int, ...], dim_strides: tuple[int, ...]) -> int | None:
        # Bytes of the trailing dims if they are densely packed, else None.
        expected = 1
        for size, stride in zip(reversed(dims), reversed(dim_strides), strict=True):
            if size != 1 and stride != expected:
                return None
            expected *= size
        return expected * itemsize

    if shape and shape[0] == num_blocks:
        # [num_blocks, ...]: one segment per block (CPU: [nb, kv_heads, block_size, 2*head_dim]).
        nbytes = contiguous_tail(shape[1:], strides[1:])
        if nbytes is not None:
            return (Segment("kv", 0, strides[0] * itemsize, nbytes),), "blocks_major"
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        # [2, num_blocks, ...]: a K plane and a V plane.
        nbytes = contiguous_tail(shape[2:], strides[2:])
        if nbytes is not None:
            stride = strides[1] * itemsize
            return (
                Segment("k", 0, stride, nbytes),
                Segment("v", strides[0] * itemsize, stride, nbytes),
            ), "kv_first"
    raise UnsupportedLayoutError(
        f"KV cache tensor of shape {shape}, strides {strides} (num_blocks={num_blocks}) "
        "is neither [num_blocks, ...] nor [2, num_blocks, ...] with dense blocks"
    )


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor], block_size: int, num_blocks: int | None = None
) -> KvCacheGeometry:
    """Find the buffers behind ``kv_caches`` and each layer's place in them.

    ``num_blocks`` (vLLM's ``kv_cache_config.num_blocks``) tells the block dimension apart; when
    not given, a 5-d ``[2, num_blocks, ...]`` tensor is taken as K/V-first, anything else as
    blocks-first.
    """
    if not kv_caches:
        raise UnsupportedLayoutError("vLLM registered no KV cache tensors")
    names = tuple(kv_caches)
    tensors = [kv_caches[n] for n in names]
    if any(t.device.type != "cpu" for t in tensors):
        raise UnsupportedLayoutError("only host-memory (CPU) KV caches are supported")
    first = tensors[0]
    # num_blocks: dim 0, unless the layer is [2, num_blocks, ...].
    if num_blocks is None:
        kv_first = first.dim() == 5 and first.shape[0] == 2
        num_blocks = int(first.shape[1] if kv_first else first.shape[0])
    segments, kind = _block_segments(first, num_blocks)
    buffers: list[Buffer] = []
    by_base: dict[int, int] = {}
    offsets: list[int] = []
    index: list[int] = []
    for name, tensor in zip(names, tensors, strict=True):
        seg, _ = _block_segments(tensor, num_blocks)
        if seg != segments:
            raise UnsupportedLayoutError(f"layer {name} has a different block geometry")
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        if base not in by_base:
            by_base[base] = len(buffers)
            buffers.append(Buffer(base, storage.nbytes()))
        index.append(by_base[base])
        offsets.append(tensor.data_ptr() - base)
    return KvCacheGeometry(
        buffers=tuple(buffers),
        layer_names=names,
        layer_offsets=tuple(offsets),
        buffer_index=tuple(index),
        num_blocks=num_blocks,
        block_size=block_size,
        segments=segments,
        kind=kind,
    )


def layout_from_spec(spec: LayoutSpec) -> PagedKVLayout:
    """The ipcblock layout of a (possibly remote) LayoutSpec; PeerError if it is malformed."""
    try:
        return PagedKVLayout.from_segments(
            np.asarray(spec.layer_offsets, dtype=np.int64),
            spec.num_blocks,
            [Segment(s.name, s.offset, s.block_stride, s.nbytes) for s in spec.segments],
            kind=spec.kind,
        )
    except Exception as err:
        raise PeerError(f"invalid KV layout from peer: {err}") from err
