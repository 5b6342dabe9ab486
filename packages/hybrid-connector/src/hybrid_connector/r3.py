"""R3: each request's MoE routing, recorded by the engine and carried with its KV.

Contract (what a reader, e.g. an RL trainer replaying the rollout's routing, relies on):

- A request that finished normally (stop or length) on an instance with
  ``kv_connector_extra_config["r3"]`` on returns ``kv_transfer_params["r3"]``::

      {"version": 1, "key": "r3/<32 hex>", "store": "<refstore master name>",
       "tokens": N, "layers": L, "top_k": K, "dtype": "uint8" | "uint16", "complete": true}

  ``tokens`` = the request's ``num_computed_tokens``: the prompt, then every generated token that
  went through the model (the last sampled token never did). ``layers``: the model's MoE layers,
  in layer order; ``top_k``: experts per token; ``dtype``: the narrowest unsigned type holding
  every expert id (its maximum value is reserved: "no row").
- ``read_record(params, client) -> np.ndarray [tokens, layers, top_k]`` of that dtype: the
  logical expert ids (before any EPLB mapping), in the order the router returned them. ``params``
  is the finished request's ``kv_transfer_params`` (or its ``"r3"`` dict); ``client`` a
  ``refstore.Client`` of the node's master named by ``store``.
- ``complete``: false if the engine knew at the end of the request that some rows are missing
  (a forward pass that ran it skipped a capture: the worker checks every pass, ``RowLedger``).
  The stored record carries the final word: a row never written is "no row" in it. A miss in
  the request's last forward pass (reported after vLLM ended the request) or rows that came
  missing with the KV (a P whose capture missed) show there only. ``read_record`` raises
  ``R3RecordError`` for a record incomplete either way, never returns a partial one.
- The stored object under ``key`` is the rows array alone (``[tokens, layers, top_k]``): a
  ``refstore.Manifest.from_refs(..., key=None)`` over records gathers them directly.

How the rows travel: the worker keeps a routing buffer laid out like the KV cache, one row
``[layers, top_k]`` per token slot of each KV block (an extra "layer" of the attention group,
``ROUTING_LAYER``); each MoE router's capture hook scatters its ``topk_ids`` to the slots of the
step's tokens. A row therefore lives in the KV block of its token and moves exactly as the KV
does: in a PD pull, a KVS save and load, a live migration; a prefix-cache hit keeps it. A block
newly given to a request whose rows the forward passes will write is reset to "no row" first
(``RowLedger``), so a row is this request's or missing, never a previous owner's. When the
request finishes, its rows are gathered from its blocks into one refstore object under ``key``.

Imports numpy only (``refstore`` inside ``read_record``): a trainer reads records without vLLM.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "R3_VERSION",
    "ROUTING_LAYER",
    "R3RecordError",
    "RowGeometry",
    "RowLedger",
    "blocks_of",
    "check_peer",
    "gather_rows",
    "missing_rows",
    "read_record",
    "record_key",
    "record_params",
    "routing_dtype",
    "scatter_rows",
]

R3_VERSION = 1
# The routing buffer's name among the KV cache "layers" of the attention group.
ROUTING_LAYER = "hybrid_connector.r3.routing"
_KEY_PREFIX = "r3/"


class R3RecordError(Exception):
    """A record that cannot be read whole: missing from the store, incomplete, malformed."""


def routing_dtype(num_experts: int) -> np.dtype:
    """The narrowest unsigned dtype holding expert ids ``0..num_experts-1`` with its maximum
    value left over for "no row" (uint16's top half is kept free: torch writes it as int16)."""
    if num_experts < 1:
        raise ValueError(f"a MoE model has at least one expert, got {num_experts}")
    if num_experts < 0xFF:
        return np.dtype(np.uint8)
    if num_experts < 0x7FFF:
        return np.dtype(np.uint16)
    raise ValueError(f"{num_experts} experts: ids do not fit the routing buffer (uint16)")


def no_row(dtype: np.dtype | str) -> int:
    """The value of a row never written (the buffer starts filled with it)."""
    return int(np.iinfo(np.dtype(dtype)).max)


@dataclass(frozen=True)
class RowGeometry:
    """One token's row: ``layers`` MoE layers of ``top_k`` expert ids of ``dtype``."""

    layers: int
    top_k: int
    dtype: str

    @property
    def row_nbytes(self) -> int:
        return self.layers * self.top_k * np.dtype(self.dtype).itemsize


class RowLedger:
    """The scheduler half's R3 bookkeeping: pure, fed the scheduler's events, returning what the
    worker must do. A token's row is written by this instance's forward pass, or it comes with
    its block: a prefix-cache hit keeps it, a PD pull or a KVS load brings it. Hence:

    - a block newly given to a request, whose rows this instance's forward passes will write,
      is reset to "no row" (``allocated``, and the running requests' new blocks the scheduler
      half lists itself): a row whose capture was skipped then reads as missing, never as the
      row of the block's previous request;
    - a step whose forward pass skipped a capture (the worker's ``StepReport``) marks every
      request it ran; such a request's params say ``complete: false`` (``finished``).

    One request::

        looked_up(hit) --allocated(loaded)--> admitted --allocated (after its load)--> admitted
            ^                                    |  ran in steps
            +------------ preempted -------------+--finished--> complete (no step of it missed)

    At admission the first ``hit`` tokens' blocks (vLLM's local prefix-cache hit, block-aligned
    as vLLM gives it to the connector's lookup) are hits and the next ``loaded`` tokens' blocks
    are loaded: those keep what they hold or get (a load writes whole blocks, so they are never
    reset: on a GPU the reset would race the load's copy). Every later block is reset, including
    those vLLM adds when the request is scheduled again after its load (vLLM calls
    ``update_state_after_alloc`` again then, without a lookup first). A block's prefix-cache
    hash cannot tell a hit: vLLM hashes a prompt's full blocks when it allocates them. Should
    vLLM drop a hit after the lookup (a model's prefix replay window), the tokens are recomputed
    and their rows captured; only a capture missed there too would leave the old rows.
    """

    def __init__(self, block_size: int, history: int = 16) -> None:
        self._block_size = block_size
        # Requests looked up and not allocated yet: their prefix-cache hit in tokens.
        self._admitting: dict[str, int] = {}
        # Blocks of each admitted request whose rows are accounted for (to the request's end).
        self._seen: dict[str, int] = {}
        # The requests each recent step ran (reports may come a few steps late: async scheduling).
        self._steps: OrderedDict[int, Collection[str]] = OrderedDict()
        self._history = history
        self._step = 0
        self._missed: set[str] = set()

    def looked_up(self, request_id: str, hit_tokens: int) -> None:
        """vLLM looks ``request_id``'s prefix up (``get_num_new_matched_tokens``): it is being
        admitted, anew or after a preemption (which freed its blocks), with ``hit_tokens`` of
        its prompt in vLLM's own prefix cache."""
        self._seen.pop(request_id, None)
        self._admitting[request_id] = max(hit_tokens, 0)

    def allocated(self, request_id: str, blocks: Sequence[Any], loaded_tokens: int) -> list[int]:
        """vLLM allocated ``request_id``'s blocks of the routing group (``blocks``: all of them,
        from token 0; each with ``block_id`` and ``is_null``), ``loaded_tokens`` to be loaded
        after its prefix hit. Returns the blocks to reset."""
        hit = self._admitting.pop(request_id, None)
        if hit is not None:  # admitted now
            kept = hit // self._block_size + math.ceil(max(loaded_tokens, 0) / self._block_size)
        else:  # scheduled again after its load; or never looked up: reset all it holds
            kept = self._seen.get(request_id, 0)
        self._seen[request_id] = max(kept, len(blocks))
        return [b.block_id for b in blocks[kept:] if not b.is_null]

    def start_step(self, scheduled: Collection[str]) -> int:
        """A step runs the requests ``scheduled`` (kept by reference): its number."""
        self._step += 1
        self._steps[self._step] = scheduled
        while len(self._steps) > self._history:
            self._steps.popitem(last=False)
        return self._step

    def missed(self, steps: Iterable[int]) -> None:
        """The worker's report: these steps' forward passes skipped a capture."""
        for step in steps:
            self._missed.update(r for r in self._steps.get(step, ()) if r in self._seen)

    def finished(self, request_id: str) -> bool:
        """``request_id`` ended: whether no step that ran it is known to have missed a row."""
        self._seen.pop(request_id, None)
        self._admitting.pop(request_id, None)
        if request_id in self._missed:
            self._missed.discard(request_id)
            return False
        return True

    @property
    def tracked(self) -> int:
        """Requests on the ledger (tests: back to 0 when the engine is idle)."""
        return len(self._seen) + len(self._admitting) + len(self._missed)


def record_key() -> str:
    """A new record's key in the store (unique per request and instance)."""
    return f"{_KEY_PREFIX}{uuid.uuid4().hex}"


def blocks_of(block_ids: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """The blocks holding tokens ``0..num_tokens-1`` of a request whose blocks are
    ``block_ids`` (from token 0)."""
    needed = math.ceil(num_tokens / block_size)
    if needed > len(block_ids):
        raise ValueError(
            f"{num_tokens} tokens need {needed} blocks, the request holds {len(block_ids)}"
        )
    return list(block_ids[:needed])


def scatter_rows(blocks: np.ndarray, slots: np.ndarray, layer: int, topk_ids: np.ndarray) -> None:
    """One MoE layer's routing of one forward pass into the buffer ``blocks`` ``[num_blocks,
    block_size, layers, top_k]``: row ``i`` of ``topk_ids`` to slot ``slots[i]`` (``block *
    block_size + offset``, vLLM's slot mapping; negative: a padding row, skipped)."""
    block_size = blocks.shape[1]
    n = min(len(slots), len(topk_ids))
    slots = np.asarray(slots[:n], dtype=np.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks[slots // block_size, slots % block_size, layer] = np.asarray(topk_ids[:n])[keep]


def gather_rows(blocks: np.ndarray, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
    """A request's rows ``[num_tokens, layers, top_k]`` (a copy) from its blocks (from token 0)."""
    block_size = blocks.shape[1]
    ids = np.asarray(blocks_of(block_ids, num_tokens, block_size), dtype=np.int64)
    return blocks[ids].reshape(-1, *blocks.shape[2:])[:num_tokens].copy()


def missing_rows(rows: np.ndarray) -> int:
    """How many token rows of ``rows`` were never written (any entry "no row")."""
    if rows.size == 0:
        return 0
    flat = rows.reshape(rows.shape[0], -1)
    return int(np.count_nonzero((flat == no_row(rows.dtype)).any(axis=1)))


def record_params(
    key: str, store: str, num_tokens: int, geometry: RowGeometry, *, complete: bool = True
) -> dict[str, Any]:
    """``kv_transfer_params["r3"]`` of a finished request (plain JSON types)."""
    return {
        "version": R3_VERSION,
        "key": key,
        "store": store,
        "tokens": int(num_tokens),
        "layers": int(geometry.layers),
        "top_k": int(geometry.top_k),
        "dtype": str(geometry.dtype),
        "complete": bool(complete),
    }


def stored_object(rows: np.ndarray) -> np.ndarray:
    """What the worker puts under the record's key: the rows ``[tokens, layers, top_k]`` alone
    (a row never written says so itself: "no row"); readers take it as a manifest's rows with
    ``key=None``."""
    return np.ascontiguousarray(rows)


def _reference(params: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = params.get("r3", params)
    if not isinstance(ref, Mapping) or not str(ref.get("key", "")).startswith(_KEY_PREFIX):
        raise R3RecordError("no r3 record in these kv_transfer_params")
    if int(ref.get("version", 1)) > R3_VERSION:
        raise R3RecordError(f"r3 record version {ref['version']} is newer than {R3_VERSION}")
    return ref


def _wait_for(client: Any, key: bytes, timeout_s: float) -> list[Any]:
    """The record's refs once its key is bound (the worker stores it after the request's end,
    at the engine's next step), waiting on the master's key events up to ``timeout_s``."""
    refs = client.lookup([key], hold_s=5.0)
    if refs or timeout_s <= 0:
        return refs
    subscription = client.subscribe_keys()
    try:
        refs = client.lookup([key], hold_s=5.0)  # stored between the first look and subscribing
        deadline = time.monotonic() + timeout_s
        while not refs:
            left = deadline - time.monotonic()
            if left <= 0 or not subscription.wait(left):
                break
            subscription.take()  # some keys were bound (or events lost): look again
            refs = client.lookup([key], hold_s=5.0)
            if not subscription.alive:
                break
        return refs
    finally:
        subscription.close()


def read_record(params: Mapping[str, Any], client: Any, *, timeout_s: float = 10.0) -> np.ndarray:
    """The request's routing ``[tokens, layers, top_k]`` (a copy), from the store ``client``
    is connected to (``params["r3"]["store"]``); waits up to ``timeout_s`` for the record to be
    stored. Raises ``R3RecordError`` when it is gone, incomplete or not what ``params`` say."""
    ref = _reference(params)
    key = str(ref["key"]).encode()
    if not ref.get("complete", True):
        raise R3RecordError(f"r3 record {ref['key']} is incomplete (the engine said so)")
    refs = _wait_for(client, key, timeout_s)
    if not refs:
        raise R3RecordError(f"r3 record {ref['key']} is not in the store (not yet, or evicted)")
    try:
        rows = np.array(client.get(refs[0]))  # a copy: the view dies with the object
    finally:
        client.unhold(refs)
    shape = (int(ref["tokens"]), int(ref["layers"]), int(ref["top_k"]))
    if rows.shape != shape or rows.dtype != np.dtype(ref["dtype"]):
        raise R3RecordError(
            f"r3 record {ref['key']}: stored {rows.dtype}{list(rows.shape)}, "
            f"expected {ref['dtype']}{list(shape)}"
        )
    missing = missing_rows(rows)
    if missing:
        raise R3RecordError(f"r3 record {ref['key']}: {missing} of {shape[0]} token rows missing")
    return rows


def check_peer(mine: Any, theirs: Any) -> None:
    """P, before a send: the routing layer moves byte for byte, so a group holding it goes only
    to an equal block layout (``protocol.LayoutSpec``s of the group on both sides); raises
    ``PeerError`` (the pull fails, D recomputes and records its own rows). A peer without the
    layer is refused by the layer names already."""
    if ROUTING_LAYER not in mine.layer_names or ROUTING_LAYER not in theirs.layer_names:
        return
    same = (
        mine.block_size == theirs.block_size
        and mine.segments == theirs.segments
        and (mine.head_start, mine.num_heads, mine.total_heads)
        == (theirs.head_start, theirs.num_heads, theirs.total_heads)
        and mine.attn_isa == theirs.attn_isa
    )
    if not same:
        from hybrid_connector.errors import PeerError

        raise PeerError(
            "r3: routing rows move only between equal KV block layouts (block size "
            f"{mine.block_size} vs {theirs.block_size}, KV heads, CPU attention kernel)"
        )
