"""Token timings a user can trust: the client's stream against vLLM's own histograms.

A client times tokens when it reads them, so when the server's answer arrives in bursts (several
SSE events in one TCP read, or several tokens in one event, as vLLM's API server merges outputs
it fell behind on) the client sees gaps of zero and one long gap: a TPOT of 0 ms for a 32-token
answer, an ITL p50 of 0. vLLM times every engine step itself
(``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:request_time_per_output_token_seconds`` on vllm 0.32). This module reads those histograms
from an instance's ``/metrics`` text, differences two reads (before and after a system's turn),
adds the instances of one system, estimates percentiles from the buckets, and checks the
client's numbers against them. Pure: no I/O.

    /metrics before --parse--> Histograms --.
                                            +-- after - before (+ other instances)
    /metrics after  --parse--> Histograms --'        |
                                                     v
    client token times ----------------------> check_itl  -> TimingCheck (agrees | burst)
    client TTFTs ------------------------------> check_ttft -> TtftCheck (agrees | client late)

TTFT across stages: vLLM times a request from its arrival at the engine, so on 1P1D (sequential
dispatch) the server's part of one request's TTFT is P's whole request
(``vllm:e2e_request_latency_seconds``: queue, prefill, its one token) plus D's TTFT (its wait
for the KV included), or D's TTFT alone for a request that bypassed P. Percentiles of a sum
cannot be read from the stages' buckets, so the check compares means: the stages' sums over the
turn divided by the requests, against the client's mean. The difference is the proxy, the HTTP
hops and the client's own lateness.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
HISTOGRAMS = (TTFT, ITL, TPOT, E2E)

# Finer buckets than vLLM's defaults (whose ITL ladder starts at 10 ms and jumps 0.1/0.15/0.2),
# so percentiles read from the buckets land within a few percent: 1 ms to 20 s, ~1.25x apart.
FINE_BUCKETS_S: tuple[float, ...] = tuple(
    round(0.001 * 1.25**i, 6) for i in range(0, 45) if 0.001 * 1.25**i <= 20.0
)


def custom_buckets_arg() -> str:
    """The value of vLLM's ``--custom-histogram-buckets`` giving TTFT and ITL the fine ladder."""
    buckets = list(FINE_BUCKETS_S)
    return json.dumps({"time_to_first_token": buckets, "inter_token_latency": buckets})


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: ``cumulative[i]`` observations <= ``bounds[i]``;
    the last bound is +Inf, so ``cumulative[-1] == count``."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else float("nan")

    def __sub__(self, before: Histogram) -> Histogram:
        return self._combine(before, -1.0)

    def __add__(self, other: Histogram) -> Histogram:
        return self._combine(other, 1.0)

    def _combine(self, other: Histogram, sign: float) -> Histogram:
        if not other.bounds:
            return self
        if not self.bounds:
            return Histogram(
                other.bounds, tuple(sign * c for c in other.cumulative), sign * other.sum
            )
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets")
        cumulative = tuple(
            a + sign * b for a, b in zip(self.cumulative, other.cumulative, strict=True)
        )
        return Histogram(self.bounds, cumulative, self.sum + sign * other.sum)

    def quantile(self, q: float) -> float:
        """Prometheus' ``histogram_quantile``: linear within the bucket holding rank q*count
        (q in [0, 1]); nan when empty; the highest finite bound when it falls in +Inf."""
        total = self.count
        if total <= 0:
            return float("nan")
        rank = q * total
        i = bisect.bisect_left(self.cumulative, rank)
        i = min(i, len(self.bounds) - 1)
        if math.isinf(self.bounds[i]):
            return self.bounds[i - 1] if i else float("nan")
        lo_bound = self.bounds[i - 1] if i else 0.0
        lo_count = self.cumulative[i - 1] if i else 0.0
        in_bucket = self.cumulative[i] - lo_count
        if in_bucket <= 0:
            return self.bounds[i]
        return lo_bound + (self.bounds[i] - lo_bound) * (rank - lo_count) / in_bucket


EMPTY = Histogram((), (), 0.0)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LE = re.compile(r'(?:^|,)\s*le="([^"]*)"')


def parse_histograms(text: str, names: Iterable[str] = HISTOGRAMS) -> dict[str, Histogram]:
    """The named histograms of a ``/metrics`` text, label sets other than ``le`` added up (one
    instance may report per engine or model). A name that is absent maps to ``EMPTY``."""
    wanted = set(names)
    buckets: dict[str, dict[float, float]] = {n: {} for n in wanted}
    sums = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        metric, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if metric.endswith("_bucket") and metric[: -len("_bucket")] in wanted:
            le = _LE.search(labels or "")
            if le is None:
                continue
            bound = float(le.group(1))  # "+Inf" parses as inf
            per = buckets[metric[: -len("_bucket")]]
            per[bound] = per.get(bound, 0.0) + value
        elif metric.endswith("_sum") and metric[: -len("_sum")] in wanted:
            sums[metric[: -len("_sum")]] += value
    out = {}
    for name in wanted:
        per = buckets[name]
        if not per:
            out[name] = EMPTY
            continue
        bounds = tuple(sorted(per))
        out[name] = Histogram(bounds, tuple(per[b] for b in bounds), sums[name])
    return out


def total(histograms: Iterable[Histogram]) -> Histogram:
    out = EMPTY
    for h in histograms:
        out = out + h
    return out


# --- the check -----------------------------------------------------------------------------

# A gap this much shorter than the server's median step cannot be a step: the client read
# tokens that had queued up (a burst).
BURST_FRACTION_OF_STEP = 0.25
# The client's numbers are trusted when at most this share of its gaps are bursts and its mean
# per-token time is within this of the server's.
MAX_BURST_SHARE = 0.05
MAX_MEAN_DEVIATION = 0.25


