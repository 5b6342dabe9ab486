"""Wire schemas between clients and masters, and between masters (remote get).

Every method has its own pair of 4-byte heads in the refstore range 0x5253xxxx ("RS"). Every
response carries ``err: ErrorInfo | None`` so a typed refstore error survives the RPC (a handler
that raises anything else reaches the caller as simple_rpc's RemoteError, i.e. a master bug).
Payload bytes never travel in these messages: the client reads and writes the shared pool itself.

msgspec checks every field's type; the ``check_*`` functions below check that the numbers are in
range (finite, positive, inside the object, ...), and the master runs them on every request before
it acts on one, answering ``CallerError`` otherwise (a NaN lease deadline, say, would break the
order of the master's lease heap and never expire).
"""

from __future__ import annotations

import msgspec
from simple_rpc import Method

from .errors import CallerError, ErrorInfo

# ~31 years: a lease deadline in nanoseconds still fits the header's u64, and is finite.
MAX_TTL_S = 1e9


class Item(msgspec.Struct, frozen=True, array_like=True):
    """One array (or byte string) inside a stored object."""

    key: str | int | None
    kind: int  # KIND_NUMPY, KIND_TORCH, KIND_BYTES
    dtype: str  # numpy dtype string ("<f4"); for torch the torch dtype name ("bfloat16")
    shape: tuple[int, ...]
    offset: int  # from the start of the object's block, 64-byte aligned
    nbytes: int


KIND_NUMPY = 0
KIND_TORCH = 1
KIND_BYTES = 2

CONTAINER_SINGLE = 0
CONTAINER_LIST = 1
CONTAINER_DICT = 2
CONTAINER_TUPLE = 3


class Layout(msgspec.Struct, frozen=True, array_like=True):
    container: int
    items: list[Item]


def check_ttl(ttl_s: float | None, what: str = "ttl_s") -> None:
    """A lease: None, or a finite number of seconds in (0, MAX_TTL_S]."""
    try:
        good = ttl_s is None or 0.0 < ttl_s <= MAX_TTL_S  # NaN fails every comparison
    except TypeError:
        good = False
    if not good:
        raise CallerError(f"{what} must be None or seconds in (0, {MAX_TTL_S:g}], got {ttl_s!r}")


def check_timeout(timeout_s: float, what: str = "timeout_s") -> None:
    try:
        good = 0.0 <= timeout_s <= MAX_TTL_S
    except TypeError:
        good = False
    if not good:
        raise CallerError(f"{what} must be seconds in [0, {MAX_TTL_S:g}], got {timeout_s!r}")


def check_size(nbytes: int, what: str) -> None:
    if nbytes < 0:
        raise CallerError(f"{what} must be at least 0, got {nbytes}")


def check_layout(layout: Layout, nbytes: int) -> None:
    """Every item of a layout lies inside the ``nbytes`` of its payload, with a known kind and a
    shape of non-negative dimensions: the clients that get the object build views from it."""
    if layout.container not in (CONTAINER_SINGLE, CONTAINER_LIST, CONTAINER_DICT, CONTAINER_TUPLE):
        raise CallerError(f"unknown container kind {layout.container}")
    if layout.container == CONTAINER_SINGLE and len(layout.items) != 1:
        raise CallerError(f"a single object has one item, not {len(layout.items)}")
    for item in layout.items:
        if item.kind not in (KIND_NUMPY, KIND_TORCH, KIND_BYTES):
            raise CallerError(f"item {item.key!r}: unknown kind {item.kind}")
        if item.offset < 0 or item.nbytes < 0 or item.offset + item.nbytes > nbytes:
            raise CallerError(
                f"item {item.key!r} at {item.offset}+{item.nbytes} lies outside the payload of "
                f"{nbytes} bytes"
            )
        if any(dim < 0 for dim in item.shape):
            raise CallerError(f"item {item.key!r}: negative dimension in shape {item.shape}")


class Ack(msgspec.Struct, frozen=True):
    err: ErrorInfo | None = None


class Hello(msgspec.Struct, frozen=True):
    client: str  # "name pid" for logs


