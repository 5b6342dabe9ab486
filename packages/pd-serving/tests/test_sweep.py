"""The load sweep (`pdserve bench --rates`): schedule, lengths, maths, plots, open-loop sending.

No vLLM: the sending is tested against stand-in upstreams (`stand_ins.FakeUpstream`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import subprocess
import sys

import pytest
from aiohttp import web
from pd_serving.cli import build_parser
from pd_serving.sweep import (
    RequestSample,
    Slo,
    SweepPoint,
    compare_tokens,
    describe_max_rate,
    inter_token_gaps,
    load_points,
    max_rate_meeting_slo,
    percentile,
    regrade,
    run_open_loop,
    split_rounds,
    summarize_point,
    sweep_markdown_table,
    sweep_payload,
    sweep_systems,
    write_plots,
)
from pd_serving.workload import (
    LengthDist,
    SweepRequest,
    parse_length_dist,
    parse_rates,
    plan_rate,
    poisson_arrivals,
)
from stand_ins import MODEL, FakeUpstream

# --- the schedule ---------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_have_the_rate() -> None:
    arrivals = poisson_arrivals(5.0, 4000, random.Random(7))
    assert arrivals == poisson_arrivals(5.0, 4000, random.Random(7))
    assert arrivals != poisson_arrivals(5.0, 4000, random.Random(8))
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(5.0, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    # Exponential gaps: the standard deviation equals the mean (a fixed pace would give 0).
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.08)


def test_plan_rate_is_reproducible_per_seed_and_rate() -> None:
    prompt, output = LengthDist("uniform", 10, 500), LengthDist("fixed", 64)
    plan = plan_rate(2.0, 50, prompt_dist=prompt, output_dist=output, seed=3)
    again = plan_rate(2.0, 50, prompt_dist=prompt, output_dist=output, seed=3)
    assert [(r.arrival_s, r.prompt_tokens) for r in plan] == [
        (r.arrival_s, r.prompt_tokens) for r in again
    ]
    other_rate = plan_rate(4.0, 50, prompt_dist=prompt, output_dist=output, seed=3)
    other_seed = plan_rate(2.0, 50, prompt_dist=prompt, output_dist=output, seed=4)
    assert [r.prompt_tokens for r in other_rate] != [r.prompt_tokens for r in plan]
    assert [r.arrival_s for r in other_seed] != [r.arrival_s for r in plan]
    assert [r.index for r in plan] == list(range(50))
    assert all(r.output_tokens == 64 for r in plan)


def test_plan_rate_fits_prompts_into_the_model_length() -> None:
    plan = plan_rate(
        1.0,
        20,
        prompt_dist=LengthDist("fixed", 400),
        output_dist=LengthDist("fixed", 64),
        seed=0,
        max_model_len=256,
    )
    assert {r.prompt_tokens for r in plan} == {192}
    with pytest.raises(ValueError, match="max_model_len"):
        plan_rate(
            1.0,
            1,
            prompt_dist=LengthDist("fixed", 4),
            output_dist=LengthDist("fixed", 256),
            seed=0,
            max_model_len=256,
        )


# --- length distributions -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "dist", "text"),
    [
        ("300", LengthDist("fixed", 300), "300"),
        ("fixed:7", LengthDist("fixed", 7), "7"),
        ("uniform:200:400", LengthDist("uniform", 200, 400), "uniform:200:400"),
        ("normal:300:50", LengthDist("normal", 300.0, 50.0), "normal:300:50"),
        (" normal:12.5:0 ", LengthDist("normal", 12.5, 0.0), "normal:12.5:0"),
    ],
)
def test_length_specs_parse(spec: str, dist: LengthDist, text: str) -> None:
    assert parse_length_dist(spec) == dist
    assert str(dist) == text
    assert parse_length_dist(str(dist)) == dist


def test_length_samples_stay_in_their_bounds() -> None:
    rng = random.Random(1)
    assert {LengthDist("fixed", 9).sample(rng) for _ in range(10)} == {9}
    uniform = [LengthDist("uniform", 3, 6).sample(rng) for _ in range(2000)]
    assert set(uniform) == {3, 4, 5, 6}  # both ends included
    normal = LengthDist("normal", 300, 50)
    draws = [normal.sample(rng) for _ in range(5000)]
    assert normal.bounds() == (150, 450)
    assert min(draws) >= 150
    assert max(draws) <= 450
    assert statistics.mean(draws) == pytest.approx(300, abs=3)
    assert statistics.stdev(draws) == pytest.approx(50, rel=0.06)
    tiny = LengthDist("normal", 2, 5)  # mostly below 1: clipped up, never 0 or negative
    assert min(tiny.sample(rng) for _ in range(500)) == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gamma:3:4", "use N, fixed:N, uniform:LO:HI or normal:MEAN:SD"),
        ("uniform:5", "uniform takes 2 number(s)"),
        ("fixed:1:2", "fixed takes 1 number(s)"),
        ("uniform:a:b", "are not whole numbers"),
        ("uniform:2.5:4", "are not whole numbers"),
        ("uniform:9:3", "need 1 <= LO <= HI"),
        ("0", "N must be at least 1"),
        ("normal:300:-1", "need MEAN >= 1, SD >= 0"),
        ("", "use N"),
    ],
)
def test_bad_length_spec_is_a_clear_argparse_error(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--rates", "1", "--prompt-dist", spec])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --prompt-dist: bad length spec" in err
    assert message in err


def test_rates_parse_and_bad_rates_are_argparse_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["bench", "--rates", "4,0.5,2,1,2"])
    assert args.rates == [0.5, 1.0, 2.0, 4.0]
    assert args.output_dist is None
    assert args.slo_ttft_ms == 1000
    assert args.slo_tpot_ms == 50
    assert parse_rates("1,") == [1.0]
    for bad, message in (("1,x", "comma separated"), ("0", "> 0"), ("-1,2", "> 0"), (",", "> 0")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", f"--rates={bad}"])
        assert message in capsys.readouterr().err


# --- the maths ------------------------------------------------------------------------------


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile(list(range(101)), 90) == 90
    assert percentile([], 50) != percentile([], 50)  # nan


def test_itl_is_every_gap_between_streamed_tokens() -> None:
    assert inter_token_gaps([0.1, 0.15, 0.35, 0.36]) == pytest.approx([0.05, 0.2, 0.01])
    assert inter_token_gaps([0.1]) == []
    assert inter_token_gaps([]) == []


def _sample(i: int, ttft: float, tpot: float, itl: list[float], tokens=None) -> RequestSample:
    return RequestSample(
        i, ttft_ms=ttft, tpot_ms=tpot, output_tokens=len(itl) + 1, itl_ms=itl, token_ids=tokens
    )


def test_summarize_point_percentiles_goodput_and_failures() -> None:
    samples = [
        _sample(0, 100.0, 10.0, [10.0, 10.0]),  # meets both
        _sample(1, 200.0, 20.0, [20.0, 20.0]),  # meets both (bounds are inclusive)
        _sample(2, 900.0, 5.0, [5.0, 5.0]),  # TTFT too slow
        _sample(3, 50.0, 80.0, [40.0, 120.0]),  # TPOT too slow
        RequestSample(4, error="HTTP 502"),  # failed: never good, not in the percentiles
    ]
    point = summarize_point("sys", 2.0, samples, wall_s=4.0, slo=Slo(ttft_ms=200, tpot_ms=20))
    assert (point.requests, point.completed, point.failed) == (5, 4, 1)
    assert point.ttft_p50_ms == pytest.approx(150.0)
    assert point.ttft_p99_ms == pytest.approx(percentile([100, 200, 900, 50], 99))
    assert point.tpot_p90_ms == pytest.approx(percentile([10, 20, 5, 80], 90))
    itls = [10.0, 10.0, 20.0, 20.0, 5.0, 5.0, 40.0, 120.0]
    assert point.itl_p50_ms == pytest.approx(percentile(itls, 50))
    assert point.itl_p99_ms == pytest.approx(percentile(itls, 99))
    assert point.throughput_rps == pytest.approx(1.0)  # 4 completed in 4 s
    assert point.output_tokens_per_s == pytest.approx(12 / 4)
    assert point.goodput_rps == pytest.approx(0.5)  # 2 good in 4 s
    assert point.slo_attainment == pytest.approx(2 / 5)
    assert point.errors == ["#4: HTTP 502"]
    assert point.ttft_ms == [100.0, 200.0, 900.0, 50.0, None]


def test_summarize_point_with_nothing_completed() -> None:
    point = summarize_point("sys", 1.0, [RequestSample(0, error="x")], 1.0, Slo(1, 1))
    assert point.completed == 0
    assert point.goodput_rps == 0
    payload = json.loads(json.dumps(sweep_payload([point], {})))  # NaN would not be JSON
    assert payload["points"][0]["ttft_p50_ms"] is None
    again = load_points(payload)[0]
    assert again.ttft_p50_ms != again.ttft_p50_ms  # back to nan
    assert again.prefill_call_mean_ms is None
    assert again.ttft_ms == [None]


def test_compare_tokens_counts_only_requests_both_answered() -> None:
    ref = [_sample(0, 1, 1, [], [1, 2]), _sample(1, 1, 1, [], [3]), RequestSample(2, error="x")]
    same = [_sample(0, 1, 1, [], [1, 2]), RequestSample(1, error="x"), _sample(2, 1, 1, [], [9])]
    assert compare_tokens(ref, same) == 0
    assert compare_tokens(ref, [_sample(0, 1, 1, [], [1, 3]), *same[1:]]) == 1
    assert compare_tokens(ref[2:], same[2:]) == -1


def _point(system: str, rate: float, ttft_p99: float, failed: int = 0) -> SweepPoint:
    point = summarize_point(system, rate, [_sample(0, ttft_p99, 1.0, [])], 1.0, Slo(1e9, 1e9))
    point.failed = failed
    return point


def test_max_rate_meeting_the_ttft_p99_slo() -> None:
    points = [
        _point("pd", 0.5, 100),
        _point("pd", 1, 300),
        _point("pd", 2, 900),
        _point("pd", 4, 1500),  # over
        _point("pd", 8, 200),  # back under: does not count, the SLO broke at 4
        _point("nixl", 0.5, 800),
        _point("nixl", 1, 2000),
        _point("slow", 0.5, 5000),
        _point("all", 0.5, 10),
        _point("all", 1, 20),
        _point("flaky", 0.5, 10),
        _point("flaky", 1, 10, failed=1),  # a failed request misses the SLO too
    ]
    assert max_rate_meeting_slo(points, "pd", 1000) == (2, False)
    assert max_rate_meeting_slo(points, "nixl", 1000) == (0.5, False)
    assert max_rate_meeting_slo(points, "slow", 1000) == (None, False)
    assert max_rate_meeting_slo(points, "all", 1000) == (1, True)
    assert max_rate_meeting_slo(points, "flaky", 1000) == (0.5, False)
    assert max_rate_meeting_slo(points, "pd", 1500) == (8, True)  # inclusive bound
    assert describe_max_rate((2, False), 1000) == "2 req/s"
    assert "highest swept" in describe_max_rate((1, True), 1000)
    assert "lowest rate" in describe_max_rate((None, False), 1000)


# --- output ---------------------------------------------------------------------------------


def _fixture_points() -> list[SweepPoint]:
    slo = Slo(500, 50)
    points = []
    for rate in (0.5, 1.0, 2.0, 4.0):
        for system, scale in (("single", 1.0), ("1P1D hybrid", 1.5), ("1P1D nixl", 8.0)):
            samples = [
                _sample(i, scale * rate * (50 + i), scale * 2, [scale * 2.0] * 3) for i in range(6)
            ]
            if system == "1P1D nixl" and rate == 4.0:
                samples = [RequestSample(i, error="timeout") for i in range(6)]
            points.append(summarize_point(system, rate, samples, 6 / rate, slo))
    return points


def test_write_plots_makes_pngs(tmp_path) -> None:
    paths = write_plots(_fixture_points(), tmp_path / "sub" / "pd_sweep", Slo(500, 50), "t")
    assert [p.name for p in paths] == ["pd_sweep_latency.png", "pd_sweep_goodput.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert len(data) > 10_000  # axes, lines and labels, not an empty canvas


def test_markdown_table_has_a_row_per_point() -> None:
    points = _fixture_points()
    points[1].same_tokens_as_single, points[2].same_tokens_as_single = True, False
    points[2].mismatched = 3
    table = sweep_markdown_table(points).splitlines()
    assert len(table) == 2 + len(points)
    assert table[0].startswith("| rate req/s | system | done / failed | TTFT p50/p90/p99 ms")
    assert table[2].startswith("| 0.5 | single | 6 / 0 | ")
    points[3].load_avg_1m = 6.4
    table = sweep_markdown_table(points).splitlines()
    assert table[3].endswith("| true | - |")
    assert table[4].endswith("| false (3) | - |")
    assert table[5].endswith("| - | 6 |")  # the machine's 1-minute load average
    assert "| 4 | 1P1D nixl | 0 / 6 | - / - / - |" in table[-1]


def test_sweep_modules_do_not_import_matplotlib() -> None:
    code = "import sys, pd_serving.bench, pd_serving.cli; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- sending --------------------------------------------------------------------------------


class GatedUpstream(FakeUpstream):
    """Answers nothing until ``gate_after`` requests are in: a closed loop would never get there."""

    gate_after: int = 3
    arrived: int = 0
    gate: asyncio.Event

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.arrived += 1
        if self.arrived >= self.gate_after:
            self.gate.set()
        await self.gate.wait()
        return await super()._generate(request)


def _requests(arrivals: list[float], max_tokens: int = 4) -> list[SweepRequest]:
    return [SweepRequest(i, t, 1, max_tokens, f"p{i}") for i, t in enumerate(arrivals)]


async def test_open_loop_sends_on_schedule_not_after_answers() -> None:
    import aiohttp

    upstream = GatedUpstream("gated", token_delay_s=0.001)
    upstream.gate = asyncio.Event()
    await upstream.start()
    try:
        async with aiohttp.ClientSession() as session:
            samples, wall = await run_open_loop(
                session, upstream.url, MODEL, _requests([5.0, 5.01, 5.02]), timeout_s=10
            )
    finally:
        await upstream.close()
    assert [s.error for s in samples] == [None, None, None]
    assert len(upstream.received) == 3
    assert all(s.output_tokens == 4 and len(s.itl_ms) == 3 for s in samples)
    assert all(s.ttft_ms > 0 and s.tpot_ms > 0 for s in samples)
    assert wall < 5.0  # the arrivals are re-based: the first request left at once


async def test_failures_and_short_answers_are_counted_not_raised() -> None:
    import aiohttp

    failing, short = FakeUpstream("failing", fail_status=500), FakeUpstream("short")
    await failing.start()
    await short.start()
    try:
        async with aiohttp.ClientSession() as session:
            bad, _ = await run_open_loop(
                session, failing.url, MODEL, _requests([0, 0]), timeout_s=30
            )
            cut, _ = await run_open_loop(
                session, short.url, MODEL, _requests([0], max_tokens=8), timeout_s=30
            )
            gone, _ = await run_open_loop(
                session, "http://127.0.0.1:1", MODEL, _requests([0]), timeout_s=30
            )
    finally:
        await failing.close()
        await short.close()
    assert all("HTTP 500" in s.error for s in bad)
    assert cut[0].error == "4 of 8 tokens"  # the stand-in streams 4 tokens at most
    assert gone[0].error.startswith("ClientConnectorError")


async def test_sweep_systems_takes_turns_and_compares_tokens() -> None:
    single, other = FakeUpstream("single"), FakeUpstream("other")
    for upstream in (single, other):
        await upstream.start()
    order: list[str] = []

    async def probe(_session, url: str):
        order.append(url)

    plans = {rate: _requests([0.0, 0.01, 0.02, 0.03]) for rate in (20.0, 40.0)}
    try:
        points = await sweep_systems(
            [("single", single.url), ("other", other.url)],
            MODEL,
            plans,
            slo=Slo(10_000, 10_000),
            rounds=2,
            warmup=1,
            prefill_probe=probe,
        )
    finally:
        for upstream in (single, other):
            await upstream.close()
    assert [(p.rate, p.system) for p in points] == [
        (20.0, "single"),
        (20.0, "other"),
        (40.0, "single"),
        (40.0, "other"),
    ]
    assert all(p.completed == 4 and p.failed == 0 for p in points)
    assert [p.same_tokens_as_single for p in points] == [None, True, None, True]
    assert all(p.goodput_rps == p.throughput_rps > 0 for p in points)
    assert all(p.load_avg_1m is not None for p in points)
    # Probed before and after each slice: single, single, other, other per round, 2 rounds/rate.
    urls = [single.url, single.url, other.url, other.url]
    assert order == urls * 4
    assert len(single.received) == 1 + 8
    assert len(other.received) == 1 + 8


def test_split_rounds_keeps_arrival_order() -> None:
    reqs = _requests([0, 1, 2, 3, 4])
    assert [[r.index for r in part] for part in split_rounds(reqs, 2)] == [[0, 1, 2], [3, 4]]
    assert len(split_rounds(reqs, 9)) == 5
    assert [len(p) for p in split_rounds(reqs, 0)] == [5]


def test_regrade_judges_stored_samples_against_another_slo() -> None:
    samples = [
        _sample(0, 100.0, 10.0, []),
        _sample(1, 900.0, 10.0, []),
        RequestSample(2, error="x"),
    ]
    strict = summarize_point("sys", 1.0, samples, wall_s=2.0, slo=Slo(200, 20))
    assert strict.goodput_rps == pytest.approx(0.5)
    loose = regrade(strict, Slo(1000, 20))
    assert loose.goodput_rps == pytest.approx(1.0)  # the failed request still does not count
    assert loose.slo_attainment == pytest.approx(2 / 3)
    assert strict.goodput_rps == pytest.approx(0.5)  # a new point; the stored one is kept
    stored = load_points(json.loads(json.dumps(sweep_payload([strict], {}))))[0]
    assert regrade(stored, Slo(1000, 20)).goodput_rps == loose.goodput_rps


def test_replot_rewrites_json_and_plots_with_the_new_slo(tmp_path) -> None:
    from pd_serving.bench import replot_sweep
    from rich.console import Console

    meta = {
        "slo": {"ttft_ms": 500, "tpot_ms": 50},
        "prompt_dist": "300",
        "output_dist": "64",
        "requests_per_rate": 6,
    }
    path = tmp_path / "pd_sweep.json"
    path.write_text(json.dumps(sweep_payload(_fixture_points(), meta)))
    console = Console(width=160, record=True)
    replot_sweep(path, Slo(100_000, 1000), console)
    payload = json.loads(path.read_text())
    assert payload["meta"]["slo"] == {"ttft_ms": 100_000, "tpot_ms": 1000}
    nixl = payload["meta"]["max_rate_meeting_ttft_p99_slo"]["1P1D nixl"]
    assert nixl == {"rate": 2.0, "highest_swept": False}  # at 4 req/s every request failed
    assert {p["slo_attainment"] for p in payload["points"] if p["completed"]} == {1.0}
    assert (tmp_path / "pd_sweep_latency.png").is_file()
    assert "1P1D nixl: 2 req/s" in console.export_text()
