"""PD against one instance on equal hardware, under the mixed load PD is for.

Three systems on the same two cores, each measured alone (the others paused with SIGSTOP, so
they take no CPU), taking turns::

    single   one vLLM instance, every process on cores 0-1, 2 OpenMP threads
    2x DP    two vLLM instances, one per core, behind `pdserve proxy` (no P: each prefills
             its own requests; the proxy balances by load)
    1P1D     P on core 0, D on core 1, behind `pdserve proxy` (HybridConnector); other
             placements of P and D: :data:`LAYOUTS`, each with its `pdserve up` flags

    rate r:   round 1: single, 2x DP, 1P1D   round 2: 2x DP, 1P1D, single   ...
              (each round a slice of the same Poisson schedule; the order rotates)

The 2x DP system runs on the P and D instances themselves (a request without
``kv_transfer_params`` is a plain request to them), so the machine holds three instances, not
five. Prefix caching is off on every instance: each system gets the same prompts.

Per turn the client's token times are kept and every instance's vLLM histograms
(``timings``) are read before and after, so each (system, rate) point carries the server's
ITL/TTFT/TPOT next to the client's and says whether they agree. Pure parts (tested without
servers): :func:`summarize`, :class:`Slo`, tables and the plot. The I/O shell is
:func:`run_equal_hw`; deployments are made by ``benchmarks/bench_equal_hw.py``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from pd_serving.launcher import ManagedProcess
from pd_serving.sweep import RequestSample, compare_tokens, percentile, run_open_loop, split_rounds
from pd_serving.timings import (
    E2E,
    EMPTY,
    HISTOGRAMS,
    ITL,
    TPOT,
    TTFT,
    Histogram,
    check_itl,
    check_ttft,
    total,
)
from pd_serving.timings import parse_histograms as parse_metrics
from pd_serving.workload import SweepRequest

# --- the systems -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one vLLM instance of a 1P1D layout runs: its cores (every process), OpenMP
    threads, CPU priority, ``OMP_WAIT_POLICY`` and whether its worker runs inside its
    engine-core process (``servers.CpuSettings``'s fields of the same meaning)."""

    cpus: str
    threads: int = 1
    nice: int = 0
    omp_wait_policy: str | None = None
    worker_in_engine: bool = False

    def apply(self, base: Any) -> Any:
        """``base`` (a ``CpuSettings``) placed here."""
        return replace(
            base,
            cpu_bind=self.cpus,
            omp_threads=self.threads,
            nice=self.nice,
            omp_wait_policy=self.omp_wait_policy,
            worker_in_engine=self.worker_in_engine,
        )

    def pdserve_flags(self, role: str) -> list[str]:
        """The ``pdserve up`` flags that give a ``role`` ("prefill"/"decode") instance this."""
        flags = [f"--{role}-cpus", self.cpus, f"--{role}-threads", str(self.threads)]
        if self.nice:
            flags += [f"--{role}-nice", str(self.nice)]
        if self.omp_wait_policy:
            flags += [f"--{role}-omp-wait-policy", self.omp_wait_policy]
        if self.worker_in_engine:
            flags.append(f"--{role}-worker-in-engine")
        return flags


@dataclass(frozen=True)
class Layout:
    """Where 1P1D's P and D run on the two cores."""

    name: str
    prefill: Placement
    decode: Placement

    def pdserve_flags(self) -> list[str]:
        return self.prefill.pdserve_flags("prefill") + self.decode.pdserve_flags("decode")


# split:    P on core 0, D on core 1, a thread each (DP's two instances are these);
# shared-p: P on cores 0-1 (two threads) at a lower priority, D on core 1;
# shared-d: D on cores 0-1 (two threads, its worker in the engine-core process: no 1 s
#           sched_yield spin after each step), P on core 0 at a lower priority: whenever D
#           steps it takes core 0 from P.
LAYOUTS = ("split", "shared-p", "shared-d")


def make_layout(
    name: str,
    *,
    low_nice: int = 10,
    low_omp_wait_policy: str | None = "passive",
    low_worker_in_engine: bool = False,
    d_worker_in_engine: bool = False,
    worker_in_engine: bool = False,
) -> Layout:
    """One of ``LAYOUTS``; ``low_*``: the instance that shares a core at a lower priority;
    ``worker_in_engine``: every instance's worker in its engine-core process."""
    low = {
        "nice": low_nice,
        "omp_wait_policy": low_omp_wait_policy,
        "worker_in_engine": low_worker_in_engine or worker_in_engine,
    }
    split_d = Placement("1", worker_in_engine=d_worker_in_engine or worker_in_engine)
    if name == "split":
        return Layout(name, Placement("0", worker_in_engine=worker_in_engine), split_d)
    if name == "shared-p":
        return Layout(name, Placement("0-1", threads=2, **low), split_d)
    if name == "shared-d":
        return Layout(name, Placement("0", **low), Placement("0-1", 2, worker_in_engine=True))
    raise ValueError(f"unknown layout {name!r} (one of {', '.join(LAYOUTS)})")


