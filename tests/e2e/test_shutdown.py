"""SIGTERM to `pdserve up` leaves no process of its tree (API servers, engine cores, workers).

It ends the session's xPyD deployment, so the harness runs it after every other test.
"""

from __future__ import annotations

import os
import signal

import pytest
from harness.pool import Xpyd
from stand_ins import wait_all_gone

from .helpers import descendants


@pytest.mark.destroys("xpyd")
def test_sigterm_stops_every_child(xpyd: Xpyd) -> None:
    pid = xpyd.pdserve.pid
    assert pid is not None
    children = descendants(pid)
    # Four API servers, each with an engine core and a worker.
    assert len(children) >= 8, children
    os.kill(pid, signal.SIGTERM)
    assert xpyd.pdserve.exited.result(timeout=90) == 0
    assert wait_all_gone(children, timeout=30) == set()
