"""RDMA WRITE planning (kvt.rdma_plan): records -> work requests, checked by executing the plan on
simulated memory (fake addresses, no device) against executing the records one by one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ipcblock import IPCBLOCK_DTYPE
from kvt.errors import InvalidBlocksError
from kvt.rdma_plan import (
    DeviceLimits,
    RemoteRegion,
    RemoteRegionError,
    check_remote,
    plan_writes,
)

REGION = 512  # bytes in each simulated local and remote region
LOCAL_BASE = {0: 0x10_0000, 1: 0x10_0000 + REGION}  # adjacent in memory, different MRs
LKEY = {0: 11, 1: 12}
REMOTE = {5: RemoteRegion(0x90_0000, REGION, 51), 6: RemoteRegion(0x90_0000 + REGION, REGION, 52)}


def _records(spec: list[tuple[int, int, int, int, int]]) -> np.ndarray:
    blocks = np.zeros(len(spec), dtype=IPCBLOCK_DTYPE)
    for i, (src_region, src_offset, dst_region, dst_offset, length) in enumerate(spec):
        blocks[i] = (src_region, dst_region, src_offset, dst_offset, length, 0)
    return blocks


def _local(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    src = blocks["src_region"]
    bases = np.array([LOCAL_BASE[int(r)] for r in src], dtype=np.uint64)
    keys = np.array([LKEY[int(r)] for r in src], dtype=np.uint32)
    return bases + blocks["src_offset"].astype(np.uint64), keys


@st.composite
def frames(draw):
    """Records that are often contiguous on one side, the other, both or neither."""
    n = draw(st.integers(0, 24))
    spec, src_end, dst_end = [], (0, 0), (5, 0)
    for _ in range(n):
        length = draw(st.integers(0, 40))
        src_region = draw(st.sampled_from([0, 1, src_end[0]]))
        dst_region = draw(st.sampled_from([5, 6, dst_end[0]]))
        src_offset = (
            src_end[1] if draw(st.booleans()) and src_region == src_end[0]
            else draw(st.integers(0, REGION))
        )  # fmt: skip
        dst_offset = (
            dst_end[1] if draw(st.booleans()) and dst_region == dst_end[0]
            else draw(st.integers(0, REGION))
        )  # fmt: skip
        length = min(length, REGION - src_offset, REGION - dst_offset)
        spec.append((src_region, src_offset, dst_region, dst_offset, length))
        src_end, dst_end = (src_region, src_offset + length), (dst_region, dst_offset + length)
    return _records(spec)


limits_strategy = st.builds(
    DeviceLimits,
    max_sge=st.integers(1, 5),
    max_msg_size=st.sampled_from([1, 3, 16, 64, 1 << 20]),
    sq_depth=st.integers(1, 9),
)


def _memories(seed: int):
    rng = np.random.default_rng(seed)
    local = {r: rng.integers(0, 256, REGION, dtype=np.uint8) for r in LOCAL_BASE}
    remote = {r: np.zeros(REGION, dtype=np.uint8) for r in REMOTE}
    return local, remote


def _execute_records(blocks, local, remote) -> None:
    for b in blocks.tolist():
        src_region, dst_region, src_offset, dst_offset, length, _ = b
        remote[dst_region][dst_offset : dst_offset + length] = local[src_region][
            src_offset : src_offset + length
        ]


def _execute_plan(plan, local, remote, limits: DeviceLimits) -> None:
    """What a NIC does with the plan, checking every scatter entry and remote range on the way."""
    by_lkey = {LKEY[r]: (LOCAL_BASE[r], local[r]) for r in LOCAL_BASE}
    by_rkey = {REMOTE[r].rkey: (REMOTE[r].address, remote[r]) for r in REMOTE}
    for i in range(plan.n_wr):
        sges = plan.sges(i)
        assert len(sges) <= limits.max_sge
        assert int(plan.wr_length[i]) == sum(n for _, n, _ in sges) <= limits.max_msg_size
        assert all(n > 0 for _, n, _ in sges)
        pieces = []
        for addr, n, lkey in sges:
            base, mem = by_lkey[lkey]
            assert base <= addr, "scatter entry outside its MR"
            assert addr + n <= base + REGION, "scatter entry outside its MR"
            pieces.append(mem[addr - base : addr - base + n])
        if not sges:
            continue
        base, mem = by_rkey[int(plan.wr_rkey[i])]
        start = int(plan.wr_remote_addr[i]) - base
        assert start >= 0, "write outside the rkey"
        assert start + int(plan.wr_length[i]) <= REGION, "write outside the rkey"
        mem[start : start + int(plan.wr_length[i])] = np.concatenate(pieces)


@settings(max_examples=300, deadline=None)
@given(blocks=frames(), limits=limits_strategy, imm=st.integers(0, 0xFFFF_FFFF))
def test_plan_writes_the_same_bytes_as_the_records_within_every_limit(blocks, limits, imm):
    local, expected = _memories(1)
    _execute_records(blocks, local, expected)
    _, got = _memories(1)
    addresses, lkeys = _local(blocks)
    plan = plan_writes(blocks, addresses, lkeys, remote=REMOTE, limits=limits, imm=imm)
    _execute_plan(plan, local, got, limits)
    for r in REMOTE:
        np.testing.assert_array_equal(got[r], expected[r])
    assert plan.nbytes == int(blocks["length"].sum())
    assert plan.imm == imm
    assert plan.n_wr >= 1
    assert plan.signaled[-1]
    windows = plan.windows()
    assert windows[0][0] == 0
    assert windows[-1][1] == plan.n_wr
    assert all(0 < end - start <= limits.window for start, end in windows)
    assert 2 * limits.window <= max(2, limits.sq_depth)  # two windows in flight fit the queue


def test_contiguous_records_coalesce_into_few_large_writes():
    # 8 x 64 B records contiguous on both sides: one span of 512 B, cut at max_msg_size.
    blocks = _records([(0, 64 * i, 5, 64 * i, 64) for i in range(8)])
    addresses, lkeys = _local(blocks)
    plan = plan_writes(
        blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(4, 1 << 20, 16), imm=7
    )
    assert plan.n_wr == 1
    assert plan.sges(0) == [(LOCAL_BASE[0], 512, LKEY[0])]
    cut = plan_writes(
        blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(4, 200, 16), imm=7
    )
    assert cut.wr_length.tolist() == [200, 200, 112]


def test_scattered_sources_into_one_remote_range_gather_up_to_max_sge():
    # Sources in reverse slot order, destination contiguous: gathered, max_sge entries per write.
    blocks = _records([(0, 64 * (7 - i), 5, 64 * i, 64) for i in range(8)])
    addresses, lkeys = _local(blocks)
    plan = plan_writes(
        blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(3, 1 << 20, 16), imm=1
    )
    assert [int(plan.wr_sge[i + 1] - plan.wr_sge[i]) for i in range(plan.n_wr)] == [3, 3, 2]
    assert plan.wr_remote_addr.tolist() == [REMOTE[5].address + 64 * k for k in (0, 3, 6)]


def test_adjacent_memory_in_different_regions_is_not_merged():
    # Local regions 0 and 1 touch in (simulated) memory, remote 5 and 6 too: keys differ.
    blocks = _records([(0, REGION - 8, 5, REGION - 8, 8), (1, 0, 6, 0, 8)])
    addresses, lkeys = _local(blocks)
    plan = plan_writes(
        blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(4, 1 << 20, 16), imm=1
    )
    assert plan.n_wr == 2


def test_send_queue_windows_and_imm_on_the_last_request():
    blocks = _records([(0, 0, 5, 16 * i, 8) for i in range(10)])  # 10 separate remote ranges
    addresses, lkeys = _local(blocks)
    plan = plan_writes(
        blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(1, 64, sq_depth=6), imm=99
    )
    assert plan.n_wr == 10
    assert plan.windows() == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert plan.imm == 99


def test_empty_frame_is_one_zero_length_write_with_imm():
    blocks = _records([(0, 0, 5, 0, 0)])
    addresses, lkeys = _local(blocks)
    plan = plan_writes(
        blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(1, 64, 4), imm=3
    )
    assert plan.n_wr == 1
    assert plan.sges(0) == []
    assert plan.wr_length.tolist() == [0]
    assert plan.signaled.tolist() == [True]
    assert plan.nbytes == 0


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ((0, 0, 7, 0, 8), "advertised no writable region 7"),
        ((0, 0, 5, REGION - 4, 8), "outside the peer's region 5"),
        ((0, 0, 5, (1 << 64) - 4, 8), "outside the peer's region 5"),  # offset + length wraps
        ((0, 0, 5, 0, REGION + 1), "outside the peer's region 5"),
    ],
)
def test_records_outside_the_advertised_regions_are_refused_before_planning(record, message):
    blocks = _records([(0, 0, 5, 0, 8), record])
    addresses, lkeys = _local(blocks)
    with pytest.raises(RemoteRegionError, match=message) as caught:
        plan_writes(blocks, addresses, lkeys, remote=REMOTE, limits=DeviceLimits(4, 64, 4), imm=0)
    assert "record 1" in str(caught.value)
    assert isinstance(caught.value, InvalidBlocksError)


def test_bad_inputs_are_typed_errors():
    with pytest.raises(InvalidBlocksError):
        check_remote(np.zeros(3, dtype=np.uint8), REMOTE)
    with pytest.raises(ValueError, match="u32"):
        plan_writes(
            _records([]),
            np.zeros(0),
            np.zeros(0),
            remote=REMOTE,
            limits=DeviceLimits(1, 1, 1),
            imm=1 << 32,
        )
    with pytest.raises(ValueError):
        DeviceLimits(0, 64, 4)
    with pytest.raises(ValueError):
        DeviceLimits(1, 1 << 32, 4)
    with pytest.raises(ValueError):
        RemoteRegion((1 << 64) - 4, 8, 1)
