"""The scheduler half with tensor parallelism, without vLLM: P says its TP size in the params
it gives D, and D passes it on to its workers (which P ranks to pull from, release)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hybrid_connector.layout import KvGroup
from hybrid_connector.scheduler_side import SchedulerSide
from test_scheduler_groups import _side as groups_side

ATTENTION = KvGroup("attention", ("l0",), 32, "bfloat16")
NO_STEP = SimpleNamespace(num_scheduled_tokens={})


def _side(*, producer: bool, tp_size: int = 1) -> SchedulerSide:
    return groups_side(producer=producer, groups=[ATTENTION], tp_size=tp_size)


def _d_request(**params: Any) -> Any:
    return SimpleNamespace(
        request_id="d-1",
        kv_transfer_params={
            "do_remote_prefill": True,
            "transfer_id": "t-1",
            "remote_rpc_address": "127.0.0.1:8200",
            **params,
        },
        num_prompt_tokens=40,
    )


def test_p_params_carry_its_tp_size() -> None:
    side = _side(producer=True, tp_size=2)
    request = SimpleNamespace(
        request_id="p-1",
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-1"},
        max_tokens=1,
        num_computed_tokens=40,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )
    side._kv_cache_manager.block_ids["p-1"] = ([3, 4],)  # type: ignore[union-attr]
    _, params = side.request_finished(request, ([3, 4],))
    assert params is not None
    assert params["remote_tp_size"] == 2
    assert params["remote_rpc_address"] == "127.0.0.1:8200"  # rank 0; rank r at port + r


@pytest.mark.parametrize(
    ("params", "expected"), [({"remote_tp_size": 2}, 2), ({}, 1)], ids=["two", "absent"]
)
def test_d_passes_p_tp_size_to_its_workers(params: dict, expected: int) -> None:
    side = _side(producer=False)
    blocks = SimpleNamespace(
        blocks=(
            [
                SimpleNamespace(block_id=5, block_hash=None, is_null=False),
                SimpleNamespace(block_id=6, block_hash=None, is_null=False),
            ],
        )
    )
    side.update_state_after_alloc(_d_request(**params), blocks, 40)  # type: ignore[arg-type]
    (recv,) = side.build_connector_meta(NO_STEP).to_recv
    assert recv.remote_tp_size == expected


def test_d_release_goes_to_every_p_rank() -> None:
    side = _side(producer=False)
    side.update_state_after_alloc(_d_request(remote_tp_size=2), SimpleNamespace(blocks=([],)), 0)  # type: ignore[arg-type]
    (release,) = side.build_connector_meta(NO_STEP).to_release
    assert release.remote_tp_size == 2


@pytest.mark.parametrize("size", ["2", 0, True], ids=["not-an-int", "zero", "a-bool"])
def test_d_with_a_bad_p_tp_size_computes_the_prompt_itself(
    size: object, caplog: pytest.LogCaptureFixture
) -> None:
    """The params break the contract: a WARNING naming the request, P and the field; no pull
    (D computes the prompt locally), however often vLLM asks."""
    side = _side(producer=False)
    request = _d_request(remote_tp_size=size)
    with caplog.at_level("WARNING", logger="hybrid_connector.scheduler_side"):
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    side.update_state_after_alloc(request, SimpleNamespace(blocks=([],)), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(NO_STEP)
    assert (meta.to_recv, meta.to_release) == ([], [])
    (line,) = [r.getMessage() for r in caplog.records]
    assert "request d-1" in line
    assert "127.0.0.1:8200" in line
    assert "remote_tp_size" in line
