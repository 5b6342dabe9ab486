"""Scheduler-side half of HybridConnector: decides, records, never touches the network.

Every hook returns at once. What the worker must do is queued here and handed over in the next
``build_connector_meta``; what the worker finished comes back through ``get_finished`` results
(``update_connector_output``).
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from hybrid_connector.config import HybridConfig
from hybrid_connector.metadata import HybridConnectorMetadata, RecvSpec, ReleaseSpec, SendSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Set in a D request's kv_transfer_params once its pull is planned: one pull per request, even if
# the request is preempted and scheduled again.
_DISPATCHED = "_hc_dispatched"


def _pull_params(request: Request) -> tuple[str, str] | None:
    """(transfer_id, remote_rpc_address) if ``request`` asks to pull its prompt's KV."""
    params = request.kv_transfer_params
    if not params or not params.get("do_remote_prefill") or params.get(_DISPATCHED):
        return None
    transfer_id = params.get("transfer_id")
    address = params.get("remote_rpc_address")
    if not isinstance(transfer_id, str) or not transfer_id:
        return None
    if not isinstance(address, str) or ":" not in address:
        return None
    return transfer_id, address


class SchedulerSide:
    def __init__(self, config: HybridConfig, *, is_producer: bool, is_consumer: bool) -> None:
        self._config = config
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._meta = HybridConnectorMetadata()
        # D: requests whose pull is in flight (between update_state_after_alloc and the worker
        # reporting them in finished_recving).
        self._recv_in_flight: set[str] = set()
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ D: pulling
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self._is_consumer:
            return 0, False
        pull = _pull_params(request)
        if pull is None:
            params = request.kv_transfer_params
            if (
                params
                and params.get("do_remote_prefill")
                and not params.get(_DISPATCHED)
                and request.request_id not in self._warned
            ):
                self._warned.add(request.request_id)
                log.warning(
                    "request %s: do_remote_prefill without a valid transfer_id and "
                    "remote_rpc_address (%s); computing the prompt locally",
                    request.request_id,
                    {k: params.get(k) for k in ("transfer_id", "remote_rpc_address")},
                )
            return 0, False
        # Every prompt token P computed; vLLM itself recomputes the last one locally once the
        # load is done (so it can sample), as with NixlConnector.
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        pull = _pull_params(request)
        if pull is None:
            return
        transfer_id, address = pull
        assert request.kv_transfer_params is not None
        request.kv_transfer_params[_DISPATCHED] = True
        request_id = request.request_id
        if num_external_tokens <= 0:
            # Everything is already here (local prefix cache): let P free its blocks now.
            self._meta.to_release.append(
                ReleaseSpec(
                    request_id, transfer_id, address, "decode instance has a full local hit"
                )
            )
            return
        (all_ids,) = blocks.get_block_ids()
        new_ids = blocks.get_unhashed_block_ids()
        self._meta.to_recv.append(
            RecvSpec(
                request_id=request_id,
                transfer_id=transfer_id,
                remote_rpc_address=address,
                block_ids=list(new_ids),
                # Cached (hashed) blocks come first: P skips as many of its own.
                first_block=len(all_ids) - len(new_ids),
                num_tokens=request.num_prompt_tokens,
            )
        )
        self._recv_in_flight.add(request_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving or ():
            self._recv_in_flight.discard(request_id)

    # ------------------------------------------------------------------ both
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        request_id = request.request_id
        params = request.kv_transfer_params
        self._warned.discard(request_id)
        if request_id in self._recv_in_flight:
            # D request finished (aborted) while P may still be writing into its blocks: keep
            # them until the worker has aborted the pull and reports it in finished_recving.
            self._meta.cancel_recv.append(request_id)
            return True, None
        pull = _pull_params(request) if self._is_consumer else None
        if pull is not None:
            # Finished before it was ever scheduled: P holds blocks for nobody; release them.
            transfer_id, address = pull
            assert params is not None
            params[_DISPATCHED] = True
            self._meta.to_release.append(
                ReleaseSpec(request_id, transfer_id, address, "decode request ended before pull")
            )
            return False, None
        if not self._is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id:
            transfer_id = str(uuid.uuid4())  # no proxy-chosen id: D must use the returned one
        finished_normally = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not finished_normally or not block_ids:
            # Aborted (or nothing computed): no KV to offer; fail any early pull at once.
            self._meta.cancel_send.append(transfer_id)
            return False, None
        num_tokens = request.num_computed_tokens
        self._meta.to_send.append(SendSpec(request_id, transfer_id, list(block_ids), num_tokens))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_rpc_address": self._config.rpc_address,
            "remote_request_id": request_id,
            "remote_block_ids": list(block_ids),
            "remote_num_tokens": num_tokens,
            "lease_s": self._config.lease_s,
        }

    def build_connector_meta(self) -> HybridConnectorMetadata:
        meta, self._meta = self._meta, HybridConnectorMetadata()
        return meta
