"""Helpers of the end-to-end tests: vLLM's prometheus metrics and process trees.

``wait_until`` is this tree's one way to wait for a state that has no event (vLLM shows KV usage
and requests only as metrics); processes are waited for on pidfds
(``stand_ins.wait_all_gone``, pd-serving's test helpers), readiness on the launcher's
futures.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from stand_ins import wait_until as _wait_until

T = TypeVar("T")

# Gauges that must read zero on an idle instance that holds no request's blocks.
IDLE_GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


async def read_gauges(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with session.get(f"{base_url}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in IDLE_GAUGES and "reason" not in sample.labels:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def prompt_tokens_by_source(
    session: aiohttp.ClientSession, base_url: str
) -> dict[str, float]:
    """vLLM's ``prompt_tokens_by_source`` counter: local_compute / local_cache_hit /
    external_kv_transfer (what a connector loaded)."""
    async with session.get(f"{base_url}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "vllm:prompt_tokens_by_source":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                source = sample.labels["source"]
                out[source] = out.get(source, 0.0) + sample.value
    return out


async def wait_until(
    read: Callable[[], Awaitable[T]], done: Callable[[T], bool], within_s: float = 60.0
) -> T:
    """stand_ins', with the longer default these end-to-end waits need."""
    return await _wait_until(read, done, within_s)


async def wait_idle(
    session: aiohttp.ClientSession,
    base_urls: Iterable[str],
    within_s: float = 60.0,
    before_each: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, dict[str, float]]:
    """Wait until every instance reports no KV in use and no request; returns the last readings
    (an abort or a lease expiry takes the engine a step or two to show). ``before_each`` runs
    before every reading (e.g. a request that makes an idle engine step)."""
    urls = list(base_urls)

    async def read() -> dict[str, dict[str, float]]:
        if before_each is not None:
            await before_each()
        return {url: await read_gauges(session, url) for url in urls}

    def idle(readings: dict[str, dict[str, float]]) -> bool:
        return all(v == 0.0 for gauges in readings.values() for v in gauges.values())

    return await wait_until(read, idle, within_s)


async def metric_sum(session: aiohttp.ClientSession, base_url: str, sample_name: str) -> float:
    """The sum over labels of one metric sample (e.g. ``pdserve_inflight``) at ``base_url``."""
    async with session.get(f"{base_url}/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name
    )


async def wait_metric_at_least(
    session: aiohttp.ClientSession,
    base_url: str,
    sample_name: str,
    value: float,
    within_s: float = 60.0,
) -> bool:
    """Wait until ``metric_sum`` reaches ``value``; False if it did not within ``within_s``."""

    async def read() -> float:
        return await metric_sum(session, base_url, sample_name)

    return await wait_until(read, lambda v: v >= value, within_s) >= value


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (children of children...), from /proc."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found
