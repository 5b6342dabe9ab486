"""The equal-hardware benchmark's pure parts: the mixed plan, SLO, summary, verdict, output."""

from __future__ import annotations

import math

import pytest
from pd_serving.equal_hw import (
    Slo,
    Turn,
    compare_systems,
    judge,
    markdown_table,
    payload,
    summarize,
    write_plot,
)
from pd_serving.sweep import RequestSample
from pd_serving.timings import FINE_BUCKETS_S, ITL, TPOT, TTFT, Histogram
from pd_serving.workload import LengthDist, MixSpec, plan_mixed


def test_plan_mixed_is_seeded_and_mixes_both_kinds():
    mix = MixSpec(long_share=0.3)
    plan = plan_mixed(2.0, 200, mix, seed=3)
    assert plan == plan_mixed(2.0, 200, mix, seed=3)
    longs = [r for r in plan if mix.is_long(r)]
    assert 30 < len(longs) < 90
    assert all(1024 <= r.prompt_tokens <= 4096 and r.output_tokens == 32 for r in longs)
    shorts = [r for r in plan if not mix.is_long(r)]
    assert all(64 <= r.prompt_tokens <= 128 and r.output_tokens == 256 for r in shorts)
    assert [r.arrival_s for r in plan] == sorted(r.arrival_s for r in plan)


def test_plan_mixed_fits_the_model_length():
    plan = plan_mixed(1.0, 50, MixSpec(long_share=1.0), seed=0, max_model_len=2048)
    assert max(r.prompt_tokens + r.output_tokens for r in plan) <= 2048


def test_mix_share_is_checked():
    with pytest.raises(ValueError):
        MixSpec(long_share=1.5)


def sample(index, ttft, gaps, *, tokens=None, prompt=100, shared=0, error=None):
    n = tokens if tokens is not None else len(gaps) + 1
    return RequestSample(
        index,
        ttft_ms=ttft,
        tpot_ms=sum(gaps) / max(1, n - 1),
        output_tokens=n,
        itl_ms=list(gaps),
        token_ids=[index] * n,
        error=error,
        tokens_sharing_a_chunk=shared,
        prompt_tokens=prompt,
    )


def server(step_s, steps):
    bounds = (*FINE_BUCKETS_S, math.inf)
    cumulative = tuple(float(steps if b >= step_s else 0) for b in bounds)
    return Histogram(bounds, cumulative, step_s * steps)


def turn(system, samples, *, wall=10.0, step_s=0.02, steps=None, rnd=0):
    steps = steps if steps is not None else sum(len(s.itl_ms) for s in samples)
    hists = {ITL: server(step_s, steps), TPOT: server(step_s, len(samples)), TTFT: server(0.1, 1)}
    return Turn(system, 1.0, rnd, samples, wall, [hists], 1.0)


def test_slo_uses_ttft_and_the_request_own_itl_p99():
    slo = Slo(ttft_ms=500, itl_ms=100)
    assert slo.met(sample(0, 400, [20] * 200))
    assert not slo.met(sample(0, 600, [20] * 200))
    assert not slo.met(sample(0, 400, [20] * 190 + [900] * 10))  # stalls beyond its p99
    assert not slo.met(sample(0, 400, [20], error="HTTP 500"))


def test_summarize_reads_client_and_server_and_agrees_when_steady():
    point = summarize(
        [turn("s", [sample(0, 100, [20] * 50, prompt=2000), sample(1, 300, [20] * 50)])],
        Slo(1000, 100),
        long_prompt_above=128,
    )
    assert point.completed == 2
    assert point.failed == 0
    assert point.timing_agrees, point.timing_note
    assert math.isclose(point.itl_p50_ms, 20)
    assert 15 < point.server_itl_p50_ms <= 21
    assert point.long_ttft_p50_ms == 100
    assert math.isclose(point.goodput_rps, 0.2)
    assert point.checked_itl_p99_ms == point.itl_p99_ms


def test_a_burst_read_reports_the_server_itl():
    bursty = sample(0, 100, [0.01] * 31)  # 32 tokens read in one burst
    point = summarize([turn("s", [bursty], steps=31)], Slo(1000, 100))
    assert not point.timing_agrees
    assert "burst" in point.timing_note
    assert point.checked_itl_p99_ms == point.server_itl_p99_ms > 15
    assert "burst" in markdown_table([point])


def test_compare_systems_orders_points_and_compares_tokens():
    a = [sample(0, 100, [20] * 4), sample(1, 100, [20] * 4)]
    b = [sample(0, 100, [20] * 4), sample(1, 100, [20] * 4)]
    b[1].token_ids = [9] * 5
    points = compare_systems([turn("one", a), turn("two", b)], Slo(1000, 100))
    assert [p.system for p in points] == ["one", "two"]
    assert points[0].same_tokens_as_reference is None
    assert points[1].same_tokens_as_reference is False
    assert points[1].mismatched == 1
    assert points[1].first_divergence == 0


