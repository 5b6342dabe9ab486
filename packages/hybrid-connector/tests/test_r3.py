"""R3 without vLLM: the row scatter and gather, keys and params, the peer check, the config, the
worker's recorder on a KV-cache-shaped tensor with routers standing in for vLLM's (a capture
hook each), and records stored into and read back from a real refstore master."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import refstore
import torch
from hybrid_connector import r3, r3_worker
from hybrid_connector.config import HybridConfig, R3Config, parse_config
from hybrid_connector.errors import ConfigError, PeerError
from hybrid_connector.layout import KvGroup
from hybrid_connector.metadata import HybridConnectorMetadata, R3Copy, StepReport
from hybrid_connector.protocol import LayoutSpec, SegmentSpec
from hybrid_connector.r3_worker import R3Recorder
from hybrid_connector.scheduler_side import SchedulerSide

ROWS = r3.RowGeometry(layers=3, top_k=2, dtype="uint8")


# ------------------------------------------------------------------ rows
@pytest.mark.parametrize(
    ("experts", "dtype"), [(1, "uint8"), (254, "uint8"), (255, "uint16"), (32766, "uint16")]
)
def test_the_narrowest_dtype_keeps_its_maximum_for_no_row(experts: int, dtype: str) -> None:
    assert r3.routing_dtype(experts) == np.dtype(dtype)
    assert r3.no_row(dtype) >= experts


def test_too_many_experts_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        r3.routing_dtype(40000)


def test_rows_scattered_by_slot_gather_back_in_token_order() -> None:
    block_size, num_blocks = 4, 6
    buffer = np.full((num_blocks, block_size, ROWS.layers, ROWS.top_k), 255, np.uint8)
    block_ids = [5, 2, 3]  # the request's blocks, from token 0
    tokens = 10
    slots = np.array(
        [block_ids[t // block_size] * block_size + t % block_size for t in range(tokens)]
    )
    rng = np.random.default_rng(0)
    want = rng.integers(0, 8, (tokens, ROWS.layers, ROWS.top_k), dtype=np.uint8)
    # a prefill of 7 tokens with a padding row, then three decode steps of one token
    for layer in range(ROWS.layers):
        r3.scatter_rows(
            buffer, np.append(slots[:7], -1), layer, np.vstack([want[:7, layer], [[9, 9]]])
        )
    for t in range(7, tokens):
        for layer in range(ROWS.layers):
            r3.scatter_rows(buffer, slots[t : t + 1], layer, want[t : t + 1, layer])
    got = r3.gather_rows(buffer, block_ids, tokens)
    assert got.tobytes() == want.tobytes()
    assert r3.missing_rows(got) == 0
    assert (buffer == 9).sum() == 0  # the padding row went nowhere
    # one token more than was written: a row is missing
    assert r3.missing_rows(r3.gather_rows(buffer, block_ids, tokens + 1)) == 1
    with pytest.raises(ValueError, match="need 4 blocks"):
        r3.blocks_of(block_ids, 13, block_size)


def test_a_stored_object_is_the_rows_and_says_which_are_missing() -> None:
    rows = np.zeros((4, 2, 2), np.uint8)[::-1]  # not contiguous: stored as one
    assert r3.stored_object(rows).flags.c_contiguous
    assert r3.missing_rows(r3.stored_object(rows)) == 0
    rows[2, 1, 0] = 255
    assert r3.missing_rows(r3.stored_object(rows)) == 1


def test_record_params_are_plain_json_with_a_unique_key() -> None:
    keys = {r3.record_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("r3/") and len(k.encode()) <= 64 for k in keys)
    params = r3.record_params(keys.pop(), "node", 17, ROWS)
    assert json.loads(json.dumps(params)) == params
    assert params["tokens"] == 17
    assert (params["layers"], params["top_k"], params["dtype"], params["complete"]) == (
        3,
        2,
        "uint8",
        True,
    )


# ------------------------------------------------------------------ peers and config
def _layout(block_size: int = 32, names: tuple[str, ...] = ("l0", r3.ROUTING_LAYER)) -> LayoutSpec:
    return LayoutSpec(
        layer_names=list(names),
        layer_offsets=[0] * len(names),
        region_ids=[0] * len(names),
        num_blocks=8,
        block_size=block_size,
        segments=[SegmentSpec("kv", 0, block_size * 256, block_size * 256)],
        kind="blocks_major",
        total_heads=2,
        num_heads=2,
    )


def test_routing_rows_go_only_to_an_equal_block_layout() -> None:
    r3.check_peer(_layout(), _layout())
    with pytest.raises(PeerError, match="equal KV block layouts"):
        r3.check_peer(_layout(), _layout(64))
    # without the layer on either side there is nothing to check (the names differ anyway)
    r3.check_peer(_layout(names=("l0",)), _layout(64))


def test_r3_config() -> None:
    assert parse_config({"r3": True}, is_producer=False).r3 == R3Config()
    assert parse_config({"r3": False}, is_producer=False).r3 is None
    assert parse_config({}, is_producer=False).r3 is None
    cfg = parse_config({"r3": {"store": "s", "ttl_s": 5}}, is_producer=False).r3
    assert cfg == R3Config(store="s", ttl_s=5.0)
    with pytest.raises(ConfigError, match="ttl_s"):
        parse_config({"r3": {"ttl_s": 0}}, is_producer=False)
    with pytest.raises(ConfigError, match="storage"):
        parse_config({"r3": {"storage": "s"}}, is_producer=False)


def test_the_copies_are_metadata_work() -> None:
    meta = HybridConnectorMetadata()
    assert meta.is_empty()
    meta.r3_copies.append(R3Copy("r", "r3/x", [1], 3))
    assert not meta.is_empty()


# ------------------------------------------------------------------ the recorder
class _Router:
    """Stands in for vLLM's BaseRouter: holds the capture hook its select_experts calls."""

    def __init__(self) -> None:
        self.capture_fn: Any = None

    def set_capture_fn(self, fn: Any) -> None:
        self.capture_fn = fn


