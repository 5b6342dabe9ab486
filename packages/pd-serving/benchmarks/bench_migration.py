"""Downtime of a live migration: the extra gap a client sees at the switch, pre-copy against
recompute.

1P2D HybridConnector; proxies in this process in front of the same instances: ``precopy``
(pd-serving's live migration: the full blocks move while the old D decodes on, the stop pulls
only the last ones), ``recompute`` (the same prompt + tokens to the new D without KV, which
recomputes the whole context) and, with ``--systems``, ``stop_and_copy`` (every block pulled at
the stop). One streaming greedy request at a time: after ``--migrate-after`` tokens the
client asks ``POST /admin/migrate`` to move it off its D; ``--after-tokens`` more follow from the
other D. Per request, the gap between the last token before the switch and the first after it,
minus the median inter-token gap of the same request, is the switch's extra gap ("downtime").
Context lengths (``--contexts``: tokens at the switch) and rounds (the systems' order flips
every round) as given. ``none`` streams the same request unmoved, on the D the pre-copied one
started on: the truth its tokens are compared with, and the gaps D1's time per output token
while pre-copying is held to (the same token positions). Each pre-copied migration's stages
(the proxy's marks, ``stages_ms`` in the admin answer) go in the JSON's ``stages``; with
``--stages`` a second pass (``--stage-contexts``) also reads D2's own metrics of the migrated
request (its queue: the pull; its first step; its TTFT).

    flock /tmp/bench.lock uv run --frozen python packages/pd-serving/benchmarks/bench_migration.py

(JSON in ``benchmarks/results/migration.json``, the plot in ``migration_downtime.png``;
``--smoke`` runs it against stand-ins in seconds, without vLLM: the harness and the table,
numbers meaningless.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# The smoke run's stand-in upstreams are the tests' (stand_ins.py there).
TESTS = Path(__file__).resolve().parents[1] / "tests"
SMOKE_DEADLINE_S = 300
SYSTEMS = ("precopy", "recompute", "none")
# How each system moves a request: (pull the KV, pre-copy first); "none" is not moved (D1's
# time per output token without a migration, at the same token positions).
HOW = {
    "precopy": (True, True),
    "recompute": (False, False),
    "stop_and_copy": (True, False),
    "none": (True, True),
}
LLUMNIX_DOWNTIME_MS = (20, 30)  # Llumnix (OSDI '24), published, for any context length


class CpuProbe:
    """Per-thread CPU (``/proc/PID/task/TID/schedstat``: ns on a CPU, ns waiting on a run queue)
    of the deployment's processes and this one, grouped as "instance:process" (``decode0:worker``),
    and each core's busy time (``/proc/stat``, which also counts the box's other work). Read at
    two token positions of a request (``--cpu-probe``: its own pass, the reads cost this process
    a few ms): what ran while D1 decoded."""

    def __init__(self, groups: dict[int, str]) -> None:
        self.groups = groups  # pid -> "instance:process"

    @classmethod
    def of(cls, servers: list[Any]) -> CpuProbe:
        import os

        leaders = {s.process.pid: s.name for s in servers if s.process and s.process.pid}
        groups: dict[int, str] = {os.getpid(): "bench:proxy+client"}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            pgid = int(fields[2])
            if pgid in leaders:
                kind = (
                    "worker"
                    if "Worker" in comm
                    else "engine"
                    if "EngineCor" in comm  # comm is cut at 15 characters
                    else "api"
                    if int(entry) == pgid or "python" in comm or "vllm" in comm.lower()
                    else comm
                )
                groups[int(entry)] = f"{leaders[pgid]}:{kind}"
        return cls(groups)

    def snapshot(self) -> dict[str, Any]:
        import os

        run: dict[str, float] = {}
        wait: dict[str, float] = {}
        for pid, group in self.groups.items():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        on_cpu, queued, _ = f.read().split()
                except (OSError, ValueError):
                    continue
                run[group] = run.get(group, 0.0) + int(on_cpu) / 1e6
                wait[group] = wait.get(group, 0.0) + int(queued) / 1e6
        cores: dict[str, float] = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *ticks = line.split()
                if name.startswith("cpu") and name != "cpu":
                    t = [int(x) for x in ticks]
                    idle = t[3] + t[4]
                    cores[name] = (sum(t[:8]) - idle) * 1000 / os.sysconf("SC_CLK_TCK")
        return {"t": time.monotonic(), "run": run, "wait": wait, "cores": cores}


def _cpu_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """CPU ms (``run``), run-queue wait ms (``wait``) per group and core busy ms between two
    snapshots, over ``ms`` of wall time."""
    return {
        "ms": (b["t"] - a["t"]) * 1000,
        **{
            key: {k: round(v - a[key].get(k, 0.0), 3) for k, v in b[key].items()}
            for key in ("run", "wait", "cores")
        },
    }


async def _start_proxy(
    prefill: Any, decodes: list[Any], model: str, pull_kv: bool, precopy: bool = True
):
    from pd_serving.launcher import free_port
    from pd_serving.proxy import PdProxy, ProxyConfig, serve
    from pd_serving.routing import Backend

    config = ProxyConfig(
        prefill=[Backend(prefill.url, rpc_address=prefill.rpc_address, name="p")],
        decode=[
            Backend(d.url, rpc_address=d.rpc_address, name=f"d{i}") for i, d in enumerate(decodes)
        ],
        model_names=[model],
        health=None,  # nothing fails here; keeps the two proxies identical
    )
    proxy = PdProxy(config)
    proxy.live.pull_kv = pull_kv
    proxy.live.precopy = precopy
    port = free_port()
    runner = await serve(proxy, "127.0.0.1", port)
    return f"http://127.0.0.1:{port}", proxy, runner


async def _one(
    session: Any,
    url: str,
    body: dict[str, Any],
    migrate_after: int | None,
    *,
    probe: CpuProbe | None = None,
    probe_at: tuple[int, int] = (0, 0),
) -> dict:
    """One streaming request moved after ``migrate_after`` tokens (None: not moved): token ids,
    arrival times (``time.monotonic()``, the proxy's clock), the admin endpoint's answer;
    ``probe``: CPU snapshots at the token counts ``probe_at`` (the first one before the ask)."""
    times: list[float] = []
    tokens: list[int] = []
    margins: list[float] = []  # top-1 minus top-2 logprob per token (when logprobs asked)
    asked: asyncio.Task[Any] | None = None
    asked_at = 0
    snaps: list[dict[str, Any]] = []

    async def migrate() -> dict[str, Any]:
        async with session.get(f"{url}/health") as resp:
            health = await resp.json()
        busy = [d["name"] for d in health["decode"] if d["inflight"]]
        async with session.post(f"{url}/admin/migrate", params={"instance": busy[0]}) as resp:
            return await resp.json()

    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[5:])
            ids = [t for c in event.get("choices") or [] for t in c.get("token_ids") or []]
            for choice in event.get("choices") or []:
                for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
                    best = sorted((top or {}).values(), reverse=True)
                    margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
            if ids:
                now = time.monotonic()
                tokens += ids
                times += [now] * len(ids)
                if probe is not None and len(snaps) < 2 and len(tokens) >= probe_at[len(snaps)]:
                    snaps.append(probe.snapshot())
            if asked is None and migrate_after is not None and len(tokens) >= migrate_after:
                asked, asked_at = asyncio.create_task(migrate()), len(tokens)
                asked_t = time.monotonic()
    cpu = {"cpu": _cpu_delta(*snaps)} if len(snaps) == 2 else {}
    if asked is None:
        return {
            "tokens": tokens,
            "times": times,
            "margins": margins,
            "answer": [],
            "asked_at": 0,
            **cpu,
        }
    answer = await asked
    return {
        "tokens": tokens,
        "times": times,
        "margins": margins,
        "answer": answer["requests"],
        "asked_at": asked_at,
        "asked_t": asked_t,
        **cpu,
    }


def _started_on(sample: dict) -> str:
    """The D (of two, d0 and d1) a moved request started on."""
    [moved] = sample["answer"] or [{}]
    return "d0" if moved.get("to") == "d1" else "d1"


def _gaps(sample: dict) -> list[float]:
    return [b - a for a, b in zip(sample["times"], sample["times"][1:], strict=False)]


def _tpot_ratio(sample: dict, unmoved: dict | None = None) -> float | None:
    """Median gap while the migration runs on the old D (after the ask, before the switch)
    over the median gap of the same request not moved (``unmoved``, the same token positions)
    or, without one, over the median gap before the ask."""
    [moved] = sample["answer"] or [{}]
    if moved.get("outcome") != "moved":
        return None
    at, asked = moved["tokens_before"], sample["asked_at"]
    gaps = _gaps(sample)
    during = gaps[asked : at - 1]
    base = _gaps(unmoved)[asked : at - 1] if unmoved is not None else gaps[: asked - 1]
    if not during or not base:
        return None
    return statistics.median(during) / statistics.median(base)


def _stages(sample: dict, prompt_tokens: int) -> dict[str, float] | None:
    """One migration's hand-off, stage by stage (ms), from the proxy's marks (``stages_ms``,
    live.py) and the client's token times: where the switch's gap goes."""
    [moved] = sample["answer"] or [{}]
    if moved.get("outcome") != "moved" or not moved.get("stages_ms"):
        return None
    at = moved["tokens_before"]
    base = moved["asked_at"]
    mark = {k: base + v / 1000 for k, v in moved["stages_ms"].items()}
    times = sample["times"]
    last_d1, first_d2 = times[at - 1], times[at]
    gaps = _gaps(sample)

    def ms(a: float, b: float) -> float:
        return (b - a) * 1000

    out = {
        "context": prompt_tokens + at,
        "precopied_tokens": moved.get("precopied_tokens", 0),
        # D2 pulls these at the stop (its prefix cache has the pre-copied ones) and computes 1.
        "pulled_at_stop_tokens": prompt_tokens + at - 1 - moved.get("precopied_tokens", 0),
        "tokens_during": at - sample["asked_at"],
        "proxy_decision": ms(sample["asked_t"], base),
        "switch_gap": ms(last_d1, first_d2),
    }
    if gaps[: at - 1] and gaps[at:]:
        out["itl_before"] = statistics.median(gaps[: at - 1]) * 1000
        out["itl_after"] = statistics.median(gaps[at:]) * 1000
    pairs = {
        "precopy_rpc": ("asked", "precopy_answered"),
        "warm_up": ("precopy_answered", "warmed"),
        "d1_stop_rpc": ("stop_asked", "d1_answered"),
        "d1_end_after_answer": ("d1_answered", "d1_end"),
        "last_d1_token_to_client": ("d1_end", None),
        "switch_wait": (None, "d2_called"),  # from the client's last D1 token
        "d2_call_to_headers": ("d2_called", "d2_answered"),
        "d2_headers_to_first_event": ("d2_answered", "d2_first_event"),
        "first_event_to_client": ("d2_first_event", None),
    }
    for name, (a, b) in pairs.items():
        ta = last_d1 if a is None else mark.get(a)
        tb = (last_d1 if a == "d1_end" else first_d2) if b is None else mark.get(b)
        if ta is not None and tb is not None:
            out[name] = ms(ta, tb)
    return out


async def _metrics(session: Any, url: str) -> dict[str, float]:
    """A vLLM's Prometheus samples (name{labels} -> value), for differences."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") or sample.name.endswith("_created"):
                continue
            labels = ",".join(
                f"{k}={v}"
                for k, v in sorted(sample.labels.items())
                if k not in ("engine",) and k != "model_name"
            )
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _scrape_before_stop(session: Any, before_stop: dict[str, dict[str, float]]) -> None:
    """``--stages``: D2's metrics right before MIGRATE_OUT (after the warm-up), so that the
    difference after the request covers the migrated request alone."""
    from pd_serving import live

    original = live.LiveStream._ask_d1

    async def ask_d1(self: Any, source: Any, transfer_id: str) -> None:
        if self._target is not None:
            before_stop[self._target.key] = await _metrics(session, self._target.url)
        await original(self, source, transfer_id)

    live.LiveStream._ask_d1 = ask_d1  # type: ignore[method-assign]


# D2's own counts of the migrated request kept in the JSON (sums over that one request).
D2_METRICS = {
    "vllm:time_to_first_token_seconds_sum": "ttft_ms",
    "vllm:request_queue_time_seconds_sum": "queue_ms",
    "vllm:request_prefill_time_seconds_sum": "prefill_ms",
    "vllm:request_prefill_kv_computed_tokens_sum": "computed_tokens",
    "vllm:prompt_tokens_by_source_total{source=local_cache_hit}": "local_hit_tokens",
    "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}": "pulled_tokens",
}


async def _d2_counts(
    session: Any, sample: dict, url_of: dict[str, str], before_stop: dict[str, dict[str, float]]
) -> None:
    """``--stages``: D2's metrics for the migrated request alone (since the stop was asked):
    its queue (the pull), its first step (prefill), its TTFT as vLLM counts it."""
    [moved] = sample["answer"] or [{}]
    if moved.get("outcome") != "moved" or moved["to"] not in before_stop:
        return
    diff = _diff(before_stop.pop(moved["to"]), await _metrics(session, url_of[moved["to"]]))
    sample["d2"] = {
        name: diff.get(key, 0.0) * (1000 if name.endswith("_ms") else 1)
        for key, name in D2_METRICS.items()
    }


def _extra_gap_ms(sample: dict) -> float | None:
    [moved] = sample["answer"] or [{}]
    if moved.get("outcome") != "moved":
        return None
    at = moved["tokens_before"]  # index of the first token from the new D
    gaps = [b - a for a, b in zip(sample["times"], sample["times"][1:], strict=False)]
    switch = gaps[at - 1]
    usual = statistics.median(gaps[: at - 1] + gaps[at:])
    return (switch - usual) * 1000


async def measure(
    prefill: Any,
    decodes: list[Any],
    model: str,
    make_prompt: Callable[[int, int], Any],
    args: argparse.Namespace,
    *,
    probe: CpuProbe | None = None,
) -> dict:
    import aiohttp

    systems = args.systems
    proxies = {s: await _start_proxy(prefill, decodes, model, *HOW[s]) for s in systems}
    samples: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in args.contexts} for s in systems}
    url_of = {f"d{i}": d.url for i, d in enumerate(decodes)}
    # "none" runs on the D the round's pre-copied request started on (the D's differ in speed).
    unmoved_on = {}
    if "none" in systems and len(decodes) == 2:
        unmoved_on = {
            f"d{i}": await _start_proxy(prefill, [d], model, True) for i, d in enumerate(decodes)
        }
    before_stop: dict[str, dict[str, float]] = {}  # D2's metrics as the stop is asked
    try:
        async with aiohttp.ClientSession() as session:
            if args.stages:
                _scrape_before_stop(session, before_stop)
            for round_ in range(args.rounds):
                order = systems if round_ % 2 == 0 else systems[::-1]
                order = [s for s in order if s != "none"] + ["none"] * ("none" in order)
                for context in args.contexts:
                    prompt = make_prompt(context - args.migrate_after, 1000 * context + round_)
                    for system in order:
                        body = {
                            "model": model,
                            "prompt": prompt,
                            "max_tokens": args.migrate_after + args.after_tokens,
                            "temperature": 0.0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                            "stream": True,
                            # Each system's own prefix caches: none hits what another moved.
                            "cache_salt": f"{system}-{round_}",
                        }
                        if args.margins:  # where the systems' tokens part: a near-tie?
                            body["logprobs"] = 2
                        url = proxies[system][0]
                        after = None if system == "none" else args.migrate_after
                        if system == "none" and unmoved_on and samples["precopy"][context]:
                            url = unmoved_on[_started_on(samples["precopy"][context][-1])][0]
                        at = (args.migrate_after, args.migrate_after + args.probe_window)
                        sample = await _one(session, url, body, after, probe=probe, probe_at=at)
                        sample["prompt_tokens"] = len(prompt)
                        if args.stages and system == "precopy":
                            await _d2_counts(session, sample, url_of, before_stop)
                        samples[system][context].append(sample)
    finally:
        for _, proxy, runner in [*proxies.values(), *unmoved_on.values()]:
            await proxy.drain_background()
            await runner.cleanup()
    return {"samples": samples}


