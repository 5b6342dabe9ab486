"""pd_serving.wheel_tags on a fake site-packages: several fixers at once leave one whole, right
WHEEL and RECORD and no temporary files; the lock is found above a start directory."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pd_serving.wheel_tags import WheelTagChange, find_lock, fix_wheel_tags

BAD_WHEEL = "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n"
LOCK = """
version = 1

[[package]]
name = "broken-tags"
version = "1.0"
wheels = [{ url = "https://example.invalid/broken_tags-1.0-py3-none-any.whl" }]
"""
FIXERS = 8


def _site(tmp_path: Path) -> Path:
    dist_info = tmp_path / "site" / "broken_tags-1.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_tags\nVersion: 1.0\n")
    (dist_info / "WHEEL").write_text(BAD_WHEEL)
    (dist_info / "WHEEL").chmod(0o644)
    (dist_info / "RECORD").write_text(
        f"{dist_info.name}/METADATA,,\n{dist_info.name}/WHEEL,sha256=stale,1\n"
        f"{dist_info.name}/RECORD,,\n"
    )
    (tmp_path / "uv.lock").write_text(LOCK)
    return dist_info


def test_fixers_at_once_leave_one_whole_file_each(tmp_path: Path) -> None:
    dist_info = _site(tmp_path)
    start = threading.Barrier(FIXERS)

    def fix() -> list[WheelTagChange]:
        start.wait()
        return fix_wheel_tags(tmp_path / "uv.lock", [str(dist_info.parent)])

    with ThreadPoolExecutor(FIXERS) as pool:
        results = list(pool.map(lambda _: fix(), range(FIXERS)))

    # Each fixer either did the change or found it done; none failed or saw a partial file.
    change = WheelTagChange("broken-tags", "1.0", ("cp312-cp312-linux_x86_64",), ("py3-none-any",))
    assert [change] in results
    assert all(r in ([], [change]) for r in results)
    wheel = (dist_info / "WHEEL").read_text()
    assert wheel == "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n"
    assert (dist_info / "WHEEL").stat().st_mode & 0o777 == 0o644
    record = (dist_info / "RECORD").read_text().splitlines()
    assert [row.split(",")[0] for row in record] == [
        f"{dist_info.name}/{name}" for name in ("METADATA", "WHEEL", "RECORD")
    ]
    assert f",{len(wheel)}" in record[1]
    assert sorted(p.name for p in dist_info.iterdir()) == ["METADATA", "RECORD", "WHEEL"]
    assert fix_wheel_tags(tmp_path / "uv.lock", [str(dist_info.parent)]) == []  # idempotent


def test_the_lock_is_found_above_a_start_directory(tmp_path: Path) -> None:
    (tmp_path / "uv.lock").write_text(LOCK)
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert find_lock([tmp_path / "elsewhere", deep]) == tmp_path / "uv.lock"
