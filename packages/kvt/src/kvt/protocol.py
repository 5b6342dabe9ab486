"""kvt's wire format and its sans-I/O decoder.

One TCP connection carries frames in both directions. Every frame starts with a 16-byte header::

    offset size field
    0      2    magic        b"KV"
    2      1    version      2 on an extended HELLO, else 1 (both decoded; see VERSIONS)
    3      1    type         1 HELLO, 2 DATA, 3 DONE, 4 ABORT, 5 DESC, 6 PATH, 7 VERDICT
    4      4    meta_len     u32 LE, bytes of type-specific metadata that follow the header
    8      8    payload_len  u64 LE, raw bytes after the metadata (DATA only, else 0)

Metadata (little-endian):

    HELLO  u16 name_len | u16 addr_len | name utf-8 | data address utf-8
           [extension, absent from a plain (v1) HELLO: u8 1 | u16 boot_len | boot id
            | u32 pid | u8 mode_len | mode ("auto", "tcp", ...) | u8 n_offers
            | n_offers x (u8 name_len | path name | u32 blob_len | blob)]
    DATA   u16 rid_len | u8 flags (bit0 = last batch) | u8 0 | u32 n_blocks | rid
           | n_blocks x 30-byte IpcBlock
           payload = the blocks' bytes, concatenated in record order (sum of lengths == payload_len)
    DONE   u16 rid_len | u16 0 | u64 nbytes | rid          (receiver -> sender: every byte written)
    ABORT  u16 rid_len | u8 code | u8 target (1 sender side, 2 receiver side; bit 7: confirms
           the target's own abort) | rid | reason utf-8
    DESC   u16 rid_len | u8 flags | u8 0 | u32 n_blocks | u64 seq | u32 ext_len | rid
           | n_blocks x 30-byte IpcBlock | ext (the path's own bytes, e.g. source addresses)
           no payload: the link's payload path moves the bytes (samehost, rdma)
    PATH   u8 kind | u8 status | u16 0 | u32 0 | u64 seq | u64 nbytes | body
           a payload path's own message (e.g. samehost's ACK of frame ``seq``)
    VERDICT u8 n | n x (u8 name_len | path name | u8 usable | u16 note_len | note utf-8)
           after the HELLOs (extended ones only): which paths this end can use to the peer

DONE and ABORT carry the control layer's messages (:mod:`kvt.control`); the others are TCP's.

The decoder never sees payload bytes in the fast path: after a DATA header it enters the PAYLOAD
state, the I/O layer reads the payload straight into destination memory and reports how much it
consumed (:meth:`FrameDecoder.payload_consumed`). For fuzzing and for draining, payload bytes can
also be fed through :meth:`FrameDecoder.feed`, which then yields :class:`PayloadBytes` events.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np
from ipcblock import IPCBLOCK_DTYPE, IPCBLOCK_SIZE, blocks_from_bytes

from kvt.control import MAX_REQUEST_ID, Abort, AbortTarget, ControlMessage, Done
from kvt.errors import ProtocolViolation
from kvt.outcome import AbortCode

MAGIC = b"KV"
VERSION = 1  # every frame but the extended HELLO
# The extended HELLO carries 2 so that a kvt from before the extension rejects it by name
# ("unsupported version 2") instead of "HELLO lengths do not add up".
EXTENDED_HELLO_VERSION = 2
VERSIONS = (VERSION, EXTENDED_HELLO_VERSION)
HEADER = struct.Struct("<2sBBIQ")
HEADER_SIZE = HEADER.size  # 16
DATA_META = struct.Struct("<HBBI")  # rid_len, flags, reserved, n_blocks
DONE_META = struct.Struct("<HHQ")  # rid_len, reserved, nbytes
ABORT_META = struct.Struct("<HBB")  # rid_len, code, target
ABORT_CONFIRMS = 0x80  # in ABORT's target byte: the receiver confirms the sender's own abort
HELLO_META = struct.Struct("<HH")  # name_len, addr_len
DESC_META = struct.Struct("<HBBIQI")  # rid_len, flags, reserved, n_blocks, seq, ext_len
PATH_META = struct.Struct("<BBHIQQ")  # kind, status, reserved, reserved, seq, nbytes
HELLO_EXT_VERSION = 1
FLAG_LAST = 0x01
DEFAULT_MAX_META = 8 * 1024 * 1024  # 8 MiB of metadata = ~280k records per frame
assert HEADER_SIZE == 16


class FrameType(enum.IntEnum):
    HELLO = 1
    DATA = 2
    DONE = 3
    ABORT = 4
    DESC = 5
    PATH = 6
    VERDICT = 7


# ------------------------------------------------------------------ events
# DONE and ABORT frames decode to the control layer's own messages (kvt.control.Done / Abort).
@dataclass(frozen=True, slots=True)
class Hello:
    """A peer's HELLO. ``extended`` is False for a plain (v1) HELLO: such a peer speaks tcp only
    and sends no VERDICT. ``offers``: (path name, opaque blob) per payload path it can do."""

    name: str
    data_address: str
    extended: bool = False
    boot_id: str = ""
    pid: int = 0
    transport: str = "auto"  # the peer's setting: "auto" or the path it forces
    offers: tuple[tuple[str, bytes], ...] = ()

    def offer(self, path: str) -> bytes | None:
        """The blob the peer sent with ``path``, None if it does not offer that path."""
        for name, blob in self.offers:
            if name == path:
                return blob
        return None


@dataclass(frozen=True, slots=True)
class DataDescriptor:
    """A DESC frame: records of a batch whose bytes the link's payload path moves itself."""

    request_id: str
    last: bool
    blocks: np.ndarray  # IPCBLOCK_DTYPE, read-only
    seq: int  # the sender's frame number on this link (acks name it)
    nbytes: int  # sum of the records' lengths (checked without wrap-around)
    ext: bytes  # the path's own per-frame bytes (samehost: n_blocks x u64 source addresses)


