"""Calls a proxy (or any tool) may make to an instance's connector.

    from hybrid_connector.control import migrate_out, release_transfer
    await release_transfer("127.0.0.1:8200", transfer_id, reason="prefill request failed")
    answer = await migrate_out("127.0.0.1:8201", transfer_id, new_transfer_id)
    offered = await precopy("127.0.0.1:8201", transfer_id, precopy_id)

Use ``release_transfer`` with parallel dispatch when the request to P failed: D's pull, parked
on P waiting for a request that will never finish, fails at once (D recomputes) instead of after
the lease. ``migrate_out`` stops a decoding request and holds its KV for another instance;
``precopy`` before it offers the request's full blocks while it decodes on.
"""

from __future__ import annotations

from typing import Any

from simple_rpc import Client

from hybrid_connector.migration import (
    MIGRATE_OUT,
    PRECOPY,
    MigrateOutRequest,
    MigrateOutResponse,
    PrecopyRequest,
    PrecopyResponse,
)
from hybrid_connector.protocol import RELEASE, ReleaseRequest


async def release_transfer(
    rpc_address: str,
    transfer_id: str,
    *,
    reason: str = "released by the proxy",
    request_id: str = "",
    timeout_s: float = 5.0,
    client: Client | None = None,
) -> bool:
    """Tell P that nobody will pull ``transfer_id``: held blocks are freed, a parked pull fails,
    and a request that finishes later is released at once. True if held blocks were freed now.

    Raises simple_rpc's errors: ``TransportError`` if P is unreachable, ``RpcTimeout`` after
    ``timeout_s``.
    Pass a connected ``client`` to reuse one connection for many calls.
    """
    request = ReleaseRequest(transfer_id, request_id, reason)
    if client is not None:
        return (await client.call(RELEASE, request, timeout=timeout_s)).released
    own = Client(rpc_address)
    try:
        return (await own.call(RELEASE, request, timeout=timeout_s)).released
    finally:
        await own.close()


async def migrate_out(
    rpc_address: str,
    transfer_id: str,
    migration_id: str,
    *,
    reason: str = "",
    timeout_s: float = 60.0,
    client: Client | None = None,
) -> MigrateOutResponse:
    """Ask a decode instance (its transfer_kv server, TP rank 0) to stop the request whose
    ``kv_transfer_params`` name ``transfer_id`` and hold its KV for a pull of ``migration_id``
    (see ``hybrid_connector.migration``). The answer says whether it stopped and, if so, the
    request's prompt and output token ids and how many of them have KV.

    Raises simple_rpc's errors as ``release_transfer`` does.
    """
    request = MigrateOutRequest(transfer_id, migration_id, reason)
    return await _call(rpc_address, MIGRATE_OUT, request, timeout_s, client)


async def precopy(
    rpc_address: str,
    transfer_id: str,
    precopy_id: str,
    *,
    reason: str = "",
    timeout_s: float = 60.0,
    client: Client | None = None,
) -> PrecopyResponse:
    """Ask a decode instance to offer the full blocks of the running request whose
    ``kv_transfer_params`` name ``transfer_id`` under ``precopy_id`` (it must start with
    ``migration.MIGRATION_ID_PREFIX``) while the request decodes on. The answer names the tokens
    whose KV is offered (see ``hybrid_connector.migration``).

    Raises simple_rpc's errors as ``release_transfer`` does.
    """
    request = PrecopyRequest(transfer_id, precopy_id, reason)
    return await _call(rpc_address, PRECOPY, request, timeout_s, client)


async def _call(
    rpc_address: str, method: Any, request: Any, timeout_s: float, client: Client | None
) -> Any:
    """One call on ``client``, or on a connection of its own to ``rpc_address``, closed after."""
    if client is not None:
        return await client.call(method, request, timeout=timeout_s)
    own = Client(rpc_address)
    try:
        return await own.call(method, request, timeout=timeout_s)
    finally:
        await own.close()
