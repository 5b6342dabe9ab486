"""Typed errors of ipcblock: all are caller errors (bad arguments), hence ValueError."""

from __future__ import annotations


class IpcBlockError(ValueError):
    """Base class: the caller passed something ipcblock cannot turn into IpcBlocks."""


class InvalidLayoutError(IpcBlockError):
    """A layout's geometry is inconsistent (non-positive sizes, blocks that overlap, ...)."""


class LayoutMismatchError(IpcBlockError):
    """Source and destination layouts differ in bytes per block (other model or format)."""


class HeadRangeError(LayoutMismatchError):
    """The requested global KV heads are not all held by the layout (or it has no head axis)."""


class BlockSizeRatioError(LayoutMismatchError):
    """Source and destination block sizes are not integer multiples of each other."""


class NotTokenMajorError(LayoutMismatchError):
    """A segment cannot be split by tokens: its token axis is not outermost (or it has none)."""


class LengthMismatchError(IpcBlockError):
    """Source and destination block id lists have different lengths."""


class TokenRangeError(LengthMismatchError):
    """The block id lists do not cover the requested token range (too few, or D's too many)."""


class BlockIdOutOfRangeError(IpcBlockError):
    """A block id is negative or not below the layout's ``num_blocks``."""


class LayerOutOfRangeError(IpcBlockError):
    """A layer index is negative or not below the layout's ``num_layers``."""


class DuplicateDestinationError(IpcBlockError):
    """The same destination block appears twice: two sources would race for the same bytes."""


class RegionIdError(IpcBlockError):
    """A region id does not fit u16, or a per-layer region list has the wrong length."""


class RecordBufferError(IpcBlockError):
    """A byte buffer's size is not a whole number of 30-byte records."""