@dataclass(frozen=True, slots=True)
class PathMessage:
    """A PATH frame: a payload path's own message, delivered to that path unread by the link."""

    kind: int
    status: int
    seq: int
    nbytes: int
    body: bytes


@dataclass(frozen=True, slots=True)
class Verdict:
    """Which paths the peer can use to reach us: (path name, usable, note: why not / detail)."""

    results: tuple[tuple[str, bool, str], ...]

    def as_dict(self) -> dict[str, str | None]:
        """path -> None if usable, else the peer's reason."""
        return {name: (None if ok else note or "refused") for name, ok, note in self.results}


@dataclass(frozen=True, slots=True)
class DataHeader:
    request_id: str
    last: bool
    blocks: np.ndarray  # IPCBLOCK_DTYPE, read-only view of the metadata
    payload_len: int


@dataclass(frozen=True, slots=True)
class PayloadBytes:
    """Payload bytes fed through :meth:`FrameDecoder.feed` (fuzzing/draining, not the fast path)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class PayloadEnd:
    """The current DATA frame's payload is complete."""

    request_id: str


Event = (
    Hello
    | DataHeader
    | Done
    | Abort
    | PayloadBytes
    | PayloadEnd
    | DataDescriptor
    | PathMessage
    | Verdict
)


# ------------------------------------------------------------------ encoders
def _rid(request_id: str) -> bytes:
    raw = request_id.encode()
    if not raw or len(raw) > MAX_REQUEST_ID:
        raise ValueError(f"request id must be 1..{MAX_REQUEST_ID} bytes of utf-8, got {len(raw)}")
    return raw


def _frame(ftype: FrameType, meta: bytes, payload_len: int = 0, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, ftype, len(meta), payload_len) + meta


def _short(text: str, limit: int = 255) -> bytes:
    return text.encode()[:limit]


def encode_hello(
    name: str,
    data_address: str,
    *,
    boot_id: str | None = None,
    pid: int = 0,
    transport: str = "auto",
    offers: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]] = (),
) -> bytes:
    """A HELLO; with ``boot_id`` given it is extended (path selection follows; header version
    2), else plain (version 1: tcp only, what kvt spoke before the extension)."""
    n, a = name.encode()[:512], data_address.encode()[:512]
    meta = HELLO_META.pack(len(n), len(a)) + n + a
    if boot_id is None:
        return _frame(FrameType.HELLO, meta)
    boot, mode = _short(boot_id, 1024), _short(transport)
    parts = [
        struct.pack("<BH", HELLO_EXT_VERSION, len(boot)), boot,
        struct.pack("<IB", pid, len(mode)), mode, struct.pack("<B", len(offers)),
    ]  # fmt: skip
    for path, blob in offers:
        raw = _short(path)
        parts += [struct.pack("<B", len(raw)), raw, struct.pack("<I", len(blob)), bytes(blob)]
    return _frame(FrameType.HELLO, meta + b"".join(parts), version=EXTENDED_HELLO_VERSION)


