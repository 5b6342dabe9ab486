"""The local master: owns one node's pool and all of its metadata, serves clients over simple-rpc.

Data never passes through the master: it hands out offsets (alloc), marks objects readable (seal),
resolves refs to offsets (get), and keeps leases, pins, eviction and tombstones (``state.py``).
Everything runs on one asyncio loop thread, which owns the state; a single timer fires at the
earliest lease deadline (no periodic sweeps).

Remote get: a client asks its local master to ``fetch`` a ref owned by another node's master; the
local master allocates room in its own pool and pulls the payload from the owner (kvt, or
simple-rpc raw reads with ``remote="rpc"``; see ``remote.py``), then the client reads it locally.

Keyed objects (``put_keyed``, ``lookup``, holds) live in the state too; the key changes it
records are handed to the subscribers' bounded queues (``state.KeyFeeds``) once per loop turn,
and each subscriber's one outstanding ``key_events`` call is answered when its queue has events.

Peers (other nodes' masters, ``peers.py`` decides whom to ask): a ``lookup`` whose local run
stops short asks every peer not backing off for the continuation (``PEER_LOOKUP``, in
parallel, each within ``peer_timeout_s``), allocates the longest continuation's objects here
as keyed objects (in order, as many as fit), pulls their payloads over the remote-get path
within ``peer_fetch_timeout_s``, writes their headers and seals them (first writer wins), then
answers the whole run from the local state. A peer that fails is a miss for that round and
backs off; whatever failed is freed before the answer.

Disk tier (``disk=`` a directory, ``disk_tier.py`` the I/O, ``disk_index.py`` the
bookkeeping): a keyed cache entry that memory pressure evicts is copied out and written to a
preallocated file by a writer thread (dropped if its queue is full); a lookup whose run
continues on disk (after the local run, before the peers) allocates those keys' objects here,
reads them back on reader threads straight into their blocks, verifies each (length, head,
checksum) within ``disk_read_timeout_s``, writes their headers and seals them: a failed read is a
miss from that key on. A peer's lookup promotes from disk the same way before it is answered, so
another node finds what this one spilled.

Run it as ``refstore serve`` (a process of its own), embedded with ``MasterThread`` (tests, the Ray
actor), or let the first client start one (``refstore.connect(autostart=True)``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import msgspec
from simple_rpc import CallContext, LoopThread, Method, Server

from . import discovery, header, protocol
from .disk_index import DiskRecord
from .disk_tier import DEFAULT_SPILL_QUEUE, DiskTier
from .errors import CallerError, PoolFull, RefstoreError, to_info
from .faults import FaultPlan
from .peers import PeerRound, PeerTable
from .pool import SharedPool, listen_fd_socket, send_fd, shmem_hugepages_mode
from .remote import RemotePuller
from .state import (
    MAX_HOLD_S,
    WRITE_TIMEOUT_S,
    HeaderCommit,
    KeyFeeds,
    MasterState,
    StoredObject,
    check_hold,
)

log = logging.getLogger("refstore.master")
_decode_layout = msgspec.msgpack.Decoder(protocol.Layout).decode


class _Promotion(NamedTuple):
    """One key of a lookup's run read back from disk into the block ``obj``."""

    record: DiskRecord
    obj: StoredObject
    writer: header.Writer
    read: asyncio.Future[str | None] | None  # None: copied from the staging area


def _read_outcome(read: asyncio.Future[str | None]) -> str | None:
    """None if the read brought the record's bytes, else why not."""
    if read.cancelled():
        return "the read was cancelled"
    err = read.exception()
    if err is not None:
        return f"read failed: {type(err).__name__}: {err}"
    return read.result()


DEFAULT_POOL_SIZE = 1 << 30
MAX_WAIT_GONE_S = 3600.0
MAX_RESERVE_BLOCK = 64 << 20
MAX_RESERVE_COUNT = 64
PEERS_ENV_VAR = "REFSTORE_PEERS"  # "host:port,host:port": a master's peers, read at start
# A KVS lookup not answered in 2 s is a miss: asking and fetching fit well inside that.
PEER_TIMEOUT_S = 0.5
PEER_FETCH_TIMEOUT_S = 1.5
PEER_FETCH_PARALLEL = 8  # objects of one continuation moving at once
HEADER_WRITERS_MAX = 256
DISK_ENV_VAR = "REFSTORE_DISK"  # a directory for the disk tier, read at start when none is given
DISK_SIZE_ENV_VAR = "REFSTORE_DISK_SIZE"
DEFAULT_DISK_SIZE = "16G"
# A lookup's reads from disk end within this (the KVS counts a lookup not answered in 2 s a miss).
DISK_READ_TIMEOUT_S = 1.0