def test_rounds_give_the_spread():
    turns = [
        turn("s", [sample(0, 100, [20] * 50)], rnd=0),
        turn("s", [sample(1, 100, [20] * 49 + [400])], rnd=1),
    ]
    point = summarize(turns, Slo(1000, 100))
    assert [r["round"] for r in point.rounds] == [0, 1]
    assert point.rounds[0]["itl_p99_ms"] < point.rounds[1]["itl_p99_ms"]


def test_judge_compares_at_the_highest_rate_single_sustains():
    def point(system, rate, attainment, itl, goodput):
        p = summarize([turn(system, [sample(0, 100, [itl] * 10)], step_s=itl / 1000)], Slo(1, 1))
        p.rate, p.slo_attainment, p.goodput_rps = rate, attainment, goodput
        return p

    points = [
        point("single", 1, 1.0, 200, 1.0),
        point("dp", 1, 1.0, 300, 0.9),
        point("pd", 1, 1.0, 50, 1.0),
        point("single", 2, 0.95, 400, 1.5),
        point("dp", 2, 0.9, 500, 1.6),
        point("pd", 2, 1.0, 100, 2.2),
        point("single", 4, 0.3, 900, 1.0),
        point("pd", 4, 0.9, 120, 3.0),
    ]
    verdict = judge(points, single="single", others=["dp"], pd="pd")
    assert verdict.rate == 2
    assert math.isclose(verdict.itl_p99_ratio, 0.25, rel_tol=0.05)
    assert math.isclose(verdict.goodput_ratio, 2.2 / 1.6)
    assert verdict.itl_target_met
    assert verdict.goodput_target_met


def test_judge_without_a_sustained_rate():
    p = summarize([turn("single", [sample(0, 100, [20])])], Slo(1, 1))
    assert judge([p], single="single", others=[], pd="pd").rate is None


def test_payload_has_no_nan_and_the_plot_is_a_png(tmp_path):
    points = compare_systems([turn("one", [sample(0, 100, [])])], Slo(1000, 100))
    body = payload(points, {"x": 1})
    assert body["points"][0]["itl_p50_ms"] is None
    path = write_plot(points, tmp_path / "p.png", Slo(1000, 100), "t")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_fixed_kinds_of_a_small_mix():
    mix = MixSpec(0.5, LengthDist("fixed", 8), LengthDist("fixed", 2), LengthDist("fixed", 1))
    plan = plan_mixed(10.0, 20, mix, seed=1)
    assert {(r.prompt_tokens, r.output_tokens) for r in plan} <= {(8, 2), (1, 256)}


def test_low_load_breakdown_takes_each_stage_per_request():
    from pd_serving.equal_hw import (
        E2E,
        PREFILL,
        QUEUE,
        REST,
        LowLoadSample,
        low_load_breakdown,
        low_load_markdown,
        request_stage_s,
    )

    def hist(seconds, count):
        return Histogram((1.0, math.inf), (count, count), seconds)

    before = [{QUEUE: hist(1.0, 3), PREFILL: hist(2.0, 3), E2E: hist(3.0, 3), TTFT: hist(2.0, 3)}]
    after = [{QUEUE: hist(1.01, 4), PREFILL: hist(2.05, 4), E2E: hist(3.06, 4), TTFT: hist(2.0, 3)}]
    stage = request_stage_s(before, after)
    assert stage[QUEUE] == pytest.approx(0.01)
    assert stage[E2E] == pytest.approx(0.06)
    assert math.isnan(stage[TTFT])  # the count did not move: not this request's
    p = {QUEUE: 0.0, PREFILL: 0.05, E2E: 0.06, TTFT: 0.055}
    d = {QUEUE: 0.01, PREFILL: 0.02, E2E: 0.5, TTFT: 0.03}
    single = {QUEUE: 0.0, PREFILL: 0.04, E2E: 0.4, TTFT: 0.042}
    samples = [
        LowLoadSample("single", "short", sample(0, 45.0, [20.0]), [single]),
        LowLoadSample("1P1D", "short", sample(0, 100.0, [20.0]), [p, d]),
        LowLoadSample("1P1D", "short", sample(1, 0.0, [], error="boom"), [p, d]),
    ]
    rows = low_load_breakdown(samples, reference="single")
    pd_row = rows[1]
    assert (pd_row.requests, pd_row.failed) == (2, 1)
    assert pd_row.stages_p50_ms["P forward (prefill)"] == pytest.approx(50.0)
    assert pd_row.stages_p50_ms["D waits for KV (queue)"] == pytest.approx(10.0)
    assert pd_row.stages_p50_ms[REST] == pytest.approx(100.0 - 60.0 - 30.0)
    assert rows[0].stages_p50_ms[REST] == pytest.approx(3.0)
    assert pd_row.vs_reference == pytest.approx(100.0 / 45.0)
    table = low_load_markdown(rows)
    assert "| **client TTFT p50** | 45 | 100 |" in table
    assert "2.22x" in table