@dataclass(frozen=True)
class TimingCheck:
    """The client's inter-token timing against the server's, in ms."""

    client_p50_ms: float
    client_p99_ms: float
    client_mean_ms: float  # per token: (last - first token) / (tokens - 1), over all requests
    server_p50_ms: float
    server_p99_ms: float
    server_mean_ms: float
    server_steps: int  # ITL observations on the server
    burst_share: float  # the client's gaps (and tokens sharing a chunk) read as bursts
    agrees: bool

    @property
    def note(self) -> str:
        if self.server_steps == 0:
            return "no server ITL to check against"
        if self.agrees:
            return "client agrees with server"
        return (
            f"client read bursts ({100 * self.burst_share:.0f}% of gaps); "
            "server's step times are the true ITL"
        )


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def check_itl(
    gaps_ms: Sequence[float],
    tokens_sharing_a_chunk: int,
    decode_ms: float,
    decode_tokens: int,
    server: Histogram,
) -> TimingCheck:
    """``gaps_ms``: every gap between the client's token-carrying chunks; ``tokens_sharing_a_
    chunk``: tokens that came in a chunk after its first (gaps of zero the client never saw);
    ``decode_ms`` / ``decode_tokens``: the sums, over requests, of (last - first token time)
    and (tokens - 1); ``server``: the ITL histogram of the same requests."""
    server_p50 = 1000 * server.quantile(0.5)
    steps = int(server.count)
    threshold = BURST_FRACTION_OF_STEP * server_p50 if steps else 0.0
    bursts = sum(g < threshold for g in gaps_ms) + tokens_sharing_a_chunk
    observed = len(gaps_ms) + tokens_sharing_a_chunk
    share = bursts / observed if observed else 0.0
    client_mean = decode_ms / decode_tokens if decode_tokens else float("nan")
    server_mean = 1000 * server.mean
    close = (
        steps > 0
        and math.isfinite(client_mean)
        and abs(client_mean - server_mean) <= MAX_MEAN_DEVIATION * server_mean
    )
    return TimingCheck(
        client_p50_ms=_percentile(gaps_ms, 0.5),
        client_p99_ms=_percentile(gaps_ms, 0.99),
        client_mean_ms=client_mean,
        server_p50_ms=server_p50,
        server_p99_ms=1000 * server.quantile(0.99),
        server_mean_ms=server_mean,
        server_steps=steps,
        burst_share=share,
        agrees=steps > 0 and share <= MAX_BURST_SHARE and close,
    )


# The client's mean TTFT may exceed the server's by this share plus this much (the proxy's two
# calls and the HTTP hops: 5-18 ms one request at a time, README "Low load") before the
# client's own timing is suspect (its event loop late to read the first token).
MAX_TTFT_REST_SHARE = 0.25
TTFT_REST_ALLOWANCE_MS = 25.0


@dataclass(frozen=True)
class TtftCheck:
    """The client's TTFT against the server's, in ms (module docstring: TTFT across stages)."""

    client_p50_ms: float
    client_p99_ms: float
    client_mean_ms: float
    server_mean_ms: float  # per request: the earlier stages' whole requests + the last's TTFT
    last_stage_p50_ms: float  # the last stage's own TTFT histogram (D's, or the instance's)
    last_stage_p99_ms: float
    rest_mean_ms: float  # client mean - server mean: proxy, HTTP hops, client lateness
    requests: int
    last_stage_requests: int
    agrees: bool

    @property
    def note(self) -> str:
        if self.last_stage_requests == 0:
            return "no server TTFT to check against"
        if self.last_stage_requests != self.requests:
            return (
                f"the server counted {self.last_stage_requests} first tokens for "
                f"{self.requests} requests"
            )
        if self.agrees:
            return "client TTFT agrees with server"
        if self.rest_mean_ms < 0:
            return "client TTFT under the server's: the stages overlap (parallel dispatch?)"
        return (
            f"client TTFT {self.rest_mean_ms:.0f} ms over the server's on average: the client "
            "or the proxy was late"
        )


def check_ttft(
    ttfts_ms: Sequence[float], stages: Sequence[tuple[Histogram, Histogram]]
) -> TtftCheck:
    """``ttfts_ms``: the client's TTFT of each answered request; ``stages``: per stage of a
    request, in order, (its whole-request histogram, its TTFT histogram) over the same turn,
    the stage's instances added up. The earlier stages count whole requests (each hands over
    when its request finishes), the last one its first token."""
    requests = len(ttfts_ms)
    client_mean = sum(ttfts_ms) / requests if requests else float("nan")
    if stages:
        *earlier, (_, last) = stages
        server_s = sum(e2e.sum for e2e, _ in earlier) + last.sum
        last_count = int(last.count)
    else:
        last, server_s, last_count = EMPTY, 0.0, 0
    server_mean = 1000 * server_s / requests if requests and last_count else float("nan")
    rest = client_mean - server_mean
    agrees = (
        requests > 0
        and last_count == requests
        and math.isfinite(rest)
        and -max(1.0, 0.01 * server_mean)
        <= rest
        <= MAX_TTFT_REST_SHARE * server_mean + TTFT_REST_ALLOWANCE_MS
    )
    return TtftCheck(
        client_p50_ms=_percentile(ttfts_ms, 0.5),
        client_p99_ms=_percentile(ttfts_ms, 0.99),
        client_mean_ms=client_mean,
        server_mean_ms=server_mean,
        last_stage_p50_ms=1000 * last.quantile(0.5),
        last_stage_p99_ms=1000 * last.quantile(0.99),
        rest_mean_ms=rest,
        requests=requests,
        last_stage_requests=last_count,
        agrees=agrees,
    )
