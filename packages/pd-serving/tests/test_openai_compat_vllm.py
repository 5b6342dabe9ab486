"""The proxy as a drop-in OpenAI endpoint: the official ``openai`` SDK against the session's xPyD
proxy (``pdserve up``) and against a plain vLLM server of the same tiny model (P1, asked without
transfer parameters), side by side. Every case answers the same: text, tokens and their
logprobs, usage, finish reasons, choice order; or both refuse it.

The cases are what completions clients written for vLLM send: a list of one prompt (LangChain,
lm-eval), a batch of prompts (strings and token ids), ``n`` > 1, ``echo`` with ``logprobs`` and
``max_tokens: 0`` (scoring a text), no ``model`` at all; and chat with ``n``, logprobs and a
streamed usage chunk. Greedy (the tiny model's answers are deterministic), and ``n`` > 1 sampled
with a fixed ``seed``: vLLM runs choice i with ``seed + i`` on its own generator, the proxy
sends choice i as a single request with that seed (``openai_compat``), so the sampled choices
are the same tokens, streamed or not, on completions and chat.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from harness.pool import Xpyd

# The SDK and its HTTP client come with vLLM; this module runs where vLLM does (the vllm session)
# and is only collected, never run, by pd-serving's own session without vLLM.
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

TOLERANCE = 1e-3  # logprobs: the same computation on another instance's KV
IGNORED = {"id", "created", "system_fingerprint", "kv_transfer_params", "service_tier"}


def _clients(xpyd: Xpyd) -> tuple[openai.OpenAI, openai.OpenAI]:
    def client(url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120.0, max_retries=0)

    return client(xpyd.proxy_url), client(xpyd.reference_url)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, abs_tol=TOLERANCE) or (math.isinf(a) and a == b)
    return a == b


def _assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal JSON trees, ids and timestamps aside, floats within TOLERANCE."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        keys = set(want) - IGNORED
        assert set(got) - IGNORED == keys, f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in keys:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list), where
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert _close(got, want), f"{where}: {got!r} != {want!r}"


def _both(xpyd: Xpyd, call: Any) -> tuple[Any, Any]:
    """``call(client)`` on the proxy and on vLLM: (answer or the APIStatusError) of each."""
    results = []
    for client in _clients(xpyd):
        try:
            results.append(call(client).model_dump())
        except openai.APIStatusError as error:
            results.append(error)
        finally:
            client.close()
    return results[0], results[1]


def _assert_same_answer(xpyd: Xpyd, call: Any) -> dict[str, Any]:
    got, want = _both(xpyd, call)
    if isinstance(want, openai.APIStatusError):
        # vLLM refuses it too: so must the proxy, with the same status.
        assert isinstance(got, openai.APIStatusError), f"vLLM refused ({want}), the proxy served"
        assert got.status_code == want.status_code
        return {}
    assert not isinstance(got, openai.APIStatusError), f"the proxy refused: {got}"
    _assert_same(got, want)
    return want


COMPLETION_CASES = {
    "list_of_one_prompt": {"prompt": ["def add(a, b):"], "logprobs": 2},
    "batch_of_texts": {"prompt": ["def add(a, b):", "The quick brown fox"], "logprobs": 1},
    "batch_of_token_ids": {"prompt": [[11, 12, 13, 14], [21, 22, 23]]},
    "n_choices": {"prompt": "def add(a, b):", "n": 2},
    "batch_times_n": {"prompt": ["def add(a, b):", "The quick brown fox"], "n": 2},
    "echo_scoring": {"prompt": "The quick brown fox", "echo": True, "logprobs": 1, "max_tokens": 0},
    # vLLM raises a temperature under 1e-2 to 1e-2 and samples: only 0 refuses n > 1.
    "n_tiny_temperature": {"prompt": "def add(a, b):", "n": 2, "temperature": 1e-6, "seed": 3},
    "n_negative_temperature": {"prompt": "def add(a, b):", "n": 2, "temperature": -1.0},
}
# n > 1 sampled: the same seed on both sides; a temperature that spreads the choices apart.
SAMPLED = {"temperature": 0.9, "seed": 1234, "max_tokens": 12}
SAMPLED_CASES = {
    "n_choices": {"prompt": "def add(a, b):", "n": 4, "logprobs": 2},
    "batch_times_n": {"prompt": ["def add(a, b):", "The quick brown fox"], "n": 3},
}


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completions_answer_as_vllm_does(xpyd: Xpyd, case: str) -> None:
    body = {"max_tokens": 8, "temperature": 0.0, **COMPLETION_CASES[case]}
    model = xpyd.model_name
    want = _assert_same_answer(xpyd, lambda c: c.completions.create(model=model, **body))
    if case == "echo_scoring" and want:
        assert want["choices"][0]["logprobs"]["tokens"], "vLLM scored the prompt"


@pytest.mark.parametrize("case", sorted(SAMPLED_CASES))
def test_sampled_n_choices_are_vllms(xpyd: Xpyd, case: str) -> None:
    body = {**SAMPLED, **SAMPLED_CASES[case]}
    model = xpyd.model_name
    want = _assert_same_answer(xpyd, lambda c: c.completions.create(model=model, **body))
    assert want, "vLLM refused it"
    choices = want["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    # Sampled, not greedy: one prompt's choices are not all the same text.
    n = body["n"]
    assert len({c["text"] for c in choices[:n]}) > 1, choices


def _streamed(client: Any, create: Any, text_of: Any) -> tuple[dict, dict, Any]:
    """(text per choice index, finish reason per index, the one usage chunk) of a stream."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = None
    with client:
        for chunk in create(client):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (text_of(choice) or "")
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
            if chunk.usage is not None:
                assert usage is None, "one usage chunk"
                usage = chunk.usage.model_dump()
    return texts, finish, usage


