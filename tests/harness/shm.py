"""vLLM's shared memory in /dev/shm that its killed processes leave: found before the kill from
what the processes have mapped (``/proc/PID/maps``), unlinked after it, as a crashed instance's
supervisor would (the killed processes cannot, and nothing else knows the names)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

# TP message queues and other multiprocessing shared memory, the CPU collectives, and the
# named semaphores of multiprocessing locks.
PREFIXES = ("/dev/shm/psm_", "/dev/shm/vllm_dist_", "/dev/shm/sem.mp-")


def mapped_segments(pids: Iterable[int]) -> set[str]:
    """The /dev/shm segments of vLLM (``PREFIXES``) that these processes have mapped."""
    segments = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path.startswith(PREFIXES):
                        segments.add(path)
        except (OSError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return segments


def unlink(segments: Iterable[str]) -> list[str]:
    """Unlink those of ``segments`` still there (their processes are gone); returns them."""
    left = []
    for path in segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            left.append(path)
    return sorted(left)
