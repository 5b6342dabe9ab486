"""Child-process peers for test_samehost.py (spawned, so this module must be importable)."""

from __future__ import annotations

import os
import queue

import numpy as np
from ipcblock import make_blocks
from kvt import TransferEngine

BLOCK = 64 << 10


def pattern(nbytes: int) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)


def scattered(nbytes: int, src_region: int, dst_region: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks from slot i to a random slot (the vLLM CPU layout); returns (blocks, permutation)."""
    n = nbytes // BLOCK
    perm = np.random.default_rng(7).permutation(n)
    blocks = make_blocks(np.arange(n) * BLOCK, perm * BLOCK, BLOCK, src_region=src_region,
                         dst_region=dst_region)  # fmt: skip
    return blocks, perm


def send_once(conn, data_address: str, dst_region: int, nbytes: int, setting: tuple) -> None:
    """Send one scattered request; report (status, code, reason, paths of this end's links).

    ``setting``: (transport= argument, KVT_TRANSPORT value), either may be None."""
    transport, env = setting
    if env is not None:
        os.environ["KVT_TRANSPORT"] = env
    engine = TransferEngine(name="child-P", transport=transport)
    try:
        region = engine.register_region(pattern(nbytes))
        blocks, _ = scattered(nbytes, region, dst_region)
        done: queue.SimpleQueue = queue.SimpleQueue()
        engine.send("r", data_address, blocks, last=True, on_complete=done.put)
        c = done.get(timeout=60)
        paths = [link.path for link in engine.backend.links()]
        conn.send((c.status.value, c.code and c.code.name, c.reason, paths))
    finally:
        engine.close()


def send_and_hang(conn, data_address: str, dst_region: int, nbytes: int) -> None:
    """Queue one request over samehost, report, and wait to be killed (kill -9 mid-read)."""
    engine = TransferEngine(name="doomed-P", transport="samehost")
    region = engine.register_region(pattern(nbytes))
    blocks, _ = scattered(nbytes, region, dst_region)
    engine.send("victim", data_address, blocks, last=True)
    conn.send("queued")
    conn.recv()  # never answered: the parent kills this process
