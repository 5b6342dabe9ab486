"""Scheduler-side half of HybridConnector: decides, records, never touches the network.

Every hook returns at once. What the worker must do is queued here and handed over in the next
``build_connector_meta``; what the worker finished comes back through ``get_transfer_results``
(``update_connector_output``), or, for the blocks of P requests this half holds itself
(``holds.BlockHolds``: announced requests, see ``request_finished``), through SEND_DONE, applied
at the start of every hook (``_drain``). Imports no vLLM (only its types, for checking).

KV-cache groups (vLLM's hybrid KV-cache manager): every block list is one list per group, in
vLLM's group order. Token groups (attention, mla, sliding window) carry the request's blocks from
token 0 (P) or its new blocks after the local prefix hit (D, with ``first_block`` per group); a
"state" group (linear attention: GDN, Mamba) carries only the slot of the request's running
state. A state can not be recomputed over the last prompt token twice, so with a state group P
computes the prompt but its last token and D loads that and computes the last token itself (as
vLLM's NixlConnector does): P's request is shortened by one token when it arrives.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

from hybrid_connector.config import HybridConfig
from hybrid_connector.holds import BlockHolds
from hybrid_connector.layout import KvGroup, state_slot
from hybrid_connector.metadata import (
    FinalPrefill,
    HybridConnectorMetadata,
    OfferSpec,
    RecvSpec,
    ReleaseSpec,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# Set in a D request's kv_transfer_params once its pull is planned: one pull per request, even if
# the request is preempted and scheduled again.
_DISPATCHED = "_hc_dispatched"
# Set in a P request's kv_transfer_params once its prompt lost its last token (state groups).
_SHORTENED = "_hc_shortened"
# vLLM RequestStatus names of a request that finished with its KV computed (not aborted).
_FINISHED_NORMALLY = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


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


def _remote_tp_size(request: Request) -> int:
    """P's TP size from its kv_transfer_params (1 if absent or not a positive int)."""
    params = request.kv_transfer_params or {}
    size = params.get("remote_tp_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1


def _wants_remote_decode(request: Request) -> bool:
    params = request.kv_transfer_params
    return bool(params and params.get("do_remote_decode"))


def _finishes_with_its_prompt(request: Request) -> bool:
    """True if the step that completes the prompt also finishes the request (``max_tokens=1``,
    the proxy contract for P). Only such requests get a rapid send: vLLM may preempt a request
    that keeps decoding and reuse its blocks at once, while kvt is still reading them."""
    return request.max_tokens == 1


def _transfer_id(request: Request) -> str:
    """The proxy's transfer id, or one made up (and stored) when the proxy gave none."""
    params = request.kv_transfer_params
    assert params is not None
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str) or not transfer_id:
        transfer_id = str(uuid.uuid4())  # D must then use the id P returns
        params["transfer_id"] = transfer_id
    return transfer_id


