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
