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
        self._closed = False

    # -- kvt engine, created on first use ---------------------------------------------------
    def _kvt(self) -> Any:
        if self._engine is None:
            from kvt import TransferEngine

            engine = TransferEngine(host=self._host, port=0, name=f"refstore-{self.name}")
            self._region = engine.register_region(self.pool)
            self._engine = engine
        return self._engine

    def _peer(self, address: str) -> RpcClient:
        client = self._peers.get(address)
        if client is None or client.closed:
            client = self._peers[address] = RpcClient(address)
        return client

    async def _call(self, address: str, method: Any, request: Any, limit_s: float) -> Any:
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
        desc = await self._call(
            req.node, protocol.DESCRIBE, protocol.Describe(req.epoch, req.oid), 10.0
        )
        if desc.layout is None:
            raise PeerError(f"owner {req.node} described object {req.oid} without a layout")
        try:
            obj = state.alloc(desc.nbytes, desc.layout, req.ttl_s, False)
        except CallerError as err:  # the owner's numbers, not the caller's
            raise PeerError(f"owner {req.node} described object {req.oid}: {err}") from err
        try:
            if self.mode == "kvt":
                await self._pull_kvt(req, obj.offset)
            else:
                await self._pull_rpc(req, obj.offset, desc.nbytes)
        except BaseException:
            state.release(state.epoch, [obj.oid])
            raise
        state.seal(obj.oid)
        state.counters["remote_fetches"] += 1
        self._fetched[(req.epoch, req.oid)] = obj.oid
        return protocol.FetchResp(state.epoch, obj.oid, obj.payload, obj.layout)

    async def _pull_rpc(self, req: protocol.Fetch, dst_offset: int, nbytes: int) -> None:
        view = self.pool
        queue = list(range(0, nbytes, CHUNK))

        async def worker() -> None:
            while queue:
                pos = queue.pop(0)
                length = min(CHUNK, nbytes - pos)
                data = await self._call(
                    req.node,
                    protocol.READ_RANGE,
                    protocol.ReadRange(req.epoch, req.oid, pos, length),
                    TRANSFER_TIMEOUT_S,
                )
                if len(data) != length:
                    raise PeerError(f"owner {req.node} sent {len(data)} bytes for {length}")
                view[dst_offset + pos : dst_offset + pos + length] = data

        await asyncio.gather(*(worker() for _ in range(RAW_PARALLEL)))

    async def _pull_kvt(self, req: protocol.Fetch, dst_offset: int) -> None:
        engine = await asyncio.to_thread(self._kvt) if self._engine is None else self._engine
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        request_id = f"refstore-{uuid.uuid4().hex}"

        def on_complete(completion: Any) -> None:  # kvt thread: hand off, never block
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(completion))

        engine.expect(request_id, timeout_s=TRANSFER_TIMEOUT_S, on_complete=on_complete)
        try:
            await self._call(
                req.node,
                protocol.SEND_TO,
                protocol.SendTo(
                    req.epoch, req.oid, request_id, engine.data_address, self._region, dst_offset
                ),
                TRANSFER_TIMEOUT_S,
            )
        except BaseException:
            engine.abort(request_id, "owner refused to send")
            raise
        completion = await done
        status = getattr(completion.status, "name", str(completion.status))
        if status != "DONE":
            raise PeerError(f"transfer {request_id} from {req.node} {status}: {completion!r}")

    # -- owner side ---------------------------------------------------------------------------
    async def send_to(self, req: protocol.SendTo, peer: str) -> protocol.SendToResp:
        import numpy as np
        from ipcblock import IPCBLOCK_DTYPE

        state = self.state
        obj = state.get(req.epoch, req.oid)
        engine = await asyncio.to_thread(self._kvt) if self._engine is None else self._engine
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