def summarize(result: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    samples = result["samples"]
    for context in args.contexts:
        row: dict[str, Any] = {"context": context}
        for system in args.systems:
            runs = samples[system][context]
            gaps = [g for g in map(_extra_gap_ms, runs) if g is not None]
            itl = [
                statistics.median(b - a for a, b in zip(r["times"], r["times"][1:], strict=False))
                for r in runs
            ]
            row[f"{system}_moved"] = len(gaps)
            row[f"{system}_extra_gap_ms"] = statistics.median(gaps) if gaps else None
            row[f"{system}_itl_ms"] = statistics.median(itl) * 1000 if itl else None
            unmoved = samples["none"][context] if "none" in samples else [None] * len(runs)
            ratios = [
                r
                for r in map(_tpot_ratio, runs, unmoved)  # against the same request unmoved
                if r is not None
            ]
            row[f"{system}_tpot_during"] = statistics.median(ratios) if ratios else None
            before = [r for r in map(_tpot_ratio, runs) if r is not None]
            row[f"{system}_tpot_during_over_before"] = statistics.median(before) if before else None
        # The truth: the request not moved ("none"), else the other system.
        truth = "none" if "none" in samples else "recompute"
        same = [
            a["tokens"] == b["tokens"]
            for a, b in zip(samples["precopy"][context], samples[truth][context], strict=True)
        ]
        row["same_tokens"] = f"{sum(same)}/{len(same)}"
        row["same_tokens_as"] = truth
        for system in _moving(args.systems):
            row[f"{system}_parted"] = _parted(samples[system][context], samples[truth][context])
        ours, re = row["precopy_extra_gap_ms"], row.get("recompute_extra_gap_ms")
        row["precopy_over_recompute"] = ours / re if ours is not None and re else None
        rows.append(row)
    return rows


def _parted(moved: list[dict], truth: list[dict]) -> list[dict[str, Any]]:
    """Where each moved request's tokens part from the unmoved one's: the token (counted from
    the switch) and the unmoved run's top-1 minus top-2 logprob there (a near-tie when small)."""
    out = []
    for round_, (a, b) in enumerate(zip(moved, truth, strict=True)):
        pairs = enumerate(zip(a["tokens"], b["tokens"], strict=False))
        k = next((i for i, (x, y) in pairs if x != y), None)
        if k is None:
            continue
        [answer] = a["answer"] or [{}]
        margins = b.get("margins") or []
        out.append(
            {
                "round": round_,
                "after_switch": k - answer.get("tokens_before", 0),
                "margin": round(margins[k], 4) if k < len(margins) else None,
            }
        )
    return out


def _window(sample: dict, unmoved: dict | None) -> dict[str, Any] | None:
    """The gaps (ms) on D1 from the ask to the switch, the unmoved request's at the same
    positions, and when each stage was reached (ms after the token the ask followed)."""
    [moved] = sample["answer"] or [{}]
    if moved.get("outcome") != "moved":
        return None
    at, asked = moved["tokens_before"], sample["asked_at"]
    t0 = sample["times"][asked - 1]
    marks = {k: moved["asked_at"] + v / 1000 for k, v in moved.get("stages_ms", {}).items()}
    return {
        "gaps": [round(g * 1000, 2) for g in _gaps(sample)[asked - 1 : at]],
        "unmoved": [round(g * 1000, 2) for g in _gaps(unmoved)[asked - 1 : at]] if unmoved else [],
        "marks": {k: round((t - t0) * 1000, 2) for k, t in marks.items()},
    }


def stage_rows(result: dict, args: argparse.Namespace) -> list[dict]:
    """Per context: the pre-copy hand-off's stages (medians over the rounds, ms), and with
    ``--stages`` D2's metrics for the migrated request and the direct probes (each round's)."""
    out = []
    for context in args.contexts:
        runs = result["samples"].get("precopy", {}).get(context, [])
        stages = [s for s in (_stages(r, r.get("prompt_tokens", 0)) for r in runs) if s]
        keys = sorted({k for s in stages for k in s})
        row: dict[str, Any] = {
            "context": context,
            "stages_ms": {k: statistics.median(s[k] for s in stages if k in s) for k in keys},
        }
        unmoved = result["samples"].get("none", {}).get(context, [None] * len(runs))
        row["tpot_windows"] = [_window(r, u) for r, u in zip(runs, unmoved, strict=False)]
        d2 = [r["d2"] for r in runs if r.get("d2")]
        if d2:
            row["d2_ms"] = {k: statistics.median(x[k] for x in d2) for k in d2[0]}
        out.append(row)
    return out


def _as_roles(delta: dict[str, Any], d1: str) -> dict[str, Any]:
    """A CPU delta's groups named by role: D1 (the D the request started on), D2, P."""

    def role(group: str) -> str:
        name, _, kind = group.partition(":")
        if name.startswith("decode"):
            name = "D1" if f"d{name.removeprefix('decode')}" == d1 else "D2"
        elif name.startswith("prefill"):
            name = "P"
        return f"{name}:{kind}"

    return {
        "ms": delta["ms"],
        "run": {role(k): v for k, v in delta["run"].items()},
        "wait": {role(k): v for k, v in delta["wait"].items()},
        "cores": delta["cores"],
    }


def cpu_rows(result: dict, args: argparse.Namespace) -> list[dict]:
    """``--cpu-probe``: per context, the CPU each process took (``run``) and waited for
    (``wait``) between the ask and ``--probe-window`` tokens later, medians over the rounds, for
    the pre-copied request and the same one unmoved (at the same token positions), and their
    difference: what the pre-copy adds on the box while D1 decodes."""
    out = []
    samples = result["samples"]
    for context in args.contexts:
        row: dict[str, Any] = {"context": context}
        moved = samples["precopy"][context]
        for system in ("precopy", "none"):
            deltas = [
                _as_roles(r["cpu"], _started_on(m))
                for r, m in zip(samples[system][context], moved, strict=False)
                if r.get("cpu")
            ]
            if not deltas:
                continue
            summary: dict[str, Any] = {"ms": statistics.median(d["ms"] for d in deltas)}
            for key in ("run", "wait", "cores"):
                names = sorted({k for d in deltas for k in d[key]})
                summary[key] = {
                    k: round(statistics.median(d[key].get(k, 0.0) for d in deltas), 2)
                    for k in names
                }
            row[system] = summary
        if "precopy" in row and "none" in row:
            row["added"] = {
                key: {
                    k: round(v - row["none"][key].get(k, 0.0), 2)
                    for k, v in row["precopy"][key].items()
                }
                for key in ("run", "wait")
            }
        out.append(row)
    return out


def targets(rows: list[dict]) -> dict[str, Any]:
    """The ratios the migration is held to (None where a context was not run)."""
    by = {r["context"]: r for r in rows}
    gap = {c: r["precopy_extra_gap_ms"] for c, r in by.items()}
    first, last = min(by), max(by)
    # Against the 256 one's gap, floored at 1 ms: a few-ms gap divides into noise.
    flat = gap[last] / max(gap[first], 1.0) if gap[last] is not None and gap[first] else None
    tpot = [r["precopy_tpot_during"] for r in rows if r["precopy_tpot_during"] is not None]
    at_8k = by.get(8192, by[last])
    return {
        f"downtime_{last}_over_{first}": flat,
        "downtime_over_recompute_8k": at_8k["precopy_over_recompute"],
        "d1_tpot_while_precopying": statistics.median(tpot) if tpot else None,
        "limits": {"flat": 1.5, "over_recompute": 0.2, "tpot": 1.05},
    }


def plot(rows: list[dict], systems: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    contexts = [r["context"] for r in rows]
    for system in _moving(systems):
        ax.plot(
            contexts,
            [r[f"{system}_extra_gap_ms"] for r in rows],
            marker="o",
            label=system.replace("_", "-"),
        )
    ax.axhspan(*LLUMNIX_DOWNTIME_MS, color="grey", alpha=0.2, label="Llumnix (published)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context at the switch (tokens)")
    ax.set_ylabel("downtime: extra gap at the switch (ms)")
    ax.set_title("Live migration downtime")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def x(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    systems = _moving(args.systems)
    lines = [
        f"Migration after {args.migrate_after} tokens, {args.after_tokens} after; "
        f"{args.rounds} rounds; medians; model {args.arch}.",
        "",
        "| context | "
        + " | ".join(f"{s}: downtime ms" for s in systems)
        + " | precopy / recompute | D1 TPOT while pre-copying | ITL ms | same tokens |",
        "|---:|" + "---:|" * (len(systems) + 4),
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | "
            + " | ".join(ms(r[f"{s}_extra_gap_ms"]) for s in systems)
            + f" | {x(r.get('precopy_over_recompute'))} | {x(r['precopy_tpot_during'])} "
            f"| {ms(r['precopy_itl_ms'])} | {r['same_tokens']} |"
        )
    return "\n".join(lines)


def _moving(systems: list[str]) -> list[str]:
    """The systems that move the request (not "none")."""
    return [s for s in systems if s != "none"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="against stand-ins, in seconds")
    parser.add_argument(
        "--contexts",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[256, 1024, 4096, 8192, 16384],
    )
    parser.add_argument(
        "--systems",
        type=lambda s: s.split(","),
        default=list(SYSTEMS),
        help="precopy,recompute[,stop_and_copy]",
    )
    parser.add_argument("--arch", default="qwen2-wide", help="the random-weight model")
    parser.add_argument("--migrate-after", type=int, default=32)
    parser.add_argument("--after-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--stages",
        action="store_true",
        help="then a pass that reads D2's metrics around each stop (--stage-contexts)",
    )
    parser.add_argument(
        "--stage-contexts",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[256, 16384],
    )
    parser.add_argument("--stage-rounds", type=int, default=2)
    parser.add_argument(
        "--cpu-probe",
        action="store_true",
        help="then a pass that reads each process's CPU from the ask on (--probe-window)",
    )
    parser.add_argument("--probe-window", type=int, default=8, help="tokens after the ask")
    parser.add_argument("--probe-rounds", type=int, default=4)
    parser.add_argument("--probe-contexts", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--margins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask top-2 logprobs: the margin where a moved request's tokens part",
    )
    parser.add_argument(
        "--worker-in-engine",
        action="store_true",
        help="each instance's worker inside its engine process (no spinning shm reader)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "migration.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "migration_downtime.png")
    return parser


async def _smoke(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(TESTS))
    from pd_serving.routing import Backend
    from stand_ins import (
        MODEL,
        PREFILL_RPC,
        FakeDecode,
        fake_prefill,
        model_tokens,
    )

    p = fake_prefill()

    # A stream to be moved holds its second-to-last token until D1 is asked to stop it: on a
    # loaded box the ask can come after the last token (a move that moved nothing) otherwise.
    def to_move(body: dict) -> bool:
        return not body.get("cache_salt", "").startswith("none-")

    decodes = [
        FakeDecode(f"D{i}", token_delay_s=0.004, precopy_block=4, hold_for_migration=to_move)
        for i in range(2)
    ]
    await p.start()
    for d in decodes:
        await d.start()
    try:
        async with asyncio.timeout(SMOKE_DEADLINE_S):  # a hung move fails, it does not hang CI
            result = await measure(
                Backend(p.url, rpc_address=PREFILL_RPC),
                decodes,
                MODEL,
                lambda n, seed: [3 + (seed + i) % 400 for i in range(n)],
                args,
            )
    finally:
        await p.close()
        for d in decodes:
            await d.close()
    rows = summarize(result, args)
    print(markdown(rows, args))
    stages = stage_rows(result, args)
    assert all(s["stages_ms"]["switch_gap"] > 0 for s in stages), stages
    n = args.rounds
    assert all(r[f"{s}_moved"] == n for r in rows for s in _moving(args.systems)), rows
    assert all(r["same_tokens"] == f"{n}/{n}" for r in rows), rows
    print(json.dumps(targets(rows)))
    if args.png:
        plot(rows, args.systems, Path("/tmp") / "bench-migration-smoke.png")
    sample = result["samples"]["precopy"][args.contexts[0]][0]
    prompt_len = args.contexts[0] - args.migrate_after
    prompt = [3 + (1000 * args.contexts[0] + i) % 400 for i in range(prompt_len)]
    assert sample["tokens"] == model_tokens(prompt, args.migrate_after + args.after_tokens)
    print("bench_migration smoke: ok")
    return 0


def _stage_args(args: argparse.Namespace) -> argparse.Namespace:
    """``--stages``: the pass that reads D2's metrics around each stop (its own rounds)."""
    staged = argparse.Namespace(**vars(args))
    if args.stages:
        staged.contexts = [c for c in args.stage_contexts if c <= max(args.contexts)]
        staged.systems = ["precopy", "none"]
        staged.rounds = args.stage_rounds
    return staged


def _probe_args(args: argparse.Namespace) -> argparse.Namespace:
    """``--cpu-probe``: the pass that reads each process's CPU around the ask."""
    probed = argparse.Namespace(**{**vars(args), "stages": False})
    probed.contexts = args.probe_contexts or args.contexts
    probed.systems = ["precopy", "none"]
    probed.rounds = args.probe_rounds
    return probed


def run(args: argparse.Namespace) -> int:
    from pd_serving.client import load_tokenizer
    from pd_serving.deploy import Deployment
    from pd_serving.model import default_model_dir, make_model
    from pd_serving.servers import Connector, CpuSettings, Role, plan_servers

    model = make_model(default_model_dir(args.arch), args.arch)
    load_tokenizer(model)  # the model is complete before the servers start
    log_dir = Path("/tmp") / f"bench-migration-{int(time.time())}"
    longest = max(args.contexts) + args.after_tokens + 64
    cpu = CpuSettings(
        max_model_len=max(2048, longest),
        kv_cache_bytes=max(64 << 20, 6 * longest * 2048),  # the wide model: 2 KiB a token
        worker_in_engine=args.worker_in_engine,
    )
    servers = plan_servers(model, log_dir=log_dir, connector=Connector.HYBRID, decode=2, cpu=cpu)
    vocab = 400

    def make_prompt(n: int, seed: int) -> list[int]:
        return [3 + (seed * 7919 + i * 104729) % vocab for i in range(n)]

    with Deployment(servers) as deployment:
        deployment.start(timeout=600)
        prefill = deployment.by_role(Role.PREFILL)[0]
        decodes = deployment.by_role(Role.DECODE)
        started = time.time()
        staged = _stage_args(args)
        timed = argparse.Namespace(**{**vars(args), "stages": False})
        result = asyncio.run(measure(prefill, decodes, str(model), make_prompt, timed))
        if staged.stages:  # after the timed pass: its metrics scrapes would be in its windows
            stage_result = asyncio.run(measure(prefill, decodes, str(model), make_prompt, staged))
        cpu: list[dict] = []
        if args.cpu_probe:  # its own pass too: the reads cost this process a few ms
            probed = _probe_args(args)
            probe = CpuProbe.of(deployment.servers)
            probe_result = asyncio.run(
                measure(prefill, decodes, str(model), make_prompt, probed, probe=probe)
            )
            cpu = cpu_rows(probe_result, probed)
            print(json.dumps(cpu, indent=1))
    rows = summarize(result, args)
    table = markdown(rows, args)
    print(table)
    stages = stage_rows(stage_result if staged.stages else result, staged)
    print(json.dumps(stages, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "started": started,
                "rows": rows,
                "stages": stages,
                "cpu": cpu,
                "targets": targets(rows),
                "llumnix_downtime_ms": LLUMNIX_DOWNTIME_MS,
                "table": table,
            },
            indent=1,
        )
    )
    plot(rows, args.systems, args.png)
    print(json.dumps(targets(rows)))
    return 0


def main() -> int:
    args = _parser().parse_args()
    if args.smoke:
        args.contexts, args.migrate_after, args.after_tokens, args.rounds = [24, 40], 8, 6, 2
        args.systems = ["precopy", "recompute", "stop_and_copy", "none"]
        return asyncio.run(_smoke(args))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
