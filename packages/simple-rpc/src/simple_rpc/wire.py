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
before any payload is buffered; what is then held follows the bytes that arrive, not `length`.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgspec

from .errors import BufferLimitExceeded, CallerError, ProtocolError

HEADER = struct.Struct(">III")
HEADER_SIZE = HEADER.size  # 12
CALL_ID_SIZE = 4
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
MAX_CALL_ID = 0xFFFFFFFF
# A payload at least this large that is not yet complete is gathered as the received pieces
# themselves (no copy until it completes, then one join) instead of being copied piece by piece
# into the small-frame buffer.
GATHER_AT = 64 * 1024

# Reserved: the head of every error answer (unknown head, bad request, handler raised); its
# payload is an ErrorBody.
ERROR_RESP = 0x45525221  # "ERR!"


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


class BufferBudget:
    """Bytes of incomplete frames that the decoders sharing it may hold together (a server's
    connections share one). Plain accounting: each decoder charges what it holds after a feed
    and gives it back when its frame completes, it fails, or it is released."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or limit < 0:
            raise CallerError(f"buffer budget must be an int >= 0, got {limit!r}")
        self.limit = limit
        self.used = 0


class FrameDecoder:
    """Bytes in; frames or a ProtocolError out. No I/O, so it can be fuzzed without sockets.

    `feed()` returns every complete frame in the input so far. On a malformed stream it raises
    ProtocolError whose `frames` lists the good frames that preceded the bad one in that input;
    the decoder then stays failed (every later `feed()` raises the same error).

    Memory follows the bytes that arrived, never a declared length: an incomplete frame is held
    as the pieces received so far (at most one incomplete frame, so at most max_frame_size + 8
    bytes per decoder). With a `budget`, the bytes held count against it after every feed; a
    feed that takes it over its limit raises BufferLimitExceeded (a ProtocolError: the decoder
    fails and holds nothing). `release()` gives back what a decoder holds when its stream ends.

    The decoder takes ownership of what it is fed: payload views may point into it, so the caller
    must not mutate a fed buffer afterwards (asyncio's `data_received` hands over fresh bytes).
    """

    __slots__ = (
        "_budget",
        "_buf",
        "_charged",
        "_error",
        "_gathered",
        "_missing",
        "_parts",
        "_parts_call_id",
        "_parts_head",
        "gather_at",
        "max_frame_size",
    )

    def __init__(
        self,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        *,
        gather_at: int = GATHER_AT,
        budget: BufferBudget | None = None,
    ) -> None:
        if not isinstance(max_frame_size, int) or max_frame_size < CALL_ID_SIZE:
            raise CallerError(
                f"max_frame_size must be an int >= {CALL_ID_SIZE}, got {max_frame_size!r}"
            )
        self.max_frame_size = max_frame_size
        self.gather_at = gather_at
        self._budget = budget
        self._charged = 0  # bytes of this decoder currently counted in the budget
        # Partial header, or a partial frame with a payload under gather_at.
        self._buf = bytearray()
        # Pieces of a large payload received so far (None when no such frame is incomplete).
        self._parts: list[bytes | memoryview] | None = None
        self._parts_head = 0
        self._parts_call_id = 0
        self._gathered = 0  # payload bytes in _parts
        self._missing = 0  # payload bytes still to come
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames (what this decoder holds)."""
        if self._parts is None:
            return len(self._buf)
        return HEADER_SIZE + self._gathered

    @property
    def failed(self) -> bool:
        return self._error is not None

    def release(self) -> None:
        """Drop any incomplete frame and give its bytes back to the budget (the stream ended)."""
        self._buf = bytearray()
        self._parts = None
        self._gathered = 0
        self._settle(0)

    def _settle(self, held: int) -> None:
        """Charge the budget for `held` bytes instead of what was charged before."""
        budget = self._budget
        if budget is not None:
            budget.used += held - self._charged
            self._charged = held

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
        if self._parts is None and not self._buf and len(data) >= HEADER_SIZE:
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
            if self._parts is not None:
                pos = self._gather(view, 0, frames)
            if self._buf:
                pos = self._complete_buffered(view, pos, frames)
            if self._parts is None and not self._buf:
                self._parse_direct(view, pos, frames)
            if self._budget is not None:
                self._charge()
        except ProtocolError as err:
            err.frames = frames
            self._error = err
            self.release()
            raise
        return frames

    def _charge(self) -> None:
        held = self.buffered
        if held != self._charged:
            budget = self._budget
            assert budget is not None
            self._settle(held)
            if budget.used > budget.limit:  # only this feed can have taken it over
                raise BufferLimitExceeded(
                    f"incomplete frames would hold {budget.used} bytes, over the budget of "
                    f"{budget.limit} (this connection {held})"
                )

    def _gather(self, view: memoryview, pos: int, frames: list[Frame]) -> int:
        """Add the next piece of the large payload in `_parts`; return the new position."""
        parts = self._parts
        assert parts is not None
        end = len(view)
        take = min(self._missing, end - pos)
        if take:
            # Keep a whole fed buffer as it is (no copy); copy a piece of one, so that the
            # rest of that buffer (other frames' bytes) is not held alive by a view.
            parts.append(view if take == end else bytes(view[pos : pos + take]))
            self._gathered += take
            self._missing -= take
        if not self._missing:
            payload = memoryview(bytearray().join(parts))
            frames.append(_frame(Frame, (self._parts_head, self._parts_call_id, payload)))
            self._parts = None
            self._gathered = 0
        return pos + take

    def _start_gathering(
        self, header: tuple[int, int, int], view: memoryview, pos: int, frames: list[Frame]
    ) -> int:
        head, length, call_id = header
        self._parts = []
        self._parts_head = head
        self._parts_call_id = call_id
        self._gathered = 0
        self._missing = length - CALL_ID_SIZE
        return self._gather(view, pos, frames)

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
            if size >= self.gather_at and end - pos < size:
                self._buf = bytearray()
                return self._start_gathering((head, length, call_id), view, pos, frames)
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

    def _parse_direct(self, view: memoryview, pos: int, frames: list[Frame]) -> None:
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
            elif size >= self.gather_at:
                self._start_gathering((head, length, call_id), view, start, frames)
                return
            else:
                break
        if pos < end:
            if end - pos >= 8:
                head, length = struct.unpack_from(">II", view, pos)
                self._check_length(head, length)
            self._buf += view[pos:end]
