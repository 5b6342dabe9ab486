from __future__ import annotations

import gc
import math
import pickle
import threading
import time

import numpy as np
import pytest
import refstore
import torch
from refstore import Client, MasterThread, start_master_process
from simple_rpc import SyncClient


def test_numpy_roundtrip_is_zero_copy_and_read_only(client):
    a = np.random.default_rng(0).standard_normal((256, 33)).astype(np.float32)
    ref = client.put(a)
    v1, v2 = client.get(ref), client.get(ref)
    np.testing.assert_array_equal(v1, a)
    assert not v1.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        v1[0, 0] = 1.0
    w = client.get(ref, writable=True)
    w[0, 0] = 42.0  # writes go to the shared object: every view sees them (zero copy)
    assert v1[0, 0] == 42.0
    assert v2[0, 0] == 42.0
    raw = client.get(client.put(b"abc"))
    assert raw.readonly
    assert bytes(raw) == b"abc"
    assert client.get(ref, as_="numpy").flags.writeable is False


def test_non_contiguous_and_odd_dtypes(client):
    a = np.arange(100, dtype=np.int16).reshape(10, 10)[:, ::3]
    np.testing.assert_array_equal(client.get(client.put(a)), a)
    s = np.zeros(3, dtype=[("x", "<i4"), ("y", "<f8")])
    s["y"] = [1.5, 2.5, 3.5]
    np.testing.assert_array_equal(client.get(client.put(s)), s)
    empty = np.empty((0, 4), np.float64)
    assert client.get(client.put(empty)).shape == (0, 4)


TORCH_DTYPES = [getattr(torch, name) for name in refstore.header.DLPACK_TYPES] + [
    torch.float8_e4m3fn,  # no DLPack code here: the as_strided way
    torch.complex32,
]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_layouts_of_tensors_are_remembered_per_torch_dtype(client):
    """Same-shape puts reuse one remembered layout per dtype. DLPack does not tell every torch
    dtype apart (int2 and int8 are both 8-bit ints there), so the dtype itself must key it."""
    dtypes = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
    refs = {}
    for dtype in dtypes:
        try:
            tensor = torch.zeros(4, dtype=dtype)
        except (RuntimeError, TypeError):  # dtypes torch cannot even make zeros of
            continue
        refs[dtype] = client.put(tensor)
    assert torch.int2 in refs
    assert torch.int8 in refs
    for dtype, ref in refs.items():
        assert client.get(ref).dtype == dtype


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_roundtrip(client, dtype):
    t = (torch.arange(24) % 3).to(torch.float32).to(dtype).reshape(2, 3, 4)
    ref = client.put(t)
    got = client.get(ref)
    assert isinstance(got, torch.Tensor)
    assert got.dtype == dtype
    assert got.shape == t.shape
    assert got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))  # bit for bit
    assert client.counters["fast_gets"] == 1
    scratch = client.put(t)
    first, second = client.get(scratch, writable=True), client.get(scratch)
    first.view(torch.uint8).view(-1)[0] ^= 1  # zero-copy: a write shows in every view
    assert torch.equal(second.view(torch.uint8), first.view(torch.uint8))
    assert not torch.equal(second.view(torch.uint8), t.view(torch.uint8))
    if dtype not in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        return
    # The same object as numpy (zero-copy) where numpy has the dtype.
    if dtype != torch.bfloat16:
        np.testing.assert_array_equal(client.get(ref, as_="numpy"), t.numpy())
    # And a numpy object as torch.
    assert torch.equal(client.get(client.put(np.arange(5)), as_="torch"), torch.arange(5))


def test_torch_view_shares_memory(client):
    ref = client.put(torch.zeros(8))
    w = client.get(ref, writable=True)
    w += 1
    assert torch.equal(client.get(ref), torch.ones(8))


