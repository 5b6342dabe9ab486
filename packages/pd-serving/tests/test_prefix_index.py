"""The prefix index alone: decoded batches in, cached prefix lengths per instance out."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_serving import kv_events
from pd_serving.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from pd_serving.prefix_index import CachedPrefix, PrefixIndex, chain_keys

BS = 4


class Engine:
    """A stand-in instance's prefix cache: its own per-process hash values, vLLM's events."""

    def __init__(self, salt: int, medium: str = "GPU") -> None:
        self.salt = salt
        self.medium = medium
        self.seq = 0

    def hash_of(self, tokens: list[int], blocks: int) -> int:
        return hash((self.salt, tuple(tokens[: blocks * BS]))) & (2**64 - 1)

    def stored(self, tokens: list[int], first: int, last: int, **kw) -> BlockStored:
        """Blocks first..last-1 of ``tokens`` cached (parent: block first-1)."""
        return BlockStored(
            block_hashes=tuple(self.hash_of(tokens, b + 1) for b in range(first, last)),
            parent=self.hash_of(tokens, first) if first else None,
            token_ids=tuple(tokens[first * BS : last * BS]),
            block_size=BS,
            medium=self.medium,
            **kw,
        )

    def removed(self, tokens: list[int], *blocks: int) -> BlockRemoved:
        return BlockRemoved(tuple(self.hash_of(tokens, b + 1) for b in blocks), self.medium)

    def batch(self, *events, seq: int | None = None) -> EventBatch:
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        return EventBatch(seq=seq, ts=0.0, events=tuple(events))


PROMPT = list(range(100, 120))  # 5 blocks


def test_stored_blocks_match_the_prompt_on_that_instance_only() -> None:
    index, a = PrefixIndex(), Engine(1)
    index.attach("a")
    index.attach("b")
    applied = index.apply("a", a.batch(a.stored(PROMPT, 0, 3)))
    assert applied.stored == 3
    assert not applied.gap
    got = index.lookup([*PROMPT, 1, 2], ["a", "b", "unknown"])
    assert got == {"a": CachedPrefix(12, 0), "b": CachedPrefix(), "unknown": CachedPrefix()}
    # A prompt that diverges inside block 2 matches two blocks; one diverging in block 0 none.
    assert index.lookup(PROMPT[:9] + [0] * 11, ["a"])["a"].local_tokens == 8
    assert index.lookup([7, *PROMPT[1:]], ["a"])["a"].local_tokens == 0


def test_blocks_extend_their_parent_across_events_and_instances_agree() -> None:
    index, a, b = PrefixIndex(), Engine(1), Engine(2)
    index.apply("a", a.batch(a.stored(PROMPT, 0, 2)))
    index.apply("a", a.batch(a.stored(PROMPT, 2, 5)))
    index.apply("b", b.batch(b.stored(PROMPT, 0, 1)))
    got = index.lookup(PROMPT, ["a", "b"])
    assert got["a"].local_tokens == 20
    assert got["b"].local_tokens == 4


def test_a_removed_block_cuts_the_prefix_there() -> None:
    index, a = PrefixIndex(), Engine(1)
    index.apply("a", a.batch(a.stored(PROMPT, 0, 5)))
    applied = index.apply("a", a.batch(a.removed(PROMPT, 3)))
    assert applied.removed == 1
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 12
    index.apply("a", a.batch(a.removed(PROMPT, 0)))
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 0


def test_all_blocks_cleared_forgets_the_local_cache_but_not_the_store() -> None:
    index, a, store = PrefixIndex(), Engine(1), Engine(9, medium="KVS")
    index.attach("a", store="node")
    index.apply("a", a.batch(a.stored(PROMPT, 0, 5), store.stored(PROMPT, 0, 2)))
    assert index.lookup(PROMPT, ["a"])["a"] == CachedPrefix(20, 8)
    applied = index.apply("a", a.batch(AllBlocksCleared()))
    assert applied.cleared
    assert index.lookup(PROMPT, ["a"])["a"] == CachedPrefix(0, 8)


def test_a_store_block_counts_for_every_instance_attached_to_that_store() -> None:
    index, store = PrefixIndex(), Engine(9, medium="KVS")
    index.attach("a", store="node")
    index.attach("b", store="node")
    index.attach("c", store="elsewhere")
    index.attach("d")
    index.apply("a", Engine(1).batch(store.stored(PROMPT, 0, 3)))
    got = index.lookup(PROMPT, ["a", "b", "c", "d"])
    assert [got[n].store_tokens for n in "abcd"] == [12, 12, 0, 0]
    assert got["b"].local_tokens == 0
    assert got["b"].tokens == 12
    # The store's removals reach every instance; any one of them applies it, once.
    index.apply("b", Engine(2).batch(store.removed(PROMPT, 1)))
    index.apply("a", Engine(1).batch(store.removed(PROMPT, 1), seq=1))
    assert index.lookup(PROMPT, ["a"])["a"].store_tokens == 4


def test_a_sequence_gap_forgets_the_instance_and_its_store() -> None:
    index, a, store = PrefixIndex(), Engine(1), Engine(9, medium="KVS")
    index.attach("a", store="node")
    index.apply("a", a.batch(a.stored(PROMPT, 0, 5), store.stored(PROMPT, 0, 5), seq=10))
    applied = index.apply("a", a.batch(a.stored([1] * 8, 0, 2), seq=12))
    assert applied.gap
    assert index.lookup(PROMPT, ["a"])["a"] == CachedPrefix(0, 0)
    assert index.lookup([1] * 8, ["a"])["a"].local_tokens == 8  # the batch itself applied
    # The next in order is applied as usual.
    assert not index.apply("a", a.batch(a.stored(PROMPT, 0, 1), seq=13)).gap
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 4


def test_a_restarted_publisher_starts_a_fresh_view() -> None:
    index, a = PrefixIndex(), Engine(1)
    index.attach("a", store="node")
    index.apply(
        "a", a.batch(a.stored(PROMPT, 0, 5), Engine(9, "KVS").stored(PROMPT, 0, 1), seq=500)
    )
    fresh = Engine(3)
    applied = index.apply("a", fresh.batch(fresh.stored([5] * 4, 0, 1), seq=0))
    assert applied.restart
    assert not applied.gap
    assert index.lookup(PROMPT, ["a"])["a"] == CachedPrefix(0, 4)  # the store outlives it
    assert index.lookup([5] * 4, ["a"])["a"].local_tokens == 4


def test_forget_then_any_sequence_is_a_new_baseline() -> None:
    index, a = PrefixIndex(), Engine(1)
    index.apply("a", a.batch(a.stored(PROMPT, 0, 5), seq=3))
    index.forget("a")
    assert not index.holds_any()
    applied = index.apply("a", a.batch(a.stored(PROMPT, 0, 1), seq=90))
    assert not applied.gap
    assert not applied.restart
    assert index.holds_any(["a"])
    assert not index.holds_any(["b"])


def test_an_unknown_parent_is_not_placed() -> None:
    index, a = PrefixIndex(), Engine(1)
    applied = index.apply("a", a.batch(a.stored(PROMPT, 2, 4)))
    assert applied.unplaced == 2
    assert applied.stored == 0
    assert not index.holds_any()


def test_odd_token_counts_and_salted_blocks_never_match() -> None:
    index, a = PrefixIndex(), Engine(1)
    odd = a.stored(PROMPT, 0, 2)
    odd = BlockStored(odd.block_hashes, None, odd.token_ids[:-1], BS, "GPU")
    assert index.apply("a", a.batch(odd)).unplaced == 2
    salted = a.stored(PROMPT, 0, 2, extra_keys=(("salt",), None))
    index.apply("a", a.batch(salted))
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 0
    # Its children are placed (their parent is known) but do not match either.
    index.apply("a", a.batch(a.stored(PROMPT, 2, 3)))
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 0


def test_lora_blocks_match_only_that_adapter() -> None:
    index, a = PrefixIndex(), Engine(1)
    index.apply("a", a.batch(a.stored(PROMPT, 0, 2, lora="x")))
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 0
    assert index.lookup(PROMPT, ["a"], lora="x")["a"].local_tokens == 8


def test_lora_blocks_as_vllm_sends_them_match_that_adapter() -> None:
    kw = {"medium": "GPU", "lora": "x"}
    index = PrefixIndex()
    decoded = kv_events.decode_message(
        [
            b"",
            (0).to_bytes(8, "big"),
            msgspec.msgpack.encode(
                [
                    0.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1, 2],
                            "parent_block_hash": None,
                            "token_ids": PROMPT[:8],
                            "block_size": BS,
                            "lora_id": 1,
                            "lora_name": "x",
                            "medium": "GPU",
                            "extra_keys": [["x"], ["x"]],
                        }
                    ],
                ]
            ),
        ]
    )
    assert decoded.events[0] == BlockStored((1, 2), None, tuple(PROMPT[:8]), BS, **kw,
                                            extra_keys=(None, None))  # fmt: skip
    index.apply("a", decoded)
    assert index.lookup(PROMPT, ["a"], lora="x")["a"].local_tokens == 8
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 0


def test_partial_blocks_are_kept_for_removal_but_never_matched() -> None:
    index, a = PrefixIndex(), Engine(1)
    index.apply("a", a.batch(a.stored(PROMPT, 0, 1)))
    partial = BlockStored((12345,), a.hash_of(PROMPT, 1), tuple(PROMPT[4:6]), 2, "GPU")
    index.apply("a", a.batch(partial))
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 4
    assert index.apply("a", a.batch(BlockRemoved((12345,), "GPU"))).removed == 1


def test_each_view_is_bounded_oldest_out_and_a_restore_refreshes() -> None:
    index, a = PrefixIndex(max_blocks=3), Engine(1)
    index.apply("a", a.batch(a.stored(PROMPT, 0, 3)))
    index.apply("a", a.batch(a.stored(PROMPT, 0, 1)))  # a hit re-reported: block 0 is newest
    other = [9] * 8
    index.apply("a", a.batch(a.stored(other, 0, 1)))  # evicts block 1 (the oldest)
    assert index.describe("a")["blocks"] == 3
    assert index.lookup(PROMPT, ["a"])["a"].local_tokens == 4
    assert index.lookup(other, ["a"])["a"].local_tokens == 4


def test_groups_keep_their_own_block_size() -> None:
    index = PrefixIndex()
    tokens = list(range(16))
    big = BlockStored((1, 2), None, tuple(tokens), 8, "GPU", group=1)
    small = BlockStored((3,), None, tuple(tokens[:4]), 4, "GPU", group=0)
    index.apply("a", EventBatch(0, 0.0, (big, small)))
    assert index.lookup(tokens, ["a"])["a"].local_tokens == 16  # either group's hit counts


# -- the index against a model of the cache, any sequence of events --------------------------
ops = st.lists(
    st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 2), st.integers(0, 4)),
    max_size=30,
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(ops)
def test_any_event_sequence_matches_a_model_of_the_cache(sequence) -> None:
    prompts = [list(range(p * 100, p * 100 + 20)) for p in range(3)]
    index, a = PrefixIndex(), Engine(1)
    held: set[tuple[int, int]] = set()  # (prompt, block)
    for op, p, block in sequence:
        tokens = prompts[p]
        if op == "store":
            # vLLM stores a block only under a cached parent: from the first missing one up.
            first = next(b for b in range(6) if (p, b) not in held)
            if first <= block:
                index.apply("a", a.batch(a.stored(tokens, first, block + 1)))
                held.update((p, b) for b in range(first, block + 1))
        elif op == "remove":
            index.apply("a", a.batch(a.removed(tokens, block)))
            held.discard((p, block))
        else:
            index.apply("a", a.batch(AllBlocksCleared()))
            held.clear()
        for q, prompt in enumerate(prompts):
            expected = next(b for b in range(6) if (q, b) not in held) * BS
            assert index.lookup(prompt, ["a"])["a"].local_tokens == expected


def test_chain_keys_depend_on_every_earlier_token() -> None:
    first = chain_keys(PROMPT, BS)
    assert len(first) == 5
    assert len(chain_keys(PROMPT, BS, limit=2)) == 2
    changed = chain_keys([0, *PROMPT[1:]], BS)
    assert all(x != y for x, y in zip(first, changed, strict=True))
    assert chain_keys(PROMPT, BS, lora="x")[0] != first[0]
