"""Export a snapshot as a gzipped pprof profile (profile.proto), encoded by hand.

Sample types: inuse_objects/count and inuse_space/bytes (estimates, already unbiased). One
location per distinct frame, one function per (name, file). A `thread` and a `kind` label per
sample. Readable by `go tool pprof` and speedscope.
"""

from __future__ import annotations

import gzip

from .snapfile import KIND_NAMES, Frame, Snapshot


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _uint(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(value) if value else b""


def _bytes(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _packed(field: int, values: list[int]) -> bytes:
    return _bytes(field, b"".join(_varint(v) for v in values)) if values else b""


class _Strings:
    def __init__(self) -> None:
        self.index: dict[str, int] = {"": 0}
        self.table: list[str] = [""]

    def __call__(self, s: str) -> int:
        idx = self.index.get(s)
        if idx is None:
            idx = self.index[s] = len(self.table)
            self.table.append(s)
        return idx


def to_pprof(snap: Snapshot) -> bytes:
    """The raw (not gzipped) Profile message."""
    strings = _Strings()
    out = bytearray()
    for type_name, unit in (("inuse_objects", "count"), ("inuse_space", "bytes")):
        out += _bytes(1, _uint(1, strings(type_name)) + _uint(2, strings(unit)))
    functions: dict[tuple[str, str], int] = {}
    locations: dict[Frame, int] = {}
    func_msgs = bytearray()
    loc_msgs = bytearray()

    def location(frame: Frame) -> int:
        loc_id = locations.get(frame)
        if loc_id is not None:
            return loc_id
        fkey = (frame.function, frame.filename)
        fn_id = functions.get(fkey)
        if fn_id is None:
            fn_id = functions[fkey] = len(functions) + 1
            name = strings(frame.function)
            msg = (
                _uint(1, fn_id)
                + _uint(2, name)
                + _uint(3, name)
                + _uint(4, strings(frame.filename))
            )
            func_msgs.extend(_bytes(5, msg))
        loc_id = locations[frame] = len(locations) + 1
        line = _uint(1, fn_id) + _uint(2, max(frame.line, 0))
        loc_msgs.extend(_bytes(4, _uint(1, loc_id) + _bytes(4, line)))
        return loc_id

    thread_key = strings("thread")
    kind_key = strings("kind")
    for rec in snap.records:
        stack = snap.stacks[rec.stack_id]
        loc_ids = [location(f) for f in stack.frames]
        values = [round(rec.est_objects), round(rec.est_bytes)]
        labels = _bytes(3, _uint(1, thread_key) + _uint(3, stack.thread_id))
        labels += _bytes(3, _uint(1, kind_key) + _uint(2, strings(KIND_NAMES.get(rec.kind, "?"))))
        out += _bytes(2, _packed(1, loc_ids) + _packed(2, values) + labels)
    out += loc_msgs
    out += func_msgs
    period_type = _bytes(11, _uint(1, strings("space")) + _uint(2, strings("bytes")))
    # the string table goes last: every strings() call above has happened by now
    for s in strings.table:
        out += _bytes(6, s.encode())
    out += _uint(9, int(snap.time * 1e9))
    out += period_type
    out += _uint(12, int(snap.mean))
    return bytes(out)


def export_pprof(snap: Snapshot, path: str) -> None:
    with gzip.open(path, "wb") as f:
        f.write(to_pprof(snap))
