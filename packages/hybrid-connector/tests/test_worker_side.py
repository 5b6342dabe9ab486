"""The worker halves of P and D on real kvt and simple_rpc, without a vLLM engine.

Two WorkerSides in one process, each owning a torch "KV cache" laid out like vLLM's CPU backend
(layers are views of one buffer). The metadata they receive is what the scheduler half builds.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness.ports import free_port
from hybrid_connector.config import HybridConfig
from hybrid_connector.layout import KvGroup
from hybrid_connector.metadata import (
    FinalPrefill,
    HybridConnectorMetadata,
    OfferSpec,
    RecvSpec,
    ReleaseSpec,
)
from hybrid_connector.send_done import SendDoneServer
from hybrid_connector.worker_side import WorkerSide

BLOCK_SIZE = 4
NUM_BLOCKS = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 8


def _kv_caches(fill: float | None, heads: int = HEADS) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: one buffer; each layer a [num_blocks, heads, block_size, 2*hd] view."""
    shape = (LAYERS, NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_DIM)
    if fill is None:
        buf = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    else:
        buf = torch.full(shape, fill, dtype=torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


class Returns:
    """The owner of P's blocks as P's worker sees it (``holds.BlockHolds`` without vLLM's pool):
    the SEND_DONE reports, recorded. A request's blocks must come back exactly once per rank."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.reports: Counter[tuple[str, int]] = Counter()
        self._new: set[str] = set()

    def send_done(self, request_id: str, tp_rank: int, outcome: str = "") -> bool:
        with self._cond:
            self.reports[request_id, tp_rank] += 1
            self._new.add(request_id)
            self._cond.notify_all()
        return True

    def take(self, timeout: float) -> set[str]:
        """The requests given back since the last call, after waiting up to ``timeout`` for one."""
        with self._cond:
            self._cond.wait_for(lambda: self._new, timeout)
            out, self._new = self._new, set()
        return out

    def twice(self) -> list[tuple[str, int]]:
        return [key for key, n in self.reports.items() if n > 1]


class SchedulerHalf:
    """P's scheduler half as far as its worker knows it: the SEND_DONE server over ``owner``
    (default: a ``Returns`` recorder), named to the worker in its first metadata."""

    def __init__(self, p: WorkerSide, owner: Any = None) -> None:
        self.returns = Returns()
        self.server = SendDoneServer(
            self.returns if owner is None else owner, host="127.0.0.1", advertise_host=None
        )
        p.handle_metadata(HybridConnectorMetadata(scheduler_address=self.server.address))

    def returned(self, timeout: float = 10.0) -> set[str]:
        """P requests whose blocks P's worker gave back (SEND_DONE) since the last call."""
        return self.returns.take(timeout)

    def close(self) -> None:
        self.server.close()
        assert not self.returns.twice(), f"blocks given back twice: {self.returns.twice()}"


class Pair:
    def __init__(
        self,
        lease_s: float = 5.0,
        transfer_timeout_s: float = 5.0,
        owner: Any = None,
        transport: str = "auto",
    ) -> None:
        self.p_kv = _kv_caches(None)
        self.d_kv = _kv_caches(0.0)
        # P needs a fixed port; another process on the box may take a free one before P binds
        # it, so a taken port is tried again with another.
        for attempt in range(5):
            port = free_port()
            self.p_cfg = HybridConfig(
                rpc_port=port, lease_s=lease_s, transfer_timeout_s=5.0, kvt_transport=transport
            )
            self.p = WorkerSide(self.p_cfg, is_producer=True, is_consumer=False, name="P")
            try:
                self.p.register_kv_caches(self.p_kv, BLOCK_SIZE)
                break
            except OSError as exc:
                self.p.close()
                if exc.errno != errno.EADDRINUSE or attempt == 4:
                    raise
        self.rpc_address = f"127.0.0.1:{port}"
        self.d_cfg = HybridConfig(transfer_timeout_s=transfer_timeout_s, kvt_transport=transport)
        self.d = WorkerSide(self.d_cfg, is_producer=False, is_consumer=True, name="D")
        self.d.register_kv_caches(self.d_kv, BLOCK_SIZE)
        self.scheduler = SchedulerHalf(self.p, owner)

    def returned(self, timeout: float = 10.0) -> set[str]:
        return self.scheduler.returned(timeout)

    def offer(self, request_id: str, transfer_id: str, block_ids: list[int], num_tokens: int):
        self.p.handle_metadata(
            HybridConnectorMetadata(
                to_offer=[OfferSpec(request_id, transfer_id, [block_ids], num_tokens)]
            )
        )

    def pull(
        self,
        request_id: str,
        transfer_id: str,
        block_ids: list[int],
        num_tokens: int,
        *,
        first_block: int = 0,
        address: str | None = None,
    ) -> None:
        self.d.handle_metadata(
            HybridConnectorMetadata(
                to_recv=[
                    RecvSpec(
                        request_id,
                        transfer_id,
                        address or self.rpc_address,
                        [block_ids],
                        [first_block],
                        num_tokens,
                    )
                ]
            )
        )

    def close(self) -> None:
        self.d.close()
        self.p.close()
        self.scheduler.close()


def _wait(side: WorkerSide, timeout: float = 10.0) -> tuple[set[str], set[str]]:
    """D's (finished_recving, failed_recving) once something arrives (the wait is in drain)."""
    deadline = time.monotonic() + timeout
    while True:
        out = side.drain(wait_s=max(0.0, deadline - time.monotonic()))
        if any(out) or time.monotonic() >= deadline:
            return out


@pytest.fixture(params=["auto"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    threads_before = set(threading.enumerate())
    pair = Pair(transport=request.param)
    yield pair
    pair.close()
    leaked = [t.name for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    assert not leaked, leaked


def _layer_blocks(kv: dict[str, torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    return [t[block_ids] for t in kv.values()]


# auto picks the same-host copy here; tcp forced through kv_connector_extra_config's
# kvt_transport moves the same bytes over a socket.
@pytest.mark.parametrize("pair", ["auto", "tcp"], indirect=True)
def test_pull_copies_exactly_the_requested_blocks(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    src, dst = [5, 2, 9], [1, 7, 3]
    pair.offer("p-req", tid, src, num_tokens=3 * BLOCK_SIZE - 1)
    pair.pull("d-req", tid, dst, num_tokens=3 * BLOCK_SIZE - 1)
    sending, recving, failed = set(), set(), set()
    recving, failed = _wait(pair.d)
    assert recving == {"d-req"}
    assert failed == set()
    sending = pair.returned()
    assert sending == {"p-req"}
    for got, want in zip(_layer_blocks(pair.d_kv, dst), _layer_blocks(pair.p_kv, src), strict=True):
        assert torch.equal(got, want)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    assert all(bool((t[untouched] == 0).all()) for t in pair.d_kv.values())
    assert pair.d.counters()["pulls_done"] == 1
    assert pair.p.counters()["sends_done"] == 1
    assert pair.p._engine.stats().stage("parse", "none").count == 1  # P timed its plan
    want = "samehost" if pair.p_cfg.kvt_transport == "auto" else pair.p_cfg.kvt_transport
    assert {link.path for link in pair.d._engine.backend.links()} == {want}


def test_first_block_skips_what_decode_already_holds(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    pair.offer("p-req", tid, [4, 5, 6], num_tokens=10)
    # D holds P's first block already (local prefix hit): it asks only for blocks 1 and 2.
    pair.pull("d-req", tid, [11, 12], num_tokens=10, first_block=1)
    assert _wait(pair.d) == ({"d-req"}, set())
    for got, want in zip(
        _layer_blocks(pair.d_kv, [11, 12]), _layer_blocks(pair.p_kv, [5, 6]), strict=True
    ):
        assert torch.equal(got, want)
    assert pair.returned() == {"p-req"}


def test_pull_before_the_request_finishes_waits_for_it(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    pair.pull("d-req", tid, [0, 1], num_tokens=8)
    # The pull is parked on P: nothing completes until P's request finishes.
    assert _wait(pair.d, timeout=0.3) == (set(), set())
    assert pair.p.counters().get("early_pulls") == 1
    pair.offer("p-req", tid, [8, 9], num_tokens=8)
    assert _wait(pair.d) == ({"d-req"}, set())
    assert pair.returned() == {"p-req"}
    for got, want in zip(
        _layer_blocks(pair.d_kv, [0, 1]), _layer_blocks(pair.p_kv, [8, 9]), strict=True
    ):
        assert torch.equal(got, want)


def test_lease_expiry_releases_blocks_nobody_pulled(caplog: pytest.LogCaptureFixture) -> None:
    pair = Pair(lease_s=0.2)
    try:
        tid = str(uuid.uuid4())
        with caplog.at_level(logging.WARNING, logger="hybrid_connector"):
            pair.offer("p-req", tid, [1], num_tokens=3)
            assert pair.returned() == {"p-req"}
        assert pair.p.counters()["leases_expired"] == 1
        assert any("p-req" in r.message and tid in r.message for r in caplog.records)
        # A pull after the lease finds nothing to wait for... and fails within the next lease.
        pair.pull("d-req", tid, [1], num_tokens=3)
        assert _wait(pair.d) == ({"d-req"}, {"d-req"})
    finally:
        pair.close()


def test_mismatched_layout_is_rejected_and_server_survives(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    # A D whose cache has another head count cannot take P's blocks.
    other = WorkerSide(HybridConfig(), is_producer=False, is_consumer=True, name="D-bad")
    other.register_kv_caches(_kv_caches(0.0, heads=HEADS * 2), BLOCK_SIZE)
    try:
        bad_tid = str(uuid.uuid4())
        pair.offer("p-bad", bad_tid, [1], num_tokens=2)
        with caplog.at_level(logging.WARNING, logger="hybrid_connector"):
            other.handle_metadata(
                HybridConnectorMetadata(
                    to_recv=[RecvSpec("d-bad", bad_tid, pair.rpc_address, [[2]], [0], 2)]
                )
            )
            assert _wait(other) == ({"d-bad"}, {"d-bad"})
        # P frees the blocks of a pull that failed for good and keeps serving.
        assert pair.returned() == {"p-bad"}
        assert any("p-bad" in r.message and bad_tid in r.message for r in caplog.records)
        good_tid = str(uuid.uuid4())
        pair.offer("p-good", good_tid, [3], num_tokens=2)
        pair.pull("d-good", good_tid, [4], num_tokens=2)
        assert _wait(pair.d) == ({"d-good"}, set())
    finally:
        other.close()


def test_decode_asking_for_more_tokens_than_prefill_computed_fails(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    pair.offer("p-req", tid, [1, 2], num_tokens=5)
    pair.pull("d-req", tid, [3, 4, 5], num_tokens=9)
    assert _wait(pair.d) == ({"d-req"}, {"d-req"})
    assert pair.returned() == {"p-req"}


def test_unreachable_prefill_fails_the_pull(pair: Pair) -> None:
    pair.pull("d-req", str(uuid.uuid4()), [1], num_tokens=2, address=f"127.0.0.1:{free_port()}")
    assert _wait(pair.d) == ({"d-req"}, {"d-req"})
    assert pair.d.counters()["pulls_failed"] == 1


def test_prefill_abort_fails_a_waiting_pull_at_once(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    pair.pull("d-req", tid, [1], num_tokens=2)
    assert _wait(pair.d, timeout=0.3) == (set(), set())
    pair.p.handle_metadata(HybridConnectorMetadata(cancel_offer=[tid]))
    assert _wait(pair.d) == ({"d-req"}, {"d-req"})


def test_release_frees_held_blocks_without_sending(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    pair.offer("p-req", tid, [1], num_tokens=2)
    pair.d.handle_metadata(
        HybridConnectorMetadata(
            to_release=[ReleaseSpec("d-req", tid, pair.rpc_address, "full local hit")]
        )
    )
    assert pair.returned() == {"p-req"}
    assert pair.p.counters()["released_by_peer"] == 1


def test_decode_abort_while_pull_waits_reports_once() -> None:
    pair = Pair(lease_s=0.5)
    try:
        tid = str(uuid.uuid4())
        pair.pull("d-req", tid, [1], num_tokens=2)
        assert _wait(pair.d, timeout=0.3) == (set(), set())
        pair.d.handle_metadata(HybridConnectorMetadata(cancel_recv=["d-req"]))
        assert _wait(pair.d) == ({"d-req"}, {"d-req"})
        # Whether P sees D's release before the request finishes (blocks held, then the lease
        # frees them) or after (the send meets D's abort), P's blocks come back exactly once.
        pair.offer("p-req", tid, [1], num_tokens=2)
        assert pair.returned() == {"p-req"}
        assert pair.returned(timeout=0.8) == set()
        assert _wait(pair.d, timeout=0.1) == (set(), set())
    finally:
        pair.close()


def test_close_is_idempotent_and_leaves_no_threads() -> None:
    before = set(threading.enumerate())
    pair = Pair()
    pair.offer("p-req", str(uuid.uuid4()), [1], num_tokens=2)
    pair.pull("d-req", str(uuid.uuid4()), [2], num_tokens=2)
    pair.close()
    pair.close()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, leaked


def test_metrics_endpoint_serves_kvt_and_connector_metrics() -> None:
    import urllib.request

    before = set(threading.enumerate())
    port = free_port()
    side = WorkerSide(
        HybridConfig(metrics_port=port), is_producer=False, is_consumer=True, name="M"
    )
    side.register_kv_caches(_kv_caches(0.0), BLOCK_SIZE)
    try:
        side.handle_metadata(
            HybridConnectorMetadata(
                to_recv=[RecvSpec("d-req", "t-1", f"127.0.0.1:{free_port()}", [[1]], [0], 2)]
            )
        )
        assert _wait(side) == ({"d-req"}, {"d-req"})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'hybrid_connector_events_total{connector="M",event="pulls_failed"} 1.0' in text
        assert "kvt_" in text
    finally:
        side.close()
    leaked = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not leaked, leaked


def test_decode_gone_while_pull_parked_does_not_strand_blocks() -> None:
    pair = Pair(lease_s=0.5)
    try:
        tid = str(uuid.uuid4())
        pair.pull("d-req", tid, [1], num_tokens=2)
        assert _wait(pair.d, timeout=0.3) == (set(), set())
        pair.d.close()  # D's connection to P goes away with the pull still parked
        pair.offer("p-req", tid, [1], num_tokens=2)
        assert pair.returned() == {"p-req"}  # by the lease at the latest, never stranded
    finally:
        pair.close()


def test_proxy_release_fails_a_parked_pull_and_frees_a_late_request(pair: Pair) -> None:
    import asyncio

    from hybrid_connector.control import release_transfer

    tid = str(uuid.uuid4())
    pair.pull("d-req", tid, [1], num_tokens=2)
    assert _wait(pair.d, timeout=0.3) == (set(), set())
    released = asyncio.run(release_transfer(pair.rpc_address, tid, reason="prefill failed"))
    assert released is False  # nothing was held yet
    assert _wait(pair.d) == ({"d-req"}, {"d-req"})  # D recomputes at once
    pair.offer("p-req", tid, [1], num_tokens=2)  # the request finishes on P after all
    assert pair.returned() == {"p-req"}  # released at once, not held for the lease
    assert pair.p.counters()["released_by_peer"] == 1


def test_rapid_transfer_sends_layers_as_written_and_frees_after_finish(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    src, dst = [3, 4], [9, 10]
    pair.pull("d-req", tid, dst, num_tokens=6)
    assert _wait(pair.d, timeout=0.3) == (set(), set())
    # P's scheduler: this step completes the prompt (the pull is parked already).
    pair.p.handle_metadata(
        HybridConnectorMetadata(final_prefills=[FinalPrefill("p-req", tid, [src], 6)])
    )
    names = list(pair.p_kv)
    pair.p.layer_saved(names[0])
    pair.p.layer_saved(names[1])
    # One layer is still being computed: the pull cannot be complete yet.
    assert _wait(pair.d, timeout=0.3) == (set(), set())
    pair.p.step_done()  # end of the forward pass
    assert _wait(pair.d) == ({"d-req"}, set())
    for got, want in zip(_layer_blocks(pair.d_kv, dst), _layer_blocks(pair.p_kv, src), strict=True):
        assert torch.equal(got, want)
    assert pair.p.counters()["rapid_sends"] == 1
    # The request finished in its step (max_tokens=1): offered at the step's end, back once.
    assert pair.returned() == {"p-req"}


class _ReceivedBytes:
    """Bytes kvt has written into D's KV cache so far, waited on as a condition (kvt reports
    each chunk it wrote through ``_end_io``; no sleep, no polling)."""

    def __init__(self, side: WorkerSide, monkeypatch: pytest.MonkeyPatch) -> None:
        engine = side._engine
        assert engine is not None
        self._cond = threading.Condition()
        self.nbytes = 0
        end_io = engine._end_io

        def counting_end_io(req, nbytes: int, direction: str) -> None:
            end_io(req, nbytes, direction)
            if direction == "received":
                with self._cond:
                    self.nbytes += nbytes
                    self._cond.notify_all()

        monkeypatch.setattr(engine, "_end_io", counting_end_io)

    def wait_for(self, nbytes: int, timeout_s: float = 5.0) -> int:
        with self._cond:
            self._cond.wait_for(lambda: self.nbytes >= nbytes, timeout_s)
            return self.nbytes


class _SlowForwardPass:
    """P's forward pass on its own thread, held after each layer: it marks layer i written
    (``save_kv_layer``), then waits until the test lets it go on; ``wait_for_save`` at the end."""

    def __init__(self, side: WorkerSide, names: list[str]) -> None:
        self.written = [threading.Event() for _ in names]
        self.go_on = [threading.Event() for _ in names]
        self.ended = threading.Event()

        def run() -> None:
            for i, name in enumerate(names):
                side.layer_saved(name)
                self.written[i].set()
                if not self.go_on[i].wait(10):
                    break  # the test failed; let the worker close
            side.step_done()
            self.ended.set()

        self.thread = threading.Thread(target=run, name="slow-forward-pass")
        self.thread.start()

    def close(self) -> None:
        for event in self.go_on:
            event.set()
        self.thread.join(10)


@pytest.mark.parametrize("k", [0, 1])
def test_pull_arriving_mid_forward_gets_the_written_layers_at_once(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, k: int
) -> None:
    """Issue 15: D's transfer_kv reaches P after layer k of the forward pass that completes the
    prompt was written (no pull was parked when the step began). Layers 0..k are in D's cache
    before the pass goes on, each later layer follows once it is marked, D has exactly P's
    bytes at the end, and P gives its blocks back once, after the step's end."""
    tid = str(uuid.uuid4())
    src, dst = [3, 4], [9, 10]
    names = list(pair.p_kv)
    layer_bytes = pair.p_kv[names[0]][src].numel() * 2  # bf16
    received = _ReceivedBytes(pair.d, monkeypatch)
    # P's step begins: its scheduler announced the request (no pull is parked).
    pair.p.handle_metadata(
        HybridConnectorMetadata(final_prefills=[FinalPrefill("p-req", tid, [src], 6)])
    )
    assert pair.p.wait_count("offers", 1)
    forward = _SlowForwardPass(pair.p, names)
    try:
        for layer in range(k):  # nobody pulls yet: the pass runs up to layer k
            forward.go_on[layer].set()
        assert forward.written[k].wait(10)
        pair.pull("d-req", tid, dst, num_tokens=6)  # mid-forward
        assert received.wait_for((k + 1) * layer_bytes) == (k + 1) * layer_bytes
        assert not forward.ended.is_set()
        for layer, (got, want) in enumerate(
            zip(_layer_blocks(pair.d_kv, dst), _layer_blocks(pair.p_kv, src), strict=True)
        ):
            if layer <= k:
                assert torch.equal(got, want), f"layer {layer} written on P, not on D"
            else:
                assert bool((got == 0).all()), f"layer {layer} sent before it was written"
        assert pair.p.counters()["rapid_sends"] == 1
        assert "early_pulls" not in pair.p.counters(), "the pull waited for the request"
        assert _wait(pair.d, timeout=0.1) == (set(), set())
        for layer in range(k + 1, len(names)):  # the pass goes on, one layer at a time
            forward.go_on[layer - 1].set()
            assert received.wait_for((layer + 1) * layer_bytes) == (layer + 1) * layer_bytes
            assert torch.equal(pair.d_kv[names[layer]][dst], pair.p_kv[names[layer]][src])
        forward.go_on[-1].set()
        assert forward.ended.wait(10)
    finally:
        forward.close()
    assert _wait(pair.d) == ({"d-req"}, set())
    for got, want in zip(_layer_blocks(pair.d_kv, dst), _layer_blocks(pair.p_kv, src), strict=True):
        assert torch.equal(got, want)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
    assert all(bool((t[untouched] == 0).all()) for t in pair.d_kv.values())
    assert pair.d.counters()["bytes_received"] == len(names) * layer_bytes
    assert pair.p.wait_count("sends_done", 1)
    # The request finished at the step's end (offered then): its blocks go back once.
    assert pair.returned() == {"p-req"}
    assert pair.returned(timeout=0.1) == set(), "given back once"


def test_final_prefill_without_a_parked_pull_is_offered_at_the_steps_end(pair: Pair) -> None:
    tid = str(uuid.uuid4())
    pair.p.handle_metadata(
        HybridConnectorMetadata(final_prefills=[FinalPrefill("p-req", tid, [[2]], 3)])
    )
    pair.p.step_done()  # offered at the step's end
    pair.pull("d-req", tid, [5], num_tokens=3)
    assert _wait(pair.d) == ({"d-req"}, set())
    assert pair.returned() == {"p-req"}
    assert "rapid_sends" not in pair.p.counters()


# ------------------------------------------------------------------ several KV-cache groups
PAGE_ELEMS = HEADS * BLOCK_SIZE * 2 * HEAD_DIM  # one block of an attention layer, in bf16
STATE_SHAPES = ((3, 8), (2, 4, 4))  # GDN-like: conv state, recurrent state per slot


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _hybrid_caches(
    fill: float | None, state_shapes: tuple[tuple[int, ...], ...] = STATE_SHAPES
) -> tuple[dict[str, object], list[KvGroup]]:
    """vLLM's hybrid allocation: each raw buffer is shared by one linear-attention layer (a list
    of state views with the page as slot stride) and one attention layer; a block id is a slot
    in the state group and a block in the attention group (one block pool)."""
    kv: dict[str, object] = {}
    for i in range(2):
        gen = torch.Generator().manual_seed(i)
        raw = (
            torch.randn(NUM_BLOCKS * PAGE_ELEMS, generator=gen).to(torch.bfloat16)
            if fill is None
            else torch.full((NUM_BLOCKS * PAGE_ELEMS,), fill, dtype=torch.bfloat16)
        )
        views, offset = [], 0
        for shape in state_shapes:
            stride = (PAGE_ELEMS, *_contiguous_strides(shape))
            views.append(raw.as_strided((NUM_BLOCKS, *shape), stride, offset))
            offset += math.prod(shape)
        kv[f"model.layers.{2 * i}.linear_attn"] = views
        kv[f"model.layers.{2 * i + 1}.self_attn.attn"] = raw.view(
            NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM
        )
    groups = [
        KvGroup("state", ("model.layers.0.linear_attn", "model.layers.2.linear_attn"), 64),
        KvGroup("attention", ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"), 4),
    ]
    return kv, groups


def _mla_caches(fill: float | None, latent: int = 24) -> tuple[dict[str, object], list[KvGroup]]:
    """MLA: one latent row per token, [num_blocks, block_size, latent], one buffer."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, latent)
    buf = (
        torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        if fill is None
        else torch.full(shape, fill, dtype=torch.bfloat16)
    )
    kv: dict[str, object] = {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(2)}
    return kv, [KvGroup("mla", tuple(kv), BLOCK_SIZE, "bfloat16")]


def _attention_caches(fill: float | None, heads: int = HEADS):
    kv = _kv_caches(fill, heads=heads)
    return kv, [KvGroup("attention", tuple(kv), BLOCK_SIZE, "bfloat16")]


class GroupPair:
    """P and D workers on real kvt whose caches have several groups (or one of a family)."""

    def __init__(self, p_cache, d_cache) -> None:
        port = free_port()
        self.rpc_address = f"127.0.0.1:{port}"
        (self.p_kv, p_groups), (self.d_kv, d_groups) = p_cache, d_cache
        self.p = WorkerSide(
            HybridConfig(rpc_port=port), is_producer=True, is_consumer=False, name="P"
        )
        self.d = WorkerSide(HybridConfig(), is_producer=False, is_consumer=True, name="D")
        self.p.register_kv_caches(self.p_kv, BLOCK_SIZE, NUM_BLOCKS, p_groups)  # type: ignore[arg-type]
        self.d.register_kv_caches(self.d_kv, BLOCK_SIZE, NUM_BLOCKS, d_groups)  # type: ignore[arg-type]
        self.scheduler = SchedulerHalf(self.p)

    def transfer(self, src: list[list[int]], dst: list[list[int]], first: list[int], n: int):
        tid = str(uuid.uuid4())
        self.p.handle_metadata(HybridConnectorMetadata(to_offer=[OfferSpec("p-req", tid, src, n)]))
        self.d.handle_metadata(
            HybridConnectorMetadata(
                to_recv=[RecvSpec("d-req", tid, self.rpc_address, dst, first, n)]
            )
        )
        return _wait(self.d), self.scheduler.returned()

    def close(self) -> None:
        self.d.close()
        self.p.close()
        self.scheduler.close()


def _state(kv: dict[str, object], slot: int) -> list[torch.Tensor]:
    return [t[slot] for v in kv.values() if isinstance(v, list) for t in v]


def _attn(kv: dict[str, object], blocks: list[int]) -> list[torch.Tensor]:
    return [v[blocks] for v in kv.values() if isinstance(v, torch.Tensor)]


def test_hybrid_groups_move_the_state_slot_and_the_attention_blocks() -> None:
    """State group: P's slot 9 lands in D's slot 2; attention: P's blocks 4, 5 in D's 6, 7.
    Nothing else of D changes (the groups share D's buffers)."""
    pair = GroupPair(_hybrid_caches(None), _hybrid_caches(0.0))
    try:
        (recving, failed), sending = pair.transfer([[9], [4, 5]], [[2], [6, 7]], [0, 0], 7)
        assert (recving, failed, sending) == ({"d-req"}, set(), {"p-req"})
        for got, want in zip(_state(pair.d_kv, 2), _state(pair.p_kv, 9), strict=True):
            assert torch.equal(got, want)
        for got, want in zip(_attn(pair.d_kv, [6, 7]), _attn(pair.p_kv, [4, 5]), strict=True):
            assert torch.equal(got, want)
        untouched = [b for b in range(NUM_BLOCKS) if b not in (2, 6, 7)]
        assert all(bool((t[untouched] == 0).all()) for t in _attn(pair.d_kv, list(range(16))))
        state_bytes = 2 * sum(math.prod(s) for s in STATE_SHAPES) * 2
        attention_bytes = 2 * 2 * PAGE_ELEMS * 2
        assert pair.d.counters()["bytes_received"] == state_bytes + attention_bytes
    finally:
        pair.close()


def test_hybrid_prefix_hit_on_decode_skips_its_blocks_in_that_group_only() -> None:
    """D holds the first attention block (first_block 1): P sends only block 5 of [4, 5], and
    the state slot regardless."""
    pair = GroupPair(_hybrid_caches(None), _hybrid_caches(0.0))
    try:
        (recving, failed), sending = pair.transfer([[9], [4, 5]], [[2], [7]], [0, 1], 7)
        assert (recving, failed, sending) == ({"d-req"}, set(), {"p-req"})
        for got, want in zip(_attn(pair.d_kv, [7]), _attn(pair.p_kv, [5]), strict=True):
            assert torch.equal(got, want)
        for got, want in zip(_state(pair.d_kv, 2), _state(pair.p_kv, 9), strict=True):
            assert torch.equal(got, want)
        state_bytes = 2 * sum(math.prod(s) for s in STATE_SHAPES) * 2
        assert pair.d.counters()["bytes_received"] == state_bytes + 2 * PAGE_ELEMS * 2
    finally:
        pair.close()


MISMATCHES = {
    # family: (P's cache, D's cache, blocks per group)
    "attention": (
        lambda: _attention_caches(None),
        lambda: _attention_caches(0.0, heads=HEADS * 2),
        [[1, 2]],
    ),
    "mla": (lambda: _mla_caches(None), lambda: _mla_caches(0.0, latent=16), [[1, 2]]),
    "state": (
        lambda: _hybrid_caches(None),
        lambda: _hybrid_caches(0.0, state_shapes=((3, 8), (2, 4, 2))),
        [[9], [1, 2]],
    ),
    "state-vs-attention-only": (
        lambda: _hybrid_caches(None),
        lambda: _attention_caches(0.0),
        [[9], [1, 2]],
    ),
}


@pytest.mark.parametrize("family", list(MISMATCHES))
def test_layout_mismatch_is_refused_before_any_byte_moves_and_decode_recomputes(
    family: str, caplog: pytest.LogCaptureFixture
) -> None:
    """P and D disagree on a group's layout: D's pull fails (reported failed: vLLM recomputes the
    prompt), P frees its blocks, D's cache is untouched, and P's log names request and peer."""
    make_p, make_d, blocks = MISMATCHES[family]
    pair = GroupPair(make_p(), make_d())
    try:
        n_groups = len(pair.d.local_spec.groups)  # type: ignore[union-attr]
        dst = blocks if n_groups == len(blocks) else blocks[-n_groups:]
        with caplog.at_level(logging.WARNING, logger="hybrid_connector"):
            (recving, failed), sending = pair.transfer(blocks, dst, [0] * len(dst), 7)
        assert (recving, failed, sending) == ({"d-req"}, {"d-req"}, {"p-req"})
        assert "bytes_received" not in pair.d.counters()
        for value in pair.d_kv.values():
            for tensor in value if isinstance(value, list) else [value]:
                assert bool((tensor == 0).all())
        rejected = [r.message for r in caplog.records if "rejected" in r.message]
        assert any("p-req" in m and "d-req" in m and "127.0.0.1" in m for m in rejected), rejected
    finally:
        pair.close()
