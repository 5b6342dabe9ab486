"""The 30-byte IpcBlock record: "these source bytes go to those destination bytes".

Byte layout (packed, little-endian, no padding)::

    offset  size  field        meaning
    0       2     src_region   u16  region id on the sending side (its registration table)
    2       2     dst_region   u16  region id on the receiving side
    4       8     src_offset   u64  byte offset inside the source region
    12      8     dst_offset   u64  byte offset inside the destination region
    20      8     length       u64  number of bytes
    28      2     tag          u16  opaque to the data plane (ParseBlock puts the layer index here)

Arrays of records are plain numpy structured arrays, so a batch goes to bytes and back without a
copy (``arr.data`` / ``np.frombuffer``) and every column is a strided view usable in vector math.
"""

from __future__ import annotations

import numpy as np

from ipcblock.errors import RecordBufferError

IPCBLOCK_DTYPE = np.dtype(
    [
        ("src_region", "<u2"),
        ("dst_region", "<u2"),
        ("src_offset", "<u8"),
        ("dst_offset", "<u8"),
        ("length", "<u8"),
        ("tag", "<u2"),
    ],
    align=False,
)
IPCBLOCK_SIZE = 30
assert IPCBLOCK_DTYPE.itemsize == IPCBLOCK_SIZE, IPCBLOCK_DTYPE.itemsize

_CONTIGUITY_KEYS = ("src_region", "dst_region", "tag")


def empty_blocks(n: int = 0) -> np.ndarray:
    """An uninitialised array of ``n`` IpcBlocks."""
    return np.empty(n, dtype=IPCBLOCK_DTYPE)


def make_blocks(
    src_offset: np.ndarray | list[int] | int,
    dst_offset: np.ndarray | list[int] | int,
    length: np.ndarray | list[int] | int,
    *,
    src_region: np.ndarray | int = 0,
    dst_region: np.ndarray | int = 0,
    tag: np.ndarray | int = 0,
) -> np.ndarray:
    """Build an IpcBlock array from columns (scalars broadcast)."""
    columns = np.broadcast_arrays(
        np.asarray(src_offset), np.asarray(dst_offset), np.asarray(length)
    )
    out = np.empty(columns[0].size, dtype=IPCBLOCK_DTYPE)
    out["src_offset"] = columns[0].ravel()
    out["dst_offset"] = columns[1].ravel()
    out["length"] = columns[2].ravel()
    out["src_region"] = src_region
    out["dst_region"] = dst_region
    out["tag"] = tag
    return out


def blocks_to_bytes(blocks: np.ndarray) -> memoryview:
    """A zero-copy byte view of a contiguous IpcBlock array (``len == 30 * blocks.size``)."""
    if blocks.dtype != IPCBLOCK_DTYPE:
        raise RecordBufferError(f"expected IPCBLOCK_DTYPE, got {blocks.dtype}")
    return memoryview(np.ascontiguousarray(blocks)).cast("B")


def blocks_from_bytes(buffer: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A zero-copy IpcBlock array over ``buffer`` (read-only if the buffer is)."""
    nbytes = memoryview(buffer).nbytes
    if nbytes % IPCBLOCK_SIZE:
        raise RecordBufferError(
            f"{nbytes} bytes is not a whole number of {IPCBLOCK_SIZE}-byte IpcBlock records"
        )
    return np.frombuffer(buffer, dtype=IPCBLOCK_DTYPE)


def merge_runs(blocks: np.ndarray) -> np.ndarray:
    """Merge neighbouring records that continue each other in both source and destination.

    Record ``i+1`` joins record ``i`` when regions and tag are equal and both its source and its
    destination offsets start where record ``i`` ends. Order is kept; only neighbours are merged
    (sort first to find runs regardless of order). Vectorised: O(n), no Python loop.
    """
    n = blocks.size
    if n <= 1:
        return blocks.copy()
    length = blocks["length"]
    continues = (blocks["src_offset"][1:] == blocks["src_offset"][:-1] + length[:-1]) & (
        blocks["dst_offset"][1:] == blocks["dst_offset"][:-1] + length[:-1]
    )
    for key in _CONTIGUITY_KEYS:
        continues &= blocks[key][1:] == blocks[key][:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    merged = blocks[starts]
    merged["length"] = np.add.reduceat(length, starts)
    return merged


def total_bytes(blocks: np.ndarray) -> int:
    """Sum of the records' lengths."""
    return int(blocks["length"].sum(dtype=np.uint64))
