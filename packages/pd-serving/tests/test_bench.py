"""`pdserve bench` (fixed concurrency): which prompts each system gets. No vLLM: stand-ins."""

from __future__ import annotations

from pathlib import Path

from pd_serving import bench
from pd_serving.cli import build_parser
from pd_serving.servers import plan_servers
from stand_ins import MODEL, FakeUpstream


async def test_systems_on_a_shared_pair_get_prompts_of_their_own() -> None:
    """Two proxies on one P/D pair must not send the same prompts: the second would find them in
    P's prefix cache. The single instance answers every set, for the token comparison."""
    single, shared = FakeUpstream("single"), FakeUpstream("shared pair")
    for upstream in (single, shared):
        await upstream.start()
    try:
        results = await bench.bench_systems(
            [("single", single.url), ("first", shared.url), ("second", shared.url)],
            MODEL,
            ["p0", "p1", "p2", "p3"],
            own_prompts={"second": ["q0", "q1", "q2", "q3"]},
            concurrency=2,
            max_tokens=4,
            prompt_tokens=1,
            rounds=2,
            warmup=0,
        )
    finally:
        for upstream in (single, shared):
            await upstream.close()
    sent_to_pair = [body["prompt"] for body in shared.received]
    assert sorted(sent_to_pair) == ["p0", "p1", "p2", "p3", "q0", "q1", "q2", "q3"]
    assert sorted(body["prompt"] for body in single.received) == sorted(sent_to_pair)
    assert [r.requests for r in results] == [4, 4, 4]  # single measured on its own set only
    assert [r.same_tokens_as_single for r in results] == [None, True, True]


def test_proxies_on_one_pair_get_distinct_prompt_sets() -> None:
    args = build_parser().parse_args(["bench", "--compare"])
    pairs = [
        bench.PdPair(c, t, plan_servers(Path("/m"), log_dir=Path("/l"), connector=c))
        for c, t in bench.plan_pairs(args)
    ]
    proxies = bench._proxy_processes(pairs, Path("/m"), args=args, log_dir=Path("/l"))
    assert [(name, prompt_set) for name, _, _, prompt_set in proxies] == [
        ("1P1D hybrid (sequential)", 0),
        ("1P1D hybrid (parallel)", 1),  # same P/D pair as the row above
        ("1P1D nixl (sequential)", 0),  # a pair of its own
    ]
