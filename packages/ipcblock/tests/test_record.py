import numpy as np
import pytest
from ipcblock import (
    IPCBLOCK_DTYPE,
    IPCBLOCK_SIZE,
    RecordBufferError,
    blocks_from_bytes,
    blocks_to_bytes,
    make_blocks,
    merge_runs,
)


def test_record_is_30_packed_little_endian_bytes() -> None:
    assert IPCBLOCK_DTYPE.itemsize == IPCBLOCK_SIZE == 30
    blocks = make_blocks(
        0x0102030405060708, 0x1112131415161718, 0x2122232425262728,
        src_region=0xA1A2, dst_region=0xB1B2, tag=0xC1C2,
    )  # fmt: skip
    raw = bytes(blocks_to_bytes(blocks))
    assert raw == (
        bytes.fromhex("a2a1b2b1")
        + (0x0102030405060708).to_bytes(8, "little")
        + (0x1112131415161718).to_bytes(8, "little")
        + (0x2122232425262728).to_bytes(8, "little")
        + bytes.fromhex("c2c1")
    )


def test_bytes_round_trip_without_copies() -> None:
    blocks = make_blocks(np.arange(5) * 10, np.arange(5) * 20, 7, src_region=1, dst_region=2, tag=3)
    view = blocks_to_bytes(blocks)
    assert view.nbytes == 5 * 30
    back = blocks_from_bytes(view)
    assert np.shares_memory(back, blocks)
    np.testing.assert_array_equal(back, blocks)
    payload = bytearray(view)
    parsed = blocks_from_bytes(payload)
    assert parsed.ctypes.data == np.frombuffer(payload, dtype=np.uint8).ctypes.data


def test_from_bytes_rejects_partial_record() -> None:
    with pytest.raises(RecordBufferError):
        blocks_from_bytes(b"\0" * 31)


def test_merge_joins_runs_contiguous_on_both_sides() -> None:
    # 0..30 runs on both sides; 40 breaks the source run (30 -> 40) although the destination
    # continues; 50 continues both again.
    blocks = make_blocks([0, 10, 20, 40, 50], [100, 110, 120, 130, 140], 10, tag=4)
    merged = merge_runs(blocks)
    assert merged[["src_offset", "dst_offset", "length", "tag"]].tolist() == [
        (0, 100, 30, 4),
        (40, 130, 20, 4),
    ]


def test_merge_respects_destination_gap_tag_and_region() -> None:
    blocks = make_blocks([0, 10, 20, 30, 40], [0, 10, 25, 35, 45], 10, tag=[0, 0, 0, 1, 1])
    assert merge_runs(blocks)["length"].tolist() == [20, 10, 20]
    blocks = make_blocks([0, 10], [0, 10], 10, src_region=[1, 2])
    assert merge_runs(blocks).size == 2
    blocks = make_blocks([0, 10], [0, 10], 10, dst_region=[1, 2])
    assert merge_runs(blocks).size == 2


def test_merge_of_empty_and_single() -> None:
    assert merge_runs(make_blocks([], [], [])).size == 0
    one = make_blocks([5], [6], [7])
    np.testing.assert_array_equal(merge_runs(one), one)
