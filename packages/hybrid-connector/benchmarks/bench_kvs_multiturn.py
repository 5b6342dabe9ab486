"""Multi-turn chat across two instances: vLLM's local prefix cache alone, against KVS.

The workload (published, seeded): ``--sessions`` chat sessions of ``--turns`` turns. Turn 1 is a
system prompt shared by all sessions (``--system`` tokens) plus a first user message; every
later turn adds the previous answer and a new user message (``--user`` tokens) to the context,
so contexts grow to ``system + turns * (user + answer)`` tokens. Each answer is ``--answer``
tokens, greedy. All sessions are open at once, each sending its next turn when its answer is
in, at most ``--concurrency`` requests in flight: turns of different sessions interleave, as
users' do. Turns go to the two instances in turn (round robin: no session affinity, the case a
load balancer makes), and each instance's KV pool (``--kv-mib``) is too small to keep every
session. Then ``--miss-prompts`` prompts nobody has seen (``--miss-tokens`` each), one at a
time: what the store costs a request it cannot help.

Systems, in one run, each on two vLLM OpenAI servers of the same settings, all up at once and
taking turns round by round (``--rounds``, each with its own prompts; the order flips every
round), so the box's other load falls on every system alike:

* ``local``: vLLM's prefix cache only (the connector without a store);
* ``kvs``: the connector with KVS on, both instances on one refstore master;
* ``kvs+routing``: the same as ``kvs`` (a master of its own), the turns sent to a ``pdserve
  proxy`` in front of the two instances instead, which routes each one where its longest prefix
  is cached (the instances' KV-cache events; pd-serving's cache-aware routing) rather than in
  turn;
* ``kvs+disk`` (``--systems``): the same as ``kvs`` with the store's disk tier on
  (``--disk-size``, in the run's temporary directory): blocks its pool (``--pool``) evicts are
  written there and read back on a hit.

Reported per system: TTFT p50 and p99 of each turn, of turns 2+ and of turns 2+ with 2k+
tokens of context, and of the misses; prompt tokens served from
the local cache / loaded from the store / computed (vLLM's own counters), throughput
(answers' tokens per second), and every answer's tokens compared across systems; for
``kvs+routing`` also the proxy's routing decisions by reason; for every store its counters
(``STORE_STATS``: evictions, keys found, the disk tier's writes, hits and errors).

    flock /tmp/bench.lock uv run --frozen --no-sync python \\
        packages/hybrid-connector/benchmarks/bench_kvs_multiturn.py
    ... bench_kvs_multiturn.py --smoke    # 4 sessions of 3 turns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
from refstore.protocol import Stats

RESULTS = Path(__file__).parent / "results"
LONG_CONTEXT = 2048  # the target's "2k+ tokens of context"
LOCAL, KVS, ROUTED, DISK = "local", "kvs", "kvs+routing", "kvs+disk"
# Each store's counters at the end (refstore's ``Stats``): what its pool evicted, what lookups
# found, and the disk tier's side of it (every ``disk_`` counter; its capacity is the setting).
STORE_STATS = (
    "keys",
    "used",
    "evictions",
    "key_hits",
    "key_misses",
    *(f for f in Stats.__struct_fields__ if f.startswith("disk_") and f != "disk_capacity"),
    "spill_dropped",
)
TOP_LOGPROBS = 5


def workload(args: argparse.Namespace, round_index: int) -> tuple[list[int], list[list[list[int]]]]:
    """A round's system prompt and its sessions' user messages (each round has its own: no
    round hits what an earlier one left in a cache)."""
    rng = random.Random(f"{args.seed}/{round_index}")
    system = [rng.randrange(3, 500) for _ in range(args.system)]
    users = [
        [[rng.randrange(3, 500) for _ in range(args.user)] for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    return system, users


async def _complete(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
    *,
    extra: dict[str, Any] | None = None,
) -> tuple[float, list[int], list[list[str]]]:
    """(TTFT s, answer token ids, per position [its token, the top tokens]) of one streamed
    greedy completion (tokens as text: the API's logprobs name them so); ``extra`` joins the
    request body."""
    body = {
        **(extra or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
        "logprobs": TOP_LOGPROBS,
    }
    start = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    tops: list[list[str]] = []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - start
                tokens.extend(ids)
                logprobs = choice.get("logprobs") or {}
                for token, top in zip(
                    logprobs.get("tokens") or [], logprobs.get("top_logprobs") or [], strict=False
                ):
                    tops.append([token, *sorted(top or {})])  # the sampled one, then the top
    assert ttft is not None, "no token came back"
    return ttft, tokens, tops


async def run_system(
    urls: list[str],
    model: str,
    args: argparse.Namespace,
    round_index: int,
    instance_urls: list[str] | None = None,
) -> dict[str, Any]:
    """One round of the workload on one system: what it measured, unsummarised. ``urls`` get
    the requests; ``instance_urls`` (default: the same) are the vLLM servers behind them."""
    instance_urls = instance_urls or urls
    system, users = workload(args, round_index)
    ttfts: dict[int, list[float]] = {t: [] for t in range(args.turns)}
    long_ttfts: list[float] = []  # turns 2+ whose context is LONG_CONTEXT tokens or more
    answers: dict[str, list[int]] = {}
    tops: dict[str, list[list[str]]] = {}
    counter = iter(range(10**9))
    # Every session is open at once and sends its next turn when its answer is in; at most
    # ``concurrency`` requests are in flight. Sessions' turns interleave, as users' do, so an
    # instance's pool sees every other session's context between two turns of one.
    sem = asyncio.Semaphore(args.concurrency)
    total_tokens = 0

    async def session(s: int, http: aiohttp.ClientSession) -> None:
        nonlocal total_tokens
        context = list(system)
        for t in range(args.turns):
            context += users[s][t]
            async with sem:
                url = urls[next(counter) % len(urls)]  # round robin: no session affinity
                ttft, answer, top = await _complete(http, url, model, context, args.answer)
            ttfts[t].append(ttft)
            if t > 0 and len(context) >= LONG_CONTEXT:
                long_ttfts.append(ttft)
            answers[f"{round_index}/{s}/{t}"] = answer
            tops[f"{round_index}/{s}/{t}"] = top
            total_tokens += len(answer)
            context += answer

    before = [_by_source(u) for u in instance_urls]
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(session(s, http) for s in range(args.sessions)))
        elapsed = time.perf_counter() - start
        misses = await _misses(http, urls, model, args, round_index)
    after = [_by_source(u) for u in instance_urls]
    sources: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for key in a:
            sources[key] = sources.get(key, 0.0) + a[key] - b.get(key, 0.0)
    return {
        "ttfts": ttfts,
        "long": long_ttfts,
        "misses": misses,
        "tokens": total_tokens,
        "elapsed": elapsed,
        "sources": sources,
        "answers": answers,
        "tops": tops,
    }


def summarize(rounds: list[dict[str, Any]], turns: int) -> dict[str, Any]:
    """A system's figures over every round."""
    ttfts = {t: [x for r in rounds for x in r["ttfts"][t]] for t in range(turns)}
    later = [x for t in range(1, turns) for x in ttfts[t]]
    long = [x for r in rounds for x in r["long"]]
    sources: dict[str, float] = {}
    for r in rounds:
        for key, value in r["sources"].items():
            sources[key] = sources.get(key, 0.0) + value
    return {
        "ttft_turn1_ms": _pcts(ttfts[0]),
        "ttft_later_ms": _pcts(later),
        f"ttft_later_{LONG_CONTEXT}plus_ms": _pcts(long) if long else None,
        "ttft_by_turn_p50_ms": [statistics.median(ttfts[t]) * 1e3 for t in range(turns)],
        "ttft_by_turn_p99_ms": [_pcts(ttfts[t])["p99"] for t in range(turns)],
        "ttft_miss_ms": _pcts([x for r in rounds for x in r["misses"]]),
        "tokens_per_s": sum(r["tokens"] for r in rounds) / sum(r["elapsed"] for r in rounds),
        "elapsed_s": sum(r["elapsed"] for r in rounds),
        "prompt_tokens_by_source": sources,
        "answers": {k: v for r in rounds for k, v in r["answers"].items()},
        "tops": {k: v for r in rounds for k, v in r["tops"].items()},
    }


async def _misses(
    http: aiohttp.ClientSession,
    urls: list[str],
    model: str,
    args: argparse.Namespace,
    round_index: int,
) -> list[float]:
    """TTFT of prompts nobody has seen (``--miss-prompts`` of ``--miss-tokens``), one at a
    time: what the store costs a request it cannot help (lookup, saves)."""
    rng = random.Random(f"{args.seed}/{round_index}/misses")
    out = []
    for i in range(args.miss_prompts):
        prompt = [rng.randrange(3, 500) for _ in range(args.miss_tokens)]
        ttft, _, _ = await _complete(http, urls[i % len(urls)], model, prompt, 1)
        out.append(ttft)
    return out


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


async def _ttft(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: list[int],
    extra: dict[str, Any] | None = None,
) -> float:
    ttft, _, _ = await _complete(http, url, model, prompt, 1, extra=extra)
    return ttft


# The KVS system's own servers, each request opting out of the store: a miss with the store off
# in the same processes (a server process may run 10-20% slower than another for a whole run).
OFF = "kvs-off"
OFF_BODY = {"kv_transfer_params": {"kvs": False}}


async def paired_misses(
    http: aiohttp.ClientSession, urls: dict[str, list[str]], model: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``--miss-pairs`` pairs of trials, the two systems taking turns A B B A ...: a trial is
    two fresh prompts (``--miss-tokens``) sent one after the other to one instance, after
    ``--miss-gap-ms`` of idle (the previous trial's saves are done). The first miss sees an
    idle instance; the second starts while the first one's save may still run on its core.
    Every system gets the same two prompts (their caches and stores are their own: fresh to
    each), on the same instance index (one per pair, alternating). The order changes every
    second pair (A B, A B, B A, B A, ...: each instance index sees every order); with more than
    two systems (``--kvs-variants``) it rotates, and reverses every other turn of the rotation.
    Pairs are also summarised per instance index (``by_instance``): each system's two servers
    may differ by more than the effect, and the median over pairs mixes the two. ``kvs-off``
    is the KVS system's own servers with each request opting out of the store (``OFF_BODY``):
    the store on and off in the same processes; it gets two fresh prompts of its own (the KVS
    servers' prefix caches hold the KVS trial's)."""
    rng = random.Random(f"{args.seed}/paired")
    systems = list(urls)
    for name in [n for n in systems if n != OFF]:  # warm-up, not counted: first requests
        for url in urls[name]:
            for _ in range(2):
                await _ttft(http, url, model, _fresh(rng, args.miss_tokens))
    rows = []
    n = len(systems)
    for p in range(args.miss_pairs):
        # Each instance index sees every order: the order's turn and the instance's cross.
        turn = p // 2
        order = systems[turn % n :] + systems[: turn % n]
        if (turn // n) % 2:
            order.reverse()
        prompts = [_fresh(rng, args.miss_tokens) for _ in range(2)]
        own = [_fresh(rng, args.miss_tokens) for _ in range(2)]
        row: dict[str, Any] = {"order": order, "instance": p % 2}
        for name in order:
            await asyncio.sleep(args.miss_gap_ms / 1e3)
            url = urls[name][p % 2]
            extra = OFF_BODY if name == OFF else None
            sent = own if name == OFF else prompts
            row[name] = [await _ttft(http, url, model, prompt, extra) for prompt in sent]
        rows.append(row)
    return rows


async def context_trials(
    http: aiohttp.ClientSession, urls: dict[str, list[str]], model: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Where a 2k+ turn's time goes, ``--context-trials`` times: a fresh context C
    (``--context-tokens``) is sent (one answer token) to instance i, then C + N (``--new-tokens``
    fresh ones, a turn's new answer and message) to
    ``full``: the local system's other instance, C + N never seen there (computes it all);
    ``hit``: the local system's instance i, C in its cache (computes N over it);
    ``load``: the KVS system's other instance, C in the store only (loads C, computes N);
    ``kvs_hit``: the KVS system's instance i (C in its own cache, C + N's blocks in the store
    from ``load``: loads those, computes the last partial block).
    Every send after ``--miss-gap-ms`` of idle."""
    rng = random.Random(f"{args.seed}/context")
    rows = []
    gap = args.miss_gap_ms / 1e3
    for q in range(args.context_trials):
        i = q % 2
        context = _fresh(rng, args.context_tokens)
        turn = context + _fresh(rng, args.new_tokens)
        other = _fresh(rng, args.context_tokens) + turn[args.context_tokens :]
        row: dict[str, Any] = {"instance": i}
        order = [LOCAL, KVS] if q % 2 == 0 else [KVS, LOCAL]
        for name in order:
            await asyncio.sleep(gap)
            await _ttft(http, urls[name][i], model, context)
            await asyncio.sleep(gap)
            if name == LOCAL:
                row["full"] = await _ttft(http, urls[name][1 - i], model, other)
                await asyncio.sleep(gap)
                row["hit"] = await _ttft(http, urls[name][i], model, turn)
            else:
                row["load"] = await _ttft(http, urls[name][1 - i], model, turn)
                await asyncio.sleep(gap)
                row["kvs_hit"] = await _ttft(http, urls[name][i], model, turn)
        rows.append(row)
    return rows


def paired_stats(ratios_: list[float], limit: float, seed: int = 0) -> dict[str, Any]:
    """Median of per-pair ratios, its 95% bootstrap interval, the spread, and a two-sided
    sign test of "the median is ``limit``" (exact binomial)."""
    from math import comb

    xs = sorted(ratios_)
    n = len(xs)
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(5000))
    above = sum(x > limit for x in xs)
    below = sum(x < limit for x in xs)
    m = above + below
    tail = sum(comb(m, k) for k in range(min(above, below) + 1)) / 2**m if m else 1.0
    return {
        "n": n,
        "median": statistics.median(xs),
        "ci95": [boot[int(0.025 * len(boot))], boot[int(0.975 * len(boot)) - 1]],
        "p10": xs[int(0.1 * (n - 1))],
        "p90": xs[round(0.9 * (n - 1))],
        "min": xs[0],
        "max": xs[-1],
        f"above_{limit}": above,
        f"below_{limit}": below,
        "sign_test_p": min(1.0, 2 * tail),
    }


def summarize_paired(
    rows: list[dict[str, Any]], context: list[dict[str, Any]], limit: float, systems: list[str]
) -> dict[str, Any]:
    """Per system against ``local`` (and each KVS variant against ``kvs``): ``ratio_*`` keys
    are ``kvs`` / ``local``; ``ratios`` holds every pairing."""
    out: dict[str, Any] = {"pairs": rows, "context_trials": context, "ratios": {}}
    pairings = [(v, LOCAL) for v in systems if v != LOCAL]
    pairings += [(v, KVS) for v in systems if v not in (LOCAL, KVS)]
    if OFF in systems:
        pairings.append((KVS, OFF))  # the store on and off in the same processes
    for label, pick in (
        ("first", lambda t: t[0]),
        ("second", lambda t: t[1]),
        ("trial", lambda t: t[0] + t[1]),
    ):
        for num, den in pairings:
            per_pair = [pick(r[num]) / pick(r[den]) for r in rows]
            stats = paired_stats(per_pair, limit)
            by_instance = {
                i: statistics.median(
                    x for x, r in zip(per_pair, rows, strict=True) if r["instance"] == i
                )
                for i in sorted({r["instance"] for r in rows})
            }
            stats["by_instance_median"] = by_instance
            # Every instance index alike: the geometric mean of their medians.
            stats["instances_geomean"] = statistics.geometric_mean(by_instance.values())
            out["ratios"][f"{num}/{den} {label}"] = stats
            if (num, den) == (KVS, LOCAL):
                out[f"ratio_{label}"] = stats
        for name in systems:
            out[f"{name}_{label}_p50_ms"] = statistics.median(pick(r[name]) for r in rows) * 1e3
    if context:
        out["context_p50_ms"] = {
            k: statistics.median(r[k] for r in context) * 1e3
            for k in ("full", "hit", "load", "kvs_hit")
        }
        out["context_ratios"] = {
            "hit/full": paired_stats([r["hit"] / r["full"] for r in context], 0.3),
            "load/full": paired_stats([r["load"] / r["full"] for r in context], 0.3),
            "load-hit_ms": paired_stats([(r["load"] - r["hit"]) * 1e3 for r in context], 0.0),
        }
    return out


def compare_answers(
    reference: dict[str, Any], other: dict[str, Any]
) -> tuple[list[str], list[str], list[tuple[str, int]]]:
    """(answers that differ, the first differing turn of each session, those of them that do
    not part at a near-tie, with where). A session whose answers part at a near-tie (random
    weights: logits are nearly flat, and a prefix hit computes the rest in another kernel path)
    goes on with other contexts: only its first differing turn compares like for like, and must
    part at a near-tie."""
    ref_answers, answers = reference["answers"], other["answers"]
    differ = sorted(k for k in ref_answers if ref_answers[k] != answers.get(k))
    roots, bad = [], []
    for key in differ:
        round_index, session, turn = key.split("/")
        if any(f"{round_index}/{session}/{t}" in differ for t in range(int(turn))):
            continue
        roots.append(key)
        a, b = ref_answers[key], answers[key]
        at = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        tops_a, tops_b = reference["tops"][key], other["tops"][key]
        near = (
            at < min(len(tops_a), len(tops_b))
            and tops_a[at][0] in tops_b[at][1:]
            and tops_b[at][0] in tops_a[at][1:]
        )
        if not near:
            bad.append((key, at))
    return differ, roots, bad


def ratios(system: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """``system``'s TTFT p50s and throughput over ``base``'s."""
    long_key = f"ttft_later_{LONG_CONTEXT}plus_ms"
    long_ratio = (
        system[long_key]["p50"] / base[long_key]["p50"]
        if system[long_key] and base[long_key]
        else None
    )
    long_p99 = (
        system[long_key]["p99"] / base[long_key]["p99"]
        if system[long_key] and base[long_key]
        else None
    )
    return {
        "ttft_later_p50": system["ttft_later_ms"]["p50"] / base["ttft_later_ms"]["p50"],
        "ttft_later_p99": system["ttft_later_ms"]["p99"] / base["ttft_later_ms"]["p99"],
        f"ttft_later_{LONG_CONTEXT}plus_p99": long_p99,
        f"ttft_later_{LONG_CONTEXT}plus_p50": long_ratio,
        "ttft_miss_p50": system["ttft_miss_ms"]["p50"] / base["ttft_miss_ms"]["p50"],
        "tokens_per_s": system["tokens_per_s"] / base["tokens_per_s"],
    }


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "p50": statistics.median(xs) * 1e3,
        "p99": xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))] * 1e3,
    }