@dataclass
class SystemUnderTest:
    """``url``: where requests go; ``stages``: the vLLM instances' URLs per stage of a request
    (P's, then D's; one stage for a plain instance), whose histograms are read; ``processes``:
    what must run during its turn (everything else the benchmark started is paused)."""

    name: str
    url: str
    stages: list[list[str]]
    processes: list[ManagedProcess] = field(default_factory=list)


@dataclass
class Turn:
    """One system's slice of one round at one rate."""

    system: str
    rate: float
    round: int
    samples: list[RequestSample]
    wall_s: float
    # Per stage, the histograms' difference over the turn (instances of a stage added up).
    server: list[dict[str, Histogram]]
    load_avg_1m: float
    # CPU seconds over the turn: each process the benchmark started (by name), the client (this
    # process), "other" (everything else on the box), and each core's busy share.
    cpu: CpuUse | None = None


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when its TTFT is within ``ttft_ms`` and the 99th percentile of
    its own inter-token gaps within ``itl_ms`` (a 256-token answer may stall twice)."""

    ttft_ms: float
    itl_ms: float

    def met(self, sample: RequestSample) -> bool:
        if not sample.ok:
            return False
        gaps = sample.itl_ms + [0.0] * sample.tokens_sharing_a_chunk
        itl = percentile(gaps, 99) if gaps else 0.0
        return sample.ttft_ms <= self.ttft_ms and itl <= self.itl_ms


# --- where the CPU goes during a turn --------------------------------------------------------


def group_cpu_ticks(stats: Iterable[str]) -> dict[int, int]:
    """User + system clock ticks per process group, from ``/proc/<pid>/stat`` texts (each
    process the benchmark starts leads a group of its own, its children in it)."""
    out: dict[int, int] = {}
    for text in stats:
        _, _, after = text.rpartition(")")  # the command name may hold spaces and parentheses
        fields = after.split()
        if len(fields) < 13:
            continue
        try:
            group, ticks = int(fields[2]), int(fields[11]) + int(fields[12])
        except ValueError:
            continue
        out[group] = out.get(group, 0) + ticks
    return out


def core_ticks(proc_stat: str) -> list[tuple[int, int]]:
    """(busy, total) clock ticks of each core, from ``/proc/stat`` (idle and iowait are not
    busy; guest time is inside user time already)."""
    out = []
    for line in proc_stat.splitlines():
        name, *values = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()) or len(values) < 8:
            continue
        ticks = [int(v) for v in values[:8]]
        total_ticks = sum(ticks)
        out.append((total_ticks - ticks[3] - ticks[4], total_ticks))
    return out


@dataclass
class CpuUse:
    """CPU seconds over one turn: per process the benchmark started (by name), ``client``
    (the benchmark's own process: the load generator) and ``other`` (the rest of the box:
    other jobs); and each core's busy share."""

    wall_s: float
    seconds: dict[str, float]
    core_busy: list[float]

    def share(self, name: str) -> float:
        """Cores' worth of ``name``'s CPU over the turn (1.0: one core all the time)."""
        return self.seconds.get(name, 0.0) / self.wall_s if self.wall_s > 0 else float("nan")


@dataclass
class CpuSnapshot:
    at: float
    groups: dict[int, int]
    cores: list[tuple[int, int]]
    client_s: float


def cpu_snapshot() -> CpuSnapshot | None:
    """Every process group's CPU ticks, the cores' and this process's own; None off Linux."""
    import resource

    try:
        cores = core_ticks(Path("/proc/stat").read_text())
    except OSError:
        return None
    stats = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stats.append(Path(entry.path, "stat").read_text())
            except OSError:
                continue  # exited meanwhile
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return CpuSnapshot(
        time.monotonic(), group_cpu_ticks(stats), cores, usage.ru_utime + usage.ru_stime
    )


def cpu_use(
    before: CpuSnapshot | None,
    after: CpuSnapshot | None,
    groups: dict[str, int],
    *,
    ticks_per_s: float,
) -> CpuUse | None:
    """What the processes leading ``groups`` (name -> process group), the client and the rest
    of the box used between the snapshots."""
    if before is None or after is None:
        return None
    seconds = {
        name: (after.groups.get(g, 0) - before.groups.get(g, 0)) / ticks_per_s
        for name, g in groups.items()
    }
    client = after.client_s - before.client_s
    mine = set(groups.values()) | {os.getpgrp()}
    busy = sum(a[0] - b[0] for a, b in zip(after.cores, before.cores, strict=False))
    ours = sum(after.groups.get(g, 0) - before.groups.get(g, 0) for g in mine)
    other = max(0.0, (busy - ours) / ticks_per_s)
    seconds = {k: v for k, v in seconds.items() if v > 0} | {"client": client, "other": other}
    shares = [
        (a[0] - b[0]) / (a[1] - b[1]) if a[1] > b[1] else float("nan")
        for a, b in zip(after.cores, before.cores, strict=False)
    ]
    return CpuUse(after.at - before.at, seconds, shares)


def cpu_share(turns: Sequence[Turn]) -> dict[str, float]:
    """Cores' worth of each name's CPU over the turns together."""
    used = [t.cpu for t in turns if t.cpu is not None]
    wall = sum(u.wall_s for u in used)
    names = dict.fromkeys(n for u in used for n in u.seconds)
    return {n: sum(u.seconds.get(n, 0.0) for u in used) / wall for n in names} if wall else {}