def test_torch_tensors_with_view_bits_are_stored_as_their_values(client):
    """Contiguous tensors are copied by one memcpy; tensors whose bytes are not their values
    (conjugate or negative bit set), non-contiguous ones and ones that need grad still land as
    their values."""
    z = torch.complex(torch.arange(6.0), torch.ones(6))
    conj = z.conj()
    negated_imag = conj.imag  # a real tensor with the negative bit set
    assert conj.is_conj()
    assert negated_imag.is_neg()
    strided = torch.arange(40.0).reshape(5, 8)[:, ::3]
    grad = torch.ones(3, requires_grad=True)
    for t in (conj, negated_imag, strided, grad):
        got = client.get(client.put(t))
        assert torch.equal(got, t.detach().resolve_conj().resolve_neg())
    assert torch.equal(client.get(client.put(negated_imag)), -torch.ones(6))


def test_same_shape_puts_reuse_one_layout_and_stay_distinct(client):
    """The layout of a (type, dtype, shape) is encoded once; every put still gets its bytes."""
    tensors = [torch.full((4, 256), float(i)) for i in range(5)]
    refs = [client.put(t) for t in tensors]
    assert len(client._layouts) == 1
    for ref, t in zip(refs, tensors, strict=True):
        assert torch.equal(client.get(ref), t)
    client.put(np.zeros((4, 256), np.float32))  # same shape, another type: its own layout
    client.put(torch.zeros((4, 256), dtype=torch.float64))
    assert len(client._layouts) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_torch_views_keep_the_pool_mapped_after_close(master, dtype):
    """float32 views are DLPack tensors, float8 ones as_strided views: both hold the mapping."""
    c = Client("test")
    ref = c.put(torch.arange(16.0).to(dtype))
    view = c.get(ref)
    c.close()
    gc.collect()
    assert torch.equal(view.float(), torch.arange(16.0))  # the mapping lives while views do
    del view


def test_bytes_and_batches(client):
    payload = {"tokens": np.arange(10, dtype=np.int32), "meta": b"abc", 3: torch.ones(2, 2)}
    ref = client.put(payload)
    got = client.get(ref)
    assert set(got) == {"tokens", "meta", 3}
    np.testing.assert_array_equal(got["tokens"], payload["tokens"])
    assert bytes(got["meta"]) == b"abc"
    assert torch.equal(got[3], payload[3])
    lst = client.get(client.put([b"x" * 100, np.ones(3)]))
    assert isinstance(lst, list)
    assert bytes(lst[0]) == b"x" * 100
    tup = client.get(client.put((memoryview(b"hi"),)))
    assert isinstance(tup, tuple)
    assert bytes(tup[0]) == b"hi"


def test_ref_is_small_and_pickles(client):
    ref = client.put(np.zeros((1024, 1024), np.float32))
    data = pickle.dumps(ref)
    assert len(data) < 200, len(data)
    assert pickle.loads(data) == ref
    np.testing.assert_array_equal(client.get(pickle.loads(data)), 0)


def test_bad_input_is_a_caller_error(client):
    with pytest.raises(refstore.CallerError, match="cannot store"):
        client.put(object())
    with pytest.raises(refstore.CallerError, match="object arrays"):
        client.put(np.array([object()]))
    with pytest.raises(refstore.CallerError, match=r"expected a refstore\.Ref"):
        client.get("nope")
    with pytest.raises(refstore.UnknownObject):
        client.get(refstore.Ref(client.epoch, 10_000, 1, client.node))
    with pytest.raises(refstore.PoolFull):
        client.put(np.zeros(65 << 20, np.uint8))


def test_release_frees_at_once_and_get_says_since_when(client):
    ref = client.put(np.ones(1 << 20, np.uint8))
    assert client.stats().used >= 1 << 20
    before = time.time()
    client.release(ref)
    assert client.stats().used == 0
    with pytest.raises(refstore.ObjectReleased, match="released since") as info:
        client.get(ref)
    assert before <= info.value.since <= time.time()
    client.release(ref)  # idempotent


def test_lease_expires_and_memory_is_reclaimed(clock, client):
    ref = client.put(np.ones(1 << 20, np.uint8), ttl=0.2)
    keep = client.put(np.ones(10, np.uint8), ttl=60)
    clock.advance(0.1)
    assert client.wait_gone(ref, timeout=0) is None
    clock.advance(0.2)
    gone = client.wait_gone(ref, timeout=0)
    assert gone is not None
    assert gone[0] == "lease expired"
    assert gone[1] == clock.wall  # the fake wall clock, when the master freed it
    with pytest.raises(refstore.ObjectExpired, match="lease expired since"):
        client.get(ref)
    stats = client.stats()
    assert stats.objects == 1
    assert stats.expirations == 1
    np.testing.assert_array_equal(client.get(keep), 1)
    assert client.wait_gone(keep, timeout=0) is None


