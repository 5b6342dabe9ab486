"""What this process's file descriptors point at (``/proc/self/fd``): for leak checks."""

from __future__ import annotations

import os
from pathlib import Path


def fd_targets() -> list[str]:
    """The target of each open descriptor (``socket:[N]``, ``/dev/shm/...``, a path)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed since listdir, or the listing's own descriptor
    return targets


def describe_sockets(targets: list[str]) -> list[str]:
    """``socket:[N]`` targets as what they connect (``tcp 127.0.0.1:A -> 127.0.0.1:B``,
    ``unix PATH``), for a leak check's message; unknown kinds stay as given."""
    inodes = {t.removeprefix("socket:[").removesuffix("]"): t for t in targets}
    found: dict[str, str] = {}
    for kind in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                found[fields[9]] = f"{kind} {_addr(fields[1])} -> {_addr(fields[2])}"
    try:
        lines = Path("/proc/self/net/unix").read_text().splitlines()[1:]
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if fields[6] in inodes:
            found[fields[6]] = f"unix {fields[7] if len(fields) > 7 else '(unnamed)'}"
    return sorted(found.get(inode, target) for inode, target in inodes.items())


def _addr(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    if len(host) == 8:  # IPv4, little-endian
        host = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return f"{host}:{int(port, 16)}"
