"""ParseBlock: (source blocks, destination blocks, layers) -> merged IpcBlock array, vectorised."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ipcblock.errors import (
    BlockIdOutOfRangeError,
    BlockSizeRatioError,
    DuplicateDestinationError,
    LayerOutOfRangeError,
    LayoutMismatchError,
    LengthMismatchError,
    NotTokenMajorError,
    RegionIdError,
    TokenRangeError,
)
from ipcblock.layouts import TOKEN, CompositeLayout, PagedKVLayout, pair_pieces
from ipcblock.record import IPCBLOCK_DTYPE, IPCBLOCK_SIZE

RegionSpec = int | Sequence[int] | np.ndarray
Layout = PagedKVLayout | CompositeLayout


def parse_blocks(  # noqa: PLR0917 - contract: (src, dst, src_ids, dst_ids, layers, regions)
    src_layout: Layout,
    dst_layout: Layout,
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
    A :class:`CompositeLayout` (parts in different tensors sharing the block ids) takes region
    ids per part: one int for every part, or a sequence with one region spec per part.
    Raises a subclass of :class:`ipcblock.IpcBlockError` on any inconsistent input.
    """
    if isinstance(src_layout, CompositeLayout) or isinstance(dst_layout, CompositeLayout):
        return _parse_parts(
            parse_blocks, src_layout, dst_layout, src_block_ids, dst_block_ids, layers,
            src_region, dst_region, merge=merge,
        )  # fmt: skip
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
    _unique(dst_ids, dst_layout.num_blocks)
    layer_idx = _layers(layers, src_layout, dst_layout)
    src_regions = _regions(src_region, src_layout, layer_idx, "source")
    dst_regions = _regions(dst_region, dst_layout, layer_idx, "destination")
    pairs = [
        pair_pieces(s, d) for s, d in zip(src_layout.segments, dst_layout.segments, strict=True)
    ]
    if layer_idx.size == 0 or src_ids.size == 0:
        return np.empty(0, dtype=IPCBLOCK_DTYPE)

    rel_src, rel_dst, length = [], [], []
    for (s_stride, d_stride), (s_in, d_in, pieces) in _block_pieces(
        src_layout, dst_layout, pairs, merge
    ).items():
        s_base, d_base = src_ids * s_stride, dst_ids * d_stride
        if s_in.size == 1:
            rel_src.append(s_base + s_in[0])
            rel_dst.append(d_base + d_in[0])
            length.append(np.full(s_base.size, pieces[0], dtype=np.int64))
        else:
            rel_src.append((s_base[:, None] + s_in[None, :]).ravel())
            rel_dst.append((d_base[:, None] + d_in[None, :]).ravel())
            length.append(np.tile(pieces, s_base.size))
    return _stamp_layers(
        rel_src, rel_dst, length, src_layout, dst_layout, layer_idx, src_regions, dst_regions, merge
    )


