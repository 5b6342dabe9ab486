"""Keyed objects, holds and key feeds in the master's state machine: no sockets, a fake clock."""

from __future__ import annotations

import pytest
import refstore
from hypothesis import given, settings
from hypothesis import strategies as st
from refstore.protocol import Item, KeysLost, KeysRemoved, KeysStored, Layout
from refstore.state import KeyChange, KeyFeeds, MasterState

SIZE = 100
LAYOUT = Layout(0, [Item(None, 2, "|u1", (SIZE,), 0, SIZE)])
BLOCK = 256  # what one object of SIZE bytes takes in the pool (the granule)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(clock: Clock, capacity: int = 1 << 20) -> MasterState:
    return MasterState(capacity, "epoch", clock=clock, wall_clock=clock)


def _put(state: MasterState, key: bytes, ttl: float | None = None, pin: bool = False):
    got = state.alloc_keyed([(key, SIZE, LAYOUT, 0)], ttl, pin)
    if not got:
        raise refstore.PoolFull("the batch stored nothing")
    [(obj, bound)] = got
    if bound:
        return obj
    [winner] = state.seal_keyed([obj.oid])
    return winner


def test_a_key_is_bound_at_seal_and_first_writer_wins():
    state = _state(Clock())
    [(first, b1)] = state.alloc_keyed([(b"k", SIZE, LAYOUT, 0)], None, False)
    [(second, b2)] = state.alloc_keyed([(b"k", SIZE, LAYOUT, 0)], None, False)
    assert (b1, b2) == (False, False)  # neither is bound before its seal
    assert state.lookup_keys([b"k"], 0.0, "c") == []
    assert state.seal_keyed([second.oid]) == [second]  # the first to seal wins
    assert state.seal_keyed([first.oid]) == [second]
    assert first.oid not in state.objects  # freed at once
    assert state.tombstones[first.oid][0] is refstore.ObjectReleased
    assert state.keys == {b"k": second.oid}
    # A put of a bound key allocates nothing: the binding is the answer.
    used = state.stats().used
    [(again, bound)] = state.alloc_keyed([(b"k", SIZE, LAYOUT, 0)], None, False)
    assert bound
    assert again is second
    assert state.stats().used == used
    assert state.stats().key_dedupes == 2
    assert state.drain_key_changes() == [KeyChange(True, b"k")]


def test_bad_keys_and_holds_are_caller_errors_before_anything_is_allocated():
    state = _state(Clock())
    for bad in (b"", b"x" * 65, "text"):
        with pytest.raises(refstore.CallerError, match="key"):
            state.alloc_keyed([(b"ok", SIZE, LAYOUT, 0), (bad, SIZE, LAYOUT, 0)], None, False)
        with pytest.raises(refstore.CallerError, match="key"):
            state.lookup_keys([bad], 0.0, "c")
    for bad in (float("nan"), -1.0, 1e9):
        with pytest.raises(refstore.CallerError, match="hold_s"):
            state.lookup_keys([b"ok"], bad, "c")
    assert state.stats().used == 0
    plain = state.alloc(SIZE, LAYOUT, None, False)
    with pytest.raises(refstore.CallerError, match="no key"):
        state.seal_keyed([plain.oid])


@pytest.mark.parametrize("how", ["release", "lease", "evict", "evict_keys", "write_deadline"])
def test_every_kind_of_free_unbinds_the_key(how):
    clock = Clock()
    state = _state(clock, capacity=8 * BLOCK)
    obj = _put(state, b"k", ttl=10.0 if how == "lease" else None)
    state.drain_key_changes()
    if how == "release":
        state.release("epoch", [obj.oid])
        reason = "released"
    elif how == "lease":
        clock.now += 11.0
        assert state.expire_due() == 1
        reason = "lease expired"
    elif how == "evict":
        state.alloc(8 * BLOCK - 100, Layout(0, [Item(None, 2, "|u1", (10,), 0, 10)]), 10.0, False)
        reason = "evicted"
    elif how == "evict_keys":
        assert state.evict_keys([b"k", b"other"]) == 1
        reason = "evicted"
    else:  # a writer that died: never sealed, never bound, its block comes back
        [(pending, _)] = state.alloc_keyed([(b"w", SIZE, LAYOUT, 0)], None, False)
        state.release("epoch", [obj.oid])
        state.drain_key_changes()
        clock.now += 121.0
        state.expire_due()
        assert pending.oid not in state.objects
        assert state.seal_keyed([pending.oid]) == [None]
        assert state.keys == {}
        assert state.drain_key_changes() == []
        return
    assert obj.oid not in state.objects
    assert state.keys == {}
    assert state.lookup_keys([b"k"], 0.0, "c") == []
    assert state.drain_key_changes() == [KeyChange(False, b"k", reason)]
    assert state.stats().keys == 0


