"""The load sweep of ``pdserve bench --rates``: open-loop sending, latency maths, tables, plots.

Pure parts (tested without servers): percentiles, ITL, goodput under a TTFT/TPOT SLO, the
highest rate meeting a TTFT p99 SLO, tables and PNG plots. One I/O part: :func:`sweep_systems`
sends each rate's requests (``workload.plan_rate``) to each system at their scheduled times
(open loop: a request leaves at its arrival time whether or not earlier ones finished) and
summarizes each (rate, system) into a :class:`SweepPoint`. Deployments are ``bench``'s business.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from pd_serving.client import UpstreamHttpError, complete
from pd_serving.workload import SweepRequest

# --- samples and their maths ---------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def inter_token_gaps(token_times_s: Sequence[float]) -> list[float]:
    """Every gap between consecutive streamed chunks that carried tokens (ITL), in seconds."""
    return [b - a for a, b in itertools.pairwise(token_times_s)]


@dataclass
class RequestSample:
    """One request's outcome at one (rate, system); times in ms, ``error`` set when it failed."""

    index: int
    ttft_ms: float = float("nan")
    tpot_ms: float = float("nan")
    latency_ms: float = float("nan")
    output_tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # Tokens that came in a chunk after its first one: gaps the client never saw.
    tokens_sharing_a_chunk: int = 0
    prompt_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT and its TPOT are both within these bounds."""

    ttft_ms: float
    tpot_ms: float

    def met(self, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        """None: the request failed, which never meets the SLO."""
        if ttft_ms is None or tpot_ms is None:
            return False
        return ttft_ms <= self.ttft_ms and tpot_ms <= self.tpot_ms


@dataclass
class SweepPoint:
    """One system at one offered rate: counts, percentiles (ms), throughput, goodput."""

    system: str
    rate: float  # offered, req/s
    requests: int
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    tpot_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    throughput_rps: float  # completed requests / wall
    output_tokens_per_s: float
    goodput_rps: float  # requests meeting the SLO / wall
    slo_attainment: float  # fraction of all requests meeting the SLO
    wall_s: float  # first send -> last answer, summed over the rounds
    load_avg_1m: float | None = None  # the machine's, when this point started
    same_tokens_as_single: bool | None = None  # None: the reference itself, or nothing compared
    mismatched: int = 0  # requests whose tokens differ from the single instance's
    prefill_call_mean_ms: float | None = None  # PD: the proxy's call to P
    errors: list[str] = field(default_factory=list)  # the first few failures
    # Per request (ms, None for a failed one), so other percentiles or SLOs can be computed.
    ttft_ms: list[float | None] = field(default_factory=list)
    tpot_ms: list[float | None] = field(default_factory=list)


def summarize_point(
    system: str, rate: float, samples: Sequence[RequestSample], wall_s: float, slo: Slo
) -> SweepPoint:
    done = [s for s in samples if s.ok]
    ttfts = [s.ttft_ms for s in done]
    tpots = [s.tpot_ms for s in done]
    itls = [gap for s in done for gap in s.itl_ms]

    def per_second(n: float) -> float:
        return n / wall_s if wall_s > 0 else 0.0

    point = SweepPoint(
        system=system,
        rate=rate,
        requests=len(samples),
        completed=len(done),
        failed=len(samples) - len(done),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p90_ms=percentile(ttfts, 90),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p90_ms=percentile(tpots, 90),
        tpot_p99_ms=percentile(tpots, 99),
        itl_p50_ms=percentile(itls, 50),
        itl_p90_ms=percentile(itls, 90),
        itl_p99_ms=percentile(itls, 99),
        throughput_rps=per_second(len(done)),
        output_tokens_per_s=per_second(sum(s.output_tokens for s in done)),
        goodput_rps=0.0,
        slo_attainment=0.0,
        wall_s=wall_s,
        errors=[f"#{s.index}: {s.error}" for s in samples if s.error][:5],
        ttft_ms=[s.ttft_ms if s.ok else None for s in samples],
        tpot_ms=[s.tpot_ms if s.ok else None for s in samples],
    )
    return regrade(point, slo)


def regrade(point: SweepPoint, slo: Slo) -> SweepPoint:
    """``point`` with goodput and SLO attainment under ``slo``, from its per-request samples
    (so a stored sweep can be judged against another SLO without running it again)."""
    good = sum(slo.met(t, p) for t, p in zip(point.ttft_ms, point.tpot_ms, strict=True))
    return replace(
        point,
        goodput_rps=good / point.wall_s if point.wall_s > 0 else 0.0,
        slo_attainment=good / point.requests if point.requests else 0.0,
    )


def compare_tokens(reference: Sequence[RequestSample], samples: Sequence[RequestSample]) -> int:
    """How many requests answered by both differ in tokens; -1 when none was answered by both."""
    pairs = [(a, b) for a, b in zip(reference, samples, strict=True) if a.ok and b.ok]
    if not pairs:
        return -1
    return sum(a.token_ids != b.token_ids for a, b in pairs)


def meets_ttft_slo(point: SweepPoint, slo_ttft_ms: float) -> bool:
    """Every request answered and TTFT p99 within the SLO."""
    return point.failed == 0 and point.completed > 0 and point.ttft_p99_ms <= slo_ttft_ms


def max_rate_meeting_slo(points: Sequence[SweepPoint], system: str, slo_ttft_ms: float):
    """The highest swept rate up to which ``system`` meets the TTFT p99 SLO at every rate.

    Returns ``(rate, at_top)``: ``rate`` None when even the lowest rate misses it; ``at_top``
    when the highest swept rate still meets it (the real limit lies above the sweep).
    """
    mine = sorted((p for p in points if p.system == system), key=lambda p: p.rate)
    best = None
    for point in mine:
        if not meets_ttft_slo(point, slo_ttft_ms):
            return best, False
        best = point.rate
    return best, best is not None


def describe_max_rate(result: tuple[float | None, bool], slo_ttft_ms: float) -> str:
    rate, at_top = result
    if rate is None:
        return f"none (misses TTFT p99 <= {slo_ttft_ms:g} ms at the lowest rate)"
    return f"{rate:g} req/s" + (" (the highest swept; the limit is above)" if at_top else "")


# --- driving the load ----------------------------------------------------------------------


async def run_open_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    requests: Sequence[SweepRequest],
    *,
    timeout_s: float,
) -> tuple[list[RequestSample], float]:
    """Send each request at its ``arrival_s`` (from now), streaming; returns samples and wall.

    Open loop: a request leaves on schedule however many are still in flight. A request that
    fails, times out or answers fewer tokens than asked counts as failed, not as a crash.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    origin = requests[0].arrival_s if requests else 0.0

    async def one(req: SweepRequest) -> RequestSample:
        await asyncio.sleep(max(0.0, start + req.arrival_s - origin - loop.time()))
        try:
            async with asyncio.timeout(timeout_s):
                answer = await complete(
                    session, base_url, model, req.prompt, max_tokens=req.output_tokens
                )
        except TimeoutError:
            return RequestSample(req.index, error=f"no answer within {timeout_s:g} s")
        except (aiohttp.ClientError, UpstreamHttpError, ValueError) as exc:
            return RequestSample(req.index, error=f"{type(exc).__name__}: {exc}"[:300])
        sample = RequestSample(
            req.index,
            ttft_ms=answer.ttft_s * 1000,
            tpot_ms=answer.tpot_s * 1000,
            latency_ms=answer.latency_s * 1000,
            output_tokens=answer.completion_tokens,
            itl_ms=[gap * 1000 for gap in inter_token_gaps(answer.token_times_s)],
            token_ids=answer.token_ids,
            tokens_sharing_a_chunk=sum(k - 1 for k in answer.chunk_tokens),
            prompt_tokens=req.prompt_tokens,
        )
        if answer.completion_tokens != req.output_tokens:
            sample.error = f"{answer.completion_tokens} of {req.output_tokens} tokens"
        return sample

    samples = await asyncio.gather(*(one(r) for r in requests))
    return list(samples), loop.time() - start


