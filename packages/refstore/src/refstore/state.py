"""The master's bookkeeping: objects, leases, soft pins, eviction, tombstones. Pure logic, no I/O.

Object lifecycle::

    alloc ---> WRITING --seal---> SEALED --release-------------> freed (tombstone "released")
                 |                 ^  |--lease deadline passes--> freed (tombstone "lease expired")
    reserve -> RESERVED --settle---'  |--(no lease) memory pressure> freed (tombstone "evicted")
                 |
                 '--write deadline passes (writer died) -------> freed (tombstone "lease expired")

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
  never evicted.
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
- A freed object leaves a **tombstone** (reason + wall-clock time) so a later get raises a typed
  error saying which and since when. Tombstones are bounded (oldest dropped first).

The state is owned by the master's event-loop thread; nothing here is thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
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
from .protocol import Layout, Stats, check_layout, check_size, check_ttl

# An unsealed object whose writer never seals it is reclaimed after this long even without a lease.
WRITE_TIMEOUT_S = 120.0
# A block reserved by a client that disconnected is freed this long after, unless a put wrote it
# (a put of the client may still be copying into it: the grace outlasts any such copy).
DISCONNECT_GRACE_S = 10.0
MAX_TOMBSTONES = 200_000
# How many of the least recently used objects are checked for one that alone makes room.
EVICTION_WINDOW = 64


class StoredObject:
    __slots__ = (
        "busy",
        "deadline",
        "free_when_idle",
        "header",
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
        self.counters = dict.fromkeys(
            ("puts", "gets", "evictions", "expirations", "releases", "remote_fetches", "reserves"),
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
        return obj.sealed and obj.deadline is None and obj.free_when_idle is None

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
        if obj.busy:
            # A peer is still reading it: free once the send completes (see ``end_send``).
            was_evictable = self._is_evictable(obj)
            obj.free_when_idle = reason
            self._update_lists(obj, was_evictable)
            return
        if self._is_evictable(obj):
            self._evictable_bytes -= self.allocator.block_size(obj.offset)
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
        self, nbytes: int, layout: Layout, ttl_s: float | None, pin: bool, header: int = 0
    ) -> StoredObject:
        check_size(nbytes, "nbytes")
        check_size(header, "header")
        check_ttl(ttl_s)
        check_layout(layout, nbytes)
        obj = self._new_object(header + nbytes, layout, header)
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
        (their leases then run as written), free the rest after ``DISCONNECT_GRACE_S``."""
        grace = self._clock() + DISCONNECT_GRACE_S
        for obj in [o for o in self.reserved.values() if o.owner == owner]:
            self.settle(obj)
            if obj.reserved and (obj.deadline is None or obj.deadline > grace):
                self._set_deadline(obj, grace)

    def _evict_for(self, nbytes: int) -> int:
        # Puts into reserved blocks the master has not seen yet may have made objects evictable
        # (no lease) or freeable (lease run out).
        self.settle_all()
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
                    self._free(obj, ObjectEvicted)
                    self.counters["evictions"] += 1
                    offset = self.allocator.malloc(nbytes)
                    assert offset is not None
                    return offset
            while lru:
                self._second_chance(lru)
                oid = next(iter(lru))
                self._free(self.objects[oid], ObjectEvicted)
                self.counters["evictions"] += 1
                offset = self.allocator.malloc(nbytes)
                if offset is not None:
                    return offset
        stats = self.allocator.stats()
        raise PoolFull(
            f"{nbytes} bytes requested: evicted everything evictable, largest free block "
            f"{stats.largest_free} of {stats.free} free (fragmented by leased objects)"
        )

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

    def seal(self, oid: int) -> None:
        obj = self.objects.get(oid)
        if obj is None:
            self.lookup(self.epoch, oid)  # raises the typed reason
            raise AssertionError("unreachable")
        if obj.sealed:
            raise CallerError(f"object {oid} is already sealed")
        if obj.reserved:
            raise CallerError(f"object {oid} is a reserved block: its header commits it")
        was_evictable = self._is_evictable(obj)
        obj.sealed = True
        self._update_lists(obj, was_evictable)
        if not obj.leased:
            self._set_deadline(obj, None)
        self.counters["puts"] += 1

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
            **self.counters,
        )
