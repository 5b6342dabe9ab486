"""Fault injection: failing, delayed and dropped operations, dead clients, killed masters."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import refstore
from refstore import Client, MasterThread, faults, start_master_process


def test_parse_rejects_bad_rules():
    assert faults.parse("get:delay=0.5@0.25#3; *:drop")[0].remaining == 3
    for bad in ("get", "get:explode", "get:delay=abc", "get:fail@2"):
        with pytest.raises(refstore.CallerError, match="bad fault rule"):
            faults.parse(bad)


def test_fail_delay_and_drop_then_recover(client):
    ref = client.put(np.arange(100))
    faults.inject(client, "get:fail#1")
    with pytest.raises(refstore.InjectedFault, match="injected failure of get"):
        client.get(ref)
    np.testing.assert_array_equal(client.get(ref), np.arange(100))  # the rule fired once

    faults.inject(client, "get:delay=0.3#1")
    started = time.monotonic()
    client.get(ref)
    assert time.monotonic() - started >= 0.3

    client.timeout = 0.5
    faults.inject(client, "alloc:drop#1")
    with pytest.raises(refstore.MasterUnavailable, match="RpcTimeout"):
        client.put(np.ones(10))
    assert client.stats().objects == 1  # a dropped operation changed nothing
    np.testing.assert_array_equal(client.get(client.put(np.ones(10))), 1)
    faults.clear(client)


def test_master_reads_plan_from_environment(no_leaks, monkeypatch):
    monkeypatch.setenv("REFSTORE_FAULTS", "alloc:fail#1")  # the name the README documents
    with MasterThread("envfaults", "4M"), Client("envfaults") as c:
        with pytest.raises(refstore.InjectedFault):
            c.put(b"x")
        assert bytes(c.get(c.put(b"y"))) == b"y"


DYING_CLIENT = """
import os, pickle, sys
import numpy as np
from refstore import Client
c = Client("test")
refs = [c.put(np.full(4 << 20, i, np.uint8), ttl=float(sys.argv[1])) for i in range(3)]
c.flush()  # every put sealed at the master
sys.stdout.buffer.write(pickle.dumps(refs))
sys.stdout.flush()
os._exit(0)  # dies holding its leases: no release, no close
"""


def test_dead_client_memory_reclaimed_after_ttl(clock, client):
    out = subprocess.run(
        [sys.executable, "-c", DYING_CLIENT, "1.0"], capture_output=True, check=True, timeout=60
    ).stdout
    refs = pickle.loads(out)
    assert client.stats().used >= 12 << 20
    np.testing.assert_array_equal(client.get(refs[2])[:10], 2)  # readable until the TTL
    assert client.wait_gone(refs[0], timeout=0) is None
    clock.catch_up(2.0)  # its leases ran on the real clock, in its own process
    for ref in refs:
        reason, _since = client.wait_gone(ref, timeout=0)
        assert reason == "lease expired"
    stats = client.stats()
    assert stats.used == 0
    assert stats.expirations == 3
    with pytest.raises(refstore.ObjectExpired, match="lease expired since"):
        client.get(refs[0])


DYING_FAST_CLIENT = """
import os, pickle, sys
import numpy as np
from refstore import Client
c = Client("test")
refs = [c.put(np.full(1 << 16, i, np.uint8), ttl=1.0) for i in range(16)]
# Its last reserve calls may not have reached the master yet: wait for their answers, so that
# the master holds every block it reserved, and count those no put used.
assert c.flush(timeout=30)
stock = c._link.current.reservations
with c._reservation_landed:  # a reserve call's future is done before its blocks are stocked
    assert c._reservation_landed.wait_for(lambda: not any(stock.in_flight.values()), 30)
    unused = sum(map(len, stock.stock.values()))