def split_rounds(requests: Sequence[SweepRequest], rounds: int) -> list[list[SweepRequest]]:
    """Contiguous slices in arrival order (each a stretch of the same Poisson process)."""
    rounds = max(1, min(rounds, len(requests)))
    size = math.ceil(len(requests) / rounds)
    return [list(requests[i : i + size]) for i in range(0, len(requests), size)]


PrefillProbe = Callable[[aiohttp.ClientSession, str], Any]


async def sweep_systems(
    systems: Sequence[tuple[str, str]],
    model: str,
    plans: dict[float, list[SweepRequest]],
    *,
    slo: Slo,
    rounds: int = 2,
    warmup: int = 2,
    timeout_s: float = 120.0,
    prefill_probe: PrefillProbe | None = None,
    console: Console | None = None,
) -> list[SweepPoint]:
    """Every rate's plan on every system; the first system is the reference for equality.

    Per rate the plan is cut into ``rounds`` slices and the systems take turns slice by slice
    (one at a time, never competing for the CPU), so a burst of outside load falls on all.
    ``prefill_probe(session, url)`` returns a proxy's (sum, count) of P calls, or None.
    """
    points: list[SweepPoint] = []
    connector = aiohttp.TCPConnector(limit=0)  # open loop: the client must never queue
    timeout = aiohttp.ClientTimeout(total=None)  # per request: asyncio.timeout(timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _name, url in systems:
            warm = [SweepRequest(i, 0.0, 0, 4, f"warm up {i}") for i in range(warmup)]
            await run_open_loop(session, url, model, warm, timeout_s=timeout_s)
        for rate, plan in sorted(plans.items()):
            samples: dict[str, list[RequestSample]] = {name: [] for name, _ in systems}
            walls = dict.fromkeys(samples, 0.0)
            loads: dict[str, list[float]] = {name: [] for name in samples}
            p_calls = {name: [0.0, 0.0] for name in samples}
            slices = split_rounds(plan, rounds)
            for r, part in enumerate(slices):
                for name, url in systems:
                    if console:
                        console.print(
                            f"  {rate:g} req/s, round {r + 1}/{len(slices)}: {name} "
                            f"({len(part)} requests)"
                        )
                    loads[name].append(os.getloadavg()[0])
                    before = await prefill_probe(session, url) if prefill_probe else None
                    got, wall = await run_open_loop(session, url, model, part, timeout_s=timeout_s)
                    after = await prefill_probe(session, url) if prefill_probe else None
                    if before and after:
                        p_calls[name][0] += after[0] - before[0]
                        p_calls[name][1] += after[1] - before[1]
                    samples[name] += got
                    walls[name] += wall
            reference = samples[systems[0][0]]
            for i, (name, _) in enumerate(systems):
                point = summarize_point(name, rate, samples[name], walls[name], slo)
                point.load_avg_1m = sum(loads[name]) / len(loads[name])
                total, count = p_calls[name]
                if count:
                    point.prefill_call_mean_ms = 1000 * total / count
                if i:
                    mismatched = compare_tokens(reference, samples[name])
                    point.mismatched = max(0, mismatched)
                    point.same_tokens_as_single = None if mismatched < 0 else mismatched == 0
                points.append(point)
    return points


