"""A self-contained HTML flame graph of live bytes (no network access needed to view it).

The page embeds the snapshot's stacks, frames and records (not a pre-built tree) and builds
the tree it shows in the browser, so that each switch re-aggregates the same data:

- every frame shows its live bytes and share of the total (label and tooltip: file:line,
  bytes, share of all and of the parent, self bytes, objects);
- search (substring, or /regex/) highlights matching frames and sums the live bytes of the
  stacks that contain a match ("matched"), each stack counted once;
- views: `flame` (callers above callees, the allocating frame at the bottom), `inverted`
  (the allocating frame at the top, its callers below), `native callers` (native
  allocations only, under the Python frame that called into native code);
- `hide imports`: drops allocations made while a module was being imported (the C core flags
  stacks that have importlib's `_find_and_load` on them);
- `native`: a native (jemalloc) allocation is a `[native allocation]` frame under its Python
  caller, or folded into the caller's own bytes;
- `library frames`: shown, or folded into the user's frame that called them (the same
  user/library split as `memprof top`);
- thread filter; click to zoom, Escape or a click on the root to reset.

The state lives in the URL fragment (`#search=ones&view=inverted&imports=hide&native=fold&
lib=fold&thread=123`), so a view can be linked and a headless browser can drive it.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from .snapfile import KIND_NATIVE, Snapshot, is_library_file


def flamegraph_data(snap: Snapshot) -> dict:
    """The page's data: frames [function, file index, line, is_library], stacks [flags,
    thread, frame ids innermost first], records [stack, native?, bytes, objects]."""
    files: dict[str, int] = {}
    frames: dict[tuple[str, str, int], int] = {}
    frame_rows: list[list] = []
    stack_rows: list[list] = []
    for stack in snap.stacks:
        ids = []
        for f in stack.frames:
            key = (f.function, f.filename, f.line)
            fid = frames.get(key)
            if fid is None:
                file_id = files.setdefault(f.filename, len(files))
                fid = frames[key] = len(frame_rows)
                frame_rows.append([f.function, file_id, f.line, int(is_library_file(f.filename))])
            ids.append(fid)
        stack_rows.append([stack.flags, stack.thread_id, ids])
    records = [
        [r.stack_id, int(r.kind == KIND_NATIVE), round(r.est_bytes), round(r.est_objects)]
        for r in snap.records
        if r.est_bytes > 0
    ]
    return {
        "pid": snap.pid,
        "time": snap.time,
        "mean": snap.mean,
        "native": snap.native,
        "files": list(files),
        "frames": frame_rows,
        "stacks": stack_rows,
        "records": records,
    }


# the page (HTML, CSS and script) lives next to this module; the data goes in at @DATA@
_PAGE = (Path(__file__).parent / "flamegraph_page.html").read_text(encoding="utf-8")


def flamegraph_html(snap: Snapshot, title: str | None = None) -> str:
    title = title or f"memprof: live memory of pid {snap.pid}"
    # Every "<" escaped: "</script" would end the script element and "<!--" would change how
    # the browser parses it (a frame or file name may hold either); "\\u003c" is "<" in JSON.
    data = json.dumps(flamegraph_data(snap), separators=(",", ":")).replace("<", "\\u003c")
    head, _, tail = _PAGE.partition("@DATA@")
    title = html.escape(title)
    return head.replace("@TITLE@", title) + data + tail.replace("@TITLE@", title)
