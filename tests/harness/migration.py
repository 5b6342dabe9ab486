"""Live migration driven as the proxy drives it, against an offline engine: MIGRATE_OUT and
PRECOPY until the engine answers, RELEASE, and D2's pull parameters."""

from __future__ import annotations

from typing import Any

from hybrid_connector.contract import PullParams, encode_params
from hybrid_connector.control import migrate_out, precopy, release_transfer
from hybrid_connector.migration import MigrateOutResponse, PrecopyResponse
from simple_rpc import LoopThread

from harness.offline import OfflineEngine


def decoded(child: Any, request_id: str) -> int:
    """In the child: how many tokens D1's request has (0 before vLLM admitted it)."""
    for request in child.core.scheduler.requests.values():
        if request.request_id.startswith(request_id):
            return int(request.num_output_tokens)
    return 0


def stop(engine: OfflineEngine, transfer_id: str, migration_id: str) -> MigrateOutResponse:
    """MIGRATE_OUT until D1 stops the request: the first calls may come before D1 admitted it,
    or while it still pulls (each answer comes from an engine step)."""
    loop = LoopThread(name="test-proxy")
    try:
        for _ in range(2000):
            answer = loop.run(
                migrate_out(engine.rpc_address, transfer_id, migration_id), timeout=60
            )
            if answer.stopped or "finished" in answer.reason:
                return answer
        return answer
    finally:
        loop.close()


def precopy_offered(engine: OfflineEngine, transfer_id: str, precopy_id: str) -> PrecopyResponse:
    """PRECOPY until D1 offers (the first calls may come before D1 admitted the request)."""
    loop = LoopThread(name="test-proxy")
    try:
        for _ in range(2000):
            answer = loop.run(precopy(engine.rpc_address, transfer_id, precopy_id), timeout=60)
            if answer.offered or "finished" in answer.reason:
                return answer
        return answer
    finally:
        loop.close()


def release(engine: OfflineEngine, transfer_id: str) -> None:
    loop = LoopThread(name="test-proxy")
    try:
        loop.run(release_transfer(engine.rpc_address, transfer_id), timeout=60)
    finally:
        loop.close()


def pull_of(transfer_id: str, address: str, tp: int, num_tokens: int) -> dict[str, Any]:
    return encode_params(
        PullParams(
            transfer_id=transfer_id,
            remote_rpc_address=address,
            remote_tp_size=tp,
            remote_num_tokens=num_tokens,
        )
    )