def core_busy(turns: Sequence[Turn]) -> list[float]:
    used = [t.cpu for t in turns if t.cpu is not None and t.cpu.core_busy]
    if not used:
        return []
    wall = sum(u.wall_s for u in used)
    cores = min(len(u.core_busy) for u in used)
    return [sum(u.core_busy[i] * u.wall_s for u in used) / wall for i in range(cores)]


# --- the maths -------------------------------------------------------------------------------


@dataclass
class EqualHwPoint:
    """One system at one offered rate, all rounds together; times in ms."""

    system: str
    rate: float
    requests: int
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    # The client's per-token gaps (tokens sharing a chunk count as gaps of 0).
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    itl_max_ms: float  # the longest gap any request saw (a stall)
    tpot_p50_ms: float
    tpot_p99_ms: float
    # vLLM's own, from its histograms (decode stage): per step, and per request.
    server_itl_p50_ms: float
    server_itl_p90_ms: float
    server_itl_p99_ms: float
    server_tpot_p50_ms: float
    server_tpot_p99_ms: float
    # Per request, the server's part of the TTFT (timings.check_ttft: the earlier stages'
    # whole requests, then the last stage's first token), and the last stage's own TTFT.
    server_ttft_mean_ms: float
    timing_agrees: bool
    timing_note: str
    burst_share: float
    throughput_rps: float
    output_tokens_per_s: float
    goodput_rps: float
    slo_attainment: float
    wall_s: float
    load_avg_1m: float
    # Per round: ITL p99 (client, and server), goodput: the spread between rounds.
    rounds: list[dict[str, float]] = field(default_factory=list)
    same_tokens_as_reference: bool | None = None
    mismatched: int = 0
    # Of the answers that differ from the reference's, the earliest token where one does:
    # 0 would mean a different first token (a wrong prompt KV), later a drift in decoding.
    first_divergence: int | None = None
    long_ttft_p50_ms: float = float("nan")  # requests of the long kind only
    errors: list[str] = field(default_factory=list)
    ttft_mean_ms: float = float("nan")  # the client's
    server_ttft_p50_ms: float = float("nan")  # the last stage's TTFT histogram (D's on 1P1D)
    server_ttft_p99_ms: float = float("nan")
    ttft_rest_ms: float = float("nan")  # client mean - server mean: proxy, HTTP, client
    ttft_agrees: bool = False
    ttft_note: str = ""
    # CPU seconds per second of the turns: by process name, "client", "other"; and per core.
    cpu_share: dict[str, float] = field(default_factory=dict)
    core_busy: list[float] = field(default_factory=list)

    @property
    def checked_itl_p99_ms(self) -> float:
        """The ITL p99 to believe: the client's when it agrees with the server, else vLLM's."""
        if self.timing_agrees or not math.isfinite(self.server_itl_p99_ms):
            return self.itl_p99_ms
        return self.server_itl_p99_ms


def _gaps(samples: Sequence[RequestSample]) -> list[float]:
    return [g for s in samples if s.ok for g in s.itl_ms + [0.0] * s.tokens_sharing_a_chunk]


def _goodput(samples: Sequence[RequestSample], wall_s: float, slo: Slo) -> float:
    return sum(slo.met(s) for s in samples) / wall_s if wall_s > 0 else 0.0


