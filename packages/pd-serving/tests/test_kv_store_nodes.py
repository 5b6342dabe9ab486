"""`pdserve up --kvs`'s store on several nodes: the master each node starts listens where
``--kvs-listen`` says and asks the masters ``--kvs-peer`` names for what it lacks; a running
master of that name is reused and gets the peers added. Real masters (child processes) on
loopback, each in its own discovery directory, as two nodes would have."""

from __future__ import annotations

import socket
import zlib

import numpy as np
import pytest
import refstore
from pd_serving.cli import _kv_store

KEYS = [b"prefix-%02d" % i for i in range(4)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 255, (64 << 10) + i, dtype=np.uint8)


@pytest.fixture
def node_dirs(tmp_path, monkeypatch):
    """Switch the discovery directory between two "nodes"."""

    def on(node: str) -> None:
        monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / node))

    return on


def test_a_node_store_finds_what_another_node_stored(node_dirs, capsys):
    listen = f"127.0.0.1:{_free_port()}"
    node_dirs("a")
    with _kv_store("kvs", "16M", listen=listen) as a_proc:
        assert a_proc is not None
        with refstore.Client("kvs") as a:
            assert a.address == listen
            a.put_keyed([(key, _block(i)) for i, key in enumerate(KEYS[:3])])
        node_dirs("b")
        with _kv_store("kvs", "16M", peers=[listen]) as b_proc, refstore.Client("kvs") as b:
            assert b_proc is not None
            assert [peer.address for peer in b.peers()] == [listen]
            refs = b.lookup(KEYS, hold_s=0)
            assert len(refs) == 3  # A's three, fetched into B; A lacks the fourth too
            assert all(ref.node == b.node for ref in refs)
            for i, ref in enumerate(refs):
                assert zlib.crc32(b.get(ref)) == zlib.crc32(_block(i))
            assert b.stats().peer_keys == 3
        assert b_proc.poll() is not None  # the deployment's end stops the master it started
    assert a_proc.poll() is not None
    assert f"peers {listen}" in capsys.readouterr().out


def test_a_running_master_is_reused_and_gets_the_peers_added(node_dirs):
    peer = f"127.0.0.1:{_free_port()}"  # need not be up: a peer that is down is a miss
    node_dirs("a")
    with _kv_store("kvs", "16M") as started:
        with _kv_store("kvs", "16M", peers=[peer]) as reused:
            assert reused is None  # left alone when the deployment ends
            with refstore.Client("kvs") as client:
                assert [status.address for status in client.peers()] == [peer]
                assert client.lookup(KEYS, hold_s=0) == []
        assert started.poll() is None
    assert started.poll() is not None


def test_the_store_pdserve_starts_can_have_a_disk_tier(node_dirs, tmp_path):
    node_dirs("a")
    with _kv_store("kvs", "16M", disk=str(tmp_path / "tier"), disk_size="64M") as proc:
        assert proc is not None
        with refstore.Client("kvs") as client:
            assert client.stats().disk_capacity == 64 << 20
    assert list((tmp_path / "tier").iterdir())  # its file (and, after a clean stop, its index)