class _DictStore:
    def __init__(self) -> None:
        self.objects: dict[bytes, Any] = {}

    def put_keyed(self, items: list[tuple[bytes, Any]], ttl: float | None = None) -> list[Any]:
        for key, obj in items:
            self.objects[key] = np.array(obj)
        return [key for key, _ in items]

    def close(self) -> None:
        pass


def _recorder(
    store: Any, *, tp_rank: int = 0, layers: int = 3, numpy_on_cpu: bool = True
) -> tuple[R3Recorder, Any]:
    rows = r3.RowGeometry(layers=layers, top_k=2, dtype="uint8")
    recorder = R3Recorder(
        R3Config(), rows, tp_rank=tp_rank, connect=lambda: store, numpy_on_cpu=numpy_on_cpu
    )
    return recorder, rows


# The CPU path (numpy views) and the device path (torch only, no host sync) on a CPU buffer.
PATHS = pytest.mark.parametrize("numpy_on_cpu", [True, False], ids=["numpy", "torch"])


def _template(num_blocks: int = 6, block_size: int = 4) -> torch.Tensor:
    # vLLM's CPU layer: [num_blocks, kv_heads, block_size, 2 * head_dim] bf16
    return torch.zeros(num_blocks, 2, block_size, 8, dtype=torch.bfloat16)


@PATHS
def test_the_recorder_writes_rows_at_the_forward_pass_slots_and_stores_a_finished_request(
    numpy_on_cpu: bool,
) -> None:
    store = _DictStore()
    recorder, rows = _recorder(store, numpy_on_cpu=numpy_on_cpu)
    routers = [_Router() for _ in range(rows.layers)]
    slots: dict[str, torch.Tensor] = {}
    template = _template()
    tensor = recorder.attach(template, 4, "l0", routers, slots.get)
    try:
        assert tensor.shape == template.shape
        assert tensor.stride() == template.stride()
        assert tensor.dtype == template.dtype
        assert tensor.data_ptr() != template.data_ptr()
        rng = np.random.default_rng(1)
        want = rng.integers(0, 8, (6, rows.layers, 2), dtype=np.int32)
        slots["l0"] = torch.tensor([4 * 3 + 0, 4 * 3 + 1, 4 * 3 + 2, 4 * 3 + 3, 4 * 1 + 0, -1])
        for layer, router in enumerate(routers):
            # vLLM's topk_ids: int32 [tokens, top_k], padding row included
            router.capture_fn(torch.from_numpy(np.vstack([want[:5, layer], [[7, 7]]])))
        slots.clear()
        routers[0].capture_fn(torch.zeros(3, 2, dtype=torch.int32))  # no forward: ignored
        recorder.copy_out([R3Copy("req", "r3/a", [3, 1], 5), R3Copy("short", "r3/b", [3, 1], 6)])
        assert recorder.wait_stored(2, timeout_s=10)
        assert store.objects[b"r3/a"].tobytes() == want[:5].astype(np.uint8).tobytes()
        assert r3.missing_rows(store.objects[b"r3/b"]) == 1  # token 5 never went through
        assert recorder.counters["incomplete"] == 1
        assert recorder.counters["captures"] == rows.layers
    finally:
        recorder.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("hybrid-connector-r3")]


