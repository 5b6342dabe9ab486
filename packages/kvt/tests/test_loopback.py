"""The benchmark harness's own checks: byte-exact verification and the path it measures."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from kvt.loopback import ScatterPattern, check_paths, source_bytes


def _apply(pattern: ScatterPattern, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in zip(pattern.src_offsets, pattern.dst_offsets, pattern.lengths, strict=True):
        dst[d : d + n] = src[s : s + n]


def test_a_permutation_moves_every_block_once() -> None:
    pattern = ScatterPattern.permutation(1 << 20, 64 << 10)
    assert pattern.blocks == 16
    assert pattern.nbytes == 1 << 20
    assert sorted(pattern.dst_offsets // (64 << 10)) == list(range(16))
    src, dst = source_bytes(1 << 20), np.ones(1 << 20, np.uint8)
    _apply(pattern, src, dst)
    assert pattern.delivered(dst, src)


def test_delivered_catches_a_torn_unit_inside_a_merged_record() -> None:
    unit = 4096
    # Record 0 is three units long (a merged run), record 1 one unit.
    pattern = ScatterPattern(
        np.array([0, 5 * unit]), np.array([4 * unit, 0]), np.array([3 * unit, unit])
    )
    src, dst = source_bytes(8 * unit), np.ones(8 * unit, np.uint8)
    _apply(pattern, src, dst)
    assert pattern.delivered(dst, src)
    dst[6 * unit - 1] ^= 1  # last byte of the merged record's middle unit
    assert not pattern.delivered(dst, src)
    dst[6 * unit - 1] ^= 1
    dst[: unit // 2] = 1  # half of record 1 never written
    assert not pattern.delivered(dst, src)


def _engine_on(*paths: str) -> SimpleNamespace:
    links = [SimpleNamespace(path=p) for p in paths]
    return SimpleNamespace(backend=SimpleNamespace(links=lambda: links))


def test_check_paths_refuses_to_measure_another_path() -> None:
    assert check_paths(_engine_on("tcp", "tcp"), "tcp") == ["tcp"]  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"\['samehost'\], not the 'tcp' path"):
        check_paths(_engine_on("samehost"), "tcp")  # type: ignore[arg-type]
    assert check_paths(_engine_on("samehost"), "auto") == ["samehost"]  # type: ignore[arg-type]
