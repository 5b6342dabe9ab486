"""The data path of a client: put and get, the reservation stock they use, and the copies.

Fast paths (no round trip to the master, see ``header.py``):

- **get** of a local ref checks the object's header in shared memory (magic, state, oid, tag,
  lease deadline) and builds zero-copy views from the layout stored there: a few µs whatever the
  size. Anything the header cannot vouch for (freed, expired, evicted, not sealed yet, another
  epoch) goes to the master, which answers with the typed reason or waits for the seal.
- **put** of a size this client has put before takes a block it **reserved** ahead of time
  (``reservations.py``), copies the payload and writes the header, and sends nothing: the header
  is the commit record, which the master reads when the object first matters to it
  (``state.py``). One ``reserve`` call in the background refills a class's stock every few puts.
  Other sizes take an ``alloc`` round trip first and a ``seal`` sent without waiting for the
  answer: a get from elsewhere that overtakes the seal waits for it at the master.

While the master has a fault plan (``faults.py``) the pool's control page tells clients to send
every operation to the master, so that injected faults apply to all of them.

``PutGet`` is the base class of ``Client`` rather than an object it holds, so that a put or a get
runs in no more frames and attribute loads than it needs: these paths were measured and tuned
(one native call per put, one clock read, one read of the connection). They read the master's
connection, pool and stock from one ``Attachment`` (``connection.py``), which a reconnect replaces
whole. ``monotonic_ns`` is this module's clock (tests replace it with a fake one).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from time import monotonic_ns
from typing import Any

import numpy as np
from simple_rpc import SyncClient

from . import _fastpath, codec, header, protocol, state
from .connection import Attachment, MasterLink
from .errors import CallerError, MasterRestarted, MasterUnavailable, UnknownObject
from .header import OBJECT_PINNED
from .protocol import CONTAINER_SINGLE, KIND_TORCH, MAX_TTL_S, check_ttl
from .ref import Ref
from .reservations import Reservations

log = logging.getLogger("refstore.client")

DEFAULT_TTL_S = float(os.environ.get("REFSTORE_TTL", "300"))
MAX_REMEMBERED_COPIES = 100_000


class PutGet:
    """put and get of a ``Client`` (its base class); thread-safe."""

    def __init__(self, link: MasterLink, default_ttl: float | None) -> None:
        check_ttl(default_ttl, "default_ttl")
        self._link = link
        self.default_ttl = default_ttl
        # Bookkeeping (stock, counters, pending calls, copies): never held across a blocking
        # call, because the RPC loop thread takes it in its callbacks.
        self._book = threading.Lock()
        self._reservation_landed = threading.Condition(self._book)
        self._layouts: dict[Any, Any] = {}  # (type, dtype, shape) -> layout (codec.encode_cached)
        self._pending_calls: set[concurrent.futures.Future] = set()  # seals, reservations
        # remote (pool, oid) -> (local pool, oid) of the copy a remote get made here
        self._local_copies: OrderedDict[tuple[str, int], tuple[str, int]] = OrderedDict()
        self.counters = dict.fromkeys(("puts", "gets", "fast_puts", "fast_gets"), 0)

    # -- put ----------------------------------------------------------------------------------
    def put(self, obj: Any, *, ttl: float | str | None = "default", pin: bool = False) -> Ref:
        """Store ``obj`` (array, tensor, bytes, or a list/tuple/dict of them) and return its ref.

        ``ttl``: lease seconds (default ``default_ttl``); ``None`` for no lease (a cache entry,
        evictable under memory pressure). ``pin``: soft pin (evicted only when nothing else can be).
        """
        ttl_s = self.default_ttl if ttl == "default" else ttl
        try:
            bad_ttl = ttl_s is not None and not 0.0 < ttl_s <= MAX_TTL_S  # NaN fails it too
        except TypeError:
            bad_ttl = True
        if bad_ttl:
            check_ttl(ttl_s, "ttl")  # raises, saying why
        encoded, sources = codec.encode_cached(obj, self._layouts)
        # ``MasterLink.with_recovery(self._put, ...)`` without its frame: every step of a put
        # costs.
        try:
            return self._put(encoded, sources, ttl_s, pin)
        except MasterUnavailable:
            if not self._link.recovered():
                raise
        return self._put(encoded, sources, ttl_s, pin)

    def _put(self, encoded: codec.Encoded, sources: list[Any], ttl_s: Any, pin: bool) -> Ref:
        nbytes, block = encoded.nbytes, encoded.block
        reserved = None
        ask = 0
        now_ns = monotonic_ns()
        # One consistent connection, pool and stock, even if another thread reconnects.
        attached = self._link.current
        rpc, pool, epoch, node, _, key, _, reservations = attached
        with self._book:
            connection = rpc.connection  # 0 while down: the master may be gone, so ask it
            if connection:
                reserved, ask = reservations.next(block, now_ns, connection)
            self.counters["puts"] += 1
            self.counters["fast_puts"] += reserved is not None
        if ask:
            # Before the copy, so the blocks are on their way while it runs.
            try:
                request = protocol.Reserve(block, ask)
                pending = rpc.call_future(protocol.RESERVE, request, self._link.timeout)
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
                    request = protocol.Alloc(
                        nbytes, encoded.layout, ttl_s, pin, encoded.header.hlen
                    )
                    # To the master of the pool it will write into.
                    resp = self._link.call(protocol.ALLOC, request, on=attached)
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
                self._put_failed(attached, oid, fast=reserved is not None)
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
            sealing = rpc.call_future(protocol.SEAL, protocol.Seal(oid), self._link.timeout)
            self._track(sealing)
            sealing.add_done_callback(self._sealed)
        # A put into a reserved block sends nothing: its header is the commit record, which
        # the master reads when the object first matters to it (``state.py``, settle).
        return Ref(epoch, oid, nbytes, node, at)

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
            codec.copy_into(view, at + writer.hlen + item.offset, source, item)
        _fastpath.seal(view, at, writer.template, oid, key, encoded.nbytes, deadline_ns, flags)
        return True

    def _put_failed(self, attached: Attachment, oid: int, *, fast: bool) -> None:
        """Undo the counting of a put that raised, and free its block."""
        with self._book:
            self.counters["puts"] -= 1  # counted above, not made
            self.counters["fast_puts"] -= fast
        with contextlib.suppress(Exception):
            self._link.call(protocol.RELEASE, protocol.OidList(attached.epoch, [oid]), on=attached)

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
            log.warning("refstore seal failed on %s: %s", self._link.current.address, err)

    def _reserved(
        self,
        asked_for: tuple[int, int, Reservations, str, SyncClient],
        future: concurrent.futures.Future,
    ) -> None:
        """On the RPC loop thread (no blocking calls): stock the blocks reserved for later puts.
        ``asked_for``: (block, count, the stock, pool epoch, connection) at the time of asking."""
        block, asked, reservations, epoch, rpc = asked_for
        err = _failure(future)
        blocks = future.result().blocks if err is None else []
        if err is not None:
            log.warning("refstore reserve failed on %s: %s", rpc.address, err)
        link = self._link
        with self._book:
            current = link.current.epoch == epoch and not link.closed
            # Into the stock they were asked for: a reconnect in between replaced (and drained) it.
            # The answer came on the connection open now: this callback runs on the loop
            # thread as the answer is delivered, before any reconnect.
            connection = rpc.connections_opened
            stocked = blocks if current else []
            reservations.arrived(block, asked, stocked, monotonic_ns(), connection)
            self._reservation_landed.notify_all()
        if blocks and not current:
            # Reserved in a pool this client has left or closed: give them back.
            oids = [oid for oid, _ in blocks]
            with contextlib.suppress(Exception):
                rpc.call_future(protocol.RELEASE, protocol.OidList(epoch, oids), link.timeout)

    # -- keyed put ----------------------------------------------------------------------------
    def put_keyed(
        self, items: Any, ttl: float | None = None, pin: bool = False
    ) -> list[Ref | None]:
        """Store ``(key, obj)`` pairs under their keys (1..64 bytes each; ``obj`` anything
        ``put`` takes) and return, per pair in order, the ref of the object bound to its key:
        this put's, or the one stored under that key first (first writer wins: this put's
        object is then freed, or, when the key was bound already, never copied). ``None`` for
        the pairs that did not fit: a full pool stores what fits, in order, and never raises.

        One ``put_keyed`` call allocates the whole batch, the payloads are copied, and one
        ``seal_keyed`` call binds the keys (both wait for their answers: the bound refs).
        ``ttl=None``: cache entries (no lease, evictable in LRU order); ``pin``: soft pin."""
        pairs = list(items)
        if ttl is not None:
            check_ttl(ttl, "ttl")
        for pair in pairs:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise CallerError(f"put_keyed takes (key, obj) pairs, got {type(pair).__name__}")
            state.check_key(pair[0])
        encoded = [codec.encode_cached(obj, self._layouts) for _, obj in pairs]
        if not pairs:
            return []
        return self._link.with_recovery(self._put_keyed, pairs, encoded, ttl, pin)

    def _put_keyed(
        self, pairs: list[Any], encoded: list[Any], ttl_s: float | None, pin: bool
    ) -> list[Ref | None]:
        attached = self._link.current
        link = self._link
        request = protocol.PutKeyed(
            [
                protocol.KeyedItem(key, enc.nbytes, enc.layout, enc.header.hlen)
                for (key, _), (enc, _) in zip(pairs, encoded, strict=True)
            ],
            ttl_s,
            pin,
        )
        slots = link.call(protocol.PUT_KEYED, request, on=attached).slots
        deadline_ns = 0 if ttl_s is None else monotonic_ns() + int(ttl_s * 1e9)
        flags = OBJECT_PINNED * pin
        refs: list[Ref | None] = [None] * len(pairs)
        to_seal: list[int] = []  # indexes of the slots written here
        try:
            for i, slot in enumerate(slots):
                if slot.bound:
                    refs[i] = Ref(attached.epoch, slot.oid, slot.nbytes, attached.node, slot.at)
                    continue
                enc, sources = encoded[i]
                to_seal.append(i)
                self._write(
                    enc,
                    sources,
                    view=attached.pool.view,
                    at=slot.at,
                    oid=slot.oid,
                    key=attached.tag_key,
                    deadline_ns=deadline_ns,
                    flags=flags,
                    reserved=False,
                )
        except BaseException:
            oids = [slots[i].oid for i in to_seal]
            with contextlib.suppress(Exception):
                link.call(protocol.RELEASE, protocol.OidList(attached.epoch, oids), on=attached)
            raise
        if to_seal:
            sealing = protocol.SealKeyed([slots[i].oid for i in to_seal])
            bound = link.call(protocol.SEAL_KEYED, sealing, on=attached).bound
            for i, slot in zip(to_seal, bound, strict=True):
                if slot is not None:
                    refs[i] = Ref(attached.epoch, slot.oid, slot.nbytes, attached.node, slot.at)
        with self._book:
            self.counters["puts"] += len(to_seal)
        return refs

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

        rpc, pool, epoch, _, _, _, headers, _ = self._link.current
        # Not connected: the master may be gone (its pool stays mapped here, readable but no
        # longer kept); the master path finds out and says so.
        if ref.pool == epoch and ref.at >= 0 and rpc.connection:
            view = pool.view
            found = headers.sealed(view, ref.at, ref.oid, monotonic_ns())
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

        link = self._link

        def resolve() -> tuple[int, protocol.Layout]:
            if ref.pool == link.current.epoch:
                resp = link.call(protocol.GET, protocol.Get(ref.pool, ref.oid))
                return resp.offset, resp.layout
            link.check_epoch(ref)
            fetch_ttl = ttl if ttl is not None else (self.default_ttl or DEFAULT_TTL_S)
            check_ttl(fetch_ttl, "ttl")
            resp = link.call(
                protocol.FETCH,
                protocol.Fetch(ref.pool, ref.oid, ref.nbytes, ref.node, fetch_ttl),
                timeout=max(link.timeout, 120.0),
            )
            with self._book:
                self._local_copies[(ref.pool, ref.oid)] = (resp.epoch, resp.oid)
                while len(self._local_copies) > MAX_REMEMBERED_COPIES:
                    self._local_copies.popitem(last=False)
            return resp.offset, resp.layout

        offset, layout = link.with_recovery(resolve)
        with self._book:
            self.counters["gets"] += 1
        pool = link.current.pool
        return codec.decode(pool.view, offset, layout, as_, writable, pool=pool)

    def payloads(self, refs: Sequence[Ref], *, ask_master: bool = True) -> Payloads:
        """Where the bytes of many one-array objects lie in this node's pool, without a view of
        each: for copying them all at once (``Payloads.copy_out``). Each object must be one
        array, tensor or byte string (``put`` of one), and stay alive (held, leased) while its
        bytes are read. Headers are checked as ``get`` checks them; a ref the header cannot
        vouch for goes through ``get`` (the master decides, and raises its typed error), or,
        with ``ask_master=False`` (a caller that must not wait on a call), raises
        ``UnknownObject`` at once."""
        rpc, pool, epoch, _, _, _, headers, _ = self._link.current
        view = pool.keeper()
        if view is None:
            raise CallerError("refstore client is closed")
        base = np.frombuffer(view, np.uint8).ctypes.data
        count = len(refs)
        offsets = np.empty(count, np.uint64)
        nbytes = np.empty(count, np.uint64)
        now = monotonic_ns()
        fast = 0
        for i, ref in enumerate(refs):
            found = None
            if ref.pool == epoch and ref.at >= 0 and rpc.connection:
                found = headers.sealed(view, ref.at, ref.oid, now)
            if found is not None and found[1].container == CONTAINER_SINGLE:
                payload, layout, _ = found
                item = layout.items[0]
                offsets[i], nbytes[i] = payload + item.offset, item.nbytes
                fast += 1
                continue
            if not ask_master:
                raise UnknownObject(f"object {ref.oid}: no sealed header in this pool")
            one = self.get(ref, as_="numpy")
            if isinstance(one, (list, tuple, dict)):
                raise CallerError(f"object {ref.oid} holds {len(one)} arrays, not one")
            array = np.frombuffer(one, np.uint8) if isinstance(one, memoryview) else one
            at = array.ctypes.data - base
            if not 0 <= at <= len(view) - array.nbytes:  # the master restarted meanwhile
                raise MasterRestarted(f"object {ref.oid} is in another pool now", 0.0)
            offsets[i], nbytes[i] = at, array.nbytes
        with self._book:
            self.counters["gets"] += fast
            self.counters["fast_gets"] += fast
        return Payloads(view, offsets, nbytes)

    # -- calls puts started and did not wait for ------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the calls puts started without waiting: seals of puts that allocated (they
        return before the master acknowledges the seal) and reservations for later puts. True if
        all are done; ``close()`` flushes first."""
        with self._book:
            pending = list(self._pending_calls)
        if not pending:
            return True
        _done, not_done = concurrent.futures.wait(pending, timeout=timeout or self._link.timeout)
        return not not_done

    def _stop_putting(self) -> list[int]:
        """For ``close()``: wait for pending calls and reservations on their way, then forget the
        stock; returns the oids of the unused reserved blocks (to give back)."""
        self.flush()
        reservations = self._link.current.reservations
        with self._book:
            # A reserve call's future is done before its callback has stocked the blocks.
            self._reservation_landed.wait_for(
                lambda: not any(reservations.in_flight.values()), self._link.timeout
            )
            return reservations.drain()