def _block_pieces(
    src_layout: PagedKVLayout, dst_layout: PagedKVLayout, pairs: list, merge: bool
) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The pieces of one block, fused across segments that move with the same block strides.

    Keyed by (source, destination) block stride: the (source offsets, destination offsets,
    lengths) inside a block, sorted by source, pieces that continue each other on both sides
    merged (unless not ``merge``). vLLM's CPU block is K and V pieces of every head interleaved:
    together one contiguous piece per block (or head range), so a block stays one record before
    the per-layer sort.
    """
    groups: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for s_seg, d_seg, (s_in, d_in, piece) in zip(
        src_layout.segments, dst_layout.segments, pairs, strict=True
    ):
        groups.setdefault((s_seg.block_stride, d_seg.block_stride), []).append(
            (s_seg.offset + s_in, d_seg.offset + d_in, np.full(s_in.size, piece, np.int64))
        )
    out = {}
    for key, parts in groups.items():
        s_in, d_in, size = (np.concatenate(col) for col in zip(*parts, strict=True))
        if merge and s_in.size > 1:
            order = np.argsort(s_in, kind="stable")
            s_in, d_in, size = s_in[order], d_in[order], size[order]
            continues = (s_in[1:] == s_in[:-1] + size[:-1]) & (d_in[1:] == d_in[:-1] + size[:-1])
            if continues.any():
                starts = np.flatnonzero(np.concatenate(([True], ~continues)))
                s_in, d_in, size = s_in[starts], d_in[starts], np.add.reduceat(size, starts)
        out[key] = (s_in, d_in, size)
    return out


def parse_blocks_resized(  # noqa: PLR0917 - same positional contract as parse_blocks
    src_layout: PagedKVLayout,
    dst_layout: PagedKVLayout,
    src_block_ids: Sequence[int] | np.ndarray,
    dst_block_ids: Sequence[int] | np.ndarray,
    layers: Sequence[int] | np.ndarray | None = None,
    src_region: RegionSpec = 0,
    dst_region: RegionSpec = 0,
    *,
    num_tokens: int | None = None,
    src_first_block: int = 0,
    dst_first_block: int = 0,
    merge: bool = True,
) -> np.ndarray:
    """IpcBlocks copying a token range between caches of different block sizes (any integer ratio).

    Block sizes are the layouts' ``block_size``. ``src_block_ids[i]`` holds the request's block
    ``src_first_block + i`` (tokens ``[(src_first_block + i) * src_bs, ...)``), likewise
    ``dst_block_ids[j]`` with ``dst_first_block``. The tokens copied are
    ``[dst_first_block * dst_bs, num_tokens)`` (default: to the end of the last destination block).
    The destination ids must be exactly the blocks of that range; source ids must cover it (extra
    ones are ignored).

    The unit of copy is a sub-block of ``g = min(src_bs, dst_bs)`` tokens: the finer side's whole
    block, a ``1/ratio`` token slice of the coarser side's. When the range ends inside a sub-block,
    that whole sub-block is copied: it lies inside the last destination block, so no byte outside
    D's given blocks is written (the tokens past ``num_tokens`` are garbage D never reads).

    Every segment must be token-major (:meth:`PagedKVLayout.token_major` splits the CPU layout per
    head first). Errors: :class:`BlockSizeRatioError`, :class:`NotTokenMajorError`,
    :class:`TokenRangeError`, :class:`LayoutMismatchError` (names or bytes per token differ), plus
    those of :func:`parse_blocks`.
    """
    if isinstance(src_layout, CompositeLayout) or isinstance(dst_layout, CompositeLayout):
        return _parse_parts(
            parse_blocks_resized, src_layout, dst_layout, src_block_ids, dst_block_ids, layers,
            src_region, dst_region, num_tokens=num_tokens, src_first_block=src_first_block,
            dst_first_block=dst_first_block, merge=merge,
        )  # fmt: skip
    s_bs, d_bs = src_layout.block_size, dst_layout.block_size
    for layout in (src_layout, dst_layout):
        bad = [s.name for s in layout.segments if not s.token_major]
        if bad or not layout.block_size:
            raise NotTokenMajorError(
                f"{layout.kind} segments {bad} are not token-major: call token_major() first"
            )
    if max(s_bs, d_bs) % min(s_bs, d_bs):
        raise BlockSizeRatioError(f"block sizes {s_bs} and {d_bs} are not integer multiples")
    per_token_src = [(s.name, s.nbytes // s_bs) for s in src_layout.segments]
    per_token_dst = [(s.name, s.nbytes // d_bs) for s in dst_layout.segments]
    if per_token_src != per_token_dst:
        raise LayoutMismatchError(
            f"source segments (name, bytes/token) {per_token_src} != destination {per_token_dst}"
        )
    src_ids = _block_ids(src_block_ids, src_layout, "source")
    dst_ids = _block_ids(dst_block_ids, dst_layout, "destination")
    _unique(dst_ids, dst_layout.num_blocks)
    start = int(dst_first_block) * d_bs
    end = start + dst_ids.size * d_bs if num_tokens is None else int(num_tokens)
    if src_first_block < 0 or dst_first_block < 0 or end < start:
        raise TokenRangeError(f"token range [{start}, {end}) or first blocks are negative")
    if -(-(end - start) // d_bs) != dst_ids.size:
        raise TokenRangeError(
            f"tokens [{start}, {end}) need {-(-(end - start) // d_bs)} destination blocks of "
            f"{d_bs}, got {dst_ids.size}"
        )
    src_span = (src_first_block * s_bs, (src_first_block + src_ids.size) * s_bs)
    if end > start and (src_span[0] > start or src_span[1] < end):
        raise TokenRangeError(f"source blocks hold tokens {src_span}, need [{start}, {end})")
    layer_idx = _layers(layers, src_layout, dst_layout)
    src_regions = _regions(src_region, src_layout, layer_idx, "source")
    dst_regions = _regions(dst_region, dst_layout, layer_idx, "destination")
    g = min(s_bs, d_bs)
    units = []  # per segment: tokens per token index (tiled kernels pack several)
    for s, d in zip(src_layout.segments, dst_layout.segments, strict=True):
        unit = s.token_unit(s_bs)
        if unit != d.token_unit(d_bs) or g % unit:
            raise LayoutMismatchError(
                f"segment {s.name!r}: tokens packed {unit} and {d.token_unit(d_bs)} per index; "
                f"copy units of {g} tokens must hold whole ones"
            )
        units.append(unit)
    narrowed = [
        (s.narrow(TOKEN, 0, g // u), d.narrow(TOKEN, 0, g // u))
        for s, d, u in zip(src_layout.segments, dst_layout.segments, units, strict=True)
    ]
    pairs = [pair_pieces(s, d) for s, d in narrowed]
    if layer_idx.size == 0 or end == start:
        return np.empty(0, dtype=IPCBLOCK_DTYPE)

    tokens = start + np.arange(-(-(end - start) // g), dtype=np.int64) * g
    s_blocks = src_ids[tokens // s_bs - src_first_block]
    d_blocks = dst_ids[tokens // d_bs - dst_first_block]
    s_sub, d_sub = (tokens % s_bs) // g, (tokens % d_bs) // g
    rel_src, rel_dst, length = [], [], []
    for s_seg, d_seg, (s_in, d_in, piece), unit in zip(
        src_layout.segments, dst_layout.segments, pairs, units, strict=True
    ):
        s_tok = s_seg.dims[s_seg.dim(TOKEN)].stride * (g // unit)
        d_tok = d_seg.dims[d_seg.dim(TOKEN)].stride * (g // unit)
        s_base = s_seg.offset + s_blocks * s_seg.block_stride + s_sub * s_tok
        d_base = d_seg.offset + d_blocks * d_seg.block_stride + d_sub * d_tok
        _append(rel_src, rel_dst, length, s_base, d_base, s_in, d_in, piece)
    return _stamp_layers(
        rel_src, rel_dst, length, src_layout, dst_layout, layer_idx, src_regions, dst_regions, merge
    )


def _parse_parts(  # noqa: PLR0917
    parse, src: Layout, dst: Layout, src_ids, dst_ids, layers, src_region, dst_region, **kwargs
) -> np.ndarray:
    """Parse a composite part by part and interleave the records layer by layer."""
    if not (isinstance(src, CompositeLayout) and isinstance(dst, CompositeLayout)):
        raise LayoutMismatchError(f"composite vs single layout: {src.kind} != {dst.kind}")
    names = [n for n, _ in src.parts]
    if names != [n for n, _ in dst.parts]:
        raise LayoutMismatchError(f"composite parts {names} != {[n for n, _ in dst.parts]}")
    s_regions = _part_regions(src_region, len(names), "source")
    d_regions = _part_regions(dst_region, len(names), "destination")
    outs = [
        parse(s, d, src_ids, dst_ids, layers, sr, dr, **kwargs)
        for (_, s), (_, d), sr, dr in zip(src.parts, dst.parts, s_regions, d_regions, strict=True)
    ]
    n_layers = _layers(layers, src.parts[0][1], dst.parts[0][1]).size
    if n_layers == 0 or not any(o.size for o in outs):
        return np.empty(0, dtype=IPCBLOCK_DTYPE)
    # Each part's output is n_layers equal runs: put layer l of every part together.
    return np.concatenate([o.reshape(n_layers, -1) for o in outs], axis=1).reshape(-1)


def _part_regions(region, n_parts: int, side: str) -> list:
    if np.ndim(region) == 0:
        return [region] * n_parts
    if isinstance(region, (list, tuple)) and len(region) == n_parts:
        return list(region)
    raise RegionIdError(f"{side}: a composite takes one int or one region spec per part")


def _append(rel_src, rel_dst, length, s_base, d_base, s_in, d_in, piece) -> None:  # noqa: PLR0917
    """One segment's records: (units x pieces) offsets relative to the layer base."""
    if s_in.size == 1:
        rel_src.append(s_base + s_in[0])
        rel_dst.append(d_base + d_in[0])
    else:
        rel_src.append((s_base[:, None] + s_in[None, :]).ravel())
        rel_dst.append((d_base[:, None] + d_in[None, :]).ravel())
    length.append(np.full(rel_src[-1].size, piece, dtype=np.int64))


