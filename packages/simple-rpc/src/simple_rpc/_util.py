from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any


def format_address(sockname: Any) -> str:
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """'host:port', '[v6]:port' or (host, port) -> (host, port)."""
    if isinstance(address, tuple):
        host, port = address
        return str(host), int(port)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        from .errors import CallerError

        raise CallerError(f"address must look like 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    # Small request/response frames: never let Nagle hold one back waiting for an ACK.
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class WriteBatcher:
    """Hands the frames written during one loop iteration to the transport in one writelines().

    With 64 calls in flight, one socket write for many small frames instead of one each (uvloop
    writes at once when its buffer is empty, so without this every frame costs a syscall and a
    wake-up of the peer). A sequential call waits one callback for it, not a loop iteration.
    """

    __slots__ = ("_loop", "_pending", "_transport", "held")

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        self._loop = loop
        self._transport = transport
        self._pending: list = []
        # While held (inside data_received), the holder flushes when it is done.
        self.held = False

    def write(self, buf: Any) -> None:
        if not self._pending and not self.held:
            self._loop.call_soon(self.flush)
        self._pending.append(buf)

    def write_now(self, buf: Any) -> None:
        """Write at once unless earlier frames are waiting (order is kept either way)."""
        if self._pending or self.held:
            self.write(buf)
        elif not self._transport.is_closing():
            self._transport.write(buf)

    def flush(self) -> None:
        if self._pending:
            pending = self._pending
            self._pending = []
            if not self._transport.is_closing():
                if len(pending) == 1:
                    self._transport.write(pending[0])
                else:
                    self._transport.writelines(pending)
