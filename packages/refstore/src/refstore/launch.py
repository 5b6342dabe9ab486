"""Starting a master process: ``refstore serve`` as a child, ready once it says so."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable

from . import discovery
from .errors import MasterUnavailable


def start_master_process(
    name: str = discovery.DEFAULT_NAME,
    pool_size: str | int = "1G",
    *,
    extra_args: Iterable[str] = (),
    detach: bool = False,
    env: dict[str, str] | None = None,
    prefix: Iterable[str] = (),
    disk: str | os.PathLike[str] | None = None,
    disk_size: str | int | None = None,
) -> subprocess.Popen:
    """Start ``refstore serve`` as a child process; returns once it accepts connections.

    The caller owns the process (terminate() it, or ``Client.shutdown_master()``). With ``detach``
    the master is started through a shell that exits at once, so it belongs to no one but the node
    (the returned Popen is that shell, already reaped). ``disk``, ``disk_size``: its disk tier
    (``refstore serve --disk DIR --disk-size SIZE``). Readiness is the ``ready`` line the master
    prints on stdout: a blocking read, no polling. ``prefix`` runs it under e.g. ``ip netns exec``.
    """
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "refstore.cli",
        "serve",
        "--name",
        name,
        "--size",
        str(pool_size),
        "--ready-line",
        *(() if disk is None else ("--disk", str(disk))),
        *(() if disk_size is None else ("--disk-size", str(disk_size))),
        *extra_args,
    ]
    if detach:
        cmd = ["/bin/sh", "-c", '"$@" </dev/null 2>/dev/null &', "sh", *cmd]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, start_new_session=True, env=env or os.environ.copy()
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    if detach:
        proc.wait()
    if not line.startswith(b"ready "):
        code = proc.wait()
        raise MasterUnavailable(f"refstore master {name!r} failed to start (exit {code}): {line!r}")
    return proc
