"""What the scheduler half tells the worker half each step, and what the worker reports back.

The only channels between the halves (they may be different processes): plain picklable
dataclasses, built by ``build_connector_meta`` and bound on the worker before the step runs, and
the worker's ``TransferResults``. Plain classes, no vLLM import: ``connector.py`` (the one module
that imports vLLM) registers ``HybridConnectorMetadata`` as a vLLM ``KVConnectorMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class OfferSpec:
    """P: request ``request_id`` finished (it was not announced in ``final_prefills``); its
    blocks are offered for transfer ``transfer_id``: serve D's pulls, then give them back
    (SEND_DONE) once done with them."""

    request_id: str
    transfer_id: str
    # Per KV-cache group (vLLM's order): every block of the request from token 0; for a "state"
    # group only the slot that holds the request's final state.
    block_ids: list[list[int]]
    num_tokens: int


@dataclass(frozen=True)
class FinalPrefill:
    """P: this step runs the final prefill of ``request_id`` (its forward pass completes the
    prompt, and the request finishes in the step: ``max_tokens=1``). Rapid transfer_kv: a pull
    for ``transfer_id`` may send each layer as soon as the pass has written it; at the step's
    end the worker offers the request (no OfferSpec follows)."""

    request_id: str
    transfer_id: str
    block_ids: list[list[int]]  # per group, as in OfferSpec
    num_tokens: int


@dataclass(frozen=True)
class RecvSpec:
    """D: pull transfer ``transfer_id`` from ``remote_rpc_address`` into ``block_ids``."""

    request_id: str
    transfer_id: str
    remote_rpc_address: str
    # Per KV-cache group: D's new blocks after its first_block[g] cached ones (a "state" group:
    # the slot that receives the final state).
    block_ids: list[list[int]]
    first_block: list[int]
    num_tokens: int
    # P's tensor-parallel size: ``remote_rpc_address`` is its rank 0, rank p listens at
    # ``config.rank_address(remote_rpc_address, p)``.
    remote_tp_size: int = 1


@dataclass(frozen=True)
class ReleaseSpec:
    """D: tell P to release transfer ``transfer_id`` without sending (nothing to pull)."""

    request_id: str
    transfer_id: str
    remote_rpc_address: str
    reason: str
    remote_tp_size: int = 1  # P's TP size: every P rank holds the request's blocks


NO_BLOCK = -1  # KvsLoad / KvsSave: this group has no object for this block


@dataclass(frozen=True)
class KvsLoad:
    """KVS: copy blocks the store holds into ``block_ids`` (per group, in block order), then
    report the request like a pull (``TransferResults``); ``in_step``: copy them before this
    step's forward pass, which computes the rest of the request (``StepReport``)."""

    request_id: str
    # Per group, per block: the destination block, or NO_BLOCK where the group loads nothing
    # for that block (a state group loads only the state at the last block's end).
    block_ids: list[list[int]]
    chains: list[bytes]  # each block's chain hash (its objects' keys begin with it)
    # Per block: the store's (ref, index) of each object it loads, in
    # ``kvs_keys.block_objects`` order (group by group, rank by rank; a rank-shared group has
    # one), groups whose block is NO_BLOCK left out.
    sources: list[list[tuple[object, int]]]
    # Not empty: the load could not be planned; the worker reports it failed (vLLM recomputes).
    error: str = ""
    in_step: bool = False


@dataclass(frozen=True)
class StepReport:
    """A worker's report of a step, back to the scheduler half (vLLM's connector worker
    metadata, after the step's forward pass); ``connector.py`` registers it as a vLLM
    ``KVConnectorWorkerMetadata`` and vLLM merges every rank's (``aggregate``).

    ``kvs_loaded``: the requests whose in-step KVS load ran (done or failed; a failed one's
    blocks are in vLLM's ``invalid_block_ids``). ``r3_missed_steps``: R3 steps whose forward
    pass left some MoE layer's routing of some token uncaptured; the scheduler marks the
    requests of those steps incomplete."""

    kvs_loaded: tuple[str, ...] = ()
    r3_missed_steps: tuple[int, ...] = ()

    def aggregate(self, other: StepReport) -> StepReport:
        return StepReport(
            self.kvs_loaded + other.kvs_loaded,
            tuple(sorted({*self.r3_missed_steps, *other.r3_missed_steps})),
        )


@dataclass(frozen=True)
class KvsSave:
    """KVS: after this step's forward pass, store ``block_ids`` (per group, in block order;
    each block's chain hash in ``chains``; NO_BLOCK: nothing of that group for that block),
    then report ``save_id`` done."""

    save_id: int
    block_ids: list[list[int]]
    chains: list[bytes]


@dataclass(frozen=True)
class R3Copy:
    """R3: request ``request_id`` finished; copy its routing rows (tokens ``0..num_tokens-1``,
    in ``block_ids`` of the attention group, from token 0) into the store under ``key``. Bound
    before the step's forward pass, which is the first that may write into blocks vLLM freed
    when the request finished: the copy needs no hold on them."""

    request_id: str
    key: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class HybridConnectorMetadata:
    # P: finished requests whose blocks are offered (requests not in final_prefills).
    to_offer: list[OfferSpec] = field(default_factory=list)
    to_recv: list[RecvSpec] = field(default_factory=list)
    # D: requests finished (aborted) while their pull was in flight: abort the pull.
    cancel_recv: list[str] = field(default_factory=list)
    # P: transfer ids whose request ended without KV to offer (aborted): fail early pulls.
    cancel_offer: list[str] = field(default_factory=list)
    to_release: list[ReleaseSpec] = field(default_factory=list)
    final_prefills: list[FinalPrefill] = field(default_factory=list)
    kvs_loads: list[KvsLoad] = field(default_factory=list)
    kvs_saves: list[KvsSave] = field(default_factory=list)
    r3_copies: list[R3Copy] = field(default_factory=list)
    # R3: blocks of the routing group newly given to a request whose rows this instance's
    # forward passes will write (not a prefix hit, not a load): "no row" again before the step's
    # forward pass, so a row never written is never the previous owner's.
    r3_fresh_blocks: list[int] = field(default_factory=list)
    # R3: this step's number and how many tokens its forward pass computes (0: none), for the
    # worker's check that every MoE layer captured every token (``StepReport.r3_missed_steps``).
    r3_step: int = 0
    r3_step_tokens: int = 0
    # P: where the scheduler half (the owner of P's blocks) takes SEND_DONE ("host:port"). Set
    # in every metadata, read by the worker.
    scheduler_address: str = ""

    def is_empty(self) -> bool:
        return not (self.moves_blocks() or self.r3_fresh_blocks)

    def moves_blocks(self) -> bool:
        """Work beside the forward pass and R3's resets that reads, writes or gives up
        blocks (R3 writes its kept rows before it)."""
        return bool(
            self.to_offer
            or self.to_recv
            or self.cancel_recv
            or self.cancel_offer
            or self.to_release
            or self.final_prefills
            or self.kvs_loads
            or self.kvs_saves
            or self.r3_copies
        )


class TransferResults(NamedTuple):
    """Worker -> scheduler, every step: D's request ids whose pull ended since the last step.

    A failed pull is in both ``finished_recving`` and ``failed_recving`` (vLLM 0.32's
    request-level failure report: the scheduler releases the request and recomputes it). P's
    requests are never here (vLLM's ``finished_sending`` stays empty): their blocks go back to
    the scheduler half's owner by SEND_DONE (``holds.py``).
    """

    finished_recving: set[str]
    failed_recving: set[str]
