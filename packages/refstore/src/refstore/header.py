"""What the pool itself says about its objects, so that clients can get and put without the master.

Two structures live in shared memory next to the payloads:

- the **control page** (the pool's first 4 KiB, reserved by the master at start): a magic and a
  flags word. ``FLAG_MASTER_PATH`` is set while a fault plan is active, and makes every client
  take the master path for every operation, so that injected faults apply to all of them.
- an **object header** at the start of every object's block, written by the client that puts it,
  after its payload::

      magic "RSo1" | state u32 | oid u64 | tag u64 | header_len u32 | layout_len u32
      | nbytes u64 | last_access_ns u64 | lease_deadline_ns u64 | flags u32 | (pad to 64)
      | layout (msgpack) | (pad to 64) | payload

  ``state`` is SEALED once the client has written the payload and then the header, and FREED
  (master) before the block returns to the allocator.
  ``tag`` mixes the oid with the pool's epoch, so a stale header or payload bytes that happen
  to sit where a ref points are not taken for the object.
  ``last_access_ns`` (CLOCK_MONOTONIC, the same clock in every process) is written by gets that
  never reach the master; eviction reads it to give recently read objects a second chance.
  ``lease_deadline_ns`` (CLOCK_MONOTONIC; 0: no lease) is written by the client at put and by the
  master when the lease changes: a get past it asks the master instead of trusting the header.
  ``flags`` holds ``OBJECT_PINNED`` (the put's soft pin).

The header is also the **commit record** of a put into a reserved block: such a put sends the
master nothing. The master reads the header (``read_committed``) the first time the object
matters to it (a lookup, its write deadline, eviction, stats, the client's disconnect), and adopts
it with the size, layout, lease and pin found there.

A get checks the header (magic, state, oid, tag) and builds its views from the layout in the
header: about 5 µs, no round trip. Anything else (freed, unknown, still being written, another
epoch) falls back to the master, which says why with a typed error or waits for the seal.

Ordering: the header and the layout are written after the payload is in place, then the state
word SEALED by a store of its own with release ordering; readers load the state first, with
acquire ordering (``_fastpath.c``). A client
cannot race that write (it needs the object's ref, which exists only after ``put`` returned); the
master can, when it settles reserved blocks, and then sees either no SEALED or a whole header.
A reader that validated a header and then sees the object freed is the same case as any view
outliving its object: views are valid while the object lives.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

import msgspec

from . import _fastpath
from .protocol import CONTAINER_SINGLE, KIND_TORCH, Item, Layout

CONTROL_BYTES = 4096
CONTROL = struct.Struct("<4sI")
CONTROL_MAGIC = b"RSp1"
FLAG_MASTER_PATH = 1

HEADER = struct.Struct("<4sIQQIIQQQI")
MAGIC = b"RSo1"
HEADER_FIXED = 64
ALIGN = 64
STATE_WRITING = 0
STATE_SEALED = 1
STATE_FREED = 2
STATE_OFFSET = 4
LAST_ACCESS_OFFSET = 40
LEASE_OFFSET = 48
OBJECT_PINNED = 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
LAYOUT_CACHE_MAX = 1024

_encode_layout = msgspec.msgpack.Encoder().encode
_decode_layout = msgspec.msgpack.Decoder(Layout).decode


def epoch_key(epoch: str) -> int:
    """The pool epoch (16 hex digits) as the 64-bit key mixed into every tag."""
    try:
        return int(epoch[:16], 16) & _MASK64
    except ValueError:
        return hash(epoch) & _MASK64


def tag(oid: int, key: int) -> int:
    return ((oid * _GOLDEN) ^ key) & _MASK64


def header_len(layout_bytes: bytes) -> int:
    return -(-(HEADER_FIXED + len(layout_bytes)) // ALIGN) * ALIGN


def encode_layout(layout: Layout) -> bytes:
    return _encode_layout(layout)


class Writer:
    """Writes the sealed headers of objects with one layout: one native call per put, which
    copies the header template, fills in the object's fields and stores SEALED last."""

    __slots__ = ("hlen", "layout_bytes", "layout_len", "template")

    def __init__(self, layout_bytes: bytes) -> None:
        self.layout_bytes = layout_bytes
        self.layout_len = len(layout_bytes)
        self.hlen = header_len(layout_bytes)
        pad = HEADER_FIXED - HEADER.size
        packer = struct.Struct(f"{HEADER.format}{pad}x{self.layout_len}s")
        self.template = packer.pack(
            MAGIC, STATE_WRITING, 0, 0, self.hlen, self.layout_len, 0, 0, 0, 0, layout_bytes
        )

    def write(
        self,
        view: memoryview,
        at: int,
        oid: int,
        key: int,
        nbytes: int,
        *,
        lease_deadline_ns: int = 0,
        flags: int = 0,
    ) -> None:
        """Write a complete, sealed header at ``at`` (after the payload is in place)."""
        _fastpath.seal(view, at, self.template, oid, key, nbytes, lease_deadline_ns, flags)


class Committed(NamedTuple):
    """What a sealed header says about its object."""

    header_len: int
    nbytes: int
    layout: Layout
    lease_deadline_ns: int  # 0: no lease
    flags: int


