"""Child-process peers for the two-process tests (spawned, so this module must be importable)."""

from __future__ import annotations

import numpy as np
from ipcblock import make_blocks
from kvt import TransferEngine


def first_batch_then_hang(conn, data_address: str, dst_region: int, nbytes: int) -> None:
    """A real sender that delivers one batch of a request, reports, and waits to be killed."""
    engine = TransferEngine(name="doomed-P")
    src = np.full(nbytes, 7, dtype=np.uint8)
    region = engine.register_region(src)
    half = nbytes // 2
    blocks = make_blocks(0, 0, half, src_region=region, dst_region=dst_region)
    engine.send("victim", data_address, blocks, last=False, on_complete=conn.send)
    conn.send("first batch queued")
    conn.recv()  # never answered: the parent kills this process
