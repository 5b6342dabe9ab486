"""The KV-event decoder: vLLM's frames decode to what was sent, anything else to KvEventError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_serving.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventError,
    decode_message,
)

hashes = st.one_of(st.binary(min_size=1, max_size=32), st.integers(0, 2**64 - 1))
tokens = st.integers(0, 2**31 - 1)
# The box is shared: generation time varies, and is no property of the decoder.
fuzz = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)


@st.composite
def stored_maps(draw):
    size = draw(st.integers(1, 4))
    blocks = draw(st.integers(1, 3))
    event = {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(hashes, min_size=blocks, max_size=blocks)),
        "parent_block_hash": draw(st.one_of(st.none(), hashes)),
        "token_ids": draw(st.lists(tokens, min_size=size * blocks, max_size=size * blocks)),
        "block_size": size,
        "lora_id": draw(st.one_of(st.none(), st.integers(1, 5))),
        "medium": draw(st.sampled_from([None, "GPU", "CPU", "KVS"])),
        "lora_name": draw(st.one_of(st.none(), st.text(max_size=5))),
        "group_idx": draw(st.one_of(st.none(), st.integers(0, 3))),
    }
    if draw(st.booleans()):
        event["a_field_of_a_newer_vllm"] = 1
    return event


event_maps = st.one_of(
    stored_maps(),
    st.builds(
        lambda h, m: {"type": "BlockRemoved", "block_hashes": h, "medium": m},
        st.lists(hashes, max_size=4),
        st.sampled_from([None, "GPU", "KVS"]),
    ),
    st.just({"type": "AllBlocksCleared"}),
)


def _message(seq: int, payload: object) -> list[bytes]:
    return [b"topic", seq.to_bytes(8, "big"), msgspec.msgpack.encode(payload)]


@fuzz
@given(
    st.integers(0, 2**63), st.lists(event_maps, max_size=6), st.one_of(st.none(), st.integers(0, 7))
)
def test_well_formed_batches_decode_to_their_events(seq, events, rank) -> None:
    batch = decode_message(_message(seq, [12.5, events, rank]))
    assert batch.seq == seq
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == rank
    assert batch.topic == b"topic"
    assert batch.unknown == 0
    assert len(batch.events) == len(events)
    for got, sent in zip(batch.events, events, strict=True):
        assert type(got).__name__ == sent["type"]
        if isinstance(got, BlockStored):
            assert list(got.block_hashes) == sent["block_hashes"]
            assert list(got.token_ids) == sent["token_ids"]
            assert got.parent == sent["parent_block_hash"]
            assert got.group == sent["group_idx"]
            assert got.medium == sent["medium"]
            lora = sent["lora_name"] or (None if sent["lora_id"] is None else str(sent["lora_id"]))
            assert got.lora == lora
        elif isinstance(got, BlockRemoved):
            assert list(got.block_hashes) == sent["block_hashes"]


@fuzz
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_frames_decode_or_raise_kv_event_error(frames) -> None:
    with contextlib.suppress(KvEventError):
        decode_message(frames)


_ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.text(max_size=8),
              st.binary(max_size=8), st.floats(allow_nan=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(
                                ["type", "block_hashes", "token_ids", "block_size", "medium",
                                 "parent_block_hash", "extra_keys"]), inner, max_size=5)),
    max_leaves=12,
)  # fmt: skip


@fuzz
@given(_ANY)
def test_arbitrary_msgpack_payloads_decode_or_raise_kv_event_error(payload) -> None:
    with contextlib.suppress(KvEventError):
        decode_message(_message(1, payload))


@fuzz
@given(st.lists(_ANY, max_size=3))
def test_arbitrary_events_in_a_batch_decode_or_raise(events) -> None:
    with contextlib.suppress(KvEventError):
        decode_message(_message(1, [0.0, events]))


def test_nesting_past_any_limit_is_a_kv_event_error_not_a_recursion_error() -> None:
    deep = msgspec.Raw(b"\x91" * 100_000 + b"\xc0")
    stored = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": [1], "block_size": 1}  # fmt: skip
    for payload in ([0.0, deep], [0.0, [{**stored, "extra_keys": [deep]}]]):
        with pytest.raises(KvEventError):
            decode_message(_message(1, payload))
    # Within msgspec's limit, but deeper than any extra keys vLLM sends.
    nested = msgspec.Raw(b"\x91" * 20 + b"\xc0")
    with pytest.raises(KvEventError, match="extra_keys nest"):
        decode_message(_message(1, [0.0, [{**stored, "extra_keys": [nested]}]]))


def test_the_lora_name_is_taken_out_of_the_extra_keys() -> None:
    stored = {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None,
              "token_ids": [1, 2, 3], "block_size": 1, "lora_id": 4, "lora_name": "ad"}  # fmt: skip
    extra = [["ad"], ["ad", "salt"], None]
    (event,) = decode_message(_message(1, [0.0, [{**stored, "extra_keys": extra}]])).events
    assert event.lora == "ad"
    assert event.extra_keys == (None, ("salt",), None)
    # Maps (no vLLM sends one) become hashable pairs.
    (event,) = decode_message(
        _message(
            1,
            [
                0.0,
                [{**stored, "block_hashes": [1], "token_ids": [1], "extra_keys": [[{"k": [1]}]]}],
            ],
        )
    ).events
    assert event.extra_keys == (((("k", (1,)),),),)


def test_unknown_event_types_are_skipped_and_counted() -> None:
    batch = decode_message(
        _message(3, [0.0, [{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}]])
    )
    assert batch.events == (AllBlocksCleared(),)
    assert batch.unknown == 1


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"", b"\0" * 8], "3 frames"),
        ([b"", b"\0" * 7, b""], "8"),
        ([b"", b"\0" * 8, b"\xc1"], "payload"),
        ([b"", b"\0" * 8, msgspec.msgpack.encode([0.0, [{"type": "BlockStored"}]])], "BlockStored"),
        ([b"", b"\0" * 8, msgspec.msgpack.encode([0.0, [7]])], "tagged"),
        (_message(1, [0.0, [{"type": "BlockRemoved", "block_hashes": [-1.5]}]]), "BlockRemoved"),
        (
            _message(1, [0.0, [{"type": "BlockStored", "block_hashes": [1],
                                "parent_block_hash": None, "token_ids": [-1], "block_size": 1}]]),
            "BlockStored",
        ),
        (
            _message(1, [0.0, [{"type": "BlockStored", "block_hashes": [1],
                                "parent_block_hash": None, "token_ids": [1], "block_size": 1,
                                "extra_keys": [None, None]}]]),
            "extra_keys",
        ),
    ],
)  # fmt: skip
def test_malformed_messages_name_what_is_wrong(frames, why) -> None:
    with pytest.raises(KvEventError, match=why):
        decode_message(frames)


# -- frames made by vLLM's own structs and encoder ----------------------------------------------
@pytest.mark.needs_vllm
def test_frames_from_vllms_own_structs() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    batch = kv_events.KVEventBatch(
        ts=3.25,
        events=[
            kv_events.BlockStored(
                block_hashes=[b"\x01" * 32, 2**64 - 5],
                parent_block_hash=None,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, ("salt",)],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            kv_events.BlockStored(
                block_hashes=[b"\x03" * 32],
                parent_block_hash=2**64 - 5,
                token_ids=[8, 9, 10, 11],
                block_size=4,
                lora_id=2,
                medium="KVS",
                lora_name="adapter",
            ),
            kv_events.BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU", group_idx=0),
            kv_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    # What ZmqEventPublisher sends: topic, 8-byte big-endian sequence, msgpack payload.
    payload = msgspec.msgpack.Encoder().encode(batch)
    got = decode_message([b"kv", (41).to_bytes(8, "big"), payload])
    assert got.seq == 41
    assert got.ts == 3.25
    assert got.data_parallel_rank == 0
    assert got.unknown == 0
    first, second, removed, cleared = got.events
    assert first == BlockStored(
        block_hashes=(b"\x01" * 32, 2**64 - 5),
        parent=None,
        token_ids=tuple(range(8)),
        block_size=4,
        medium="GPU",
        lora=None,
        group=0,
        extra_keys=(None, ("salt",)),
    )
    assert second.parent == 2**64 - 5
    assert second.lora == "adapter"
    assert second.medium == "KVS"
    assert removed == BlockRemoved((b"\x01" * 32,), "GPU", 0)
    assert cleared == AllBlocksCleared()


@st.composite
def vllm_batches(draw):
    """vLLM's own structs, any field values its types allow."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    events = []
    for kind in draw(st.lists(st.sampled_from(["stored", "removed", "cleared"]), max_size=5)):
        if kind == "stored":
            size, blocks = draw(st.integers(1, 4)), draw(st.integers(1, 3))
            lora = draw(st.one_of(st.none(), st.text(min_size=1, max_size=4)))
            per_block = st.one_of(
                st.none(), st.lists(st.one_of(st.text(max_size=4), st.integers(0, 99)), max_size=3)
            )
            extra = draw(
                st.one_of(st.none(), st.lists(per_block, min_size=blocks, max_size=blocks))
            )
            events.append(
                kv_events.BlockStored(
                    block_hashes=draw(st.lists(hashes, min_size=blocks, max_size=blocks)),
                    parent_block_hash=draw(st.one_of(st.none(), hashes)),
                    token_ids=draw(
                        st.lists(tokens, min_size=size * blocks, max_size=size * blocks)
                    ),
                    block_size=size,
                    lora_id=None if lora is None else draw(st.integers(1, 9)),
                    medium=draw(st.sampled_from([None, "GPU", "CPU", "KVS"])),
                    lora_name=lora,
                    extra_keys=None
                    if extra is None
                    else [
                        None if e is None else tuple(([lora] if lora else []) + e) for e in extra
                    ],
                    group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
                    session_id=draw(st.one_of(st.none(), st.text(max_size=4))),
                )
            )
        elif kind == "removed":
            events.append(
                kv_events.BlockRemoved(
                    block_hashes=draw(st.lists(hashes, max_size=4)),
                    medium=draw(st.sampled_from([None, "GPU", "KVS"])),
                    group_idx=draw(st.one_of(st.none(), st.integers(0, 3))),
                )
            )
        else:
            events.append(kv_events.AllBlocksCleared())
    rank = draw(st.one_of(st.none(), st.integers(0, 3)))
    return kv_events.KVEventBatch(
        ts=draw(st.floats(0, 1e10)), events=events, data_parallel_rank=rank
    )