def _stamp_layers(  # noqa: PLR0917
    rel_src: list[np.ndarray],
    rel_dst: list[np.ndarray],
    length: list[np.ndarray],
    src_layout: PagedKVLayout,
    dst_layout: PagedKVLayout,
    layer_idx: np.ndarray,
    src_regions: np.ndarray,
    dst_regions: np.ndarray,
    merge: bool,
) -> np.ndarray:
    """Sort and merge one layer's records, then stamp them out for every layer.

    Every layer has the same records shifted by its (source, destination) base offsets, and a
    shift changes neither the order nor which neighbours continue each other. So sorting and
    merging happen once, on one layer, and the layers are stamped out by broadcasting.
    """
    src = np.concatenate(rel_src) if len(rel_src) > 1 else rel_src[0]
    dst = np.concatenate(rel_dst) if len(rel_dst) > 1 else rel_dst[0]
    size = np.concatenate(length) if len(length) > 1 else length[0]
    if src.size > 1 and not (src[1:] > src[:-1]).all():
        order = np.argsort(src)  # runs contiguous in source become neighbours
        src, dst, size = src[order], dst[order], size[order]
    if merge and src.size > 1:
        continues = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
        if continues.any():
            starts = np.flatnonzero(np.concatenate(([True], ~continues)))
            src, dst, size = src[starts], dst[starts], np.add.reduceat(size, starts)

    s_base = src_layout.layer_offsets[layer_idx]
    d_base = dst_layout.layer_offsets[layer_idx]
    if layer_idx.size * src.size >= _WIDE_WRITE_MIN:
        return _write_wide(s_base, d_base, src, dst, size, layer_idx, src_regions, dst_regions)
    n_layers, per_layer = layer_idx.size, src.size
    out = np.empty(n_layers * per_layer, dtype=IPCBLOCK_DTYPE)
    out["src_offset"] = (s_base[:, None] + src[None, :]).ravel()
    out["dst_offset"] = (d_base[:, None] + dst[None, :]).ravel()
    out["length"] = np.tile(size, n_layers)
    out["src_region"] = np.repeat(src_regions, per_layer)
    out["dst_region"] = np.repeat(dst_regions, per_layer)
    out["tag"] = np.repeat(layer_idx, per_layer)
    return out


