"""Wire format and the sans-I/O frame decoder.

One frame, all integers unsigned big-endian:

    offset  size  field
    0       4     head      method id: selects the handler (request) or says what the answer is
    4       4     length    number of bytes that follow this field: 4 + len(payload)
    8       4     call_id   chosen by the client, echoed in the response (many calls share one
                            connection; responses may come back in any order)
    12      n     payload   msgspec msgpack of the method's Struct, or raw bytes for raw methods

So a frame is exactly the issue's "4-byte head, 4-byte length, body", with the body starting with
the call id. `length` is checked against `max_frame_size` as soon as the 8-byte prefix arrives,
before any payload is buffered.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgspec

from .errors import ProtocolError

HEADER = struct.Struct(">III")
HEADER_SIZE = HEADER.size  # 12
CALL_ID_SIZE = 4
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
MAX_CALL_ID = 0xFFFFFFFF
# A payload at least this large that is not yet complete is received into one preallocated
# buffer (one copy per byte) instead of being accumulated chunk by chunk.
PREALLOCATE_AT = 64 * 1024


class Frame(NamedTuple):
    head: int
    call_id: int
    # A view into received data (zero-copy where possible); do not mutate the fed buffers.
    payload: memoryview


# tuple.__new__ builds a Frame without the Python-level NamedTuple constructor (hot path).
_frame = tuple.__new__


class ErrorBody(msgspec.Struct, frozen=True):
    """Payload of an ERROR_RESP frame."""

    kind: str
    message: str


def encode_frame(head: int, call_id: int, payload: bytes | bytearray | memoryview) -> bytes:
    """One whole frame as bytes (convenience for tests and tools; the hot paths encode in place)."""
    return HEADER.pack(head, len(payload) + CALL_ID_SIZE, call_id) + bytes(payload)


class FrameDecoder:
    """Bytes in; frames or a ProtocolError out. No I/O, so it can be fuzzed without sockets.

    `feed()` returns every complete frame in the input so far. On a malformed stream it raises
    ProtocolError whose `frames` lists the good frames that preceded the bad one in that input;
    the decoder then stays failed (every later `feed()` raises the same error).

    The decoder takes ownership of what it is fed: payload views may point into it, so the caller
    must not mutate a fed buffer afterwards (asyncio's `data_received` hands over fresh bytes).
    """

    __slots__ = (
        "_body",
        "_body_call_id",
        "_body_head",
        "_buf",
        "_error",
        "_filled",
        "max_frame_size",
        "preallocate_at",
    )

    def __init__(
        self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *, preallocate_at: int = PREALLOCATE_AT
    ) -> None:
        if not isinstance(max_frame_size, int) or max_frame_size < CALL_ID_SIZE:
            from .errors import CallerError

            raise CallerError(
                f"max_frame_size must be an int >= {CALL_ID_SIZE}, got {max_frame_size!r}"
            )
        self.max_frame_size = max_frame_size
        self.preallocate_at = preallocate_at
        # Partial frame (at most one small frame, or a partial header) carried between feeds.
        self._buf = bytearray()
        # Preallocated payload of a large frame being filled.
        self._body: bytearray | None = None
        self._body_head = 0
        self._body_call_id = 0
        self._filled = 0
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) + (HEADER_SIZE + self._filled if self._body is not None else 0)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _check_length(self, head: int, length: int) -> int:
        if length < CALL_ID_SIZE:
            raise ProtocolError(
                f"frame with head 0x{head:08x} declares length {length}, "
                f"shorter than its {CALL_ID_SIZE}-byte call id"
            )
        if length > self.max_frame_size:
            raise ProtocolError(
                f"frame with head 0x{head:08x} declares length {length}, "
                f"over max_frame_size {self.max_frame_size}"
            )
        return length - CALL_ID_SIZE

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise self._error
        if self._body is None and not self._buf and len(data) >= HEADER_SIZE:
            # Fast path for the common case: the input is exactly one whole frame.
            head, length, call_id = HEADER.unpack_from(data, 0)
            if length + 8 == len(data) and CALL_ID_SIZE <= length <= self.max_frame_size:
                return [_frame(Frame, (head, call_id, memoryview(data)[HEADER_SIZE:]))]
        frames: list[Frame] = []
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        try:
            pos = 0
            if self._body is not None:
                pos = self._fill_body(view, 0, frames)
            if self._buf:
                pos = self._complete_buffered(view, pos, frames)
            if self._body is None and not self._buf:
                pos = self._parse_direct(view, pos, frames)
        except ProtocolError as err:
            err.frames = frames
            self._error = err
            self._buf = bytearray()
            self._body = None
            raise
        return frames

    def _fill_body(self, view: memoryview, pos: int, frames: list[Frame]) -> int:
        body = self._body
        assert body is not None
        take = min(len(body) - self._filled, len(view) - pos)
        body[self._filled : self._filled + take] = view[pos : pos + take]
        self._filled += take
        if self._filled == len(body):
            frames.append(_frame(Frame, (self._body_head, self._body_call_id, memoryview(body))))
            self._body = None
        return pos + take

    def _start_body(
        self, header: tuple[int, int, int], view: memoryview, pos: int, frames: list[Frame]
    ) -> int:
        head, length, call_id = header
        self._body = bytearray(length - CALL_ID_SIZE)
        self._body_head = head
        self._body_call_id = call_id
        self._filled = 0
        return self._fill_body(view, pos, frames)

    def _complete_buffered(self, view: memoryview, pos: int, frames: list[Frame]) -> int:
        """Finish the partial frame in `_buf` with bytes from `view`; return the new position."""
        buf = self._buf
        end = len(view)
        if len(buf) < HEADER_SIZE:
            take = min(HEADER_SIZE - len(buf), end - pos)
            buf += view[pos : pos + take]
            pos += take
            if len(buf) < HEADER_SIZE:
                # An 8-byte prefix is enough to reject a bad length before waiting for the call id.
                if len(buf) >= 8:
                    head, length = struct.unpack_from(">II", buf, 0)
                    self._check_length(head, length)
                return pos
            head, length, call_id = HEADER.unpack_from(buf, 0)
            size = self._check_length(head, length)
            if size >= self.preallocate_at and end - pos < size:
                self._buf = bytearray()
                return self._start_body((head, length, call_id), view, pos, frames)
        else:
            head, length, call_id = HEADER.unpack_from(buf, 0)
            size = length - CALL_ID_SIZE
        need = HEADER_SIZE + size - len(buf)
        take = min(need, end - pos)
        buf += view[pos : pos + take]
        pos += take
        if take == need:
            # Hand the whole buffer over (no copy) and start a fresh one.
            self._buf = bytearray()
            frames.append(_frame(Frame, (head, call_id, memoryview(buf)[HEADER_SIZE:])))
        return pos

    def _parse_direct(self, view: memoryview, pos: int, frames: list[Frame]) -> int:
        """Parse whole frames straight out of `view` (the common case: no copy at all)."""
        end = len(view)
        unpack_from = HEADER.unpack_from
        while end - pos >= HEADER_SIZE:
            head, length, call_id = unpack_from(view, pos)
            size = self._check_length(head, length)
            start = pos + HEADER_SIZE
            if end - start >= size:
                pos = start + size
                frames.append(_frame(Frame, (head, call_id, view[start:pos])))
            elif size >= self.preallocate_at:
                return self._start_body((head, length, call_id), view, start, frames)
            else:
                break
        if pos < end:
            if end - pos >= 8:
                head, length = struct.unpack_from(">II", view, pos)
                self._check_length(head, length)
            self._buf += view[pos:end]
            pos = end
        return pos