def test_lookup_walks_the_prefix_and_counts_hits_and_misses():
    state = _state(Clock())
    a, b, c = (_put(state, k) for k in (b"a", b"b", b"c"))
    assert state.lookup_keys([b"a", b"b", b"c"], 0.0, "x") == [a, b, c]
    assert state.lookup_keys([b"a", b"zz", b"c"], 0.0, "x") == [a]  # stops at the first miss
    assert state.lookup_keys([b"zz", b"a"], 0.0, "x") == []
    stats = state.stats()
    assert (stats.key_hits, stats.key_misses, stats.keys) == (4, 4, 3)


def test_a_lookup_is_a_use_for_lru_order():
    state = _state(Clock(), capacity=3 * BLOCK)
    a, b, _ = (_put(state, k) for k in (b"a", b"b", b"c"))
    state.lookup_keys([b"a"], 0.0, "x")  # a is now the youngest: b goes first
    _put(state, b"d")
    assert set(state.keys) == {b"a", b"c", b"d"}
    assert b.oid not in state.objects
    assert a.oid in state.objects


def test_a_hold_protects_from_eviction_and_lapses_back_to_a_cache_entry():
    clock = Clock()
    state = _state(clock, capacity=2 * BLOCK)
    a, b = _put(state, b"a"), _put(state, b"b")
    assert state.lookup_keys([b"a", b"b"], 5.0, "reader") == [a, b]
    assert state.stats().evictable == 0
    assert state.stats().held == 2
    with pytest.raises(refstore.PoolFull):
        state.alloc(SIZE, LAYOUT, 10.0, False)  # nothing evictable: both are held
    clock.now += 5.0  # the holds lapse: cache entries again, not freed
    stats = state.stats()
    assert (stats.held, stats.evictable, stats.objects) == (0, 2, 2)
    state.alloc(SIZE, LAYOUT, 10.0, False)  # now one of them can go
    assert len(state.keys) == 1


def test_holds_are_per_holder_and_unhold_ends_only_its_own():
    clock = Clock()
    state = _state(clock)
    a = _put(state, b"a")
    state.lookup_keys([b"a"], 5.0, "one")
    state.lookup_keys([b"a"], 1.0, "two")
    state.unhold("epoch", [a.oid], "one")
    assert a.holds == {"two": 1001.0}
    assert state.stats().evictable == 0
    state.unhold("epoch", [a.oid, 12345], "two")  # a gone oid is skipped
    assert a.holds is None
    assert state.stats().evictable == 1
    state.lookup_keys([b"a"], 0.0, "one")  # hold_s=0: no hold
    assert a.holds is None


def test_a_holders_disconnect_ends_its_holds_and_only_its_own():
    state = _state(Clock())
    a, b = _put(state, b"a"), _put(state, b"b")
    state.lookup_keys([b"a", b"b"], 30.0, "gone")
    state.lookup_keys([b"a"], 30.0, "stays")
    state.owner_gone("gone")
    assert a.holds == {"stays": 1030.0}
    assert b.holds is None
    assert state.stats().held == 1
    state.owner_gone("gone")  # nothing more to end
    state.evict_keys([b"a"])  # freed while held: the holder's record of it goes too
    again = _put(state, b"a")
    state.lookup_keys([b"a"], 30.0, "new")
    state.owner_gone("stays")  # its old object is gone; the new one's hold is another's
    assert again.holds == {"new": 1030.0}