def summarize(
    turns: Sequence[Turn], slo: Slo, *, long_prompt_above: int | None = None
) -> EqualHwPoint:
    """The turns of one (system, rate) as one point (``long_prompt_above``: prompts longer
    than this are the long kind, whose TTFT p50 is reported apart)."""
    samples = [s for t in turns for s in t.samples]
    done = [s for s in samples if s.ok]
    wall = sum(t.wall_s for t in turns)
    stages = max(len(t.server) for t in turns) if turns else 0
    stage_hists = [
        {name: total(t.server[i].get(name, EMPTY) for t in turns if i < len(t.server))
         for name in HISTOGRAMS}
        for i in range(stages)
    ]  # fmt: skip
    decode = stage_hists[-1] if stage_hists else dict.fromkeys(HISTOGRAMS, EMPTY)
    gaps = _gaps(samples)
    decode_ms = sum(s.tpot_ms * (s.output_tokens - 1) for s in done if s.output_tokens > 1)
    decode_tokens = sum(s.output_tokens - 1 for s in done if s.output_tokens > 1)
    check = check_itl(
        [g for s in done for g in s.itl_ms],
        sum(s.tokens_sharing_a_chunk for s in done),
        decode_ms,
        decode_tokens,
        decode[ITL],
    )
    ttft = check_ttft([s.ttft_ms for s in done], [(h[E2E], h[TTFT]) for h in stage_hists])
    tpots = [s.tpot_ms for s in done if s.output_tokens > 1]
    long_ttfts = [
        s.ttft_ms
        for t in turns
        for s in t.samples
        if s.ok and long_prompt_above is not None and s.prompt_tokens > long_prompt_above
    ]
    rounds = []
    for t in turns:
        ok = [s for s in t.samples if s.ok]
        hist = t.server[-1].get(ITL, EMPTY) if t.server else EMPTY
        rounds.append(
            {
                "round": t.round,
                "itl_p99_ms": percentile(_gaps(ok), 99),
                "server_itl_p99_ms": 1000 * hist.quantile(0.99),
                "ttft_p50_ms": percentile([s.ttft_ms for s in ok], 50),
                "goodput_rps": _goodput(t.samples, t.wall_s, slo),
                "load_avg_1m": t.load_avg_1m,
                "other_cpu_share": t.cpu.share("other") if t.cpu else float("nan"),
            }
        )

    def per_second(n: float) -> float:
        return n / wall if wall > 0 else 0.0

    ttfts = [s.ttft_ms for s in done]
    return EqualHwPoint(
        system=turns[0].system if turns else "",
        rate=turns[0].rate if turns else 0.0,
        requests=len(samples),
        completed=len(done),
        failed=len(samples) - len(done),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p90_ms=percentile(ttfts, 90),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(gaps, 50),
        itl_p90_ms=percentile(gaps, 90),
        itl_p99_ms=percentile(gaps, 99),
        itl_max_ms=max(gaps, default=float("nan")),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        server_itl_p50_ms=1000 * decode[ITL].quantile(0.5),
        server_itl_p90_ms=1000 * decode[ITL].quantile(0.9),
        server_itl_p99_ms=1000 * decode[ITL].quantile(0.99),
        server_tpot_p50_ms=1000 * decode[TPOT].quantile(0.5),
        server_tpot_p99_ms=1000 * decode[TPOT].quantile(0.99),
        server_ttft_mean_ms=ttft.server_mean_ms,
        timing_agrees=check.agrees,
        timing_note=check.note,
        burst_share=check.burst_share,
        throughput_rps=per_second(len(done)),
        output_tokens_per_s=per_second(sum(s.output_tokens for s in done)),
        goodput_rps=_goodput(samples, wall, slo),
        slo_attainment=sum(slo.met(s) for s in samples) / len(samples) if samples else 0.0,
        wall_s=wall,
        load_avg_1m=sum(t.load_avg_1m for t in turns) / len(turns) if turns else 0.0,
        rounds=rounds,
        long_ttft_p50_ms=percentile(long_ttfts, 50),
        errors=[f"#{s.index}: {s.error}" for s in samples if s.error][:5],
        ttft_mean_ms=ttft.client_mean_ms,
        server_ttft_p50_ms=ttft.last_stage_p50_ms,
        server_ttft_p99_ms=ttft.last_stage_p99_ms,
        ttft_rest_ms=ttft.rest_mean_ms,
        ttft_agrees=ttft.agrees,
        ttft_note=ttft.note,
        cpu_share=cpu_share(turns),
        core_busy=core_busy(turns),
    )


def compare_systems(
    turns: Sequence[Turn],
    slo: Slo,
    *,
    long_prompt_above: int | None = None,
    reference: str | None = None,
) -> list[EqualHwPoint]:
    """One point per (rate, system), in the order the systems were given; token identity of
    every system against ``reference``'s answers to the same requests (default: the first
    system's; greedy tokens of a random-weight model in bf16 can differ between instances on
    different OpenMP thread counts, so compare like with like)."""
    systems = list(dict.fromkeys(t.system for t in turns))
    reference = reference or systems[0]
    rates = sorted({t.rate for t in turns})
    points = []
    for rate in rates:
        mine = {s: [t for t in turns if t.system == s and t.rate == rate] for s in systems}
        answers = sorted((x for t in mine[reference] for x in t.samples), key=lambda x: x.index)
        for system in systems:
            point = summarize(mine[system], slo, long_prompt_above=long_prompt_above)
            if system != reference:
                ours = sorted((x for t in mine[system] for x in t.samples), key=lambda x: x.index)
                if len(ours) == len(answers):
                    differ = compare_tokens(answers, ours)
                    point.mismatched = max(0, differ)
                    point.same_tokens_as_reference = None if differ < 0 else differ == 0
                    point.first_divergence = first_divergence(answers, ours)
            points.append(point)
    return points


def first_divergence(
    reference: Sequence[RequestSample], samples: Sequence[RequestSample]
) -> int | None:
    """The earliest token index where any answer differs from its reference; None if none."""
    earliest = None
    for a, b in zip(reference, samples, strict=True):
        if not (a.ok and b.ok) or a.token_ids == b.token_ids:
            continue
        index = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
            min(len(a.token_ids), len(b.token_ids)),
        )
        earliest = index if earliest is None else min(earliest, index)
    return earliest


# A round during which the rest of the box (other jobs) used more than this many cores' worth
# of CPU is flagged busy: its numbers are not the systems' own.
BUSY_OTHER_CPU = 0.15


