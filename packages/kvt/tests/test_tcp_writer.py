"""A payload path that raises something other than OSError must fail its link, not strand it."""

from __future__ import annotations

import numpy as np
from conftest import Completions, EngineFactory
from ipcblock import make_blocks
from kvt import AbortCode, AbortOrigin, TransferStatus
from kvt.paths import TcpPath


def test_a_path_that_raises_fails_the_link_and_its_requests(no_leaks, monkeypatch) -> None:
    def broken_send_job(self, job) -> None:
        raise RuntimeError("bug in a payload path")

    monkeypatch.setattr(TcpPath, "send_job", broken_send_job)
    make = EngineFactory("tcp")
    p, d = make("P", default_timeout_s=60), make("D", default_timeout_s=60)
    try:
        src, dst = np.ones(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        sent = Completions()
        d.expect("r")
        p.send("r", d.data_address, make_blocks(0, 0, 1 << 16, src_region=rs, dst_region=rd),
               last=True, on_complete=sent)  # fmt: skip
        # Long before the 60 s deadline: the writer's crash failed the link.
        done = sent.wait(timeout=20)
        assert done.status is TransferStatus.ABORTED
        assert (done.origin, done.code) == (AbortOrigin.TRANSPORT, AbortCode.CONNECTION_LOST)
    finally:
        p.close()
        d.close()
