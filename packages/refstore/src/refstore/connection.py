"""The client's link to its node's master: connecting, typed calls, and master-epoch recovery.

A ``MasterLink`` holds the current ``Attachment``: the connection, the mapped pool and what
belongs to that master instance (its epoch, the header tag key, the reservation stock). An
attachment is immutable and replaced whole by a reconnect, so a put or get reads one consistent
set with one attribute load and no lock, even while another thread reconnects.

Recovery: when a call finds the master gone, ``recovered()`` re-reads the discovery file and, if
a new master (new epoch) runs, attaches to it; refs of the old epoch then raise
``MasterRestarted`` (with the time the old master was noticed gone). One thread reconnects at a
time; others that need it meanwhile wait for its outcome, holding no lock (``reconnect``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from typing import Any, NamedTuple

from simple_rpc import RpcError, SyncClient

from . import discovery, header, protocol
from .errors import CallerError, MasterRestarted, MasterUnavailable, from_info
from .pool import SharedPool
from .ref import Ref
from .reservations import RESERVE_BUDGET_MAX, Reservations

log = logging.getLogger("refstore.client")


class Attachment(NamedTuple):
    """One master instance as a client sees it; replaced whole when the client re-attaches."""

    rpc: SyncClient
    pool: SharedPool
    epoch: str
    node: str
    address: str
    tag_key: int  # the epoch's header tag key (``header.epoch_key``)
    headers: header.Reader
    reservations: Reservations  # blocks reserved in this master's pool


class MasterLink:
    """Finds the master ``name`` (or talks to ``address``), attaches to it, and re-attaches to
    the next one after a restart. Thread-safe; ``close()`` closes every connection it opened."""

    def __init__(
        self,
        name: str,
        *,
        address: str | None,
        timeout: float,
        reserve_budget: int | None,
    ) -> None:
        self.name = name
        self.timeout = timeout
        self.closed = False
        self._fixed_address = address
        self._reserve_budget = reserve_budget
        self._lock = threading.Lock()  # the fields below; never held across a blocking call
        self._reconnecting: concurrent.futures.Future[bool] | None = None
        self.past_epochs: dict[str, float] = {}  # epoch -> when its master was noticed gone
        self._owners: dict[str, SyncClient] = {}  # other nodes' masters, for remote release
        self.current: Attachment = self._attach(None)

    # -- attaching ----------------------------------------------------------------------------
    def _attach(self, previous: Attachment | None) -> Attachment:
        """Connect to the master named in the discovery file and map its pool (blocking)."""
        address = self._fixed_address
        info = discovery.read_info(self.name)
        if info is not None:
            with self._lock:
                self.past_epochs.update(dict(info.past_epochs))
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
        if previous is not None and previous.epoch != hello.epoch:
            with self._lock:
                self.past_epochs.setdefault(previous.epoch, time.time())
            log.warning(
                "refstore master %s restarted: epoch %s -> %s",
                self.name,
                previous.epoch,
                hello.epoch,
            )
        budget = min(RESERVE_BUDGET_MAX, hello.pool_size // 32)
        key = header.epoch_key(hello.epoch)
        return Attachment(
            rpc=rpc,
            pool=pool,
            epoch=hello.epoch,
            node=hello.node,
            address=address,
            tag_key=key,
            headers=header.Reader(key),
            # The old master's reservations went with its pool: a new stock.
            reservations=Reservations(
                budget if self._reserve_budget is None else self._reserve_budget
            ),
        )

    def reconnect(self) -> bool:
        """Re-attach after losing the master. True if a different master (new epoch) took over.

        One thread attaches; threads that ask meanwhile wait for its outcome (a blocking wait
        that holds no lock) instead of attaching again."""
        with self._lock:
            attempt = self._reconnecting
            leader = attempt is None
            if leader:
                attempt = self._reconnecting = concurrent.futures.Future()
        assert attempt is not None
        if not leader:
            return attempt.result()
        try:
            previous = self.current
            attached = self._attach(previous)
            self.current = attached  # one store: readers see the old or the new, whole
            previous.rpc.close()
            previous.pool.close()  # stays mapped while old views are alive
            changed = attached.epoch != previous.epoch
        except BaseException as err:
            attempt.set_exception(err)
            raise
        finally:
            with self._lock:
                self._reconnecting = None
        attempt.set_result(changed)
        return changed

    def recovered(self) -> bool:
        """After MasterUnavailable: True if a new master took over and the link re-attached to
        it (the failed call may run again), False if the error stands."""
        return self._fixed_address is None and self.reconnect()

    def with_recovery(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)``; if the master is gone and a new one runs, re-attach and run it
        again (a put then lands in the new pool; a get of an old ref raises MasterRestarted)."""
        try:
            return fn(*args)
        except MasterUnavailable:
            if not self.recovered():
                raise
        return fn(*args)

    def check_epoch(self, ref: Ref) -> None:
        """Raise MasterRestarted for refs of a local master that no longer runs."""
        since = self.past_epochs.get(ref.pool)
        if since is not None:
            raise MasterRestarted(
                f"object {ref.oid} of pool {ref.pool} (now {self.current.epoch})", since
            )

    # -- calls --------------------------------------------------------------------------------
    def call(
        self,
        method: Any,
        request: Any,
        *,
        timeout: float | None = None,
        on: Attachment | None = None,
    ) -> Any:
        """A call to the local master (the one of attachment ``on``, default the current one);
        its typed error raised, a transport failure as MasterUnavailable."""
        if self.closed:
            raise CallerError("refstore client is closed")
        current = self.current if on is None else on
        try:
            resp = current.rpc.call(method, request, timeout=timeout or self.timeout)
        except RpcError as err:
            raise MasterUnavailable(
                f"refstore master at {current.address}: {type(err).__name__}: {err}"
            ) from err
        err_info = getattr(resp, "err", None)
        if err_info is not None:
            raise from_info(err_info)
        return resp

    def call_owner(self, node: str, method: Any, request: Any) -> Any:
        """A call to another node's master (the owner of a remote ref)."""
        try:
            resp = self._owner(node).call(method, request, timeout=self.timeout)
        except RpcError as err:
            raise MasterUnavailable(f"owner master {node}: {type(err).__name__}") from err
        if resp.err is not None:
            raise from_info(resp.err)
        return resp

    def _owner(self, node: str) -> SyncClient:
        with self._lock:
            rpc = self._owners.get(node)
        if rpc is not None:
            return rpc
        made = SyncClient(node)  # starts a loop thread: not under the lock
        with self._lock:
            rpc = self._owners.setdefault(node, made)
        if rpc is not made:  # another thread made one first
            made.close()
        return rpc

    def close(self) -> None:
        """Close the connections (the pool of the current attachment stays mapped while views
        of it live)."""
        self.closed = True
        current = self.current
        current.rpc.close()
        with self._lock:
            owners, self._owners = list(self._owners.values()), {}
        for owner in owners:
            owner.close()
        current.pool.close()
