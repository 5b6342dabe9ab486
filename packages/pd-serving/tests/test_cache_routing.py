"""Cache-aware routing without sockets: a fake feed applies KV-event batches to the prefix
index the Router asks; load, health and the bounds decide with it."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from pd_serving.health import InstanceLoad
from pd_serving.kv_events import AllBlocksCleared, BlockStored, EventBatch
from pd_serving.prefix_index import PrefixIndex
from pd_serving.routing import Backend, RequestKey, Router, RoutingPolicy, request_key

BS = 16
SYSTEM = list(range(1000, 1000 + 8 * BS))  # 8 blocks
NO_PREFIX = RoutingPolicy(prefix_chars=0)


def _backends(role: str, n: int, store: str | None = None) -> list[Backend]:
    return [
        Backend(f"http://{role}{i}", name=f"{role}{i}", kv_events=f"tcp://{role}{i}:5557",
                kv_store=store)
        for i in range(n)
    ]  # fmt: skip


class FakeFeed:
    """What kv_feed does with each instance's stream: numbered batches into the index."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.seq: Counter[str] = Counter()
        self.salt = 0

    def publish(self, instance: str, *events) -> None:
        self.index.apply(instance, EventBatch(self.seq[instance], 0.0, tuple(events)))
        self.seq[instance] += 1

    def stored(self, instance: str, tokens: list[int], medium: str = "GPU") -> None:
        """``instance`` cached (medium "KVS": stored in its store) the full blocks of tokens."""
        self.salt += 1
        blocks = len(tokens) // BS
        hashes = tuple(self.salt * 10_000 + b for b in range(blocks))
        self.publish(
            instance,
            BlockStored(hashes, None, tuple(tokens[: blocks * BS]), BS, medium=medium, group=0),
        )


def _router(p: int, d: int, policy: RoutingPolicy = NO_PREFIX, store: str | None = None):
    index = PrefixIndex()
    prefill, decode = _backends("p", p, store), _backends("d", d, store)
    return Router(prefill, decode, policy, index=index), FakeFeed(index), prefill, decode


def _key(tokens: list[int], **kw) -> RequestKey:
    return RequestKey(prompt_token_ids=tuple(tokens), **kw)


def test_without_events_routing_is_what_it_was() -> None:
    router, _feed, _, _ = _router(0, 2)
    picks = [router.route(_key(SYSTEM)) for _ in range(4)]
    assert Counter(r.decode.key for r in picks) == {"d0": 2, "d1": 2}  # round robin
    assert {r.decode_cache for r in picks} == {"index_empty"}
    plain = Router([], _backends("d", 2))  # no index at all: nothing asked, nothing reported
    assert plain.route(_key(SYSTEM)).decode_cache is None


def test_the_instance_holding_the_longest_prefix_gets_the_request() -> None:
    router, feed, _, d = _router(0, 3)
    feed.stored("d1", SYSTEM[: 4 * BS])
    feed.stored("d2", SYSTEM)
    route = router.route(_key([*SYSTEM, 1, 2, 3]))
    assert route.decode is d[2]
    assert route.decode_cache == "cached_prefix"
    assert router.route(_key(SYSTEM[: 5 * BS] + [7] * 40)).decode is d[2]
    # A prompt nobody holds: the usual routing, by load.
    d[0].inflight, d[1].inflight, d[2].inflight = 1, 0, 1
    other = router.route(_key([5] * 100))
    assert other.decode is d[1]
    assert other.decode_cache == "no_match"


def test_ties_go_by_load_and_a_busy_holder_gives_way_to_the_hot_prefix_bound() -> None:
    policy = RoutingPolicy(prefix_chars=0, cache_load_tokens=32, prefix_overload=8)
    router, feed, _, d = _router(0, 2, policy)
    feed.stored("d0", SYSTEM)  # 128 tokens
    feed.stored("d1", SYSTEM)
    d[0].inflight = 1
    assert router.route(_key(SYSTEM)).decode is d[1]  # equal prefixes: the less loaded
    feed.stored("d0", [*SYSTEM, *range(64)])  # d0 now holds 64 tokens more
    d[0].inflight = 1
    route = router.route(_key([*SYSTEM, *range(64), 9]))
    assert route.decode is d[0]  # one pending (32 tokens' worth) is less than 64 tokens
    d[0].inflight = 3  # three pending outweigh 96 tokens: the other one, which has the system
    route = router.route(_key([*SYSTEM, *range(64), 9]))
    assert route.decode is d[1]
    assert route.decode_cache == "balanced"


def test_prefix_overload_is_a_hard_bound() -> None:
    policy = RoutingPolicy(prefix_chars=0, prefix_overload=2, cache_load_tokens=0)
    router, feed, _, d = _router(0, 2, policy)
    feed.stored("d0", SYSTEM)
    d[0].inflight = 2
    assert router.route(_key(SYSTEM)).decode is d[0]
    d[0].inflight = 3
    route = router.route(_key(SYSTEM))
    assert route.decode is d[1]
    assert route.decode_cache == "overloaded"


def test_a_shared_store_counts_for_its_instances_and_local_counts_over_it() -> None:
    index = PrefixIndex()
    d = [*_backends("d", 2, store="node-a"), *_backends("x", 1, store="node-b")]
    policy = RoutingPolicy(prefix_chars=0, cache_load_tokens=16)
    router, feed = Router([], d, policy, index=index), FakeFeed(index)
    feed.stored("d0", SYSTEM, medium="KVS")  # d0 saved it to node-a's store
    d[0].inflight = 1
    route = router.route(_key(SYSTEM))
    assert route.decode is d[1]  # both can load it; d1 is idle; x0's store lacks it
    assert route.decode_cache == "cached_prefix"
    feed.stored("d0", SYSTEM[: 6 * BS])  # and holds 6 of its 8 blocks itself
    d[0].inflight = 0
    # d0: 96 local + 0.9 * 32 stored; d1: 0.9 * 128 stored.
    assert router.route(_key(SYSTEM)).decode is d[0]
    d[0].inflight = 1  # 124.8 - 16 for a pending request: less than d1's 115.2
    assert router.route(_key(SYSTEM)).decode is d[1]


