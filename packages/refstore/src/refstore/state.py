"""The master's bookkeeping: objects, leases, soft pins, eviction, tombstones. Pure logic, no I/O.

Object lifecycle::

    alloc ---> WRITING --seal---> SEALED --release-------------> freed (tombstone "released")
                 |    |            ^  |--lease deadline passes--> freed (tombstone "lease expired")
    reserve -> RESERVED --settle---'  |--(no lease, not held)
                 |    |               |   memory pressure ------> freed (tombstone "evicted")
                 |    '--seal, key already bound (keyed) -------> freed (tombstone "released")
                 '--write deadline passes (writer died) -------> freed (tombstone "lease expired")

    key index, for keyed objects:  unbound --seal (key free)--> bound --object freed--> unbound
    hold, per holder:  none --lookup_keys(hold_s > 0), hold--> held
                       held --time passes, unhold, the holder disconnects (owner_gone)--> none

- A **lease** (``ttl_s`` at put, renewable with ``extend``) keeps the object readable and never
  evicted until its deadline; when it passes, the object is freed at once, so memory held by a
  client that died is reclaimed after the TTL without anyone asking.
- An object put (or extended) with ``ttl_s=None`` holds no lease: it is a cache entry that stays
  until evicted or released.
- **Eviction** runs only when an allocation does not fit. Victims are unleased objects in least
  recently used order (a get counts as a use), with one refinement over plain LRU: if one of the
  ``EVICTION_WINDOW`` least recently used objects sits next to enough free space to satisfy the
  request on its own, it alone is evicted (plain LRU would evict in order until some freed blocks
  happen to coalesce, destroying more of the cache); **soft-pinned** unleased objects form a second
  LRU list that is touched only when the first is empty. Before evicting anything the master checks
  that free + evictable bytes could cover the request at all, so a hopeless request fails with
  PoolFull without destroying the cache. Leased and in-flight (being sent to a peer) objects are
  never evicted. A keyed cache entry being evicted is handed to ``on_spill`` first, while its
  bytes are still in the pool (the master's disk tier copies them out: ``disk_tier.py``).
- Gets that a client answers from the object's header in shared memory (``header.py``) never
  reach the master; they stamp the header with their time instead, and eviction gives an object
  read since the master last saw it a **second chance** (moved to the young end, as CLOCK does),
  so the order stays least recently *read* even though most reads bypass the master.
- **Reservations**: a client takes blocks ahead of time for its next puts (``reserve``). A put
  into a reserved block sends the master nothing: the object's header in shared memory is its
  commit record (size, layout, lease deadline, pin). The master **settles** a reserved block, i.e.
  reads its header and adopts the object found there, whenever the block matters to it: a lookup
  of its oid, its write deadline, eviction, stats, and the disconnect of the client that reserved
  it. A lease that ran out before the master looked frees the object at once, with the time it
  ran out as the tombstone's. A reserved block that holds no object by its write deadline (a
  client that died, or never needed it) is freed then; after its client disconnects, within
  ``DISCONNECT_GRACE_S``.
- **Keyed objects** (``alloc(..., key=)``, a client's ``put_keyed``): the key (1..64 bytes) is
  **bound** to the object at its seal, in the key index ``keys``; if the key is bound to a live
  object by then, that binding wins (first writer wins) and the new object is freed at once
  (tombstone "released"): ``seal`` returns the winner. A bound object is freed like any other
  and its binding goes with it, whatever the reason (``_free`` unbinds). ``lookup_keys`` walks
  keys in order and stops at the first one not bound (prefix semantics); it counts as a use.
- A **hold** (``lookup_keys(..., hold_s)``, per holder) keeps a sealed object from being evicted
  until its time; it is not a lease: when it lapses an unleased object is a cache entry again
  (back at the young end of its LRU list), not freed. Holds lapse lazily, when eviction or stats
  look (no timer: they only matter to eviction). A lease deadline that passes while a hold runs
  later moves to the hold's end (the later protection wins). ``unhold`` ends a holder's hold,
  and so does the holder's disconnect (``owner_gone``): nobody is left to end it, and whatever it
  was held for went with the connection.
- Every binding and unbinding is appended to ``key_changes`` (the master drains it once per
  loop turn and feeds its subscribers, ``KeyFeeds``).
- A freed object leaves a **tombstone** (reason + wall-clock time) so a later get raises a typed
  error saying which and since when. Tombstones are bounded (oldest dropped first).

The state is owned by the master's event-loop thread; nothing here is thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from .allocator import TlsfAllocator
from .errors import (
    CallerError,
    ObjectEvicted,
    ObjectExpired,
    ObjectGone,
    ObjectReleased,
    PoolFull,
    UnknownObject,
)
from .protocol import (
    KeyEvent,
    KeysLost,
    KeysRemoved,
    KeysStored,
    Layout,
    Stats,
    check_layout,
    check_size,
    check_ttl,
)

# An unsealed object whose writer never seals it is reclaimed after this long even without a lease.
WRITE_TIMEOUT_S = 120.0
# A block reserved by a client that disconnected is freed this long after, unless a put wrote it
# (a put of the client may still be copying into it: the grace outlasts any such copy).
DISCONNECT_GRACE_S = 10.0
MAX_TOMBSTONES = 200_000
# How many of the least recently used objects are checked for one that alone makes room.
EVICTION_WINDOW = 64
MAX_KEY_BYTES = 64
MAX_HOLD_S = 3600.0
# Keys queued for one subscriber before its queue is dropped (it gets KeysLost: resync).
MAX_QUEUED_KEYS = 65_536


def check_key(key: object) -> None:
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        raise CallerError(f"a key is 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")


def check_hold(hold_s: float) -> None:
    try:
        good = 0.0 <= hold_s <= MAX_HOLD_S  # NaN fails it
    except TypeError:
        good = False
    if not good:
        raise CallerError(f"hold_s must be seconds in [0, {MAX_HOLD_S:g}], got {hold_s!r}")


class KeyChange(NamedTuple):
    """A key bound (``stored``) or unbound (``reason``: why its object was freed)."""

    stored: bool
    key: bytes
    reason: str = ""


class StoredObject:
    __slots__ = (
        "busy",
        "deadline",
        "free_when_idle",
        "header",
        "holds",
        "key",
        "layout",
        "leased",
        "nbytes",
        "offset",
        "oid",
        "owner",
        "pinned",
        "reserved",
        "sealed",
        "touched_ns",
    )

    def __init__(
        self, oid: int, offset: int, nbytes: int, layout: Layout | None, header: int = 0
    ) -> None:
        self.oid = oid
        self.offset = offset  # the block's start: the header, then the payload
        self.header = header
        self.nbytes = nbytes  # payload bytes
        self.layout = layout  # None while reserved
        self.reserved = False
        self.owner = ""  # the peer a reserved block was handed to
        self.touched_ns = 0  # when the master last saw it used (the state's clock, in ns)
        self.sealed = False
        self.deadline: float | None = None  # monotonic; None = no lease
        self.pinned = False
        self.leased = True  # False: a cache entry, its write deadline is dropped at seal
        self.busy = 0  # in-flight sends to peers; freeing waits for them
        self.free_when_idle: type[ObjectGone] | None = None
        self.key: bytes | None = None  # keyed objects: bound at seal unless bound already
        self.holds: dict[str, float] | None = None  # holder -> until (the state's clock)

    @property
    def payload(self) -> int:
        """Pool offset of the first payload byte."""
        return self.offset + self.header


class HeaderCommit(NamedTuple):
    """A put's commit record, as read from the header of a reserved block."""

    header: int
    nbytes: int
    layout: Layout
    deadline: float | None  # on the state's clock; None: no lease
    pinned: bool


