"""The 30-byte IpcBlock descriptor and ParseBlock KV layouts.

The IpcBlock ("these source bytes go to those destination bytes") is the only thing that crosses
from the layout-aware layers to the data plane. See README.md for the byte layout.
"""

from ipcblock.errors import (
    BlockIdOutOfRangeError,
    DuplicateDestinationError,
    InvalidLayoutError,
    IpcBlockError,
    LayerOutOfRangeError,
    LayoutMismatchError,
    LengthMismatchError,
    RecordBufferError,
    RegionIdError,
)
from ipcblock.layouts import PagedKVLayout, Segment, stacked_layer_offsets
from ipcblock.parse import parse_blocks
from ipcblock.record import (
    IPCBLOCK_DTYPE,
    IPCBLOCK_SIZE,
    blocks_from_bytes,
    blocks_to_bytes,
    empty_blocks,
    make_blocks,
    merge_runs,
    total_bytes,
)

__version__ = "0.1.0"

__all__ = [
    "IPCBLOCK_DTYPE",
    "IPCBLOCK_SIZE",
    "BlockIdOutOfRangeError",
    "DuplicateDestinationError",
    "InvalidLayoutError",
    "IpcBlockError",
    "LayerOutOfRangeError",
    "LayoutMismatchError",
    "LengthMismatchError",
    "PagedKVLayout",
    "RecordBufferError",
    "RegionIdError",
    "Segment",
    "__version__",
    "blocks_from_bytes",
    "blocks_to_bytes",
    "empty_blocks",
    "make_blocks",
    "merge_runs",
    "parse_blocks",
    "stacked_layer_offsets",
    "total_bytes",
]