def parse_size(text: str | int) -> int:
    """'512M', '2G', '1.5GiB', 1048576 -> bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = cleaned[-1:] if cleaned[-1:] in units else ""
    number = cleaned[: len(cleaned) - len(unit)]
    try:
        return int(float(number) * units[unit])
    except ValueError as err:
        raise CallerError(f"bad size {text!r}") from err


def check_peer_address(address: object) -> None:
    if not isinstance(address, str):
        raise CallerError(f"a peer is a 'host:port' string, got {address!r:.80}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CallerError(f"a peer is host:port, got {address!r:.80}")


class Master:
    """Create with ``await Master.start(...)`` on the loop that will own it; ``await close()``."""

    def __init__(
        self,
        name: str,
        pool: SharedPool,
        epoch: str,
        faults: FaultPlan,
        advertise: str | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        disk: DiskTier | None = None,
    ) -> None:
        self.name = name
        self.disk = disk
        self.disk_read_timeout_s = DISK_READ_TIMEOUT_S
        self._clock = clock
        self.pool = pool
        self.epoch = epoch
        self.faults = faults
        self._tag_key = header.epoch_key(epoch)
        self.state = MasterState(
            pool.size,
            epoch,
            reserved_prefix=header.CONTROL_BYTES,
            on_free=self._mark_freed,
            clock=clock,
            wall_clock=wall_clock,
            last_read_ns=self._last_read_ns,
            read_commit=self._read_commit,
            on_lease=self._write_lease,
            on_spill=None if disk is None else self._spill,
        )
        self.feeds = KeyFeeds()
        self._feed_waiters: dict[str, asyncio.Future[None]] = {}
        self._key_flush_due = False
        self._publish_flags()
        self.server = Server(name=f"refstore-master-{name}", on_disconnect=self._disconnected)
        self._advertise = advertise
        self._timer: asyncio.TimerHandle | None = None
        self._seal_waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._timer_deadline: float | None = None
        self._lock = discovery.MasterLock(name)
        self._closed = False
        self.closed_event = asyncio.Event()
        self.remote: RemotePuller | None = None  # created in start()
        self._fd_socket: socket.socket | None = None
        self._fd_socket_path = ""
        self._fd_task: asyncio.Task[None] | None = None
        self.info: discovery.MasterInfo | None = None
        self.peers = PeerTable()
        self.peer_timeout_s = PEER_TIMEOUT_S
        self.peer_fetch_timeout_s = PEER_FETCH_TIMEOUT_S
        self._peer_served = 0
        self._round_ids = itertools.count(1)
        self._header_writers: dict[bytes, header.Writer] = {}  # layout bytes -> its writer
        for method, handler in (
            (protocol.HELLO, self._hello),
            (protocol.ALLOC, self._alloc),
            (protocol.RESERVE, self._reserve),
            (protocol.SEAL, self._seal),
            (protocol.GET, self._get),
            (protocol.DESCRIBE, self._describe),
            (protocol.RELEASE, self._release),
            (protocol.EXTEND, self._extend),
            (protocol.PIN, self._pin),
            (protocol.STATS, self._stats),
            (protocol.WAIT_GONE, self._wait_gone),
            (protocol.SET_FAULTS, self._set_faults),
            (protocol.SHUTDOWN, self._shutdown),
            (protocol.FETCH, self._fetch),
            (protocol.SEND_TO, self._send_to),
            (protocol.READ_RANGE, self._read_range),
            (protocol.PUT_KEYED, self._put_keyed),
            (protocol.SEAL_KEYED, self._seal_keyed),
            (protocol.LOOKUP, self._lookup),
            (protocol.UNHOLD, self._unhold),
            (protocol.SUBSCRIBE_KEYS, self._subscribe_keys),
            (protocol.KEY_EVENTS, self._key_events),
            (protocol.EVICT_KEYS, self._evict_keys),
            (protocol.PEER_LOOKUP, self._peer_lookup),
            (protocol.PEERS, self._update_peers),
        ):
            self.server.register(method, self._wrap(method, handler))

    @classmethod
    async def start(
        cls,
        name: str = discovery.DEFAULT_NAME,
        pool_size: int | str = DEFAULT_POOL_SIZE,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise: str | None = None,
        faults: str | None = None,
        remote: str = "auto",
        peers: Iterable[str] | None = None,
        peer_timeout_s: float = PEER_TIMEOUT_S,
        peer_fetch_timeout_s: float = PEER_FETCH_TIMEOUT_S,
        disk: str | os.PathLike[str] | None = None,
        disk_size: int | str | None = None,
        spill_queue: int | str = DEFAULT_SPILL_QUEUE,
        disk_read_timeout_s: float = DISK_READ_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> Master:
        """``disk``: a directory for the disk tier (None: env ``REFSTORE_DISK``; "" or unset:
        no disk tier), its file ``disk_size`` bytes (None: env ``REFSTORE_DISK_SIZE``, else
        16G), ``spill_queue`` the bytes of evicted entries waiting for the writer,
        ``disk_read_timeout_s`` the bound on a lookup's reads. ``clock`` (CLOCK_MONOTONIC
        seconds, as clients stamp headers) and ``wall_clock`` (for the times errors say) are
        for tests that move time themselves (``check_deadlines``).
        ``peers``: other nodes' masters (``host:port``) to ask for keys a lookup misses here
        (None: env ``REFSTORE_PEERS``, comma-separated); ``peer_timeout_s`` bounds a peer's
        answer, ``peer_fetch_timeout_s`` the move of the objects found there."""
        protocol.check_ttl(peer_timeout_s, "peer_timeout_s")
        protocol.check_ttl(peer_fetch_timeout_s, "peer_fetch_timeout_s")
        protocol.check_ttl(disk_read_timeout_s, "disk_read_timeout_s")
        if disk is None:
            disk = os.environ.get(DISK_ENV_VAR, "")
        if disk_size is None:
            disk_size = os.environ.get(DISK_SIZE_ENV_VAR, DEFAULT_DISK_SIZE)
        disk_bytes = parse_size(disk_size) if disk else 0
        spill_bytes = parse_size(spill_queue)
        if peers is None:
            peers = [p.strip() for p in os.environ.get(PEERS_ENV_VAR, "").split(",") if p.strip()]
        peers = list(peers)
        for address in peers:
            check_peer_address(address)
        lock = discovery.MasterLock(name)
        if not lock.try_acquire():
            raise CallerError(f"a refstore master named {name!r} is already running ({lock.path})")
        tier: DiskTier | None = None
        try:
            size = parse_size(pool_size)
            if disk:
                tier = await asyncio.to_thread(
                    DiskTier.open,
                    disk,
                    name,
                    disk_bytes,
                    loop=asyncio.get_running_loop(),
                    spill_queue=spill_bytes,
                )
                log.info("disk tier %s: %d MiB", tier.path, disk_bytes >> 20)
            started = time.perf_counter()
            pool = await asyncio.to_thread(SharedPool.create, size, f"refstore-{name}")
            log.info(
                "pool %s: %d MiB pre-faulted in %.2f s (shmem huge pages: %s)",
                name,
                size >> 20,
                time.perf_counter() - started,
                shmem_hugepages_mode(),
            )
            plan = FaultPlan(faults) if faults is not None else FaultPlan.from_env()
            master = cls(
                name,
                pool,
                uuid.uuid4().hex[:16],
                plan,
                advertise,
                clock=clock,
                wall_clock=wall_clock,
                disk=tier,
            )
            master._lock = lock
            master.disk_read_timeout_s = disk_read_timeout_s
            await master.server.start(host, port)
        except BaseException:
            lock.release()
            if tier is not None:
                tier.close()
            with contextlib.suppress(NameError):
                pool.close()
            raise
        master.remote = RemotePuller(master.state, pool.view, name, mode=remote, host=host)
        master.peer_timeout_s = peer_timeout_s
        master.peer_fetch_timeout_s = peer_fetch_timeout_s
        master.update_peers(add=peers)
        if master.peers:
            try:
                await master.remote.warm_up()
            except Exception as err:  # the first transfer tries again
                log.warning("master %s: kvt engine not started: %s", name, err)
        master._start_fd_socket()
        node = advertise or master.server.address
        master.info = discovery.MasterInfo(
            name=name,
            address=master.server.address,
            node=node,
            pid=os.getpid(),
            pool_fd=pool.fd,
            pool_size=pool.size,
            epoch=master.epoch,
            started_at=time.time(),
            past_epochs=discovery.past_epochs_for_new_master(name),
        )
        discovery.write_info(master.info)
        log.info("refstore master %s epoch %s serving at %s", name, master.epoch, node)
        return master

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def node(self) -> str:
        return self._advertise or self.server.address

    def _start_fd_socket(self) -> None:
        """Hand the pool descriptor to local clients over a UNIX socket next to the discovery
        file; sockets of earlier masters of this name (crashed ones) are removed first."""
        for stale in discovery.directory().glob(f"{self.name}.*.sock"):
            with contextlib.suppress(OSError):
                stale.unlink()
        path = str(discovery.directory() / f"{self.name}.{self.epoch}.sock")
        try:
            self._fd_socket = listen_fd_socket(path)
        except OSError as err:
            log.warning("no pool descriptor socket at %s (%s): clients use /proc", path, err)
            return
        self._fd_socket_path = path
        self._fd_task = asyncio.get_running_loop().create_task(self._serve_pool_fd())

    async def _serve_pool_fd(self) -> None:
        assert self._fd_socket is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._fd_socket)
            except OSError as err:  # e.g. out of descriptors: clients fall back to /proc
                log.warning("pool descriptor socket: %s", err)
                await asyncio.sleep(1.0)
                continue
            with conn:
                try:
                    send_fd(conn, self.pool.fd)
                except OSError as err:
                    log.warning("pool descriptor not sent: %s", err)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._fd_task is not None:
            self._fd_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fd_task
        if self._fd_socket is not None:
            self._fd_socket.close()
            with contextlib.suppress(OSError):
                os.unlink(self._fd_socket_path)
        if self._timer is not None:
            self._timer.cancel()
        for waiter in self._feed_waiters.values():
            if not waiter.done():
                waiter.set_result(None)
        await self.server.close()
        if self.remote is not None:
            await self.remote.close()
        if self.disk is not None:
            self.disk.close()  # joins its readers: none writes into the pool after this
        self.pool.close()
        self._lock.release()
        self.closed_event.set()
        log.info("refstore master %s epoch %s closed", self.name, self.epoch)

    # -- plumbing -----------------------------------------------------------------------------
    def _mark_freed(self, obj: Any) -> None:
        header.mark_freed(self.pool.view, obj.offset)

    def _last_read_ns(self, obj: Any) -> int:
        return header.last_access(self.pool.view, obj.offset) if obj.header else 0

    def _read_commit(self, obj: Any, end: int) -> HeaderCommit | None:
        found = header.read_committed(self.pool.view, obj.offset, obj.oid, self._tag_key, end)
        if found is None:
            return None
        deadline_ns = found.lease_deadline_ns
        return HeaderCommit(
            header=found.header_len,
            nbytes=found.nbytes,
            layout=found.layout,
            deadline=deadline_ns / 1e9 if deadline_ns else None,
            pinned=bool(found.flags & header.OBJECT_PINNED),
        )

    def _write_lease(self, obj: Any) -> None:
        """Keep the header's lease deadline (what clients' header gets check) the master's."""
        if obj.header:
            deadline = obj.deadline if obj.leased and obj.deadline is not None else None
            deadline_ns = 0 if deadline is None else int(deadline * 1e9)
            header.set_lease(self.pool.view, obj.offset, deadline_ns)

    def _disconnected(self, peer: str) -> None:
        if self._closed:
            return
        self.state.owner_gone(peer)
        if peer in self.feeds:
            self.feeds.unsubscribe(peer)
            waiter = self._feed_waiters.pop(peer, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._reschedule_expiry()

    def _publish_flags(self) -> None:
        """While faults are planned, clients send every operation here so that they apply."""
        header.write_control(self.pool.view, header.FLAG_MASTER_PATH if self.faults else 0)

    def _wrap(
        self, method: Method, handler: Callable[[Any, CallContext], Awaitable[Any]]
    ) -> Callable[[Any, CallContext], Awaitable[Any]]:
        op = method.name.removeprefix("refstore.")
        response_type = method.response_type

        @functools.wraps(handler)
        async def wrapped(request: Any, ctx: CallContext) -> Any:
            try:
                if self.faults:
                    await self.faults.apply(op, ctx.peer)
                return await handler(request, ctx)
            except RefstoreError as err:
                if isinstance(err, CallerError):
                    log.warning("%s from %s rejected: %s", op, ctx.peer, err)
                if response_type is bytes:
                    raise
                return response_type(err=to_info(err))
            finally:
                self._reschedule_expiry()

        return wrapped

    def _schedule_key_flush(self) -> None:
        """Hand the state's key changes to the subscribers once per loop turn (batched)."""
        if self.state.key_changes and not self._key_flush_due and not self._closed:
            self._key_flush_due = True
            asyncio.get_running_loop().call_soon(self._flush_key_changes)

    def _flush_key_changes(self) -> None:
        self._key_flush_due = False
        for subscriber in self.feeds.publish(self.state.drain_key_changes()):
            waiter = self._feed_waiters.pop(subscriber, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _reschedule_expiry(self) -> None:
        """Keep exactly one timer, set for the earliest lease deadline (and pass on the key
        changes whatever changed state)."""
        self._schedule_key_flush()
        deadline = self.state.next_deadline()
        if deadline == self._timer_deadline or self._closed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_deadline = deadline
        if deadline is not None:
            delay = max(0.0, deadline - self._clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_expiry_timer)

    def _on_expiry_timer(self) -> None:
        self._timer = None
        self._timer_deadline = None
        self.check_deadlines()

    def check_deadlines(self) -> int:
        """Free what is due by the master's clock and re-arm the timer (on the loop thread; the
        timer calls it, and so does a test that moved a fake clock). Returns how many expired."""
        expired = self.state.expire_due()
        if expired:
            log.debug("master %s: %d leases expired", self.name, expired)
        self._reschedule_expiry()
        return expired

    # -- handlers -----------------------------------------------------------------------------
    async def _hello(self, req: protocol.Hello, ctx: CallContext) -> protocol.HelloResp:
        log.debug("hello from %s (%s)", req.client, ctx.peer)
        return protocol.HelloResp(
            epoch=self.epoch,
            pid=os.getpid(),
            pool_fd=self.pool.fd,
            pool_size=self.pool.size,
            node=self.node,
            fd_socket=self._fd_socket_path,
        )

    async def _alloc(self, req: protocol.Alloc, ctx: CallContext) -> protocol.AllocResp:
        obj = self.state.alloc(req.nbytes, req.layout, req.ttl_s, req.pin, req.header)
        return protocol.AllocResp(oid=obj.oid, offset=obj.offset)

    async def _seal(self, req: protocol.Seal, ctx: CallContext) -> protocol.Ack:
        self.state.seal(req.oid)
        self._wake_seal_waiters(req.oid)
        return protocol.Ack()

    async def _reserve(self, req: protocol.Reserve, ctx: CallContext) -> protocol.Reserved:
        """Blocks for a client's next puts of one size class: as many as fit, up to the count
        (none when the pool has no room to spare: the client then allocates per put)."""
        if not 0 < req.block <= MAX_RESERVE_BLOCK or not 0 < req.count <= MAX_RESERVE_COUNT:
            raise CallerError(
                f"reserve of {req.count} blocks of {req.block} bytes: at most "
                f"{MAX_RESERVE_COUNT} blocks of at most {MAX_RESERVE_BLOCK} bytes"
            )
        blocks = []
        for _ in range(req.count):
            try:
                obj = self.state.reserve(req.block, ctx.peer)
            except PoolFull:
                break
            blocks.append((obj.oid, obj.offset))
        return protocol.Reserved(blocks)

    def _wake_seal_waiters(self, oid: int) -> None:
        for waiter in self._seal_waiters.pop(oid, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def _until_sealed(self, epoch: str, oid: int) -> None:
        """Clients seal without waiting for the answer (it saves a round trip per put), so a ref
        may reach another client before its seal reaches the master: such a get waits for the
        seal (an event), or for the object to go (then ``state.get`` says why)."""
        obj = self.state.lookup(epoch, oid)
        if obj.sealed:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seal_waiters.setdefault(oid, []).append(waiter)

        def on_gone(reason: str, since: float) -> None:
            if not waiter.done():
                waiter.set_result(None)

        self.state.add_gone_listener(epoch, oid, on_gone)
        try:
            await asyncio.wait_for(waiter, WRITE_TIMEOUT_S)
        except TimeoutError:
            raise CallerError(f"object {oid} is still being written (not sealed)") from None
        finally:
            self.state.remove_gone_listener(oid, on_gone)
            waiters = self._seal_waiters.get(oid)
            if waiters and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._seal_waiters[oid]

    async def _get(self, req: protocol.Get, ctx: CallContext) -> protocol.GetResp:
        obj = self.state.objects.get(req.oid)
        if obj is None or not obj.sealed:
            await self._until_sealed(req.epoch, req.oid)
        obj = self.state.get(req.epoch, req.oid)
        return protocol.GetResp(offset=obj.payload, nbytes=obj.nbytes, layout=obj.layout)

    async def _describe(self, req: protocol.Describe, ctx: CallContext) -> protocol.GetResp:
        await self._until_sealed(req.epoch, req.oid)
        obj = self.state.lookup(req.epoch, req.oid)
        return protocol.GetResp(offset=obj.payload, nbytes=obj.nbytes, layout=obj.layout)

    async def _release(self, req: protocol.OidList, ctx: CallContext) -> protocol.Ack:
        if self.disk is not None and req.epoch == self.epoch:
            # A released keyed object is gone from this node, its disk record too.
            bound = (self.state.objects.get(oid) for oid in req.oids)
            self.disk.drop([o.key for o in bound if o is not None and o.key is not None])
        self.state.release(req.epoch, req.oids)
        return protocol.Ack()

    async def _extend(self, req: protocol.Extend, ctx: CallContext) -> protocol.Ack:
        self.state.extend(req.epoch, req.oids, req.ttl_s)
        return protocol.Ack()

    async def _pin(self, req: protocol.Pin, ctx: CallContext) -> protocol.Ack:
        self.state.pin(req.epoch, req.oids, req.pinned)
        return protocol.Ack()

    async def _stats(self, req: protocol.StatsReq, ctx: CallContext) -> protocol.Stats:
        return msgspec.structs.replace(
            self.state.stats(),
            **({} if self.disk is None else self.disk.stats()),
            **self.peers.totals(),
            peer_served=self._peer_served,
            clients=self.server.connection_count,
            subscribers=len(self.feeds),
            peers=self.peers.status(self._clock()),
        )

    async def _wait_gone(self, req: protocol.WaitGone, ctx: CallContext) -> protocol.GoneResp:
        """Answer when the object is freed (or at the timeout): an event, not a poll."""
        protocol.check_timeout(req.timeout_s)
        timeout = min(req.timeout_s, MAX_WAIT_GONE_S)
        try:
            obj = self.state.lookup(req.epoch, req.oid)
        except RefstoreError as err:
            since = getattr(err, "since", None)
            if since is None:
                raise
            return protocol.GoneResp(gone=True, reason=type(err).reason, since=since)  # type: ignore[attr-defined]
        future: asyncio.Future[tuple[str, float]] = asyncio.get_running_loop().create_future()

        def on_gone(reason: str, since: float) -> None:
            if not future.done():
                future.set_result((reason, since))

        self.state.add_gone_listener(req.epoch, obj.oid, on_gone)
        try:
            reason, since = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return protocol.GoneResp(gone=False)
        finally:
            self.state.remove_gone_listener(obj.oid, on_gone)
        return protocol.GoneResp(gone=True, reason=reason, since=since)

    async def _set_faults(self, req: protocol.SetFaults, ctx: CallContext) -> protocol.Ack:
        log.warning("fault plan set to %r by %s", req.spec, ctx.peer)
        if req.spec == "kill!":
            self.faults.set("*:kill#1")
            await self.faults.apply("kill", ctx.peer)
        self.faults.set(req.spec)
        self._publish_flags()
        return protocol.Ack()

    async def _shutdown(self, req: protocol.Shutdown, ctx: CallContext) -> protocol.Ack:
        log.info("shutdown requested by %s: %s", ctx.peer, req.reason)
        # Close after this answer is on its way.
        asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self.close()))
        return protocol.Ack()

    async def _fetch(self, req: protocol.Fetch, ctx: CallContext) -> protocol.FetchResp:
        protocol.check_ttl(req.ttl_s)
        protocol.check_size(req.nbytes, "nbytes")
        return await self.remote.fetch(req)

    async def _send_to(self, req: protocol.SendTo, ctx: CallContext) -> protocol.SendToResp:
        protocol.check_size(req.dst_offset, "dst_offset")
        protocol.check_size(req.dst_region, "dst_region")
        cut = self.faults.takes("send_to", "cut")
        return await self.remote.send_to(req, ctx.peer, cut=cut)

    def _slot(self, obj: StoredObject, bound: bool = True) -> protocol.Slot:
        return protocol.Slot(obj.oid, obj.offset, obj.nbytes, bound)

    async def _put_keyed(self, req: protocol.PutKeyed, ctx: CallContext) -> protocol.PutKeyedResp:
        items = [(i.key, i.nbytes, i.layout, i.header) for i in req.items]
        got = self.state.alloc_keyed(items, req.ttl_s, req.pin)
        return protocol.PutKeyedResp([self._slot(obj, bound) for obj, bound in got])

    async def _seal_keyed(
        self, req: protocol.SealKeyed, ctx: CallContext
    ) -> protocol.SealKeyedResp:
        bound = self.state.seal_keyed(req.oids)
        for oid in req.oids:
            self._wake_seal_waiters(oid)
        return protocol.SealKeyedResp([None if o is None else self._slot(o) for o in bound])

    async def _lookup(self, req: protocol.Lookup, ctx: CallContext) -> protocol.LookupResp:
        hold_s = 0.0 if self.faults.ignores("hold") else req.hold_s
        if self.peers or self.disk is not None:
            check_hold(hold_s)
            local = self.state.lookup_keys(req.keys, 0.0, ctx.peer, count=False)
            if self.disk is not None and len(local) < len(req.keys):
                await self._continue_from_disk(req.keys)
                local = self.state.lookup_keys(req.keys, 0.0, ctx.peer, count=False)
            if self.peers and len(local) < len(req.keys):
                await self._continue_from_peers(req.keys, local)
        if not ctx.connected:
            # The caller left while this call waited (its timeout, a fault's delay): a hold
            # would have nobody to end it (its disconnect ended the ones it had).
            hold_s = 0.0
        # The whole run from the state as it is now: what the peers' objects added, and
        # nothing that went meanwhile.
        found = self.state.lookup_keys(req.keys, hold_s, ctx.peer)
        return protocol.LookupResp(self.epoch, [self._slot(obj) for obj in found])

    # -- peers --------------------------------------------------------------------------------
    def update_peers(self, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        """Add and remove peer masters (``host:port``; this master itself is skipped)."""
        add, remove = list(add), list(remove)
        for address in (*add, *remove):
            check_peer_address(address)
        own = {self.address, self.node}
        for address in self.peers.add(a for a in add if a not in own):
            log.info("master %s: peer %s added", self.name, address)
        for address in self.peers.remove(remove):
            log.info("master %s: peer %s removed", self.name, address)

    async def _update_peers(
        self, req: protocol.UpdatePeers, ctx: CallContext
    ) -> protocol.PeersResp:
        if req.add or req.remove:
            log.info("peers of %s changed by %s: +%s -%s", self.name, ctx.peer, req.add, req.remove)
        self.update_peers(req.add, req.remove)
        return protocol.PeersResp(self.peers.status(self._clock()))

    async def _peer_lookup(
        self, req: protocol.PeerLookup, ctx: CallContext
    ) -> protocol.PeerLookupResp:
        """A peer's question: the leading run stored here, the part of it on disk promoted
        first, as for a local lookup (a use; no hold: an object evicted before the peer's
        transfer is a miss there). Peers are not asked in turn: a round never chains."""
        found = self.state.lookup_keys(req.keys, 0.0, ctx.peer, count=False)
        if self.disk is not None and len(found) < len(req.keys):
            await self._continue_from_disk(req.keys)
            found = self.state.lookup_keys(req.keys, 0.0, ctx.peer, count=False)
        self._peer_served += len(found)
        objects = [protocol.PeerObject(o.oid, o.nbytes, o.layout) for o in found if o.layout]
        return protocol.PeerLookupResp(self.epoch, objects)

    async def _continue_from_peers(self, keys: list[bytes], local: list[StoredObject]) -> None:
        """Ask the peers for the keys past the local run and store the longest continuation
        here (see the module docstring). Never raises for a peer's fault."""
        round_ = self.peers.begin(self._clock())
        if not round_.asked:
            return
        rest = keys[len(local) :]
        # The local run must survive the allocations below, whatever the caller's hold.
        holder = f"peer-round-{next(self._round_ids)}"
        round_s = min(self.peer_timeout_s + self.peer_fetch_timeout_s + 1.0, MAX_HOLD_S)
        self.state.hold(local, holder, round_s)
        try:
            answers = await self._ask_peers(round_, rest)
            best = round_.best()
            if best is not None:
                address, run = best
                epoch, objects = answers[address]
                await self._fetch_continuation(round_, address, epoch, rest[:run], objects[:run])
        except BaseException:
            round_.abandon()
            raise
        finally:
            self.state.unhold(self.epoch, [obj.oid for obj in local], holder)

    async def _ask_peers(
        self, round_: PeerRound, rest: list[bytes]
    ) -> dict[str, tuple[str, list[protocol.PeerObject]]]:
        assert self.remote is not None
        request = protocol.PeerLookup(rest)
        results = await asyncio.gather(
            *(
                self.remote.call(address, protocol.PEER_LOOKUP, request, self.peer_timeout_s)
                for address in round_.asked
            ),
            return_exceptions=True,
        )
        answers = {}
        for address, result in zip(round_.asked, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
            if isinstance(result, Exception):
                why = f"no answer to peer_lookup ({type(result).__name__}: {result})"
            elif len(result.found) > len(rest):
                why = f"answered {len(result.found)} keys for {len(rest)}"
            else:
                if round_.answered(address, len(result.found)):
                    log.info("master %s: peer %s answers again", self.name, address)
                answers[address] = (result.epoch, result.found)
                continue
            self._peer_failed(round_.failed(address, why), address, why)
        return answers

    def _peer_failed(self, first: bool, address: str, why: str) -> None:
        """Log a peer's failure once (when it goes down); it is not asked during its back-off."""
        if first:
            log.warning(
                "master %s: peer %s is a miss: %s; not asked again until a back-off passes",
                self.name,
                address,
                why,
            )

    def _header_writer(self, layout: protocol.Layout) -> header.Writer:
        raw = header.encode_layout(layout)
        writer = self._header_writers.get(raw)
        if writer is None:
            if len(self._header_writers) >= HEADER_WRITERS_MAX:
                self._header_writers.clear()
            writer = self._header_writers[raw] = header.Writer(raw)
        return writer

    async def _fetch_continuation(
        self,
        round_: PeerRound,
        address: str,
        epoch: str,
        keys: list[bytes],
        objects: list[protocol.PeerObject],
    ) -> None:
        """Allocate the continuation here (in order, as many as fit; keys stored here
        meanwhile are skipped), pull the payloads, seal the leading run that arrived whole and
        free the rest."""
        assert self.remote is not None
        state = self.state
        blocks: list[tuple[StoredObject, header.Writer, protocol.PeerObject]] = []
        why = ""
        for key, remote in zip(keys, objects, strict=True):
            if state.bound(key) is not None:
                continue  # stored here since the walk (a put, another lookup's fetch)
            try:
                writer = self._header_writer(remote.layout)
                obj = state.alloc(remote.nbytes, remote.layout, None, False, writer.hlen, key=key)
            except PoolFull:
                break  # no room: what is here so far is the answer
            except CallerError as err:  # the peer's numbers
                why = f"described object {remote.oid} badly: {err}"
                break
            blocks.append((obj, writer, remote))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.peer_fetch_timeout_s
        parallel = asyncio.Semaphore(PEER_FETCH_PARALLEL)

        async def move(obj: StoredObject, remote: protocol.PeerObject) -> None:
            async with parallel:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"not started within {self.peer_fetch_timeout_s} s")
                await self.remote.pull_into(
                    address,
                    epoch,
                    remote.oid,
                    nbytes=remote.nbytes,
                    dst_offset=obj.payload,
                    timeout_s=left,
                )

        cancelled: BaseException = asyncio.CancelledError("the lookup was cancelled")
        results: list[BaseException | None] = [cancelled] * len(blocks)
        try:
            results = await asyncio.gather(
                *(move(obj, remote) for obj, _, remote in blocks), return_exceptions=True
            )
        finally:
            # Cancelled or not, every pull has ended here: the blocks are this master's again.
            moved = moved_bytes = 0
            whole = True
            for (obj, writer, remote), result in zip(blocks, results, strict=True):
                alive = state.objects.get(obj.oid) is obj
                if whole and result is None and alive:
                    writer.write(self.pool.view, obj.offset, obj.oid, self._tag_key, obj.nbytes)
                    state.seal(obj.oid)  # first writer wins: a put of the key may have come
                    moved += 1
                    moved_bytes += obj.nbytes
                    continue
                if whole and result is not None and not why:
                    why = f"moving object {remote.oid} failed: {type(result).__name__}: {result}"
                whole = False
                if alive:
                    state.release(self.epoch, [obj.oid])
            round_.fetched(moved, moved_bytes)
        if why:
            self._peer_failed(round_.fetch_failed(why, self._clock()), address, why)

    # -- disk tier ----------------------------------------------------------------------------
    def _spill(self, obj: StoredObject) -> None:
        """The state evicts the keyed cache entry ``obj`` (its bytes still in the pool)."""
        assert self.disk is not None
        assert obj.key is not None
        assert obj.layout is not None
        payload = self.pool.view[obj.payload : obj.payload + obj.nbytes]
        try:
            self.disk.spill(obj.key, header.encode_layout(obj.layout), payload, obj.oid)
        finally:
            payload.release()

    async def flush_disk(self) -> None:
        """Until every spill queued so far is written (tests, benchmarks)."""
        if self.disk is not None:
            await self.disk.flush()

    async def _continue_from_disk(self, keys: list[bytes]) -> None:
        """Promote the keys of the run that continue on disk: walk ``keys`` while each is in
        memory or on disk, allocate the disk ones here (in order, as many as fit), read them
        into their blocks (parallel, within ``disk_read_timeout_s``), then write the headers
        and seal the leading ones that arrived whole; free the rest. Never raises for the
        disk's faults (a bad record is a miss from its key on, logged with the key)."""
        assert self.disk is not None
        state, index = self.state, self.disk.index
        leading: list[StoredObject] = []  # the local run before the first key on disk
        records = []
        for key in keys:
            obj = state.bound(key)
            if obj is not None:
                if not records:
                    leading.append(obj)
                continue
            record = index.begin_read(key)
            if record is None:
                break
            records.append(record)
        if not records:
            return
        # The local run must survive the allocations below, whatever the caller's hold (as in a
        # peer round). Objects of the run past the first key on disk are not held: making room
        # for that key may evict them (a longer prefix is worth more than a later part).
        holder = f"disk-round-{next(self._round_ids)}"
        state.hold(leading, holder, min(self.disk_read_timeout_s + 1.0, MAX_HOLD_S))
        pending = collections.deque(records)  # reads begun, no block allocated for them yet
        blocks: list[_Promotion] = []
        try:
            while pending:
                record = pending[0]
                try:
                    layout = _decode_layout(record.layout)
                    writer = self._header_writer(layout)
                    obj = state.alloc(
                        record.nbytes, layout, None, False, writer.hlen, key=record.key
                    )
                except PoolFull:
                    break  # no room: what is here so far is the answer
                except (CallerError, msgspec.DecodeError) as err:  # a bad record of a past run
                    pending.popleft()
                    index.read_done(record, False, from_file=False)
                    log.warning("disk tier: key %r is a miss: %s", record.key, err)
                    break
                pending.popleft()
                dst = self.pool.view[obj.payload : obj.payload + obj.nbytes]
                if record.staged is not None:
                    self.disk.copy_staged(record, dst)  # not written yet: still in memory
                    dst.release()
                    index.read_done(record, True, from_file=False)
                    blocks.append(_Promotion(record, obj, writer, None))
                    continue
                state.begin_send(obj)  # not freed (reused) while a reader writes into it
                blocks.append(_Promotion(record, obj, writer, self.disk.read(record, dst)))
            reads = [block.read for block in blocks if block.read is not None]
            if reads:
                await asyncio.wait(reads, timeout=self.disk_read_timeout_s)
        finally:
            for record in pending:
                index.read_done(record, True, from_file=False)
            self._finish_promotion(blocks)
            state.unhold(self.epoch, [obj.oid for obj in leading], holder)

    def _finish_promotion(self, blocks: list[_Promotion]) -> None:
        """Seal the leading promotions that arrived whole; release the rest (a read still
        running keeps its block until it ends: ``_late_read``)."""
        assert self.disk is not None
        state, index = self.state, self.disk.index
        whole = True
        for record, obj, writer, read in blocks:
            why = None
            if read is not None:
                if read.done():
                    why = _read_outcome(read)
                    index.read_done(record, why is None)
                    state.end_send(obj)
                else:
                    why = f"not read within {self.disk_read_timeout_s} s"
                    read.add_done_callback(functools.partial(self._late_read, record, obj))
            if why is not None:
                log.warning("master %s: disk tier: key %r a miss: %s", self.name, record.key, why)
            alive = state.objects.get(obj.oid) is obj
            if whole and why is None and alive:
                writer.write(self.pool.view, obj.offset, obj.oid, self._tag_key, obj.nbytes)
                if state.seal(obj.oid) is obj:  # first writer wins: a put may have come
                    index.set_mirror(record, obj.oid)
                    index.counters["disk_hits"] += 1
                continue
            whole = False
            if alive:
                state.release(self.epoch, [obj.oid])  # a block still being read: at its end

    def _late_read(self, record: DiskRecord, obj: StoredObject, read: asyncio.Future) -> None:
        """A read a lookup stopped waiting for has ended: its block can go now."""
        if self._closed or self.disk is None:
            return
        self.disk.index.read_done(record, _read_outcome(read) is None)
        self.state.end_send(obj)
        self._reschedule_expiry()

    async def _unhold(self, req: protocol.OidList, ctx: CallContext) -> protocol.Ack:
        self.state.unhold(req.epoch, req.oids, ctx.peer)
        return protocol.Ack()

    async def _evict_keys(self, req: protocol.EvictKeys, ctx: CallContext) -> protocol.Ack:
        log.warning("evicting %d keys on request of %s", len(req.keys), ctx.peer)
        self.state.evict_keys(req.keys)
        if self.disk is not None:
            self.disk.drop(req.keys)  # lost on this node: not promoted back
        return protocol.Ack()

    async def _subscribe_keys(self, req: protocol.SubscribeKeys, ctx: CallContext) -> protocol.Ack:
        """Events from now on go to this connection's queue (until it disconnects)."""
        self.feeds.subscribe(ctx.peer)
        return protocol.Ack()

    async def _key_events(
        self, req: protocol.NextKeyEvents, ctx: CallContext
    ) -> protocol.KeyEventsResp:
        """Answered once the caller's queue has events: a wait, not a poll."""
        if ctx.peer not in self.feeds:
            raise CallerError(f"{ctx.peer} asked for key events without subscribing")
        if ctx.peer in self._feed_waiters:
            raise CallerError(f"{ctx.peer} asked for key events twice at once")
        if not self.feeds.pending(ctx.peer):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._feed_waiters[ctx.peer] = waiter
            try:
                await waiter
            finally:
                if self._feed_waiters.get(ctx.peer) is waiter:
                    del self._feed_waiters[ctx.peer]
        return protocol.KeyEventsResp(self.feeds.take(ctx.peer))

    async def _read_range(self, req: protocol.ReadRange, ctx: CallContext) -> bytes:
        obj = self.state.get(req.epoch, req.oid)
        if req.offset < 0 or req.length < 0 or req.offset + req.length > obj.nbytes:
            raise CallerError(f"range {req.offset}+{req.length} outside object of {obj.nbytes}")
        start = obj.payload + req.offset
        if self.faults.takes("read_range", "cut"):
            return bytes(self.pool.view[start : start + req.length // 2])
        # A copy: the answer may sit in the transport's buffer after the object is freed.
        return bytes(self.pool.view[start : start + req.length])


class MasterThread:
    """A master on its own loop thread inside this process (tests, the Ray actor).

    ``close()`` is idempotent; it closes the master, then the loop thread.
    """

    def __init__(
        self,
        name: str = discovery.DEFAULT_NAME,
        pool_size: int | str = DEFAULT_POOL_SIZE,
        **kwargs: Any,
    ) -> None:
        self._loop = LoopThread(name=f"refstore-master-{name}")
        try:
            self.master: Master = self._loop.run(Master.start(name, pool_size, **kwargs))
        except BaseException:
            self._loop.close()
            raise
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def address(self) -> str:
        return self.master.address

    @property
    def epoch(self) -> str:
        return self.master.epoch

    def update_peers(self, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        """``Master.update_peers`` on the master's loop thread."""

        async def update() -> None:
            self.master.update_peers(add, remove)

        self._loop.run(update())

    def flush_disk(self) -> None:
        """``Master.flush_disk`` on the master's loop thread: every spill so far written."""
        self._loop.run(self.master.flush_disk())

    def check_deadlines(self) -> int:
        """``Master.check_deadlines`` on the master's loop thread."""

        async def check() -> int:
            return self.master.check_deadlines()

        return self._loop.run(check())

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._loop.run(self.master.close(), timeout=30)
        finally:
            self._loop.close()

    def __enter__(self) -> MasterThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def serve(
    name: str = discovery.DEFAULT_NAME,
    pool_size: int | str = DEFAULT_POOL_SIZE,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    advertise: str | None = None,
    ready: Callable[[Master], None] | None = None,
    remote: str = "auto",
    peers: Iterable[str] | None = None,
    peer_timeout_s: float = PEER_TIMEOUT_S,
    peer_fetch_timeout_s: float = PEER_FETCH_TIMEOUT_S,
    disk: str | None = None,
    disk_size: int | str | None = None,
    spill_queue: int | str = DEFAULT_SPILL_QUEUE,
) -> None:
    """Run a master until SIGTERM/SIGINT or a shutdown RPC."""
    import signal

    master = await Master.start(
        name,
        pool_size,
        host,
        port,
        advertise=advertise,
        remote=remote,
        peers=peers,
        peer_timeout_s=peer_timeout_s,
        peer_fetch_timeout_s=peer_fetch_timeout_s,
        disk=disk,
        disk_size=disk_size,
        spill_queue=spill_queue,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(master.close()))
    if ready is not None:
        ready(master)
    await master.closed_event.wait()