@dataclass(frozen=True)
class Verdict:
    """The targets, judged at the highest rate the single instance sustains (meets the SLO for
    at least ``sustain`` of its requests), over all rounds and round by round (each round is
    the same slice of the schedule for every system)."""

    rate: float | None
    itl_p99_ratio: float | None  # 1P1D's checked ITL p99 / single's
    goodput_ratio: float | None  # 1P1D's goodput / the better single-instance setup's
    itl_target_met: bool
    goodput_target_met: bool
    # Per round: {"round", "itl_p99_ratio", "goodput_ratio", "other_cpu_max", "busy"}.
    rounds: tuple[dict[str, Any], ...] = ()
    itl_target: float = 0.5
    goodput_target: float = 1.3

    @property
    def met_in_every_round(self) -> bool:
        return bool(self.rounds) and all(
            r["itl_p99_ratio"] is not None
            and r["itl_p99_ratio"] <= self.itl_target
            and r["goodput_ratio"] is not None
            and r["goodput_ratio"] >= self.goodput_target
            for r in self.rounds
        )

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "met_in_every_round": self.met_in_every_round}


def _round_ratios(
    by: dict[tuple[str, float], EqualHwPoint], rate: float, single: str, others: Sequence[str],
    pd: str,
) -> tuple[dict[str, Any], ...]:  # fmt: skip
    s, d = by[(single, rate)], by[(pd, rate)]
    key = "itl_p99_ms" if s.timing_agrees and d.timing_agrees else "server_itl_p99_ms"
    setups = [by[(o, rate)] for o in [single, *others] if (o, rate) in by]
    out = []
    for r in sorted({x["round"] for x in d.rounds}):

        def at(p: EqualHwPoint, r=r) -> dict[str, float] | None:
            return next((x for x in p.rounds if x["round"] == r), None)

        mine, theirs = at(d), at(s)
        best = max((x["goodput_rps"] for x in map(at, setups) if x), default=0.0)
        rounds = [x for x in (at(p) for p in [*setups, d]) if x]
        other = max((x.get("other_cpu_share", math.nan) for x in rounds), default=math.nan)
        itl = (
            mine[key] / theirs[key]
            if mine and theirs and theirs[key] > 0 and math.isfinite(mine[key])
            else None
        )
        out.append(
            {
                "round": r,
                "itl_p99_ratio": itl,
                "goodput_ratio": mine["goodput_rps"] / best if mine and best > 0 else None,
                "other_cpu_max": other,
                "busy": bool(other > BUSY_OTHER_CPU),
            }
        )
    return tuple(out)


def judge(
    points: Sequence[EqualHwPoint],
    *,
    single: str,
    others: Sequence[str],
    pd: str,
    sustain: float = 0.9,
    itl_target: float = 0.5,
    goodput_target: float = 1.3,
) -> Verdict:
    by = {(p.system, p.rate): p for p in points}
    sustained = [p.rate for p in points if p.system == single and p.slo_attainment >= sustain]
    if not sustained:
        return Verdict(None, None, None, False, False)
    rate = max(sustained)
    s, d = by.get((single, rate)), by.get((pd, rate))
    if s is None or d is None:
        return Verdict(rate, None, None, False, False)
    itl = d.checked_itl_p99_ms / s.checked_itl_p99_ms if s.checked_itl_p99_ms > 0 else None
    best = max(by[(o, rate)].goodput_rps for o in [single, *others] if (o, rate) in by)
    goodput = d.goodput_rps / best if best > 0 else None
    return Verdict(
        rate,
        itl,
        goodput,
        itl is not None and itl <= itl_target,
        goodput is not None and goodput >= goodput_target,
        _round_ratios(by, rate, single, others, pd),
        itl_target,
        goodput_target,
    )


# --- driving the load ------------------------------------------------------------------------


async def _scrape(session: aiohttp.ClientSession, url: str) -> dict[str, Histogram]:
    """The instance's histograms; an instance without ``/metrics`` gives empty ones."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return dict.fromkeys(HISTOGRAMS, EMPTY)
            return parse_metrics(await resp.text())
    except aiohttp.ClientError:
        return dict.fromkeys(HISTOGRAMS, EMPTY)


async def _read_stages(session, system: SystemUnderTest) -> list[list[dict[str, Histogram]]]:
    return [[await _scrape(session, url) for url in stage] for stage in system.stages]


def activate(system: SystemUnderTest, every: Sequence[ManagedProcess]) -> None:
    """Pause every process the benchmark started except the system's, which resume."""
    running = {id(p) for p in system.processes}
    for proc in every:
        if id(proc) not in running:
            proc.pause()
    for proc in system.processes:
        proc.resume()


def turn_order(systems: Sequence[Any], round_index: int) -> list[Any]:
    """The systems of round ``round_index``, rotated so each takes the first turn in turn."""
    k = round_index % len(systems)
    return [*systems[k:], *systems[:k]]


async def _healthy(session: aiohttp.ClientSession, system: SystemUnderTest) -> None:
    """After a resume: each of the system's servers answers /health (one call each)."""
    for url in [system.url, *(u for stage in system.stages for u in stage)]:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=60)) as r:
            r.raise_for_status()


