"""vLLM's KV-cache events off the wire: a sans-I/O decoder, bytes in, typed events out.

A vLLM instance started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT"}'`` publishes, after each engine step that changed
its prefix cache, one zmq multipart message of three frames (``vllm.distributed.kv_events.
ZmqEventPublisher``)::

    frame 0  topic            bytes (the configured topic, "" by default)
    frame 1  sequence number  8 bytes, big endian, 0, 1, 2, ... per publisher process
    frame 2  payload          msgpack of KVEventBatch, an array: [ts, events, data_parallel_rank]

    event (a msgpack map, tagged by "type"):
      {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
       "token_ids": [int, ...], "block_size": int, "lora_id": int | nil, "medium": str | nil,
       "lora_name": str | nil, "extra_keys": [.. | nil, ...] | nil, "group_idx": int | nil, ...}
      {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": str | nil, "group_idx": ...}
      {"type": "AllBlocksCleared"}
    h: the engine's block hash, bytes or int; a value of that process only (its hash seed),
       never compared across instances.

``decode_message(frames)`` returns an :class:`EventBatch` or raises :class:`KvEventError`
(what is wrong, never a msgspec, struct or recursion error). Fields a newer vLLM adds are
ignored; an event of an unknown type is skipped and counted (``EventBatch.unknown``), a known
one that is malformed fails the whole message (its sender's view can no longer be trusted).
Nothing here imports vLLM or zmq: the I/O shell (``kv_feed``) hands the frames in.

Extra keys: vLLM lists, per block, what else went into its hash besides the tokens: the LoRA
name first (when the request has one), then multimodal ``(identifier, offset)`` pairs, the
cache salt, prompt-embedding digests. The LoRA name is taken out (``BlockStored.lora`` carries
it), so a LoRA block without anything else has no extra keys. Entries nest at most
``MAX_EXTRA_DEPTH`` deep (vLLM's nest two).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

BlockHash = bytes | int
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
SEQ_BYTES = 8
# The medium our connector's shared store (KVS) reports: a block every instance attached to the
# same store can load (hybrid_connector.kvs.MEDIUM).
MEDIUM_STORE = "KVS"
MAX_EXTRA_DEPTH = 4


class KvEventError(ValueError):
    """A message that is not a vLLM KV-event batch (named in the message)."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks ``block_hashes`` (in order, each ``block_size`` tokens of ``token_ids``) joined
    the cache; the first one's parent is ``parent`` (None: it starts the prompt)."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora: str | None = None  # lora_name, else str(lora_id), else None
    group: int | None = None
    # Per block, what else its hash covers (LoRA name taken out); a non-None entry salts it.
    extra_keys: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None
    topic: bytes = b""
    unknown: int = 0  # events of a type this decoder does not know, skipped


# -- the wire structs (vLLM's layout; unknown fields are ignored by msgspec) -----------------
class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[TokenId]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[bytes | int]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct):
    type: str


_BATCH = msgspec.msgpack.Decoder(_Batch)
_EVENT = msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared)
_TAG = msgspec.msgpack.Decoder(_Tagged)
_KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _event(raw: msgspec.Raw) -> KvEvent | None:
    try:
        event = _EVENT.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        try:
            tag = _TAG.decode(raw).type
        except (msgspec.DecodeError, RecursionError):
            raise KvEventError(f"an event is not a tagged map: {exc}") from None
        if tag not in _KNOWN:
            return None
        raise KvEventError(f"a {tag} event is malformed: {exc}") from None
    if isinstance(event, _Stored):
        extra = event.extra_keys
        if extra is not None and len(extra) != len(event.block_hashes):
            raise KvEventError(
                f"a BlockStored event has {len(extra)} extra_keys for "
                f"{len(event.block_hashes)} blocks"
            )
        lora = event.lora_name or (None if event.lora_id is None else str(event.lora_id))
        if extra is not None:
            extra = [_without_lora(_frozen(e, MAX_EXTRA_DEPTH), event.lora_name) for e in extra]
        return BlockStored(
            block_hashes=tuple(event.block_hashes),
            parent=event.parent_block_hash,
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            medium=event.medium,
            lora=lora,
            group=event.group_idx,
            extra_keys=None if extra is None else tuple(extra),
        )
    if isinstance(event, _Removed):
        return BlockRemoved(tuple(event.block_hashes), event.medium, event.group_idx)
    return AllBlocksCleared()


def _frozen(value: Any, depth: int) -> Any:
    """Lists as tuples; maps as tuples of (key, value) pairs (hashable, encodable)."""
    if isinstance(value, list | tuple | dict):
        if depth <= 0:
            raise KvEventError(f"a BlockStored event's extra_keys nest over {MAX_EXTRA_DEPTH} deep")
        if isinstance(value, dict):
            return tuple((_frozen(k, depth - 1), _frozen(v, depth - 1)) for k, v in value.items())
        return tuple(_frozen(v, depth - 1) for v in value)
    return value


def _without_lora(keys: Any, lora_name: str | None) -> Any:
    """A block's extra keys less the LoRA name vLLM puts first; None when nothing is left."""
    if lora_name and isinstance(keys, tuple) and keys and keys[0] == lora_name:
        keys = keys[1:]
    if keys == ():
        return None
    return keys


def decode_sequence(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise KvEventError(f"the sequence frame has {len(frame)} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def decode_payload(payload: bytes, seq: int, topic: bytes = b"") -> EventBatch:
    try:
        batch = _BATCH.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise KvEventError(f"the payload is not a KV-event batch: {exc}") from None
    events: list[KvEvent] = []
    unknown = 0
    for raw in batch.events:
        event = _event(raw)
        if event is None:
            unknown += 1
        else:
            events.append(event)
    return EventBatch(seq, batch.ts, tuple(events), batch.data_parallel_rank, topic, unknown)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """One published message (topic, sequence number, payload) -> its batch."""
    if len(frames) != 3:
        raise KvEventError(f"a KV-event message has 3 frames, this one {len(frames)}")
    topic, seq, payload = (bytes(f) for f in frames)
    return decode_payload(payload, decode_sequence(seq), topic)
