"""transfer_kv over simple_rpc: D asks P to write a request's KV blocks into D's blocks.

Heads 0x4843xxxx ("HC"); responses set bit 15 of the low half. SEND_DONE keeps the heads the
mission gave it (``0x20181218`` / ``0x81218102``).
"""

from __future__ import annotations

import msgspec
from simple_rpc import Method


class SegmentSpec(msgspec.Struct, frozen=True, array_like=True):
    """One per-block piece of a layer (see ipcblock.Segment)."""

    name: str
    offset: int
    block_stride: int
    nbytes: int


class LayoutSpec(msgspec.Struct, frozen=True):
    """One KV-cache group of one rank, as the peer needs it to compute destination byte ranges.

    ``layer_offsets[l]`` is relative to the base of region ``region_ids[l]`` (a kvt region id of
    the instance that owns the cache).
    """

    layer_names: list[str]
    layer_offsets: list[int]
    region_ids: list[int]
    num_blocks: int
    block_size: int
    segments: list[SegmentSpec]
    # ipcblock's layout kind (``ipcblock.LayoutSpec.kind``): how a block's bytes are arranged.
    kind: str = "custom"
    # What a block of this group is: "attention" (paged K/V), "mla" (paged latent), "state" (a
    # request's linear-attention/SSM state slot: only the final state moves), "sliding_window".
    family: str = "attention"
    # Element type of the cache as vLLM names it ("bfloat16", "fp8_e4m3", ...); "" = unknown.
    dtype: str = ""
    # Tensor parallelism: this rank holds KV heads [head_start, head_start + num_heads) of
    # total_heads. total_heads = 0: every rank holds the same bytes (MLA latent, state slots).
    total_heads: int = 0
    head_start: int = 0
    num_heads: int = 0
    # vLLM's CPU attention kernel for this group ("vec", "vec16", "amx", ...): it decides where
    # each token lies inside a CPU block. "" = not said (GPU kinds; CPU: taken as "vec").
    attn_isa: str = ""


class CacheSpec(msgspec.Struct, frozen=True):
    """Everything one worker (one TP rank) registered: one LayoutSpec per vLLM KV-cache group,
    in vLLM's group order."""

    groups: list[LayoutSpec]
    tp_rank: int = 0
    tp_size: int = 1


class TransferKvRequest(msgspec.Struct, frozen=True):
    """D -> P: "write the KV of transfer ``transfer_id`` into these blocks of mine".

    Per KV-cache group (index ``g`` follows ``layout.groups``): ``block_ids[g]`` are D's
    destination blocks, after the ``first_block[g]`` leading blocks D already holds (its local
    prefix-cache hit in that group, which P skips); an empty list: D needs nothing of that group.
    For a "state" group ``block_ids[g]`` is the one slot that receives the request's final state.
    """

    transfer_id: str
    # D's own request id, for logs on P.
    request_id: str
    # D's kvt data-plane address ("host:port").
    data_address: str
    # What D registered: P checks it against its own before any byte moves.
    layout: CacheSpec
    block_ids: list[list[int]]
    first_block: list[int]
    # Prompt tokens D needs in total (including the ones it already holds).
    num_tokens: int


class TransferKvResponse(msgspec.Struct, frozen=True):
    """P -> D: the send was started (its completion arrives through kvt)."""

    transfer_id: str
    num_blocks: int
    num_records: int
    nbytes: int


class ReleaseRequest(msgspec.Struct, frozen=True):
    """D -> P: D will not pull transfer ``transfer_id`` (aborted, or a full local hit)."""

    transfer_id: str
    request_id: str
    reason: str


class ReleaseResponse(msgspec.Struct, frozen=True):
    transfer_id: str
    released: bool


TRANSFER_KV: Method[TransferKvRequest, TransferKvResponse] = Method(
    "hybrid_connector.transfer_kv",
    request_head=0x48430001,
    response_head=0x48438001,
    request_type=TransferKvRequest,
    response_type=TransferKvResponse,
)

RELEASE: Method[ReleaseRequest, ReleaseResponse] = Method(
    "hybrid_connector.release",
    request_head=0x48430002,
    response_head=0x48438002,
    request_type=ReleaseRequest,
    response_type=ReleaseResponse,
)


class SendDoneRequest(msgspec.Struct, frozen=True):
    """P's worker -> P's scheduler half: "I no longer need request ``request_id``'s blocks".

    Sent once per TP rank for every request whose blocks the scheduler half holds for the worker
    (it let vLLM finish the request at once and took its own reference on the blocks, so vLLM's
    engine core can sleep while D pulls). ``outcome`` says why, for logs: "sent" (kvt DONE),
    "failed", "lease expired", "released", "refused", "shutdown".
    """

    request_id: str
    transfer_id: str
    tp_rank: int
    outcome: str


class SendDoneResponse(msgspec.Struct, frozen=True):
    request_id: str
    # The scheduler half held the request's blocks (False: unknown id, or this rank's report
    # was already counted).
    held: bool


SEND_DONE: Method[SendDoneRequest, SendDoneResponse] = Method(
    "hybrid_connector.send_done",
    request_head=0x20181218,
    response_head=0x81218102,
    request_type=SendDoneRequest,
    response_type=SendDoneResponse,
)