def encode_desc(request_id: str, blocks: np.ndarray, last: bool, seq: int, ext: bytes) -> bytes:
    """A DESC frame (no payload follows: the link's payload path moves the bytes)."""
    rid = _rid(request_id)
    records = np.ascontiguousarray(blocks, dtype=IPCBLOCK_DTYPE)
    meta = DESC_META.pack(
        len(rid), FLAG_LAST if last else 0, 0, records.size, seq, len(ext)
    ) + b"".join((rid, records.tobytes(), ext))
    return _frame(FrameType.DESC, meta)


def encode_path(kind: int, status: int = 0, seq: int = 0, nbytes: int = 0, body: bytes = b""):
    """A PATH frame: a payload path's own small message."""
    return _frame(FrameType.PATH, PATH_META.pack(kind, status, 0, 0, seq, nbytes) + body)


def encode_verdict(results: list[tuple[str, bool, str]] | tuple) -> bytes:
    parts = [struct.pack("<B", len(results))]
    for path, usable, note in results:
        raw, text = _short(path), note.encode(errors="replace")[:4096]
        parts += [struct.pack("<B", len(raw)), raw, struct.pack("<BH", bool(usable), len(text))]
        parts.append(text)
    return _frame(FrameType.VERDICT, b"".join(parts))


def encode_data_head(request_id: str, blocks: np.ndarray, last: bool) -> bytes:
    """Header + metadata of a DATA frame; the payload (the blocks' source bytes) follows it."""
    rid = _rid(request_id)
    records = np.ascontiguousarray(blocks, dtype=IPCBLOCK_DTYPE)
    payload_len = int(records["length"].sum(dtype=np.uint64)) if records.size else 0
    meta = (
        DATA_META.pack(len(rid), FLAG_LAST if last else 0, 0, records.size)
        + rid
        + records.tobytes()
    )
    return _frame(FrameType.DATA, meta, payload_len)


def encode_done(request_id: str, nbytes: int) -> bytes:
    rid = _rid(request_id)
    return _frame(FrameType.DONE, DONE_META.pack(len(rid), 0, nbytes) + rid)


def encode_abort(
    request_id: str, code: AbortCode, target: AbortTarget, reason: str, confirms: bool = False
) -> bytes:
    rid = _rid(request_id)
    text = reason.encode(errors="replace")[:4096]
    target_byte = int(target) | (ABORT_CONFIRMS if confirms else 0)
    return _frame(FrameType.ABORT, ABORT_META.pack(len(rid), int(code), target_byte) + rid + text)


def encode_control(message: ControlMessage) -> bytes:
    """The DONE or ABORT frame that carries a control-layer message."""
    if isinstance(message, Done):
        return encode_done(message.request_id, message.nbytes)
    return encode_abort(
        message.request_id, message.code, message.target, message.reason, message.confirms
    )


# ------------------------------------------------------------------ decoder
class _State(enum.Enum):
    HEADER = 1
    META = 2
    PAYLOAD = 3