async def run_equal_hw(
    systems: Sequence[SystemUnderTest],
    model: str,
    plans: dict[float, list[SweepRequest]],
    *,
    rounds: int,
    every_process: Sequence[ManagedProcess] = (),
    warmup: Sequence[SweepRequest] = (),
    timeout_s: float = 180.0,
    budget_s: float | None = None,
    console: Console | None = None,
) -> list[Turn]:
    """Every rate's plan on every system, in ``rounds`` slices, one system at a time.

    ``budget_s``: no rate starts after this many seconds (the machine's lock is held for a
    bounded time); the rates measured so far are returned whole."""
    started = time.monotonic()
    turns: list[Turn] = []
    groups = {p.name: p.pid for p in every_process if p.pid is not None}  # each leads a group
    ticks = float(os.sysconf("SC_CLK_TCK"))
    connector = aiohttp.TCPConnector(limit=0)  # open loop: the client must never queue
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None)
    ) as session:
        for system in systems:
            activate(system, every_process)
            await _healthy(session, system)
            await run_open_loop(session, system.url, model, list(warmup), timeout_s=timeout_s)
        for rate, plan in sorted(plans.items()):
            if budget_s is not None and time.monotonic() - started > budget_s:
                if console:
                    console.print(f"  out of time budget: {rate:g} req/s and above not run")
                break
            for r, part in enumerate(split_rounds(plan, rounds)):
                for system in turn_order(systems, r):
                    activate(system, every_process)
                    await _healthy(session, system)
                    if console:
                        console.print(
                            f"  {rate:g} req/s, round {r + 1}: {system.name} ({len(part)} requests)"
                        )
                    load = os.getloadavg()[0]
                    before = await _read_stages(session, system)
                    cpu_before = cpu_snapshot()
                    samples, wall = await run_open_loop(
                        session, system.url, model, part, timeout_s=timeout_s
                    )
                    cpu = cpu_use(cpu_before, cpu_snapshot(), groups, ticks_per_s=ticks)
                    after = await _read_stages(session, system)
                    server = [
                        {
                            name: total(a[name] - b[name] for b, a in zip(sb, sa, strict=True))
                            for name in HISTOGRAMS
                        }
                        for sb, sa in zip(before, after, strict=True)
                    ]
                    turns.append(Turn(system.name, rate, r, samples, wall, server, load, cpu))
        for proc in every_process:
            proc.resume()
    return turns


# --- low load: where one request's TTFT goes ------------------------------------------------

QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
STAGE_HISTOGRAMS = (QUEUE, PREFILL, E2E, TTFT)

# What each stage's histograms mean for one request, in the table's order. Two-stage systems
# (P, then D): P's queue and forward step, D's queue (for a request that came with
# kv_transfer_params: its wait for the KV, the pull included) and its step for the last prompt
# token; the rest of the client's TTFT is the proxy and the HTTP hops (tokenizing, P's answer,
# D's first SSE event). One-stage systems: the instance's queue and prefill.
TWO_STAGE_ROWS = (
    ("P queue", 0, QUEUE),
    ("P forward (prefill)", 0, PREFILL),
    ("P whole request", 0, E2E),
    ("D waits for KV (queue)", 1, QUEUE),
    ("D step, last prompt token", 1, PREFILL),
    ("D first token (vLLM TTFT)", 1, TTFT),
)
ONE_STAGE_ROWS = (
    ("instance queue", 0, QUEUE),
    ("instance forward (prefill)", 0, PREFILL),
    ("instance first token (vLLM TTFT)", 0, TTFT),
)
REST = "proxy + HTTP (rest of client TTFT)"


@dataclass
class LowLoadSample:
    """One request sent alone: the client's sample and, per stage (P's instances, then D's; one
    stage for a plain instance), its own seconds in each of ``STAGE_HISTOGRAMS`` (the sum's
    difference around it; nan where the count did not move by exactly one)."""

    system: str
    kind: str  # "short" or "long"
    sample: RequestSample
    stages: list[dict[str, float]]


def request_stage_s(
    before: Sequence[dict[str, Histogram]], after: Sequence[dict[str, Histogram]]
) -> dict[str, float]:
    """One stage's (its instances added up) seconds per histogram for the one request sent
    between the two reads."""
    out = {}
    for name in STAGE_HISTOGRAMS:
        diff = total(a.get(name, EMPTY) for a in after) - total(b.get(name, EMPTY) for b in before)
        out[name] = diff.sum if diff.count == 1 else float("nan")
    return out


@dataclass
class LowLoadRow:
    """One system and prompt kind at concurrency 1: medians over its requests, ms."""

    system: str
    kind: str
    requests: int
    failed: int
    prompt_tokens_p50: float
    ttft_p50_ms: float
    ttft_mean_ms: float
    stages_p50_ms: dict[str, float]
    vs_reference: float = float("nan")  # TTFT p50 / the reference system's, same kind


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return percentile(finite, 50) if finite else float("nan")