def test_extend_keeps_object_alive(clock, client):
    ref = client.put(b"x", ttl=0.2)
    client.extend(ref, 30)
    clock.advance(29)
    assert client.wait_gone(ref, timeout=0) is None
    client.extend(ref, 0.1)
    clock.advance(0.2)
    assert client.wait_gone(ref, timeout=0)[0] == "lease expired"


def test_eviction_is_lru_of_unleased_and_spares_pins_and_leases(client):
    mib = 1 << 20
    leased = client.put(np.full(16 * mib, 1, np.uint8))  # leased: never evicted
    pinned = client.put(np.full(8 * mib, 2, np.uint8), ttl=None, pin=True)
    cache = [client.put(np.full(8 * mib, 10 + i, np.uint8), ttl=None) for i in range(4)]
    # A read through the header (no master involved): eviction still sees it, so cache[1] is now
    # the least recently used.
    client.get(cache[0])
    assert client.counters["fast_gets"] == 1
    assert client.stats().evictable == 5
    # Layout: leased 0-16, pinned 16-24, cache 24-56, free 56-64 MiB (less the control page and
    # the headers). Needs 8 MiB more than is free: plain LRU would evict cache[1], cache[2],
    # cache[3] until blocks coalesce; refstore evicts only cache[3], which together with the free
    # tail makes room.
    client.put(np.zeros(16 * mib - (64 << 10), np.uint8))
    assert client.stats().evictions == 1
    with pytest.raises(refstore.ObjectEvicted, match="evicted since"):
        client.get(cache[3])
    for ref in (cache[0], cache[1], cache[2], pinned, leased):
        client.get(ref)
    # Now more than all unpinned cache entries: the pinned one goes last.
    client.put(np.zeros(24 * mib, np.uint8))
    assert client.stats().evictions >= 3
    np.testing.assert_array_equal(client.get(leased), 1)
    with pytest.raises(refstore.PoolFull, match="leased"):
        client.put(np.zeros(40 * mib, np.uint8))


def test_soft_pin_evicted_only_when_nothing_else(client):
    mib = 1 << 20
    pinned = client.put(np.full(30 * mib, 2, np.uint8), ttl=None, pin=True)
    plain = client.put(np.full(30 * mib, 3, np.uint8), ttl=None)
    client.get(plain)
    # Evicts the unpinned one although it is newer.
    client.release(client.put(np.zeros(8 * mib, np.uint8)))
    np.testing.assert_array_equal(client.get(pinned), 2)
    with pytest.raises(refstore.ObjectEvicted):
        client.get(plain)
    client.pin(pinned, False)
    client.put(np.zeros(40 * mib, np.uint8))
    with pytest.raises(refstore.ObjectEvicted):
        client.get(pinned)


def test_two_clients_share_objects(master):
    with Client("test") as a, Client("test") as b:
        ref = a.put(np.arange(1000))
        np.testing.assert_array_equal(b.get(ref), np.arange(1000))
        b.release(ref)
        with pytest.raises(refstore.ObjectReleased):
            a.get(ref)


def test_no_master_is_a_clear_error(no_leaks):
    with pytest.raises(refstore.MasterUnavailable, match="no refstore master 'nobody'"):
        Client("nobody")


def test_second_master_with_same_name_refused(master):
    with pytest.raises(refstore.CallerError, match="already running"):
        MasterThread("test", "1M")


def test_close_is_idempotent_and_views_survive_close(master):
    c = Client("test")
    ref = c.put(np.arange(10))
    view = c.get(ref)
    c.close()
    c.close()
    np.testing.assert_array_equal(view, np.arange(10))  # the mapping lives while views do
    with pytest.raises(refstore.CallerError, match="closed"):
        c.get(ref)
    del view


