"""What this process's file descriptors point at (``/proc/self/fd``): for leak checks."""

from __future__ import annotations

import os


def fd_targets() -> list[str]:
    """The target of each open descriptor (``socket:[N]``, ``/dev/shm/...``, a path)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed since listdir, or the listing's own descriptor
    return targets