def test_prefill_goes_where_the_prefix_is_cached_decode_too() -> None:
    router, feed, p, d = _router(3, 2, RoutingPolicy())  # prefix affinity on
    prompt = [*SYSTEM, 1, 2]
    affine = router.route(_key(prompt)).prefill
    assert affine is not None
    elsewhere = next(b for b in p if b is not affine)
    feed.stored(elsewhere.key, SYSTEM)
    feed.stored("d1", SYSTEM[: 2 * BS])
    route = router.route(_key(prompt))
    assert route.prefill is elsewhere
    assert route.prefill_cache == "cached_prefix"
    assert route.decode is d[1]
    assert route.decode_cache == "cached_prefix"
    # Nothing cached for this one: P by affinity again, the reason says why.
    fresh = router.route(_key([3] * 200))
    assert fresh.prefill_cache == "no_match"
    assert router.pick_prefill(_key(prompt)) is elsewhere


def test_forgotten_cleared_or_open_instances_fall_back() -> None:
    router, feed, _, d = _router(0, 2, RoutingPolicy(prefix_chars=0, breaker_failures=1))
    feed.stored("d0", SYSTEM)
    d[1].inflight = 1
    assert router.route(_key(SYSTEM), now=0).decode is d[0]
    feed.publish("d0", AllBlocksCleared())  # its cache was reset
    d[1].inflight, d[0].inflight = 0, 1
    route = router.route(_key(SYSTEM), now=0)
    assert route.decode is d[1]
    assert route.decode_cache == "index_empty"
    feed.stored("d0", SYSTEM)
    router.record_failure(d[0], 0, "refused")  # its breaker opens: it may come back empty
    assert not router.index.holds_any(["d0"])
    router.record_success(d[0], 10)
    d[0].inflight = 0
    d[1].inflight = 1
    assert router.route(_key(SYSTEM), now=11).decode is d[0]  # by load alone now


def test_requests_the_index_cannot_answer() -> None:
    router, feed, _, _ = _router(0, 2)
    feed.stored("d0", SYSTEM)
    text = router.route(RequestKey(prompt_text="hello " * 100))
    assert text.decode_cache == "no_tokens"  # text the proxy did not tokenize
    tokenized = RequestKey(prompt_text="...", engine_token_ids=tuple(SYSTEM))
    assert router.route(tokenized).decode_cache == "cached_prefix"
    salted = request_key({"prompt": SYSTEM, "cache_salt": "tenant-1"})
    assert router.route(salted).decode_cache == "no_tokens"
    lora = router.route(_key(SYSTEM, lora="adapter"))  # d0's blocks are the base model's
    assert lora.decode_cache == "no_match"
    off = Router([], _backends("d", 2), RoutingPolicy(cache_aware=False), index=router.index)
    assert off.route(_key(SYSTEM)).decode_cache is None


def test_the_prefix_cached_bypass_uses_the_exact_tail_from_the_index() -> None:
    router, feed, p, d = _router(1, 2, RoutingPolicy(prefix_chars=0, bypass_below_tokens=32))
    feed.stored("d1", SYSTEM)
    route = router.route(_key([*SYSTEM, *range(20)]))  # 20 uncached tokens on d1
    assert route.prefill is None
    assert route.bypass_reason == "prefix_cached"
    assert route.decode is d[1]
    route = router.route(_key([*SYSTEM, *range(40)]))  # 40: worth a P, still on d1
    assert route.prefill is p[0]
    assert route.decode is d[1]


@given(
    st.lists(st.integers(0, 8), min_size=3, max_size=3),
    st.lists(st.integers(0, 6), min_size=3, max_size=3),
    st.sampled_from([0.0, 16.0, 256.0]),
)
def test_no_instance_with_a_better_value_is_passed_over(blocks, pending, load_tokens) -> None:
    policy = RoutingPolicy(prefix_chars=0, cache_load_tokens=load_tokens, prefix_overload=4)
    router, feed, _, d = _router(0, 3, policy)
    for backend, held, busy in zip(d, blocks, pending, strict=True):
        if held:
            feed.stored(backend.key, SYSTEM[: held * BS])
        backend.inflight = busy
    route = router.route(_key(SYSTEM))
    least = min(pending)

    def value(i: int) -> float:
        return blocks[i] * BS - load_tokens * (pending[i] - least)

    within = [i for i in range(3) if pending[i] - least <= 4]
    chosen = d.index(route.decode)
    if route.decode_cache in ("cached_prefix", "balanced"):
        assert chosen in within
        assert value(chosen) == max(value(i) for i in within)
    else:
        assert pending[chosen] == least  # fell back: by load


def test_a_stale_scrape_does_not_steer_a_turn_away_from_its_cache() -> None:
    router, feed, _, d = _router(0, 2, RoutingPolicy(prefix_chars=0, prefix_overload=2))
    feed.stored("d0", SYSTEM)
    # d0 just served the previous turn: its last scrape still shows it running, blocks in use.
    router.update_load(d[0], InstanceLoad(running=3, kv_usage=0.6))
    route = router.route(_key([*SYSTEM, 1]))
    assert route.decode is d[0]
    assert route.decode_cache == "cached_prefix"
    # What the proxy has in flight there does count.
    d[0].inflight = 3
    assert router.route(_key([*SYSTEM, 1])).decode_cache == "overloaded"