sys.stdout.buffer.write(pickle.dumps((refs, c.counters["fast_puts"], unused)))
sys.stdout.flush()
os._exit(0)  # dies holding leases on objects in reserved blocks, and unused reservations
"""


def test_dead_client_reserved_blocks_come_back_after_its_disconnect(clock, client, disconnects):
    """Its puts into reserved blocks never told the master anything: the master adopts them when
    the client's connection ends (their leases then run), and frees the blocks it never used
    after the disconnect grace, long before their write deadline."""
    started = clock.now
    out = subprocess.run(
        [sys.executable, "-c", DYING_FAST_CLIENT], capture_output=True, check=True, timeout=60
    ).stdout
    refs, fast_puts, unused = pickle.loads(out)
    assert fast_puts >= 8
    assert unused >= 1  # a put leaves the stock (or its refill on the way) never empty
    assert disconnects.acquire(timeout=30)
    assert client.stats().reserved == unused  # blocks it reserved and never used
    # Past its leases (on the real clock, in its process) and the grace, not the write deadline.
    clock.catch_up(refstore.state.DISCONNECT_GRACE_S + 1.0)
    assert clock.now - started < refstore.state.WRITE_TIMEOUT_S
    for ref in refs:
        reason, _since = client.wait_gone(ref, timeout=0)
        assert reason == "lease expired"
    stats = client.stats()
    assert stats.expirations == len(refs)
    assert stats.reserved == stats.used == 0


async def _drop_connection(rpc_client) -> None:
    conn = rpc_client._conn
    conn.abort("dropped by the test")
    await conn.closed


def test_blocks_reserved_on_a_lost_connection_are_never_written(clock, client, disconnects):
    """The master frees a disconnected client's unused blocks after a grace period; a client
    whose connection dropped and came back (same process, same master) must not use them."""
    data = np.arange(30_000, dtype=np.int32)
    for _ in range(6):  # a full stock of this size class, reserved on the first connection
        client.release(client.put(data))
        client.flush()
    client._link.current.rpc.loop.run(_drop_connection(client._link.current.rpc._client))
    first = client.put(data)  # not connected: allocates, and reconnects
    assert client._link.current.rpc.connections_opened == 2
    assert disconnects.acquire(timeout=30)
    clock.advance(refstore.state.DISCONNECT_GRACE_S + 1.0)  # frees the first connection's blocks
    refs = [first] + [client.put(data + i) for i in range(1, 12)]
    assert client.counters["fast_puts"] >= 4 + 6  # fast again, with blocks of the new connection
    with Client("test") as other:
        for i, ref in enumerate(refs):
            through_master = refstore.Ref(ref.pool, ref.oid, ref.nbytes, ref.node, -1)
            np.testing.assert_array_equal(other.get(through_master), data + i)
        assert other.stats().objects == len(refs)


def test_killed_master_restart_gives_clear_error_and_clients_recover(no_leaks):
    proc = start_master_process("crashy", "16M")
    try:
        client = Client("crashy", timeout=5.0)
        old = client.put(np.arange(1000))
        view = client.get(old)
        faults.kill_master(client)
        assert proc.wait(timeout=30) == -9
        with pytest.raises(refstore.MasterUnavailable, match="no refstore master 'crashy'"):
            client.put(b"nobody home")
        proc = start_master_process("crashy", "16M")
        with pytest.raises(refstore.MasterRestarted, match="master restarted since"):
            client.get(old)
        np.testing.assert_array_equal(view, np.arange(1000))  # old views stay valid memory
        new = client.put(np.arange(5))  # recovered: works against the new master
        np.testing.assert_array_equal(client.get(new), np.arange(5))
        client.release([old, new])  # the dead master's ref is skipped, not an error
        # A client that never saw the old master knows too (the discovery file keeps history).
        with Client("crashy") as fresh, pytest.raises(refstore.MasterRestarted):
            fresh.get(old)
        client.shutdown_master("test done")
        assert proc.wait(timeout=30) == 0
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_autostart_starts_one_master_and_stop_ends_it(no_leaks):
    with refstore.connect("auto", autostart=True, pool_size="8M") as a:
        with refstore.connect("auto", autostart=True, pool_size="8M") as b:
            assert a.epoch == b.epoch
            assert bytes(b.get(a.put(b"shared"))) == b"shared"
        subprocess.run(
            [sys.executable, "-m", "refstore.cli", "stop", "--name", "auto"], check=True, timeout=60
        )
    with pytest.raises(refstore.MasterUnavailable):
        Client("auto")


def _in_threads(worker, count: int) -> None:
    """Run ``worker(i)`` for i in range(count) on as many threads, and wait for all of them."""
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_payloads_never_corrupted_under_faults_and_eviction(no_leaks):
    """Two writer threads churn cache entries through a small pool (constant eviction) while the
    master delays and fails operations at random; every successful get must match its checksum."""
    with MasterThread("churn", "24M", faults="*:delay=0.002@0.2;alloc:fail@0.05;get:fail@0.05"):
        errors: list[str] = []
        checked = [0, 0]

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            with Client("churn") as c:
                live: list[tuple[refstore.Ref, int]] = []
                for _ in range(150):
                    data = rng.integers(0, 255, int(rng.integers(1, 2 << 20)), dtype=np.uint8)
                    with contextlib.suppress(refstore.InjectedFault, refstore.PoolFull):
                        live.append((c.put(data, ttl=None), zlib.crc32(data)))
                    for ref, crc in live[-8:]:
                        try:
                            # A lease while reading: a view is only valid while its object lives,
                            # and the other thread's puts evict cache entries at any moment.
                            c.extend(ref, 30)
                            got = c.get(ref)
                        except (refstore.ObjectEvicted, refstore.InjectedFault):
                            continue
                        checked[seed] += 1
                        if zlib.crc32(got) != crc:
                            errors.append(f"corrupted {ref}")
                        del got
                        c.extend(ref, None)  # a cache entry again

        _in_threads(worker, 2)
        assert not errors
        assert min(checked) > 100


def test_fast_paths_never_corrupt_under_churn(no_leaks):
    """As above without faults, so puts take reserved blocks and gets read headers without the
    master, while eviction recycles blocks under them."""
    with MasterThread("churnfast", "8M"):
        errors: list[str] = []
        counters: list[dict[str, int]] = []
        dead_refs: list[list[refstore.Ref]] = []

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            with Client("churnfast", reserve_budget=1 << 20) as c:
                live: list[tuple[refstore.Ref, int]] = []
                dead: list[refstore.Ref] = []
                for _ in range(300):
                    size = int(rng.choice([60_000, 100_000, 200_000, 300_000]))
                    data = rng.integers(0, 255, size, dtype=np.uint8)
                    with contextlib.suppress(refstore.PoolFull):
                        live.append((c.put(data, ttl=None), zlib.crc32(data)))
                    for ref, crc in live[-6:]:
                        try:
                            c.extend(ref, 30)
                            got = c.get(ref)
                        except refstore.ObjectEvicted:
                            dead.append(ref)
                            continue
                        if zlib.crc32(got) != crc:
                            errors.append(f"corrupted {ref}")
                        del got
                        c.extend(ref, None)
                    # Refs of evicted objects (their blocks reused since) must be refused, never
                    # read as whatever lives there now.
                    for ref in dead[-4:]:
                        with contextlib.suppress(refstore.ObjectEvicted):
                            c.get(ref)
                            errors.append(f"evicted {ref} still readable")
                    live = live[-60:]
                counters.append(dict(c.counters))
                dead_refs.append(dead)

        _in_threads(worker, 2)
        assert not errors
        assert all(c["fast_puts"] > 100 and c["fast_gets"] > 500 for c in counters), counters
        assert sum(len(d) for d in dead_refs) > 50  # eviction did recycle blocks


def test_get_overtaking_a_delayed_seal_waits_for_it(master):
    with Client("test") as writer, Client("test") as reader:
        faults.inject(writer, "seal:delay=0.3#1")
        ref = writer.put(np.arange(50))  # returns before the (delayed) seal is applied
        np.testing.assert_array_equal(reader.get(ref), np.arange(50))
        assert writer.stats().puts == 1
