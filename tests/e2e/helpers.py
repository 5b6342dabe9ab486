"""Helpers of the end-to-end tests: vLLM's prometheus metrics and process trees."""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections.abc import Iterable
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

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


async def wait_idle(
    session: aiohttp.ClientSession, base_urls: Iterable[str], within_s: float = 60.0
) -> dict[str, dict[str, float]]:
    """Wait until every instance reports no KV in use and no request; returns the last readings.

    vLLM exposes this state only as metrics, so they are re-read with backoff; an abort or a lease
    expiry takes the engine a step or two to show.
    """
    urls = list(base_urls)
    deadline = time.monotonic() + within_s
    delay = 0.1
    while True:
        readings = {url: await read_gauges(session, url) for url in urls}
        if all(v == 0.0 for r in readings.values() for v in r.values()):
            return readings
        if time.monotonic() > deadline:
            return readings
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


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
    """Wait until ``metric_sum`` reaches ``value`` (re-read with backoff, as in ``wait_idle``);
    False if it did not within ``within_s``."""
    deadline = time.monotonic() + within_s
    delay = 0.01
    while await metric_sum(session, base_url, sample_name) < value:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)
    return True


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


def wait_all_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait (on pidfds, no polling) until every pid exited; returns the ones still alive."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout
    try:
        while fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready, _, _ = select.select(list(fds), [], [], remaining)
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return set(fds.values())
    finally:
        for fd in fds:
            os.close(fd)