def test_put_then_close_leaves_a_readable_object(master):
    """put returns before its seal is acknowledged; close() (and flush()) wait for it."""
    writer = Client("test")
    refs = [writer.put(np.full(1000, i)) for i in range(20)]
    assert writer.flush(timeout=10)
    refs.append(writer.put(b"last"))
    writer.close()
    with Client("test") as reader:
        assert bytes(reader.get(refs[-1])) == b"last"
        assert reader.stats().puts == 21


def test_reads_that_skip_the_master_still_count_for_eviction(client):
    """A get answered from the header never reaches the master; eviction must still spare it."""
    mib = 1 << 20
    cache = [client.put(np.full(15 * mib, i, np.uint8), ttl=None) for i in range(4)]
    assert client.get(cache[0])[0] == 0  # the oldest entry, read without the master
    assert client.counters["fast_gets"] == 1
    client.put(np.zeros(8 * mib, np.uint8))  # any one entry makes room
    with pytest.raises(refstore.ObjectEvicted):
        client.get(cache[1])
    assert client.get(cache[0])[0] == 0


def test_a_fault_plan_sends_puts_to_the_master_and_their_blocks_wait_in_stock(client):
    """While a fault plan is set (the control page says so), a put with a reserved block in stock
    leaves it unwritten and goes through the master, where the plan applies; the block is the
    next fast put's once the plan is cleared."""
    for i in range(6):
        client.put(np.full(50_000, i, np.uint8))
        client.flush()
    fast = client.counters["fast_puts"]
    assert fast >= 4
    refstore.faults.inject(client, "alloc:fail#1")
    with pytest.raises(refstore.InjectedFault):
        client.put(np.full(50_000, 6, np.uint8))
    during = client.put(np.full(50_000, 7, np.uint8))
    assert client.counters["fast_puts"] == fast  # both asked the master
    refstore.faults.clear(client)
    after = client.put(np.full(50_000, 8, np.uint8))
    assert client.counters["fast_puts"] == fast + 1
    assert client.get(during)[0] == 7
    assert client.get(after)[0] == 8


def test_repeated_sizes_put_without_a_round_trip(client):
    """From the third put of a size class on, puts take a reserved block (no alloc round trip);
    unused reservations go back to the pool at close."""
    data = [np.full(100_000 + i, i % 251, np.uint8) for i in range(10)]
    refs = []
    for d in data:
        refs.append(client.put(d))
        client.flush()  # the reservation asked for by this put has landed
    assert client.counters["fast_puts"] == 8
    for ref, d in zip(refs, data, strict=True):
        np.testing.assert_array_equal(client.get(ref), d)
    client.flush()
    stats = client.stats()
    assert stats.reserves >= 9
    assert 1 <= stats.reserved <= refstore.reservations.RESERVE_DEPTH  # blocks for the next puts
    assert stats.objects == stats.puts == 10  # reserved blocks are counted apart
    client.release(refs)
    client.close()
    with Client("test") as other:
        stats = other.stats()
        assert stats.objects == stats.reserved == stats.used == 0


def test_header_fast_path_defers_to_the_master_for_the_reason(client):
    ref = client.put(np.arange(10))
    client.release(ref)
    with pytest.raises(refstore.ObjectReleased, match="released since"):
        client.get(ref)
    assert client.counters["fast_gets"] == 0
    # A forged ref pointing at a live object's header, with another oid: not taken for it.
    live = client.put(np.arange(10))
    forged = refstore.Ref(live.pool, live.oid + 1000, live.nbytes, live.node, live.at)
    with pytest.raises(refstore.UnknownObject):
        client.get(forged)
    # A ref pointing into the middle of a payload is not taken for an object either.
    payload = client.put(np.zeros(1 << 16, np.uint8))
    stray = refstore.Ref(payload.pool, payload.oid, payload.nbytes, payload.node, payload.at + 64)
    np.testing.assert_array_equal(client.get(stray), 0)  # the master path answers
    assert client.counters["fast_gets"] == 0


def test_pool_descriptor_comes_over_a_unix_socket_else_through_proc(master, refstore_dir):
    with Client("test") as c:
        assert c._link.current.pool.attached_via == "scm_rights"  # works across PID namespaces
        ref = c.put(np.arange(10))
    (socket_file,) = refstore_dir.glob("test.*.sock")
    socket_file.unlink()  # e.g. a container that shares the discovery file but not the socket
    with Client("test") as c:
        assert c._link.current.pool.attached_via == "proc"
        np.testing.assert_array_equal(c.get(ref), np.arange(10))