def _by_source(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# A model whose prefill costs what it does for real (hundreds of ms for 2k tokens on this box),
# built with random weights beside the tiny model's tokenizer.
SMALL = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def make_model(work: Path, size: str) -> Path:
    from hybrid_connector.tiny_model import make_tiny_model

    tiny = make_tiny_model(work / "tiny-qwen2", "qwen2")
    if size == "tiny":
        return tiny
    import shutil

    import torch
    from transformers import AutoConfig, Qwen2ForCausalLM

    out = work / "small-qwen2"
    shutil.copytree(tiny, out)
    config = AutoConfig.from_pretrained(tiny)
    for key, value in SMALL.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * SMALL["num_hidden_layers"]
    config.initializer_range = 0.05
    torch.manual_seed(0)
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def start_servers(
    name: str,
    model: Path,
    kvs: dict[str, Any] | None,
    args: argparse.Namespace,
    log_dir: Path,
    *,
    kv_events: bool = False,
) -> tuple[list[Any], list[Any]]:
    """A system's two vLLM servers, started (not waited for)."""
    from pd_serving.launcher import free_port, start_all
    from pd_serving.servers import Connector, CpuSettings, Role, VllmServer

    cpu = CpuSettings(kv_cache_bytes=args.kv_mib << 20, max_model_len=args.max_model_len)
    servers = [
        VllmServer(
            name=f"{name}{i}",
            model=model,
            role=Role.DECODE,
            connector=Connector.HYBRID,
            log_dir=log_dir,
            index=i,
            cpu=cpu,
            served_model_name="tiny",
            extra_args=["--block-size", str(args.block_size)],
            extra_connector_config={"kvs": kvs} if kvs else {},
            kv_events_port=free_port() if kv_events else None,
        )
        for i in range(2)
    ]
    processes = start_all(s.make_process() for s in servers)
    return servers, processes


def start_proxy(
    servers: list[Any], store: str, log_dir: Path, routing_args: list[str]
) -> tuple[str, Any]:
    """``pdserve proxy`` in front of ``servers`` (D's prefilling themselves, no P), subscribed
    to their KV events: (its URL, its process, started)."""
    from pd_serving.launcher import ManagedProcess, free_port, python_argv
    from pd_serving.proxy import READY_LINE

    port = free_port()
    argv = ["proxy", "--port", str(port), "--model-name", "tiny", *routing_args]
    for server in servers:
        argv += ["--decode", server.url]
        argv += ["--kv-events-from", f"{server.url}={server.kv_events_endpoint}@{store}"]
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess(
        "proxy",
        python_argv("pd_serving.cli", *argv),
        log_path=log_dir / "proxy.log",
        ready_marker=READY_LINE,
        health_url=f"{url}/health",
    )
    proc.start()
    return url, proc


def routing_decisions(url: str) -> dict[str, float]:
    """The proxy's cache-aware routing decisions so far, by reason."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_cache_routing_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def paired_main(args: argparse.Namespace, model: Path, work: Path) -> None:
    """``--misses-only``: the local and KVS systems up at once, the paired trials, the JSON."""
    import refstore
    from pd_serving.launcher import stop_all, wait_all_ready

    variants = {KVS: json.loads(args.kvs_extra), **json.loads(args.kvs_variants)}
    stores = {
        name: refstore.connect(f"bench-kvs-{uuid.uuid4().hex[:6]}", autostart=True,
                               pool_size=args.pool)
        for name in variants
    }  # fmt: skip
    configs: dict[str, dict[str, Any] | None] = {LOCAL: None}
    for name, extra in variants.items():
        configs[name] = {"store": stores[name].name, **extra}
    processes: list[Any] = []
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        urls: dict[str, list[str]] = {}
        for name, config in configs.items():
            servers, started = start_servers(name, model, config, args, work / name)
            urls[name] = [s.url for s in servers]
            processes += started
        urls[OFF] = urls[KVS]
        wait_all_ready(processes, timeout=900)

        async def trials() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                rows = await paired_misses(http, urls, "tiny", args)
                context = await context_trials(http, urls, "tiny", args)
            return rows, context

        rows, context = asyncio.run(trials())
        results.update(summarize_paired(rows, context, args.miss_limit, list(urls)))
        results["store"] = {
            name: {k: getattr(store.stats(), k) for k in ("keys", "used", "evictions")}
            for name, store in stores.items()
        }
    finally:
        stop_all(processes)
        for store in stores.values():
            store.shutdown_master()
            store.close()
    for key, r in results["ratios"].items():
        print(
            f"misses {key}: median {r['median']:.3f}x, 95% CI "
            f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}, p10-p90 {r['p10']:.3f}-{r['p90']:.3f}, "
            f"{r[f'above_{args.miss_limit}']} of {r['n']} above {args.miss_limit}x, sign test "
            f"p={r['sign_test_p']:.3g}; per instance "
            + ", ".join(f"{v:.3f}x" for v in r["by_instance_median"].values())
            + f" (geometric mean {r['instances_geomean']:.3f}x)"
        )
    for name in [*configs, OFF]:
        print(
            f"{name} miss p50 ms: first {results[f'{name}_first_p50_ms']:.1f}, second "
            f"{results[f'{name}_second_p50_ms']:.1f}"
        )
    if context:
        c = results["context_p50_ms"]
        print(
            f"context {args.context_tokens} + {args.new_tokens} new: p50 full {c['full']:.1f} ms, "
            f"local hit {c['hit']:.1f} ms, store load {c['load']:.1f} ms, kvs local hit "
            f"{c['kvs_hit']:.1f} ms; hit/full "
            f"{results['context_ratios']['hit/full']['median']:.3f}x, load/full "
            f"{results['context_ratios']['load/full']['median']:.3f}x"
        )
    if not args.smoke:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=512)
    parser.add_argument("--user", type=int, default=384)
    parser.add_argument("--answer", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--miss-prompts", type=int, default=8)
    parser.add_argument("--miss-tokens", type=int, default=2048)
    parser.add_argument(
        "--kv-mib", type=int, default=None, help="KV per instance (default: 16 tiny, 64 small)"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--pool", default="1G", help="each store's pool")
    parser.add_argument(
        "--systems",
        default=f"{LOCAL},{KVS},{ROUTED}",
        help=f"local and any of {KVS}, {ROUTED}, {DISK} (the store with a disk tier)",
    )
    parser.add_argument("--disk-size", default="4G", help=f"{DISK}: the disk tier's size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="each system runs this many")
    parser.add_argument(
        "--model-size",
        choices=["tiny", "small"],
        default="small",
        help="tiny: the 2-layer test model; small: 8 layers of 512 (prefill costs like a real one)",
    )
    from pd_serving.routing import RoutingPolicy

    policy = RoutingPolicy()
    parser.add_argument(
        "--cache-load-tokens",
        type=float,
        default=policy.cache_load_tokens,
        help="kvs+routing: the proxy's --cache-load-tokens",
    )
    parser.add_argument(
        "--store-weight",
        type=float,
        default=policy.store_weight,
        help="kvs+routing: the proxy's --store-weight",
    )
    parser.add_argument(
        "--misses-only",
        action="store_true",
        help="only the paired measurements: misses (A B B A ...) and where a 2k+ turn's time goes",
    )
    parser.add_argument("--miss-pairs", type=int, default=40)
    parser.add_argument("--miss-gap-ms", type=float, default=300.0)
    parser.add_argument("--miss-limit", type=float, default=1.05, help="the target kvs/local")
    parser.add_argument("--context-trials", type=int, default=16)
    parser.add_argument("--context-tokens", type=int, default=2240)
    parser.add_argument("--new-tokens", type=int, default=448)
    parser.add_argument("--kvs-extra", default="{}", help="JSON merged into the kvs config")
    parser.add_argument(
        "--kvs-variants",
        default="{}",
        help='--misses-only: more KVS systems, {"name": {kvs keys}}, each on its own store',
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.json is None:
        name = "kvs_multiturn_misses.json" if args.misses_only else "kvs_multiturn.json"
        args.json = RESULTS / name
    if args.smoke:
        args.sessions, args.turns, args.system, args.user, args.answer = 4, 3, 128, 96, 16
        args.miss_prompts, args.miss_tokens, args.rounds = 2, 256, 1
        args.miss_pairs, args.context_trials, args.miss_gap_ms = 2, 1, 0.0
        args.context_tokens, args.new_tokens = 256, 64
    if args.smoke:
        args.model_size = "tiny"
    if args.kv_mib is None:
        args.kv_mib = 16 if args.model_size == "tiny" else 64
    # The model, the servers' logs and the disk tier's preallocated file (``--disk-size``) go
    # with the run.
    with tempfile.TemporaryDirectory(prefix="bench-kvs-") as tmp:
        work = Path(tmp)
        model = make_model(work, args.model_size)
        if args.misses_only:
            paired_main(args, model, work)
        else:
            systems_main(args, model, work)


def systems_main(args: argparse.Namespace, model: Path, work: Path) -> None:
    """The systems of ``--systems`` up at once, the multi-turn rounds, the JSON."""
    import refstore
    from pd_serving.launcher import stop_all, wait_all_ready

    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    results["date"] = time.strftime("%Y-%m-%d")
    systems = args.systems.split(",")
    if set(systems) - {LOCAL, KVS, ROUTED, DISK} or LOCAL not in systems:
        raise SystemExit(f"--systems: local and any of {KVS}, {ROUTED}, {DISK}")
    store_names = {name: f"bench-kvs-{uuid.uuid4().hex[:6]}" for name in systems if name != LOCAL}
    disk_dir = work / "disk"
    stores = {
        name: refstore.connect(
            store,
            autostart=True,
            pool_size=args.pool,
            **({"disk": str(disk_dir), "disk_size": args.disk_size} if name == DISK else {}),
        )
        for name, store in store_names.items()
    }
    configs: dict[str, dict[str, Any] | None] = {
        name: None if name == LOCAL else {"store": store_names[name], **json.loads(args.kvs_extra)}
        for name in systems
    }
    processes: list[Any] = []
    proxy_url = ""
    try:
        # Every system's servers up at once (an idle vLLM server waits on its queue), taking
        # turns round by round, the order flipped each round: what the box's other load does to
        # one system it does to the others.
        servers: dict[str, list[Any]] = {}
        for name, kvs in configs.items():
            servers[name], started = start_servers(
                name.replace("+", "-"), model, kvs, args, work / name, kv_events=name == ROUTED
            )
            processes += started
        wait_all_ready(processes, timeout=900)
        instance_urls = {name: [s.url for s in group] for name, group in servers.items()}
        urls = dict(instance_urls)
        if ROUTED in systems:
            routing_args = ["--cache-load-tokens", str(args.cache_load_tokens)]
            routing_args += ["--store-weight", str(args.store_weight)]
            proxy_url, proxy = start_proxy(
                servers[ROUTED], store_names[ROUTED], work / ROUTED, routing_args
            )
            processes.append(proxy)
            wait_all_ready([proxy], timeout=120)
            urls[ROUTED] = [proxy_url]
        raw: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for round_index in range(args.rounds):
            order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
            for name in order:
                raw[name].append(
                    asyncio.run(
                        run_system(urls[name], "tiny", args, round_index, instance_urls[name])
                    )
                )
        for name in configs:
            results[name] = summarize(raw[name], args.turns)
        for name, store in stores.items():
            stats = store.stats()
            results[name]["store"] = {k: getattr(stats, k) for k in STORE_STATS}
        if ROUTED in systems:
            results[ROUTED]["routing"] = routing_decisions(proxy_url)
    finally:
        stop_all(processes)
        for store in stores.values():
            store.shutdown_master()
            store.close()
    local_answers = results[LOCAL]["answers"]
    bad: list[tuple[str, str, int]] = []
    for name in systems[1:]:
        differ, roots, parted = compare_answers(results[LOCAL], results[name])
        bad += [(name, key, at) for key, at in parted]
        results[name]["answers_differ"] = differ
        results[name]["divergent_sessions"] = roots
        print(
            f"{name} against local: answers identical {len(local_answers) - len(differ)} of "
            f"{len(local_answers)}; sessions parting at a near-tie: {len(roots) - len(parted)} "
            f"of {args.sessions * args.rounds}, elsewhere: {len(parted)}"
        )
    same = not bad
    results["same_answers"] = same
    results["not_near_ties"] = bad
    for name in configs:
        r = results[name]
        src = r["prompt_tokens_by_source"]
        total = sum(src.values()) or 1.0
        print(
            f"{name:11s} TTFT turn 1 p50 {r['ttft_turn1_ms']['p50']:7.1f} ms, turns 2+ p50 "
            f"{r['ttft_later_ms']['p50']:7.1f} p99 {r['ttft_later_ms']['p99']:7.1f} ms; "
            f"{r['tokens_per_s']:6.1f} tok/s; prompt tokens: "
            + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(src.items()))
        )
    for name in stores:
        st = results[name]["store"]
        print(
            f"{name} store: {st['evictions']} evictions, {st['key_hits']} keys found "
            f"({st['disk_hits']} of them on disk), {st['disk_writes']} written to disk, "
            f"{st['spill_dropped']} not written, {st['disk_errors']} disk errors"
        )
    if ROUTED in systems:
        print(f"{ROUTED} routing decisions: {results[ROUTED]['routing']}")
    results["ratios"] = {}
    pairs = [(name, LOCAL) for name in systems[1:]]
    pairs += [(name, KVS) for name in systems[1:] if name != KVS and KVS in systems]
    for num, den in pairs:
        r = results["ratios"][f"{num}/{den}"] = ratios(results[num], results[den])
        long_ratio = r[f"ttft_later_{LONG_CONTEXT}plus_p50"]
        long_text = f"{long_ratio:.3f}x" if long_ratio is not None else "n/a"
        print(
            f"TTFT p50 {num}/{den}: turns 2+ {r['ttft_later_p50']:.3f}x (p99 "
            f"{r['ttft_later_p99']:.3f}x), at {LONG_CONTEXT}+ tokens {long_text}, misses "
            f"{r['ttft_miss_p50']:.3f}x; tok/s {r['tokens_per_s']:.3f}x"
        )
    if not args.smoke:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        slim = {
            k: {kk: vv for kk, vv in v.items() if kk not in ("answers", "tops")}
            if isinstance(v, dict)
            else v
            for k, v in results.items()
        }
        args.json.write_text(json.dumps(slim, indent=1))
    if not same:
        raise SystemExit(f"answers part away from near-ties: {bad}")


if __name__ == "__main__":
    main()
