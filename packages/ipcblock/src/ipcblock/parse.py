"""ParseBlock: (source blocks, destination blocks, layers) -> merged IpcBlock array, vectorised."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ipcblock.errors import (
    BlockIdOutOfRangeError,
    DuplicateDestinationError,
    LayerOutOfRangeError,
    LayoutMismatchError,
    LengthMismatchError,
    RegionIdError,
)
from ipcblock.layouts import PagedKVLayout
from ipcblock.record import IPCBLOCK_DTYPE

RegionSpec = int | Sequence[int] | np.ndarray


def parse_blocks(  # noqa: PLR0917 - contract: (src, dst, src_ids, dst_ids, layers, regions)
    src_layout: PagedKVLayout,
    dst_layout: PagedKVLayout,
    src_block_ids: Sequence[int] | np.ndarray,
    dst_block_ids: Sequence[int] | np.ndarray,
    layers: Sequence[int] | np.ndarray | None = None,
    src_region: RegionSpec = 0,
    dst_region: RegionSpec = 0,
    *,
    merge: bool = True,
) -> np.ndarray:
    """IpcBlocks that copy ``src_block_ids[i]`` to ``dst_block_ids[i]`` for every given layer.

    ``layers`` defaults to every layer. ``src_region``/``dst_region`` are region ids: one int for
    all layers (layers are views of one registered buffer) or one id per layer of the layout
    (each layer registered on its own, typical on GPU). Each record's ``tag`` is its layer index.

    Output order: by layer (in the order given), and inside a layer by source offset, so that runs
    which are contiguous on both sides become neighbours and ``merge`` fuses them into one record
    (records never straddle layers).
    Raises a subclass of :class:`ipcblock.IpcBlockError` on any inconsistent input.
    """
    if src_layout.signature != dst_layout.signature:
        raise LayoutMismatchError(
            f"source {src_layout.kind} segments {src_layout.signature} != "
            f"destination {dst_layout.kind} segments {dst_layout.signature}"
        )
    src_ids = _block_ids(src_block_ids, src_layout, "source")
    dst_ids = _block_ids(dst_block_ids, dst_layout, "destination")
    if src_ids.size != dst_ids.size:
        raise LengthMismatchError(
            f"{src_ids.size} source block ids but {dst_ids.size} destination block ids"
        )
    if dst_ids.size > 1 and np.unique(dst_ids).size != dst_ids.size:
        raise DuplicateDestinationError("destination block ids contain duplicates")
    layer_idx = _layers(layers, src_layout, dst_layout)
    src_regions = _regions(src_region, src_layout, layer_idx, "source")
    dst_regions = _regions(dst_region, dst_layout, layer_idx, "destination")

    n_layers, n_blocks = layer_idx.size, src_ids.size
    if n_layers == 0 or n_blocks == 0:
        return np.empty(0, dtype=IPCBLOCK_DTYPE)

    s_off, s_stride, nbytes = src_layout.segment_arrays()
    d_off, d_stride, _ = dst_layout.segment_arrays()
    # One layer's records, relative to the layer bases, segment-major: shape (segments * blocks,).
    # Every layer has the same records shifted by its (source, destination) base offsets, and a
    # shift changes neither the order nor which neighbours continue each other. So sorting and
    # merging happen once, on one layer, and the layers are stamped out by broadcasting.
    rel_src = (s_off[:, None] + src_ids[None, :] * s_stride[:, None]).ravel()
    rel_dst = (d_off[:, None] + dst_ids[None, :] * d_stride[:, None]).ravel()
    length = np.repeat(nbytes, n_blocks)
    if rel_src.size > 1 and not (rel_src[1:] > rel_src[:-1]).all():
        order = np.argsort(rel_src, kind="stable")  # runs contiguous in source become neighbours
        rel_src, rel_dst, length = rel_src[order], rel_dst[order], length[order]
    if merge and rel_src.size > 1:
        continues = (rel_src[1:] == rel_src[:-1] + length[:-1]) & (
            rel_dst[1:] == rel_dst[:-1] + length[:-1]
        )
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        rel_src, rel_dst, length = rel_src[starts], rel_dst[starts], np.add.reduceat(length, starts)

    per_layer = rel_src.size
    out = np.empty(n_layers * per_layer, dtype=IPCBLOCK_DTYPE)
    out["src_offset"] = (src_layout.layer_offsets[layer_idx][:, None] + rel_src[None, :]).ravel()
    out["dst_offset"] = (dst_layout.layer_offsets[layer_idx][:, None] + rel_dst[None, :]).ravel()
    out["length"] = np.tile(length, n_layers)
    out["src_region"] = np.repeat(src_regions, per_layer)
    out["dst_region"] = np.repeat(dst_regions, per_layer)
    out["tag"] = np.repeat(layer_idx, per_layer)
    return out


def _block_ids(ids: Sequence[int] | np.ndarray, layout: PagedKVLayout, side: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise BlockIdOutOfRangeError(f"{side} block ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= layout.num_blocks:
        bad = lo if lo < 0 else hi
        raise BlockIdOutOfRangeError(f"{side} block id {bad} out of range [0, {layout.num_blocks})")
    return arr


def _layers(
    layers: Sequence[int] | np.ndarray | None, src: PagedKVLayout, dst: PagedKVLayout
) -> np.ndarray:
    limit = min(src.num_layers, dst.num_layers)
    if layers is None:
        if src.num_layers != dst.num_layers:
            raise LayerOutOfRangeError(
                f"source has {src.num_layers} layers, destination {dst.num_layers}: pass layers="
            )
        return np.arange(limit, dtype=np.int64)
    arr = np.asarray(layers).reshape(-1)
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise LayerOutOfRangeError(f"layers must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if int(arr.min()) < 0 or int(arr.max()) >= limit:
        raise LayerOutOfRangeError(f"layers {arr.tolist()} out of range [0, {limit})")
    if np.unique(arr).size != arr.size:
        raise LayerOutOfRangeError(f"layers {arr.tolist()} contain duplicates")
    return arr


def _regions(
    region: RegionSpec, layout: PagedKVLayout, layer_idx: np.ndarray, side: str
) -> np.ndarray:
    arr = np.asarray(region)
    if arr.ndim == 0:
        arr = np.full(layer_idx.size, int(arr), dtype=np.int64)
    else:
        arr = arr.reshape(-1).astype(np.int64)
        if arr.size != layout.num_layers:
            raise RegionIdError(
                f"{side}: {arr.size} region ids given for a layout of {layout.num_layers} layers"
            )
        arr = arr[layer_idx]
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFF):
        raise RegionIdError(f"{side} region ids must fit in u16, got {arr.tolist()}")
    return arr