def test_close_after_shutdown_master_has_nothing_to_give_back(no_leaks):
    """Reserved blocks go with the master's pool: close() must not try to release them to a
    master that is going away (the call would fail and log a lost connection)."""
    proc = start_master_process("short", "16M")
    try:
        client = Client("short")
        for i in range(4):
            client.put(np.full(1000, i))
            client.flush()
        assert client.stats().reserved >= 1
        client.shutdown_master("test done")
        sent = []
        rpc_call = client._link.current.rpc.call
        client._link.current.rpc.call = lambda method, *args, **kwargs: (
            sent.append(method.name),
            rpc_call(method, *args, **kwargs),
        )[1]
        client.close()
        assert sent == []
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _calls_sent(client: Client) -> list[str]:
    """Names of the calls the client sends from now on."""
    sent: list[str] = []
    call_future = client._link.current.rpc.call_future
    client._link.current.rpc.call_future = lambda method, *args, **kwargs: (
        sent.append(method.name),
        call_future(method, *args, **kwargs),
    )[1]
    return sent


def _warm_reservations(client: Client, obj) -> None:
    """Puts of the size class of ``obj`` until the client keeps a full stock of its blocks."""
    for _ in range(6):
        client.release(client.put(obj))
        client.flush()


def test_a_put_into_a_reserved_block_sends_nothing_its_header_commits_it(client):
    data = np.arange(20_000, dtype=np.int64)
    _warm_reservations(client, data)
    sent = _calls_sent(client)
    refs = [client.put(data + i, ttl=60.0) for i in range(refstore.reservations.RESERVE_LOW)]
    # No seal, no commit: the header is the commit record. One call refills the stock.
    assert sent == ["refstore.reserve"]
    assert client.counters["fast_puts"] == 4 + len(refs)
    with Client("test") as other:  # another client, through the master (no header fast path)
        ref = refs[1]
        master_path = refstore.Ref(ref.pool, ref.oid, ref.nbytes, ref.node, -1)
        np.testing.assert_array_equal(other.get(master_path), data + 1)
        stats = other.stats()
        assert stats.objects == stats.leased == len(refs)
        assert stats.puts == 6 + len(refs)


def test_a_lease_that_ran_out_before_the_master_looked_says_since_when(clock, client):
    data = np.zeros(50_000, np.uint8)
    _warm_reservations(client, data)
    ref = client.put(data, ttl=0.2)
    assert client.counters["fast_puts"] == 5
    put_at = clock.wall
    clock.advance(0.6)
    with pytest.raises(refstore.ObjectExpired) as info:
        client.get(ref)  # the header says the lease ran out: the master decides
    assert info.value.since == pytest.approx(put_at + 0.2, abs=1e-3)  # when it ran out, not now
    assert client.counters["fast_gets"] == 0
    assert client.stats().expirations == 1


def test_extend_moves_the_lease_the_header_fast_path_checks(clock, client):
    data = np.ones(50_000, np.uint8)
    _warm_reservations(client, data)
    ref = client.put(data, ttl=1.0)
    client.extend(ref, 60.0)
    clock.advance(1.2)
    np.testing.assert_array_equal(client.get(ref), data)
    assert client.counters["fast_gets"] == 1  # the master wrote the new deadline to the header
    client.extend(ref, None)  # no lease: a cache entry
    np.testing.assert_array_equal(client.get(ref), data)
    assert client.counters["fast_gets"] == 2
    assert client.stats().evictable == 1


def test_eviction_sees_cache_entries_put_into_reserved_blocks(client):
    """The master has not seen these puts when the pool fills up: eviction settles them first."""
    entries = [client.put(np.full(200_000, i % 251, np.uint8), ttl=None) for i in range(250)]
    assert client.counters["fast_puts"] >= 200
    big = client.put(np.zeros(40 << 20, np.uint8))  # room only if cache entries are evicted
    np.testing.assert_array_equal(client.get(big)[:4], 0)
    evicted = 0
    for i, ref in enumerate(entries):
        try:
            assert client.get(ref)[0] == i % 251
        except refstore.ObjectEvicted:
            evicted += 1
    assert evicted >= 100


