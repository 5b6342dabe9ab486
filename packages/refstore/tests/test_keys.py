"""Keyed objects through a real master: put_keyed, lookup, holds, key events, faults."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import refstore
from refstore import Client, KeysLost, KeysRemoved, KeysStored, MasterThread, faults


def _block(i: int, nbytes: int = 4096) -> np.ndarray:
    return np.full(nbytes, i % 251, np.uint8)


def _wait_events(sub, want: int) -> list:
    """Take events until ``want`` keys were reported (waiting on the subscription, no sleep)."""
    events, seen = [], 0
    while seen < want:
        assert sub.wait(5.0), f"no key event after {events}"
        got = sub.take()
        events += got
        seen += sum(len(getattr(e, "keys", ())) for e in got)
    return events


def test_put_keyed_then_lookup_and_get_read_the_bytes_back(client):
    keys = [b"blk-%d" % i for i in range(5)]
    refs = client.put_keyed([(k, _block(i)) for i, k in enumerate(keys)])
    assert all(isinstance(r, refstore.Ref) for r in refs)
    found = client.lookup(keys)
    assert found == refs
    for i, ref in enumerate(found):
        np.testing.assert_array_equal(client.get(ref), _block(i))
    assert client.lookup([keys[0], keys[1], b"missing", keys[3]]) == refs[:2]  # a prefix
    client.unhold(found)
    stats = client.stats()
    assert (stats.keys, stats.held) == (5, 0)
    assert (stats.key_hits, stats.key_misses) == (7, 2)
    assert stats.evictable == 5  # ttl=None: cache entries
    assert client.put_keyed([]) == []


def test_memoryviews_go_in_and_a_second_writer_gets_the_first_ones_ref(master):
    with Client("test") as one, Client("test") as two:
        [first] = one.put_keyed([(b"k", memoryview(b"first writer"))])
        [second] = two.put_keyed([(b"k", memoryview(b"second writer"))])
        assert second == first
        assert bytes(two.get(second)) == b"first writer"
        assert one.stats().key_dedupes == 1
        assert one.stats().objects == 1


def test_release_unbinds_and_a_full_pool_stores_what_fits(no_leaks):
    with MasterThread("small", "1M"), Client("small") as c:
        pinned = c.put(np.zeros(600 << 10, np.uint8), ttl=60)  # leased: never evicted
        refs = c.put_keyed([(b"%d" % i, _block(i, 100 << 10)) for i in range(6)], ttl=60)
        stored = [r for r in refs if r is not None]
        assert 0 < len(stored) < 6
        assert refs[: len(stored)] == stored  # in order, None for the rest
        assert len(c.lookup([b"%d" % i for i in range(6)])) == len(stored)
        c.release(stored[0])
        assert c.lookup([b"0"]) == []
        assert c.stats().keys == len(stored) - 1
        c.release(pinned)


def test_a_hold_keeps_a_looked_up_cache_entry_until_unhold(master):
    with Client("test") as c:
        [ref] = c.put_keyed([(b"held", _block(1, 8 << 20))])
        assert c.lookup([b"held"], hold_s=60.0) == [ref]
        assert c.stats().held == 1
        # Fill the pool with cache entries: everything else can go, the held one stays.
        for i in range(12):
            c.put(_block(i, 8 << 20), ttl=None)
        assert c.lookup([b"held"], hold_s=0) == [ref]
        np.testing.assert_array_equal(c.get(ref), _block(1, 8 << 20))
        c.unhold([ref])
        assert c.stats().held == 0
        for i in range(12):
            c.put(_block(i, 8 << 20), ttl=None)
        assert c.lookup([b"held"]) == []  # an ordinary cache entry again: evicted


def test_key_events_stored_removed_and_close(client, master):
    sub = client.subscribe_keys()
    assert sub.take() == []
    refs = client.put_keyed([(b"a", b"1"), (b"b", b"2")])
    assert _wait_events(sub, 2) == [KeysStored([b"a", b"b"])]
    client.put_keyed([(b"a", b"dup")])  # bound already: no event
    client.release(refs[0])
    faults.evict_keys(client, [b"b"])
    events = _wait_events(sub, 2)
    assert events == [KeysRemoved([b"a"], "released"), KeysRemoved([b"b"], "evicted")]
    sub.close()
    sub.close()  # idempotent
    assert not sub.alive


def test_client_close_closes_its_subscriptions_and_leaves_no_thread(master):
    before = set(threading.enumerate())
    c = Client("test")
    subs = [c.subscribe_keys(), c.subscribe_keys()]
    c.put_keyed([(b"x", b"y")])
    for sub in subs:
        assert _wait_events(sub, 1) == [KeysStored([b"x"])]
    c.close()
    assert not any(sub.alive for sub in subs)
    assert set(threading.enumerate()) <= before


def test_a_subscriber_that_does_not_read_gets_keys_lost_first(client):
    sub = client.subscribe_keys()
    sub._limit = 3  # the reader's buffer: a few keys
    client.put_keyed([(b"%d" % i, b"v") for i in range(4)])
    assert sub.wait(5.0)
    client.put_keyed([(b"late", b"v")])
    events = _wait_events(sub, 1)
    assert events[0] == KeysLost()
    assert events[1:] == [KeysStored([b"late"])]
    sub.close()


def test_a_master_that_goes_away_ends_the_subscription_with_keys_lost(no_leaks):
    with MasterThread("gone", "4M") as m, Client("gone") as c:
        sub = c.subscribe_keys()
        m.close()
        assert sub.wait(5.0)
        assert sub.take() == [KeysLost()]
        assert not sub.alive
        sub.close()


def test_bad_keys_and_holds_are_caller_errors(client):
    for bad in (b"", b"k" * 65, "text"):
        with pytest.raises(refstore.CallerError):
            client.put_keyed([(bad, b"v")])
        with pytest.raises(refstore.CallerError):
            client.lookup([bad])
    with pytest.raises(refstore.CallerError, match="hold_s"):
        client.lookup([b"k"], hold_s=float("nan"))
    with pytest.raises(refstore.CallerError, match="pairs"):
        client.put_keyed([b"k"])
    assert client.stats().objects == 0


def test_lookup_and_put_keyed_faults(client):
    client.put_keyed([(b"k", b"v")])
    client.timeout = 0.5
    faults.inject(client, "lookup:drop#1")
    with pytest.raises(refstore.MasterUnavailable, match="RpcTimeout"):
        client.lookup([b"k"])
    faults.inject(client, "lookup:fail#1; put_keyed:fail#1")
    with pytest.raises(refstore.InjectedFault):
        client.lookup([b"k"])
    with pytest.raises(refstore.InjectedFault):
        client.put_keyed([(b"other", b"v")])
    assert client.stats().objects == 1  # a failed operation changed nothing
    faults.inject(client, "lookup:delay=0.2#1")
    assert len(client.lookup([b"k"])) == 1
    faults.clear(client)
    assert len(client.put_keyed([(b"other", b"v")])) == 1


def test_an_ignored_hold_lets_an_object_go_between_lookup_and_get(client):
    [ref] = client.put_keyed([(b"k", b"payload")])
    faults.inject(client, "hold:ignore")
    assert client.lookup([b"k"], hold_s=60.0) == [ref]
    assert client.stats().held == 0
    faults.clear(client)
    assert client.lookup([b"k"], hold_s=60.0) == [ref]
    faults.evict_keys(client, [b"k"])  # holds notwithstanding
    with pytest.raises(refstore.ObjectEvicted):
        client.get(ref)
    assert client.lookup([b"k"]) == []


def test_a_clients_holds_end_when_it_disconnects(master, disconnects):
    """Holds are per connection: one that is gone cannot unhold, nor can a lookup that
    answered after its caller gave up and left (a timeout) leave a hold behind."""
    with Client("test") as observer:
        observer.put_keyed([(b"k", b"v")])
        base = observer.stats().clients
        holder = Client("test")
        holder.lookup([b"k"], hold_s=60.0)
        assert observer.stats().held == 1
        connections = observer.stats().clients - base
        holder.close()
        for _ in range(connections):
            assert disconnects.acquire(timeout=10)
        assert observer.stats().held == 0

        # Two lookups wait out the same delay; the impatient one's comes back first.
        faults.inject(observer, "lookup:delay=0.5#2")
        impatient = Client("test", timeout=0.1)
        impatient.stats()  # connected
        connections = observer.stats().clients - base
        with pytest.raises(refstore.MasterUnavailable):
            impatient.lookup([b"k"], hold_s=60.0)
        impatient.close()
        for _ in range(connections):
            assert disconnects.acquire(timeout=10)
        hits = observer.stats().key_hits
        assert observer.lookup([b"k"], hold_s=0) != []  # after the impatient one's ran
        stats = observer.stats()
        assert (stats.key_hits, stats.held) == (hits + 2, 0)


def test_stats_count_the_connections_and_the_subscribers(master, disconnects):
    with Client("test") as observer:
        base = observer.stats()
        assert base.clients >= 1  # the observer itself
        c = Client("test")
        sub = c.subscribe_keys()
        now = observer.stats()
        assert now.subscribers == base.subscribers + 1
        assert now.clients > base.clients
        c.close()
        assert not sub.alive
        for _ in range(now.clients - base.clients):
            assert disconnects.acquire(timeout=10)
        after = observer.stats()
        assert (after.clients, after.subscribers) == (base.clients, base.subscribers)