# --- output --------------------------------------------------------------------------------


def _ms(*values: float) -> str:
    """``76 / 90 / 147``: whole ms from 10 up, one decimal below."""
    return " / ".join(
        "-" if math.isnan(v) else f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in values
    )


def _same(point: SweepPoint) -> str:
    if point.same_tokens_as_single is None:
        return "-"
    return "true" if point.same_tokens_as_single else f"false ({point.mismatched})"


SWEEP_COLUMNS = (
    "rate req/s",
    "system",
    "done / failed",
    "TTFT p50/p90/p99 ms",
    "TPOT p50/p90/p99 ms",
    "ITL p50/p90/p99 ms",
    "req/s",
    "out tok/s",
    "goodput req/s",
    "same tokens",
    "load avg",
)


def _row(p: SweepPoint) -> list[str]:
    return [
        f"{p.rate:g}",
        p.system,
        f"{p.completed} / {p.failed}",
        _ms(p.ttft_p50_ms, p.ttft_p90_ms, p.ttft_p99_ms),
        _ms(p.tpot_p50_ms, p.tpot_p90_ms, p.tpot_p99_ms),
        _ms(p.itl_p50_ms, p.itl_p90_ms, p.itl_p99_ms),
        f"{p.throughput_rps:.2f}",
        f"{p.output_tokens_per_s:.0f}",
        f"{p.goodput_rps:.2f}",
        _same(p),
        "-" if p.load_avg_1m is None else f"{p.load_avg_1m:.0f}",
    ]


def render_sweep_table(points: Sequence[SweepPoint], title: str) -> Table:
    table = Table(title=title)
    for i, col in enumerate(SWEEP_COLUMNS):
        header = col.replace(" p50/", "\np50/").replace(" req/s", "\nreq/s").replace(" / ", "\n/ ")
        header = header.replace("same tokens", "same\ntokens").replace(" tok/s", "\ntok/s")
        header = header.replace("load avg", "load\navg")
        table.add_column(header, justify="left" if i in (1, 9) else "right", no_wrap=True)
    for point in points:
        table.add_row(*_row(point))
    return table