@pytest.mark.parametrize("name", ["split", "shared-p", "shared-d"])
def test_every_layout_is_what_its_pdserve_up_flags_deploy(name):
    from pathlib import Path

    from pd_serving.cli import _place, build_parser
    from pd_serving.equal_hw import make_layout
    from pd_serving.servers import Connector, CpuSettings, plan_servers

    layout = make_layout(name)
    base = CpuSettings()
    servers = plan_servers(Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID, cpu=base)
    _place(servers, build_parser().parse_args(["up", *layout.pdserve_flags()]))
    p, d = servers
    assert p.cpu == layout.prefill.apply(base)
    assert d.cpu == layout.decode.apply(base)


def test_shared_d_gives_d_both_cores_and_p_core_0_at_a_lower_priority():
    from pd_serving.equal_hw import make_layout
    from pd_serving.servers import CpuSettings

    layout = make_layout("shared-d", low_nice=10, low_omp_wait_policy="passive")
    p, d = layout.prefill.apply(CpuSettings()), layout.decode.apply(CpuSettings())
    assert (d.cpu_bind, d.omp_threads, d.nice, d.worker_in_engine) == ("0-1", 2, 0, True)
    assert (p.cpu_bind, p.omp_threads, p.nice, p.omp_wait_policy) == ("0", 1, 10, "passive")
    assert make_layout("split").pdserve_flags() == [
        "--prefill-cpus", "0", "--prefill-threads", "1", "--decode-cpus", "1",
        "--decode-threads", "1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown layout"):
        make_layout("both")


def test_cpu_ticks_per_process_group_and_core():
    from pd_serving.equal_hw import core_ticks, group_cpu_ticks

    stats = [
        "10 (vllm) S 1 10 10 0 -1 0 0 0 0 0 300 20 0 0",
        "11 (VLLM::Engine (core)) R 10 10 10 0 -1 0 0 0 0 0 500 30 0 0",
        "12 (proxy) S 1 12 12 0 -1 0 0 0 0 0 7 3 0 0",
        "garbage",
    ]
    assert group_cpu_ticks(stats) == {10: 850, 12: 10}
    proc_stat = (
        "cpu  10 0 10 70 10 0 0 0 0 0\n"
        "cpu0 5 0 5 30 10 0 0 0 0 0\n"
        "cpu1 5 0 5 40 0 0 0 0 0 0\nintr 1 2\n"
    )
    assert core_ticks(proc_stat) == [(10, 50), (10, 50)]


def test_cpu_use_splits_systems_client_and_the_rest_of_the_box():
    from pd_serving.equal_hw import CpuSnapshot, cpu_use

    before = CpuSnapshot(0.0, {100: 0, 200: 0}, [(0, 0), (0, 0)], client_s=1.0)
    after = CpuSnapshot(10.0, {100: 500, 200: 100}, [(800, 1000), (600, 1000)], client_s=2.0)
    use = cpu_use(before, after, {"decode0": 100, "proxy": 200, "idle": 300}, ticks_per_s=100)
    assert use is not None
    assert use.seconds["decode0"] == 5.0
    assert use.seconds["proxy"] == 1.0
    assert "idle" not in use.seconds  # paused: used nothing
    assert use.seconds["client"] == 1.0
    # 14 s of busy cores, 6 of them ours (our own process group counts as ours too).
    assert 0 < use.seconds["other"] <= 8.0
    assert use.core_busy == [0.8, 0.6]
    assert use.share("decode0") == 0.5
    assert cpu_use(None, after, {}, ticks_per_s=100) is None


def test_judge_round_by_round_and_flags_busy_rounds():
    def two_rounds(system, itls, goodputs, other=0.0):
        turns = [
            turn(system, [sample(r, 100, [itl] * 10)], step_s=itl / 1000, rnd=r)
            for r, itl in enumerate(itls)
        ]
        p = summarize(turns, Slo(1, 1))
        for r, g in zip(p.rounds, goodputs, strict=True):
            r["goodput_rps"], r["other_cpu_share"] = g, other
        p.slo_attainment, p.goodput_rps = 1.0, sum(goodputs) / 2
        return p

    points = [
        two_rounds("single", [400, 400], [1.0, 1.0]),
        two_rounds("dp", [300, 300], [1.0, 1.2]),
        two_rounds("pd", [100, 300], [1.5, 1.5], other=0.5),
    ]
    verdict = judge(points, single="single", others=["dp"], pd="pd")
    first, second = verdict.rounds
    assert math.isclose(first["itl_p99_ratio"], 0.25, rel_tol=0.05)
    assert math.isclose(second["goodput_ratio"], 1.25)
    assert first["busy"]
    assert second["busy"]
    assert not verdict.met_in_every_round  # round 1: ITL 0.75x, goodput 1.25x
    assert verdict.describe()["met_in_every_round"] is False
