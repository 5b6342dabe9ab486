"""The proxy's opt-in ``routed_experts`` field, without vLLM: an answer naming an R3 record in a
real refstore master gets the record inlined as vLLM encodes it; anything else passes as is."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import refstore
from hybrid_connector import r3
from pd_serving.routed_experts import RoutedExperts

ROWS = r3.RowGeometry(layers=2, top_k=2, dtype="uint8")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    with refstore.MasterThread("proxy-r3", "8M"), refstore.Client("proxy-r3") as client:
        yield client


def _answer(params: dict[str, Any] | None, choices: int = 1) -> bytes:
    return json.dumps(
        {
            "choices": [{"index": i, "text": "x"} for i in range(choices)],
            "kv_transfer_params": params,
        }
    ).encode()


def test_a_record_is_inlined_as_vllm_encodes_routed_experts(store: Any) -> None:
    rows = (np.arange(7 * 2 * 2) % 8).astype(np.uint8).reshape(7, 2, 2)
    key = r3.record_key()
    store.put_keyed([(key.encode(), r3.stored_object(rows))], ttl=30)
    params = {"r3": r3.record_params(key, "proxy-r3", 7, ROWS)}
    inline = RoutedExperts()
    try:
        got = json.loads(asyncio.run(inline.attach(_answer(params))))
        decoded = np.load(io.BytesIO(base64.b64decode(got["choices"][0]["routed_experts"])))
        assert decoded.dtype == np.uint8
        assert decoded.tobytes() == rows.tobytes()
        assert got["kv_transfer_params"] == params  # the reference passes through
        # nothing to inline: the same bytes back
        for data in (_answer(None), _answer({"transfer_id": "t"}), _answer(params, 2), b"{"):
            assert asyncio.run(inline.attach(data)) == data
        # a record that is gone: the answer as it was
        gone = {"r3": r3.record_params(r3.record_key(), "proxy-r3", 7, ROWS)}
        inline_fast = RoutedExperts(timeout_s=0)
        assert asyncio.run(inline_fast.attach(_answer(gone))) == _answer(gone)
        inline_fast.close()
    finally:
        inline.close()
