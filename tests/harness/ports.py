"""Addresses for tests: a free port to listen on, and one nobody listens on."""

from __future__ import annotations

import atexit
import socket

try:  # below the kernel's ephemeral range, where another process's connect cannot take it
    from pd_serving.launcher import free_port
except ImportError:  # a package's own venv without pd-serving: the kernel's pick

    def free_port() -> int:
        """A port free right now on 127.0.0.1 (the kernel picks it)."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]


def _hold_a_dead_port() -> socket.socket:
    """A socket bound and never listening, for the whole run: a connect to its port is refused
    at once, and no later ``free_port()`` or server can take the port (a port that was only free
    when picked was seen taken by the test's own proxy a moment later: the "dead" D answered)."""
    for _ in range(16):
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", free_port()))
        except OSError:  # taken between the pick and the bind
            sock.close()
            continue
        atexit.register(sock.close)
        return sock
    raise RuntimeError("no port to hold for dead_address()")


# Made at import (collection), before any test takes its count of open file descriptors.
_DEAD = _hold_a_dead_port()


def dead_address() -> str:
    """host:port nobody listens on (the same for every call): connecting is refused at once."""
    host, port = _DEAD.getsockname()
    return f"{host}:{port}"