def _failure(future: concurrent.futures.Future) -> Any:
    """What went wrong with a call the caller did not wait for (None: it succeeded)."""
    if future.cancelled():
        return "cancelled"
    if future.exception() is not None:
        return future.exception()
    return future.result().err


class Payloads:
    """The bytes of objects in a pool (``PutGet.payloads``): object ``i``'s array is
    ``nbytes[i]`` bytes at ``offsets[i]`` of ``view`` (the pool; held here, so it stays mapped
    while this lives)."""

    __slots__ = ("nbytes", "offsets", "view")

    def __init__(self, view: memoryview, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        self.view = view
        self.offsets = offsets
        self.nbytes = nbytes

    def array(self, i: int) -> np.ndarray:
        """Object ``i``'s bytes, a read-only uint8 view."""
        array = np.frombuffer(self.view, np.uint8, int(self.nbytes[i]), int(self.offsets[i]))
        array.flags.writeable = False
        return array

    def copy_out(self, offsets: np.ndarray, addresses: np.ndarray, lengths: np.ndarray) -> None:
        """For every ``i``, copy ``lengths[i]`` bytes at pool offset ``offsets[i]`` (an object's
        offset plus where in it) to ``addresses[i]``, memory of this process the caller keeps
        valid (uint64 arrays of one length). One native loop, every range in the pool checked
        first; large copies run without the GIL."""
        _fastpath.copy_out_segments(
            self.view,
            np.ascontiguousarray(offsets, np.uint64),
            np.ascontiguousarray(addresses, np.uint64),
            np.ascontiguousarray(lengths, np.uint64),
        )


def gather(buffer: Any, offsets: np.ndarray, addresses: np.ndarray, lengths: np.ndarray) -> None:
    """For every ``i``, copy ``lengths[i]`` bytes from ``addresses[i]`` (memory of this process
    the caller keeps valid) into ``buffer`` (writable, e.g. a numpy array) at ``offsets[i]``
    (uint64 arrays of one length): the way in of ``Payloads.copy_out``, for bytes scattered
    over other buffers that are to be put. One native loop, every range in ``buffer`` checked
    first; large copies run without the GIL."""
    _fastpath.copy_in_segments(
        buffer,
        np.ascontiguousarray(offsets, np.uint64),
        np.ascontiguousarray(addresses, np.uint64),
        np.ascontiguousarray(lengths, np.uint64),
    )


def checksum(buffer: Any) -> int:
    """XXH64 of a C-contiguous buffer: the checksum the store's disk tier writes, for callers
    that check their own payloads (several GB/s; without the GIL from 64 KiB)."""
    return _fastpath.xxh64(buffer)
