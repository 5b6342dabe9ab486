"""Export a snapshot in speedscope's JSON file format (https://www.speedscope.app).

Spec: speedscope's `src/lib/file-format-spec.ts` (schema at
https://www.speedscope.app/file-format-schema.json). Two sampled profiles share one frame
table: live bytes (unit `bytes`) and live objects (unit `none`). Each record of the snapshot
(one stack and kind) is one sample, its frames listed root first as the format wants, with
the estimated live bytes or objects as its weight. A native (jemalloc) allocation ends in a
`[native allocation]` frame under the Python frame that called into native code.
"""

from __future__ import annotations

import json
import os

from . import __version__
from .snapfile import KIND_NATIVE, Frame, Snapshot

SCHEMA = "https://www.speedscope.app/file-format-schema.json"
NATIVE_LEAF = "[native allocation]"


def to_speedscope(snap: Snapshot, name: str | None = None) -> dict:
    frames: list[dict] = []
    index: dict[Frame | str, int] = {}

    def frame_id(frame: Frame | str) -> int:
        idx = index.get(frame)
        if idx is None:
            idx = index[frame] = len(frames)
            if isinstance(frame, Frame):
                entry: dict = {"name": frame.function, "file": frame.filename}
                if frame.line > 0:
                    entry["line"] = frame.line
            else:
                entry = {"name": frame}
            frames.append(entry)
        return idx

    samples: list[list[int]] = []
    byte_weights: list[float] = []
    object_weights: list[float] = []
    for rec in snap.records:
        stack = [frame_id(f) for f in reversed(snap.stacks[rec.stack_id].frames)]
        if rec.kind == KIND_NATIVE:
            stack.append(frame_id(NATIVE_LEAF))
        samples.append(stack)
        byte_weights.append(round(rec.est_bytes))
        object_weights.append(round(rec.est_objects))
    title = name or f"memprof: live memory of pid {snap.pid}"

    def profile(what: str, unit: str, weights: list[float]) -> dict:
        return {
            "type": "sampled",
            "name": f"{title} ({what})",
            "unit": unit,
            "startValue": 0,
            "endValue": sum(weights),
            "samples": samples,
            "weights": weights,
        }

    return {
        "$schema": SCHEMA,
        "shared": {"frames": frames},
        "profiles": [
            profile("live bytes", "bytes", byte_weights),
            profile("live objects", "none", object_weights),
        ],
        "name": title,
        "activeProfileIndex": 0,
        "exporter": f"memprof {__version__}",
    }


def export_speedscope(snap: Snapshot, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_speedscope(snap), f, separators=(",", ":"))