@PATHS
def test_each_forward_pass_writes_at_its_own_slots_even_in_a_reused_slot_tensor(
    numpy_on_cpu: bool,
) -> None:
    # vLLM may hand the same slot-mapping tensor object to every pass, its content changed in
    # place: the write plan is made again at each pass's first MoE layer.
    store = _DictStore()
    recorder, rows = _recorder(store, numpy_on_cpu=numpy_on_cpu)
    routers = [_Router() for _ in range(rows.layers)]
    slot_tensor = torch.tensor([4 * 2 + 0, 4 * 2 + 1, -1])
    recorder.attach(_template(), 4, "l0", routers, {"l0": slot_tensor}.get)
    try:
        rng = np.random.default_rng(2)
        want = rng.integers(0, 8, (4, rows.layers, 2), dtype=np.int32)
        for tokens, slots in ((slice(0, 2), [8, 9, -1]), (slice(2, 4), [10, 11, -1])):
            slot_tensor.copy_(torch.tensor(slots))
            for layer, router in enumerate(routers):
                ids = np.vstack([want[tokens, layer], [[7, 7]]])
                router.capture_fn(torch.from_numpy(ids))
        recorder.copy_out([R3Copy("req", "r3/a", [2], 4)])
        assert recorder.wait_stored(1, timeout_s=10)
        assert store.objects[b"r3/a"].tobytes() == want.astype(np.uint8).tobytes()
    finally:
        recorder.close()


def test_quiet_steps_keep_their_rows_until_a_step_that_moves_blocks() -> None:
    """CPU: the passes and resets of steps whose metadata moves no block are kept and written
    later, in order (a slot written twice keeps its last row; a block reset after a pass wrote
    to it loses that row), before a step that moves blocks reads or frees any, at that step's
    end, or once ``KEEP_PASSES`` passes are kept."""
    store = _DictStore()
    recorder, rows = _recorder(store)
    routers = [_Router() for _ in range(rows.layers)]
    slot_tensor = torch.zeros(2, dtype=torch.int64)
    recorder.attach(_template(), 4, "l0", routers, {"l0": slot_tensor}.get)
    blocks = recorder.blocks
    assert blocks is not None
    no_row = np.full((rows.layers, 2), 0xFF, dtype=np.uint8)

    def step(meta: HybridConnectorMetadata, slots: list[int], ids: np.ndarray) -> None:
        recorder.begin_step(meta)
        slot_tensor.copy_(torch.tensor(slots))  # refilled in place, as vLLM does
        _forward(routers, ids, range(rows.layers))
        recorder.step_done()
        assert recorder.report() == ()

    def rows_of(block: int, first: int, last: int) -> bytes:
        return blocks[block, first:last].numpy().tobytes()

    try:
        rng = np.random.default_rng(4)
        one, two, three, four = (
            rng.integers(0, 8, (2, rows.layers, 2), dtype=np.int32) for _ in range(4)
        )
        step(HybridConnectorMetadata(), [4, 12], one)
        step(HybridConnectorMetadata(), [12, 13], two)  # slot 12 again: this row wins
        step(HybridConnectorMetadata(r3_fresh_blocks=[1]), [5, 8], three)  # block 1 reset
        for block in (1, 2, 3):
            assert rows_of(block, 0, 4) == np.stack([no_row] * 4).tobytes()  # not yet
        step(HybridConnectorMetadata(cancel_recv=["gone"]), [9, 10], four)  # moves blocks
        # block 1: one's row (slot 4) went before the reset, three's (slot 5) after it
        want = np.stack([no_row, three[0], no_row, no_row]).astype(np.uint8)
        assert rows_of(1, 0, 4) == want.tobytes()
        assert rows_of(3, 0, 2) == two.astype(np.uint8).tobytes()
        assert rows_of(2, 0, 1) == three[1].astype(np.uint8).tobytes()
        assert rows_of(2, 1, 3) == four.astype(np.uint8).tobytes()  # at the step's end
        for _ in range(r3_worker.KEEP_PASSES - 1):
            step(HybridConnectorMetadata(), [16, 17], two)
        assert rows_of(4, 0, 2) == np.stack([no_row] * 2).tobytes()
        step(HybridConnectorMetadata(), [16, 17], one)  # the KEEP_PASSES-th kept pass
        assert rows_of(4, 0, 2) == one.astype(np.uint8).tobytes()
        assert recorder.counters["resets"] == 1
    finally:
        recorder.close()


