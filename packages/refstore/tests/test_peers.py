"""Peer masters: a lookup that misses here continues at a peer, and the keys found there are
fetched and stored here. Two masters in this process on loopback (kvt and raw-RPC paths), a
master started with ``--peer``, faults at the peer, and two masters in two network namespaces
(skipped without root or ``ip``)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import zlib

import numpy as np
import pytest
import refstore
from refstore import Client, MasterThread, faults, start_master_process
from test_remote import _netns_available, _two_namespaces

KEYS = [b"chain-%02d" % i for i in range(8)]
PATIENT = {"peer_timeout_s": 30.0, "peer_fetch_timeout_s": 60.0}  # a loaded box never misses
HASTY = {"peer_timeout_s": 0.3, "peer_fetch_timeout_s": 0.6}  # faults end in a fraction of this


def _block(i: int) -> np.ndarray:
    """1-4 MiB of bytes that differ per key."""
    nbytes = (1 << 20) + i * (384 << 10) + 4 * i
    return np.random.default_rng(i).integers(0, 255, nbytes, dtype=np.uint8)


@contextlib.contextmanager
def _two_masters(mode: str = "kvt", *, clock=None, pool: str = "64M", **peer_options):
    """A (the peer, holding keys) and B (peers with A), each with a client."""
    on_clock = {} if clock is None else {"clock": clock.monotonic, "wall_clock": clock.time}
    with (
        MasterThread("node-a", "64M", remote=mode) as a,
        MasterThread(
            "node-b", pool, remote=mode, peers=[a.address], **on_clock, **peer_options
        ) as b,
        Client("node-a", timeout=20.0) as ca,
        Client("node-b", timeout=20.0) as cb,
    ):
        if clock is not None:
            clock.masters.append(b)
        yield a, b, ca, cb


@pytest.mark.parametrize("mode", ["kvt", "rpc"])
def test_keys_put_on_a_are_found_through_b_and_then_hit_at_b(no_leaks, mode):
    with _two_masters(mode, **PATIENT) as (_a, _b, ca, cb):
        ca.put_keyed([(k, _block(i)) for i, k in enumerate(KEYS[:5])])
        cb.put_keyed([(KEYS[0], _block(0)), (KEYS[1], _block(1))])  # B's own run
        baseline = cb.stats()
        refs = cb.lookup(KEYS, hold_s=30.0)
        assert len(refs) == 5  # B's two, then A's continuation; A lacks the rest too
        assert all(ref.node == cb.node and ref.pool == cb.epoch for ref in refs)
        for i, ref in enumerate(refs):
            got = cb.get(ref)
            assert zlib.crc32(got) == zlib.crc32(_block(i))  # byte-identical to A's
            assert got.nbytes == _block(i).nbytes
        stats = cb.stats()
        assert (stats.peer_lookups, stats.peer_hits, stats.peer_keys) == (1, 1, 3)
        assert stats.peer_bytes == sum(_block(i).nbytes for i in (2, 3, 4))
        assert stats.objects == baseline.objects + 3
        assert (stats.key_hits, stats.key_misses, stats.held) == (5, 3, 5)
        [peer] = stats.peers
        assert (peer.address, peer.state, peer.hits, peer.keys) == (ca.address, "up", 1, 3)
        assert ca.stats().peer_served == 3
        assert cb.counters["fast_gets"] == 5  # the copies carry headers of their own

        again = cb.lookup(KEYS[:5], hold_s=30.0)  # all local now: no peer asked
        assert again == refs
        stats = cb.stats()
        assert (stats.peer_lookups, stats.peer_keys) == (1, 3)
        assert ca.stats().peer_served == 3

        cb.unhold(refs)
        assert cb.stats().held == 0
        assert ca.stats().held == 0  # a peer's lookup holds nothing there
        cb.release(refs)
        assert cb.stats().used == 0


def test_copies_outlive_the_peer_evicting_and_restarting(no_leaks):
    with _two_masters(**PATIENT) as (a, b, ca, cb):
        ca.put_keyed([(k, _block(i)) for i, k in enumerate(KEYS[:3])])
        refs = cb.lookup(KEYS[:3], hold_s=0)
        assert len(refs) == 3
        faults.evict_keys(ca, KEYS[:3])
        assert ca.lookup(KEYS[:3]) == []
        assert cb.lookup(KEYS[:3], hold_s=0) == refs  # B's copies: no peer asked
        a.close()  # A gone altogether (its address refuses from now on)
        assert cb.lookup(KEYS[:3], hold_s=0) == refs
        assert zlib.crc32(cb.get(refs[2])) == zlib.crc32(_block(2))
        assert cb.stats().peer_lookups == 1
        assert b.master.peers.addresses == [a.address]


def test_a_peer_that_is_down_is_a_miss_logged_once_and_backed_off(no_leaks, clock, caplog):
    with _two_masters(clock=clock, **HASTY) as (a, _b, _ca, cb):
        cb.put_keyed([(KEYS[0], _block(0))])
        a.close()
        with caplog.at_level(logging.WARNING, "refstore.master"):
            assert len(cb.lookup(KEYS, hold_s=5.0)) == 1  # the local run only
            assert len(cb.lookup(KEYS, hold_s=5.0)) == 1  # backing off: A not asked
        lines = [r.getMessage() for r in caplog.records if a.address in r.getMessage()]
        assert len(lines) == 1, lines
        assert "is a miss" in lines[0]
        [peer] = cb.stats().peers
        assert (peer.state, peer.asked, peer.failures) == ("down", 1, 1)
        clock.advance(peer.retry_in_s)
        assert len(cb.lookup(KEYS, hold_s=0)) == 1  # probed again, still down
        [peer] = cb.stats().peers
        assert (peer.asked, peer.failures) == (2, 2)
        cb.unhold(cb.lookup(KEYS[:1]))
        assert cb.stats().held == 0


# Each fault is set on A, the peer: what B's lookup meets there.
FAULTS = {
    "refuses": ("peer_lookup:fail", "peer_lookup:fail"),
    "stalls before answering": ("peer_lookup:drop", "peer_lookup:drop"),
    "stalls in the transfer": ("send_to:drop", "read_range:drop"),
    "drops mid-transfer": ("send_to:cut", "read_range:cut"),
}


@pytest.mark.parametrize("mode", ["kvt", "rpc"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_peer_leaves_the_local_run_and_nothing_behind(no_leaks, monkeypatch, mode, fault):
    spec = FAULTS[fault][mode == "rpc"]
    # A cut in a DATA frame (kvt's TCP path; the same-host path reads the object regardless).
    monkeypatch.setenv("KVT_TRANSPORT", "tcp")
    with _two_masters(mode, **HASTY) as (_a, _b, ca, cb):
        ca.put_keyed([(k, _block(i)) for i, k in enumerate(KEYS[:4])])
        cb.put_keyed([(KEYS[0], _block(0))])
        baseline = cb.stats()
        faults.inject(ca, spec)
        # Within the client's timeout (the master never hangs on a peer): B's own key only.
        refs = cb.lookup(KEYS, hold_s=30.0)
        assert len(refs) == 1
        assert zlib.crc32(cb.get(refs[0])) == zlib.crc32(_block(0))
        stats = cb.stats()
        assert (stats.used, stats.objects, stats.keys) == (
            baseline.used,
            baseline.objects,
            baseline.keys,
        )
        [peer] = stats.peers
        assert (peer.state, peer.failures, peer.keys) == ("down", 1, 0)
        assert (
            spec.split(":")[0] in peer.last_error
            or "transfer" in peer.last_error
            or ("moving" in peer.last_error)
        )
        cb.unhold(refs)
        cb.release(refs)
        assert (cb.stats().held, cb.stats().used) == (0, 0)
        assert ca.stats().held == 0


def test_a_peer_that_refused_is_asked_again_once_its_backoff_passed(no_leaks, clock):
    with _two_masters(clock=clock, **PATIENT) as (_a, _b, ca, cb):
        ca.put_keyed([(k, _block(i)) for i, k in enumerate(KEYS[:4])])
        faults.inject(ca, "peer_lookup:fail")
        assert cb.lookup(KEYS, hold_s=0) == []
        faults.clear(ca)
        assert cb.lookup(KEYS, hold_s=0) == []  # backing off: not asked
        [peer] = cb.stats().peers
        assert (peer.state, peer.asked, peer.failures) == ("down", 1, 1)
        assert "InjectedFault" in peer.last_error
        clock.advance(peer.retry_in_s)
        refs = cb.lookup(KEYS, hold_s=0)
        assert [zlib.crc32(cb.get(r)) for r in refs] == [zlib.crc32(_block(i)) for i in range(4)]
        [peer] = cb.stats().peers
        assert (peer.state, peer.asked, peer.keys) == ("up", 2, 4)


def test_no_room_here_answers_the_local_run(no_leaks):
    with _two_masters(pool="8M", **PATIENT) as (_a, _b, ca, cb):
        ca.put_keyed([(k, _block(i)) for i, k in enumerate(KEYS[:3])])
        cb.put_keyed([(KEYS[0], _block(0))], ttl=60)
        filler = cb.put(np.zeros(6 << 20, np.uint8), ttl=60)  # leased: not evictable
        baseline = cb.stats()
        refs = cb.lookup(KEYS, hold_s=0)
        assert len(refs) == 1
        stats = cb.stats()
        assert (stats.used, stats.peer_keys, stats.peer_failures) == (baseline.used, 0, 0)
        assert stats.peers[0].misses == 1  # A answered; nothing could be stored here
        cb.release([filler, *refs])


def test_peers_are_added_and_removed_at_run_time(no_leaks):
    with (
        MasterThread("node-a", "16M") as a,
        MasterThread("node-b", "16M", **PATIENT) as b,
        Client("node-a") as ca,
        Client("node-b") as cb,
    ):
        ca.put_keyed([(KEYS[0], b"from a")])
        assert cb.peers() == []
        assert cb.lookup(KEYS[:1]) == []
        [peer] = cb.peers(add=[a.address, b.address])  # itself is skipped
        assert (peer.address, peer.state) == (a.address, "up")
        [ref] = cb.lookup(KEYS[:1], hold_s=0)
        assert bytes(cb.get(ref)) == b"from a"
        assert cb.peers(remove=[a.address]) == []
        with pytest.raises(refstore.CallerError, match="host:port"):
            cb.peers(add=["no-port"])
        b.update_peers(add=[a.address])
        assert [p.address for p in cb.peers()] == [a.address]


def test_a_served_master_takes_its_peers_from_the_command_line(no_leaks):
    with MasterThread("node-a", "16M") as a, Client("node-a") as ca:
        ca.put_keyed([(KEYS[0], b"k0"), (KEYS[1], b"k1")])
        proc = start_master_process(
            "node-b", "16M", extra_args=["--peer", a.address, "--peer-timeout", "30"]
        )
        try:
            with Client("node-b") as cb:
                refs = cb.lookup(KEYS, hold_s=0)
                assert [bytes(cb.get(r)) for r in refs] == [b"k0", b"k1"]
                assert cb.stats().peers[0].keys == 2
                cb.shutdown_master()
        finally:
            proc.wait(timeout=30)


NS_CLIENT = """
import pickle, sys, zlib
import numpy as np
from refstore import Client
keys = [b"ns-%d" % i for i in range(4)]
blocks = [np.random.default_rng(i).integers(0, 255, (2 << 20) + i, np.uint8) for i in range(4)]
with Client(sys.argv[1]) as c:
    if sys.argv[2] == "put":
        c.put_keyed(list(zip(keys, blocks)))
    else:
        c.put_keyed([(keys[0], blocks[0])])
        refs = c.lookup(keys, hold_s=0)
        assert [zlib.crc32(c.get(r)) for r in refs] == [zlib.crc32(b) for b in blocks]
        print(c.stats().peer_keys)
