"""The disk tier's checksum: ``_fastpath.xxh64`` against XXH64's reference values (and the
system's libxxhash where there is one), and ``pread_xxh64`` (a read hashed chunk by chunk)
against reading the bytes and hashing them whole."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from refstore import _fastpath

RANGE = bytes(range(256)) * 5
REFERENCE = [  # (bytes, seed, XXH64) as the reference implementation computes them
    (b"", 0, 0xEF46DB3751D8E999),
    (b"a", 0, 0xD24EC4F1A98C6E5B),
    (b"refstore", 0, 0x304F9AF58A29B21B),
    (RANGE, 0, 0xAFC184AD7938A354),
    (RANGE, 2654435761, 0xA124E937A81C3D87),
]


@pytest.mark.parametrize(("data", "seed", "expected"), REFERENCE)
def test_xxh64_gives_the_reference_values(data, seed, expected):
    assert _fastpath.xxh64(data, seed) == expected
    assert _fastpath.xxh64(memoryview(bytearray(data))) == _fastpath.xxh64(data)


def _libxxhash():
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.XXH64.restype = ctypes.c_uint64
    lib.XXH64.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64]
    return lib


@pytest.mark.skipif(_libxxhash() is None, reason="no libxxhash on this machine")
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 2**64 - 1))
def test_xxh64_matches_libxxhash(data, seed):
    assert _fastpath.xxh64(data, seed) == _libxxhash().XXH64(data, len(data), seed)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("checksum") / "data"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, 3 << 20), length=st.integers(0, (1 << 20) + 70_000))
def test_a_hashed_read_is_the_read_then_the_hash(data_file, offset, length):
    fd, data = data_file
    dst = bytearray(length)
    got, checksum = _fastpath.pread_xxh64(fd, dst, offset)
    expected = data[offset : offset + length]
    assert got == len(expected)
    assert bytes(dst[:got]) == expected
    assert checksum == (_fastpath.xxh64(expected) if got == length else 0)


def test_a_hashed_read_of_a_bad_descriptor_raises(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: read fails with EISDIR
    try:
        with pytest.raises(OSError):
            _fastpath.pread_xxh64(fd, bytearray(10), 0)
    finally:
        os.close(fd)
    with pytest.raises(ValueError):
        _fastpath.pread_xxh64(0, bytearray(10), -1)