class HelloResp(msgspec.Struct, frozen=True):
    epoch: str
    pid: int
    pool_fd: int
    pool_size: int
    node: str  # the address other nodes use to reach this master
    fd_socket: str = ""  # UNIX socket that hands out the pool descriptor (SCM_RIGHTS)
    err: ErrorInfo | None = None


class Alloc(msgspec.Struct, frozen=True):
    nbytes: int  # payload bytes
    layout: Layout
    ttl_s: float | None  # None: no lease, the object is a cache entry (evictable)
    pin: bool = False
    header: int = 0  # bytes the client writes before the payload (``header.py``)


class AllocResp(msgspec.Struct, frozen=True):
    oid: int = 0
    offset: int = 0
    err: ErrorInfo | None = None


class Seal(msgspec.Struct, frozen=True):
    """The object of an ``alloc`` is written (puts into reserved blocks send nothing: their
    header is their commit record, see ``header.py``)."""

    oid: int


class Reserve(msgspec.Struct, frozen=True):
    """Blocks of ``block`` bytes for the client's next puts of that size class."""

    block: int
    count: int


class Reserved(msgspec.Struct, frozen=True):
    blocks: list[tuple[int, int]] = []  # (oid, offset); fewer than asked when the pool is tight
    err: ErrorInfo | None = None


class Get(msgspec.Struct, frozen=True):
    epoch: str
    oid: int


class GetResp(msgspec.Struct, frozen=True):
    offset: int = 0
    nbytes: int = 0
    layout: Layout | None = None
    err: ErrorInfo | None = None


class OidList(msgspec.Struct, frozen=True):
    epoch: str
    oids: list[int]


class Extend(msgspec.Struct, frozen=True):
    epoch: str
    oids: list[int]
    ttl_s: float | None  # None drops the lease (the object becomes evictable)


class Pin(msgspec.Struct, frozen=True):
    epoch: str
    oids: list[int]
    pinned: bool


class StatsReq(msgspec.Struct, frozen=True):
    pass


class PeerStatus(msgspec.Struct, frozen=True):
    """One peer master as this master sees it (``peers.py``)."""

    address: str
    state: str  # "up", "down" (backing off), "probing"
    retry_in_s: float = 0.0  # while down: until the next probe
    asked: int = 0  # lookups that asked it
    hits: int = 0  # lookups that fetched from it
    keys: int = 0  # keys fetched from it
    bytes: int = 0  # payload bytes fetched from it
    misses: int = 0  # it answered, nothing was fetched from it
    failures: int = 0  # no answer in time, refused, bad answer, or a failed transfer
    last_error: str = ""


class Stats(msgspec.Struct, frozen=True):
    epoch: str = ""
    capacity: int = 0
    used: int = 0
    free: int = 0
    largest_free: int = 0
    free_blocks: int = 0
    objects: int = 0
    leased: int = 0
    pinned: int = 0
    evictable: int = 0
    reserved: int = 0  # blocks clients took ahead of time for their next puts
    puts: int = 0
    gets: int = 0
    evictions: int = 0
    expirations: int = 0
    releases: int = 0
    remote_fetches: int = 0
    reserves: int = 0
    keys: int = 0  # keys bound to live objects
    held: int = 0  # objects a lookup's hold keeps from eviction now
    key_hits: int = 0  # keys lookups found bound
    key_misses: int = 0  # keys lookups asked for past the first one not bound
    key_dedupes: int = 0  # keyed puts that found their key bound already (nothing stored)
    peer_lookups: int = 0  # lookups that asked peers for the keys past the local run
    peer_hits: int = 0  # lookups that fetched keys from a peer
    peer_keys: int = 0  # keys fetched from peers (and stored here)
    peer_bytes: int = 0  # payload bytes fetched from peers
    peer_misses: int = 0  # peer answers nothing was fetched from
    peer_failures: int = 0  # peers that did not answer in time, refused, or failed a transfer
    peer_served: int = 0  # keys this master's objects answered to peers' lookups
    disk_capacity: int = 0  # bytes of the disk tier's file (0: no disk tier)
    disk_keys: int = 0  # keys with a record on disk
    disk_bytes: int = 0  # payload bytes of those records
    disk_writes: int = 0  # records written (evicted keyed cache entries)
    disk_reads: int = 0  # records read back from the file by lookups
    disk_hits: int = 0  # keys lookups found on disk and promoted into the pool
    disk_errors: int = 0  # failed writes; reads short, failed or not the bytes written
    disk_evictions: int = 0  # records evicted (LRU) to make room for newer ones
    spill_dropped: int = 0  # evicted keyed cache entries not written (queue full, no room)
    clients: int = 0  # connections to the master now (the asker's included; peers' too)
    subscribers: int = 0  # connections that follow the key events
    peers: list[PeerStatus] = []
    err: ErrorInfo | None = None

    @property
    def external_fragmentation(self) -> float:
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free


