"""What a load sweep sends: request-length distributions, their spec syntax, Poisson arrivals.

Standard library only (``pdserve``'s argument parser uses the spec parsers). Length spec syntax
(``--prompt-dist``, ``--output-dist``)::

    300               fixed (also fixed:300)
    uniform:200:400   integers, both ends included
    normal:300:50     rounded, truncated to mean +- 3 sd, at least 1
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from typing import Any

# --- length distributions ------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDist:
    """Token counts drawn per request: ``fixed`` (a), ``uniform`` (a..b) or ``normal`` (a, sd b)."""

    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        lo, hi = self.bounds()
        return min(hi, max(lo, round(rng.gauss(self.a, self.b))))

    def bounds(self) -> tuple[int, int]:
        """The smallest and largest count this distribution can draw."""
        if self.kind == "fixed":
            return int(self.a), int(self.a)
        if self.kind == "uniform":
            return int(self.a), int(self.b)
        return max(1, math.ceil(self.a - 3 * self.b)), max(1, math.floor(self.a + 3 * self.b))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"normal:{self.a:g}:{self.b:g}"


def parse_length_dist(spec: str) -> LengthDist:
    """``N``, ``fixed:N``, ``uniform:LO:HI`` or ``normal:MEAN:SD`` (argparse ``type=``)."""
    kind, _, rest = spec.strip().partition(":")
    if not rest and kind.isdigit():
        kind, rest = "fixed", kind
    parts = rest.split(":") if rest else []
    arity = {"fixed": 1, "uniform": 2, "normal": 2}
    if kind not in arity:
        raise argparse.ArgumentTypeError(
            f"bad length spec {spec!r}: use N, fixed:N, uniform:LO:HI or normal:MEAN:SD"
        )
    if len(parts) != arity[kind]:
        raise argparse.ArgumentTypeError(
            f"bad length spec {spec!r}: {kind} takes {arity[kind]} number(s) after {kind}:"
        )
    try:
        numbers = [int(p) if kind != "normal" else float(p) for p in parts]
    except ValueError:
        whole = "whole " if kind != "normal" else ""
        raise argparse.ArgumentTypeError(
            f"bad length spec {spec!r}: {':'.join(parts)} are not {whole}numbers"
        ) from None
    if kind == "fixed" and numbers[0] < 1:
        raise argparse.ArgumentTypeError(f"bad length spec {spec!r}: N must be at least 1")
    if kind == "uniform" and not 1 <= numbers[0] <= numbers[1]:
        raise argparse.ArgumentTypeError(f"bad length spec {spec!r}: need 1 <= LO <= HI")
    if kind == "normal" and not (numbers[0] >= 1 and numbers[1] >= 0):
        raise argparse.ArgumentTypeError(f"bad length spec {spec!r}: need MEAN >= 1, SD >= 0")
    return LengthDist(kind, *numbers)


def parse_rates(spec: str) -> list[float]:
    """``0.5,1,2,4``: request rates in requests/s, positive, ascending order not required."""
    try:
        rates = [float(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad rates {spec!r}: give request rates in req/s, comma separated, e.g. 0.5,1,2,4"
        ) from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"bad rates {spec!r}: every rate must be > 0")
    return sorted(set(rates))


# --- the schedule --------------------------------------------------------------------------


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Arrival times (s from the first) of ``count`` requests of a Poisson process at ``rate``.

    The first request leaves at 0; each gap after it is exponential with mean ``1 / rate``.
    """
    arrivals, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


@dataclass
class SweepRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt: Any = None  # filled in by the caller (text of exactly prompt_tokens tokens)


def plan_rate(
    rate: float,
    count: int,
    *,
    prompt_dist: LengthDist,
    output_dist: LengthDist,
    seed: int,
    max_model_len: int | None = None,
) -> list[SweepRequest]:
    """The requests of one rate: arrival times and lengths, the same for every system.

    Seeded by (seed, rate), so a run is reproducible and each rate draws its own lengths.
    A prompt is shortened where prompt + output would not fit ``max_model_len``.
    """
    arrivals = poisson_arrivals(rate, count, random.Random(f"{seed}:{rate}:arrivals"))
    lengths = random.Random(f"{seed}:{rate}:lengths")
    out = []
    for i, arrival in enumerate(arrivals):
        prompt_len, output_len = prompt_dist.sample(lengths), output_dist.sample(lengths)
        if max_model_len is not None:
            if output_len >= max_model_len:
                raise ValueError(f"{output_len} output tokens do not fit max_model_len")
            prompt_len = min(prompt_len, max_model_len - output_len)
        out.append(SweepRequest(i, arrival, prompt_len, output_len))
    return out


# --- the mixed workload PD is for ----------------------------------------------------------


@dataclass(frozen=True)
class MixSpec:
    """Long prompts that answer briefly mixed with many short prompts that decode long.

    A share ``long_share`` of the requests has a prompt drawn from ``long_prompt`` and
    ``long_output`` tokens to answer; the rest a prompt from ``short_prompt`` and
    ``short_output`` tokens. On one instance every long prefill stalls the decoding of all the
    short requests in flight (their ITL); PD moves the prefills to another instance."""

    long_share: float = 0.25
    long_prompt: LengthDist = LengthDist("uniform", 1024, 4096)
    long_output: LengthDist = LengthDist("fixed", 32)
    short_prompt: LengthDist = LengthDist("uniform", 64, 128)
    short_output: LengthDist = LengthDist("fixed", 256)

    def __post_init__(self) -> None:
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share {self.long_share} is not within [0, 1]")

    def describe(self) -> str:
        return (
            f"{100 * self.long_share:.0f}% long: prompt {self.long_prompt} -> "
            f"{self.long_output} tokens; the rest short: prompt {self.short_prompt} -> "
            f"{self.short_output} tokens"
        )

    def is_long(self, req: SweepRequest) -> bool:
        return req.prompt_tokens > self.short_prompt.bounds()[1]


def plan_mixed(
    rate: float, count: int, mix: MixSpec, *, seed: int, max_model_len: int | None = None
) -> list[SweepRequest]:
    """Poisson arrivals at ``rate`` of ``count`` requests drawn from ``mix``; seeded by
    (seed, rate) as ``plan_rate``, the same for every system."""
    arrivals = poisson_arrivals(rate, count, random.Random(f"{seed}:{rate}:arrivals"))
    draws = random.Random(f"{seed}:{rate}:mix")
    out = []
    for i, arrival in enumerate(arrivals):
        long = draws.random() < mix.long_share
        prompt_dist = mix.long_prompt if long else mix.short_prompt
        output_dist = mix.long_output if long else mix.short_output
        prompt_len, output_len = prompt_dist.sample(draws), output_dist.sample(draws)
        if max_model_len is not None:
            if output_len >= max_model_len:
                raise ValueError(f"{output_len} output tokens do not fit max_model_len")
            prompt_len = min(prompt_len, max_model_len - output_len)
        out.append(SweepRequest(i, arrival, prompt_len, output_len))
    return out