class FrameDecoder:
    """Bytes in, typed events out; raises :class:`ProtocolViolation` on malformed input.

    After a violation the decoder is poisoned (every later call raises): the stream has lost its
    framing and the connection must be closed.
    """

    def __init__(self, max_meta: int = DEFAULT_MAX_META) -> None:
        self.max_meta = max_meta
        self._state = _State.HEADER
        self._buf = bytearray()
        self._ftype = FrameType.HELLO
        self._meta_len = 0
        self._payload_left = 0
        self._payload_rid = ""
        self._error: ProtocolViolation | None = None

    # -- introspection used by the I/O layer
    @property
    def in_payload(self) -> bool:
        return self._state is _State.PAYLOAD

    @property
    def payload_left(self) -> int:
        return self._payload_left

    def next_read_size(self) -> int:
        """Bytes to read so the next header or metadata is complete, never reading past it."""
        if self._state is _State.HEADER:
            return HEADER_SIZE - len(self._buf)
        if self._state is _State.META:
            return self._meta_len - len(self._buf)
        return self._payload_left

    # -- feeding
    def feed(self, data: bytes | bytearray | memoryview) -> list[Event]:
        self._check_poisoned()
        events: list[Event] = []
        view = memoryview(data).cast("B")
        pos = 0
        try:
            while pos < len(view):
                if self._state is _State.PAYLOAD:
                    take = min(self._payload_left, len(view) - pos)
                    events.append(PayloadBytes(bytes(view[pos : pos + take])))
                    pos += take
                    events.extend(self.payload_consumed(take))
                    continue
                need = self.next_read_size()
                take = min(need, len(view) - pos)
                self._buf += view[pos : pos + take]
                pos += take
                if take == need:
                    events.extend(self._advance())
        except ProtocolViolation as exc:
            self._error = exc
            raise
        return events

    def payload_consumed(self, n: int) -> list[Event]:
        """The I/O layer moved ``n`` payload bytes itself (straight into destination memory)."""
        self._check_poisoned()
        if self._state is not _State.PAYLOAD or n > self._payload_left or n < 0:
            raise ProtocolViolation(f"payload_consumed({n}) outside a payload")
        self._payload_left -= n
        if self._payload_left == 0:
            self._state = _State.HEADER
            return [PayloadEnd(self._payload_rid)]
        return []

    def _check_poisoned(self) -> None:
        if self._error is not None:
            raise ProtocolViolation(f"decoder unusable after earlier error: {self._error}")

    def _advance(self) -> list[Event]:
        if self._state is _State.HEADER:
            magic, version, ftype, meta_len, payload_len = HEADER.unpack(self._buf)
            self._buf.clear()
            if magic != MAGIC:
                raise ProtocolViolation(f"bad magic {magic!r}")
            if version not in VERSIONS:
                raise ProtocolViolation(f"unsupported version {version}")
            try:
                self._ftype = FrameType(ftype)
            except ValueError:
                raise ProtocolViolation(f"unknown frame type {ftype}") from None
            if meta_len > self.max_meta:
                raise ProtocolViolation(f"metadata of {meta_len} bytes exceeds {self.max_meta}")
            if payload_len and self._ftype is not FrameType.DATA:
                raise ProtocolViolation(f"{self._ftype.name} frame with a payload")
            self._meta_len = meta_len
            self._payload_left = payload_len
            self._state = _State.META
            if meta_len == 0:
                return self._advance()
            return []
        # META complete
        meta = bytes(self._buf)
        self._buf.clear()
        self._state = _State.HEADER
        event = self._parse_meta(self._ftype, meta)
        if isinstance(event, DataHeader):
            self._payload_rid = event.request_id
            if self._payload_left:
                self._state = _State.PAYLOAD
                return [event]
            return [event, PayloadEnd(event.request_id)]
        return [event]

    def _parse_meta(self, ftype: FrameType, meta: bytes) -> Event:
        if ftype is FrameType.HELLO:
            return _parse_hello(meta)
        if ftype is FrameType.DESC:
            return _parse_desc(meta)
        if ftype is FrameType.PATH:
            kind, status, _, _, seq, nbytes = _unpack(PATH_META, meta, "PATH")
            return PathMessage(kind, status, seq, nbytes, meta[PATH_META.size :])
        if ftype is FrameType.VERDICT:
            return _parse_verdict(meta)
        if ftype is FrameType.DATA:
            rid_len, flags, _, n_blocks = _unpack(DATA_META, meta, "DATA")
            if DATA_META.size + rid_len + n_blocks * IPCBLOCK_SIZE != len(meta):
                raise ProtocolViolation("DATA metadata length does not match its block count")
            rid = _request_id(meta[DATA_META.size : DATA_META.size + rid_len])
            if flags & ~FLAG_LAST:
                raise ProtocolViolation(f"unknown DATA flags {flags:#x}")
            blocks = blocks_from_bytes(meta[DATA_META.size + rid_len :])
            total = _checked_total(blocks)
            if total != self._payload_left:
                raise ProtocolViolation(
                    f"DATA {rid!r}: payload_len {self._payload_left} != block lengths {total}"
                )
            return DataHeader(rid, bool(flags & FLAG_LAST), blocks, total)
        if ftype is FrameType.DONE:
            rid_len, _, nbytes = _unpack(DONE_META, meta, "DONE")
            if DONE_META.size + rid_len != len(meta):
                raise ProtocolViolation("DONE metadata length mismatch")
            return Done(_request_id(meta[DONE_META.size :]), nbytes)
        rid_len, code, target = _unpack(ABORT_META, meta, "ABORT")
        if ABORT_META.size + rid_len > len(meta):
            raise ProtocolViolation("ABORT request id runs past the metadata")
        rid = _request_id(meta[ABORT_META.size : ABORT_META.size + rid_len])
        try:
            abort_code, abort_target = AbortCode(code), AbortTarget(target & ~ABORT_CONFIRMS)
        except ValueError:
            raise ProtocolViolation(f"ABORT with unknown code {code} / target {target}") from None
        reason = _text(meta[ABORT_META.size + rid_len :])
        return Abort(rid, abort_code, abort_target, reason, bool(target & ABORT_CONFIRMS))


