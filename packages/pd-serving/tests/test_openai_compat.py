"""openai_compat: batches and n split into single requests, answers merged as vLLM does."""

from __future__ import annotations

import pytest
from pd_serving.openai_compat import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    CompatError,
    StreamMerger,
    is_greedy,
    merge_answers,
    needs_no_decode,
    prompts,
    split,
    with_model,
)


def test_prompt_forms() -> None:
    assert prompts("a") == ["a"]
    assert prompts(["a"]) == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], None, ["a", 1], [[1, True]], [[-1]], [[]], [[2**31]]):
        with pytest.raises(CompatError):
            prompts(bad)


def test_missing_model_is_the_served_one() -> None:
    assert with_model({"prompt": "x"}, ["m"])["model"] == "m"
    assert with_model({"model": None}, ["m"])["model"] == "m"
    assert with_model({"model": "other"}, ["m"])["model"] == "other"


def test_single_request_is_one_part_with_a_plain_prompt() -> None:
    (part,) = split(COMPLETIONS, {"model": "m", "prompt": ["a"], "n": 1})
    assert part.body == {"model": "m", "prompt": "a"}
    (part,) = split(CHAT_COMPLETIONS, {"model": "m", "messages": [{}]})
    assert part.body == {"model": "m", "messages": [{}]}


def test_batch_times_n_is_numbered_as_vllm() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 7}
    parts = split(COMPLETIONS, body)
    assert [(p.prompt_index, p.choice_index, p.index) for p in parts] == [
        (i, j, i * 3 + j) for i in range(2) for j in range(3)
    ]
    assert [p.body["prompt"] for p in parts] == ["a"] * 3 + ["b"] * 3
    assert [p.body["seed"] for p in parts] == [7, 8, 9] * 2  # vLLM's child seeds
    assert all("n" not in p.body for p in parts)
    chat = split(CHAT_COMPLETIONS, {"model": "m", "messages": [{}], "n": 2})
    assert [p.index for p in chat] == [0, 1]
    assert "seed" not in chat[0].body
    with pytest.raises(CompatError):
        split(COMPLETIONS, {"prompt": "a", "n": 0})
    with pytest.raises(CompatError):
        split(COMPLETIONS, {"prompt": ["a"] * 2000})


def test_greedy_is_vllms_rule() -> None:
    """vLLM raises a temperature in (0, 1e-2) to 1e-2 and samples greedily, refusing n > 1,
    below 1e-5: only 0 is greedy."""
    for temperature in (0, 0.0):
        assert is_greedy({"temperature": temperature})
        with pytest.raises(CompatError, match="greedy"):
            split(COMPLETIONS, {"prompt": "a", "n": 2, "temperature": temperature})
    for temperature in (1e-9, 9.99e-6, 1e-5, 0.5, None, "hot", True, -1.0):
        assert not is_greedy({"temperature": temperature})
    assert not is_greedy({})  # the model's default: the instances decide
    assert len(split(COMPLETIONS, {"prompt": "a", "n": 2, "temperature": 1e-6})) == 2
    assert len(split(COMPLETIONS, {"prompt": "a", "n": 1, "temperature": 0})) == 1


def test_scoring_needs_no_decode() -> None:
    assert needs_no_decode(COMPLETIONS, {"max_tokens": 0, "echo": True, "logprobs": 1})
    assert needs_no_decode(COMPLETIONS, {"echo": True, "logprobs": 0})
    assert needs_no_decode(CHAT_COMPLETIONS, {"prompt_logprobs": 1})
    assert not needs_no_decode(COMPLETIONS, {"echo": True, "max_tokens": 3})
    assert not needs_no_decode(CHAT_COMPLETIONS, {"max_tokens": 0})


def _answer(text: str, prompt_tokens: int, completion: int) -> dict:
    return {
        "id": f"cmpl-{text}",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }


def test_merge_sums_usage_once_per_prompt() -> None:
    parts = split(COMPLETIONS, {"prompt": ["a", "b"], "n": 2})
    answers = [_answer("a0", 3, 2), _answer("a1", 3, 4), _answer("b0", 5, 1), _answer("b1", 5, 1)]
    merged = merge_answers(parts, answers)
    assert merged["id"] == "cmpl-a0"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "a0"),
        (1, "a1"),
        (2, "b0"),
        (3, "b1"),
    ]
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}


def test_stream_merge_renumbers_and_sums_usage() -> None:
    parts = split(COMPLETIONS, {"prompt": ["a", "b"], "stream": True})
    merger = StreamMerger(parts)
    first = merger.chunk(1, {"id": "x", "created": 5, "choices": [{"index": 0, "text": "b"}]})
    second = merger.chunk(0, {"id": "y", "created": 6, "choices": [{"index": 0, "text": "a"}]})
    assert first is not None
    assert second is not None
    assert (first["id"], first["choices"][0]["index"]) == ("x", 1)
    assert (second["id"], second["created"], second["choices"][0]["index"]) == ("x", 5, 0)
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert merger.chunk(0, {"id": "y", "choices": [], "usage": usage, "metrics": {}}) is None
    assert merger.usage_chunk() is None  # part 1's usage has not come
    assert merger.chunk(1, {"id": "x", "choices": [], "usage": usage}) is None
    final = merger.usage_chunk()
    assert final is not None
    assert final["id"] == "x"
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert "metrics" not in final
    error = {"error": {"message": "boom"}}
    assert merger.chunk(0, error) == error


def test_stream_without_usage_has_no_usage_chunk() -> None:
    merger = StreamMerger(split(COMPLETIONS, {"prompt": "a", "n": 2}))
    merger.chunk(0, {"id": "x", "choices": [{"index": 0, "text": "a"}]})
    assert merger.usage_chunk() is None
