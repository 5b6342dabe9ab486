"""Calls a proxy (or any tool) may make to a prefill instance's connector.

    from hybrid_connector.control import release_transfer
    await release_transfer("127.0.0.1:8200", transfer_id, reason="prefill request failed")

Use it with parallel dispatch when the request to P failed: D's pull, parked on P waiting for a
request that will never finish, fails at once (D recomputes) instead of after the lease.
"""

from __future__ import annotations

from simple_rpc import Client

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
