"""What the pool itself says about its objects, so that clients can get and put without the master.

Two structures live in shared memory next to the payloads:

- the **control page** (the pool's first 4 KiB, reserved by the master at start): a magic and a
  flags word. ``FLAG_MASTER_PATH`` is set while a fault plan is active, and makes every client
  take the master path for every operation, so that injected faults apply to all of them.
- an **object header** at the start of every object's block, written by the client that puts it,
  after its payload::

      magic "RSo1" | state u32 | oid u64 | tag u64 | header_len u32 | layout_len u32
      | nbytes u64 | last_access_ns u64 | (pad to 64) | layout (msgpack) | (pad to 64) | payload

  ``state`` is SEALED once the client has written the payload and then the header, and FREED
  (master) before the block returns to the allocator.
  ``tag`` mixes the oid with the pool's epoch, so a stale header or payload bytes that happen
  to sit where a ref points are not taken for the object.
  ``last_access_ns`` (CLOCK_MONOTONIC, the same clock in every process) is written by gets that
  never reach the master; eviction reads it to give recently read objects a second chance.

A get checks the header (magic, state, oid, tag) and builds its views from the layout in the
header: about 5 µs, no round trip. Anything else (freed, unknown, still being written, another
epoch) falls back to the master, which says why with a typed error or waits for the seal.

Ordering: the header (state SEALED) and the layout are written by one ``pack_into`` after the
payload is in place. No reader can race that write: a reader needs the object's ref (its oid and
tag), and it gets the ref only after ``put`` returned. A reader that validated a header and then
sees the object freed is the same case as any view outliving its object: views are valid while
the object lives.
"""

from __future__ import annotations

import struct

import msgspec

from .protocol import Layout

CONTROL_BYTES = 4096
CONTROL = struct.Struct("<4sI")
CONTROL_MAGIC = b"RSp1"
FLAG_MASTER_PATH = 1

HEADER = struct.Struct("<4sIQQIIQQ")
MAGIC = b"RSo1"
HEADER_FIXED = 64
ALIGN = 64
STATE_SEALED = 1
STATE_FREED = 2
STATE_OFFSET = 4
LAST_ACCESS_OFFSET = 40
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1

_encode_layout = msgspec.msgpack.Encoder().encode
_decode_layout = msgspec.msgpack.Decoder(Layout).decode


def epoch_key(epoch: str) -> int:
    """The pool epoch (16 hex digits) as the 64-bit key mixed into every tag."""
    try:
        return int(epoch[:16], 16) & _MASK64
    except ValueError:
        return hash(epoch) & _MASK64


def tag(oid: int, key: int) -> int:
    return ((oid * 0x9E3779B97F4A7C15) ^ key) & _MASK64


def header_len(layout_bytes: bytes) -> int:
    return -(-(HEADER_FIXED + len(layout_bytes)) // ALIGN) * ALIGN


def encode_layout(layout: Layout) -> bytes:
    return _encode_layout(layout)


class Writer:
    """Writes the sealed headers of objects with one layout: one ``pack_into`` per put."""

    __slots__ = ("hlen", "layout_bytes", "layout_len", "packer")

    def __init__(self, layout_bytes: bytes) -> None:
        self.layout_bytes = layout_bytes
        self.layout_len = len(layout_bytes)
        self.hlen = header_len(layout_bytes)
        pad = HEADER_FIXED - HEADER.size
        self.packer = struct.Struct(f"{HEADER.format}{pad}x{self.layout_len}s")

    def write(self, view: memoryview, at: int, oid: int, key: int, nbytes: int) -> None:
        """Write a complete, sealed header at ``at`` (after the payload is in place)."""
        self.packer.pack_into(
            view,
            at,
            MAGIC,
            STATE_SEALED,
            oid,
            tag(oid, key),
            self.hlen,
            self.layout_len,
            nbytes,
            0,
            self.layout_bytes,
        )


def read_sealed(view: memoryview, at: int, oid: int, key: int) -> tuple[int, Layout] | None:
    """(payload offset, layout) if a sealed header of object ``oid`` sits at ``at``, else None."""
    if at < CONTROL_BYTES or at + HEADER_FIXED > len(view):
        return None
    magic, state, found_oid, found_tag, hlen, llen, nbytes, _ = HEADER.unpack_from(view, at)
    if (
        magic != MAGIC
        or state != STATE_SEALED
        or found_oid != oid
        or found_tag != tag(oid, key)
        or hlen < HEADER_FIXED + llen
        or at + hlen + nbytes > len(view)
    ):
        return None
    try:
        layout = _decode_layout(view[at + HEADER_FIXED : at + HEADER_FIXED + llen])
    except msgspec.DecodeError:
        return None
    for item in layout.items:
        if item.offset < 0 or item.nbytes < 0 or item.offset + item.nbytes > nbytes:
            return None
    return at + hlen, layout


def touch(view: memoryview, at: int, now_ns: int) -> None:
    _U64.pack_into(view, at + LAST_ACCESS_OFFSET, now_ns)


def last_access(view: memoryview, at: int) -> int:
    return _U64.unpack_from(view, at + LAST_ACCESS_OFFSET)[0]


def mark_freed(view: memoryview, at: int) -> None:
    _U32.pack_into(view, at + STATE_OFFSET, STATE_FREED)


def write_control(view: memoryview, flags: int) -> None:
    CONTROL.pack_into(view, 0, CONTROL_MAGIC, flags)


def control_flags(view: memoryview) -> int:
    magic, flags = CONTROL.unpack_from(view, 0)
    # A pool without a control page (never the case for a master of this version): master path.
    return flags if magic == CONTROL_MAGIC else FLAG_MASTER_PATH