def sweep_markdown_table(points: Sequence[SweepPoint]) -> str:
    lines = ["| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    lines += ["| " + " | ".join(_row(p)) + " |" for p in points]
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no NaN: a percentile of no samples becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def sweep_payload(points: Sequence[SweepPoint], meta: dict[str, Any]) -> dict[str, Any]:
    return _finite({"meta": meta, "points": [asdict(p) for p in points]})


PLOTTED = (
    ("ttft_p50_ms", "TTFT p50"),
    ("ttft_p90_ms", "TTFT p90"),
    ("ttft_p99_ms", "TTFT p99"),
    ("tpot_p50_ms", "TPOT p50"),
    ("tpot_p99_ms", "TPOT p99"),
    ("itl_p99_ms", "ITL p99"),
)


def write_plots(points: Sequence[SweepPoint], stem: Path, slo: Slo, title: str) -> list[Path]:
    """``STEM_latency.png`` (percentiles against rate, one line per system, log scale) and
    ``STEM_goodput.png`` (goodput and throughput against rate); returns the paths."""
    # Heavy import, here only; a bare Figure renders PNG with the Agg canvas (no pyplot state).
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    systems = list(dict.fromkeys(p.system for p in points))
    rates = sorted({p.rate for p in points})

    def series(system: str, attr: str, log: bool) -> tuple[list[float], list[float]]:
        """A system's (rate, value) line; a point with no value (nothing answered) is left out."""
        mine = sorted((p for p in points if p.system == system), key=lambda p: p.rate)
        pairs = [(p.rate, getattr(p, attr)) for p in mine]
        pairs = [(r, v) for r, v in pairs if v is not None and math.isfinite(v)]
        pairs = [(r, v) for r, v in pairs if v > 0 or not log]
        return [r for r, _ in pairs], [v for _, v in pairs]

    def rate_axis(ax: Any, log: bool) -> None:
        if log and len(rates) > 1 and rates[-1] / rates[0] >= 4:
            ax.set_xscale("log", base=2)  # rates usually double: evenly spaced
        ax.set_xticks(rates, labels=[f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(True, alpha=0.3)

    stem.parent.mkdir(parents=True, exist_ok=True)
    latency = Figure(figsize=(13, 7.5), layout="constrained")
    latency.suptitle(f"{title}: latency against request rate")
    for ax, (attr, label) in zip(latency.subplots(2, 3).flat, PLOTTED, strict=True):
        for system in systems:
            ax.plot(*series(system, attr, log=True), marker="o", label=system)
        bound = slo.ttft_ms if attr.startswith("ttft") else slo.tpot_ms
        if not attr.startswith("itl"):
            ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_yscale("log")  # the systems differ by 10x and more
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(label)
        ax.set_ylabel("ms")
        rate_axis(ax, log=True)
    latency.axes[0].legend(fontsize="small")
    latency_path = stem.with_name(stem.name + "_latency.png")
    latency.savefig(latency_path, dpi=100)

    goodput = Figure(figsize=(11, 4.5), layout="constrained")
    goodput.suptitle(
        f"{title}: goodput (TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms)"
    )
    left, right = goodput.subplots(1, 2)
    for system in systems:
        left.plot(*series(system, "goodput_rps", log=False), marker="o", label=system)
        right.plot(*series(system, "throughput_rps", log=False), marker="o", label=system)
    for ax, label in ((left, "goodput (req/s meeting the SLO)"), (right, "throughput (req/s)")):
        ax.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered")
        ax.set_title(label)
        ax.set_ylabel("req/s")
        ax.set_ylim(bottom=0)
        rate_axis(ax, log=False)
    left.legend(fontsize="small")
    goodput_path = stem.with_name(stem.name + "_goodput.png")
    goodput.savefig(goodput_path, dpi=100)
    return [latency_path, goodput_path]


_PERCENTILE = re.compile(r"_p\d+_ms$")


def load_points(payload: dict[str, Any]) -> list[SweepPoint]:
    """The points of a sweep JSON (e.g. to replot it); nulls come back as nan."""
    nan = float("nan")
    points = []
    for raw in payload["points"]:
        values = {k: (nan if v is None and _PERCENTILE.search(k) else v) for k, v in raw.items()}
        points.append(SweepPoint(**values))
    return points


def machine_load() -> dict[str, Any]:
    one, five, fifteen = os.getloadavg()
    return {"load_avg": [one, five, fifteen], "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
