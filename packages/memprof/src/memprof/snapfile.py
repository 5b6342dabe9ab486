"""Reading memprof snapshots (format v1 and v2, written by the C core; layout in the README)."""

from __future__ import annotations

import os
import re
import struct
import sysconfig
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"MEMPROF\0"
TRAILER = b"MPROFEND"
VERSION = 2
VERSIONS = (1, 2)  # v1: no per-stack flags
STACK_IN_IMPORT = 1  # allocated while a module was being imported
STACK_TRUNCATED = 2  # deeper than the C core's 64 frames: the outermost ones are missing
GROUP_USER = "user"
GROUP_INNERMOST = "innermost"
KIND_PYTHON = 0
KIND_NATIVE = 1
KIND_NAMES = {KIND_PYTHON: "python", KIND_NATIVE: "native"}

_HEADER = struct.Struct("<8sIIQddQ")
_U32 = struct.Struct("<I")
_FRAME = struct.Struct("<IIi")
_STACK_HEAD = struct.Struct("<II")
_STACK_HEAD_V2 = struct.Struct("<III")
# importlib's loader, seen in v1 snapshots (v2 has the flag from the C core)
_IMPORT_FILE = "<frozen importlib._bootstrap>"
_IMPORT_FUNCTION = "_find_and_load"
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


# Library code: the standard library and installed packages, wherever the profiled
# interpreter had them (the snapshot may be read on another machine, so by path shape as well
# as by this interpreter's own paths). `<frozen ...>` is the stdlib frozen into the
# interpreter; other `<...>` names (`<string>` of `python -c`, `<stdin>`) are the user's.
_LIBRARY_PATH = re.compile(
    r"([/\\](site|dist)-packages[/\\])|([/\\]lib(64)?[/\\](pypy|python)\d+(\.\d+)?[/\\])"
)


def _library_prefixes() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(sorted({os.path.join(paths[k], "") for k in keys if paths.get(k)}))


_LIBRARY_PREFIXES = _library_prefixes()


def is_library_file(filename: str) -> bool:
    """True for the standard library and installed packages (site-/dist-packages)."""
    if filename.startswith("<"):
        return filename.startswith("<frozen ")
    return bool(_LIBRARY_PATH.search(filename)) or filename.startswith(_LIBRARY_PREFIXES)


@dataclass(frozen=True, slots=True)
class Stack:
    thread_id: int
    frames: tuple[Frame, ...]  # innermost first
    flags: int = 0

    @property
    def in_import(self) -> bool:
        """Allocated while a module was being imported (importlib's _find_and_load below)."""
        return bool(self.flags & STACK_IN_IMPORT)

    @property
    def truncated(self) -> bool:
        return bool(self.flags & STACK_TRUNCATED)

    def site_index(self, group: str = GROUP_USER) -> int:
        """Index of the frame a report groups by: the first (innermost) frame of the user's
        code -- outside the standard library and site-packages -- or, for `innermost` or a
        stack without user code, frame 0."""
        if group == GROUP_USER:
            for i, frame in enumerate(self.frames):
                if not is_library_file(frame.filename):
                    return i
        elif group != GROUP_INNERMOST:
            raise ValueError(f"group must be {GROUP_USER!r} or {GROUP_INNERMOST!r}, got {group!r}")
        return 0

    def site_path(self, group: str = GROUP_USER, depth: int = 1) -> tuple[Frame, ...]:
        """`depth` frames from the grouping frame outward (the site, its caller, ...)."""
        if not self.frames:
            return (Frame("<unknown>", "<unknown>", 0),)
        i = self.site_index(group)
        return self.frames[i : i + max(1, depth)]


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
    path: tuple[Frame, ...] = ()  # site first, then its callers (`depth` frames)


@dataclass(frozen=True, slots=True)
class SiteDelta:
    site: Frame
    kind: str
    before_bytes: float
    after_bytes: float
    before_objects: float
    after_objects: float
    path: tuple[Frame, ...] = ()

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

    def sites(
        self, *, kind: str | None = None, group: str = GROUP_INNERMOST, depth: int = 1
    ) -> list[SiteStat]:
        """Live bytes grouped by allocation site, largest first.

        group: `innermost` (the frame that allocated) or `user` (the first frame in the
        user's code, outside the standard library and site-packages); depth: how many frames
        from there outward make up a site."""
        acc: dict[tuple[tuple[Frame, ...], str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        paths: dict[int, tuple[Frame, ...]] = {}
        for r in self.records:
            kname = KIND_NAMES.get(r.kind, str(r.kind))
            if kind is not None and kname != kind:
                continue
            path = paths.get(r.stack_id)
            if path is None:
                path = paths[r.stack_id] = self.stacks[r.stack_id].site_path(group, depth)
            slot = acc[(path, kname)]
            slot[0] += r.samples
            slot[1] += r.est_objects
            slot[2] += r.est_bytes
        out = [SiteStat(path[0], k, int(v[0]), v[1], v[2], path) for (path, k), v in acc.items()]
        out.sort(key=lambda s: s.est_bytes, reverse=True)
        return out


def diff(
    before: Snapshot, after: Snapshot, *, group: str = GROUP_INNERMOST, depth: int = 1
) -> list[SiteDelta]:
    """Per-site change from `before` to `after`, biggest growth first (grouped as sites())."""
    old = {(s.path, s.kind): s for s in before.sites(group=group, depth=depth)}
    new = {(s.path, s.kind): s for s in after.sites(group=group, depth=depth)}
    out = []
    for key in old.keys() | new.keys():
        a, b = old.get(key), new.get(key)
        out.append(
            SiteDelta(
                site=key[0][0],
                kind=key[1],
                before_bytes=a.est_bytes if a else 0.0,
                after_bytes=b.est_bytes if b else 0.0,
                before_objects=a.est_objects if a else 0.0,
                after_objects=b.est_objects if b else 0.0,
                path=key[0],
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
    if version not in VERSIONS:
        raise SnapshotFormatError(f"snapshot version {version}, this reader knows {VERSIONS}")
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
        if version >= 2:
            tid, stack_flags, nf = _STACK_HEAD_V2.unpack_from(buf, off)
            off += _STACK_HEAD_V2.size
        else:
            tid, nf = _STACK_HEAD.unpack_from(buf, off)
            off += _STACK_HEAD.size
        ids = struct.unpack_from(f"<{nf}I", buf, off)
        off += 4 * nf
        stack_frames = tuple(frames[i] for i in ids)
        if version < 2 and any(
            f.filename == _IMPORT_FILE and f.function == _IMPORT_FUNCTION for f in stack_frames
        ):
            stack_flags = STACK_IN_IMPORT
        elif version < 2:
            stack_flags = 0
        stacks.append(Stack(tid, stack_frames, stack_flags))
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