# Above this many records, _write_wide's two 16-byte passes beat six per-field strided writes.
_WIDE_WRITE_MIN = 4096
# Records built per chunk: the scratch words stay in cache between building and copying.
_CHUNK_RECORDS = 65536
_U16 = np.uint64(16)


def _write_wide(  # noqa: PLR0917
    s_base: np.ndarray,
    d_base: np.ndarray,
    rel_src: np.ndarray,
    rel_dst: np.ndarray,
    size: np.ndarray,
    layer_idx: np.ndarray,
    src_regions: np.ndarray,
    dst_regions: np.ndarray,
) -> np.ndarray:
    """The records of every layer, written as two strided passes of 16-byte words.

    Writing the six packed fields one by one costs six strided passes over the output (the
    bottleneck for ~500k records). Instead: bytes 4..19 of record i (src_offset, dst_offset) are
    one 16-byte word, and bytes 20..35 (length, tag, then record i+1's two region ids and two
    bytes the second pass overwrites) are another. Both are built in small aligned uint64 scratch
    arrays, a chunk of layers at a time so they stay in cache, and copied as complex128 (a
    bitwise copy; no arithmetic touches the values). The buffer has 6 spare bytes for the last
    record's spill-over; the result is a view of it.
    """
    n_layers, per_layer = layer_idx.size, rel_src.size
    n = n_layers * per_layer
    header = src_regions.astype(np.uint64) | (dst_regions.astype(np.uint64) << _U16)
    tag = layer_idx.astype(np.uint64)
    tag_word = tag | (header << _U16)  # the next record is in the same layer ...
    last_word = tag | (np.append(header[1:], np.uint64(0)) << _U16)  # ... except after the last
    rel_src, rel_dst = rel_src.astype(np.uint64), rel_dst.astype(np.uint64)
    s_base, d_base = s_base.astype(np.uint64), d_base.astype(np.uint64)

    buf = np.empty(n * IPCBLOCK_SIZE + 6, np.uint8)
    buf[:4].view(np.uint16)[:] = (src_regions[0], dst_regions[0])
    step = max(1, _CHUNK_RECORDS // per_layer)
    pair = np.empty((min(step, n_layers), per_layer, 2), np.uint64)
    tail = np.empty_like(pair)
    tail[:, :, 0] = size[None, :]
    for first in range(0, n_layers, step):
        stop = min(first + step, n_layers)
        k, m = stop - first, (stop - first) * per_layer
        np.add(s_base[first:stop, None], rel_src[None, :], out=pair[:k, :, 0])
        np.add(d_base[first:stop, None], rel_dst[None, :], out=pair[:k, :, 1])
        tail[:k, :, 1] = tag_word[first:stop, None]
        tail[:k, -1, 1] = last_word[first:stop]
        at = first * per_layer * IPCBLOCK_SIZE
        for offset, words in ((at + 20, tail), (at + 4, pair)):
            view = np.ndarray((m,), np.complex128, buf, offset, (IPCBLOCK_SIZE,))
            view[...] = words[:k].reshape(m, 2).view(np.complex128)[:, 0]
    return buf[: n * IPCBLOCK_SIZE].view(IPCBLOCK_DTYPE)


def _unique(dst_ids: np.ndarray, num_blocks: int) -> None:
    """DuplicateDestinationError if an id repeats (ids are already range-checked)."""
    if dst_ids.size < 2 or (dst_ids[1:] > dst_ids[:-1]).all():  # ascending: nothing to sort
        return
    if num_blocks <= 16 * dst_ids.size:  # a count per block is cheaper than a sort
        repeated = bool((np.bincount(dst_ids, minlength=num_blocks) > 1).any())
    else:
        ordered = np.sort(dst_ids)
        repeated = bool((ordered[1:] == ordered[:-1]).any())
    if repeated:
        raise DuplicateDestinationError("destination block ids contain duplicates")


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