class WaitGone(msgspec.Struct, frozen=True):
    epoch: str
    oid: int
    timeout_s: float


class GoneResp(msgspec.Struct, frozen=True):
    gone: bool = False  # False: the timeout passed first
    reason: str = ""
    since: float = 0.0
    err: ErrorInfo | None = None


class SetFaults(msgspec.Struct, frozen=True):
    spec: str


class Shutdown(msgspec.Struct, frozen=True):
    reason: str


class Fetch(msgspec.Struct, frozen=True):
    """Client -> its local master: bring a remote object into the local pool."""

    epoch: str
    oid: int
    nbytes: int
    node: str
    ttl_s: float


class FetchResp(msgspec.Struct, frozen=True):
    epoch: str = ""  # the local copy's ref
    oid: int = 0
    offset: int = 0
    layout: Layout | None = None
    err: ErrorInfo | None = None


class SendTo(msgspec.Struct, frozen=True):
    """Requester master -> owner master: write object ``oid`` to the requester's pool with kvt."""

    epoch: str
    oid: int
    request_id: str
    data_address: str  # the requester's kvt data plane
    dst_region: int
    dst_offset: int


class SendToResp(msgspec.Struct, frozen=True):
    nbytes: int = 0
    layout: Layout | None = None
    err: ErrorInfo | None = None


class ReadRange(msgspec.Struct, frozen=True):
    """Requester master -> owner master: raw bytes of an object (``remote="rpc"``)."""

    epoch: str
    oid: int
    offset: int
    length: int


class Describe(msgspec.Struct, frozen=True):
    epoch: str
    oid: int


class KeyedItem(msgspec.Struct, frozen=True, array_like=True):
    key: bytes
    nbytes: int
    layout: Layout
    header: int


class PutKeyed(msgspec.Struct, frozen=True):
    """Allocate a batch of keyed objects (``Client.put_keyed``), in order, as many as fit."""

    items: list[KeyedItem]
    ttl_s: float | None
    pin: bool = False


class Slot(msgspec.Struct, frozen=True, array_like=True):
    """An object of a keyed batch: ``bound`` (nothing to write: the key's object) or a block
    to write and seal; ``at`` is the block's offset (the header's)."""

    oid: int
    at: int
    nbytes: int
    bound: bool


class PutKeyedResp(msgspec.Struct, frozen=True):
    slots: list[Slot] = []  # shorter than the batch when the pool was full
    err: ErrorInfo | None = None


class SealKeyed(msgspec.Struct, frozen=True):
    oids: list[int]


class SealKeyedResp(msgspec.Struct, frozen=True):
    bound: list[Slot | None] = []  # per oid: the object bound to its key; None: gone meanwhile
    err: ErrorInfo | None = None


class Lookup(msgspec.Struct, frozen=True):
    keys: list[bytes]
    hold_s: float = 0.0


class LookupResp(msgspec.Struct, frozen=True):
    epoch: str = ""
    found: list[Slot] = []  # the leading keys that are bound
    err: ErrorInfo | None = None


class PeerLookup(msgspec.Struct, frozen=True):
    """Master -> peer master: the leading run of ``keys`` stored at the peer itself (it asks
    no peers of its own), described for a fetch (``SEND_TO`` / ``READ_RANGE``)."""

    keys: list[bytes]


