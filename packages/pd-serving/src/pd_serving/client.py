"""A small OpenAI client that measures TTFT and TPOT from the stream, plus exact-length prompts."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp


@dataclass
class Completion:
    """One answer: its text, its token ids (when the server returns them) and its timing."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # request sent -> first token
    tpot_s: float = 0.0  # mean time per output token after the first
    latency_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    # Per output token, {token id: logprob} of the top ones, when asked for (`logprobs=k`).
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Per streamed chunk that carried tokens: seconds since the request was sent (ITL).
    token_times_s: list[float] = field(default_factory=list)
    # Tokens in each of those chunks: more than one means the client never saw the gaps
    # between them (vLLM merged outputs it fell behind on).
    chunk_tokens: list[int] = field(default_factory=list)


def _top_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    # With return_tokens_as_token_ids vLLM names every token "token_id:<id>".
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return [{int(tok.rpartition(":")[2]): lp for tok, lp in (top or {}).items()} for top in tops]


class UpstreamHttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status
        self.body = body


class StreamError(UpstreamHttpError):
    """The stream began (HTTP 200) and ended with an error event (``data: {"error": ...}``, as
    the proxy sends when D fails mid-stream or the deadline passes); ``partial`` has what came
    before it."""

    def __init__(self, status: int, message: str, partial: Completion) -> None:
        super().__init__(status, message)
        self.partial = partial


def greedy_body(
    model: str, prompt: str | list[int], *, max_tokens: int, stream: bool, **extra: Any
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body of exactly ``max_tokens`` tokens, with their ids."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }


async def complete(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: str | list[int],
    *,
    max_tokens: int,
    stream: bool = True,
    logprobs: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Completion:
    """Greedy ``/v1/completions``; streaming gives TTFT and TPOT, non-streaming only latency.

    ``logprobs=k`` also returns each output token's top k (``Completion.top_logprobs``)."""
    body = greedy_body(model, prompt, max_tokens=max_tokens, stream=stream, **(extra or {}))
    if logprobs is not None:
        body["logprobs"] = logprobs
        body["return_tokens_as_token_ids"] = True
    if stream:
        body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    async with session.post(f"{base_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise UpstreamHttpError(resp.status, await resp.text())
        if not stream:
            data = await resp.json()
            done = time.perf_counter()
            choice = data["choices"][0]
            return Completion(
                text=choice["text"],
                token_ids=list(choice.get("token_ids") or []),
                latency_s=done - started,
                ttft_s=done - started,
                completion_tokens=data["usage"]["completion_tokens"],
                prompt_tokens=data["usage"]["prompt_tokens"],
                finish_reason=choice.get("finish_reason"),
                top_logprobs=_top_logprobs(choice),
            )
        return await _read_stream(resp, started)


async def _read_stream(resp: aiohttp.ClientResponse, started: float) -> Completion:
    out = Completion(text="")
    first_token_at: float | None = None
    last_token_at = started
    texts: list[str] = []
    error: dict[str, Any] | None = None
    async for raw_line in resp.content:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue  # read to the end: closing early would look like a client disconnect
        event = json.loads(payload)
        if isinstance(event.get("error"), dict):
            error = event["error"]
            continue
        if event.get("usage"):
            out.completion_tokens = event["usage"]["completion_tokens"]
            out.prompt_tokens = event["usage"]["prompt_tokens"]
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids") or []
            if choice.get("text") or ids:
                now = time.perf_counter()
                first_token_at = first_token_at or now
                last_token_at = now
                out.token_times_s.append(now - started)
                out.chunk_tokens.append(max(1, len(ids)))
            texts.append(choice.get("text") or "")
            out.token_ids.extend(ids)
            out.top_logprobs.extend(_top_logprobs(choice))
            out.finish_reason = choice.get("finish_reason") or out.finish_reason
    done = time.perf_counter()
    out.text = "".join(texts)
    out.latency_s = done - started
    out.ttft_s = (first_token_at or done) - started
    n = out.completion_tokens or len(out.token_ids)
    out.completion_tokens = n
    out.tpot_s = (last_token_at - (first_token_at or last_token_at)) / (n - 1) if n > 1 else 0.0
    if error is not None:
        code = error.get("code")
        raise StreamError(code if isinstance(code, int) else 502, str(error.get("message")), out)
    return out


def load_tokenizer(model_dir: Path):
    """The model's own fast tokenizer (``tokenizers``, no transformers import)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


_WORDS = [
    "prefill",
    "decode",
    "cache",
    "block",
    "token",
    "request",
    "model",
    "answer",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "Monday",
    "Friday",
    "January",
    "question",
]


def exact_length_prompt(tokenizer, num_tokens: int, seed: int = 0) -> str:
    """A text prompt that the model's tokenizer turns into exactly ``num_tokens`` tokens.

    Random words are appended until the text is long enough, then cut at a token boundary; a cut
    can merge differently when re-encoded, so other word draws are tried until one round-trips.
    """
    rng = random.Random(seed)
    for _attempt in range(50):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False).ids) < num_tokens + 8:
            words.append(rng.choice(_WORDS))
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        text = tokenizer.decode(ids[:num_tokens])
        if len(tokenizer.encode(text, add_special_tokens=False).ids) == num_tokens:
            return text
    raise ValueError(f"could not build a prompt of exactly {num_tokens} tokens")