def test_only_rank_0_stores_and_a_mismatch_is_refused_at_start() -> None:
    store = _DictStore()
    recorder, rows = _recorder(store, tp_rank=1)
    routers = [_Router() for _ in range(rows.layers)]
    recorder.attach(_template(), 4, "l0", routers, lambda name: None)
    recorder.copy_out([R3Copy("req", "r3/a", [1], 1)])
    recorder.close()
    assert store.objects == {}
    assert recorder.counters["records"] == 1
    with pytest.raises(ConfigError, match="2 MoE routers, its config says 3"):
        _recorder(store)[0].attach(_template(), 4, "l0", [_Router(), _Router()], lambda name: None)
    # 64 layers x 2 ids do not fit one layer's 32 B of KV per token
    with pytest.raises(ConfigError, match="does not fit"):
        _recorder(store, layers=64)[0].attach(
            _template(), 4, "l0", [_Router() for _ in range(64)], lambda name: None
        )


# ------------------------------------------------------------------ fresh blocks, missed captures
def _blk(block_id: int) -> Any:
    """vLLM's KVCacheBlock as the scheduler half reads it."""
    return SimpleNamespace(block_id=block_id, is_null=block_id == 0)


def test_the_ledger_resets_blocks_the_forward_passes_write_and_keeps_hits_and_loads() -> None:
    ledger = r3.RowLedger(block_size=4)
    # a hit of 2 blocks, 6 tokens loaded (2 blocks, the second partly), 1 block computed
    ledger.looked_up("a", hit_tokens=8)
    blocks = [_blk(7), _blk(8), _blk(9), _blk(10), _blk(11)]
    assert ledger.allocated("a", blocks, loaded_tokens=6) == [11]
    # scheduled again once its load is in (no lookup first): only what is new since
    assert ledger.allocated("a", [*blocks, _blk(12), _blk(13)], loaded_tokens=0) == [12, 13]
    # preempted and admitted again: its blocks were freed; a new hit, nothing loaded
    ledger.looked_up("a", hit_tokens=4)
    assert ledger.allocated("a", [_blk(7), _blk(3), _blk(4)], 0) == [3, 4]
    # allocated without a lookup (not vLLM's order): every block it holds, never the null one
    assert ledger.allocated("c", [_blk(0), _blk(6)], 0) == [6]
    # a step that missed a capture marks the requests it ran that are still on the ledger
    ledger.looked_up("b", hit_tokens=0)
    assert ledger.allocated("b", [_blk(5)], 0) == [5]
    first = ledger.start_step({"a": 1, "b": 1})
    second = ledger.start_step({"b": 1, "gone": 1})
    ledger.missed([second])
    assert ledger.finished("a") is True
    assert ledger.finished("b") is False
    assert ledger.finished("c") is True
    ledger.missed([first])  # late: "a" ended already, nothing to mark
    ledger.looked_up("d", hit_tokens=0)  # looked up, ended before it was ever allocated
    assert ledger.finished("d") is True
    assert ledger.tracked == 0