def low_load_breakdown(
    samples: Sequence[LowLoadSample], *, reference: str | None = None
) -> list[LowLoadRow]:
    """Per (kind, system), in the order given: the client's TTFT and each stage's median. The
    rest (client TTFT minus P's whole request minus D's first token, per request) is what the
    proxy and the HTTP hops add."""
    systems = list(dict.fromkeys(s.system for s in samples))
    kinds = list(dict.fromkeys(s.kind for s in samples))
    reference = reference or (systems[0] if systems else None)
    rows = []
    for kind in kinds:
        for system in systems:
            mine = [s for s in samples if s.system == system and s.kind == kind]
            if not mine:
                continue
            done = [s for s in mine if s.sample.ok]
            two = any(len(s.stages) > 1 for s in done)
            stages: dict[str, float] = {}
            for label, i, name in TWO_STAGE_ROWS if two else ONE_STAGE_ROWS:
                stages[label] = _median(
                    [1000 * s.stages[i].get(name, math.nan) for s in done if i < len(s.stages)]
                )
            last = [(1, TTFT), (0, E2E)] if two else [(0, TTFT)]
            stages[REST] = _median(
                [
                    s.sample.ttft_ms
                    - sum(1000 * s.stages[i].get(n, math.nan) for i, n in last if i < len(s.stages))
                    for s in done
                ]
            )
            ttfts = [s.sample.ttft_ms for s in done]
            rows.append(
                LowLoadRow(
                    system=system,
                    kind=kind,
                    requests=len(mine),
                    failed=len(mine) - len(done),
                    prompt_tokens_p50=_median([s.sample.prompt_tokens for s in mine]),
                    ttft_p50_ms=_median(ttfts),
                    ttft_mean_ms=sum(ttfts) / len(ttfts) if ttfts else float("nan"),
                    stages_p50_ms=stages,
                )
            )
    for row in rows:
        ref = next((r for r in rows if r.system == reference and r.kind == row.kind), None)
        if ref is not None and ref.ttft_p50_ms > 0:
            row.vs_reference = row.ttft_p50_ms / ref.ttft_p50_ms
    return rows


def low_load_markdown(rows: Sequence[LowLoadRow]) -> str:
    """Stages down, (kind, system) across; a stage a system does not have reads "-"."""
    head = [f"{r.kind}: {r.system}" for r in rows]
    labels = list(dict.fromkeys(label for r in rows for label in r.stages_p50_ms))
    lines = [
        "| stage, ms (p50) | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(rows),
        "| prompt tokens (p50) | " + " | ".join(f"{r.prompt_tokens_p50:.0f}" for r in rows) + " |",
    ]
    for label in labels:
        cells = [_ms(r.stages_p50_ms.get(label, math.nan)) for r in rows]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **client TTFT p50** | " + " | ".join(_ms(r.ttft_p50_ms) for r in rows) + " |")
    lines.append(
        "| vs the single instance | "
        + " | ".join("-" if not math.isfinite(r.vs_reference) else f"{r.vs_reference:.2f}x"
                     for r in rows)
        + " |"
    )  # fmt: skip
    return "\n".join(lines)


async def run_low_load(
    systems: Sequence[SystemUnderTest],
    model: str,
    requests: dict[str, list[SweepRequest]],
    *,
    rounds: int = 2,
    every_process: Sequence[ManagedProcess] = (),
    timeout_s: float = 180.0,
    console: Console | None = None,
) -> list[LowLoadSample]:
    """Each kind's requests on every system, one at a time (the next leaves when the previous
    answered), the systems taking turns in ``rounds`` slices; every instance of the system's
    stages is read around each request, so each stage's time is that request's own."""
    out: list[LowLoadSample] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        for r in range(rounds):
            for kind, reqs in requests.items():
                part = reqs[r::rounds]
                for system in turn_order(systems, r):
                    activate(system, every_process)
                    await _healthy(session, system)
                    if console:
                        console.print(
                            f"  one at a time, round {r + 1}: {system.name}, {len(part)} {kind}"
                        )
                    for req in part:
                        before = await _read_low_load(session, system)
                        (sample,), _ = await run_open_loop(
                            session, system.url, model, [replace(req, arrival_s=0.0)],
                            timeout_s=timeout_s,
                        )  # fmt: skip
                        after = await _read_low_load(session, system)
                        stages = [request_stage_s(b, a) for b, a in zip(before, after, strict=True)]
                        out.append(LowLoadSample(system.name, kind, sample, stages))
        for proc in every_process:
            proc.resume()
    return out


async def _read_low_load(session, system: SystemUnderTest) -> list[list[dict[str, Histogram]]]:
    async def one(url: str) -> dict[str, Histogram]:
        try:
            async with session.get(f"{url}/metrics") as resp:
                if resp.status != 200:
                    return {}
                return parse_metrics(await resp.text(), STAGE_HISTOGRAMS)
        except aiohttp.ClientError:
            return {}

    return [[await one(url) for url in stage] for stage in system.stages]


# --- output ----------------------------------------------------------------------------------


def _ms(*values: float) -> str:
    return " / ".join(
        "-" if not math.isfinite(v) else f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in values
    )


def _spread(point: EqualHwPoint, key: str) -> str:
    values = [r[key] for r in point.rounds if math.isfinite(r[key])]
    if len(values) < 2:
        return ""
    return f" ({_ms(min(values))}-{_ms(max(values))})"


COLUMNS = (
    "rate req/s",
    "system",
    "done / failed",
    "TTFT p50/p90/p99 ms",
    "TTFT mean ms client / vLLM",
    "ITL p50/p90/p99 ms, client",
    "ITL p50/p90/p99 ms, vLLM",
    "ITL p99 checked (rounds)",
    "TPOT p50 ms client / vLLM",
    "goodput req/s (rounds)",
    "timings",
    "same tokens",
    "load",
)


