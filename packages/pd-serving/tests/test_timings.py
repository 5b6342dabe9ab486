"""vLLM's histograms read from /metrics, differenced, and the client's timings checked."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from pd_serving.timings import (
    EMPTY,
    FINE_BUCKETS_S,
    ITL,
    TTFT,
    Histogram,
    check_itl,
    check_ttft,
    custom_buckets_arg,
    parse_histograms,
    total,
)

METRICS = """\
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 2.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.02",model_name="m"} 6.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.04",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 10.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.2
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 1.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.05
vllm:num_requests_running{model_name="m"} 3.0
"""


def test_parse_reads_buckets_sums_and_counts():
    hists = parse_histograms(METRICS)
    itl = hists[ITL]
    assert itl.bounds == (0.01, 0.02, 0.04, math.inf)
    assert itl.cumulative == (2.0, 6.0, 10.0, 10.0)
    assert itl.count == 10
    assert math.isclose(itl.mean, 0.02)
    assert hists[TTFT].count == 1
    assert math.isclose(hists[TTFT].sum, 0.05)


def test_absent_histogram_is_empty():
    hists = parse_histograms("vllm:num_requests_running 1\n", [ITL])
    assert hists[ITL] is EMPTY
    assert math.isnan(EMPTY.mean)


def test_label_sets_add_up():
    two_engines = METRICS + METRICS.replace('engine="0"', 'engine="1"')
    assert parse_histograms(two_engines)[ITL].count == 20


def test_difference_and_sum():
    before = parse_histograms(METRICS)[ITL]
    after = Histogram(before.bounds, (3.0, 9.0, 15.0, 16.0), 0.5)
    turn = after - before
    assert turn.cumulative == (1.0, 3.0, 5.0, 6.0)
    assert math.isclose(turn.sum, 0.3)
    assert total([turn, turn]).count == 12
    assert (EMPTY + turn) == turn
    assert (turn - EMPTY) == turn


def test_quantile_interpolates_within_the_bucket():
    itl = parse_histograms(METRICS)[ITL]
    assert math.isclose(itl.quantile(0.5), 0.0175)  # rank 5: 3 of 4 into (0.01, 0.02]
    assert math.isclose(itl.quantile(0.1), 0.005)
    assert itl.quantile(1.0) == 0.04
    assert math.isnan(EMPTY.quantile(0.5))


def test_quantile_in_the_inf_bucket_is_the_highest_bound():
    h = Histogram((0.01, math.inf), (1.0, 4.0), 1.0)
    assert h.quantile(0.99) == 0.01


def test_custom_buckets_are_fine_and_ascending():
    assert list(FINE_BUCKETS_S) == sorted(FINE_BUCKETS_S)
    assert FINE_BUCKETS_S[0] == 0.001
    assert FINE_BUCKETS_S[-1] <= 20
    assert '"inter_token_latency"' in custom_buckets_arg()


def _server(step_s: float, steps: int) -> Histogram:
    bounds = (*FINE_BUCKETS_S, math.inf)
    cumulative = tuple(float(steps if b >= step_s else 0) for b in bounds)
    return Histogram(bounds, cumulative, step_s * steps)


def test_steady_client_agrees():
    gaps = [20.0] * 99
    check = check_itl(gaps, 0, decode_ms=sum(gaps), decode_tokens=99, server=_server(0.02, 99))
    assert check.agrees
    assert check.burst_share == 0
    assert "agrees" in check.note


def test_burst_read_is_flagged_not_agreed():
    # 32 tokens made 20 ms apart, read as one burst: gaps of ~0 and a TPOT of ~0.
    gaps = [0.01] * 31
    check = check_itl(gaps, 0, decode_ms=0.3, decode_tokens=31, server=_server(0.02, 31))
    assert not check.agrees
    assert check.burst_share == 1.0
    assert "burst" in check.note
    assert check.server_mean_ms > 15


def test_tokens_sharing_a_chunk_count_as_bursts():
    gaps = [40.0] * 10
    check = check_itl(gaps, 10, decode_ms=400, decode_tokens=20, server=_server(0.02, 20))
    assert not check.agrees
    assert math.isclose(check.burst_share, 0.5)


def test_no_server_steps_cannot_agree():
    check = check_itl([5.0], 0, decode_ms=5, decode_tokens=1, server=EMPTY)
    assert not check.agrees
    assert "no server" in check.note


@given(st.text(max_size=400))
def test_parse_never_raises_on_garbage(text):
    parse_histograms(text)


@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=8),
    st.floats(0, 1),
)
def test_quantile_is_within_the_bounds(counts, q):
    cumulative = []
    running = 0.0
    for c in counts:
        running += c
        cumulative.append(running)
    bounds = (*tuple(float(i + 1) for i in range(len(counts) - 1)), math.inf)
    h = Histogram(bounds, tuple(cumulative), 0.0)
    value = h.quantile(q)
    if h.count > 0 and len(bounds) > 1:
        assert 0.0 <= value <= bounds[-2]


def _ttft_hist(seconds: list[float]) -> Histogram:
    bounds = (*FINE_BUCKETS_S, math.inf)
    cumulative = tuple(float(sum(s <= b for s in seconds)) for b in bounds)
    return Histogram(bounds, cumulative, sum(seconds))


def test_ttft_of_one_instance_agrees_with_its_histogram():
    server = [0.10, 0.12, 0.30, 0.11]
    client = [1000 * s + 5 for s in server]  # the HTTP hop
    check = check_ttft(client, [(EMPTY, _ttft_hist(server))])
    assert check.agrees, check.note
    assert math.isclose(check.rest_mean_ms, 5.0)
    assert math.isclose(check.server_mean_ms, 157.5)
    assert 100 <= check.last_stage_p50_ms <= 125
    assert "agrees" in check.note


def test_ttft_across_p_and_d_adds_ps_whole_requests_to_ds_first_tokens():
    # Two requests through P (whole request 0.5 s each), one bypassed to D alone; D's TTFT of
    # each (its wait for the KV included) 0.04 s.
    p_whole, d_first = _ttft_hist([0.5, 0.5]), _ttft_hist([0.04, 0.04, 0.04])
    client = [550.0, 552.0, 50.0]
    check = check_ttft(client, [(p_whole, _ttft_hist([0.45, 0.45])), (EMPTY, d_first)])
    assert math.isclose(check.server_mean_ms, (1000 + 120) / 3)
    assert check.agrees, check.note
    assert check.last_stage_p50_ms < 50  # D's own TTFT, not the request's


def test_a_late_client_is_flagged():
    server = [0.05] * 10
    check = check_ttft([150.0] * 10, [(EMPTY, _ttft_hist(server))])
    assert not check.agrees
    assert "late" in check.note


def test_ttft_counts_must_match():
    check = check_ttft([50.0, 50.0], [(EMPTY, _ttft_hist([0.05]))])
    assert not check.agrees
    assert "1 first tokens for 2 requests" in check.note
    assert not check_ttft([50.0], []).agrees
    assert "no server" in check_ttft([50.0], []).note