@pytest.mark.needs_vllm
@fuzz
@given(vllm_batches(), st.integers(0, 2**64 - 1))
def test_any_batch_vllm_encodes_decodes_to_its_events(batch, seq) -> None:
    payload = msgspec.msgpack.Encoder().encode(batch)
    got = decode_message([b"", seq.to_bytes(8, "big"), payload])
    assert (got.seq, got.ts, got.data_parallel_rank) == (seq, batch.ts, batch.data_parallel_rank)
    assert len(got.events) == len(batch.events)
    assert got.unknown == 0
    for ours, theirs in zip(got.events, batch.events, strict=True):
        assert type(ours).__name__ == type(theirs).__name__
        if isinstance(ours, BlockStored):
            assert ours.block_hashes == tuple(theirs.block_hashes)
            assert ours.parent == theirs.parent_block_hash
            assert ours.token_ids == tuple(theirs.token_ids)
            assert (ours.block_size, ours.medium, ours.group) == (
                theirs.block_size, theirs.medium, theirs.group_idx
            )  # fmt: skip
            assert ours.lora == (theirs.lora_name or (theirs.lora_id and str(theirs.lora_id)))
            if theirs.extra_keys is None:
                assert ours.extra_keys is None
            else:
                lead = 1 if theirs.lora_name else 0
                assert ours.extra_keys == tuple(
                    None if e is None or len(e) == lead else tuple(e[lead:])
                    for e in theirs.extra_keys
                )
        elif isinstance(ours, BlockRemoved):
            assert ours.block_hashes == tuple(theirs.block_hashes)
            assert (ours.medium, ours.group) == (theirs.medium, theirs.group_idx)