def _never_read(obj: StoredObject) -> int:
    return 0


def _nothing_written(obj: StoredObject, end: int) -> HeaderCommit | None:
    return None


class MasterState:
    def __init__(
        self,
        capacity: int,
        epoch: str,
        *,
        granule: int = 256,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        reserved_prefix: int = 0,
        on_free: Callable[[StoredObject], None] | None = None,
        last_read_ns: Callable[[StoredObject], int] = _never_read,
        read_commit: Callable[[StoredObject, int], HeaderCommit | None] = _nothing_written,
        on_lease: Callable[[StoredObject], None] | None = None,
        on_spill: Callable[[StoredObject], None] | None = None,
    ) -> None:
        self.epoch = epoch
        self.allocator = TlsfAllocator(capacity, granule)
        self._prefix = reserved_prefix
        if reserved_prefix:
            # The pool's control page (``header.py``): never handed out, not counted in stats.
            control = self.allocator.malloc(reserved_prefix)
            if control != 0:
                raise AssertionError(f"the control page landed at {control}, not 0")
        self._on_free = on_free  # marks the header freed before the block can be reused
        self._last_read_ns = last_read_ns
        self._read_commit = read_commit  # (block, its end) -> the header's commit record or None
        self._on_lease = on_lease  # writes a sealed object's new lease deadline to its header
        self._on_spill = on_spill  # a keyed cache entry evicted for room, its bytes still here
        self.reserved: dict[int, StoredObject] = {}  # blocks handed out, not settled yet
        self._clock = clock
        self._wall = wall_clock
        self._next_oid = 1
        self.objects: dict[int, StoredObject] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unleased, unpinned, sealed
        self._lru_pinned: OrderedDict[int, None] = OrderedDict()  # unleased, soft-pinned, sealed
        self._evictable_bytes = 0
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self.tombstones: OrderedDict[int, tuple[type[ObjectGone], float]] = OrderedDict()
        self._gone_listeners: dict[int, list[Callable[[str, float], None]]] = {}
        self.keys: dict[bytes, int] = {}  # key -> oid of the sealed, live object bound to it
        self.key_changes: list[KeyChange] = []  # drained by the master (its subscribers)
        self._holds: list[tuple[float, int]] = []  # heap of hold ends; stale entries skipped
        self._held_by: dict[str, set[int]] = {}  # holder -> oids it holds (for ``owner_gone``)
        self.counters = dict.fromkeys(
            (
                "puts",
                "gets",
                "evictions",
                "expirations",
                "releases",
                "remote_fetches",
                "reserves",
                "key_hits",
                "key_misses",
                "key_dedupes",
            ),
            0,
        )

    # -- helpers ------------------------------------------------------------------------------
    def _now_ns(self) -> int:
        """The clock in nanoseconds, as gets stamp headers (``header.py``, last access)."""
        return int(self._clock() * 1e9)

    def _check_epoch(self, epoch: str) -> None:
        if epoch != self.epoch:
            raise UnknownObject(f"ref from pool {epoch!r}, this master serves pool {self.epoch!r}")

    def lookup(self, epoch: str, oid: int) -> StoredObject:
        self._check_epoch(epoch)
        obj = self.objects.get(oid)
        if obj is not None and obj.reserved:
            self.settle(obj)
            if obj.reserved:
                raise UnknownObject(
                    f"object {oid} of pool {epoch} is a block reserved for a put not made yet"
                )
            obj = self.objects.get(oid)  # None if its lease had run out
        if obj is not None and obj.free_when_idle is None:
            return obj
        tomb = self.tombstones.get(oid)
        if tomb is not None:
            cls, since = tomb
            raise cls(f"object {oid} of pool {epoch}", since)
        if obj is not None and obj.free_when_idle is not None:
            raise obj.free_when_idle(f"object {oid} of pool {epoch}", self._wall())
        raise UnknownObject(f"object {oid} is unknown to pool {epoch} (never stored, or forgotten)")

    def _set_deadline(self, obj: StoredObject, deadline: float | None) -> None:
        was_evictable = self._is_evictable(obj)
        obj.deadline = deadline
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, obj.oid))
        self._update_lists(obj, was_evictable)
        if obj.sealed and self._on_lease is not None:
            self._on_lease(obj)

    def _is_evictable(self, obj: StoredObject) -> bool:
        return obj.sealed and obj.deadline is None and obj.free_when_idle is None and not obj.holds

    def _update_lists(self, obj: StoredObject, was_evictable: bool) -> None:
        self._lru.pop(obj.oid, None)
        self._lru_pinned.pop(obj.oid, None)
        now_evictable = self._is_evictable(obj)
        if now_evictable:
            (self._lru_pinned if obj.pinned else self._lru)[obj.oid] = None
            obj.touched_ns = self._now_ns()
        self._evictable_bytes += (now_evictable - was_evictable) * self.allocator.block_size(
            obj.offset
        )

    def _free(
        self, obj: StoredObject, reason: type[ObjectGone], since: float | None = None
    ) -> None:
        if obj.key is not None and self.keys.get(obj.key) == obj.oid:
            # Unbound as soon as it is dying, even while a peer still reads it.
            del self.keys[obj.key]
            self.key_changes.append(KeyChange(False, obj.key, reason.reason))
        if obj.busy:
            # A peer is still reading it: free once the send completes (see ``end_send``).
            was_evictable = self._is_evictable(obj)
            obj.free_when_idle = reason
            self._update_lists(obj, was_evictable)
            return
        if self._is_evictable(obj):
            self._evictable_bytes -= self.allocator.block_size(obj.offset)
        for holder in obj.holds or ():
            self._forget_hold(holder, obj.oid)
        self._lru.pop(obj.oid, None)
        self._lru_pinned.pop(obj.oid, None)
        del self.objects[obj.oid]
        self.reserved.pop(obj.oid, None)
        if self._on_free is not None and (obj.header or obj.reserved):
            self._on_free(obj)
        self.allocator.free(obj.offset)
        if since is None:
            since = self._wall()
        self.tombstones[obj.oid] = (reason, since)
        while len(self.tombstones) > MAX_TOMBSTONES:
            self.tombstones.popitem(last=False)
        for listener in self._gone_listeners.pop(obj.oid, ()):
            listener(reason.reason, since)

    # -- operations ---------------------------------------------------------------------------
    def alloc(
        self,
        nbytes: int,
        layout: Layout,
        ttl_s: float | None,
        pin: bool,
        header: int = 0,
        *,
        key: bytes | None = None,
    ) -> StoredObject:
        check_size(nbytes, "nbytes")
        check_size(header, "header")
        check_ttl(ttl_s)
        check_layout(layout, nbytes)
        if key is not None:
            check_key(key)
        obj = self._new_object(header + nbytes, layout, header)
        obj.key = key
        obj.nbytes = nbytes
        obj.pinned = pin
        obj.leased = ttl_s is not None
        now = self._clock()
        # The writer holds a deadline even without a lease, so a writer that dies is reclaimed.
        self._set_deadline(obj, now + (ttl_s if ttl_s is not None else WRITE_TIMEOUT_S))
        return obj

    def _new_object(self, block_bytes: int, layout: Layout | None, header: int) -> StoredObject:
        if block_bytes > self.allocator.capacity:
            raise PoolFull(
                f"{block_bytes} bytes requested, the pool holds {self.allocator.capacity}"
            )
        offset = self.allocator.malloc(block_bytes)
        if offset is None:
            offset = self._evict_for(block_bytes)
        obj = StoredObject(self._next_oid, offset, block_bytes, layout, header)
        self._next_oid += 1
        self.objects[obj.oid] = obj
        return obj

    def reserve(self, block_bytes: int, owner: str = "") -> StoredObject:
        """A block for a put the client has not made yet; the put's header commits it (settle)."""
        if block_bytes <= 0:
            raise CallerError(f"reserve needs a positive size, got {block_bytes}")
        obj = self._new_object(block_bytes, None, 0)
        obj.reserved = True
        obj.owner = owner
        self.reserved[obj.oid] = obj
        self._set_deadline(obj, self._clock() + WRITE_TIMEOUT_S)
        self.counters["reserves"] += 1
        return obj

    def settle(self, obj: StoredObject) -> None:
        """If a put has committed the reserved block ``obj`` (its header says so), adopt the
        object: size, layout, lease and pin as written there. Otherwise it stays reserved."""
        if not obj.reserved:
            return
        found = self._read_commit(obj, obj.offset + self.allocator.block_size(obj.offset))
        if found is None:
            return
        del self.reserved[obj.oid]
        obj.reserved = False
        obj.owner = ""
        obj.header, obj.nbytes, obj.layout = found.header, found.nbytes, found.layout
        obj.pinned = found.pinned
        obj.leased = found.deadline is not None
        obj.sealed = True  # still not evictable: it holds the reservation's deadline
        self.counters["puts"] += 1
        now = self._clock()
        if found.deadline is not None and found.deadline <= now:
            # The lease ran out before the master looked: gone since it ran out.
            obj.deadline = None
            self._free(obj, ObjectExpired, since=self._wall() - (now - found.deadline))
            self.counters["expirations"] += 1
            return
        self._set_deadline(obj, found.deadline)

    def settle_all(self) -> None:
        for obj in list(self.reserved.values()):
            self.settle(obj)

    def owner_gone(self, owner: str) -> None:
        """The client ``owner`` disconnected: adopt what its puts wrote into reserved blocks
        (their leases then run as written), free the rest after ``DISCONNECT_GRACE_S``; its
        holds end."""
        for oid in self._held_by.pop(owner, ()):
            obj = self.objects.get(oid)
            if obj is not None:
                self._drop_holds(obj, lambda h, t: h != owner)
        grace = self._clock() + DISCONNECT_GRACE_S
        for obj in [o for o in self.reserved.values() if o.owner == owner]:
            self.settle(obj)
            if obj.reserved and (obj.deadline is None or obj.deadline > grace):
                self._set_deadline(obj, grace)

    def _evict_for(self, nbytes: int) -> int:
        # Puts into reserved blocks the master has not seen yet may have made objects evictable
        # (no lease) or freeable (lease run out); holds that lapsed make objects evictable again.
        self.settle_all()
        self.lapse_holds()
        offset = self.allocator.malloc(nbytes)
        if offset is not None:
            return offset
        need = self.allocator.round_up(nbytes)
        stats = self.allocator.stats()
        if stats.free + self._evictable_bytes < need:
            raise PoolFull(
                f"{nbytes} bytes requested: {stats.free} free and {self._evictable_bytes} "
                f"evictable of {stats.capacity}; the rest is leased or being written"
            )
        for lru in (self._lru, self._lru_pinned):
            self._second_chance(lru)
            # Better than plain LRU: among the least recently used few, one object whose block
            # (with its free neighbours) already fits the request is evicted alone.
            for oid in itertools.islice(lru, EVICTION_WINDOW):
                obj = self.objects[oid]
                if self._last_read_ns(obj) > obj.touched_ns:
                    continue  # read lately: its chance comes with the head of the list
                if self.allocator.span_if_freed(obj.offset) >= need:
                    self._evict(obj)
                    offset = self.allocator.malloc(nbytes)
                    assert offset is not None
                    return offset
            while lru:
                self._second_chance(lru)
                oid = next(iter(lru))
                self._evict(self.objects[oid])
                offset = self.allocator.malloc(nbytes)
                if offset is not None:
                    return offset
        stats = self.allocator.stats()
        raise PoolFull(
            f"{nbytes} bytes requested: evicted everything evictable, largest free block "
            f"{stats.largest_free} of {stats.free} free (fragmented by leased objects)"
        )

    def _evict(self, obj: StoredObject) -> None:
        """Evict for room; a keyed cache entry (no lease ever: ``ttl_s=None``) is offered to
        ``on_spill`` first, while its bytes are still in the pool (the disk tier)."""
        if (
            self._on_spill is not None
            and obj.key is not None
            and not obj.leased
            and self.keys.get(obj.key) == obj.oid
        ):
            self._on_spill(obj)
        self._free(obj, ObjectEvicted)
        self.counters["evictions"] += 1

    def _second_chance(self, lru: OrderedDict[int, None]) -> None:
        """Move objects read (through their header) since the master last saw them to the young
        end, until the oldest one was not; each object gets one chance per read."""
        for _ in range(len(lru)):
            oid = next(iter(lru))
            obj = self.objects[oid]
            read_ns = self._last_read_ns(obj)
            if read_ns <= obj.touched_ns:
                return
            obj.touched_ns = read_ns
            lru.move_to_end(oid)

    def seal(self, oid: int) -> StoredObject:
        """Mark the object readable; returns it, or for a keyed object whose key is bound to
        another live object by now, that object (the new one is freed: first writer wins)."""
        obj = self.objects.get(oid)
        if obj is None:
            self.lookup(self.epoch, oid)  # raises the typed reason
            raise AssertionError("unreachable")
        if obj.sealed:
            raise CallerError(f"object {oid} is already sealed")
        if obj.reserved:
            raise CallerError(f"object {oid} is a reserved block: its header commits it")
        if obj.key is not None:
            bound = self.bound(obj.key)
            if bound is not None:
                self._free(obj, ObjectReleased)
                self.counters["key_dedupes"] += 1
                self._touch(bound)
                return bound
        was_evictable = self._is_evictable(obj)
        obj.sealed = True
        self._update_lists(obj, was_evictable)
        if not obj.leased:
            self._set_deadline(obj, None)
        self.counters["puts"] += 1
        if obj.key is not None:
            self.keys[obj.key] = obj.oid
            self.key_changes.append(KeyChange(True, obj.key))
        return obj

    # -- keys and holds -----------------------------------------------------------------------
    def bound(self, key: bytes) -> StoredObject | None:
        """The live object bound to ``key``, if any."""
        oid = self.keys.get(key)
        return None if oid is None else self.objects[oid]

    def _touch(self, obj: StoredObject) -> None:
        """A use, for LRU order."""
        for lru in (self._lru, self._lru_pinned):
            if obj.oid in lru:
                lru.move_to_end(obj.oid)
                obj.touched_ns = self._now_ns()

    def alloc_keyed(
        self,
        items: list[tuple[bytes, int, Layout, int]],
        ttl_s: float | None,
        pin: bool,
    ) -> list[tuple[StoredObject, bool]]:
        """A batch of keyed puts, ``(key, nbytes, layout, header)`` each: per item in order the
        object bound to its key already (True: nothing to write) or a new block to write and
        seal (False). Stops at the first item that does not fit (PoolFull): the answer is then
        shorter than the batch. Every item is checked before anything is allocated."""
        check_ttl(ttl_s)
        for key, nbytes, layout, header in items:
            check_key(key)
            check_size(nbytes, "nbytes")
            check_size(header, "header")
            check_layout(layout, nbytes)
        out: list[tuple[StoredObject, bool]] = []
        for key, nbytes, layout, header in items:
            bound = self.bound(key)
            if bound is not None:
                self._touch(bound)  # the youngest: the batch's allocations evict it last
                self.counters["key_dedupes"] += 1
                out.append((bound, True))
                continue
            try:
                out.append((self.alloc(nbytes, layout, ttl_s, pin, header, key=key), False))
            except PoolFull:
                break
        # An allocation of the batch may still have evicted a binding found before it.
        for i, (obj, was_bound) in enumerate(out):
            if was_bound and self.objects.get(obj.oid) is not obj:
                for later, later_bound in out[i:]:
                    if not later_bound:
                        self._free(later, ObjectReleased)
                return out[:i]
        return out

    def seal_keyed(self, oids: list[int]) -> list[StoredObject | None]:
        """Seal a batch of keyed objects: per oid the object bound to its key (this one, or the
        one bound first), or None for an object gone before its seal (its write deadline)."""
        out: list[StoredObject | None] = []
        for oid in oids:
            obj = self.objects.get(oid)
            if obj is None or obj.free_when_idle is not None:
                out.append(None)
                continue
            if obj.key is None:
                raise CallerError(f"object {oid} has no key: seal it with seal")
            out.append(self.seal(oid))
        return out

    def lookup_keys(
        self, keys: list[bytes], hold_s: float, holder: str, *, count: bool = True
    ) -> list[StoredObject]:
        """The objects bound to the leading keys that are bound (the walk stops at the first key
        that is not); each counts as a use and, with ``hold_s`` > 0, is held by ``holder`` until
        ``hold_s`` from now. ``count=False``: not counted as hits and misses (a walk that is
        not a client's answer: a master's own, before it asks its peers, or a peer's)."""
        check_hold(hold_s)
        for key in keys:
            check_key(key)
        until = self._clock() + hold_s
        found = []
        for key in keys:
            obj = self.bound(key)
            if obj is None:
                break
            found.append(obj)
            if hold_s > 0:
                self._hold(obj, holder, until)
            self._touch(obj)
        if count:
            self.counters["key_hits"] += len(found)
            self.counters["key_misses"] += len(keys) - len(found)
        return found

    def hold(self, objs: list[StoredObject], holder: str, hold_s: float) -> None:
        """Hold live objects for ``holder`` until ``hold_s`` from now (as a lookup does)."""
        check_hold(hold_s)
        until = self._clock() + hold_s
        for obj in objs:
            if self.objects.get(obj.oid) is obj and obj.sealed:
                self._hold(obj, holder, until)

    def _hold(self, obj: StoredObject, holder: str, until: float) -> None:
        was_evictable = self._is_evictable(obj)
        if obj.holds is None:
            obj.holds = {}
        if obj.holds.get(holder, -math.inf) < until:
            obj.holds[holder] = until
            heapq.heappush(self._holds, (until, obj.oid))
            self._held_by.setdefault(holder, set()).add(obj.oid)
        if was_evictable:
            self._update_lists(obj, was_evictable)

    def _drop_holds(self, obj: StoredObject, keep: Callable[[str, float], bool]) -> None:
        if not obj.holds:
            return
        kept = {h: t for h, t in obj.holds.items() if keep(h, t)}
        for holder in obj.holds.keys() - kept.keys():
            self._forget_hold(holder, obj.oid)
        obj.holds = kept or None
        if obj.holds is None:
            self._update_lists(obj, False)  # back to the young end of its LRU list

    def _forget_hold(self, holder: str, oid: int) -> None:
        oids = self._held_by.get(holder)
        if oids is not None:
            oids.discard(oid)
            if not oids:
                del self._held_by[holder]

    def unhold(self, epoch: str, oids: list[int], holder: str) -> None:
        """End ``holder``'s holds on these objects (gone ones are skipped)."""
        self._check_epoch(epoch)
        for oid in oids:
            obj = self.objects.get(oid)
            if obj is not None:
                self._drop_holds(obj, lambda h, t: h != holder)

    def lapse_holds(self) -> None:
        """Drop the holds whose time has passed."""
        now = self._clock()
        while self._holds and self._holds[0][0] <= now:
            _, oid = heapq.heappop(self._holds)
            obj = self.objects.get(oid)
            if obj is not None:
                self._drop_holds(obj, lambda h, t: t > now)

    def evict_keys(self, keys: list[bytes]) -> int:
        """Evict the objects bound to ``keys`` now, holds and leases notwithstanding (a test's
        way to lose an object between a lookup and a get); returns how many."""
        evicted = 0
        for key in keys:
            check_key(key)
            obj = self.bound(key)
            if obj is not None:
                self._free(obj, ObjectEvicted)
                self.counters["evictions"] += 1
                evicted += 1
        return evicted

    def drain_key_changes(self) -> list[KeyChange]:
        changes, self.key_changes = self.key_changes, []
        return changes

    def get(self, epoch: str, oid: int) -> StoredObject:
        obj = self.lookup(epoch, oid)
        if not obj.sealed:
            raise CallerError(f"object {oid} is still being written (not sealed)")
        if oid in self._lru:
            self._lru.move_to_end(oid)
            obj.touched_ns = self._now_ns()
        elif oid in self._lru_pinned:
            self._lru_pinned.move_to_end(oid)
            obj.touched_ns = self._now_ns()
        self.counters["gets"] += 1
        return obj

    def release(self, epoch: str, oids: list[int]) -> None:
        """Free at once (active release). Releasing an already freed object is a no-op."""
        self._check_epoch(epoch)
        for oid in oids:
            obj = self.objects.get(oid)
            if obj is not None and obj.reserved:
                self.settle(obj)  # counted as a put, if one was made into it
                obj = self.objects.get(oid)
            if obj is not None and obj.free_when_idle is None:
                self._free(obj, ObjectReleased)
                self.counters["releases"] += 1

    def extend(self, epoch: str, oids: list[int], ttl_s: float | None) -> None:
        check_ttl(ttl_s)
        objs = [self.lookup(epoch, oid) for oid in oids]  # all or nothing
        now = self._clock()
        for obj in objs:
            obj.leased = ttl_s is not None
            if obj.sealed or obj.leased:
                self._set_deadline(obj, None if ttl_s is None else now + ttl_s)

    def pin(self, epoch: str, oids: list[int], pinned: bool) -> None:
        objs = [self.lookup(epoch, oid) for oid in oids]
        for obj in objs:
            was_evictable = self._is_evictable(obj)
            obj.pinned = pinned
            self._update_lists(obj, was_evictable)

    def begin_send(self, obj: StoredObject) -> None:
        obj.busy += 1

    def end_send(self, obj: StoredObject) -> None:
        obj.busy -= 1
        if not obj.busy and obj.free_when_idle is not None:
            reason, obj.free_when_idle = obj.free_when_idle, None
            self._free(obj, reason)

    def add_gone_listener(
        self, epoch: str, oid: int, listener: Callable[[str, float], None]
    ) -> bool:
        """Call ``listener(reason, since)`` when the object is freed; False if already gone."""
        self._check_epoch(epoch)
        if oid not in self.objects:
            return False
        self._gone_listeners.setdefault(oid, []).append(listener)
        return True

    def remove_gone_listener(self, oid: int, listener: Callable[[str, float], None]) -> None:
        listeners = self._gone_listeners.get(oid)
        if listeners and listener in listeners:
            listeners.remove(listener)
            if not listeners:
                del self._gone_listeners[oid]

    # -- leases -------------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """The earliest pending lease deadline (monotonic), for the master's single timer."""
        while self._deadlines:
            deadline, oid = self._deadlines[0]
            obj = self.objects.get(oid)
            if obj is not None and obj.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)  # stale: object freed or lease changed
        return None

    def expire_due(self) -> int:
        """Free every object whose lease deadline has passed; returns how many."""
        now = self._clock()
        expired = 0
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > now:
                return expired
            _, oid = heapq.heappop(self._deadlines)
            obj = self.objects[oid]
            if obj.holds:
                held_until = max(obj.holds.values())
                if held_until > now:
                    self._set_deadline(obj, held_until)  # the later protection wins
                    continue
            if obj.reserved:
                self.settle(obj)  # a put wrote it: its own lease applies from now on
                if not obj.reserved:
                    expired += oid not in self.objects
                    continue
            was_evictable = self._is_evictable(obj)
            obj.deadline = None
            self._update_lists(obj, was_evictable)
            # A reserved block no put wrote is no object: not counted as an expiration.
            self.counters["expirations"] += not obj.reserved
            self._free(obj, ObjectExpired)
            expired += 1

    def stats(self) -> Stats:
        self.settle_all()
        self.lapse_holds()
        alloc = self.allocator.stats()
        reserved = len(self.reserved)
        leased = sum(1 for o in self.objects.values() if o.deadline is not None and not o.reserved)
        return Stats(
            epoch=self.epoch,
            capacity=alloc.capacity - self._prefix,
            used=alloc.used - self._prefix,
            free=alloc.free,
            largest_free=alloc.largest_free,
            free_blocks=alloc.free_blocks,
            objects=len(self.objects) - reserved,  # reserved blocks are not objects yet
            leased=leased,
            pinned=sum(1 for o in self.objects.values() if o.pinned),
            evictable=len(self._lru) + len(self._lru_pinned),
            reserved=reserved,
            keys=len(self.keys),
            held=sum(1 for o in self.objects.values() if o.holds),
            **self.counters,
        )


