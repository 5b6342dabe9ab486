"""Scheduler-side half of HybridConnector: decides, records, never touches the network.

Every hook returns at once. What the worker must do is queued here and handed over in the next
``build_connector_meta``; what D's worker finished comes back through ``get_transfer_results``
(``update_connector_output``). P's blocks have one owner, ``holds.BlockHolds``: it references a
finished P request's blocks and gives them back when every worker rank sent SEND_DONE, at the
start of the next hook (``_drain``). Imports no vLLM (only its types, for checking).

``kv_transfer_params`` is decoded once per request at this half's first hook that sees it
(``contract.decode_params``); what this half does with a request is kept in its own record
(``_Tracked``), never in vLLM's dict. Params that break the contract are logged (WARNING, the
request, the peer, the field) and the request runs without a transfer.

KV-cache groups (vLLM's hybrid KV-cache manager): every block list is one list per group, in
vLLM's group order. Token groups (attention, mla, sliding window) carry the request's blocks from
token 0 (P) or its new blocks after the local prefix hit (D, with ``first_block`` per group); a
"state" group (linear attention: GDN, Mamba) carries only the slot of the request's running
state. A state can not be recomputed over the last prompt token twice, so with a state group P
computes the prompt but its last token and D loads that and computes the last token itself (as
vLLM's NixlConnector does): P's request is shortened by one token when it arrives.

D with KVS on looks the prompt up in the store before it pulls (the lookup is asked and answered
as for a plain request, ``None`` to vLLM in between). The blocks the store holds past D's local
hit are loaded from it (``KvsLoad``), and only the blocks after them are pulled from P (the pull's
``first_block`` counts them as held); the worker reports the request once both are in. When the
store holds every full block of the prompt, D pulls nothing: it loads them, computes the partial
last block itself, and P releases at once, so a P that released or died costs no recompute.
With a state group D loads the token groups' blocks from the store and pulls the rest and P's
state (the state after the prompt is only P's).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybrid_connector import r3
from hybrid_connector.config import HybridConfig
from hybrid_connector.contract import (
    ContractError,
    PrefillParams,
    PullParams,
    decode_params,
    encode_params,
)
from hybrid_connector.holds import BlockHolds, Offer, Withdraw
from hybrid_connector.kvs import KvsScheduler
from hybrid_connector.layout import KvGroup, state_slot
from hybrid_connector.metadata import (
    FinalPrefill,
    HybridConnectorMetadata,
    OfferSpec,
    R3Copy,
    RecvSpec,
    ReleaseSpec,
    StepReport,
)
from hybrid_connector.migration import MIGRATION_ID_PREFIX, MigrationsOut, Precopied, Stopped

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# vLLM RequestStatus names of a request that finished with its KV computed (not aborted).
_FINISHED_NORMALLY = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


@dataclass(slots=True)
class _Tracked:
    """The connector's own record of a request with ``kv_transfer_params`` (vLLM's dict stays
    as the proxy sent it): its decoded params, and what this half did with it."""

    params: PrefillParams | PullParams | None  # None: the params broke the contract
    # P: the transfer id (the proxy's, or one made up when it gave none).
    transfer_id: str = ""
    # P, a model with a state group: the prompt lost its last token (once).
    shortened: bool = False
    # D: its pull (or release) is planned: one per request, even if it is preempted and
    # scheduled again.
    dispatched: bool = False
    # D with KVS: the store holds every full block of the prompt; load those, compute the
    # partial last block here, and let P release without a pull.
    store_only: bool = False


def _finishes_with_its_prompt(request: Request) -> bool:
    """True if the step that completes the prompt also finishes the request (``max_tokens=1``,
    the proxy contract for P). Only such requests get a rapid send: vLLM may preempt a request
    that keeps decoding and reuse its blocks at once, while kvt is still reading them."""
    return request.max_tokens == 1


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
        kvs: KvsScheduler | None = None,
        r3_rows: r3.RowGeometry | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self._config = config
        # Pre-copied blocks land in the new D's prefix cache (the D's of a deployment share
        # their settings): without one here, a pre-copy would only move the blocks twice.
        self._prefix_caching = prefix_caching
        # R3 (None: off): the routing row of a token, and the group whose blocks hold the rows.
        self._r3_rows = r3_rows
        self._r3_group = next(
            (i for i, g in enumerate(groups or ()) if r3.ROUTING_LAYER in g.layer_names), 0
        )
        # The shared KV store's half (None: off): loads for requests without a PD pull, saves.
        self.kvs = kvs
        # KVS loads in flight (the worker reports them like pulls); those copied in the step
        # that admits their request are named in that step's output instead (``StepReport``).
        self._kvs_loading: set[str] = set()
        # This instance's TP size: D needs P's to know which P ranks to pull from.
        self._tp_size = tp_size
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._block_size = block_size
        # vLLM's KV-cache groups (None: one attention group of ``block_size``).
        self._groups = groups or [KvGroup("attention", (), block_size)]
        self._has_state = any(g.family == "state" for g in self._groups)
        # R3: which blocks to reset, which requests a capture missed.
        self._r3_ledger = (
            None if r3_rows is None else r3.RowLedger(self._groups[self._r3_group].block_size)
        )
        self._meta = HybridConnectorMetadata()
        self._kv_cache_manager: KVCacheManager | None = None
        # Requests with kv_transfer_params, from their first hook to request_finished.
        self._tracked: dict[str, _Tracked] = {}
        # P: do_remote_decode requests still prefilling (announced once their last chunk runs).
        self._prefilling: dict[str, Request] = {}
        # D: requests whose pull is in flight (between update_state_after_alloc and the worker
        # reporting them in finished_recving).
        self._recv_in_flight: set[str] = set()
        # P: the one owner of P's blocks (bound to vLLM's pool in bind_kv_cache_manager), and
        # where the workers' SEND_DONE reaches it (every metadata carries the address).
        self.holds = BlockHolds(tp_size=tp_size)
        self.send_done_address = ""
        # Live migration out of running requests (migration.py): an instance that can hold KV.
        self.migrations = MigrationsOut(config.rpc_address, *self._precopy_geometry())

    def _precopy_geometry(self) -> tuple[int, str]:
        """(the block size of every group, why pre-copy can not run here): a full block stays
        as it is only in full-attention groups of one block size."""
        changing = sorted({g.family for g in self._groups} - {"attention", "mla"})
        if changing:
            # A state changes with every token: pre-copied, it would be stale by the stop.
            return 0, f"the model has {'/'.join(changing)} KV-cache groups"
        if not self._prefix_caching:
            return 0, "prefix caching is off (the pre-copied blocks would have no cache to land in)"
        sizes = {g.block_size for g in self._groups}
        if len(sizes) != 1:
            return 0, "the KV-cache groups have different block sizes"
        return sizes.pop(), ""

    def _drain(self) -> None:
        """Give vLLM back the blocks whose SEND_DONE arrived (engine-core thread, every hook):
        P's held requests', and those of KVS saves every rank finished."""
        self.holds.drain()
        if self.kvs is not None:
            self.kvs.drain()

    def send_done(self, request_id: str, tp_rank: int, outcome: str = "") -> bool:
        """SEND_DONE server thread (``send_done.SendDoneSink``): a KVS save's report, or one
        for P's held blocks (``holds``)."""
        if self.kvs is not None and self.kvs.is_save_report(request_id):
            return self.kvs.save_reported(request_id, tp_rank)
        return self.holds.send_done(request_id, tp_rank, outcome)

    def release_holds(self) -> int:
        """Shutdown: every block still held goes back to vLLM (once). Returns how many."""
        if self.kvs is not None:
            self.kvs.close()
        self.migrations.close()
        return self.holds.release_all()

    # ------------------------------------------------------------------ the contract
    def _track(self, request: Request) -> _Tracked | None:
        """The connector's record of ``request`` (None: no transfer asked). Decodes vLLM's
        ``kv_transfer_params`` the first time; a contract breach is logged once."""
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        raw = request.kv_transfer_params
        if raw is None:
            return None
        try:
            params = decode_params(raw)
        except ContractError as err:
            log.warning(
                "request %s: kv_transfer_params from %s rejected (%s); %s",
                request.request_id,
                _peer(raw),
                err,
                "computing the prompt locally"
                if _asks(raw, "do_remote_prefill")
                else "serving it without a transfer",
            )
            tracked = _Tracked(None)
        else:
            if params is None:
                return None
            tracked = _Tracked(params)
            if isinstance(params, PrefillParams):
                # No id from the proxy: one made up here, which D must then take from P's answer.
                tracked.transfer_id = params.transfer_id or str(uuid.uuid4())
        self._tracked[request.request_id] = tracked
        return tracked

    def _pull_of(self, request: Request) -> tuple[_Tracked, PullParams] | None:
        """D: the request's record and pull params, if it still has to pull."""
        if not self._is_consumer:
            return None
        tracked = self._track(request)
        if tracked is None or tracked.dispatched or not isinstance(tracked.params, PullParams):
            return None
        return tracked, tracked.params

    def _offer_of(self, request: Request) -> _Tracked | None:
        """P: the request's record, if D will pull its KV."""
        if not self._is_producer:
            return None
        tracked = self._track(request)
        if tracked is None or not isinstance(tracked.params, PrefillParams):
            return None
        return tracked

    # ------------------------------------------------------------------ D: pulling
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        # First hook of a schedule() that admits a request: released blocks count for it.
        self._drain()
        if self._r3_ledger is not None:
            self._r3_ledger.looked_up(request.request_id, num_computed_tokens)
        pull = self._pull_of(request)
        if pull is None:
            if self.kvs is not None:
                return self.kvs.get_num_new_matched_tokens(request, num_computed_tokens)
            return 0, False
        # Every prompt token P computed; vLLM itself recomputes the last one locally once the
        # load is done (so it can sample), as with NixlConnector.
        count = self._tokens_to_load(request, pull) - num_computed_tokens
        if count <= 0:
            return 0, False
        if self.kvs is not None:
            stored = self.kvs.stored_tokens(request, num_computed_tokens)
            if stored is None:
                return None, False  # the lookup is out: ask again next schedule
            full = (request.num_prompt_tokens - 1) // self._block_size * self._block_size
            # With a state group the state after the prompt is P's alone: D always pulls.
            if not self._has_state and stored > num_computed_tokens and stored >= full:
                tracked, _ = self._pull_of(request) or (None, None)
                assert tracked is not None
                tracked.store_only = True
                return stored - num_computed_tokens, True
        return count, True

    def _tokens_to_load(
        self, request: Request, pull: tuple[_Tracked, PullParams] | None = None
    ) -> int:
        """Prompt tokens D pulls: all of them, or all but the last with a state group (P's
        state then stops before it, and D computes the last token on top of it); never more
        than the sender says it holds (``remote_num_tokens``: a migrated request's prompt ends
        with the token whose KV the sender never computed)."""
        count = request.num_prompt_tokens
        if self._has_state and count > 1:
            count -= 1
        # Only a migration's: a P's count may lag its prompt (a prefix hit on P) though it
        # holds every block D expects.
        if (
            pull is not None
            and pull[1].transfer_id.startswith(MIGRATION_ID_PREFIX)
            and 0 < pull[1].remote_num_tokens < count
        ):
            count = pull[1].remote_num_tokens
        return count

    def on_new_request(self, request: Request) -> None:
        """P with a state group: drop the prompt's last token (D computes it, see the module
        docstring); once, and only for requests that will be pulled."""
        if not self._has_state:
            return
        tracked = self._offer_of(request)
        if (
            tracked is None
            or tracked.shortened
            or request.num_prompt_tokens <= 1
            or request.prompt_token_ids is None
        ):
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        tracked.shortened = True

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_cache_manager = manager
        self.holds.bind_pool(manager.block_pool)
        if self.kvs is not None:
            self.kvs.bind_kv_cache_manager(manager)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        request_id = request.request_id
        if self._r3_ledger is not None:
            self._meta.r3_fresh_blocks.extend(
                self._r3_ledger.allocated(
                    request_id, blocks.blocks[self._r3_group], num_external_tokens
                )
            )
        if self.kvs is not None and self._pull_of(request) is None:
            load = self.kvs.update_state_after_alloc(request, blocks, num_external_tokens)
            if load is not None:
                self._meta.kvs_loads.append(load)
                if not load.in_step:
                    self._kvs_loading.add(request_id)
        if self._offer_of(request) is not None:
            # Not again after a preemption; never for a request that keeps decoding.
            if not self.holds.is_announced(request_id) and _finishes_with_its_prompt(request):
                self._prefilling[request_id] = request
            return
        pull = self._pull_of(request)
        if pull is None:
            return
        tracked, params = pull
        tracked.dispatched = True
        if self._is_producer:
            # Admitted with its pull: it may be migrated out later under its transfer id.
            self.migrations.track(params.transfer_id, request)
        from_store = 0  # leading new blocks the store fills (each group)
        if self.kvs is not None and num_external_tokens > 0:
            load = self.kvs.update_state_after_alloc(request, blocks, num_external_tokens)
            if load is not None:
                self._meta.kvs_loads.append(load)
                self._kvs_loading.add(request_id)
                from_store = len(load.chains)
        if num_external_tokens <= 0 or tracked.store_only:
            # Everything is already here (local prefix cache) or in the store: P frees now.
            self._meta.to_release.append(
                ReleaseSpec(
                    request_id,
                    params.transfer_id,
                    params.remote_rpc_address,
                    "the decode instance loads the prompt from the store"
                    if tracked.store_only
                    else "decode instance has a full local hit",
                    params.remote_tp_size,
                )
            )
            return
        num_tokens = self._tokens_to_load(request, pull)
        block_ids, first_block = self._destination(blocks, num_tokens, from_store)
        self._meta.to_recv.append(
            RecvSpec(
                request_id=request_id,
                transfer_id=params.transfer_id,
                remote_rpc_address=params.remote_rpc_address,
                block_ids=block_ids,
                first_block=first_block,
                num_tokens=num_tokens,
                remote_tp_size=params.remote_tp_size,
            )
        )
        self._recv_in_flight.add(request_id)

    def _destination(
        self, blocks: KVCacheBlocks, num_tokens: int, from_store: int = 0
    ) -> tuple[list[list[int]], list[int]]:
        """D's blocks per group for the first ``num_tokens`` prompt tokens, and how many leading
        blocks of each group it already holds (hashed: its local prefix-cache hit) or loads from
        the store (``from_store`` blocks after those)."""
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
            cached = len(held) - len(new) + from_store
            # Blocks past the loaded tokens (the one D computes itself) are not P's to write.
            needed = max(0, -(-num_tokens // group.block_size) - cached)
            block_ids.append(new[from_store : from_store + needed])
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
        # The workers' step report, every rank's (vLLM aggregates them): R3's missed captures
        # and the step's in-step KVS loads.
        report = getattr(output, "kv_connector_worker_meta", None)
        r3_ledger = self._r3_ledger
        if isinstance(report, StepReport) and r3_ledger is not None and report.r3_missed_steps:
            r3_ledger.missed(report.r3_missed_steps)
        for request_id in output.finished_recving or ():
            self._recv_in_flight.discard(request_id)
            if request_id in self._kvs_loading:
                self._kvs_loading.discard(request_id)
                if self.kvs is not None:
                    self.kvs.load_finished(request_id)
        if self.kvs is not None and isinstance(report, StepReport):
            for request_id in report.kvs_loaded:
                self.kvs.load_finished(request_id)

    # ------------------------------------------------------------------ both
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...] | list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished ``request``; ``block_ids``: its blocks per KV-cache group. Returns
        (keep every group's blocks until the worker reports the request, params for D), with
        R3 on the reference of its routing record under ``"r3"``. P records nothing for a
        prefill it hands to D: its rows travel to D with the KV, and D's record is the request's
        (a prompt-only record on P would be one more object in the store that nobody reads)."""
        complete = (
            self._r3_ledger.finished(request.request_id) if self._r3_ledger is not None else True
        )
        record = (
            None
            if self._offer_of(request) is not None
            else self._r3_record(request, block_ids, complete)
        )
        delay_free, params = self._finish(request, block_ids)
        if record is not None:
            params = {**(params or {}), "r3": record}
        return delay_free, params

    def _r3_record(
        self,
        request: Request,
        block_ids: tuple[list[int], ...] | list[list[int]],
        complete: bool,
    ) -> dict[str, Any] | None:
        """R3: plan the copy of a normally finished request's rows into the store (in the next
        metadata) and return the record's reference (``complete``: as far as the ledger knows)."""
        rows = self._r3_rows
        if rows is None or request.status.name not in _FINISHED_NORMALLY:
            return None
        num_tokens = int(request.num_computed_tokens)
        group = self._groups[self._r3_group]
        try:
            blocks = r3.blocks_of(block_ids[self._r3_group], num_tokens, group.block_size)
        except ValueError as err:
            log.warning("request %s: no r3 record (%s)", request.request_id, err)
            return None
        key = r3.record_key()
        self._meta.r3_copies.append(R3Copy(request.request_id, key, blocks, num_tokens))
        assert self._config.r3 is not None
        if not complete:
            log.warning(
                "request %s: a forward pass that ran it skipped a routing capture; its r3 "
                "record says incomplete", request.request_id,
            )  # fmt: skip
        return r3.record_params(key, self._config.r3.store, num_tokens, rows, complete=complete)

    def _finish(
        self, request: Request, block_ids: tuple[list[int], ...] | list[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._prefilling.pop(request_id, None)
        self._drain()
        if self.kvs is not None:
            self.kvs.request_finished(request)
        stopped = self.migrations.finished(request)
        if stopped is not None:
            self._tracked.pop(request_id, None)
            return self._hold_for_migration(request, block_ids, stopped)
        if request_id in self._kvs_loading:
            # The worker is copying into its blocks: vLLM frees them when it reports the load.
            self._tracked.pop(request_id, None)
            return True, None
        if request_id in self._recv_in_flight:
            # D request finished (aborted) while P may still be writing into its blocks: keep
            # them until the worker has aborted the pull and reports it in finished_recving.
            self._meta.cancel_recv.append(request_id)
            self._tracked.pop(request_id, None)
            return True, None
        pull = self._pull_of(request)
        tracked = self._offer_of(request)
        self._tracked.pop(request_id, None)
        if pull is not None:
            # Finished before it was ever scheduled: P holds blocks for nobody; release them.
            params = pull[1]
            self._meta.to_release.append(
                ReleaseSpec(
                    request_id,
                    params.transfer_id,
                    params.remote_rpc_address,
                    "decode request ended before pull",
                    params.remote_tp_size,
                )
            )
            return False, None
        if tracked is None:
            return False, None
        transfer_id = tracked.transfer_id
        # By name: vLLM's RequestStatus enum would import vLLM into this pure module.
        held = self._held(block_ids)
        has_kv = request.status.name in _FINISHED_NORMALLY and any(held)
        num_tokens = request.num_computed_tokens
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager comes first"
        blocks = self._kv_cache_manager.get_blocks(request_id).blocks
        # vLLM may forget the request now (delay_free=False): the owner references its blocks
        # while a worker may read them, and gives them back after every rank's SEND_DONE.
        for action in self.holds.finish(request_id, transfer_id, blocks, has_kv=has_kv):
            match action:
                case Offer():
                    self._meta.to_offer.append(OfferSpec(request_id, transfer_id, held, num_tokens))
                case Withdraw():
                    # No KV to offer (aborted, nothing computed): early pulls fail at once.
                    self._meta.cancel_offer.append(transfer_id)
        if not has_kv:
            return False, None
        return False, self._params(request_id, transfer_id, held, num_tokens)

    def _hold_for_migration(
        self, request: Request, block_ids: tuple[list[int], ...] | list[list[int]], stop: Stopped
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request stopped for a live migration (``migration.py``): its blocks are held and
        offered under the migration id, as a finished P request's are, and the asker answered."""
        request_id = request.request_id
        held = self._held(block_ids)
        num_tokens = request.num_computed_tokens
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager comes first"
        blocks = self._kv_cache_manager.get_blocks(request_id).blocks
        for action in self.holds.finish(request_id, stop.migration_id, blocks, has_kv=True):
            if isinstance(action, Offer):
                self._meta.to_offer.append(
                    OfferSpec(request_id, stop.migration_id, held, num_tokens)
                )
        stop.answer(num_tokens, self._tp_size)
        return False, self._params(request_id, stop.migration_id, held, num_tokens)

    def _hold_for_precopy(self, precopy: Precopied) -> None:
        """A pre-copy (``migration.py``): the running request's first full blocks are held and
        offered under the pre-copy id (the hold's own key: the request holds its blocks on);
        the asker answered. The owner's reference keeps them even if vLLM preempts the request."""
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager comes first"
        request = precopy.request
        count = precopy.num_tokens // self._block_size
        blocks = [
            list(g[:count]) for g in self._kv_cache_manager.get_blocks(request.request_id).blocks
        ]
        held = [[b.block_id for b in g] for g in blocks]
        actions = self.holds.finish(precopy.precopy_id, precopy.precopy_id, blocks, has_kv=True)
        if not any(isinstance(a, Offer) for a in actions):
            precopy.refuse("the pre-copy id is held already")
            return
        self._meta.to_offer.append(
            OfferSpec(precopy.precopy_id, precopy.precopy_id, held, precopy.num_tokens)
        )
        precopy.answer(self._tp_size)

    def _params(
        self, request_id: str, transfer_id: str, held: list[list[int]], num_tokens: int
    ) -> dict[str, Any]:
        """P's kv_transfer_params for the proxy and D (``contract.PullParams``)."""
        return encode_params(
            PullParams(
                transfer_id=transfer_id,
                remote_rpc_address=self._config.rpc_address,
                remote_tp_size=self._tp_size,
                remote_request_id=request_id,
                remote_block_ids=held,
                remote_num_tokens=num_tokens,
                lease_s=self._config.lease_s,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HybridConnectorMetadata:
        self._drain()
        for precopied in self.migrations.apply():
            self._hold_for_precopy(precopied)
        if self._prefilling:
            self._announce_prefills(scheduler_output)
        if self.kvs is not None:
            self._meta.kvs_saves.extend(self.kvs.plan_saves(scheduler_output))
        if self._r3_ledger is not None:
            self._r3_step(scheduler_output, self._r3_ledger)
        meta, self._meta = self._meta, HybridConnectorMetadata()
        meta.scheduler_address = self.send_done_address
        return meta

    def _r3_step(self, scheduler_output: SchedulerOutput, ledger: r3.RowLedger) -> None:
        """R3: the running requests' new blocks to reset, and the step's number and tokens for
        the worker's capture check. A resumed request's list is all its blocks (vLLM's worker
        replaces its block table): its new ones were counted when it was allocated."""
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        fresh = self._meta.r3_fresh_blocks
        for request_id, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new is not None and request_id not in resumed:
                fresh.extend(new[self._r3_group])
        self._meta.r3_step = ledger.start_step(scheduler_output.num_scheduled_tokens)
        self._meta.r3_step_tokens = scheduler_output.total_num_scheduled_tokens

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
            tracked = self._offer_of(request)
            assert tracked is not None
            num_tokens = request.num_prompt_tokens
            all_ids = self._held(self._kv_cache_manager.get_block_ids(request_id))
            held = [
                ids if g.family == "state" else ids[: -(-num_tokens // g.block_size)]
                for g, ids in zip(self._groups, all_ids, strict=True)
            ]
            self._meta.final_prefills.append(
                FinalPrefill(request_id, tracked.transfer_id, held, num_tokens)
            )
            # From the step's end a worker may read the blocks: the owner keeps them.
            self.holds.announce(request_id, tracked.transfer_id)


def _asks(raw: object, flag: str) -> bool:
    return isinstance(raw, dict) and raw.get(flag) is True


def _peer(raw: object) -> str:
    """Who the params are from, for the log line: D's come with P's address, P's from the
    proxy (vLLM does not say which client sent the request)."""
    if _asks(raw, "do_remote_prefill"):
        address = raw.get("remote_rpc_address")  # type: ignore[union-attr]
        return f"the proxy (P at {repr(address)[:80]})"
    return "the proxy"