def _routed_side(block_size: int) -> SchedulerSide:
    groups = [KvGroup("attention", ("l0", r3.ROUTING_LAYER), block_size, "bfloat16")]
    return SchedulerSide(
        HybridConfig(r3=R3Config(store="r3-test")),
        is_producer=False,
        is_consumer=False,
        block_size=block_size,
        groups=groups,
        r3_rows=ROWS,
    )


def _step(side: SchedulerSide, scheduled: dict[str, int], new_blocks: dict[str, list[int]]) -> Any:
    """build_connector_meta for a step running ``scheduled``; ``new_blocks``: the running
    requests' new blocks (vLLM's scheduled_cached_reqs)."""
    cached = SimpleNamespace(
        req_ids=list(new_blocks),
        new_block_ids=[(ids,) for ids in new_blocks.values()],
        resumed_req_ids=set(),
    )
    return side.build_connector_meta(
        SimpleNamespace(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_cached_reqs=cached,
        )
    )


def _finished(request_id: str, tokens: int) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        kv_transfer_params=None,
        num_computed_tokens=tokens,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
    )


def _forward(routers: list[_Router], ids: np.ndarray, layers: range) -> None:
    """One forward pass's routers (its slots set by the caller): those of ``layers`` call their
    hook with ``ids[:, layer]``, the others skip it."""
    for layer in layers:
        routers[layer].capture_fn(torch.from_numpy(ids[:, layer]))


def test_a_reused_block_never_hands_on_its_previous_rows_and_a_missed_capture_is_flagged() -> None:
    """A's 8 tokens fill blocks 2 and 3; A ends; B gets block 3 and its forward pass captures
    layer 0 only (vLLM skipped the other routers' hooks). Block 3 must not pass A's rows off as
    B's: B's record is incomplete, in its params and in the stored object."""
    side = _routed_side(block_size=4)
    store = _DictStore()
    recorder, rows = _recorder(store)
    routers = [_Router() for _ in range(rows.layers)]
    slots: dict[str, torch.Tensor] = {}
    recorder.attach(_template(), 4, "l0", routers, slots.get)
    rng = np.random.default_rng(3)
    try:
        # A: admitted with blocks 2, 3 (both new: reset), one prefill pass of 8 tokens
        assert side.get_num_new_matched_tokens(SimpleNamespace(request_id="a"), 0) == (0, False)
        side.update_state_after_alloc(
            SimpleNamespace(request_id="a"), SimpleNamespace(blocks=([_blk(2), _blk(3)],)), 0
        )
        meta = _step(side, {"a": 8}, {})
        assert meta.r3_fresh_blocks == [2, 3]
        recorder.begin_step(meta)
        a_rows = rng.integers(0, 8, (8, rows.layers, 2)).astype(np.int32)
        slots["l0"] = torch.arange(8, 16)
        _forward(routers, a_rows, range(rows.layers))
        assert recorder.report() == ()
        _, params = side.request_finished(_finished("a", 8), ([2, 3],))
        assert params is not None
        assert params["r3"]["complete"] is True
        # B: block 3 again; its prefill captures layer 0 only
        side.get_num_new_matched_tokens(SimpleNamespace(request_id="b"), 0)
        side.update_state_after_alloc(
            SimpleNamespace(request_id="b"), SimpleNamespace(blocks=([_blk(3)],)), 0
        )
        meta = _step(side, {"b": 3}, {})
        assert [c.request_id for c in meta.r3_copies] == ["a"]
        assert meta.r3_fresh_blocks == [3]
        recorder.begin_step(meta)  # A's rows out first, then block 3 reset
        b_rows = rng.integers(0, 8, (4, rows.layers, 2)).astype(np.int32)
        slots["l0"] = torch.arange(12, 15)
        _forward(routers, b_rows[:3], range(1))
        missed = recorder.report()
        assert missed == (meta.r3_step,)
        side.update_connector_output(
            SimpleNamespace(
                kv_connector_worker_meta=StepReport(r3_missed_steps=missed),
                finished_recving=set(),
            )
        )
        # B decodes one token, every hook called
        recorder.begin_step(_step(side, {"b": 1}, {"b": []}))
        slots["l0"] = torch.arange(15, 16)
        _forward(routers, b_rows[3:], range(rows.layers))
        assert recorder.report() == ()
        _, params = side.request_finished(_finished("b", 4), ([3],))
        assert params is not None
        assert params["r3"]["complete"] is False  # the engine knew
        recorder.begin_step(_step(side, {}, {}))
        assert recorder.wait_stored(2, timeout_s=10)
        b_obj, a_obj = sorted(store.objects.values(), key=len)  # 4 rows, 8 rows
        assert a_obj.tobytes() == a_rows.astype(np.uint8).tobytes()
        # and the stored rows: never A's as B's
        assert r3.missing_rows(b_obj) == 3
        assert (b_obj[:3, 1:] == 255).all()
        assert b_obj[:3, 0].tobytes() == b_rows[:3, 0].astype(np.uint8).tobytes()
        assert recorder.counters["incomplete"] == 1
        assert recorder.counters["missed_steps"] == 1
        assert side._r3_ledger is not None
        assert side._r3_ledger.tracked == 0
    finally:
        recorder.close()


