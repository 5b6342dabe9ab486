"""Remote get: pull an object owned by another node's master into this node's pool.

The requesting master allocates room in its own pool, then asks the owner to write the payload
there. By default (``mode="kvt"``, also what ``"auto"`` means) both masters own a
``kvt.TransferEngine`` with their pool registered as region 0: the requester ``expect``s the
request id, asks the owner over simple-rpc (``SEND_TO``), and the owner ``send``s IpcBlocks from its
pool straight into the requester's pool (kvt's TCP data plane: scatter/gather from registered
memory, ``recv_into`` the destination). With ``mode="rpc"`` (e.g. where kvt's data port cannot be
reached) the requester reads the object in chunks with raw simple-rpc frames (``READ_RANGE``) and
copies them into its pool. kvt is a dependency of refstore; it is imported when a master first
transfers (its import costs about half a second), not when refstore is.

The puller works on what the master owns, handed to it: the state and the pool's memory (it does
not know the master).

The local copy is an ordinary object of the local pool (leased for the fetch's TTL, then evictable
like any other), remembered per remote (epoch, oid) so repeated gets do not pull again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from simple_rpc import Client as RpcClient
from simple_rpc import RpcError

from . import protocol
from .errors import CallerError, MasterUnavailable, PeerError, from_info
from .state import MasterState

log = logging.getLogger("refstore.remote")

CHUNK = 8 << 20  # raw-read chunk; larger chunks only add latency before the first byte
RAW_PARALLEL = 2
KVT_BLOCK = 64 << 20  # bytes per IpcBlock when sending a contiguous object
TRANSFER_TIMEOUT_S = 120.0
SETTLE_S = 10.0
MODES = ("auto", "kvt", "rpc")


class RemotePuller:
    """Remote gets of one master: ``state`` is its bookkeeping, ``pool`` its pool's memory
    (both owned by the master and used on its loop thread), ``name`` names its kvt engine."""

    def __init__(
        self,
        state: MasterState,
        pool: memoryview,
        name: str,
        *,
        mode: str = "auto",
        host: str = "127.0.0.1",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"remote mode must be auto, kvt or rpc, got {mode!r}")
        self.state = state
        self.pool = pool
        self.name = name
        self.mode = "rpc" if mode == "rpc" else "kvt"
        self._host = host if host != "0.0.0.0" else "127.0.0.1"
        self._peers: dict[str, RpcClient] = {}
        self._fetched: dict[tuple[str, int], int] = {}  # remote (epoch, oid) -> local oid
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        self._engine: Any = None
        self._region: int | None = None
        self._starting: asyncio.Future | None = None  # the engine's start, while it runs
        self._cuts: Any = None  # kvt fault plan, only once a cut was injected (send_to:cut)
        self._closed = False

    # -- kvt engine, created on first use ---------------------------------------------------
    def _kvt(self) -> Any:
        if self._engine is None:
            from kvt import TransferEngine

            engine = TransferEngine(host=self._host, port=0, name=f"refstore-{self.name}")
            self._region = engine.register_region(self.pool)
            self._engine = engine
        return self._engine

    async def warm_up(self) -> None:
        """Start the kvt engine now rather than in the first transfer's time (a master with
        peers: their fetches have a short deadline)."""
        if self.mode == "kvt" and self._engine is None:
            await self._started_engine()

    async def _started_engine(self) -> Any:
        """The kvt engine, started once however many transfers ask for it at once."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(asyncio.to_thread(self._kvt))
        starting = self._starting
        try:
            return await asyncio.shield(starting)
        except Exception:
            if self._starting is starting:
                self._starting = None  # the next transfer tries again
            raise

    def _cut_plan(self) -> Any:
        """The kvt fault plan of this master's engine that cuts the links of chosen requests
        mid-frame (installed on the first cut: until then the backend has no plan to ask)."""
        if self._cuts is None:
            from kvt.faults import Fault, FaultKind, FaultPlan

            class CutPlan(FaultPlan):
                def __init__(self) -> None:
                    super().__init__()
                    self.request_ids: set[str] = set()

                def decide(self, frame: Any) -> Fault | None:
                    if frame.request_id not in self.request_ids:
                        return None
                    self.request_ids.discard(frame.request_id)
                    return Fault(FaultKind.DROP_MID)

            self._cuts = CutPlan()
            self._kvt().backend.faults = self._cuts
        return self._cuts

    def _peer(self, address: str) -> RpcClient:
        client = self._peers.get(address)
        if client is None or client.closed:
            client = self._peers[address] = RpcClient(address)
        return client

    async def call(self, address: str, method: Any, request: Any, limit_s: float) -> Any:
        """One call to another master; its typed errors raised, transport ones as
        ``MasterUnavailable``."""
        try:
            resp = await self._peer(address).call(method, request, timeout=limit_s)
        except RpcError as err:
            raise MasterUnavailable(f"owner master {address}: {type(err).__name__}: {err}") from err
        if getattr(resp, "err", None) is not None:
            raise from_info(resp.err)
        return resp

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in self._peers.values():
            await client.close()
        self._peers.clear()
        if self._starting is not None:  # an engine being started is closed too
            with contextlib.suppress(Exception):
                await asyncio.shield(self._starting)
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await asyncio.to_thread(engine.close)

    # -- requester side -----------------------------------------------------------------------
    async def fetch(self, req: protocol.Fetch) -> protocol.FetchResp:
        key = (req.epoch, req.oid)
        state = self.state
        local_oid = self._fetched.get(key)
        if local_oid is not None:
            obj = state.objects.get(local_oid)
            if obj is not None and obj.sealed and obj.free_when_idle is None:
                state.extend(state.epoch, [local_oid], req.ttl_s)
                state.get(state.epoch, local_oid)
                return protocol.FetchResp(state.epoch, local_oid, obj.payload, obj.layout)
            del self._fetched[key]
        pending = self._inflight.get(key)
        if pending is not None:
            await asyncio.shield(pending)
            return await self.fetch(req)
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            return await self._pull(req)
        finally:
            del self._inflight[key]
            future.set_result(None)

    async def _pull(self, req: protocol.Fetch) -> protocol.FetchResp:
        state = self.state
        desc = await self.call(
            req.node, protocol.DESCRIBE, protocol.Describe(req.epoch, req.oid), 10.0
        )
        if desc.layout is None:
            raise PeerError(f"owner {req.node} described object {req.oid} without a layout")
        try:
            obj = state.alloc(desc.nbytes, desc.layout, req.ttl_s, False)
        except CallerError as err:  # the owner's numbers, not the caller's
            raise PeerError(f"owner {req.node} described object {req.oid}: {err}") from err
        try:
            await self.pull_into(
                req.node,
                req.epoch,
                req.oid,
                nbytes=desc.nbytes,
                dst_offset=obj.payload,
                timeout_s=TRANSFER_TIMEOUT_S,
            )
        except BaseException:
            state.release(state.epoch, [obj.oid])
            raise
        state.seal(obj.oid)
        state.counters["remote_fetches"] += 1
        self._fetched[(req.epoch, req.oid)] = obj.oid
        return protocol.FetchResp(state.epoch, obj.oid, obj.payload, obj.layout)

    async def pull_into(
        self, node: str, epoch: str, oid: int, *, nbytes: int, dst_offset: int, timeout_s: float
    ) -> None:
        """Copy the payload of object ``oid`` of the master at ``node`` (pool ``epoch``) to
        ``dst_offset`` of this master's pool, within ``timeout_s``. When it raises, nothing
        writes to the destination any more: the caller may free it."""
        if self.mode == "kvt":
            await self._pull_kvt(node, epoch, oid, dst_offset, nbytes, timeout_s)
        else:
            await self._pull_rpc(
                node, epoch, oid, dst_offset=dst_offset, nbytes=nbytes, timeout_s=timeout_s
            )

    async def _pull_rpc(
        self, node: str, epoch: str, oid: int, *, dst_offset: int, nbytes: int, timeout_s: float
    ) -> None:
        view = self.pool
        queue = list(range(0, nbytes, CHUNK))

        async def worker() -> None:
            while queue:
                pos = queue.pop(0)
                length = min(CHUNK, nbytes - pos)
                data = await self.call(
                    node,
                    protocol.READ_RANGE,
                    protocol.ReadRange(epoch, oid, pos, length),
                    timeout_s,
                )
                if len(data) != length:
                    raise PeerError(f"owner {node} sent {len(data)} bytes for {length}")
                view[dst_offset + pos : dst_offset + pos + length] = data

        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(worker() for _ in range(RAW_PARALLEL)))

    async def _pull_kvt(  # noqa: PLR0917 (private; one call site)
        self, node: str, epoch: str, oid: int, dst_offset: int, nbytes: int, timeout_s: float
    ) -> None:
        engine = self._engine or await self._started_engine()
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        request_id = f"refstore-{uuid.uuid4().hex}"

        def on_complete(completion: Any) -> None:  # kvt thread: hand off, never block
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(completion))

        engine.expect(request_id, timeout_s=timeout_s, on_complete=on_complete)
        send = protocol.SendTo(
            epoch, oid, request_id, engine.data_address, self._region, dst_offset
        )
        try:
            await self.call(node, protocol.SEND_TO, send, timeout_s)
            completion = (
                await done
            )  # kvt ends the request by its deadline (timeout_s) at the latest
        except BaseException:
            if not done.done():
                engine.abort(request_id, "owner refused to send")
                await self._settled(done, request_id)
            raise
        status = getattr(completion.status, "name", str(completion.status))
        if status != "DONE":
            raise PeerError(f"transfer {request_id} from {node} {status}: {completion!r}")
        if completion.nbytes != nbytes:  # an owner that sent less than it described
            raise PeerError(f"transfer {request_id} from {node}: {completion.nbytes} of {nbytes} B")

    async def _settled(self, done: asyncio.Future, request_id: str) -> None:
        """Wait for an aborted receive's one completion: until then kvt may still be writing
        a frame into the destination (an abort inside a frame waits for the frame's end)."""
        try:
            await asyncio.wait_for(asyncio.shield(done), SETTLE_S)
        except TimeoutError:
            log.error("receive %s not settled %.0f s after its abort", request_id, SETTLE_S)

    # -- owner side ---------------------------------------------------------------------------
    async def send_to(
        self, req: protocol.SendTo, peer: str, *, cut: bool = False
    ) -> protocol.SendToResp:
        """Send object ``oid`` into the requester's pool; ``cut`` (fault injection): the link
        dies once the first frame's header and half its payload are out."""
        import numpy as np
        from ipcblock import IPCBLOCK_DTYPE

        state = self.state
        obj = state.get(req.epoch, req.oid)
        engine = self._engine or await self._started_engine()
        if cut:
            self._cut_plan().request_ids.add(req.request_id)
        starts = np.arange(0, max(obj.nbytes, 1), KVT_BLOCK, dtype=np.uint64)
        blocks = np.zeros(len(starts), dtype=IPCBLOCK_DTYPE)
        blocks["src_region"] = self._region
        blocks["dst_region"] = req.dst_region
        blocks["src_offset"] = obj.payload + starts
        blocks["dst_offset"] = req.dst_offset + starts
        blocks["length"] = np.minimum(KVT_BLOCK, obj.nbytes - starts.astype(np.int64))
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_complete(completion: Any) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(completion))

        state.begin_send(obj)  # the object is not freed while the peer reads it
        try:
            engine.send(
                req.request_id, req.data_address, blocks, last=True, on_complete=on_complete
            )
            completion = await done
        finally:
            state.end_send(obj)
        status = getattr(completion.status, "name", str(completion.status))
        if status != "DONE":
            log.warning(
                "send of %s to %s (%s) ended %s", req.request_id, peer, req.data_address, status
            )
            raise PeerError(f"transfer {req.request_id} to {peer} {status}: {completion!r}")
        return protocol.SendToResp(nbytes=obj.nbytes, layout=obj.layout)
