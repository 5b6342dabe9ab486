from __future__ import annotations

import pickle

import numpy as np
import pytest
import refstore
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from refstore import Manifest, materialize

LAYERS, K = 3, 2


def _rollout(client, lengths, start_value):
    """One object holding several samples' top-k rows back to back, plus the expected rows."""
    rows = []
    value = start_value
    for n in lengths:
        rows.append(np.arange(value, value + n * LAYERS * K, dtype=np.int32).reshape(n, LAYERS, K))
        value += n * LAYERS * K
    ref = client.put({"topk": np.concatenate(rows), "tokens": np.zeros(sum(lengths), np.int64)})
    return ref, rows


def test_reorganise_without_touching_payload_then_materialize(client):
    ref_a, rows_a = _rollout(client, [5, 3, 7], 0)
    ref_b, rows_b = _rollout(client, [4, 6], 10_000)
    ma = Manifest.from_packed(ref_a, [5, 3, 7], dtype=np.int32, row_shape=(LAYERS, K), key="topk")
    mb = Manifest.from_packed(
        ref_b, [4, 6], dtype=np.int32, row_shape=(LAYERS, K), key="topk", sample_ids=[10, 11]
    )
    both = ma + mb
    assert len(both) == 5
    assert both.num_tokens == 25
    assert both.nbytes == 25 * LAYERS * K * 4
    gets_before = client.stats().gets
    ordered = both.sort_by_length()  # 7, 6, 5, 4, 3
    picked = ordered[1:4].take([2, 0, 1])  # samples of length 4, 6, 5
    cut = picked.token_slice(1, 4)  # tokens 1..3 of each
    assert client.stats().gets == gets_before  # pure metadata so far
    expected = np.concatenate([rows_b[0][1:4], rows_b[1][1:4], rows_a[0][1:4]])
    np.testing.assert_array_equal(materialize(cut, client=client), expected)
    # A manifest travels as a few bytes per sample, whatever the payload size.
    again = pickle.loads(pickle.dumps(cut))
    assert len(pickle.dumps(cut)) < 2048
    np.testing.assert_array_equal(materialize(again, client=client), expected)


def test_padded_layout_into_torch_out(client):
    ref, rows = _rollout(client, [2, 4], 0)
    m = Manifest.from_packed(ref, [2, 4], dtype=np.int32, row_shape=(LAYERS, K), key="topk")
    out = torch.full((2, 4, LAYERS, K), 99, dtype=torch.int32)
    assert materialize(m, out, client=client, layout="padded", pad_value=-1) is out
    np.testing.assert_array_equal(out[0, :2].numpy(), rows[0])
    assert (out[0, 2:] == -1).all()
    np.testing.assert_array_equal(out[1].numpy(), rows[1])


def test_adjacent_samples_merge_into_one_copy(client):
    ref, rows = _rollout(client, [3, 3, 3], 0)
    m = Manifest.from_packed(ref, [3, 3, 3], dtype=np.int32, row_shape=(LAYERS, K), key="topk")
    out = materialize(m, client=client)
    np.testing.assert_array_equal(out, np.concatenate(rows))


def test_group_split_and_one_ref_per_sample(client):
    refs = [client.put(np.full((n, 2), i, np.float32)) for i, n in enumerate([3, 1, 2])]
    m = Manifest.from_refs(refs, [3, 1, 2], dtype=np.float32, row_shape=(2,), sample_ids=[2, 0, 1])
    grouped = m.group_by_sample()
    np.testing.assert_array_equal(grouped.sample_id, [0, 1, 2])
    batches = grouped.split_by_tokens(3)
    assert [b.num_tokens for b in batches] == [3, 3]
    np.testing.assert_array_equal(materialize(batches[0], client=client)[:, 0], [1, 2, 2])
    assert sorted(r.oid for r in m.used_refs()) == sorted(r.oid for r in refs)


def test_errors_are_caller_errors(client):
    ref, _ = _rollout(client, [2], 0)
    m = Manifest.from_packed(ref, [2], dtype=np.int32, row_shape=(LAYERS, K), key="topk")
    with pytest.raises(refstore.CallerError, match="out must be"):
        materialize(m, np.zeros((3, LAYERS, K), np.int32), client=client)
    with pytest.raises(refstore.CallerError, match="different fields"):
        Manifest.concat([m, Manifest.from_packed(ref, [2], dtype=np.int64, row_shape=(1,))])
    too_long = Manifest.from_packed(ref, [5], dtype=np.int32, row_shape=(LAYERS, K), key="topk")
    with pytest.raises(refstore.CallerError, match="beyond"):
        materialize(too_long, client=client)
    client.release(ref)
    with pytest.raises(refstore.ObjectReleased):
        materialize(m, client=client)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    data=st.data(),
)
def test_any_reorganisation_materializes_like_numpy(client, lengths, data):
    """Random permutations, slices, token ranges and concatenations, checked against the same
    operations done on the rows themselves with numpy."""
    rows = np.arange(sum(lengths) * 2, dtype=np.int64).reshape(-1, 2)
    ref = client.put(rows)
    m = Manifest.from_packed(ref, lengths, dtype=np.int64, row_shape=(2,))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(int)
    samples = [rows[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    order = data.draw(st.permutations(range(len(lengths))))
    m, samples = m.take(order), [samples[i] for i in order]
    lo = data.draw(st.integers(0, len(lengths)))
    hi = data.draw(st.integers(lo, len(lengths)))
    m, samples = m[lo:hi], samples[lo:hi]
    a = data.draw(st.integers(0, 5))
    b = data.draw(st.integers(a, 10))
    m, samples = m.token_slice(a, b), [s[a:b] for s in samples]
    if data.draw(st.booleans()):
        m, samples = m + m, samples + samples
    expected = np.concatenate(samples) if samples else np.empty((0, 2), np.int64)
    np.testing.assert_array_equal(materialize(m, client=client), expected)
    client.release(ref)