class SchedulerSide:
    def __init__(
        self,
        config: HybridConfig,
        *,
        is_producer: bool,
        is_consumer: bool,
        block_size: int,
        groups: list[KvGroup] | None = None,
        tp_size: int = 1,
    ) -> None:
        self._config = config
        # This instance's TP size: D needs P's to know which P ranks to pull from.
        self._tp_size = tp_size
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._block_size = block_size
        # vLLM's KV-cache groups (None: one attention group of ``block_size``).
        self._groups = groups or [KvGroup("attention", (), block_size)]
        self._has_state = any(g.family == "state" for g in self._groups)
        self._meta = HybridConnectorMetadata()
        self._kv_cache_manager: KVCacheManager | None = None
        # P: do_remote_decode requests still prefilling (announced once their last chunk runs).
        self._prefilling: dict[str, Request] = {}
        # P: requests announced in final_prefills: a rapid send may read their blocks, so they
        # stay held (by ``_holds``, else delay_free) whatever way they finish.
        self._announced: set[str] = set()
        # D: requests whose pull is in flight (between update_state_after_alloc and the worker
        # reporting them in finished_recving).
        self._recv_in_flight: set[str] = set()
        self._warned: set[str] = set()
        # P: the blocks of announced requests, held here after vLLM freed the request (None:
        # the old way, delay_free until finished_sending), and where SEND_DONE reaches us.
        self._holds: BlockHolds | None = None
        self._send_done_address = ""

    def use_holds(self, holds: BlockHolds, send_done_address: str) -> None:
        """P: hold announced requests' blocks in ``holds`` (released by SEND_DONE to
        ``send_done_address``) instead of delaying vLLM's free: the engine core can then sleep
        while D pulls. Before the first step."""
        self._holds = holds
        self._send_done_address = send_done_address

    def _drain(self) -> None:
        """Give vLLM back the blocks whose SEND_DONE arrived (engine-core thread, every hook)."""
        if self._holds is not None:
            self._holds.drain()

    def release_holds(self) -> int:
        """Shutdown: every block still held goes back to vLLM (once). Returns how many."""
        return 0 if self._holds is None else self._holds.release_all()

    # ------------------------------------------------------------------ D: pulling
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        # First hook of a schedule() that admits a request: released blocks count for it.
        self._drain()
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
        count = self._tokens_to_load(request) - num_computed_tokens
        if count <= 0:
            return 0, False
        return count, True

    def _tokens_to_load(self, request: Request) -> int:
        """Prompt tokens D pulls: all of them, or all but the last with a state group (P's
        state then stops before it, and D computes the last token on top of it)."""
        if self._has_state and request.num_prompt_tokens > 1:
            return request.num_prompt_tokens - 1
        return request.num_prompt_tokens

    def on_new_request(self, request: Request) -> None:
        """P with a state group: drop the prompt's last token (D computes it, see the module
        docstring); once, and only for requests that will be pulled."""
        params = request.kv_transfer_params
        if (
            not self._is_producer
            or not self._has_state
            or not params
            or not params.get("do_remote_decode")
            or params.get(_SHORTENED)
            or request.num_prompt_tokens <= 1
            or request.prompt_token_ids is None
        ):
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params[_SHORTENED] = True

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._is_producer and _wants_remote_decode(request):
            _transfer_id(request)
            # Not again after a preemption; never for a request that keeps decoding.
            if request.request_id not in self._announced and _finishes_with_its_prompt(request):
                self._prefilling[request.request_id] = request
            return
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
                    request_id,
                    transfer_id,
                    address,
                    "decode instance has a full local hit",
                    _remote_tp_size(request),
                )
            )
            return
        num_tokens = self._tokens_to_load(request)
        block_ids, first_block = self._destination(blocks, num_tokens)
        self._meta.to_recv.append(
            RecvSpec(
                request_id=request_id,
                transfer_id=transfer_id,
                remote_rpc_address=address,
                block_ids=block_ids,
                first_block=first_block,
                num_tokens=num_tokens,
                remote_tp_size=_remote_tp_size(request),
            )
        )
        self._recv_in_flight.add(request_id)

    def _destination(
        self, blocks: KVCacheBlocks, num_tokens: int
    ) -> tuple[list[list[int]], list[int]]:
        """D's blocks per group for the first ``num_tokens`` prompt tokens, and how many leading
        blocks of each group it already holds (hashed: its local prefix-cache hit)."""
        block_ids: list[list[int]] = []
        first_block: list[int] = []
        for group, held in zip(self._groups, blocks.blocks, strict=True):
            if group.family == "state":
                # As NixlConnector: the last new slot (a hashed one is D's cached checkpoint).
                ids = [b.block_id for b in held if b.block_hash is None and not b.is_null]
                block_ids.append(state_slot(ids, group.num_speculative_blocks))
                first_block.append(0)
                continue
            new = [b.block_id for b in held if b.block_hash is None and not b.is_null]
            cached = len(held) - len(new)
            # Blocks past the loaded tokens (the one D computes itself) are not P's to write.
            needed = max(0, -(-num_tokens // group.block_size) - cached)
            block_ids.append(new[:needed])
            first_block.append(cached)
        return block_ids, first_block

    def _held(self, block_ids: tuple[list[int], ...] | list[list[int]]) -> list[list[int]]:
        """P's blocks per group as offered: a state group keeps only its running state's slot."""
        return [
            state_slot(list(ids), g.num_speculative_blocks) if g.family == "state" else list(ids)
            for g, ids in zip(self._groups, block_ids, strict=True)
        ]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._drain()
        for request_id in output.finished_recving or ():
            self._recv_in_flight.discard(request_id)

    # ------------------------------------------------------------------ both
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...] | list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished ``request``; ``block_ids``: its blocks per KV-cache group. Returns
        (hold every group's blocks until the worker reports the request, params for D)."""
        request_id = request.request_id
        params = request.kv_transfer_params
        self._warned.discard(request_id)
        self._prefilling.pop(request_id, None)
        announced = request_id in self._announced
        self._announced.discard(request_id)
        self._drain()
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
                ReleaseSpec(
                    request_id,
                    transfer_id,
                    address,
                    "decode request ended before pull",
                    _remote_tp_size(request),
                )
            )
            return False, None
        if not self._is_producer or not params or not params.get("do_remote_decode"):
            return False, None
        transfer_id = _transfer_id(request)
        # By name: vLLM's RequestStatus enum would import vLLM into this pure module.
        finished_normally = request.status.name in _FINISHED_NORMALLY
        held = self._held(block_ids)
        if announced and self._holds is not None:
            # The worker offered it at the end of its step (FinalPrefill.scheduler_holds) and
            # will SEND_DONE it; vLLM may forget the request now, its blocks stay referenced.
            assert self._kv_cache_manager is not None
            blocks = self._kv_cache_manager.get_blocks(request_id).blocks
            self._holds.hold(request_id, transfer_id, blocks)
            if not finished_normally or not any(held):
                return False, None
            return False, self._params(request_id, transfer_id, held, request.num_computed_tokens)
        if not finished_normally or not any(held):
            # Aborted (or nothing computed): no KV to offer; fail any early pull at once.
            if announced:
                # A rapid send may be reading these blocks: the worker frees them after it.
                self._meta.to_offer.append(
                    OfferSpec(request_id, transfer_id, held, 0, aborted=True)
                )
                return True, None
            self._meta.cancel_offer.append(transfer_id)
            return False, None
        num_tokens = request.num_computed_tokens
        self._meta.to_offer.append(OfferSpec(request_id, transfer_id, held, num_tokens))
        return True, self._params(request_id, transfer_id, held, num_tokens)

    def _params(
        self, request_id: str, transfer_id: str, held: list[list[int]], num_tokens: int
    ) -> dict[str, Any]:
        """P's kv_transfer_params for the proxy and D."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_rpc_address": self._config.rpc_address,
            "remote_request_id": request_id,
            "remote_block_ids": held,
            "remote_num_tokens": num_tokens,
            "remote_tp_size": self._tp_size,
            "lease_s": self._config.lease_s,
        }

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HybridConnectorMetadata:
        self._drain()
        if self._prefilling:
            self._announce_prefills(scheduler_output)
        meta, self._meta = self._meta, HybridConnectorMetadata()
        meta.scheduler_address = self._send_done_address
        return meta

    def _announce_prefills(self, scheduler_output: SchedulerOutput) -> None:
        """Rapid transfer_kv: name the P requests whose prompt this step completes."""
        if self._kv_cache_manager is None:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in [r for r in self._prefilling if r in scheduled]:
            request = self._prefilling[request_id]
            # build_connector_meta runs before the scheduler advances num_computed_tokens.
            if request.num_computed_tokens + scheduled[request_id] < request.num_prompt_tokens:
                continue  # an earlier chunk of a chunked prefill
            del self._prefilling[request_id]
            num_tokens = request.num_prompt_tokens
            all_ids = self._held(self._kv_cache_manager.get_block_ids(request_id))
            held = [
                ids if g.family == "state" else ids[: -(-num_tokens // g.block_size)]
                for g, ids in zip(self._groups, all_ids, strict=True)
            ]
            self._meta.final_prefills.append(
                FinalPrefill(
                    request_id,
                    _transfer_id(request),
                    held,
                    num_tokens,
                    scheduler_holds=self._holds is not None,
                )
            )
            self._announced.add(request_id)
