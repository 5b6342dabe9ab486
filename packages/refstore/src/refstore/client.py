"""The client: put / get / release / extend / pin / stats against the node-local master.

Fast paths (no round trip to the master, see ``header.py``):

- **get** of a local ref checks the object's header in shared memory (magic, state, oid, tag,
  lease deadline) and builds zero-copy views from the layout stored there: a few µs whatever the
  size. Anything the header cannot vouch for (freed, expired, evicted, not sealed yet, another
  epoch) goes to the master, which answers with the typed reason or waits for the seal.
- **put** of a size this client has put before takes a block it **reserved** ahead of time (up
  to ``RESERVE_DEPTH`` per size class, classes 1/8 of a power of two apart, at most
  ``reserve_budget`` bytes in all), copies the payload and writes the header, and sends nothing:
  the header is the commit record, which the master reads when the object first matters to it
  (``state.py``). One ``reserve`` call in the background refills a class's stock every few puts.
  Other sizes take an ``alloc`` round trip first and a ``seal`` sent without waiting for the
  answer: a get from elsewhere that overtakes the seal waits for it at the master.

While the master has a fault plan (``faults.py``) the pool's control page tells clients to send
every operation to the master, so that injected faults apply to all of them.

A ref owned by another node's master is fetched into the local pool by the local master
(``remote.py``) first.

Threads: the client owns a ``SyncClient`` (its loop thread) and, lazily, one copy thread for large
puts; ``close()`` stops both and unmaps the pool once no view is left. The client is thread-safe.

Master restarts: when the connection to the master is lost the client re-reads the discovery file;
if a new master (new epoch) is running it re-attaches to the new pool, gives refs of the old epoch a
``MasterRestarted`` error (with the time the old master was noticed gone) and retries puts once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from simple_rpc import RpcError, SyncClient

from . import _fastpath, codec, discovery, header, protocol
from .codec import PARALLEL_COPY_MIN
from .errors import (
    CallerError,
    MasterRestarted,
    MasterUnavailable,
    from_info,
)
from .header import OBJECT_PINNED
from .pool import SharedPool
from .protocol import KIND_TORCH
from .ref import Ref

log = logging.getLogger("refstore.client")

DEFAULT_TTL_S = float(os.environ.get("REFSTORE_TTL", "300"))
DEFAULT_TIMEOUT_S = 30.0
MAX_REMEMBERED_COPIES = 100_000
RESERVE_MAX_BLOCK = 16 << 20  # above this a put's round trip is small next to its copy
RESERVE_BUDGET_MAX = 64 << 20
RESERVE_DEPTH = 8  # blocks per class in stock or on their way: back-to-back puts find one ready
RESERVE_LOW = RESERVE_DEPTH // 2  # refill a class when no more than this many are left
# A reservation older than this is not used: the master frees unused ones after WRITE_TIMEOUT_S.
RESERVATION_MAX_AGE_NS = 30_000_000_000


class _Copier:
    """Copies large contiguous payloads with the caller's thread plus one helper thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.threads = max(1, min(2, os.cpu_count() or 1))

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="refstore-copy"
                )
            return self._pool

    def copy_numpy(self, target: np.ndarray, source: np.ndarray) -> None:
        contiguous = source.flags.c_contiguous and target.flags.c_contiguous and source.ndim > 0
        if self.threads < 2 or source.nbytes < PARALLEL_COPY_MIN or not contiguous:
            np.copyto(target, source, casting="no")
            return
        flat_dst = target.reshape(-1).view(np.uint8)
        flat_src = source.reshape(-1).view(np.uint8)
        half = (flat_src.nbytes // 2) & ~4095
        helper = self._executor().submit(np.copyto, flat_dst[half:], flat_src[half:])
        np.copyto(flat_dst[:half], flat_src[:half])
        helper.result()

    def copy_torch(self, target: Any, source: Any) -> None:
        target.copy_(source)  # torch's own intra-op threads split large copies

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class _Reservations:
    """Blocks taken ahead of time for the next puts of each size class this client has put twice.

    Stock is refilled in batches (one ``reserve`` call per several puts) that grow with how often
    the class is put, up to ``RESERVE_DEPTH`` blocks per class and ``budget`` bytes in all. All
    methods run under the client's lock; reserved blocks arrive on the RPC loop thread.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # class -> (oid, at, when it arrived (monotonic ns), the connection it was reserved on)
        self.stock: dict[int, deque[tuple[int, int, int, int]]] = {}
        self.in_flight: dict[int, int] = {}  # class -> blocks asked for, not arrived
        self.seen: OrderedDict[int, int] = OrderedDict()  # class -> puts, most recent last
        self.bytes = 0  # in stock + in flight

    def next(
        self, block: int, now_ns: int, connection: int
    ) -> tuple[tuple[int, int, int, int] | None, int]:
        """For a put of this class: (a reserved block or None, how many blocks to ask for now);
        a block is (oid, offset, when it arrived, its connection). The usual case, a class well
        in stock, is decided first and alone.

        Blocks reserved on an earlier connection are dropped, not used: the master frees a
        disconnected client's unused blocks (``state.DISCONNECT_GRACE_S``)."""
        stock = self.stock.get(block)
        while stock:
            entry = stock.popleft()
            _, _, taken, reserved_on = entry
            self.bytes -= block
            if now_ns - taken < RESERVATION_MAX_AGE_NS and reserved_on == connection:
                if len(stock) + self.in_flight.get(block, 0) > RESERVE_LOW:
                    return entry, 0
                return entry, self._wanted(block)
        return None, self._wanted(block)

    def put_back(self, block: int, entry: tuple[int, int, int, int]) -> None:
        """Return an unused block that ``next`` handed out, to be handed out first again."""
        self.stock.setdefault(block, deque()).appendleft(entry)
        self.bytes += block

    def _wanted(self, block: int) -> int:
        """Count a put of this class that found its stock low; how many blocks to ask for."""
        seen = self.seen[block] = self.seen.get(block, 0) + 1
        self.seen.move_to_end(block)
        while len(self.seen) > 64:
            self.seen.popitem(last=False)
        if block > RESERVE_MAX_BLOCK or seen < 2:
            return 0
        have = len(self.stock.get(block, ())) + self.in_flight.get(block, 0)
        if have > RESERVE_LOW:
            return 0
        # Grows with how often the class is put (counted while its stock runs low).
        count = min(RESERVE_DEPTH - have, seen, (self.budget - self.bytes) // block)
        if count <= 0:
            return 0
        self.in_flight[block] = self.in_flight.get(block, 0) + count
        self.bytes += count * block
        return count

    def arrived(
        self, block: int, asked: int, blocks: list[tuple[int, int]], now_ns: int, connection: int
    ) -> None:
        self.in_flight[block] -= asked
        self.bytes -= (asked - len(blocks)) * block
        stock = self.stock.setdefault(block, deque())
        stock.extend((oid, at, now_ns, connection) for oid, at in blocks)

    def drain(self) -> list[int]:
        """Forget every block in stock; returns their oids (to release)."""
        oids = [entry[0] for stock in self.stock.values() for entry in stock]
        for block, stock in self.stock.items():
            self.bytes -= block * len(stock)
        self.stock.clear()
        return oids


class Client:
    """Connect with ``refstore.connect()`` (finds or starts the local master) or directly."""

    def __init__(
        self,
        name: str = discovery.DEFAULT_NAME,
        *,
        address: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        default_ttl: float | None = DEFAULT_TTL_S,
        reserve_budget: int | None = None,
    ) -> None:
        self.name = name
        self._reserve_budget = reserve_budget
        self.timeout = timeout
        self.default_ttl = default_ttl
        self._fixed_address = address
        self._lock = threading.RLock()  # (re)connecting; may be held across blocking calls
        # Bookkeeping (pending seals, reservations, counters, copies): never held across a
        # blocking call, because the RPC loop thread takes it in its callbacks.
        self._book = threading.Lock()
        self._reservation_landed = threading.Condition(self._book)
        self._copier = _Copier()
        self._layouts: dict[Any, Any] = {}  # (type, dtype, shape) -> layout (codec.encode_cached)
        self._rpc: SyncClient | None = None
        self._pool: SharedPool | None = None
        self._old_pools: list[SharedPool] = []
        self._closed = False
        self.epoch = ""
        self.node = ""
        self.address = ""
        self._past_epochs: dict[str, float] = {}
        self._owners: dict[str, SyncClient] = {}  # other nodes' masters, for remote release
        # remote (pool, oid) -> (local pool, oid) of the copy a remote get made here
        self._pending_calls: set[concurrent.futures.Future] = set()  # seals, reservations
        self._local_copies: OrderedDict[tuple[str, int], tuple[str, int]] = OrderedDict()
        self._reservations = _Reservations(0)
        self._tag_key = 0
        self.counters = dict.fromkeys(("puts", "gets", "fast_puts", "fast_gets"), 0)
        self._attach()

    # -- connection ---------------------------------------------------------------------------
    def _attach(self) -> None:
        """(Re)connect to the master named in the discovery file and map its pool."""
        address = self._fixed_address
        info = discovery.read_info(self.name)
        if info is not None:
            self._past_epochs.update(dict(info.past_epochs))
        if address is None:
            if info is None or not discovery.master_running(self.name):
                raise MasterUnavailable(
                    f"no refstore master {self.name!r} is running (dir {discovery.directory()}); "
                    "start one with `refstore serve` or use refstore.connect(autostart=True)"
                )
            address = info.address
        rpc = SyncClient(address)
        try:
            hello = rpc.call(
                protocol.HELLO,
                protocol.Hello(f"{self.name} pid {os.getpid()}"),
                timeout=self.timeout,
            )
            pool = SharedPool.attach(hello.pid, hello.pool_fd, hello.pool_size, hello.fd_socket)
        except RpcError as err:
            rpc.close()
            raise MasterUnavailable(
                f"refstore master at {address}: {type(err).__name__}: {err}"
            ) from err
        except BaseException:
            rpc.close()
            raise
        if self.epoch and self.epoch != hello.epoch:
            self._past_epochs.setdefault(self.epoch, time.time())
            log.warning(
                "refstore master %s restarted: epoch %s -> %s", self.name, self.epoch, hello.epoch
            )
        old_rpc, old_pool = self._rpc, self._pool
        with self._book:
            self._rpc, self._pool = rpc, pool
            self.epoch, self.node, self.address = hello.epoch, hello.node, address
            self._tag_key = header.epoch_key(hello.epoch)
            self._headers = header.Reader(self._tag_key)
            # Reservations of the old master's pool went with it.
            self._reservations.drain()
            budget = min(RESERVE_BUDGET_MAX, hello.pool_size // 32)
            self._reservations = _Reservations(
                budget if self._reserve_budget is None else self._reserve_budget
            )
        if old_rpc is not None:
            old_rpc.close()
        if old_pool is not None:
            old_pool.close()  # stays mapped while old views are alive

    def _call(self, method: Any, request: Any, *, timeout: float | None = None) -> Any:
        if self._closed:
            raise CallerError("refstore client is closed")
        rpc = self._rpc
        assert rpc is not None
        try:
            resp = rpc.call(method, request, timeout=timeout or self.timeout)
        except RpcError as err:
            raise MasterUnavailable(
                f"refstore master at {self.address}: {type(err).__name__}: {err}"
            ) from err
        err_info = getattr(resp, "err", None)
        if err_info is not None:
            raise from_info(err_info)
        return resp

    def reconnect(self) -> bool:
        """Re-attach after losing the master. True if a different master (new epoch) took over."""
        with self._lock:
            before = self.epoch
            self._attach()
            return self.epoch != before

    def _check_epoch(self, ref: Ref) -> None:
        """Raise MasterRestarted for refs of a local master that no longer runs."""
        since = self._past_epochs.get(ref.pool)
        if since is not None:
            raise MasterRestarted(f"object {ref.oid} of pool {ref.pool} (now {self.epoch})", since)

    def _with_recovery(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)``; if the master is gone and a new one runs, re-attach and run it
        again (a put then lands in the new pool; a get of an old ref raises MasterRestarted)."""
        try:
            return fn(*args)
        except MasterUnavailable:
            if not self._recovered():
                raise
        return fn(*args)

    def _recovered(self) -> bool:
        """After MasterUnavailable: True if a new master took over and this client re-attached
        to it (the failed call may run again), False if the error stands."""
        return self._fixed_address is None and self.reconnect()

    # -- put ----------------------------------------------------------------------------------
    def put(self, obj: Any, *, ttl: float | str | None = "default", pin: bool = False) -> Ref:
        """Store ``obj`` (array, tensor, bytes, or a list/tuple/dict of them) and return its ref.

        ``ttl``: lease seconds (default ``default_ttl``); ``None`` for no lease (a cache entry,
        evictable under memory pressure). ``pin``: soft pin (evicted only when nothing else can be).
        """
        ttl_s = self.default_ttl if ttl == "default" else ttl
        encoded, sources = codec.encode_cached(obj, self._layouts)
        # ``_with_recovery(self._put, ...)`` without its frame: a put runs where every step costs.
        try:
            return self._put(encoded, sources, ttl_s, pin)
        except MasterUnavailable:
            if not self._recovered():
                raise
        return self._put(encoded, sources, ttl_s, pin)

    def _put(self, encoded: codec.Encoded, sources: list[Any], ttl_s: Any, pin: bool) -> Ref:
        layout, nbytes, block = encoded.layout, encoded.nbytes, encoded.block
        reserved = None
        ask = 0
        now_ns = time.monotonic_ns()
        with self._book:  # one consistent connection, even if another thread reconnects
            rpc, pool, epoch, key = self._rpc, self._pool, self.epoch, self._tag_key
            reservations = self._reservations
            assert rpc is not None
            assert pool is not None
            connection = rpc.connection  # 0 while down: the master may be gone, so ask it
            if connection:
                reserved, ask = reservations.next(block, now_ns, connection)
            self.counters["puts"] += 1
            self.counters["fast_puts"] += reserved is not None
        if ask:
            # Before the copy, so the blocks are on their way while it runs.
            try:
                request = protocol.Reserve(block, ask)
                pending = rpc.call_future(protocol.RESERVE, request, self.timeout)
            except BaseException:
                with self._book:
                    reservations.arrived(block, ask, [], 0, 0)
                raise
            self._track(pending)
            pending.add_done_callback(
                functools.partial(self._reserved, (block, ask, reservations, epoch, rpc))
            )
        view = pool.view
        deadline_ns = 0 if ttl_s is None else now_ns + int(ttl_s * 1e9)
        flags = OBJECT_PINNED * pin
        while True:  # twice at most: a reserved block refused, then one from the master
            if reserved is not None:
                oid, at = reserved[0], reserved[1]
            else:
                try:
                    request = protocol.Alloc(nbytes, layout, ttl_s, pin, encoded.header.hlen)
                    resp = self._call(protocol.ALLOC, request)
                except BaseException:
                    with self._book:
                        self.counters["puts"] -= 1  # counted above, not made
                    raise
                oid, at = resp.oid, resp.offset
            try:
                written = self._write(
                    encoded,
                    sources,
                    view=view,
                    at=at,
                    oid=oid,
                    key=key,
                    deadline_ns=deadline_ns,
                    flags=flags,
                    reserved=reserved is not None,
                )
            except BaseException:
                self._put_failed(epoch, oid, fast=reserved is not None)
                raise
            if written:
                break
            # A fault plan sends every operation to the master (the control page): the block
            # goes back to the stock, unwritten, and the master allocates instead.
            with self._book:
                self.counters["fast_puts"] -= 1
                reservations.put_back(block, reserved)
            reserved = None
        if reserved is None:
            # Sealed without waiting for the answer: the master handles this connection's frames
            # in order, and a get from elsewhere that overtakes the seal waits for it there.
            sealing = rpc.call_future(protocol.SEAL, protocol.Seal(oid), self.timeout)
            self._track(sealing)
            sealing.add_done_callback(self._sealed)
        # A put into a reserved block sends nothing: its header is the commit record, which
        # the master reads when the object first matters to it (``state.py``, settle).
        return Ref(epoch, oid, nbytes, self.node, at)

    def _write(
        self,
        encoded: codec.Encoded,
        sources: list[Any],
        *,
        view: memoryview,
        at: int,
        oid: int,
        key: int,
        deadline_ns: int,
        flags: int,
        reserved: bool,
    ) -> bool:
        """The payload, then the header that seals it, into the block at ``at``: a lone item's
        in one native call (a put runs where caches are cold and every step costs), anything
        else (several items, a strided source) item by item. False, with nothing written, for a
        ``reserved`` block while a fault plan sends every operation to the master (the control
        page). ``key``: the tag key of the pool taken with the put's connection (a reconnect
        may have changed the client's since)."""
        writer = encoded.header
        sealed: bool | None = False
        direct = encoded.direct
        if direct is not None:
            source = sources[0]
            if direct == KIND_TORCH:
                # Its memory is the payload unless strided or a lazy negation or conjugate view
                # (torch has conjugate views of complex tensors only).
                if (
                    not source.is_contiguous()
                    or source.is_neg()
                    or (encoded.complex and source.is_conj())
                ):
                    source = None
                else:
                    source = source.data_ptr()
            if source is not None:
                sealed = _fastpath.put_sealed(
                    view,
                    at,
                    writer.hlen,
                    source,
                    encoded.nbytes,
                    writer.template,
                    oid,
                    key,
                    deadline_ns,
                    flags,
                )
        if sealed:
            return True
        if reserved and (sealed is None or view[4] & header.FLAG_MASTER_PATH):
            return False
        for item, source in zip(encoded.layout.items, sources, strict=True):
            codec.copy_into(view, at + writer.hlen + item.offset, source, item, self._copier)
        _fastpath.seal(view, at, writer.template, oid, key, encoded.nbytes, deadline_ns, flags)
        return True

    def _put_failed(self, epoch: str, oid: int, *, fast: bool) -> None:
        """Undo the counting of a put that raised, and free its block."""
        with self._book:
            self.counters["puts"] -= 1  # counted above, not made
            self.counters["fast_puts"] -= fast
        with contextlib.suppress(Exception):
            self._call(protocol.RELEASE, protocol.OidList(epoch, [oid]))

    def _track(self, pending: concurrent.futures.Future) -> None:
        """Remember a call that a put started and did not wait for (``flush`` waits for them)."""
        with self._book:
            self._pending_calls.add(pending)
        pending.add_done_callback(self._untrack)

    def _untrack(self, pending: concurrent.futures.Future) -> None:
        with self._book:
            self._pending_calls.discard(pending)

    def _sealed(self, future: concurrent.futures.Future) -> None:
        """On the RPC loop thread: log a failed seal (the put's caller has returned)."""
        err = _failure(future)
        if err is not None:
            log.warning("refstore seal failed on %s: %s", self.address, err)

    def _reserved(
        self,
        asked_for: tuple[int, int, _Reservations, str, SyncClient],
        future: concurrent.futures.Future,
    ) -> None:
        """On the RPC loop thread (no blocking calls): stock the blocks reserved for later puts.
        ``asked_for``: (block, count, the stock, pool epoch, connection) at the time of asking."""
        block, asked, reservations, epoch, rpc = asked_for
        err = _failure(future)
        blocks = future.result().blocks if err is None else []
        if err is not None:
            log.warning("refstore reserve failed on %s: %s", self.address, err)
        with self._book:
            current = self.epoch == epoch and not self._closed
            # Into the stock they were asked for: a reconnect in between replaced (and drained) it.
            # The answer came on the connection open now: this callback runs on the loop
            # thread as the answer is delivered, before any reconnect.
            connection = rpc.connections_opened
            stocked = blocks if current else []
            reservations.arrived(block, asked, stocked, time.monotonic_ns(), connection)
            self._reservation_landed.notify_all()
        if blocks and not current:
            # Reserved in a pool this client has left or closed: give them back.
            oids = [oid for oid, _ in blocks]
            with contextlib.suppress(Exception):
                rpc.call_future(protocol.RELEASE, protocol.OidList(epoch, oids), self.timeout)

    # -- get ----------------------------------------------------------------------------------
    def get(
        self, ref: Ref, *, as_: str | None = None, writable: bool = False, ttl: float | None = None
    ) -> Any:
        """Zero-copy view(s) of a stored object: numpy arrays, torch tensors, or memoryviews.

        Read-only unless ``writable=True`` (writes then go to the shared object). torch has no
        read-only tensors: a read-only torch view must simply not be written to. ``as_`` may be
        ``"numpy"`` or ``"torch"`` to convert on the fly. Views stay valid while the object lives
        (lease or release decide); they keep the pool mapped even after ``close()``.
        A ref of another node's master is first pulled into the local pool (``ttl`` = the local
        copy's lease, default ``default_ttl``).
        """
        if as_ not in (None, "numpy", "torch"):
            raise CallerError(f"as_ must be None, 'numpy' or 'torch', got {as_!r}")
        if not isinstance(ref, Ref):
            raise CallerError(f"expected a refstore.Ref, got {type(ref).__name__}")

        pool, rpc = self._pool, self._rpc
        # Not connected: the master may be gone (its pool stays mapped here, readable but no
        # longer kept); the master path finds out and says so.
        if ref.pool == self.epoch and ref.at >= 0 and pool is not None and rpc.connection:
            view = pool.view
            found = self._headers.sealed(view, ref.at, ref.oid, time.monotonic_ns())
            if found is not None:
                with self._book:
                    self.counters["gets"] += 1
                    self.counters["fast_gets"] += 1
                payload, layout, plan = found
                if plan is not None and as_ != "numpy":  # one tensor: no layout to walk
                    tensor = codec.tensor_on_pool(pool, payload + plan.offset, plan)
                    if tensor is not None:
                        return tensor
                return codec.decode(view, payload, layout, as_, writable, pool=pool)

        def resolve() -> tuple[int, protocol.Layout]:
            if ref.pool == self.epoch:
                resp = self._call(protocol.GET, protocol.Get(ref.pool, ref.oid))
                return resp.offset, resp.layout
            self._check_epoch(ref)
            fetch_ttl = ttl if ttl is not None else (self.default_ttl or DEFAULT_TTL_S)
            resp = self._call(
                protocol.FETCH,
                protocol.Fetch(ref.pool, ref.oid, ref.nbytes, ref.node, fetch_ttl),
                timeout=max(self.timeout, 120.0),
            )
            with self._book:
                self._local_copies[(ref.pool, ref.oid)] = (resp.epoch, resp.oid)
                while len(self._local_copies) > MAX_REMEMBERED_COPIES:
                    self._local_copies.popitem(last=False)
            return resp.offset, resp.layout

        offset, layout = self._with_recovery(resolve)
        with self._book:
            self.counters["gets"] += 1
        pool = self._pool
        assert pool is not None
        return codec.decode(pool.view, offset, layout, as_, writable, pool=pool)

    # -- lifetime -----------------------------------------------------------------------------
    def _by_pool(
        self, refs: Ref | Iterable[Ref], *, skip_dead: bool = False
    ) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for ref in [refs] if isinstance(refs, Ref) else refs:
            if ref.pool != self.epoch:
                if skip_dead and ref.pool in self._past_epochs:
                    continue  # its master and memory are gone already
                self._check_epoch(ref)
                raise CallerError(
                    f"ref {ref.oid} belongs to pool {ref.pool} on {ref.node}, not this node"
                )
            groups.setdefault(ref.pool, []).append(ref.oid)
        return groups

    def release(self, refs: Ref | Iterable[Ref]) -> None:
        """Free now (active release). Views of released objects must not be used any more.

        Refs of other nodes are released at their owner master, together with the local copy a
        remote get made here (other clients' copies go with their lease)."""
        local: list[Ref] = []
        remote: dict[str, list[Ref]] = {}
        for ref in [refs] if isinstance(refs, Ref) else refs:
            if ref.pool == self.epoch or ref.pool in self._past_epochs:
                local.append(ref)
            else:
                remote.setdefault(ref.node, []).append(ref)
                with self._book:
                    copy = self._local_copies.pop((ref.pool, ref.oid), None)
                if copy is not None:
                    local.append(Ref(copy[0], copy[1], ref.nbytes, self.node))
        for pool, oids in self._by_pool(local, skip_dead=True).items():
            self._with_recovery(
                lambda p=pool, o=oids: self._call(protocol.RELEASE, protocol.OidList(p, o)),
            )
        for node, node_refs in remote.items():
            owner = self._owner(node)
            for ref in node_refs:
                try:
                    resp = owner.call(
                        protocol.RELEASE,
                        protocol.OidList(ref.pool, [ref.oid]),
                        timeout=self.timeout,
                    )
                except RpcError as err:
                    raise MasterUnavailable(f"owner master {node}: {type(err).__name__}") from err
                if resp.err is not None:
                    raise from_info(resp.err)

    def _owner(self, node: str) -> SyncClient:
        with self._lock:
            rpc = self._owners.get(node)
            if rpc is None:
                rpc = self._owners[node] = SyncClient(node)
            return rpc

    def extend(self, refs: Ref | Iterable[Ref], ttl: float | None) -> None:
        """Renew the lease to ``ttl`` seconds from now; ``None`` drops it (the object becomes a
        cache entry, evictable)."""
        for pool, oids in self._by_pool(refs).items():
            self._call(protocol.EXTEND, protocol.Extend(pool, oids, ttl))

    def pin(self, refs: Ref | Iterable[Ref], pinned: bool = True) -> None:
        """Soft pin: evicted only when no unpinned object can make room."""
        for pool, oids in self._by_pool(refs).items():
            self._call(protocol.PIN, protocol.Pin(pool, oids, pinned))

    def wait_gone(self, ref: Ref, timeout: float) -> tuple[str, float] | None:
        """Block until the object is freed; (reason, since) or None at the timeout."""
        self._check_epoch(ref)
        resp = self._call(
            protocol.WAIT_GONE,
            protocol.WaitGone(ref.pool, ref.oid, timeout),
            timeout=timeout + self.timeout,
        )
        return (resp.reason, resp.since) if resp.gone else None

    def stats(self) -> protocol.Stats:
        return self._with_recovery(lambda: self._call(protocol.STATS, protocol.StatsReq()))

    def shutdown_master(self, reason: str = "requested by client") -> None:
        self._call(protocol.SHUTDOWN, protocol.Shutdown(reason))
        with self._book:
            # They go with the master's pool: close() has nothing to give back.
            self._reservations.drain()

    def _set_faults(self, spec: str) -> None:
        if spec == "kill!":
            # The master dies before answering; the lost connection is the expected outcome.
            with contextlib.suppress(MasterUnavailable):
                self._call(protocol.SET_FAULTS, protocol.SetFaults(spec), timeout=5.0)
            return
        self._call(protocol.SET_FAULTS, protocol.SetFaults(spec))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the calls puts started without waiting: seals of puts that allocated (they
        return before the master acknowledges the seal) and reservations for later puts. True if
        all are done; ``close()`` flushes first."""
        with self._book:
            pending = list(self._pending_calls)
        if not pending:
            return True
        _done, not_done = concurrent.futures.wait(pending, timeout=timeout or self.timeout)
        return not not_done

    def close(self) -> None:
        """Flush pending seals, give unused reservations back, close the connection."""
        with self._book:
            if self._closed:
                return
        self.flush()
        with self._book:
            if self._closed:
                return
            # A reserve call's future is done before its callback has stocked the blocks.
            self._reservation_landed.wait_for(
                lambda: not any(self._reservations.in_flight.values()), self.timeout
            )
            self._closed = True
            unused = self._reservations.drain()
        if unused and self._rpc is not None:
            with contextlib.suppress(RpcError):
                self._rpc.call(
                    protocol.RELEASE, protocol.OidList(self.epoch, unused), timeout=self.timeout
                )
        if self._rpc is not None:
            self._rpc.close()
        for owner in self._owners.values():
            owner.close()
        self._owners.clear()
        self._copier.close()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_master_process(
    name: str = discovery.DEFAULT_NAME,
    pool_size: str | int = "1G",
    *,
    extra_args: Iterable[str] = (),
    detach: bool = False,
    env: dict[str, str] | None = None,
    prefix: Iterable[str] = (),
) -> subprocess.Popen:
    """Start ``refstore serve`` as a child process; returns once it accepts connections.

    The caller owns the process (terminate() it, or ``Client.shutdown_master()``). With ``detach``
    the master is started through a shell that exits at once, so it belongs to no one but the node
    (the returned Popen is that shell, already reaped). Readiness is the ``ready`` line the master
    prints on stdout: a blocking read, no polling. ``prefix`` runs it under e.g. ``ip netns exec``.
    """
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "refstore.cli",
        "serve",
        "--name",
        name,
        "--size",
        str(pool_size),
        "--ready-line",
        *extra_args,
    ]
    if detach:
        cmd = ["/bin/sh", "-c", '"$@" </dev/null 2>/dev/null &', "sh", *cmd]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, start_new_session=True, env=env or os.environ.copy()
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if detach:
        proc.wait()
    if not line.startswith(b"ready "):
        code = proc.wait()
        raise MasterUnavailable(f"refstore master {name!r} failed to start (exit {code}): {line!r}")
    return proc


def connect(
    name: str = discovery.DEFAULT_NAME,
    *,
    autostart: bool = False,
    pool_size: str | int = "1G",
    **kwargs: Any,
) -> Client:
    """A client of the local master ``name``; with ``autostart`` start one if none is running.

    An auto-started master runs in its own session and outlives this process (it serves the whole
    node); stop it with ``refstore stop --name NAME`` or ``Client.shutdown_master()``.
    """
    if autostart:
        with discovery.spawn_lock(name):
            if not discovery.master_running(name):
                start_master_process(name, pool_size, detach=True)
                log.info("started refstore master %s", name)
    return Client(name, **kwargs)


def _failure(future: concurrent.futures.Future) -> Any:
    """What went wrong with a call the caller did not wait for (None: it succeeded)."""
    if future.cancelled():
        return "cancelled"
    if future.exception() is not None:
        return future.exception()
    return future.result().err
