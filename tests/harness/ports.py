"""Addresses for tests: a free port to listen on, and one nobody listens on."""

from __future__ import annotations

import socket

try:  # below the kernel's ephemeral range, where another process's connect cannot take it
    from pd_serving.launcher import free_port
except ImportError:  # a package's own venv without pd-serving: the kernel's pick

    def free_port() -> int:
        """A port free right now on 127.0.0.1 (the kernel picks it)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]


def dead_address() -> str:
    """host:port of a port nobody listens on: connecting is refused at once."""
    return f"127.0.0.1:{free_port()}"
