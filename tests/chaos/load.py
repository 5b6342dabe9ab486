"""Steady load for the chaos suite: N streaming clients, each sending back to back with a deadline,
every answer judged against the single instance's, and the report.

Each request ends in exactly one ``Outcome.kind``:

- ``completed``: 200, the stream ended with ``data: [DONE]``, token ids equal to the reference;
- ``http_error``: a non-200 status (a clear error);
- ``error_event``: an SSE event with ``finish_reason == "error"`` or an ``error`` object (a clear
  error, also after some tokens);

and the violations (the suite asserts there are none):

- ``mismatch``: a complete answer whose tokens differ from the reference;
- ``silent``: a 200 stream that ended (or broke off) without ``[DONE]`` and without an error
  event: the "silent 200" the issue forbids;
- ``hang``: no end within the deadline;
- ``unreachable``: the proxy itself refused or dropped the connection before a status.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from pd_serving.client import greedy_body

CLEAR = ("completed", "http_error", "error_event")
VIOLATIONS = ("mismatch", "silent", "hang", "unreachable")


@dataclass
class Outcome:
    client: int
    prompt_index: int
    started: float  # time.monotonic()
    ended: float
    kind: str
    ttft_s: float | None = None
    status: int | None = None
    tokens: int = 0
    detail: str = ""


@dataclass
class FaultWindow:
    name: str
    started: float
    ended: float | None = None  # None: still on


async def stream_once(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str | list[int],
    expected: list[int],
    *,
    max_tokens: int,
    deadline_s: float,
    client: int = 0,
    prompt_index: int = 0,
) -> Outcome:
    """One greedy streaming completion through the proxy, judged (see the module docstring)."""
    body = greedy_body(model, prompt, max_tokens=max_tokens, stream=True)
    # The proxy's own deadline for this request, a little inside ours: past it the proxy must
    # answer with an error (504 or an error event) before the client gives up.
    headers = {"x-request-timeout-s": str(max(1.0, deadline_s - 10.0))}
    started = time.monotonic()
    out = Outcome(client, prompt_index, started, started, kind="silent")
    token_ids: list[int] = []
    saw_done = False
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.kind = "http_error"
                    out.detail = (await resp.text())[:200]
                    return out
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        saw_done = True
                        continue
                    event = json.loads(payload)
                    if event.get("error"):
                        out.kind = "error_event"
                        out.detail = json.dumps(event["error"])[:200]
                    for choice in event.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        if ids and out.ttft_s is None:
                            out.ttft_s = time.monotonic() - started
                        token_ids.extend(ids)
                        if choice.get("finish_reason") == "error":
                            out.kind = "error_event"
                            out.detail = out.detail or json.dumps(choice)[:200]
    except TimeoutError:
        out.kind = "hang"
        out.detail = f"no end within {deadline_s:.0f} s ({len(token_ids)} tokens)"
    except aiohttp.ClientPayloadError as exc:  # the stream broke off
        if out.kind != "error_event":
            out.kind = "silent"
            out.detail = f"stream broke off without an error event: {exc!r}"[:200]
    except aiohttp.ClientError as exc:
        out.kind = "unreachable" if out.status is None else "silent"
        out.detail = repr(exc)[:200]
    finally:
        out.ended = time.monotonic()
        out.tokens = len(token_ids)
    if out.kind in ("hang", "unreachable", "error_event", "http_error"):
        return out
    if not saw_done:
        out.kind = "silent"
        out.detail = out.detail or f"200 stream ended without [DONE] ({len(token_ids)} tokens)"
    elif token_ids != expected:
        out.kind = "mismatch"
        out.detail = (
            f"{len(token_ids)} tokens, first difference at {_first_difference(token_ids, expected)}"
        )
    else:
        out.kind = "completed"
    return out


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass
class SteadyLoad:
    """``clients`` coroutines sending back to back until ``stop()``; prompts taken in turn."""

    url: str
    model: str
    prompts: Sequence[str | list[int]]
    expected: Sequence[list[int]]
    clients: int = 8
    max_tokens: int = 16
    deadline_s: float = 60.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._changed = asyncio.Condition()  # notified with every outcome
        self._tasks: list[asyncio.Task[None]] = []
        self._next = 0

    async def __aenter__(self) -> SteadyLoad:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Let every client finish its request in flight (each is bounded by its deadline)."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if not self._session.closed:
            await self._session.close()

    async def _client(self, client: int) -> None:
        while not self._stop.is_set():
            index = self._next % len(self.prompts)
            self._next += 1
            outcome = await stream_once(
                self._session,
                self.url,
                self.model,
                self.prompts[index],
                self.expected[index],
                max_tokens=self.max_tokens,
                deadline_s=self.deadline_s,
                client=client,
                prompt_index=index,
            )
            self.outcomes.append(outcome)
            async with self._changed:
                self._changed.notify_all()
            if outcome.kind == "unreachable":
                await asyncio.sleep(0.2)  # the proxy is gone: do not spin on refusals

    async def wait_for(self, done: Callable[[list[Outcome]], bool], within_s: float) -> bool:
        """Wait until ``done(outcomes)`` holds (checked at every new outcome); False on timeout."""
        try:
            async with asyncio.timeout(within_s), self._changed:
                await self._changed.wait_for(lambda: done(self.outcomes))
        except TimeoutError:
            return False
        return True

    def completed_since(self, since: float) -> int:
        return sum(1 for o in self.outcomes if o.kind == "completed" and o.started >= since)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def during(outcome: Outcome, windows: Sequence[FaultWindow], now: float) -> bool:
    return any(
        outcome.started < (w.ended if w.ended is not None else now) and outcome.ended > w.started
        for w in windows
    )


def report(
    outcomes: Sequence[Outcome],
    windows: Sequence[FaultWindow],
    *,
    failed_over: float | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The counts the issue asks for, per fault window too, plus every violation in full."""
    now = time.monotonic()
    kinds = {kind: sum(1 for o in outcomes if o.kind == kind) for kind in (*CLEAR, *VIOLATIONS)}
    in_faults = [o for o in outcomes if during(o, windows, now)]
    calm = [o for o in outcomes if not during(o, windows, now)]

    def ttft_p99(group: Sequence[Outcome]) -> float | None:
        value = percentile(
            [o.ttft_s for o in group if o.ttft_s is not None and o.kind == "completed"], 99
        )
        return None if value is None else round(value * 1000, 1)

    per_fault = {}
    for w in windows:
        group = [o for o in outcomes if during(o, [w], now)]
        per_fault[w.name] = {
            "seconds": round((w.ended or now) - w.started, 1),
            "requests": len(group),
            **{kind: sum(1 for o in group if o.kind == kind) for kind in (*CLEAR, *VIOLATIONS)},
            "ttft_p99_ms": ttft_p99(group),
        }
    return {
        "requests": len(outcomes),
        "completed": kinds["completed"],
        "failed_over": failed_over,
        "errors": kinds["http_error"] + kinds["error_event"],
        **{f"{k}": v for k, v in kinds.items() if k != "completed"},
        "violations": sum(kinds[k] for k in VIOLATIONS),
        "requests_during_faults": len(in_faults),
        "ttft_p99_ms_during_faults": ttft_p99(in_faults),
        "ttft_p99_ms_outside_faults": ttft_p99(calm),
        "per_fault": per_fault,
        "violation_samples": [asdict(o) for o in outcomes if o.kind in VIOLATIONS][:20],
        **(extra or {}),
    }
