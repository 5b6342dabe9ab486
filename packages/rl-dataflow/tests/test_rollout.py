"""A completions answer as the loop's Completion: what the trainer needs, or a typed error."""

from __future__ import annotations

import pytest
from rl_dataflow.rollout import Completion, RolloutError, completion_from_response


def _answer(**choice):
    base = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -1.0]}}
    return {"id": "cmpl-1", "choices": [{**base, **choice}], "kv_transfer_params": {"r3": {}}}


def test_an_answer_with_token_ids_and_logprobs_is_a_completion():
    got = completion_from_response(_answer(prompt_token_ids=[1, 2, 3]), [1, 2, 3])
    assert got == Completion("cmpl-1", [1, 2, 3], [5, 6], [-0.5, -1.0], {"r3": {}})


@pytest.mark.parametrize(
    "body",
    [
        _answer(token_ids=None),  # return_token_ids not honoured
        _answer(logprobs=None),  # logprobs not asked for
        _answer(logprobs={"token_logprobs": [-0.5]}),  # one short
        _answer(prompt_token_ids=[9, 9, 9]),  # another prompt's answer
        {"id": "x", "choices": []},
        ["not", "an", "object"],
    ],
)
def test_an_answer_the_trainer_cannot_use_is_a_rollout_error(body):
    with pytest.raises(RolloutError):
        completion_from_response(body, [1, 2, 3])
