"""The 30-byte IpcBlock descriptor and ParseBlock KV layouts.

The IpcBlock ("these source bytes go to those destination bytes") is the only thing that crosses
from the layout-aware layers to the data plane. See README.md for the byte layout.
"""

from ipcblock.errors import (
    BlockIdOutOfRangeError,
    BlockSizeRatioError,
    DuplicateDestinationError,
    HeadRangeError,
    InvalidLayoutError,
    IpcBlockError,
    LayerOutOfRangeError,
    LayoutMismatchError,
    LengthMismatchError,
    NotTokenMajorError,
    RecordBufferError,
    RegionIdError,
    TokenRangeError,
)
from ipcblock.layouts import (
    CPU_ISAS,
    CompositeLayout,
    Dim,
    PagedKVLayout,
    Segment,
    head_name,
    pair_pieces,
    stacked_layer_offsets,
)
from ipcblock.parse import parse_blocks, parse_blocks_resized
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
    "CPU_ISAS",
    "IPCBLOCK_DTYPE",
    "IPCBLOCK_SIZE",
    "BlockIdOutOfRangeError",
    "BlockSizeRatioError",
    "CompositeLayout",
    "Dim",
    "DuplicateDestinationError",
    "HeadRangeError",
    "InvalidLayoutError",
    "IpcBlockError",
    "LayerOutOfRangeError",
    "LayoutMismatchError",
    "LengthMismatchError",
    "NotTokenMajorError",
    "PagedKVLayout",
    "RecordBufferError",
    "RegionIdError",
    "Segment",
    "TokenRangeError",
    "__version__",
    "blocks_from_bytes",
    "blocks_to_bytes",
    "empty_blocks",
    "head_name",
    "make_blocks",
    "merge_runs",
    "pair_pieces",
    "parse_blocks",
    "parse_blocks_resized",
    "stacked_layer_offsets",
    "total_bytes",
]
