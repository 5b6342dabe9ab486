"""pdserve demo's pure parts: its TPOT cell (never 0 for an answer of several tokens, vLLM's
figure read or not), one request's step time from two histogram reads, the proxy's bypasses."""

from __future__ import annotations

import math
import re

from hypothesis import given
from hypothesis import strategies as st
from pd_serving.client import Completion
from pd_serving.demo import Answer, bypass_count, request_tpot_s
from pd_serving.timings import EMPTY, FINE_BUCKETS_S, Histogram

ZERO = re.compile(r"0(\.0*)?[*?]?")


def _answer(tokens: int, client_tpot_s: float, chunks: list[int], server_tpot_s: float) -> Answer:
    completion = Completion(
        text="x" * tokens, completion_tokens=tokens, tpot_s=client_tpot_s, chunk_tokens=chunks
    )
    return Answer(completion, server_tpot_s)


@given(
    tokens=st.integers(2, 64),
    client_tpot_s=st.one_of(st.just(0.0), st.floats(0, 0.2, allow_nan=False)),
    chunks=st.lists(st.integers(1, 8), max_size=64),
    server_tpot_s=st.one_of(st.just(math.nan), st.just(0.0), st.floats(1e-6, 0.2)),
)
def test_tpot_cell_is_never_zero_for_several_tokens(tokens, client_tpot_s, chunks, server_tpot_s):
    cell = _answer(tokens, client_tpot_s, chunks, server_tpot_s).tpot_cell()
    assert not ZERO.fullmatch(cell), cell


def test_a_burst_shows_vllms_step_time_marked():
    burst = _answer(32, 0.0, [32], 0.0038)  # 32 tokens read in one chunk
    assert burst.burst
    assert burst.tpot_cell() == "3.8*"
    steady = _answer(32, 0.0040, [1] * 32, 0.0038)
    assert not steady.burst
    assert steady.tpot_cell() == "3.8"


def test_without_vllms_figure_the_client_shows_only_what_it_saw():
    # The metrics scrape failed (nan): the client's own TPOT, marked unchecked, if every gap
    # was seen; a burst read has nothing to show.
    assert _answer(32, 0.004, [1] * 32, math.nan).tpot_cell() == "4.0?"
    assert _answer(32, 0.0, [1] * 32, math.nan).tpot_cell() == "-"
    assert _answer(32, 0.0001, [16, 16], math.nan).tpot_cell() == "-"
    assert _answer(1, 0.0, [1], 0.004).tpot_cell() == "-"


def _itl(steps_s: list[float]) -> Histogram:
    bounds = (*FINE_BUCKETS_S, math.inf)
    return Histogram(
        bounds, tuple(float(sum(s <= b for s in steps_s)) for b in bounds), sum(steps_s)
    )


def test_request_tpot_from_two_reads():
    before, after = _itl([0.01] * 4), _itl([0.01] * 4 + [0.004] * 31)
    assert math.isclose(request_tpot_s(before, after), 0.004)
    assert math.isnan(request_tpot_s(EMPTY, after))  # a read failed
    assert math.isnan(request_tpot_s(before, before))  # nothing stepped


def test_bypasses_are_counted_from_the_proxys_metrics():
    text = (
        "# HELP pdserve_bypass_total ...\n"
        'pdserve_bypass_total{reason="short_prompt"} 3.0\n'
        'pdserve_bypass_total{reason="idle"} 1.0\n'
        'pdserve_bypass_created{reason="idle"} 1.7e9\n'
    )
    assert bypass_count(text) == 4.0
    assert bypass_count("") == 0.0
    assert math.isnan(bypass_count(None))


def test_the_75m_model_is_the_default_for_qwen2_only():
    from pd_serving.cli import build_parser
    from pd_serving.demo import uses_bench_model

    def uses(*argv: str) -> bool:
        return uses_bench_model(build_parser().parse_args(["demo", *argv]))

    assert uses()
    assert uses("--bench-model")
    assert not uses("--tiny")
    assert not uses("--arch", "mla")
    assert not uses("--model", "/some/model")
