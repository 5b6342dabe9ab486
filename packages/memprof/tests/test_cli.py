"""End to end through the console script: run, top, diff, flamegraph, export --pprof."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import memprof
import pytest
from conftest import WORKLOADS, run_cli
from memprof.native import find_jemalloc


def _run_workload(
    tmp_path: Path, script: str, *extra: str, env: dict[str, str] | None = None
) -> list[str]:
    out = run_cli(
        "run", "--out", str(tmp_path), "--interval", "3600", "--mean", "65536", *extra,
        "--", sys.executable, str(WORKLOADS / script), env=env,
    )  # fmt: skip
    return out.split()


def test_run_top_diff(tmp_path):
    first, second = _run_workload(tmp_path, "grow.py", "--seed", "5")
    assert Path(first).exists()  # keep=5: nothing pruned yet
    top = run_cli("top", second)
    lines = top.splitlines()
    assert "retain_bytearrays" in lines[2]  # biggest site first
    assert "retain_strings" in top
    # ~80 MiB retained at the end
    est = memprof.Snapshot.load(second).sites()[0].est_bytes
    assert 0.85 * 80e6 < est < 1.15 * 80e6
    d = run_cli("diff", first, second)
    growth = d.splitlines()[2]
    assert "retain_bytearrays" in growth
    assert "retain_strings" not in d.splitlines()[2]
    # the directory form picks the newest snapshot (the one written at exit)
    assert "retain_bytearrays" in run_cli("top", str(tmp_path), "--stacks", "1")


def test_flamegraph_is_self_contained(tmp_path):
    _, snap = _run_workload(tmp_path, "grow.py")
    out = tmp_path / "fg.html"
    run_cli("flamegraph", snap, "-o", str(out))
    page = out.read_text()
    assert "retain_bytearrays" in page
    assert "<script src" not in page
    assert "http://" not in page
    assert "https://" not in page


# ---- a protobuf reader written independently of the encoder, just for the test


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            val, i = _varint(buf, i)
        elif wire == 2:
            ln, i = _varint(buf, i)
            val, i = buf[i : i + ln], i + ln
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((field, val))
    return out


def _packed(raw: bytes) -> list[int]:
    vals, i = [], 0
    while i < len(raw):
        v, i = _varint(raw, i)
        vals.append(v)
    return vals


def test_export_pprof(tmp_path):
    _, snap_path = _run_workload(tmp_path, "grow.py")
    out = tmp_path / "p.pb.gz"
    run_cli("export", "--pprof", snap_path, "-o", str(out))
    msg = _fields(gzip.decompress(out.read_bytes()))
    strings = [v.decode() for f, v in msg if f == 6]
    assert strings[0] == ""
    types = [_fields(v) for f, v in msg if f == 1]
    assert [(strings[dict(t)[1]], strings[dict(t)[2]]) for t in types] == [
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]
    functions = {dict(_fields(v))[1]: dict(_fields(v)) for f, v in msg if f == 5}
    locations = {}
    for f, v in msg:
        if f == 4:
            loc = _fields(v)
            line = dict(_fields(dict(loc)[4]))
            assert line[1] in functions
            locations[dict(loc)[1]] = strings[functions[line[1]][2]]
    total = 0
    for f, v in msg:
        if f != 2:
            continue
        sample = _fields(v)
        locs = [x for k, raw in sample if k == 1 for x in _packed(raw)]
        values = [x for k, raw in sample if k == 2 for x in _packed(raw)]
        assert locs
        assert all(loc in locations for loc in locs)
        assert len(values) == 2
        total += values[1]
    snap = memprof.Snapshot.load(snap_path)
    assert abs(total - snap.total_bytes) < 1e-3 * snap.total_bytes + 100
    assert "retain_bytearrays" in locations.values()


def test_kill_minus_9_leaves_a_readable_snapshot(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "memprof.cli", "run", "--out", str(tmp_path), "--interval",
           "0.002", "--keep", "3", "--mean", "16384", "--",
           sys.executable, str(WORKLOADS / "kill9.py")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().strip() == "churning"  # snapshots are being written now
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.stdout.close()
    snaps = sorted(tmp_path.glob(f"memprof-{proc.pid}-*.mprof"))
    assert 1 <= len(snaps) <= 3
    snap = memprof.Snapshot.load(snaps[-1])  # complete: parses, trailer and lengths check out
    sites = {s.site.function: s.est_bytes for s in snap.sites()}
    assert sites["retain_blocks"] > 0.8 * 400 * 50_000


@pytest.mark.skipif(find_jemalloc() is None, reason="libjemalloc2 not installed (apt install "
                    "libjemalloc2, or MEMPROF_JEMALLOC=/path/libjemalloc.so.2)")  # fmt: skip
def test_native_mode_attributes_malloc_to_python_stack(tmp_path):
    env = dict(os.environ, MEMPROF_KEEP_JEMALLOC_DUMP="1")  # for the failure message
    (path,) = _run_workload(tmp_path, "native_alloc.py", "--native",
                            "--malloc-conf", "lg_prof_sample:16", env=env)  # fmt: skip
    snap = memprof.Snapshot.load(path)
    assert snap.native
    native: dict[str, float] = {}
    for s in snap.sites(kind="native"):
        native[s.site.function] = native.get(s.site.function, 0.0) + s.est_bytes
    truth = 200 * 256 * 1024
    dumps = "\n".join(p.read_text()[:3000] for p in tmp_path.glob(".jemalloc-*.last"))
    assert 0.9 * truth < native.get("native_blocks", 0) < 1.1 * truth, (native, dumps)
    top = run_cli("top", path)
    assert "native_blocks" in top.splitlines()[2]


def test_native_run_without_jemalloc_says_why(tmp_path):
    env = dict(os.environ, MEMPROF_JEMALLOC=str(tmp_path / "missing.so"))
    proc = subprocess.run(
        [sys.executable, "-m", "memprof.cli", "run", "--native", "--", sys.executable, "-c", "1"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "libjemalloc" in proc.stderr


# ---- speedscope: the file-format schema's rules (https://www.speedscope.app/file-format-schema.json)
# checked by hand (no jsonschema in the environment), plus what the schema cannot say

_UNITS = {"bytes", "microseconds", "milliseconds", "nanoseconds", "none", "seconds"}


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_speedscope_schema(doc: dict) -> None:
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    assert isinstance(doc.get("name", ""), str)
    assert _is_number(doc.get("activeProfileIndex", 0))
    assert isinstance(doc.get("exporter", ""), str)
    frames = doc["shared"]["frames"]
    assert isinstance(frames, list)
    for fr in frames:
        assert isinstance(fr["name"], str)
        assert set(fr) <= {"name", "file", "line", "col"}
        assert isinstance(fr.get("file", ""), str)
        assert _is_number(fr.get("line", 0))
    assert isinstance(doc["profiles"], list)
    assert doc["profiles"]
    for prof in doc["profiles"]:
        assert prof["type"] == "sampled"
        assert isinstance(prof["name"], str)
        assert prof["unit"] in _UNITS
        assert _is_number(prof["startValue"])
        assert _is_number(prof["endValue"])
        assert prof["endValue"] >= prof["startValue"]
        assert len(prof["samples"]) == len(prof["weights"])
        for stack in prof["samples"]:
            assert isinstance(stack, list)
            assert all(isinstance(i, int) and 0 <= i < len(frames) for i in stack)
        assert all(_is_number(w) and w >= 0 for w in prof["weights"])
        assert sum(prof["weights"]) <= prof["endValue"] - prof["startValue"] + 1e-6
    assert 0 <= doc.get("activeProfileIndex", 0) < len(doc["profiles"])


def test_export_speedscope(tmp_path):
    _, snap_path = _run_workload(tmp_path, "grow.py")
    out = tmp_path / "p.speedscope.json"
    run_cli("export", "--format", "speedscope", snap_path, "-o", str(out))
    doc = json.loads(out.read_text())
    _check_speedscope_schema(doc)
    frames = doc["shared"]["frames"]
    space, objects = doc["profiles"]
    assert (space["unit"], objects["unit"]) == ("bytes", "none")
    snap = memprof.Snapshot.load(snap_path)
    assert abs(sum(space["weights"]) - snap.total_bytes) < 1e-3 * snap.total_bytes + 100
    # root first: the biggest sample ends in the allocating function, under <module>
    biggest = max(range(len(space["weights"])), key=space["weights"].__getitem__)
    names = [frames[i]["name"] for i in space["samples"][biggest]]
    assert names[-1] == "retain_bytearrays"
    assert names[0] == "<module>"
    assert frames[space["samples"][biggest][-1]]["file"].endswith("grow.py")


def test_autostart_env_starts_memprof_in_a_child_and_its_children(tmp_path):
    """What `memprof run` execs with, for launchers of their own (a server's environment)."""
    env = memprof.autostart_env(tmp_path / "out", interval=3600, signal="none")
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("_bootstrap")
    code = (
        "import memprof, subprocess, sys; print(memprof.is_running());"
        " print(subprocess.run([sys.executable, '-c', 'import memprof;"
        " print(memprof.is_running())'], capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["True", "True"]
    assert list((tmp_path / "out").glob("memprof-*.mprof"))  # each wrote its snapshot at exit
