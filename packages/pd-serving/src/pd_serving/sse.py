"""Server-sent events off an upstream stream: whole events only, so that a stream cut off by a
failing instance (or handed over to another one) never leaves half an event at the client."""

from __future__ import annotations

from collections.abc import AsyncIterator


class SseEvents:
    """Splits an SSE byte stream into whole events (``...\\n\\n``)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [e + b"\n\n" for e in events if e.strip()]


async def next_events(chunks: AsyncIterator[bytes], events: SseEvents) -> list[bytes]:
    """The next whole events of the stream; [] at its end."""
    async for chunk in chunks:
        batch = events.feed(chunk)
        if batch:
            return batch
    return []
