"""Live migration through real vLLM (CPU, offline LLM): a decoding request stopped on D1 with
its KV held, continued on D2, which pulls that KV and computes only the last token.

The session's ``kv_both`` engine plays P, D1 and D2 (each request its own prefix-cache salt, so
D2 pulls instead of hitting D1's blocks): P prefills, D1 pulls P's KV and decodes, MIGRATE_OUT
stops D1's request after the next token, D2 takes prompt + D1's tokens and pulls them from
D1. The tokens of D1 then D2 must equal a single instance's, and nothing stays held.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from harness.checks import (
    assert_idle,
    delta,
    prefill_params,
    prompts,
    pull_params,
    salt,
    wait_for,
    wait_for_sends,
)
from harness.offline import OfflineEngine, Req
from hybrid_connector.contract import PullParams, encode_params
from hybrid_connector.control import migrate_out
from hybrid_connector.migration import MigrateOutResponse
from simple_rpc import LoopThread

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 400  # long enough that the migration lands mid-decode on a loaded box
DECODED_FIRST = 50  # D1's tokens before the migration: more than a block of them


def _outputs(child: Any, request_id: str) -> int:
    """In the child: how many tokens D1's request has (0 before vLLM admitted it)."""
    for request in child.core.scheduler.requests.values():
        if request.request_id.startswith(request_id):
            return int(request.num_output_tokens)
    return 0


def _stop(engine: OfflineEngine, transfer_id: str, migration_id: str) -> MigrateOutResponse:
    """MIGRATE_OUT until D1 stops the request: the first calls may come before D1 admitted it,
    or while it still pulls (each answer comes from an engine step)."""
    loop = LoopThread(name="test-proxy")
    try:
        for _ in range(2000):
            answer = loop.run(
                migrate_out(engine.rpc_address, transfer_id, migration_id), timeout=60
            )
            if answer.stopped or "finished" in answer.reason:
                return answer
        return answer
    finally:
        loop.close()


def test_a_migrated_request_decodes_on_as_if_never_moved(engine_qwen2: OfflineEngine) -> None:
    engine = engine_qwen2
    bs = engine.block_size
    [prompt] = prompts(seed=4242, lengths=(2 * bs + 13,))
    [expected] = engine.generate([prompt], MAX_TOKENS, salt=salt())
    before = engine.stats()

    tid, mid = f"t-{uuid.uuid4().hex}", f"m-{uuid.uuid4().hex}"
    d1_request = Req(prompt, MAX_TOKENS, pull_params(engine.rpc_address, tid), salt())
    on_d1 = engine.submit([Req(prompt, 1, prefill_params(tid), salt()), d1_request])
    wait_for(
        "D1 to decode",
        lambda: engine.call(_outputs, d1_request.request_id) >= DECODED_FIRST,
    )
    answer = _stop(engine, tid, mid)
    _, d1 = on_d1.result()
    assert answer.stopped, answer.reason
    n = len(answer.output_token_ids)
    assert DECODED_FIRST <= n < MAX_TOKENS
    assert d1.token_ids == answer.output_token_ids, "D1 streamed every token it answered with"
    assert answer.prompt_token_ids == prompt
    length = len(prompt) + n
    assert answer.num_tokens == length - 1, "KV for all but D1's last token"

    d2_params = encode_params(
        PullParams(
            transfer_id=mid,
            remote_rpc_address=answer.remote_rpc_address,
            remote_tp_size=answer.remote_tp_size,
            remote_num_tokens=answer.num_tokens,
        )
    )
    [d2] = engine.generate([prompt + d1.token_ids], MAX_TOKENS - n, [d2_params], salt=salt())
    assert d1.token_ids + d2.token_ids == expected.token_ids, "token for token"
    wait_for_sends(engine, before["counters"], 2)  # P -> D1, D1 -> D2
    after = engine.stats()
    # D2 pulled every token D1 had KV for and computed one; D1 pulled P's whole prompt.
    pulled = delta(after["by_source"], before["by_source"], "external_kv_transfer")
    assert pulled == len(prompt) + (length - 1), after["by_source"]
    computed = delta(after["by_source"], before["by_source"], "local_compute")
    assert computed == len(prompt) + 1, "P's prompt and D2's one token, nothing recomputed"
    assert delta(after["counters"], before["counters"], "pulls_started") == 2
    assert_idle(engine)
