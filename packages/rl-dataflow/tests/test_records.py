"""The loop's check of gathered records and its by-value layout, without vLLM or Ray: a missing
row ("no row", the dtype's maximum) in any sample's rows is refused, padding is not a row."""

from __future__ import annotations

import numpy as np
import pytest
from rl_dataflow.pipeline import Batch
from rl_dataflow.rl_loop import RecordError, _padded, check_rows


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_a_missing_row_is_refused_padded_or_packed(dtype):
    no_row = np.iinfo(dtype).max
    lengths, ids = np.array([5, 3, 4]), np.array([10, 11, 12])
    padded = np.zeros((3, 5, 2, 2), dtype)
    padded[1, 3:] = no_row  # sample 11's padding: not a row
    check_rows(padded, lengths, ids)
    padded[2, 3, 1, 0] = no_row  # one id of sample 12's last row
    with pytest.raises(RecordError, match=r"samples \[12\]"):
        check_rows(padded, lengths, ids)
    packed = np.zeros((12, 2, 2), dtype)
    check_rows(packed, lengths, ids)
    packed[5, 0, 1] = no_row  # sample 10 has rows 0-4, sample 11 rows 5-7
    with pytest.raises(RecordError, match=r"samples \[11\]"):
        check_rows(packed, lengths, ids)


def test_a_by_value_micro_batch_pads_like_the_gather():
    rng = np.random.default_rng(0)
    lengths = np.array([4, 2, 3])
    rows = rng.integers(0, 8, (9, 2, 2), dtype=np.uint8)
    offsets = np.array([0, 4, 6])
    batch = Batch(np.arange(3), np.arange(3), lengths, [None] * 3, rows, offsets)
    out = _padded(batch)
    assert out.shape == (3, 4, 2, 2)
    for i, (offset, n) in enumerate(zip(offsets, lengths, strict=True)):
        assert np.array_equal(out[i, :n], rows[offset : offset + n])
        assert not out[i, n:].any()


@pytest.fixture
def store(tmp_path, monkeypatch):
    import refstore

    monkeypatch.setenv("REFSTORE_DIR", str(tmp_path / "refstore"))
    with refstore.MasterThread("records-test", "8M"), refstore.Client("records-test") as client:
        yield client


@pytest.mark.parametrize("long_lived", [True, False], ids=["subscription", "own"])
def test_records_are_found_in_order_stored_before_or_while_the_loop_waits(store, long_lived):
    """Keys bound out of order, some before the lookup (their events already gone by), some
    while it waits: every ref comes back, in the keys' order."""
    import threading

    from rl_dataflow.rl_loop import _lookup_all

    keys = [f"r3/{i}".encode() for i in range(4)]
    rows = [np.full((i + 1, 2, 2), i, np.uint8) for i in range(4)]
    events = store.subscribe_keys() if long_lived else None
    store.put_keyed([(keys[i], rows[i]) for i in (3, 1)], ttl=30)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_lookup_all(store, keys, 30, events)))
    reader.start()  # may look before or after the puts below: it waits on the key events
    store.put_keyed([(keys[2], rows[2])], ttl=30)
    store.put_keyed([(keys[0], rows[0])], ttl=30)
    reader.join(timeout=60)
    assert got, "the lookup did not return"
    assert [np.array(store.get(ref)).tobytes() for ref in got[0]] == [r.tobytes() for r in rows]
    with pytest.raises(RecordError, match="1 r3 records not in the store"):
        _lookup_all(store, [*keys, b"r3/never"], 0, events)
    if events is not None:
        events.close()