class KeyFeeds:
    """The subscribers' queues of key events, one per subscriber (its connection): pure
    bookkeeping, no I/O. Each queue holds at most ``limit`` keys; one that would hold more is
    dropped and replaced by ``KeysLost`` (the subscriber resyncs), so a subscriber that does not
    read costs the master a bounded queue and never a wait."""

    def __init__(self, limit: int = MAX_QUEUED_KEYS) -> None:
        self.limit = limit
        self._queues: dict[str, list[KeyEvent]] = {}
        self._queued_keys: dict[str, int] = {}

    def __contains__(self, subscriber: str) -> bool:
        return subscriber in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def subscribe(self, subscriber: str) -> None:
        self._queues.setdefault(subscriber, [])
        self._queued_keys.setdefault(subscriber, 0)

    def unsubscribe(self, subscriber: str) -> None:
        self._queues.pop(subscriber, None)
        self._queued_keys.pop(subscriber, None)

    def pending(self, subscriber: str) -> bool:
        return bool(self._queues.get(subscriber))

    def publish(self, changes: list[KeyChange]) -> list[str]:
        """Queue ``changes`` (in order, runs of one kind batched into one event) for every
        subscriber; returns the subscribers that have events now."""
        if not changes or not self._queues:
            return []
        events: list[KeyEvent] = []
        for (stored, reason), run in itertools.groupby(changes, lambda c: (c.stored, c.reason)):
            keys = [change.key for change in run]
            events.append(KeysStored(keys) if stored else KeysRemoved(keys, reason))
        for subscriber, queue in self._queues.items():
            queued = self._queued_keys[subscriber] + len(changes)
            if queued > self.limit:
                queue[:] = [KeysLost()]
                queued = 0
            else:
                queue.extend(events)
            self._queued_keys[subscriber] = queued
        return list(self._queues)

    def take(self, subscriber: str) -> list[KeyEvent]:
        """Everything queued for ``subscriber``, emptying its queue."""
        queue = self._queues.get(subscriber)
        if not queue:
            return []
        self._queues[subscriber] = []
        self._queued_keys[subscriber] = 0
        return queue
