"""The client: put / get / release / extend / pin / stats against the node-local master.

Three concerns, three modules:

- ``connection.py``: the link to the master (``MasterLink``): attaching to it and mapping its
  pool, typed calls, and recovery after the master restarts (a new epoch).
- ``putget.py``: put and get with their fast paths, the copies, and the reservation stock
  (``reservations.py``) that lets a put skip the master; ``PutGet`` is ``Client``'s base class.
- ``launch.py``: starting a master process (``start_master_process``; ``connect(autostart=True)``).

This module is the rest of the API (release, extend, pin, wait_gone, stats, peers, close, the
key lookups ``lookup`` / ``unhold`` / ``subscribe_keys``) and ``connect``; ``put_keyed`` is in
``putget.py``, the subscription in ``subscription.py``.

A ref owned by another node's master is fetched into the local pool by the local master
(``remote.py``) first.

Threads: the client owns a ``SyncClient`` (its loop thread), one reader thread per open key
subscription, lazily one ``SyncClient`` per other node whose refs it releases (a large put's copy
runs on the calling thread, in C, without the GIL); ``close()`` stops them all and unmaps the pool
once no view is left. The client is thread-safe, and holds no lock across a blocking call.

Master restarts: when the connection to the master is lost the client re-reads the discovery file;
if a new master (new epoch) is running it re-attaches to the new pool, gives refs of the old epoch a
``MasterRestarted`` error (with the time the old master was noticed gone) and retries puts once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from simple_rpc import RpcError

from . import discovery, protocol
from .connection import MasterLink
from .errors import CallerError, MasterUnavailable
from .launch import start_master_process
from .putget import DEFAULT_TTL_S, PutGet
from .ref import Ref
from .state import check_hold, check_key
from .subscription import KeySubscription

__all__ = ["DEFAULT_TTL_S", "Client", "connect", "start_master_process"]

log = logging.getLogger("refstore.client")

DEFAULT_TIMEOUT_S = 30.0


class Client(PutGet):
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
        link = MasterLink(name, address=address, timeout=timeout, reserve_budget=reserve_budget)
        try:
            super().__init__(link, default_ttl)
        except BaseException:
            link.close()
            raise
        self._closing = False
        self._subscriptions: set[KeySubscription] = set()

    # The master instance attached now (a reconnect may change them).
    @property
    def epoch(self) -> str:
        return self._link.current.epoch

    @property
    def node(self) -> str:
        return self._link.current.node

    @property
    def address(self) -> str:
        return self._link.current.address

    @property
    def timeout(self) -> float:
        """Seconds a call to the master may take."""
        return self._link.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._link.timeout = seconds

    def reconnect(self) -> bool:
        """Re-attach after losing the master. True if a different master (new epoch) took over."""
        return self._link.reconnect()

    # -- lifetime -----------------------------------------------------------------------------
    def _by_pool(
        self, refs: Ref | Iterable[Ref], *, skip_dead: bool = False
    ) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        epoch = self.epoch
        for ref in [refs] if isinstance(refs, Ref) else refs:
            if ref.pool != epoch:
                if skip_dead and ref.pool in self._link.past_epochs:
                    continue  # its master and memory are gone already
                self._link.check_epoch(ref)
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
        link = self._link
        for ref in [refs] if isinstance(refs, Ref) else refs:
            if ref.pool == link.current.epoch or ref.pool in link.past_epochs:
                local.append(ref)
            else:
                remote.setdefault(ref.node, []).append(ref)
                with self._book:
                    copy = self._local_copies.pop((ref.pool, ref.oid), None)
                if copy is not None:
                    local.append(Ref(copy[0], copy[1], ref.nbytes, self.node))
        for pool, oids in self._by_pool(local, skip_dead=True).items():
            link.with_recovery(link.call, protocol.RELEASE, protocol.OidList(pool, oids))
        for node, node_refs in remote.items():
            for ref in node_refs:
                link.call_owner(node, protocol.RELEASE, protocol.OidList(ref.pool, [ref.oid]))

    def extend(self, refs: Ref | Iterable[Ref], ttl: float | None) -> None:
        """Renew the lease to ``ttl`` seconds from now; ``None`` drops it (the object becomes a
        cache entry, evictable)."""
        protocol.check_ttl(ttl, "ttl")
        for pool, oids in self._by_pool(refs).items():
            self._link.call(protocol.EXTEND, protocol.Extend(pool, oids, ttl))

    def pin(self, refs: Ref | Iterable[Ref], pinned: bool = True) -> None:
        """Soft pin: evicted only when no unpinned object can make room."""
        for pool, oids in self._by_pool(refs).items():
            self._link.call(protocol.PIN, protocol.Pin(pool, oids, pinned))

    def wait_gone(self, ref: Ref, timeout: float) -> tuple[str, float] | None:
        """Block until the object is freed; (reason, since) or None at the timeout."""
        protocol.check_timeout(timeout, "timeout")
        self._link.check_epoch(ref)
        resp = self._link.call(
            protocol.WAIT_GONE,
            protocol.WaitGone(ref.pool, ref.oid, timeout),
            timeout=timeout + self.timeout,
        )
        return (resp.reason, resp.since) if resp.gone else None

    # -- keyed objects ------------------------------------------------------------------------
    def lookup(self, keys: Iterable[bytes], hold_s: float = 5.0) -> list[Ref]:
        """Refs of the leading ``keys`` that are bound (the walk stops at the first that is
        not), in one call. Each found object counts as used (LRU) and, with ``hold_s`` > 0, is
        kept from eviction until ``hold_s`` from now (a hold, not a lease: when it lapses an
        unleased object is a cache entry again, not freed); ``unhold`` ends it sooner."""
        keys = list(keys)
        check_hold(hold_s)
        for key in keys:
            check_key(key)
        link = self._link

        def call() -> list[Ref]:
            attached = link.current
            resp = link.call(protocol.LOOKUP, protocol.Lookup(keys, hold_s), on=attached)
            return [Ref(resp.epoch, s.oid, s.nbytes, attached.node, s.at) for s in resp.found]

        return link.with_recovery(call)

    def unhold(self, refs: Ref | Iterable[Ref]) -> None:
        """End this client's holds (from ``lookup``) on these objects."""
        for pool, oids in self._by_pool(refs, skip_dead=True).items():
            self._link.call(protocol.UNHOLD, protocol.OidList(pool, oids))

    def subscribe_keys(self, timeout: float | None = None) -> KeySubscription:
        """Key events of the master (``KeysStored``, ``KeysRemoved``, ``KeysLost``), on a
        connection of their own; ``take()`` them; ``close()`` also comes with this client's.
        ``timeout``: for its connect and subscribe (default: the client's)."""
        if self._closing:
            raise CallerError("refstore client is closed")
        sub = KeySubscription(
            self.address,
            timeout=self.timeout if timeout is None else timeout,
            on_close=self._subscriptions.discard,
        )
        with self._book:
            self._subscriptions.add(sub)
        return sub

    def peers(
        self, add: Iterable[str] = (), remove: Iterable[str] = ()
    ) -> list[protocol.PeerStatus]:
        """The master's peer masters (other nodes' ``host:port``, asked for keys a lookup
        misses here), after adding and removing the ones given."""
        request = protocol.UpdatePeers(list(add), list(remove))
        return self._link.with_recovery(self._link.call, protocol.PEERS, request).peers

    def stats(self) -> protocol.Stats:
        return self._link.with_recovery(self._link.call, protocol.STATS, protocol.StatsReq())

    def shutdown_master(self, reason: str = "requested by client") -> None:
        self._link.call(protocol.SHUTDOWN, protocol.Shutdown(reason))
        with self._book:
            # They go with the master's pool: close() has nothing to give back.
            self._link.current.reservations.drain()

    def _set_faults(self, spec: str) -> None:
        if spec == "kill!":
            # The master dies before answering; the lost connection is the expected outcome.
            with contextlib.suppress(MasterUnavailable):
                self._link.call(protocol.SET_FAULTS, protocol.SetFaults(spec), timeout=5.0)
            return
        self._link.call(protocol.SET_FAULTS, protocol.SetFaults(spec))

    def close(self) -> None:
        """Flush pending seals, give unused reservations back, close the connections."""
        with self._book:
            if self._closing:
                return
            self._closing = True
            subscriptions = list(self._subscriptions)
        for sub in subscriptions:
            sub.close()
        unused = self._stop_putting()
        current = self._link.current
        if unused:
            with contextlib.suppress(RpcError):
                current.rpc.call(
                    protocol.RELEASE, protocol.OidList(current.epoch, unused), timeout=self.timeout
                )
        self._link.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    name: str = discovery.DEFAULT_NAME,
    *,
    autostart: bool = False,
    pool_size: str | int = "1G",
    disk: str | None = None,
    disk_size: str | int | None = None,
    **kwargs: Any,
) -> Client:
    """A client of the local master ``name``; with ``autostart`` start one if none is running
    (``pool_size``; ``disk``/``disk_size``: its disk tier, default env ``REFSTORE_DISK``).

    An auto-started master runs in its own session and outlives this process (it serves the whole
    node); stop it with ``refstore stop --name NAME`` or ``Client.shutdown_master()``.
    """
    if autostart:
        with discovery.spawn_lock(name):
            if not discovery.master_running(name):
                start_master_process(name, pool_size, detach=True, disk=disk, disk_size=disk_size)
                log.info("started refstore master %s", name)
    return Client(name, **kwargs)