"""


@pytest.mark.skipif(_netns_available() is not None, reason=str(_netns_available()))
def test_peer_lookup_across_network_namespaces(no_leaks):
    """B (namespace B) peers with A (namespace A) by A's address on the veth pair: A's keys
    reach B only through it."""
    with _two_namespaces() as ((ns_a, ip_a), (ns_b, ip_b)):
        procs = []
        try:
            procs.append(
                start_master_process(
                    "ns-a",
                    "64M",
                    extra_args=["--host", ip_a, "--port", "7411", "--remote", "kvt"],
                    prefix=["ip", "netns", "exec", ns_a],
                )
            )
            procs.append(
                start_master_process(
                    "ns-b",
                    "64M",
                    extra_args=[
                        *("--host", ip_b, "--remote", "kvt", "--peer", f"{ip_a}:7411"),
                        *("--peer-timeout", "30", "--peer-fetch-timeout", "60"),
                    ],
                    prefix=["ip", "netns", "exec", ns_b],
                )
            )
            for ns, name, what in ((ns_a, "ns-a", "put"), (ns_b, "ns-b", "lookup")):
                run = subprocess.run(
                    ["ip", "netns", "exec", ns, sys.executable, "-c", NS_CLIENT, name, what],
                    capture_output=True,
                    check=False,
                    timeout=120,
                )
                assert run.returncode == 0, run.stderr.decode()[-2000:]
            assert run.stdout.strip() == b"3"
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)


def test_a_peer_promotes_what_it_spilled_to_disk_before_answering(no_leaks, tmp_path):
    """A (8 MiB of memory, a disk tier) spilled the oldest of ten keys; B's lookup of them finds
    them all: A promotes them from disk, then B fetches them, byte-identical."""
    keys = [b"spill-%02d" % i for i in range(10)]
    blocks = {i: _block(i)[: 1 << 20] for i in range(10)}  # 1 MiB each
    with (
        MasterThread("node-a", "8M", remote="kvt", disk=tmp_path / "tier", disk_size="64M") as a,
        MasterThread("node-b", "64M", remote="kvt", peers=[a.address], **PATIENT),
        Client("node-a", timeout=20.0) as ca,
        Client("node-b", timeout=20.0) as cb,
    ):
        for i in range(10):  # one by one: later puts evict (and spill) earlier ones
            assert ca.put_keyed([(keys[i], blocks[i])]) != [None]
        a.flush_disk()
        spilled = ca.stats()
        assert spilled.disk_keys >= 3
        assert spilled.disk_reads == 0

        refs = cb.lookup(keys[:3], hold_s=30.0)
        assert len(refs) == 3
        for i, ref in enumerate(refs):
            assert zlib.crc32(cb.get(ref)) == zlib.crc32(blocks[i])
        assert ca.stats().disk_hits == 3  # promoted at A for B's question
        assert cb.stats().peer_keys == 3
        cb.unhold(refs)