BAD_TTLS = [math.nan, math.inf, -1.0, 0.0]


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=str)
def test_a_ttl_that_is_not_a_finite_positive_number_is_a_caller_error(client, ttl):
    ref = client.put(b"kept", ttl=30)
    _warm_reservations(client, b"x" * 100)  # the put below would take a reserved block
    puts = client.counters["puts"]
    with pytest.raises(refstore.CallerError, match="ttl"):
        client.put(b"x" * 100, ttl=ttl)
    with pytest.raises(refstore.CallerError, match="ttl"):
        client.put(np.zeros(3 << 20, np.uint8), ttl=ttl)  # a size that allocates
    with pytest.raises(refstore.CallerError, match="ttl"):
        client.extend(ref, ttl)
    assert client.counters["puts"] == puts
    assert bytes(client.get(ref)) == b"kept"
    assert client.stats().objects == 1


def test_the_master_checks_the_numbers_of_every_request(client):
    """Past the client's own checks (another client, another version): a typed CallerError per
    request, the master keeps serving, and no other lease is disturbed."""
    ref = client.put(b"x", ttl=30)
    layout = refstore.protocol.Layout(0, [refstore.protocol.Item(None, 2, "|u1", (8,), 0, 8)])
    bad_layout = refstore.protocol.Layout(0, [refstore.protocol.Item(None, 2, "|u1", (8,), 8, 8)])
    p = refstore.protocol
    requests = [
        (p.ALLOC, p.Alloc(8, layout, math.nan)),
        (p.ALLOC, p.Alloc(8, layout, math.inf)),
        (p.ALLOC, p.Alloc(-8, layout, 10.0)),
        (p.ALLOC, p.Alloc(8, bad_layout, 10.0)),
        (p.ALLOC, p.Alloc(8, layout, 10.0, header=-64)),
        (p.EXTEND, p.Extend(ref.pool, [ref.oid], math.nan)),
        (p.WAIT_GONE, p.WaitGone(ref.pool, ref.oid, math.nan)),
        (p.FETCH, p.Fetch("elsewhere", 1, 8, "127.0.0.1:1", math.nan)),
        (p.FETCH, p.Fetch("elsewhere", 1, -8, "127.0.0.1:1", 10.0)),
        (p.SEND_TO, p.SendTo(ref.pool, ref.oid, "r", "127.0.0.1:1", 0, -1)),
        (p.RESERVE, p.Reserve(-256, 4)),
    ]
    with SyncClient(client.address) as rpc:
        for method, request in requests:
            resp = rpc.call(method, request, timeout=5)
            assert resp.err is not None, request
            assert resp.err.kind == "CallerError", (request, resp.err)
    stats = client.stats()
    assert stats.objects == 1
    assert stats.leased == 1
    assert bytes(client.get(ref)) == b"x"


def test_a_reconnect_in_progress_blocks_no_other_call(client):
    """Attaching waits on the master (a call, mapping the pool); while it does, puts, gets and
    stats go on through the current attachment, and a second reconnect waits for the first one's
    outcome instead of attaching again (no lock is held across the attach)."""
    data = np.arange(1000)
    ref = client.put(data)
    link = client._link
    attach = link._attach
    attaching, go_on = threading.Event(), threading.Event()
    attaches = []

    def slow_attach(previous):
        attaches.append(previous.epoch)
        attaching.set()
        assert go_on.wait(30)
        return attach(previous)

    link._attach = slow_attach
    outcomes: list[bool] = []
    first = threading.Thread(target=lambda: outcomes.append(client.reconnect()))
    first.start()
    assert attaching.wait(30)
    second = threading.Thread(target=lambda: outcomes.append(client.reconnect()))
    second.start()
    np.testing.assert_array_equal(client.get(ref), data)
    assert bytes(client.get(client.put(b"meanwhile"))) == b"meanwhile"
    assert client.stats().objects == 2
    go_on.set()
    first.join(30)
    second.join(30)
    assert outcomes == [False, False]  # the same master: no new epoch
    assert len(attaches) <= 2
    np.testing.assert_array_equal(client.get(ref), data)