# ------------------------------------------------------------------ through a real store
@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    with refstore.MasterThread("r3-test", "8M"), refstore.Client("r3-test") as client:
        yield client


def test_a_record_reads_back_from_the_store_and_waits_for_a_late_put(store: Any) -> None:
    rows = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2) % 8
    key = r3.record_key()
    params = {"transfer_id": "x", "r3": r3.record_params(key, "r3-test", 5, ROWS)}
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(r3.read_record(params, store)))
    reader.start()  # may look before or after the put: it waits on the key events
    store.put_keyed([(key.encode(), r3.stored_object(rows))], ttl=30)
    reader.join(timeout=30)
    assert got
    assert got[0].tobytes() == rows.tobytes()
    assert got[0].dtype == np.uint8
    assert np.array_equal(r3.read_record(params["r3"], store), rows)  # the dict alone does too
    assert store.stats().held == 0


def test_missing_incomplete_and_mismatched_records_raise(store: Any) -> None:
    missing = r3.record_params(r3.record_key(), "r3-test", 5, ROWS)
    with pytest.raises(r3.R3RecordError, match="not in the store"):
        r3.read_record({"r3": missing}, store, timeout_s=0)
    with pytest.raises(r3.R3RecordError, match="no r3 record"):
        r3.read_record({"transfer_id": "x"}, store)
    with pytest.raises(r3.R3RecordError, match="the engine said so"):
        r3.read_record({**missing, "complete": False}, store)
    partial = np.zeros((5, 3, 2), np.uint8)
    partial[4] = 255
    key = r3.record_key()
    store.put_keyed([(key.encode(), r3.stored_object(partial))], ttl=30)
    with pytest.raises(r3.R3RecordError, match="1 of 5 token rows missing"):
        r3.read_record(r3.record_params(key, "r3-test", 5, ROWS), store)
    with pytest.raises(r3.R3RecordError, match="expected uint8\\[6, 3, 2\\]"):
        r3.read_record(r3.record_params(key, "r3-test", 6, ROWS), store)
    with pytest.raises(r3.R3RecordError, match="newer"):
        r3.read_record({**missing, "version": 99}, store)


class _GatedStore(_DictStore):
    """Holds its first put until ``release`` is set; records each call's batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def put_keyed(self, items: list[tuple[bytes, Any]], ttl: float | None = None) -> list[Any]:
        self.calls.append(len(items))
        self.entered.set()
        assert self.release.wait(10)
        return super().put_keyed(items, ttl)


def test_records_queued_during_a_put_go_in_one_batch() -> None:
    store = _GatedStore()
    recorder, _ = _recorder(store)
    template = _template()
    recorder.attach(template, 4, "l0", [_Router() for _ in range(3)], {}.get)
    try:
        recorder.copy_out([R3Copy("first", "r3/first", [0], 0)])
        assert store.entered.wait(10)  # the put thread is in its first put
        recorder.copy_out([R3Copy(f"r{i}", f"r3/{i}", [1 + i], 0) for i in range(3)])
        store.release.set()
        assert recorder.wait_stored(4, timeout_s=10)
        assert store.calls == [1, 3]
    finally:
        recorder.close()
