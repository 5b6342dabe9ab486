"""SIGTERM to `pdserve up` leaves no process of its tree (API servers, engine cores, workers).

The test ends its deployment, so it has one of its own instead of sharing test_pd_e2e's.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from pd_serving.launcher import ManagedProcess, stop_all, wait_all_ready
from stand_ins import wait_all_gone

from .conftest import STARTUP_TIMEOUT_S, pdserve_up
from .helpers import descendants


@pytest.fixture
def deployment(tiny_model: Path, tmp_path: Path) -> Iterator[ManagedProcess]:
    pdserve = pdserve_up(tiny_model, tmp_path)
    try:
        pdserve.start()
        wait_all_ready([pdserve], STARTUP_TIMEOUT_S)
        yield pdserve
    finally:
        stop_all([pdserve])


def test_sigterm_stops_every_child(deployment: ManagedProcess) -> None:
    pid = deployment.pid
    assert pid is not None
    children = descendants(pid)
    assert len(children) >= 4, children  # two API servers, each with an engine core and a worker
    os.kill(pid, signal.SIGTERM)
    assert deployment.exited.result(timeout=90) == 0
    assert wait_all_gone(children, timeout=30) == set()
