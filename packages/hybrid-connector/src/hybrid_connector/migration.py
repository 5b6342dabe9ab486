"""Live migration of a decoding request, the connector's half: stop it, hold its KV, answer.

A request decoding on D1 moves to D2 with its KV. D1 stops it at a step boundary and holds its
blocks exactly as P holds a prompt's (``holds.BlockHolds``, an ``OfferSpec`` under a new
transfer id M); D2 takes a new request whose prompt is the original prompt plus every token D1
generated, pulls the KV of all but the last of those tokens from D1 (``PullParams`` with
``remote_num_tokens``), computes that last token and decodes on. The proxy stitches the two
streams (``pd_serving.migration``)::

    proxy --MIGRATE_OUT(X, M)--> D1 worker rank 0 (its transfer_kv server, the proxy knows it)
          --forwarded--> D1 scheduler half (the SEND_DONE server, engine-core process)
    D1 engine core, next build_connector_meta: request R (its kv_transfer_params name X) runs:
          R.max_tokens lowered to one more token (vLLM itself stops it after this step)
    the step samples it; vLLM finishes R (FINISHED_LENGTH_CAPPED) -> request_finished: the owner
          references R's blocks, OfferSpec(R, M) for the worker, MIGRATE_OUT answered "stopped"
          with R's prompt and output token ids and how many tokens have KV
    D1's stream ends ("length", every token delivered); the proxy withholds that end and calls
    D2 with prompt + outputs, max_tokens lowered, PullParams(M, D1, remote_num_tokens=len - 1)
    D2 pulls from D1 as from a P (a pull before the offer parks on D1); D1's blocks go back by
    SEND_DONE after the send, a release, or the lease.

Why stop by lowering ``max_tokens``: a connector cannot finish a request, and an abort (the
proxy closing D1's stream) races with tokens in flight and finishes the request as aborted,
which holds nothing. A request that reaches its lowered ``max_tokens`` finishes normally inside
vLLM's own step, after its last token was streamed, with its KV computed up to that token; the
scheduler half has mutated a request's fields before (a state group's shortened prompt).

One migration out, in the scheduler half (``MigrationsOut``)::

    (none) --request(X, M), X not a running request here--> answered: refused
    (none) --request(X, M)--> PENDING --next build_connector_meta, R running: max_tokens
                                 |          lowered--> STOPPING
                                 |--next build_connector_meta, R not running--> refused
                                 '--R finished first--> refused ("finished")
    STOPPING --R finished at the lowered max_tokens--> stopped: blocks held, offered under M
    STOPPING --R finished otherwise (EOS, stop token, abort, its own max_tokens)--> refused
    any --shut down--> refused

A second request for X while one is pending is refused. Every request is answered exactly once
(``reply``, on the thread that decided it, never blocking).

Pre-copy (``PRECOPY``, before MIGRATE_OUT): a decoding request's full blocks never change again,
so they can move while it decodes on. D1 references R's full blocks (each group's first
``num_tokens / block_size``) under a pre-copy id C, offers them as a P's prompt and answers with
their tokens and the one after them; R runs on untouched. The proxy sends D2 a one-token request
whose prompt is those tokens and that next one, pulling C from D1 (all of C's tokens: the token
D2 computes is the next one, in a block it does not cache): the blocks land in D2's prefix
cache holding D1's own KV, and the stop that follows pulls only the blocks after them. C's
blocks go back as any offer's (SEND_DONE after the send, a release, the lease); R's own blocks
are vLLM's as before::

    (none) --precopy(X, C), X not running here / C in use--> answered: refused
    (none) --precopy(X, C)--> PRECOPY PENDING --next build_connector_meta, R running with a
                                 |                full block computed before the last step-->
                                 |                offered: blocks referenced, offered under C
                                 |--next build_connector_meta, R not running / no full block,
                                 |    or a model with a state or sliding-window group--> refused
                                 '--R finished first / shut down--> refused

Only blocks below the token the last step computed count as full: with async scheduling that
step may still be writing when the next one is scheduled. Imports msgspec and simple_rpc only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from simple_rpc import CallContext, Client, Method, RpcError, Server

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# How long the scheduler half's handler waits for the engine core to decide. A running request
# steps every few milliseconds, so only a stalled engine gets near it; the answer is "refused".
DECIDE_WITHIN_S = 30.0
# A migration's transfer id starts so (the proxy names it): D2 pulls only the tokens D1 holds.
MIGRATION_ID_PREFIX = "mig-"


class MigrateOutRequest(msgspec.Struct, frozen=True):
    """Proxy -> D1 (and D1's worker -> its scheduler half): stop the request whose
    ``kv_transfer_params`` name ``transfer_id`` and hold its KV for a pull of ``migration_id``."""

    transfer_id: str
    migration_id: str
    reason: str = ""


class MigrateOutResponse(msgspec.Struct, frozen=True):
    """``stopped``: the request finished on D1 and its KV is held under ``migration_id`` (the
    first ``num_tokens`` tokens of prompt + output have KV). Otherwise ``reason`` says why not,
    and the request goes on (or already ended) as if nothing was asked."""

    transfer_id: str
    stopped: bool
    reason: str = ""
    migration_id: str = ""
    remote_rpc_address: str = ""
    remote_tp_size: int = 1
    num_tokens: int = 0
    prompt_token_ids: list[int] = []
    output_token_ids: list[int] = []


MIGRATE_OUT: Method[MigrateOutRequest, MigrateOutResponse] = Method(
    "hybrid_connector.migrate_out",
    request_head=0x48430003,
    response_head=0x48438003,
    request_type=MigrateOutRequest,
    response_type=MigrateOutResponse,
)

Reply = Callable[[MigrateOutResponse], None]


class PrecopyRequest(msgspec.Struct, frozen=True):
    """Proxy -> D1 (forwarded to its scheduler half): offer the full blocks of the running
    request whose ``kv_transfer_params`` name ``transfer_id`` under ``precopy_id``; the request
    goes on."""

    transfer_id: str
    precopy_id: str
    reason: str = ""


class PrecopyResponse(msgspec.Struct, frozen=True):
    """``offered``: the KV of ``token_ids`` (the request's first tokens, whole blocks) is
    offered under ``precopy_id`` and held until pulled, released or the lease passes;
    ``next_token_ids``: the token after them (the warm-up's prompt ends with it, so that the
    one token the warm-up computes is past the offered blocks and each block it caches holds
    D1's own KV). Otherwise ``reason`` says why not (nothing is held)."""

    transfer_id: str
    offered: bool
    reason: str = ""
    precopy_id: str = ""
    remote_rpc_address: str = ""
    remote_tp_size: int = 1
    token_ids: list[int] = []
    next_token_ids: list[int] = []


PRECOPY: Method[PrecopyRequest, PrecopyResponse] = Method(
    "hybrid_connector.precopy",
    request_head=0x48430004,
    response_head=0x48438004,
    request_type=PrecopyRequest,
    response_type=PrecopyResponse,
)

PrecopyReply = Callable[[PrecopyResponse], None]


def precopy_refused(transfer_id: str, reason: str) -> PrecopyResponse:
    return PrecopyResponse(transfer_id, offered=False, reason=reason)


def refused(transfer_id: str, reason: str) -> MigrateOutResponse:
    return MigrateOutResponse(transfer_id, stopped=False, reason=reason)


@dataclass(slots=True)
class _Migration:
    transfer_id: str
    migration_id: str
    reply: Reply
    request: Request
    # STOPPING: max_tokens was lowered to this (0: still PENDING); the request's own before.
    stop_at: int = 0
    max_tokens: int = 0


@dataclass(slots=True)
class _Precopy:
    transfer_id: str
    precopy_id: str
    reply: PrecopyReply
    request: Request


@dataclass(frozen=True, slots=True)
class Precopied:
    """``apply``: hold ``request``'s blocks for its first ``num_tokens`` tokens (whole blocks of
    every group) under ``precopy_id`` and offer them, then ``answer`` with the TP size
    (``SchedulerSide._hold_for_precopy``)."""

    precopy_id: str
    request: Request
    num_tokens: int
    answer: Callable[[int], None]
    refuse: Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Stopped:
    """``request_finished`` of a request stopped for a migration: hold its blocks under
    ``migration_id``, then ``answer`` with the params (``SchedulerSide._hold_for_migration``)."""

    migration_id: str
    answer: Callable[[int, int], None]  # (num_tokens with KV, remote_tp_size)


class MigrationsOut:
    """The scheduler half's migrations out (the diagram above). ``track``/``apply``/``finished``
    run on the engine-core thread, ``request`` on the SEND_DONE server's thread; one lock
    guards the tables, and no reply is made while holding it."""

    def __init__(self, rpc_address: str, block_size: int = 0, precopy_refusal: str = "") -> None:
        self._rpc_address = rpc_address
        # Pre-copy: the one block size of the model's groups, or why the model can not
        # (``precopy_refusal``: a state or sliding-window group changes blocks it has filled).
        self._block_size = block_size
        self._precopy_refusal = precopy_refusal or ("" if block_size else "no block size")
        self._lock = threading.Lock()
        self._running: dict[str, Request] = {}  # transfer id -> request (engine thread writes)
        self._transfer_of: dict[str, str] = {}  # request id -> transfer id
        self._pending: dict[str, _Migration] = {}  # transfer id -> migration
        self._precopies: dict[str, _Precopy] = {}  # transfer id -> pre-copy asked
        self._closed = False

    def __len__(self) -> int:
        """Requests tracked (running with a transfer id) or asked for."""
        with self._lock:
            return len(self._running) + len(self._pending) + len(self._precopies)

    # -- engine-core thread ------------------------------------------------------------------
    def track(self, transfer_id: str, request: Request) -> None:
        """A request with ``kv_transfer_params`` naming ``transfer_id`` (a PD D request, or one
        migrated in): it may be migrated out until it finishes."""
        with self._lock:
            self._running[transfer_id] = request
            self._transfer_of[request.request_id] = transfer_id

    def apply(self) -> list[Precopied]:
        """``build_connector_meta``: the pre-copies to hold now (the caller holds and offers
        them, then answers), and stop the requests asked for (after this step's token)."""
        precopied = self._apply_precopies() if self._precopies else []
        if not self._pending:  # read without the lock: a request that just came waits a step
            return precopied
        answers: list[tuple[Reply, MigrateOutResponse]] = []
        with self._lock:
            for tid, migration in list(self._pending.items()):
                if migration.stop_at:
                    continue
                request = migration.request
                status = request.status.name
                if status != "RUNNING":
                    del self._pending[tid]
                    answers.append((migration.reply, refused(tid, f"request is {status}")))
                    continue
                migration.max_tokens = request.max_tokens
                migration.stop_at = min(request.max_tokens, request.num_output_tokens + 1)
                request.max_tokens = migration.stop_at
        for reply, answer in answers:
            reply(answer)
        return precopied

    def _apply_precopies(self) -> list[Precopied]:
        refusals: list[tuple[PrecopyReply, PrecopyResponse]] = []
        out: list[Precopied] = []
        with self._lock:
            precopies, self._precopies = list(self._precopies.values()), {}
        for precopy in precopies:
            request, tid = precopy.request, precopy.transfer_id
            status = request.status.name
            # Blocks below the last computed token's: the step that computed it may still run.
            full = (request.num_computed_tokens - 1) // self._block_size * self._block_size
            if status != "RUNNING":
                refusals.append((precopy.reply, precopy_refused(tid, f"request is {status}")))
            elif full <= 0:
                refusals.append((precopy.reply, precopy_refused(tid, "no full block yet")))
            else:
                out.append(
                    Precopied(
                        precopy.precopy_id,
                        request,
                        full,
                        self._answer(precopy, full),
                        lambda why, p=precopy: p.reply(precopy_refused(p.transfer_id, why)),
                    )
                )
        for reply, answer in refusals:
            reply(answer)
        return out

    def _answer(self, precopy: _Precopy, num_tokens: int) -> Callable[[int], None]:
        request = precopy.request
        # num_tokens is below the last computed token: the token after the blocks exists.
        every = [*(request.prompt_token_ids or ()), *request.output_token_ids]
        tokens, after = every[:num_tokens], every[num_tokens : num_tokens + 1]

        def answer(tp_size: int) -> None:
            precopy.reply(
                PrecopyResponse(
                    precopy.transfer_id,
                    offered=True,
                    precopy_id=precopy.precopy_id,
                    remote_rpc_address=self._rpc_address,
                    remote_tp_size=tp_size,
                    token_ids=tokens,
                    next_token_ids=after,
                )
            )

        return answer

    def finished(self, request: Request) -> Stopped | None:
        """``request_finished``: forget the request; if it was stopped for a migration (it ended
        at the lowered ``max_tokens``), what to hold. Any other end refuses a pending one."""
        with self._lock:
            tid = self._transfer_of.pop(request.request_id, None)
            if tid is None:
                return None
            self._running.pop(tid, None)
            migration = self._pending.pop(tid, None)
            precopy = self._precopies.pop(tid, None)
        if precopy is not None:
            precopy.reply(precopy_refused(tid, f"request finished ({request.status.name})"))
        if migration is None:
            return None
        output = list(request.output_token_ids)
        ours = (
            migration.stop_at > 0
            and request.status.name == "FINISHED_LENGTH_CAPPED"
            and len(output) == migration.stop_at
            and migration.stop_at < migration.max_tokens
        )
        if not ours:
            migration.reply(refused(tid, f"request finished ({request.status.name})"))
            return None
        prompt = list(request.prompt_token_ids or ())

        def answer(num_tokens: int, tp_size: int) -> None:
            migration.reply(
                MigrateOutResponse(
                    tid,
                    stopped=True,
                    migration_id=migration.migration_id,
                    remote_rpc_address=self._rpc_address,
                    remote_tp_size=tp_size,
                    num_tokens=num_tokens,
                    prompt_token_ids=prompt,
                    output_token_ids=output,
                )
            )

        return Stopped(migration.migration_id, answer)

    def close(self) -> None:
        """Shut down: every pending migration is refused."""
        with self._lock:
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
            precopies, self._precopies = list(self._precopies.values()), {}
            self._running.clear()
            self._transfer_of.clear()
        for migration in pending:
            migration.reply(refused(migration.transfer_id, "the instance is shutting down"))
        for precopy in precopies:
            precopy.reply(precopy_refused(precopy.transfer_id, "the instance is shutting down"))

    # -- SEND_DONE server thread -------------------------------------------------------------
    def request(self, req: MigrateOutRequest, reply: Reply) -> None:
        """Ask for a migration; ``reply`` gets the answer now (refused) or from a later hook."""
        tid = req.transfer_id
        with self._lock:
            request = self._running.get(tid)
            if self._closed:
                why = "the instance is shutting down"
            elif request is None:
                why = "no running request has this transfer id here"
            elif tid in self._pending:
                why = "a migration of this request is under way"
            elif not req.migration_id or req.migration_id in self._running:
                why = "the migration id is empty or in use"
            else:
                self._pending[tid] = _Migration(tid, req.migration_id, reply, request)
                return
        reply(refused(tid, why))

    def request_precopy(self, req: PrecopyRequest, reply: PrecopyReply) -> None:
        """Ask for a pre-copy; ``reply`` gets the answer now (refused) or from ``apply``."""
        tid = req.transfer_id
        with self._lock:
            request = self._running.get(tid)
            if self._closed:
                why = "the instance is shutting down"
            elif self._precopy_refusal:
                why = f"no pre-copy here: {self._precopy_refusal}"
            elif request is None:
                why = "no running request has this transfer id here"
            elif tid in self._precopies or tid in self._pending:
                why = "a pre-copy or migration of this request is under way"
            elif not req.precopy_id.startswith(MIGRATION_ID_PREFIX):
                why = f"the pre-copy id must start with {MIGRATION_ID_PREFIX!r}"
            elif req.precopy_id in self._running:
                why = "the pre-copy id is in use"
            else:
                self._precopies[tid] = _Precopy(tid, req.precopy_id, reply, request)
                return
        reply(precopy_refused(tid, why))

    def withdraw_precopy(self, transfer_id: str) -> bool:
        """The asker gave up waiting: forget a pre-copy not yet applied (True)."""
        with self._lock:
            return self._precopies.pop(transfer_id, None) is not None

    def withdraw(self, transfer_id: str) -> bool:
        """The asker gave up waiting: forget a migration not yet applied (True). One whose
        request was already stopped goes on (its held blocks go back after the lease)."""
        with self._lock:
            migration = self._pending.get(transfer_id)
            if migration is None or migration.stop_at:
                return False
            del self._pending[transfer_id]
            return True


class MigrateOutService:
    """The scheduler half's MIGRATE_OUT handler, on the SEND_DONE server: the answer comes from
    the engine-core thread through a future on the server's loop."""

    def __init__(self, migrations: MigrationsOut, decide_within_s: float = DECIDE_WITHIN_S):
        self._migrations = migrations
        self._decide_within_s = decide_within_s

    def register(self, server: Server) -> None:
        server.register(MIGRATE_OUT, self._on_migrate_out)
        server.register(PRECOPY, self._on_precopy)

    async def _on_precopy(self, req: PrecopyRequest, ctx: CallContext) -> PrecopyResponse:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[PrecopyResponse] = loop.create_future()

        def reply(response: PrecopyResponse) -> None:  # any thread
            loop.call_soon_threadsafe(_settle, answer, response)

        self._migrations.request_precopy(req, reply)
        try:
            response = await asyncio.wait_for(asyncio.shield(answer), self._decide_within_s)
        except TimeoutError:
            if not self._migrations.withdraw_precopy(req.transfer_id):
                response = await answer  # applied meanwhile: its answer is on its way
            else:
                response = precopy_refused(req.transfer_id, "the engine did not step in time")
        log.info(
            "transfer %s: pre-copy under %s asked by %s (%s): %s",
            req.transfer_id,
            req.precopy_id,
            ctx.peer,
            req.reason or "no reason given",
            f"{len(response.token_ids)} tokens offered"
            if response.offered
            else f"refused, {response.reason}",
        )
        return response

    async def _on_migrate_out(self, req: MigrateOutRequest, ctx: CallContext) -> MigrateOutResponse:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[MigrateOutResponse] = loop.create_future()

        def reply(response: MigrateOutResponse) -> None:  # any thread
            loop.call_soon_threadsafe(_settle, answer, response)

        self._migrations.request(req, reply)
        try:
            response = await asyncio.wait_for(asyncio.shield(answer), self._decide_within_s)
        except TimeoutError:
            if not self._migrations.withdraw(req.transfer_id):
                response = await answer  # stopped meanwhile: its answer is on its way
            else:
                response = refused(req.transfer_id, "the engine did not step in time")
        log.info(
            "transfer %s: migration out to %s asked by %s (%s): %s",
            req.transfer_id,
            req.migration_id,
            ctx.peer,
            req.reason or "no reason given",
            "stopped" if response.stopped else f"refused, {response.reason}",
        )
        return response


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


class MigrateOutForwarder:
    """A worker's MIGRATE_OUT and PRECOPY handler (on its transfer_kv server, the address the
    proxy knows): forwards the call to the scheduler half, whose address the metadata names."""

    def __init__(self, scheduler_address: Callable[[], str], timeout_s: float = 60.0) -> None:
        self._scheduler_address = scheduler_address
        self._timeout_s = timeout_s
        self._client: Client | None = None
        self._client_address = ""

    def register(self, server: Server) -> None:
        server.register(MIGRATE_OUT, self._on_migrate_out)
        server.register(PRECOPY, self._on_precopy)

    async def _scheduler(self) -> Client | None:
        address = self._scheduler_address()
        if not address:
            return None
        if self._client is None or self._client_address != address:
            if self._client is not None:
                await self._client.close()
            self._client, self._client_address = Client(address), address
        return self._client

    async def _on_precopy(self, req: PrecopyRequest, ctx: CallContext) -> PrecopyResponse:
        client = await self._scheduler()
        if client is None:
            return precopy_refused(req.transfer_id, "this worker has not heard from its scheduler")
        try:
            return await client.call(PRECOPY, req, timeout=self._timeout_s)
        except RpcError as err:
            log.warning(
                "transfer %s: pre-copy asked by %s could not reach the scheduler at %s: %s",
                req.transfer_id,
                ctx.peer,
                self._client_address,
                err,
            )
            return precopy_refused(req.transfer_id, f"the scheduler half did not answer: {err}")

    async def _on_migrate_out(self, req: MigrateOutRequest, ctx: CallContext) -> MigrateOutResponse:
        client = await self._scheduler()
        if client is None:
            return refused(req.transfer_id, "this worker has not heard from its scheduler yet")
        address = self._client_address
        try:
            return await client.call(MIGRATE_OUT, req, timeout=self._timeout_s)
        except RpcError as err:
            log.warning(
                "transfer %s: migration out asked by %s could not reach the scheduler at %s: %s",
                req.transfer_id,
                ctx.peer,
                address,
                err,
            )
            return refused(req.transfer_id, f"the scheduler half did not answer: {err}")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