class _Reader:
    """Bounds-checked little-endian reads over one frame's metadata."""

    def __init__(self, meta: bytes, what: str, pos: int = 0) -> None:
        self.meta, self.what, self.pos = meta, what, pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.meta):
            raise ProtocolViolation(f"{self.what} metadata ends early")
        raw = self.meta[self.pos : self.pos + n]
        self.pos += n
        return raw

    def unpack(self, fmt: str) -> tuple:
        st = struct.Struct("<" + fmt)
        return st.unpack(self.take(st.size))

    def end(self) -> None:
        if self.pos != len(self.meta):
            raise ProtocolViolation(f"{self.what} lengths do not add up")


def _parse_hello(meta: bytes) -> Hello:
    name_len, addr_len = _unpack(HELLO_META, meta, "HELLO")
    r = _Reader(meta, "HELLO", HELLO_META.size)
    name, address = _text(r.take(name_len)), _text(r.take(addr_len))
    if r.pos == len(meta):
        return Hello(name, address)
    (version, boot_len) = r.unpack("BH")
    if version != HELLO_EXT_VERSION:
        raise ProtocolViolation(f"HELLO extension version {version}")
    boot_id = _text(r.take(boot_len))
    pid, mode_len = r.unpack("IB")
    transport = _text(r.take(mode_len))
    (n_offers,) = r.unpack("B")
    offers = []
    for _ in range(n_offers):
        (path_len,) = r.unpack("B")
        path = _text(r.take(path_len))
        (blob_len,) = r.unpack("I")
        offers.append((path, r.take(blob_len)))
    r.end()
    return Hello(name, address, True, boot_id, pid, transport, tuple(offers))


def _parse_desc(meta: bytes) -> DataDescriptor:
    rid_len, flags, _, n_blocks, seq, ext_len = _unpack(DESC_META, meta, "DESC")
    if DESC_META.size + rid_len + n_blocks * IPCBLOCK_SIZE + ext_len != len(meta):
        raise ProtocolViolation("DESC metadata length does not match its counts")
    if flags & ~FLAG_LAST:
        raise ProtocolViolation(f"unknown DESC flags {flags:#x}")
    rid = _request_id(meta[DESC_META.size : DESC_META.size + rid_len])
    start = DESC_META.size + rid_len
    end = start + n_blocks * IPCBLOCK_SIZE
    blocks = blocks_from_bytes(meta[start:end])
    return DataDescriptor(rid, bool(flags & FLAG_LAST), blocks, seq, _checked_total(blocks),
                          meta[end:])  # fmt: skip


def _parse_verdict(meta: bytes) -> Verdict:
    r = _Reader(meta, "VERDICT")
    (n,) = r.unpack("B")
    results = []
    for _ in range(n):
        (path_len,) = r.unpack("B")
        path = _text(r.take(path_len))
        usable, note_len = r.unpack("BH")
        if usable > 1:
            raise ProtocolViolation(f"VERDICT usable flag {usable}")
        results.append((path, bool(usable), _text(r.take(note_len))))
    r.end()
    return Verdict(tuple(results))


def _unpack(st: struct.Struct, meta: bytes, what: str) -> tuple:
    if len(meta) < st.size:
        raise ProtocolViolation(f"{what} metadata of {len(meta)} bytes is too short")
    return st.unpack_from(meta)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _request_id(raw: bytes) -> str:
    if not raw or len(raw) > MAX_REQUEST_ID:
        raise ProtocolViolation(f"request id of {len(raw)} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolViolation("request id is not utf-8") from None


_U64_MAX = (1 << 64) - 1


def _checked_total(blocks: np.ndarray) -> int:
    """Sum of lengths without silent u64 wrap-around (a crafted frame could try that)."""
    if blocks.size == 0:
        return 0
    lengths = blocks["length"]
    if int(lengths.max()) > _U64_MAX // max(1, blocks.size):
        total = sum(int(x) for x in lengths.tolist())
        if total > _U64_MAX:
            raise ProtocolViolation("block lengths overflow u64")
        return total
    return int(lengths.sum(dtype=np.uint64))