def _row(p: EqualHwPoint) -> list[str]:
    same = "-" if p.same_tokens_as_reference is None else (
        "true" if p.same_tokens_as_reference
        else f"false ({p.mismatched}, from token {p.first_divergence})"
    )  # fmt: skip
    checked = _ms(p.checked_itl_p99_ms) + (
        _spread(p, "itl_p99_ms") if p.timing_agrees else _spread(p, "server_itl_p99_ms")
    )
    return [
        f"{p.rate:g}",
        p.system,
        f"{p.completed} / {p.failed}",
        _ms(p.ttft_p50_ms, p.ttft_p90_ms, p.ttft_p99_ms),
        f"{_ms(p.ttft_mean_ms)} / {_ms(p.server_ttft_mean_ms)}",
        _ms(p.itl_p50_ms, p.itl_p90_ms, p.itl_p99_ms),
        _ms(p.server_itl_p50_ms, p.server_itl_p90_ms, p.server_itl_p99_ms),
        checked,
        f"{_ms(p.tpot_p50_ms)} / {_ms(p.server_tpot_p50_ms)}",
        f"{p.goodput_rps:.2f}{_spread(p, 'goodput_rps').replace(' ms', '')}",
        timings_cell(p),
        same,
        f"{p.load_avg_1m:.0f}",
    ]


def timings_cell(p: EqualHwPoint) -> str:
    """ "agree" when the client's ITL and TTFT agree with vLLM's; else what does not."""
    if p.timing_agrees and p.ttft_agrees:
        return "agree"
    return "; ".join(
        note for ok, note in ((p.timing_agrees, p.timing_note), (p.ttft_agrees, p.ttft_note))
        if not ok
    )  # fmt: skip


def markdown_table(points: Sequence[EqualHwPoint]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_row(p)) + " |" for p in points]
    return "\n".join(lines)


def render_table(points: Sequence[EqualHwPoint], title: str) -> Table:
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col.replace(", ", "\n"), justify="right")
    for p in points:
        table.add_row(*_row(p))
    return table


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def payload(points: Sequence[EqualHwPoint], meta: dict[str, Any]) -> dict[str, Any]:
    return _finite({"meta": meta, "points": [asdict(p) for p in points]})


def write_plot(points: Sequence[EqualHwPoint], path: Path, slo: Slo, title: str) -> Path:
    """ITL p99 (checked; bars: the rounds' spread), goodput and TTFT p50 against rate, one
    line per system."""
    from matplotlib.figure import Figure  # heavy: here only

    systems = list(dict.fromkeys(p.system for p in points))
    figure = Figure(figsize=(14, 4.5), layout="constrained")
    figure.suptitle(title)
    itl_ax, good_ax, ttft_ax = figure.subplots(1, 3)
    for system in systems:
        mine = sorted((p for p in points if p.system == system), key=lambda p: p.rate)
        rates = [p.rate for p in mine]

        def spread(key: str, mid: list[float], pts=mine) -> list[list[float]]:
            lows, highs = [], []
            for p, m in zip(pts, mid, strict=True):
                vals = [r[key] for r in p.rounds if math.isfinite(r[key])] or [m]
                lows.append(max(0.0, m - min(vals)))
                highs.append(max(0.0, max(vals) - m))
            return [lows, highs]

        itl = [p.checked_itl_p99_ms for p in mine]
        key = "itl_p99_ms" if all(p.timing_agrees for p in mine) else "server_itl_p99_ms"
        itl_ax.errorbar(rates, itl, yerr=spread(key, itl), marker="o", capsize=3, label=system)
        good = [p.goodput_rps for p in mine]
        good_ax.errorbar(
            rates, good, yerr=spread("goodput_rps", good), marker="o", capsize=3, label=system
        )
        ttft = [p.ttft_p50_ms for p in mine]
        ttft_ax.errorbar(
            rates, ttft, yerr=spread("ttft_p50_ms", ttft), marker="o", capsize=3, label=system
        )
    all_rates = sorted({p.rate for p in points})
    itl_ax.axhline(slo.itl_ms, color="grey", linestyle="--", linewidth=1, label="ITL SLO")
    itl_ax.set_title("ITL p99 (ms)")
    good_ax.plot(all_rates, all_rates, color="grey", linestyle=":", linewidth=1, label="offered")
    good_ax.set_title(f"goodput (TTFT <= {slo.ttft_ms:g} ms, ITL p99 <= {slo.itl_ms:g} ms), req/s")
    good_ax.set_ylim(bottom=0)
    ttft_ax.axhline(slo.ttft_ms, color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    ttft_ax.set_title("TTFT p50 (ms)")
    for ax in (itl_ax, good_ax, ttft_ax):
        ax.set_xlabel("offered rate (req/s)")
        ax.set_xticks(all_rates, labels=[f"{r:g}" for r in all_rates])
        ax.grid(True, alpha=0.3)
    itl_ax.set_yscale("log")
    ttft_ax.set_yscale("log")
    itl_ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
