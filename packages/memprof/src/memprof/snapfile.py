"""Reading memprof snapshots (format v1, written by the C core; layout in the README)."""

from __future__ import annotations

import os
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"MEMPROF\0"
TRAILER = b"MPROFEND"
VERSION = 1
KIND_PYTHON = 0
KIND_NATIVE = 1
KIND_NAMES = {KIND_PYTHON: "python", KIND_NATIVE: "native"}

_HEADER = struct.Struct("<8sIIQddQ")
_U32 = struct.Struct("<I")
_FRAME = struct.Struct("<IIi")
_STACK_HEAD = struct.Struct("<II")
_RECORD = struct.Struct("<IIQQdd")


class SnapshotFormatError(ValueError):
    """The file is not a complete memprof snapshot of a version this reader knows."""


@dataclass(frozen=True, slots=True)
class Frame:
    filename: str
    function: str
    line: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} {self.function}"


@dataclass(frozen=True, slots=True)
class Stack:
    thread_id: int
    frames: tuple[Frame, ...]  # innermost first


@dataclass(frozen=True, slots=True)
class Record:
    """Live allocations from one stack, as estimated from the samples."""

    stack_id: int
    kind: int  # KIND_PYTHON (our allocator hooks) or KIND_NATIVE (jemalloc's sampler)
    samples: int  # raw samples (0 for native: jemalloc reports unbiased counts only)
    sampled_bytes: int
    est_objects: float
    est_bytes: float


@dataclass(frozen=True, slots=True)
class SiteStat:
    site: Frame
    kind: str
    samples: int
    est_objects: float
    est_bytes: float


@dataclass(frozen=True, slots=True)
class SiteDelta:
    site: Frame
    kind: str
    before_bytes: float
    after_bytes: float
    before_objects: float
    after_objects: float

    @property
    def growth_bytes(self) -> float:
        return self.after_bytes - self.before_bytes


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    native: bool
    pid: int
    time: float
    mean: float
    native_mean: int
    stacks: tuple[Stack, ...]
    records: tuple[Record, ...]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Snapshot:
        return cls.from_bytes(Path(path).read_bytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> Snapshot:
        try:
            return _parse(memoryview(data))
        except struct.error as exc:
            raise SnapshotFormatError(f"truncated snapshot: {exc}") from exc

    @property
    def total_bytes(self) -> float:
        return sum(r.est_bytes for r in self.records)

    def stack(self, stack_id: int) -> Stack:
        return self.stacks[stack_id]

    def sites(self, *, kind: str | None = None) -> list[SiteStat]:
        """Live bytes grouped by allocation site (innermost Python frame), largest first."""
        acc: dict[tuple[Frame, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for r in self.records:
            kname = KIND_NAMES.get(r.kind, str(r.kind))
            if kind is not None and kname != kind:
                continue
            frames = self.stacks[r.stack_id].frames
            site = frames[0] if frames else Frame("<unknown>", "<unknown>", 0)
            slot = acc[(site, kname)]
            slot[0] += r.samples
            slot[1] += r.est_objects
            slot[2] += r.est_bytes
        out = [SiteStat(site, k, int(v[0]), v[1], v[2]) for (site, k), v in acc.items()]
        out.sort(key=lambda s: s.est_bytes, reverse=True)
        return out


def diff(before: Snapshot, after: Snapshot) -> list[SiteDelta]:
    """Per-site change from `before` to `after`, biggest growth first."""
    old = {(s.site, s.kind): s for s in before.sites()}
    new = {(s.site, s.kind): s for s in after.sites()}
    out = []
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        out.append(
            SiteDelta(
                site=key[0],
                kind=key[1],
                before_bytes=a.est_bytes if a else 0.0,
                after_bytes=b.est_bytes if b else 0.0,
                before_objects=a.est_objects if a else 0.0,
                after_objects=b.est_objects if b else 0.0,
            )
        )
    out.sort(key=lambda d: d.growth_bytes, reverse=True)
    return out


def _parse(buf: memoryview) -> Snapshot:
    if len(buf) < _HEADER.size + 16 or bytes(buf[:8]) != MAGIC:
        raise SnapshotFormatError("not a memprof snapshot (bad magic)")
    if bytes(buf[-16:-8]) != TRAILER or struct.unpack_from("<Q", buf, len(buf) - 8)[0] != len(buf):
        raise SnapshotFormatError(
            "incomplete memprof snapshot (trailer missing or length mismatch)"
        )
    _magic, version, flags, pid, ts, mean, native_mean = _HEADER.unpack_from(buf, 0)
    if version != VERSION:
        raise SnapshotFormatError(f"snapshot version {version}, this reader knows {VERSION}")
    off = _HEADER.size
    (n,) = _U32.unpack_from(buf, off)
    off += 4
    strings = []
    for _ in range(n):
        (ln,) = _U32.unpack_from(buf, off)
        off += 4
        strings.append(bytes(buf[off : off + ln]).decode("utf-8", "replace"))
        off += ln
    (n,) = _U32.unpack_from(buf, off)
    off += 4
    frames = []
    for file_idx, name_idx, line in _FRAME.iter_unpack(buf[off : off + n * _FRAME.size]):
        frames.append(Frame(strings[file_idx], strings[name_idx], line))
    off += n * _FRAME.size
    (n,) = _U32.unpack_from(buf, off)
    off += 4
    stacks = []
    for _ in range(n):
        tid, nf = _STACK_HEAD.unpack_from(buf, off)
        off += 8
        ids = struct.unpack_from(f"<{nf}I", buf, off)
        off += 4 * nf
        stacks.append(Stack(tid, tuple(frames[i] for i in ids)))
    (n,) = _U32.unpack_from(buf, off)
    off += 4
    records = tuple(
        Record(*fields) for fields in _RECORD.iter_unpack(buf[off : off + n * _RECORD.size])
    )
    off += n * _RECORD.size
    if off != len(buf) - 16:
        raise SnapshotFormatError("snapshot sections do not add up to the file length")
    for r in records:
        if r.stack_id >= len(stacks):
            raise SnapshotFormatError(f"record names stack {r.stack_id} of {len(stacks)}")
    return Snapshot(
        version=version,
        native=bool(flags & 1),
        pid=pid,
        time=ts,
        mean=mean,
        native_mean=native_mean,
        stacks=tuple(stacks),
        records=records,
    )


def latest_snapshot(directory: str | os.PathLike[str], pid: int | None = None) -> Path | None:
    """The newest complete snapshot in `directory` (optionally for one process)."""
    pattern = f"memprof-{pid}-*.mprof" if pid is not None else "memprof-*.mprof"
    paths = sorted(Path(directory).glob(pattern), key=lambda p: (p.stat().st_mtime, p.name))
    return paths[-1] if paths else None
