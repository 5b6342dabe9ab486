"""`top`/`diff` grouping (the user's frame by default, --innermost, --depth) and the
import-time flag, on a script that allocates through numpy, a stdlib call and an import."""

from __future__ import annotations

import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import memprof
import pytest
from conftest import WORKLOADS, run_cli, run_user_sites
from memprof.native import find_jemalloc
from memprof.snapfile import is_library_file

pytest.importorskip("numpy")


@pytest.fixture(scope="module")
def snaps() -> Iterator[tuple[str, str]]:
    out = Path(tempfile.mkdtemp(prefix="memprof-test-"))  # see conftest.tmp_path
    yield run_user_sites(out)
    shutil.rmtree(out, ignore_errors=True)


def _site_lines(report: str) -> list[str]:
    return report.splitlines()[2:]


def test_top_groups_by_the_users_frame(snaps):
    lines = _site_lines(run_cli("top", snaps[1]))
    assert lines[0].endswith("user_sites.py:22 save_array"), lines  # not numpy's write_array
    assert any(ln.endswith("user_sites.py:17 load_json") for ln in lines), lines
    report = "\n".join(lines)
    assert "write_array" not in report
    assert "raw_decode" not in report


def test_top_innermost_names_the_library_frame(snaps):
    lines = _site_lines(run_cli("top", snaps[1], "--innermost"))
    assert lines[0].endswith(" write_array"), lines
    assert "site-packages/numpy/" in lines[0]
    assert any(ln.endswith(" JSONDecoder.raw_decode") for ln in lines), lines
    assert not any(ln.endswith(" save_array") for ln in lines)


def test_top_depth_adds_the_callers(snaps):
    lines = _site_lines(run_cli("top", snaps[1], "--depth", "2"))
    site, caller = lines[0].split("  <-  ")
    assert site.endswith("save_array")
    assert caller.endswith("user_sites.py:33 <module>")
    inner = _site_lines(run_cli("top", snaps[1], "--depth", "2", "--innermost"))[0]
    assert inner.split("  <-  ")[0].endswith("write_array")
    assert inner.split("  <-  ")[1].endswith(" save")  # numpy's np.save called write_array


def test_diff_groups_by_the_users_frame(snaps):
    growth = _site_lines(run_cli("diff", *snaps))
    assert growth[0].endswith("user_sites.py:22 save_array"), growth
    assert "load_json" not in "\n".join(growth)  # allocated before the first snapshot
    inner = _site_lines(run_cli("diff", *snaps, "--innermost"))
    assert inner[0].endswith(" write_array"), inner


def test_allocations_during_import_are_flagged(snaps):
    snap = memprof.Snapshot.load(snaps[1])
    table = [r for r in snap.records if "imported_table.py" in str(snap.stack(r.stack_id).frames)]
    assert table
    assert all(snap.stack(r.stack_id).in_import for r in table)
    assert sum(r.est_bytes for r in table) > 0.7 * 2000 * 4096
    for r in snap.records:
        frames = snap.stack(r.stack_id).frames
        if frames and frames[0].function in ("load_json", "save_array"):
            assert not snap.stack(r.stack_id).in_import
    assert snap.version == 2


def test_library_files():
    assert is_library_file("/usr/lib/python3.11/json/decoder.py")
    assert is_library_file("/opt/venv/lib/python3.12/site-packages/numpy/_core/numeric.py")
    assert is_library_file("/usr/lib/python3/dist-packages/yaml/__init__.py")
    assert is_library_file("<frozen importlib._bootstrap>")
    assert is_library_file(sys.modules["json"].__file__)
    assert not is_library_file("<string>")  # python -c
    assert not is_library_file("/home/me/project/train.py")
    assert not is_library_file(str(WORKLOADS / "user_sites.py"))


def test_bad_depth_is_refused(snaps):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "memprof.cli", "top", snaps[1], "--depth", "0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--depth" in proc.stderr


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc2 not installed")
def test_native_ones_is_grouped_under_its_caller(tmp_path):
    _, path = run_user_sites(tmp_path, "--native", "--malloc-conf", "lg_prof_sample:16")
    native = [ln for ln in _site_lines(run_cli("top", path)) if " native " in ln]
    assert any(ln.endswith("user_sites.py:27 make_ones") for ln in native), native
    assert not any(ln.endswith(" ones") for ln in native), native
    inner = [ln for ln in _site_lines(run_cli("top", path, "--innermost")) if " native " in ln]
    ones = [ln for ln in inner if ln.endswith(" ones")]
    assert ones, inner
    assert "numpy" in ones[0]
    assert not any(ln.endswith(" make_ones") for ln in inner), inner


def _as_v1(data: bytes) -> bytes:
    """Rewrite a v2 snapshot as v1 (no per-stack flags), the layout in the README."""
    off = struct.calcsize("<8sIIQddQ")
    out = bytearray(data[:off])
    out[8:12] = struct.pack("<I", 1)
    (n,) = struct.unpack_from("<I", data, off)
    start, off = off, off + 4
    for _ in range(n):
        (ln,) = struct.unpack_from("<I", data, off)
        off += 4 + ln
    (n,) = struct.unpack_from("<I", data, off)
    off += 4 + 12 * n
    out += data[start:off]  # strings and frames as they are
    (n,) = struct.unpack_from("<I", data, off)
    out += data[off : off + 4]
    off += 4
    for _ in range(n):
        tid, _flags, nf = struct.unpack_from("<III", data, off)
        out += struct.pack("<II", tid, nf) + data[off + 12 : off + 12 + 4 * nf]
        off += 12 + 4 * nf
    out += data[off:-8]  # records and the trailer's magic
    return bytes(out + struct.pack("<Q", len(out) + 8))


def test_v1_snapshots_still_load(snaps):
    data = Path(snaps[1]).read_bytes()
    new = memprof.Snapshot.from_bytes(data)
    old = memprof.Snapshot.from_bytes(_as_v1(data))
    assert old.version == 1
    assert [s.frames for s in old.stacks] == [s.frames for s in new.stacks]
    # v1 knows an import from importlib's frame (when the stack was not cut off above it)
    for a, b in zip(old.stacks, new.stacks, strict=True):
        if not b.truncated:
            assert a.in_import == b.in_import, b.frames
    assert old.sites(group="user")[0].site == new.sites(group="user")[0].site


def test_flame_graph_page_survives_markup_in_frame_names():
    """A frame or file name may hold "</script>" or "<!--<script>": embedded raw, either would
    change how the browser parses the page's script element (the data would be cut short)."""
    import json

    from memprof.flamegraph import flamegraph_html
    from memprof.snapfile import Frame, Record, Snapshot, Stack

    evil = "</script><!--<script>alert(1)</script>"
    stack = Stack(1, (Frame(f"/tmp/{evil}.py", f"f{evil}", 3),))
    snap = Snapshot(2, False, 1, 0.0, 1.0, 0, (stack,), (Record(0, 0, 1, 64, 1.0, 4096.0),))
    page = flamegraph_html(snap)
    data_at = page.index('{"')
    data, data_end = json.JSONDecoder().raw_decode(page, data_at)
    assert "<" not in page[data_at:data_end]  # the whole name survives, escaped
    assert evil in json.dumps(data)
