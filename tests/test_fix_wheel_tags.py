""".ci/fix_wheel_tags.py on a fake site-packages: the WHEEL of a wheel whose tags contradict its
file name gets the file name's tags, uv's (hard-linked) cache copy stays as it was."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / ".ci" / "fix_wheel_tags.py"
BAD_WHEEL = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: cp312-cp312-linux_x86_64\n\n"
GOOD_WHEEL = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
LOCK = """
version = 1

[[package]]
name = "broken-tags"
version = "1.0"
wheels = [
    { url = "https://example.invalid/broken_tags-1.0-cp312-cp312-win_amd64.whl" },
    { url = "https://example.invalid/broken_tags-1.0-py3-none-any.whl" },
]

[[package]]
name = "fine-tags"
version = "2.0"
wheels = [{ url = "https://example.invalid/fine_tags-2.0-py3-none-any.whl" }]
"""


def _dist(site: Path, name: str, version: str, wheel: str) -> Path:
    dist_info = site / f"{name}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    (dist_info / "METADATA").write_text(metadata)
    (dist_info / "WHEEL").write_text(wheel)
    (dist_info / "RECORD").write_text(
        f"{dist_info.name}/METADATA,,\n{dist_info.name}/WHEEL,sha256=stale,1\n"
        f"{dist_info.name}/RECORD,,\n"
    )
    return dist_info


def _run(site: Path, lock: Path) -> str:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(lock), str(site)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout


def test_contradicting_tags_get_the_file_names_and_the_cache_keeps_its_copy(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    broken = _dist(site, "broken_tags", "1.0", BAD_WHEEL)
    fine = _dist(site, "fine_tags", "2.0", GOOD_WHEEL)
    cache_copy = tmp_path / "cache-WHEEL"
    os.link(broken / "WHEEL", cache_copy)  # uv hard-links installed files to its cache
    lock = tmp_path / "uv.lock"
    lock.write_text(LOCK)

    out = _run(site, lock)

    assert "broken-tags 1.0: WHEEL tags cp312-cp312-linux_x86_64 -> py3-none-any" in out
    wheel = (broken / "WHEEL").read_bytes()
    assert wheel == b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    digest = base64.urlsafe_b64encode(hashlib.sha256(wheel).digest()).rstrip(b"=").decode()
    assert (
        f"broken_tags-1.0.dist-info/WHEEL,sha256={digest},{len(wheel)}"
        in (broken / "RECORD").read_text().splitlines()
    )
    assert cache_copy.read_text() == BAD_WHEEL
    assert (fine / "WHEEL").read_text() == GOOD_WHEEL
    assert _run(site, lock) == ""  # idempotent