class PeerObject(msgspec.Struct, frozen=True, array_like=True):
    oid: int
    nbytes: int
    layout: Layout


class PeerLookupResp(msgspec.Struct, frozen=True):
    epoch: str = ""
    found: list[PeerObject] = []
    err: ErrorInfo | None = None


class UpdatePeers(msgspec.Struct, frozen=True):
    """Add and remove peer masters (``host:port``); both empty: just list them."""

    add: list[str] = []
    remove: list[str] = []


class PeersResp(msgspec.Struct, frozen=True):
    peers: list[PeerStatus] = []
    err: ErrorInfo | None = None


class EvictKeys(msgspec.Struct, frozen=True):
    keys: list[bytes]


class KeysStored(msgspec.Struct, frozen=True, tag=True):
    """These keys were bound to stored objects."""

    keys: list[bytes]


class KeysRemoved(msgspec.Struct, frozen=True, tag=True):
    """The objects of these keys were freed; ``reason``: evicted, released, lease expired."""

    keys: list[bytes]
    reason: str


class KeysLost(msgspec.Struct, frozen=True, tag=True):
    """Events were lost (a queue overflowed, the master went away): resync needed."""


KeyEvent = KeysStored | KeysRemoved | KeysLost


class SubscribeKeys(msgspec.Struct, frozen=True):
    pass


class NextKeyEvents(msgspec.Struct, frozen=True):
    """Answered when the subscriber's queue holds events (a long wait, not a poll)."""


class KeyEventsResp(msgspec.Struct, frozen=True):
    events: list[KeyEvent] = []
    err: ErrorInfo | None = None


def _method(name: str, n: int, req: object, resp: object) -> Method:
    return Method(name, 0x52530000 | n, 0x52538000 | n, req, resp)


HELLO = _method("refstore.hello", 1, Hello, HelloResp)
ALLOC = _method("refstore.alloc", 2, Alloc, AllocResp)
SEAL = _method("refstore.seal", 3, Seal, Ack)
GET = _method("refstore.get", 4, Get, GetResp)
RELEASE = _method("refstore.release", 5, OidList, Ack)
EXTEND = _method("refstore.extend", 6, Extend, Ack)
PIN = _method("refstore.pin", 7, Pin, Ack)
STATS = _method("refstore.stats", 8, StatsReq, Stats)
WAIT_GONE = _method("refstore.wait_gone", 9, WaitGone, GoneResp)
SET_FAULTS = _method("refstore.set_faults", 10, SetFaults, Ack)
SHUTDOWN = _method("refstore.shutdown", 11, Shutdown, Ack)
FETCH = _method("refstore.fetch", 12, Fetch, FetchResp)
SEND_TO = _method("refstore.send_to", 13, SendTo, SendToResp)
READ_RANGE = _method("refstore.read_range", 14, ReadRange, bytes)
DESCRIBE = _method("refstore.describe", 15, Describe, GetResp)
# 16 was ``commit`` (a put into a reserved block), replaced by the header as commit record.
RESERVE = _method("refstore.reserve", 17, Reserve, Reserved)
PUT_KEYED = _method("refstore.put_keyed", 18, PutKeyed, PutKeyedResp)
SEAL_KEYED = _method("refstore.seal_keyed", 19, SealKeyed, SealKeyedResp)
LOOKUP = _method("refstore.lookup", 20, Lookup, LookupResp)
UNHOLD = _method("refstore.unhold", 21, OidList, Ack)
SUBSCRIBE_KEYS = _method("refstore.subscribe_keys", 22, SubscribeKeys, Ack)
KEY_EVENTS = _method("refstore.key_events", 23, NextKeyEvents, KeyEventsResp)
EVICT_KEYS = _method("refstore.evict_keys", 24, EvictKeys, Ack)
PEER_LOOKUP = _method("refstore.peer_lookup", 25, PeerLookup, PeerLookupResp)
PEERS = _method("refstore.peers", 26, UpdatePeers, PeersResp)
