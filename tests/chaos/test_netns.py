"""The netns harness itself: hosts reach each other, cuts and cable pulls work and heal, and
nothing (namespace, veth, bridge, process) outlives the lab, also when the test body fails."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from pd_serving.launcher import ManagedProcess, free_port
from stand_ins import wait_all_gone

from .netns import NetnsLab, unavailable_reason

HTTP_READY = "Serving HTTP on"


def _http_server(lab: NetnsLab, host: str, tmp_path: Path) -> tuple[ManagedProcess, str]:
    port = free_port()
    address = lab[host].address
    url = f"http://{address}:{port}/"
    proc = ManagedProcess(
        f"http-{host}",
        lab.argv(host, [sys.executable, "-u", "-m", "http.server", "--bind", address, str(port)]),
        log_path=tmp_path / f"{host}.log",
        ready_marker=HTTP_READY,
        health_url=url,
        cwd=tmp_path,
    )
    proc.start()
    proc.ready.result(timeout=30)
    return proc, url


def _get_from(lab: NetnsLab, host: str, url: str) -> bool:
    """Whether ``host`` (inside its namespace) gets ``url`` within a second."""
    code = f"import urllib.request as u; u.urlopen({url!r}, timeout=1).read()"
    done = subprocess.run(
        lab.argv(host, [sys.executable, "-c", code]), capture_output=True, check=False
    )
    return done.returncode == 0


def _get_here(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_hosts_reach_each_other_and_cuts_heal(netns_lab, tmp_path: Path) -> None:
    lab = netns_lab(["a", "b", "c"])
    assert len({h.address for h in lab.hosts.values()}) == 3
    server, url = _http_server(lab, "a", tmp_path)
    try:
        assert lab.pids("a") == [server.pid]  # `ip netns exec` execs: the pid is the server's
        assert _get_from(lab, "b", url)
        assert _get_from(lab, "c", url)
        assert _get_here(url)

        lab.cut("a", "b")  # between a and b only
        assert not _get_from(lab, "b", url)
        assert _get_from(lab, "c", url)
        assert _get_here(url)
        lab.restore("a", "b")
        assert _get_from(lab, "b", url)

        lab.link_down("a")  # a's cable: nobody reaches it
        assert not _get_from(lab, "c", url)
        assert not _get_here(url)
        lab.link_up("a")
        assert _get_from(lab, "c", url)
        assert _get_here(url)
    finally:
        server.stop()


def _failing_body(lab: NetnsLab, tmp_path: Path, started: list[ManagedProcess]) -> None:
    with lab:
        server, _url = _http_server(lab, "x", tmp_path)
        started.append(server)
        lab.cut("x", "y")
        assert lab.leftovers()  # it exists while inside
        raise RuntimeError("test body failed")  # the owner never stopped its server


def test_teardown_kills_stragglers_and_removes_everything(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    lab = NetnsLab(["x", "y"])
    started: list[ManagedProcess] = []
    with pytest.raises(RuntimeError, match="test body failed"):
        _failing_body(lab, tmp_path, started)
    assert lab.leftovers() == []
    assert wait_all_gone([started[0].pid], 10) == set()
    started[0].stop()  # reaps the killed child's threads
    lab.close()  # idempotent
