"""Serving a request the way one vLLM server does when the PD path takes single requests.

The PD path (``proxy._Flow``) serves one prompt and one choice per request. A completions batch
(a list of prompts) and ``n`` > 1 are split into such single requests (``Part``), each served on
its own, and their answers merged back into the one answer vLLM gives::

    client request ──split()──> Part(prompt_index, choice_index, body)  x prompts x n
                                    │  each: one prompt, n = 1 (seed + choice_index when seeded)
                                    ▼
    one answer     <──merge_answers(parts, answers)──  answers, in Part order    (stream: false)
    one SSE stream <──StreamMerger.chunk(part, chunk) ... usage_chunk()──         (stream: true)

Numbering is vLLM's: choice ``index`` = prompt_index * n + choice_index; usage counts each
prompt's tokens once (not once per choice) and every choice's completion tokens.

Seeds are vLLM's too: its parallel sampling (``vllm.v1.engine.parallel_sampling``) runs choice
``i`` as a child request with ``seed + i``, and each request samples from its own generator
seeded with its seed, drawn once per token it samples. A seeded request's choice ``i`` is
therefore the single request with ``seed + i``: on D its generator starts fresh with D's first
token (P's one sampled token is dropped), so one prefill on P and n decodes on D draw what
vLLM's n children draw, and the answers are vLLM's (``tests/test_openai_compat_vllm.py``).

Pure (no I/O): the proxy's shell makes the calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# More single requests than this from one client request are refused: each is a call through
# the proxy, and a client with that many should send them as separate requests.
MAX_PARTS = 1024

Prompt = str | list[int]

# vLLM's SamplingParams raise a temperature in (0, 1e-2) to 1e-2 (``_MAX_TEMP``: smaller ones
# overflow), then sample greedily, and refuse n > 1, below 1e-5 (``_SAMPLING_EPS``): so only a
# temperature of 0 is greedy.
LOWEST_SAMPLED_TEMPERATURE = 1e-2
GREEDY_BELOW_TEMPERATURE = 1e-5


class CompatError(ValueError):
    """The request is malformed (answered 400)."""


@dataclass(frozen=True)
class Part:
    """One single request of a split client request."""

    prompt_index: int
    choice_index: int
    index: int  # the choice's index in the merged answer
    body: dict[str, Any]


def _is_token_id(value: object) -> bool:
    # The Router hashes ids as int32 (routing.prefix_hashes); vLLM's vocabularies fit.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def with_model(body: dict[str, Any], model_names: list[str]) -> dict[str, Any]:
    """vLLM serves its (first) model to a request that names none; so does the proxy."""
    if body.get("model") in (None, "") and model_names:
        return {**body, "model": model_names[0]}
    return body


def prompts(prompt: object) -> list[Prompt]:
    """A completions ``prompt`` as its list of single prompts: a string, a list of token ids,
    a list of strings, or a list of token-id lists (vLLM's four forms)."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise CompatError(
            "'prompt' is required: a string, a list of token ids, a list of strings or a "
            "list of token-id lists"
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        singles: list[Prompt] = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        singles = list(prompt)
    else:
        raise CompatError("'prompt' mixes strings, token ids and lists; send one of the forms")
    for single in singles:
        if isinstance(single, list) and not (single and all(_is_token_id(t) for t in single)):
            raise CompatError("'prompt' token ids must be integers in [0, 2**31)")
    return singles


def choices_n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CompatError("'n' must be a positive integer")
    if n > 1 and is_greedy(body):
        # vLLM's own refusal (greedy choices would all be the same).
        raise CompatError(f"n must be 1 when using greedy sampling, got {n}.")
    return n


def is_greedy(body: dict[str, Any]) -> bool:
    """vLLM's rule (``vllm.sampling_params.SamplingParams``): a small positive temperature is
    raised to ``LOWEST_SAMPLED_TEMPERATURE``, then one below ``GREEDY_BELOW_TEMPERATURE`` is
    greedy. A request that sets none gets the model's default (its generation config, 1.0
    without one), which only the instances know: the proxy takes it as sampled and the
    instances decide; a negative or non-number one is refused by the instances (400, relayed)."""
    temperature = body.get("temperature")
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        return False
    if temperature > 0:
        temperature = max(temperature, LOWEST_SAMPLED_TEMPERATURE)
    return 0 <= temperature < GREEDY_BELOW_TEMPERATURE


def needs_no_decode(path: str, body: dict[str, Any]) -> bool:
    """Scoring requests: ``max_tokens`` 0, or the prompt's own logprobs (``echo`` with
    ``logprobs``, ``prompt_logprobs``). The prompt's logprobs come from the prefill's logits,
    which only the instance that prefills computes; one instance serves them, no hand-off."""
    if body.get("prompt_logprobs") is not None:
        return True
    if path != COMPLETIONS:
        return False
    return body.get("max_tokens") == 0 or (
        bool(body.get("echo")) and body.get("logprobs") is not None
    )


def split(path: str, body: dict[str, Any]) -> list[Part]:
    """The single requests that serve ``body`` (one Part, ``body`` itself, when it is one)."""
    n = choices_n(body)
    singles: list[Any] = prompts(body.get("prompt")) if path == COMPLETIONS else [None]
    if len(singles) * n > MAX_PARTS:
        raise CompatError(
            f"{len(singles)} prompts x n={n} is over {MAX_PARTS} completions in one request; "
            "send them as several requests"
        )
    if len(singles) == 1 and n == 1:
        single = dict(body)
        if path == COMPLETIONS:
            single["prompt"] = singles[0]
        single.pop("n", None)
        return [Part(0, 0, 0, single)]
    seed = body.get("seed")
    parts = []
    for prompt_index, prompt in enumerate(singles):
        for choice_index in range(n):
            single = {k: v for k, v in body.items() if k != "n"}
            if path == COMPLETIONS:
                single["prompt"] = prompt
            if seed is not None and n > 1:
                single["seed"] = seed + choice_index
            parts.append(Part(prompt_index, choice_index, prompt_index * n + choice_index, single))
    return parts


def _usage(parts: list[Part], usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    known = [u for u in usages if u is not None]
    if len(known) < len(usages):
        return None
    prompt = sum(
        u["prompt_tokens"] for p, u in zip(parts, known, strict=True) if p.choice_index == 0
    )
    completion = sum(u.get("completion_tokens") or 0 for u in known)
    merged = dict(known[-1])  # vLLM reports the last prompt's details
    merged.update(prompt_tokens=prompt, completion_tokens=completion)
    merged["total_tokens"] = prompt + completion
    return merged


def merge_answers(parts: list[Part], answers: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming answers of ``parts`` (same order) as vLLM's one answer."""
    if len(parts) == 1:
        return answers[0]
    merged = {k: v for k, v in answers[0].items() if k not in ("choices", "usage")}
    choices = []
    for part, answer in zip(parts, answers, strict=True):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": part.index})
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    merged["usage"] = _usage(parts, [a.get("usage") for a in answers])
    if "metrics" in merged:  # per-request metrics describe one sequence: vLLM drops them
        merged["metrics"] = None
    return merged


class StreamMerger:
    """The SSE chunks of ``parts``' streams, in any interleaving, as one stream: one id, the
    choices renumbered, the streams' usage chunks held back and summed into one at the end."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self._id: Any = None
        self._created: Any = None
        self._usage: dict[int, dict[str, Any]] = {}
        self._usage_template: dict[str, Any] | None = None

    def chunk(self, part_no: int, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk to forward for ``chunk`` of part ``part_no``'s stream (None: held back)."""
        if self._id is None and "id" in chunk:
            self._id, self._created = chunk["id"], chunk.get("created")
        if "error" in chunk and "choices" not in chunk:
            return chunk
        out = dict(chunk)
        if "id" in out:
            out["id"] = self._id
        if "created" in out and self._created is not None:
            out["created"] = self._created
        choices = out.get("choices")
        if choices == [] and out.get("usage") is not None:
            self._usage[part_no] = out["usage"]
            self._usage_template = out
            return None
        index = self.parts[part_no].index
        out["choices"] = [{**c, "index": index} for c in choices or []]
        return out

    def usage_chunk(self) -> dict[str, Any] | None:
        """The merged final usage chunk, when the streams sent theirs (include_usage)."""
        if self._usage_template is None:
            return None
        usage = _usage(self.parts, [self._usage.get(i) for i in range(len(self.parts))])
        if usage is None:
            return None
        out = {k: v for k, v in self._usage_template.items() if k != "metrics"}
        out.update(id=self._id, usage=usage)
        if self._created is not None:
            out["created"] = self._created
        return out