STREAMED_CASES = {
    "list_of_one_prompt": {"max_tokens": 8, "temperature": 0.0, "prompt": ["def add(a, b):"]},
    "batch_of_texts": {"max_tokens": 8, "temperature": 0.0, **COMPLETION_CASES["batch_of_texts"]},
    **{f"sampled_{k}": {**SAMPLED, **v} for k, v in SAMPLED_CASES.items()},
}


@pytest.mark.parametrize("case", sorted(STREAMED_CASES))
def test_streamed_completions_carry_the_same_choices_and_usage(xpyd: Xpyd, case: str) -> None:
    body = STREAMED_CASES[case]
    model = xpyd.model_name

    def create(client: Any) -> Any:
        return client.completions.create(
            model=model, stream=True, stream_options={"include_usage": True}, **body
        )

    got, want = (_streamed(c, create, lambda choice: choice.text) for c in _clients(xpyd))
    assert got == want
    texts = want[0]
    assert sorted(texts) == list(range(len(texts)))
    assert want[2] is not None
    assert want[2]["completion_tokens"] > 0


def test_a_request_without_model_is_served_as_vllm_serves_it(xpyd: Xpyd) -> None:
    """The SDK always names a model; other clients do not (plain JSON)."""
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0.0}
    got, want = (
        httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
        for url in (xpyd.proxy_url, xpyd.reference_url)
    )
    assert got.status_code == want.status_code
    if want.status_code == 200:
        _assert_same(got.json(), want.json())


def test_chat_with_n_logprobs_and_streamed_usage_answers_as_vllm_does(xpyd: Xpyd) -> None:
    model = xpyd.model_name
    messages = [{"role": "user", "content": "def add(a, b):"}]
    body = {"max_tokens": 8, "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    _assert_same_answer(
        xpyd, lambda c: c.chat.completions.create(model=model, messages=messages, **body)
    )
    _assert_same_answer(
        xpyd, lambda c: c.chat.completions.create(model=model, messages=messages, n=2, **body)
    )
    answers = []
    for client in _clients(xpyd):
        with client:
            stream = client.chat.completions.create(
                model=model,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                max_tokens=8,
                temperature=0.0,
            )
            text, usage = "", None
            for chunk in stream:
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
            answers.append((text, usage))
    assert answers[0] == answers[1]


def test_chat_sampled_n_choices_are_vllms(xpyd: Xpyd) -> None:
    model = xpyd.model_name
    messages = [{"role": "user", "content": "def add(a, b):"}]
    body = {**SAMPLED, "n": 3, "logprobs": True, "top_logprobs": 2}
    want = _assert_same_answer(
        xpyd, lambda c: c.chat.completions.create(model=model, messages=messages, **body)
    )
    assert len({c["message"]["content"] for c in want["choices"]}) > 1, want["choices"]

    def create(client: Any) -> Any:
        return client.chat.completions.create(
            model=model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **{**SAMPLED, "n": 3},
        )

    got, streamed = (
        _streamed(c, create, lambda choice: choice.delta.content) for c in _clients(xpyd)
    )
    assert got == streamed
    # The stream's choices are the non-streamed answer's, in the same order.
    assert [streamed[0][i] for i in range(3)] == [c["message"]["content"] for c in want["choices"]]


def _computed_prompt_tokens(urls: list[str]) -> float:
    """Prompt tokens the instances computed themselves (vLLM's counter, summed)."""
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30.0).text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{") and (
                'source="local_compute"' in line
            ):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_n_sampled_choices_are_prefilled_once(xpyd: Xpyd) -> None:
    """n choices of one prompt: the first prefills it, the others find it in P's prefix cache
    and compute only what is past its last full block."""
    n, length, block_at_most = 4, 600, 128  # vLLM's CPU default block size: 128
    prompt = [(7 * i + 3) % 400 + 10 for i in range(length)]
    before = _computed_prompt_tokens(xpyd.prefill_urls)
    body = {"prompt": prompt, "n": n, "max_tokens": 4, "temperature": 1.0, "seed": 7}
    answer = httpx.post(f"{xpyd.proxy_url}/v1/completions", json=body, timeout=120.0)
    assert answer.status_code == 200, answer.text
    assert [c["index"] for c in answer.json()["choices"]] == list(range(n))
    computed = _computed_prompt_tokens(xpyd.prefill_urls) - before
    assert length <= computed <= length + (n - 1) * block_at_most, computed  # n x length apart
