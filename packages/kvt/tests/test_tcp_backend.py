"""The TCP backend's own duties: its acceptor outlives passing accept() errors, and a link whose
peer never speaks fails by the handshake deadline instead of holding threads (or requests) forever.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading

import numpy as np
from conftest import Completions, kvt_threads, wait_until
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferEngine
from kvt.tcp import TcpBackend


class _OutOfFdsOnce:
    """The listening socket, but its first accept() fails as if the process ran out of fds."""

    def __init__(self, server: socket.socket) -> None:
        self._server = server
        self.failed = threading.Event()

    def accept(self):
        if not self.failed.is_set():
            self.failed.set()
            raise OSError(errno.EMFILE, "Too many open files")
        return self._server.accept()

    def __getattr__(self, name):
        return getattr(self._server, name)


def test_the_acceptor_survives_an_accept_error(no_leaks, caplog) -> None:
    backend = TcpBackend(name="D")
    flaky = backend._server = _OutOfFdsOnce(backend._server)
    with caplog.at_level(logging.WARNING, logger="kvt.tcp"):
        d = TransferEngine(name="D", backend=backend)
        p = TransferEngine(name="P")
        try:
            dst, src = np.zeros(4096, np.uint8), np.ones(4096, np.uint8)
            blocks = make_blocks(0, 0, 4096, src_region=p.register_region(src),
                                 dst_region=d.register_region(dst))  # fmt: skip
            got = Completions()
            d.expect("r", on_complete=got)
            p.send("r", d.data_address, blocks, last=True, on_complete=got)
            assert got.wait().ok
            assert got.wait().ok
            assert flaky.failed.is_set()
            assert "accept failed" in caplog.text
        finally:
            p.close()
            d.close()


def test_a_peer_that_never_speaks_is_dropped_by_the_handshake_deadline(no_leaks) -> None:
    d = TransferEngine(name="D", backend=TcpBackend(name="D", handshake_timeout_s=0.2))
    host, port = d.data_address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port))) as silent:
            silent.settimeout(10)
            while silent.recv(65536):  # D's HELLO, then EOF once its deadline closes the link
                pass
        wait_until(lambda: d.backend.links() == [])
        wait_until(lambda: not [name for name in kvt_threads() if "-L" in name])  # link threads
    finally:
        d.close()


def test_an_outbound_link_whose_peer_never_speaks_fails_to_connect(no_leaks) -> None:
    with socket.create_server(("127.0.0.1", 0)) as mute:  # the kernel accepts; nobody speaks
        host, port = mute.getsockname()[:2]
        with TransferEngine(
            name="P", backend=TcpBackend(name="P", connect_timeout_s=0.2, handshake_timeout_s=0.2)
        ) as p:
            rs = p.register_region(np.ones(4096, np.uint8))
            got = Completions()
            blocks = make_blocks(0, 0, 4096, src_region=rs)
            p.send("r", f"{host}:{port}", blocks, last=True, on_complete=got)
            c = got.wait()
            assert (c.origin, c.code) == (AbortOrigin.TRANSPORT, AbortCode.CONNECT_FAILED)