HOLDERS = ("h0", "h1", "h2")
KEYS = (b"k0", b"k1", b"k2")
hold_ops = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), st.sampled_from(HOLDERS), st.sampled_from(KEYS)),
        st.tuples(st.just("unhold"), st.sampled_from(HOLDERS), st.sampled_from(KEYS)),
        st.tuples(st.just("gone"), st.sampled_from(HOLDERS), st.none()),
        st.tuples(st.just("evict"), st.none(), st.sampled_from(KEYS)),
        st.tuples(st.just("tick"), st.none(), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(hold_ops)
def test_holds_follow_lookups_unholds_disconnects_evictions_and_time(ops):
    """Every object's holders are exactly those a model of the operations says: one that
    looked it up, not since unheld, disconnected or lapsed, the object not freed meanwhile."""
    clock = Clock()
    state = _state(clock)
    model: dict[tuple[str, bytes], float] = {}  # (holder, key) -> until
    for op, holder, key in ops:
        if op == "lookup":
            obj = state.bound(key) or _put(state, key)
            state.lookup_keys([key], 5.0, holder)
            model[holder, key] = clock.now + 5.0
        elif op == "unhold":
            obj = state.bound(key)
            if obj is not None:
                state.unhold("epoch", [obj.oid], holder)
            model.pop((holder, key), None)
        elif op == "gone":
            state.owner_gone(holder)
            model = {hk: t for hk, t in model.items() if hk[0] != holder}
        elif op == "evict":
            state.evict_keys([key])
            model = {hk: t for hk, t in model.items() if hk[1] != key}
        else:
            clock.now += 2.0
            state.lapse_holds()
            model = {hk: t for hk, t in model.items() if t > clock.now}
        for k in KEYS:
            obj = state.bound(k)
            want = {h: t for (h, kk), t in model.items() if kk == k}
            assert ({} if obj is None else obj.holds or {}) == want
        # The holder index (what a disconnect ends) names exactly the live objects held.
        index: dict[str, set[int]] = {}
        for obj in state.objects.values():
            for h in obj.holds or ():
                index.setdefault(h, set()).add(obj.oid)
        assert state._held_by == index
    assert state.stats().held == len({k for _, k in model})


def test_a_lease_ending_during_a_hold_waits_for_the_hold():
    clock = Clock()
    state = _state(clock)
    a = _put(state, b"a", ttl=2.0)
    state.lookup_keys([b"a"], 5.0, "reader")
    clock.now += 3.0
    assert state.expire_due() == 0  # the hold runs later: it wins
    assert state.next_deadline() == 1005.0
    clock.now += 2.0
    assert state.expire_due() == 1  # then the lease's end frees it, as a lease does
    assert a.oid not in state.objects
    assert state.keys == {}


def test_soft_pinned_keyed_objects_go_after_every_unpinned_one_in_lru_order():
    state = _state(Clock(), capacity=3 * BLOCK)
    _put(state, b"p", pin=True)
    _put(state, b"a")
    _put(state, b"b")
    for key in (b"c", b"d", b"e"):
        _put(state, key)
    assert set(state.keys) == {b"p", b"d", b"e"}  # a, b, c went in order; the pin stayed
    state.alloc(3 * BLOCK - 64, LAYOUT, 10.0, False)  # the whole pool: d, e, then the pin
    assert set(state.keys) == set()


def test_a_full_pool_stores_the_batch_up_to_what_fits():
    state = _state(Clock(), capacity=3 * BLOCK)
    keep = state.alloc(SIZE, LAYOUT, 10.0, False)  # leased: never evicted
    items = [(bytes([i]), SIZE, LAYOUT, 0) for i in range(4)]
    got = state.alloc_keyed(items, 10.0, False)
    assert [bound for _, bound in got] == [False, False]
    assert keep.oid in state.objects


def test_a_binding_evicted_by_a_later_item_of_the_batch_ends_the_batch_there():
    state = _state(Clock(), capacity=BLOCK)
    _put(state, b"a")  # a cache entry, the only evictable one
    got = state.alloc_keyed([(b"a", SIZE, LAYOUT, 0), (b"b", SIZE, LAYOUT, 0)], None, False)
    assert got == []  # b's room came from a: the answer never names a freed object
    assert state.stats().objects == 0


def test_feeds_batch_runs_and_bound_each_queue():
    feeds = KeyFeeds(limit=4)
    feeds.subscribe("s")
    changes = [
        KeyChange(True, b"a"),
        KeyChange(True, b"b"),
        KeyChange(False, b"a", "evicted"),
        KeyChange(True, b"c"),
    ]
    assert feeds.publish(changes) == ["s"]
    assert feeds.take("s") == [
        KeysStored([b"a", b"b"]),
        KeysRemoved([b"a"], "evicted"),
        KeysStored([b"c"]),
    ]
    assert feeds.take("s") == []
    feeds.publish(changes)
    feeds.publish([KeyChange(True, b"d")])  # 5 keys > 4: the queue is dropped
    feeds.publish([KeyChange(True, b"e")])
    assert feeds.take("s") == [KeysLost(), KeysStored([b"e"])]
    feeds.unsubscribe("s")
    assert feeds.publish(changes) == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "put_leased", "lookup", "release", "tick", "big", "unhold"]),
            st.integers(0, 7),
        ),
        max_size=60,
    )
)
def test_a_bound_key_always_names_a_live_sealed_object(ops):
    clock = Clock()
    state = _state(clock, capacity=6 * BLOCK)
    for op, i in ops:
        key = bytes([i])
        try:
            if op == "put":
                _put(state, key)
            elif op == "put_leased":
                _put(state, key, ttl=float(i + 1))
            elif op == "lookup":
                state.lookup_keys([bytes([j]) for j in range(i)], float(i % 3), "h")
            elif op == "release":
                obj = state.bound(key)
                if obj is not None:
                    state.release("epoch", [obj.oid])
            elif op == "tick":
                clock.now += i
                state.expire_due()
            elif op == "unhold":
                state.unhold("epoch", list(state.objects), "h")
            else:
                state.alloc(BLOCK * (i % 3 + 1) - 64, LAYOUT, None, False)
        except refstore.PoolFull:
            pass
        for key, oid in state.keys.items():
            obj = state.objects[oid]
            assert obj.key == key
            assert obj.sealed
            assert obj.free_when_idle is None
        stats = state.stats()
        assert stats.keys == len(state.keys)
        assert stats.used + stats.free == stats.capacity
