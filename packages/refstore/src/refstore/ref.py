"""``Ref``: the handle that travels instead of the payload (pickles in well under 200 bytes)."""

from __future__ import annotations

import msgspec


class Ref(msgspec.Struct, frozen=True, array_like=True):
    """Which master instance (``pool`` epoch), which object, how big, and where to fetch it from.

    Equal refs name the same object. ``node`` is the owner master's address, used by other nodes'
    masters for remote gets. ``at`` is where the object's header sits in its pool (-1: unknown),
    which lets a local get check the header and skip the master (``header.py``).
    """

    pool: str
    oid: int
    nbytes: int
    node: str
    at: int = -1

    def __repr__(self) -> str:
        return f"Ref({self.pool}:{self.oid}, {self.nbytes} B @ {self.node})"