def read_committed(
    view: memoryview, at: int, oid: int, key: int, limit: int | None = None
) -> Committed | None:
    """The sealed header of object ``oid`` at ``at``, or None if there is none (not written yet,
    freed, another object's, or not a header at all). ``limit``: the object must end before it
    (the master passes the end of the block). The master's reader; clients' gets check the same
    things in one native call (``_fastpath.read_sealed``, which also rejects a passed lease)."""
    end = len(view) if limit is None else min(limit, len(view))
    if at < CONTROL_BYTES or at + HEADER_FIXED > end:
        return None
    if _U32.unpack_from(view, at + STATE_OFFSET)[0] != STATE_SEALED:
        return None  # read first: once SEALED, the rest of the header is complete
    magic, state, found_oid, found_tag, hlen, llen, nbytes, _, deadline, flags = HEADER.unpack_from(
        view, at
    )
    if (
        magic != MAGIC
        or state != STATE_SEALED
        or found_oid != oid
        or found_tag != tag(oid, key)
        or hlen < HEADER_FIXED + llen
        or at + hlen + nbytes > end
    ):
        return None
    try:
        layout = _decode_layout(view[at + HEADER_FIXED : at + HEADER_FIXED + llen])
    except msgspec.DecodeError:
        return None
    for item in layout.items:
        if item.offset < 0 or item.nbytes < 0 or item.offset + item.nbytes > nbytes:
            return None
    return Committed(hlen, nbytes, layout, deadline, flags)


class Reader:
    """Reads sealed headers for a client's gets, with the layouts it has decoded remembered by
    their bytes: a get of a known layout decodes nothing. A get runs where caches are cold (a Ray
    task just dispatched), where every step it saves counts."""

    __slots__ = ("key", "layouts")

    def __init__(self, key: int) -> None:
        self.key = key
        # layout bytes -> (layout, payload bytes it needs, the plan of a lone tensor or None)
        self.layouts: dict[bytes, tuple[Layout, int, TensorPlan | None]] = {}

    def sealed(
        self, view: memoryview, at: int, oid: int, now_ns: int
    ) -> tuple[int, Layout, TensorPlan | None] | None:
        """(payload offset, layout, plan if the object is one non-empty torch tensor) if a
        sealed header of object ``oid`` whose lease has not passed at ``now_ns`` sits at ``at``
        and no fault plan sends gets to the master, else None (then the master decides). A
        header found is stamped with ``now_ns`` as its last access."""
        found = _fastpath.read_sealed(view, at, oid, self.key, now_ns)
        if found is None:
            return None
        hlen, nbytes, raw = found
        known = self.layouts.get(raw)
        if known is None:
            try:
                layout = _decode_layout(raw)
            except msgspec.DecodeError:
                return None
            if any(item.offset < 0 or item.nbytes < 0 for item in layout.items):
                return None
            needs = max((item.offset + item.nbytes for item in layout.items), default=0)
            if len(self.layouts) >= LAYOUT_CACHE_MAX:
                self.layouts.clear()
            known = self.layouts[raw] = (layout, needs, _tensor_plan(layout))
        if known[1] > nbytes:
            return None
        return at + hlen, known[0], known[2]


class TensorPlan(NamedTuple):
    """How to view an object that is one torch tensor at payload + ``offset``: handed to torch as
    a DLPack capsule of type ``dlpack`` (code, bits), or, for dtypes DLPack has no code for, as
    ``as_strided`` of the pool's flat tensor of ``dtype`` (``pool.torch_flat``)."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    dlpack: tuple[int, int] | None


# torch dtype name -> DLPack (type code, bits): kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4,
# kDLComplex 5, kDLBool 6.
DLPACK_TYPES = {
    "float32": (2, 32),
    "float64": (2, 64),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "int8": (0, 8),
    "int16": (0, 16),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "uint16": (1, 16),
    "uint32": (1, 32),
    "uint64": (1, 64),
    "bool": (6, 8),
    "complex64": (5, 64),
    "complex128": (5, 128),
}


def _tensor_plan(layout: Layout) -> TensorPlan | None:
    if layout.container != CONTAINER_SINGLE or len(layout.items) != 1:
        return None
    item = layout.items[0]
    if item.kind != KIND_TORCH or not item.nbytes:
        return None
    return tensor_plan(item)


def tensor_plan(item: Item) -> TensorPlan:
    """How to make the tensor of a torch ``item``."""
    shape = item.shape
    return TensorPlan(
        item.dtype, shape, contiguous_strides(shape), item.offset, DLPACK_TYPES.get(item.dtype)
    )


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def last_access(view: memoryview, at: int) -> int:
    return _U64.unpack_from(view, at + LAST_ACCESS_OFFSET)[0]


def set_lease(view: memoryview, at: int, deadline_ns: int) -> None:
    _U64.pack_into(view, at + LEASE_OFFSET, deadline_ns)


def mark_freed(view: memoryview, at: int) -> None:
    _U32.pack_into(view, at + STATE_OFFSET, STATE_FREED)


def write_control(view: memoryview, flags: int) -> None:
    CONTROL.pack_into(view, 0, CONTROL_MAGIC, flags)
