"""What the pure halves cost to import, and the scheduler half driven without vLLM.

P's send guard is exercised through the real worker shell with a fake kvt engine (no sockets:
the RPC handler is called directly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hybrid_connector.config import HybridConfig
from hybrid_connector.metadata import OfferSpec
from hybrid_connector.protocol import CacheSpec, LayoutSpec, SegmentSpec, TransferKvRequest
from hybrid_connector.scheduler_side import SchedulerSide
from kvt import AbortCode, AbortOrigin, Completion, TransferStatus

PURE_MODULES = [
    "hybrid_connector",
    "hybrid_connector.config",
    "hybrid_connector.contract",
    "hybrid_connector.control",
    "hybrid_connector.migration",
    "hybrid_connector.holds",
    "hybrid_connector.metadata",
    "hybrid_connector.scheduler_side",
    "hybrid_connector.consumer",
    "hybrid_connector.common",
    "hybrid_connector.producer",
    "hybrid_connector.worker_side",
    "hybrid_connector.kvs",
    "hybrid_connector.kvs_keys",
    "hybrid_connector.kvs_worker",
    "hybrid_connector.r3",
]


def test_pure_modules_load_neither_vllm_nor_torch() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {PURE_MODULES!r}: importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print(json.dumps(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ------------------------------------------------------------------ the scheduler half, no vLLM
def _request(request_id: str, *, max_tokens: int, prompt_tokens: int = 6) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": f"t-{request_id}"},
        max_tokens=max_tokens,
        num_prompt_tokens=prompt_tokens,
        num_computed_tokens=0,
        status=SimpleNamespace(name="RUNNING"),
    )


class _Pool:
    def touch(self, blocks: Any) -> None: ...

    def free_blocks(self, ordered_blocks: Any) -> None: ...


class _Manager:
    block_pool = _Pool()

    def get_block_ids(self, request_id: str) -> tuple[list[int]]:
        return ([1, 2],)

    def get_blocks(self, request_id: str) -> Any:
        return SimpleNamespace(blocks=([SimpleNamespace(block_id=i) for i in (1, 2, 3, 4)],))


def test_rapid_send_only_for_requests_that_finish_with_their_prompt() -> None:
    """A P request that keeps decoding could be preempted while its rapid send is in flight, and
    vLLM would reuse its blocks under the send: it gets the plain path (sent once finished)."""
    side = SchedulerSide(
        HybridConfig(rpc_port=8200), is_producer=True, is_consumer=False, block_size=4
    )
    side.bind_kv_cache_manager(_Manager())  # type: ignore[arg-type]
    one, many = _request("one", max_tokens=1), _request("many", max_tokens=8)
    for request in (one, many):
        side.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
    output = SimpleNamespace(num_scheduled_tokens={"one": 6, "many": 6})
    meta = side.build_connector_meta(output)  # type: ignore[arg-type]
    assert [p.request_id for p in meta.final_prefills] == ["one"]
    # The one that keeps decoding is offered (in the next step's metadata) once it finished.
    many.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    many.num_computed_tokens = 13
    delay, params = side.request_finished(many, ([1, 2, 3, 4],))
    assert delay is False, "the scheduler half holds its blocks, as for an announced one"
    assert params is not None
    assert params["transfer_id"] == "t-many"
    meta = side.build_connector_meta(SimpleNamespace(num_scheduled_tokens={}))  # type: ignore[arg-type]
    assert [s.request_id for s in meta.to_offer] == ["many"]


# ------------------------------------------------------------------ P's shell with a fake kvt
@dataclass
class FakeEngine:
    """Records sends; completes them only when the test says so (kvt still reading meanwhile)."""

    data_address: str = "127.0.0.1:1"
    callbacks: dict[str, Any] = field(default_factory=dict)
    aborted: threading.Event = field(default_factory=threading.Event)

    def send(self, request_id: str, peer: str, blocks: Any, last: bool = False, **kw: Any) -> None:
        if kw.get("on_complete") is not None:
            self.callbacks[request_id] = kw["on_complete"]

    def abort(self, request_id: str, reason: str = "") -> None:
        self.aborted.set()

    def timed_stage(self, stage: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def complete(self, request_id: str) -> None:
        """kvt's completion, from a kvt thread, once it stopped reading the blocks."""
        completion = Completion(
            request_id,
            "send",
            TransferStatus.ABORTED,
            AbortOrigin.LOCAL,
            AbortCode.CALLER_ABORT,
            "send timed out on P",
        )
        threading.Thread(target=self.callbacks.pop(request_id), args=(completion,)).start()


class _Returns:
    """Stands for the SEND_DONE client: records which requests' blocks were given back."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.given = threading.Event()

    def report(self, request_id: str, transfer_id: str, outcome: str) -> None:
        self.requests.append(request_id)
        self.given.set()

    async def close(self) -> None:
        pass


SPEC = CacheSpec([LayoutSpec(["l0"], [0], [1], 8, 4, [SegmentSpec("kv", 0, 64, 64)])])


def test_send_guard_returns_blocks_only_after_kvt_completion() -> None:
    """The guard (transfer_timeout_s) aborts a send kvt has not completed; the blocks go back to
    vLLM only with kvt's completion, never while kvt may still read them."""
    from hybrid_connector import worker_side

    engine = FakeEngine()
    returned = _Returns()
    results = worker_side._Results()
    config = HybridConfig(rpc_port=8200, lease_s=30, transfer_timeout_s=0.05)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        producer = worker_side.ProducerShell(config, engine, SPEC, results, loop)
        producer._send_done = returned  # type: ignore[assignment]  # the owner's SEND_DONE
        producer.offer(OfferSpec("p-req", "t-1", [[3, 5]], 6))
        pull = TransferKvRequest("t-1", "d-req", "127.0.0.1:2", SPEC, [[0, 1]], [0], 6)
        await producer._on_transfer_kv(pull, SimpleNamespace(peer="d:1"))
        await loop.run_in_executor(None, engine.aborted.wait, 10)  # the guard fired
        await asyncio.sleep(0)  # let anything the guard scheduled run
        assert returned.requests == [], "blocks back while kvt reads"
        engine.complete("t-1")
        assert await loop.run_in_executor(None, returned.given.wait, 10)
        assert returned.requests == ["p-req"]
        await producer.close()

    asyncio.run(scenario())
