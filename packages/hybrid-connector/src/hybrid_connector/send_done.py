"""SEND_DONE: P's worker tells P's scheduler half that a request's blocks may go back to vLLM.

The mission's "call me when you're done" instead of the scheduler asking every step. The
scheduler half (engine-core process) owns a ``SendDoneServer``: one simple_rpc Server on its
own ``LoopThread``, bound to an ephemeral port; its address travels to the workers in every
connector metadata (``scheduler_address``). A handler only records the report in
``holds.BlockHolds`` (under its lock); vLLM's block pool is touched later by the engine-core
thread. The worker side is ``SendDoneClient``: one connection, reports retried with back-off
until the scheduler half answers or the worker closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from simple_rpc import CallContext, Client, LoopThread, Server

from hybrid_connector.migration import MigrateOutService, MigrationsOut
from hybrid_connector.protocol import SEND_DONE, SendDoneRequest, SendDoneResponse

log = logging.getLogger(__name__)

# A SEND_DONE that cannot reach the scheduler half (it restarts its loop, the connection broke)
# is retried this often, with doubling waits from RETRY_FIRST_S: the blocks stay held until it
# gets through, so it must not be dropped quietly.
RETRIES = 6
RETRY_FIRST_S = 0.05


class SendDoneSink(Protocol):
    """Where SEND_DONE reports go: ``holds.BlockHolds`` (tests: a recorder). True if counted."""

    def send_done(self, request_id: str, tp_rank: int, outcome: str = "") -> bool: ...


class SendDoneServer:
    """Scheduler half: takes SEND_DONE reports into ``holds``; owns its thread and socket."""

    def __init__(
        self,
        holds: SendDoneSink,
        *,
        host: str,
        advertise_host: str | None,
        migrations: MigrationsOut | None = None,
    ) -> None:
        self._holds = holds
        self._server = Server(name="hybrid-connector-scheduler")
        self._server.register(SEND_DONE, self._on_send_done)
        if migrations is not None:  # MIGRATE_OUT, forwarded by the workers (migration.py)
            MigrateOutService(migrations).register(self._server)
        self._loop = LoopThread(name="hybrid-connector-send-done")
        try:
            bound = self._loop.run(self._server.start(host, 0), timeout=30)
        except BaseException:
            self._loop.close()
            raise
        port = bound.rpartition(":")[2]
        advertised = advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        self.address = f"{advertised}:{port}"
        log.info("hybrid-connector: scheduler half takes SEND_DONE at %s", self.address)

    async def _on_send_done(self, req: SendDoneRequest, ctx: CallContext) -> SendDoneResponse:
        held = self._holds.send_done(req.request_id, req.tp_rank, req.outcome)
        log.debug(
            "request %s: SEND_DONE (%s) from worker rank %d at %s for transfer %s%s",
            req.request_id,
            req.outcome,
            req.tp_rank,
            ctx.peer,
            req.transfer_id,
            "" if held else " (not held here)",
        )
        return SendDoneResponse(req.request_id, held)

    def close(self) -> None:
        """Idempotent; stops the server and joins its thread."""
        try:
            if not self._loop.closed:
                self._loop.run(self._server.close(), timeout=10)
        except Exception:  # closing anyway
            log.debug("hybrid-connector: SEND_DONE server close failed", exc_info=True)
        finally:
            self._loop.close()


class SendDoneClient:
    """Worker: sends SEND_DONE to the scheduler half at ``address``; runs on the worker's loop."""

    def __init__(
        self, address: str, tp_rank: int, on_delivered: Callable[[], None] = lambda: None
    ) -> None:
        self.address = address
        self._tp_rank = tp_rank
        self._on_delivered = on_delivered  # after the scheduler half answered a report
        self._client = Client(address)
        self._tasks: set[asyncio.Task[None]] = set()

    def report(self, request_id: str, transfer_id: str, outcome: str) -> None:
        """Loop thread: send the report in the background (retried; never raises)."""
        task = asyncio.get_running_loop().create_task(
            self._send(SendDoneRequest(request_id, transfer_id, self._tp_rank, outcome))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, request: SendDoneRequest) -> None:
        wait_s = RETRY_FIRST_S
        for attempt in range(RETRIES + 1):
            try:
                await self._client.call(SEND_DONE, request, timeout=5.0)
                self._on_delivered()
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if attempt == RETRIES:
                    log.error(
                        "request %s: SEND_DONE for transfer %s could not reach the scheduler "
                        "at %s (%s); its blocks stay held until P restarts",
                        request.request_id,
                        request.transfer_id,
                        self.address,
                        err,
                    )
                    return
                await asyncio.sleep(wait_s)
                wait_s *= 2

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.close()
