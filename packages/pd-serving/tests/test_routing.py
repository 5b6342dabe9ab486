"""The Router's decisions, without sockets: health gating, load, prefix affinity, bypass."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pd_serving.health import BreakerState, FailureKind, InstanceLoad
from pd_serving.routing import (
    Backend,
    NoBackend,
    RequestKey,
    Route,
    Router,
    RoutingPolicy,
    prefix_hashes,
    request_key,
)


def _backends(role: str, n: int) -> list[Backend]:
    return [Backend(f"http://{role}{i}", name=f"{role}{i}") for i in range(n)]


def _text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(chars))


# -- health gating -----------------------------------------------------------------------------
def test_open_breakers_take_instances_out_until_one_probe_closes_them() -> None:
    p, d = _backends("p", 1), _backends("d", 2)
    seen = []
    router = Router(
        p,
        d,
        RoutingPolicy(breaker_failures=2, breaker_cooldown_s=10),
        on_transition=lambda b, t: seen.append((b.key, t.old.value, t.new.value)),
    )
    key = RequestKey(prompt_text=_text(1, 400))
    router.record_failure(d[0], 0, "refused", kind=FailureKind.REFUSED)
    router.record_failure(d[0], 1, "refused", kind="refused")
    assert router.breaker_state(d[0]) is BreakerState.OPEN
    assert {router.route(key, now=2).decode.key for _ in range(4)} == {"d1"}
    # After the cool-down exactly one request probes d0; the others keep going to d1.
    routes = [router.route(key, now=11).decode.key for _ in range(4)]
    assert routes.count("d0") == 1
    router.record_success(d[0], 12)
    assert router.breaker_state(d[0]) is BreakerState.CLOSED
    assert seen == [
        ("d0", "closed", "open"),
        ("d0", "open", "half_open"),
        ("d0", "half_open", "closed"),
    ]
    assert router.describe(d[0])["state"] == "closed"


def test_an_unused_route_gives_its_half_open_probe_back() -> None:
    p, d = _backends("p", 1), _backends("d", 1)
    router = Router(p, d, RoutingPolicy(breaker_failures=1, breaker_cooldown_s=10))
    key = RequestKey(prompt_text=_text(12, 400))
    router.record_failure(d[0], 0, "refused")
    route = router.route(key, now=10)  # takes d0's probe
    assert route.decode is d[0]
    with pytest.raises(NoBackend):
        router.route(key, now=11)
    router.record_unused(route.decode)  # P failed; D was never called
    assert router.route(key, now=11).decode is d[0]
    router.record_unused(p[0])  # a closed breaker: nothing to give back, nothing changes
    assert router.breaker_state(p[0]) is BreakerState.CLOSED


def test_no_decode_left_raises_and_no_prefill_left_means_local_prefill() -> None:
    p, d = _backends("p", 1), _backends("d", 1)
    router = Router(p, d, RoutingPolicy(breaker_failures=1))
    key = RequestKey(prompt_text=_text(2, 400))
    router.record_failure(p[0], 0, "refused")
    route = router.route(key, now=1)
    assert route == Route(decode=d[0], prefill=None, bypass_reason="no_healthy_prefill")
    assert router.route(key, exclude_decode=(), exclude_prefill=(), now=1).prefill is None
    with pytest.raises(NoBackend):
        router.route(key, exclude_decode={"d0"}, now=1)
    router.record_failure(d[0], 1, "refused")
    with pytest.raises(NoBackend):
        router.route(key, now=2)


def test_exclude_is_honoured_for_retries() -> None:
    p, d = _backends("p", 2), _backends("d", 2)
    router = Router(p, d)
    key = RequestKey(prompt_text=_text(3, 400))
    first = router.route(key)
    retry = router.route(
        key, exclude_prefill={first.prefill.key}, exclude_decode={first.decode.key}
    )
    assert retry.prefill is not first.prefill
    assert retry.decode is not first.decode


# -- load --------------------------------------------------------------------------------------
def test_decode_by_load_waiting_running_kv_and_own_inflight() -> None:
    d = _backends("d", 3)
    router = Router([], d)
    key = RequestKey()
    router.update_load(d[0], InstanceLoad(running=2))
    router.update_load(d[1], InstanceLoad(waiting=1))  # 1 pending + 1 waiting = 2
    router.update_load(d[2], InstanceLoad(kv_usage=0.5))  # 8 * 0.5 = 4
    picks = Counter(router.pick_decode(key).key for _ in range(4))
    assert picks == {"d0": 2, "d1": 2}  # a tie, round robin
    d[0].inflight = 3  # the proxy's own count is fresher than the scrape's running=2
    assert router.pick_decode(key) is d[1]
    router.update_load(d[1], InstanceLoad(waiting=3))  # 3 + 3 = 6
    d[0].inflight = 5
    assert router.pick_decode(key) is d[2]  # 4 from its KV usage alone


def test_prefill_without_a_prompt_goes_by_load() -> None:
    p = _backends("p", 2)
    router = Router(p, _backends("d", 1))
    p[0].inflight = 1
    assert router.pick_prefill(RequestKey()) is p[1]


# -- prefix affinity ---------------------------------------------------------------------------
def test_prompts_sharing_a_prefix_stick_to_one_prefill_and_spread_otherwise() -> None:
    p = _backends("p", 3)
    router = Router(p, _backends("d", 1), RoutingPolicy(prefix_chars=256))
    system = _text(4, 300)
    shared = {
        router.pick_prefill(RequestKey(prompt_text=system + _text(i, 200))).key for i in range(20)
    }
    assert len(shared) == 1
    spread = Counter(
        router.pick_prefill(RequestKey(prompt_text=_text(100 + i, 400))).key for i in range(60)
    )
    assert len(spread) == 3
    assert min(spread.values()) >= 10  # rendezvous hashing spreads distinct prefixes evenly
    ids = tuple(range(1000, 1100))
    by_ids = {router.pick_prefill(RequestKey(prompt_token_ids=(*ids, i))).key for i in range(10)}
    assert len(by_ids) == 1


def test_prefix_affinity_falls_back_when_the_affine_prefill_is_busy_or_unhealthy() -> None:
    p = _backends("p", 2)
    router = Router(p, _backends("d", 1), RoutingPolicy(prefix_overload=4, breaker_failures=1))
    key = RequestKey(prompt_text=_text(5, 400))
    home = router.pick_prefill(key)
    other = next(b for b in p if b is not home)
    home.inflight = 4
    assert router.pick_prefill(key) is home  # 4 more than the idle one: still within the bound
    home.inflight = 5
    assert router.pick_prefill(key) is other
    home.inflight = 0
    assert router.pick_prefill(key) is home
    router.record_failure(home, 0, "refused")
    assert router.pick_prefill(key, now=1) is other
    assert router.pick_prefill(key, exclude={other.key}, now=1) is None


@given(st.integers(0, 10_000))
def test_rendezvous_moves_only_the_prefixes_of_an_instance_taken_out(seed: int) -> None:
    p = _backends("p", 4)
    router = Router(p, _backends("d", 1))
    key = RequestKey(prompt_text=_text(seed, 300))
    home = router.pick_prefill(key)
    out = next(b for b in p if b is not home)
    assert router.pick_prefill(key, exclude={out.key}) is home


# -- bypass ------------------------------------------------------------------------------------
def test_short_prompts_bypass_prefill_and_long_ones_do_not() -> None:
    p, d = _backends("p", 1), _backends("d", 1)
    router = Router(p, d, RoutingPolicy(bypass_below_tokens=32))
    short = router.route(RequestKey(prompt_text="x" * 100))  # 25 tokens by estimate
    assert short == Route(decode=d[0], prefill=None, bypass_reason="short_prompt")
    assert (
        router.route(RequestKey(prompt_token_ids=tuple(range(31)))).bypass_reason == "short_prompt"
    )
    assert router.route(RequestKey(prompt_token_ids=tuple(range(32)))).prefill is p[0]
    assert router.route(RequestKey(prompt_text="x" * 200)).prefill is p[0]
    off = Router(p, d, RoutingPolicy(bypass_below_tokens=0))
    assert off.route(RequestKey(prompt_text="x")).prefill is p[0]


def test_any_prompt_under_the_idle_bound_bypasses_while_d_and_every_p_are_idle() -> None:
    p, d = _backends("p", 2), _backends("d", 1)
    router = Router(p, d, RoutingPolicy(bypass_below_tokens=32, bypass_idle_below_tokens=1000))
    long = RequestKey(prompt_text="x" * 2000)  # 500 tokens by estimate
    assert router.route(long) == Route(decode=d[0], prefill=None, bypass_reason="idle")
    assert router.route(RequestKey(prompt_text="x" * 100)).bypass_reason == "short_prompt"
    assert router.route(RequestKey(prompt_text="x" * 4000)).prefill is not None  # over the bound
    d[0].inflight = 1  # D decodes something: a long prompt's prefill would stall it
    assert router.route(long).prefill is not None
    d[0].inflight, p[1].inflight = 0, 1  # a prompt prefilling on P is about to reach D
    assert router.route(long).prefill is not None
    p[1].inflight = 0
    assert router.route(long).bypass_reason == "idle"
    off = Router(p, d, RoutingPolicy(bypass_below_tokens=32))
    assert off.route(long).prefill is not None
    with pytest.raises(ValueError):
        RoutingPolicy(bypass_idle_below_tokens=-1)


def test_a_p_for_idle_times_prefills_only_while_d_and_every_p_are_idle() -> None:
    narrow, wide = Backend("http://p0", name="p0"), Backend("http://p1", name="p1", when_idle=True)
    (d,) = _backends("d", 1)
    router = Router([narrow, wide], [d], RoutingPolicy())
    long = RequestKey(prompt_text="x" * 4000)
    assert router.route(long).prefill is wide  # nothing in flight: every core for this one
    wide.inflight = 1  # it prefills; the next prompt goes to the P on fewer cores
    assert router.route(long).prefill is narrow
    wide.inflight, d.inflight = 0, 1  # D decodes: the wide P would take its core
    for _ in range(4):
        assert router.route(long).prefill is narrow
    d.inflight, narrow.inflight = 0, 1
    assert router.route(long).prefill is narrow  # one prefilling: not idle, wide stays out
    narrow.inflight = 0
    assert router.pick_prefill(long) is narrow  # a retry's pick: not known to be idle
    # Only the P for idle times is eligible: it takes over rather than no P at all.
    assert router.route(long, exclude_prefill=["p0"]).prefill is wide
    d.inflight = 1
    assert router.route(long, exclude_prefill=["p0"]).prefill is wide
    assert wide.describe()["when_idle"] is True


def test_a_prompt_a_decode_served_recently_bypasses_to_that_decode() -> None:
    p, d = _backends("p", 1), _backends("d", 3)
    router = Router(p, d, RoutingPolicy(bypass_below_tokens=32))
    history = _text(6, 2000)  # a conversation so far: 500 tokens
    first = router.route(RequestKey(prompt_text=history))
    assert first.prefill is p[0]
    router.record_routed(RequestKey(prompt_text=history), first)
    # The next turn extends it by 100 characters (25 tokens): only that tail is new to first.decode.
    follow_up = RequestKey(prompt_text=history + _text(7, 100))
    for other in d:
        other.inflight = 1 if other is first.decode else 0  # busier, but within the bound
    route = router.route(follow_up)
    assert route == Route(decode=first.decode, prefill=None, bypass_reason="prefix_cached")
    assert router.cached_tail(follow_up, first.decode) <= 32
    assert router.cached_tail(follow_up, next(b for b in d if b is not first.decode)) == 525
    # A long new tail (200 tokens) is worth a P again; an unrelated prompt too.
    assert router.route(RequestKey(prompt_text=history + _text(8, 800))).prefill is p[0]
    assert router.route(RequestKey(prompt_text=_text(9, 2000))).prefill is p[0]


def test_prefix_cached_bypass_gives_way_to_load_health_and_exclusion() -> None:
    p, d = _backends("p", 1), _backends("d", 2)
    router = Router(
        p, d, RoutingPolicy(bypass_below_tokens=32, prefix_overload=4, breaker_failures=1)
    )
    history = RequestKey(prompt_text=_text(10, 1000))
    served = Route(decode=d[0], prefill=p[0])
    router.record_routed(history, served)
    again = RequestKey(prompt_text=history.prompt_text + "more")
    assert router.route(again).bypass_reason == "prefix_cached"
    d[0].inflight = 5
    assert router.route(again).prefill is p[0]  # that D is overloaded: PD on the idle one
    d[0].inflight = 0
    assert router.route(again, exclude_decode={"d0"}).prefill is p[0]
    router.record_failure(d[0], 0, "refused")
    assert router.route(again, now=1).decode is d[1]
    # Opening the breaker forgot what d0 had cached (it may come back restarted, cache empty).
    router.record_success(d[0], 10)  # back after the cool-down
    assert router.route(again, now=11).prefill is p[0]


def test_decode_prefix_lru_is_bounded() -> None:
    d = _backends("d", 1)
    router = Router(
        _backends("p", 1), d, RoutingPolicy(bypass_below_tokens=8, decode_prefix_entries=10)
    )
    for i in range(50):
        router.record_routed(
            RequestKey(prompt_text=_text(i, 640)), Route(decode=d[0], prefill=None)
        )
    assert len(router._cached["d0"]) == 10
    router.record_routed(
        RequestKey(prompt_text=_text(99, 64 * 9)), Route(decode=d[0], prefill=None)
    )
    assert router.cached_tail(RequestKey(prompt_text=_text(99, 64 * 9) + "abc"), d[0]) == 1


def test_prefix_hashes_cover_every_chunk_and_the_whole_prompt() -> None:
    text = _text(11, 150)
    hashes = list(prefix_hashes(RequestKey(prompt_text=text)))
    assert [n for n, _ in hashes] == [64, 128, 150]
    # The hash of a prefix is the same whatever follows it.
    longer = list(prefix_hashes(RequestKey(prompt_text=text[:128] + "zzz")))
    assert hashes[:2] == longer[:2]
    assert hashes[2] != longer[2]
    ids = list(prefix_hashes(RequestKey(prompt_token_ids=tuple(range(40)))))
    assert [n for n, _ in ids] == [16, 32, 40]


def test_request_key_from_completion_and_chat_bodies() -> None:
    assert request_key({"prompt": "hello world"}) == RequestKey(
        prompt_text="hello world", estimated_prompt_tokens=3
    )
    assert request_key({"prompt": [[1, 2, 3]]}).prompt_token_ids == (1, 2, 3)
    assert request_key({"prompt": ["abc"]}).prompt_text == "abc"
    chat1 = request_key({"messages": [{"role": "user", "content": "hi"}]})
    chat2 = request_key(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
            ]
        }
    )
    assert chat2.prompt_text.startswith(chat1.prompt_text)
    assert chat2.tokens > chat1.tokens


# -- through the proxy (stand-in upstreams; the wiring, not the policies) ----------------------
async def _proxy_with(p_url: str, d_urls: list[str], policy: RoutingPolicy):
    from pd_serving.launcher import free_port
    from pd_serving.proxy import PdProxy, ProxyConfig, serve

    config = ProxyConfig(
        prefill=[Backend(p_url, rpc_address="127.0.0.1:7777", name="p0")],
        decode=[Backend(u, name=f"d{i}") for i, u in enumerate(d_urls)],
        model_names=["tiny"],
        routing=policy,
        health=None,  # the stand-ins have no /health; the checker has its own tests
    )
    proxy = PdProxy(config)
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    return f"http://127.0.0.1:{port}", proxy, runner


async def test_proxy_bypasses_short_prompts_and_reports_states_and_metrics() -> None:
    import aiohttp
    from stand_ins import MODEL, FakeUpstream

    p, d = FakeUpstream("P", kv_params={}), FakeUpstream("D")
    await p.start()
    await d.start()
    url, _proxy, runner = await _proxy_with(p.url, [d.url], RoutingPolicy(bypass_below_tokens=16))
    try:
        async with aiohttp.ClientSession() as session:
            for prompt in ("short", "x" * 400):
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
            assert len(p.received) == 1  # only the long prompt went through P
            assert "kv_transfer_params" not in d.received[0]
            assert "kv_transfer_params" in d.received[1]
            async with session.get(f"{url}/health") as resp:
                health = await resp.json()
            assert health["decode"][0]["state"] == "closed"
            assert health["prefill"][0]["load"] == {"waiting": 0, "running": 0, "kv_usage": 0.0}
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert 'pdserve_bypass_total{reason="short_prompt"} 1.0' in text
    finally:
        await runner.cleanup()
        await p.close()
        await d.close()


async def test_proxy_failures_open_the_breaker_and_count_the_transition() -> None:
    import aiohttp
    from stand_ins import MODEL, FakeUpstream

    p, bad, good = (
        FakeUpstream("P", kv_params={}),
        FakeUpstream("D1", fail_status=500),
        FakeUpstream("D2"),
    )
    for u in (p, bad, good):
        await u.start()
    policy = RoutingPolicy(breaker_failures=2, breaker_cooldown_s=600)
    url, proxy, runner = await _proxy_with(p.url, [bad.url, good.url], policy)
    try:
        async with aiohttp.ClientSession() as session:
            statuses = []
            for i in range(6):
                body = {"model": MODEL, "prompt": _text(i, 300), "max_tokens": 2}
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    statuses.append(resp.status)
            # D1 failed twice (each time D2 took over the transfer), then was out of rotation.
            assert statuses == [200] * 6
            assert len(bad.received) == 2
            assert proxy.router.breaker_state(proxy.config.decode[0]) is BreakerState.OPEN
            async with session.get(f"{url}/health") as resp:
                health = await resp.json()
            assert health["decode"][0]["state"] == "open"
            assert "answered 500" in health["decode"][0]["last_error"]
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            assert (
                'pdserve_breaker_transitions_total{backend="d0",from_state="closed",'
                'to_state="open"} 1.0' in text
            )
    finally:
        await runner.cleanup()
        for u in (p, bad, good):
            await u.close()


def test_cli_routing_options_make_the_policy() -> None:
    from pd_serving.cli import build_parser, routing_from_args

    args = build_parser().parse_args(
        [
            *("proxy", "--decode", "http://d", "--bypass-below-tokens", "64"),
            *("--bypass-idle-below-tokens", "8192"),
            *("--prefix-chars", "0", "--breaker-failures", "5", "--health-interval-s", "0"),
        ]
    )
    policy, health = routing_from_args(args)
    assert policy.bypass_below_tokens == 64
    assert policy.bypass_idle_below_tokens == 8192
    assert policy.prefix_chars == 0
    assert policy.breaker.failures == 5
    assert health is None
    args = build_parser().parse_args(["up", "--breaker-failures", "0"])
    with pytest.raises(SystemExit, match="at least one failure"):
        routing_from_args(args)


@pytest.mark.parametrize("command", [["up"], ["proxy", "--decode", "http://d"]])
def test_pdserve_bypasses_short_prompts_by_default(command: list[str]) -> None:
    """The commands a user runs default to what measured best (routing.DEFAULT_BYPASS_...):
    a short prompt goes to D alone, a long one through P; `--bypass-below-tokens 0` turns it
    off."""
    from pd_serving.cli import build_parser, routing_from_args
    from pd_serving.routing import DEFAULT_BYPASS_BELOW_TOKENS

    assert DEFAULT_BYPASS_BELOW_TOKENS > 0
    policy, _ = routing_from_args(build_parser().parse_args(command))
    assert policy.bypass_below_tokens == DEFAULT_BYPASS_BELOW_TOKENS
    router = Router([Backend("http://p", name="p")], [Backend("http://d", name="d")], policy)
    short = RequestKey(prompt_token_ids=tuple(range(DEFAULT_BYPASS_BELOW_TOKENS - 1)))
    long = RequestKey(prompt_token_ids=tuple(range(DEFAULT_BYPASS_BELOW_TOKENS)))
    assert router.route(short).bypass_reason == "short_prompt"
    assert router.route(long).prefill is not None
    off, _ = routing_from_args(build_parser().parse_args([*command, "--bypass-below-tokens", "0"]))
    assert Router([Backend("http://p")], [Backend("http://d")], off).route(short).prefill
    assert RoutingPolicy().bypass_below_tokens == 0  # a Router built in code: told, not guessed
