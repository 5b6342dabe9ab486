"""The scheduler half with several KV-cache groups, without vLLM: which blocks of each group P
holds and offers, which D asks for after its prefix hit, and the state group's last token."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

from hybrid_connector.config import HybridConfig
from hybrid_connector.layout import KvGroup, state_slot
from hybrid_connector.scheduler_side import SchedulerSide

STATE = KvGroup("state", ("l0",), 256, "bfloat16,bfloat16")
ATTENTION = KvGroup("attention", ("l1",), 256, "bfloat16")


class Manager:
    """vLLM's KV-cache manager as the scheduler half uses it: ``block_ids[request]`` per group
    become KVCacheBlock-like objects (id 0 is vLLM's null block) on a pool that counts."""

    def __init__(self) -> None:
        self.block_ids: dict[str, tuple[list[int], ...]] = {}
        self.block_pool = SimpleNamespace(refs=Counter())
        self.block_pool.touch = lambda blocks: self.block_pool.refs.update(
            b.block_id for b in blocks
        )
        self.block_pool.free_blocks = lambda blocks: self.block_pool.refs.subtract(
            b.block_id for b in blocks
        )

    def get_blocks(self, request_id: str) -> Any:
        return SimpleNamespace(
            blocks=tuple([_block(i) for i in ids] for ids in self.block_ids[request_id])
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.block_ids[request_id]


def _side(*, producer: bool, groups: list[KvGroup], tp_size: int = 1) -> SchedulerSide:
    side = SchedulerSide(
        HybridConfig(rpc_port=8200) if producer else HybridConfig(),
        is_producer=producer,
        is_consumer=not producer,
        block_size=256,
        groups=groups,
        tp_size=tp_size,
    )
    side.bind_kv_cache_manager(Manager())  # type: ignore[arg-type]
    return side


def _block(block_id: int, *, cached: bool = False) -> Any:
    return SimpleNamespace(
        block_id=block_id, block_hash="h" if cached else None, is_null=block_id == 0
    )


def _p_request(prompt: int, **params: Any) -> Any:
    tokens = list(range(3, 3 + prompt))
    return SimpleNamespace(
        request_id="p-1",
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1", **params},
        max_tokens=16,
        prompt_token_ids=tokens,
        _all_token_ids=list(tokens),
        num_prompt_tokens=prompt,
        num_computed_tokens=prompt,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )


def _d_request(prompt: int) -> Any:
    return SimpleNamespace(
        request_id="d-1",
        kv_transfer_params={
            "do_remote_prefill": True,
            "transfer_id": "t-1",
            "remote_rpc_address": "127.0.0.1:8200",
        },
        num_prompt_tokens=prompt,
    )


def test_state_slot_is_the_last_slot_before_the_scratch_ones() -> None:
    assert state_slot([7]) == [7]
    assert state_slot([0, 0, 7]) == [7]  # align mode: null placeholders before the state
    assert state_slot([7, 8, 9], num_speculative_blocks=2) == [7]
    assert state_slot([7], num_speculative_blocks=2) == [7]
    assert state_slot([]) == []


def test_p_holds_every_group_and_offers_only_the_state_slot() -> None:
    side = _side(producer=True, groups=[STATE, ATTENTION])
    request = _p_request(600)
    side._kv_cache_manager.block_ids["p-1"] = ([0, 0, 31], [11, 12, 13])  # type: ignore[union-attr]
    delay, params = side.request_finished(request, ([0, 0, 31], [11, 12, 13]))
    assert delay is False, "the owner references every group's blocks (vLLM may forget it)"
    assert side.holds.held_blocks == 4, "the state slot and the attention blocks, no null block"
    (send,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_offer
    assert send.block_ids == [[31], [11, 12, 13]]
    assert params is not None
    assert params["remote_block_ids"] == [[31], [11, 12, 13]]


def test_p_with_a_state_group_stops_before_the_prompts_last_token_once() -> None:
    """A state cannot absorb the last token twice: P computes all but it, D computes it."""
    side = _side(producer=True, groups=[STATE, ATTENTION])
    request = _p_request(10)
    side.on_new_request(request)
    side.on_new_request(request)  # again (preempted and re-added): not shortened twice
    assert request.num_prompt_tokens == 9
    assert request.prompt_token_ids == list(range(3, 12))
    assert request._all_token_ids == list(range(3, 12))
    assert request.max_tokens == 1
    # Without a state group, or not to be pulled, the prompt is left alone.
    for side, req in (
        (_side(producer=True, groups=[ATTENTION]), _p_request(10)),
        (_side(producer=True, groups=[STATE, ATTENTION]), _p_request(1)),
    ):
        side.on_new_request(req)
        assert req.num_prompt_tokens == len(req.prompt_token_ids)


def test_d_pulls_all_but_the_last_token_with_a_state_group() -> None:
    hybrid = _side(producer=False, groups=[STATE, ATTENTION])
    plain = _side(producer=False, groups=[ATTENTION])
    assert hybrid.get_num_new_matched_tokens(_d_request(600), 0) == (599, True)
    assert plain.get_num_new_matched_tokens(_d_request(600), 0) == (600, True)
    assert hybrid.get_num_new_matched_tokens(_d_request(600), 512) == (87, True)


def test_d_asks_per_group_after_its_prefix_hit() -> None:
    """D caches the first two attention blocks and the state checkpoint at token 512: it asks
    for attention block 3 only (first_block 2) and the new state slot."""
    side = _side(producer=False, groups=[STATE, ATTENTION])
    request = _d_request(700)
    blocks = SimpleNamespace(
        blocks=(
            [_block(0), _block(21, cached=True), _block(22)],
            [_block(5, cached=True), _block(6, cached=True), _block(7)],
        )
    )
    side.update_state_after_alloc(request, blocks, 699 - 512)  # type: ignore[arg-type]
    (recv,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_recv
    assert recv.block_ids == [[22], [7]]
    assert recv.first_block == [0, 2]
    assert recv.num_tokens == 699


def test_d_does_not_ask_for_the_block_of_the_token_it_computes() -> None:
    """Prompt 513 with a state group: D loads 512 tokens (2 blocks); its third block holds only
    the last token, which D computes itself."""
    side = _side(producer=False, groups=[STATE, ATTENTION])
    blocks = SimpleNamespace(blocks=([_block(40)], [_block(1), _block(2), _block(3)]))
    side.update_state_after_alloc(_d_request(513), blocks, 512)  # type: ignore[arg-type]
    (recv,) = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_recv
    assert recv.block_ids == [[40], [1, 2]]
    assert recv.first_block == [0, 0]


def test_d_pulls_once_and_leaves_vllms_dict_alone() -> None:
    """D's request is dispatched once, even if vLLM allocates for it again (preempted and
    rescheduled); the mark is the connector's, vLLM's kv_transfer_params stay as sent."""
    side = _side(producer=False, groups=[ATTENTION])
    request = _d_request(600)
    sent = dict(request.kv_transfer_params)
    blocks = SimpleNamespace(blocks=([_block(1), _block(2), _block(3)],))
    side.update_state_after_alloc(request, blocks, 600)  # type: ignore[arg-type]
    assert side.get_num_new_matched_tokens(request, 0) == (0, False), "dispatched already"
    side.update_state_after_alloc(request, blocks, 600)  # type: ignore[arg-type]
    assert len(side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).to_recv) == 1
    assert request.kv_transfer_params == sent
