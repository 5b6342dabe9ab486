"""The client's stock of blocks reserved ahead of time, per size class, for its next puts.

A put of a size class in stock takes a block without a round trip (``putget.py``); the stock is
refilled in the background, one ``reserve`` call per several puts. Blocks of a connection that
was lost are not used (the master frees a disconnected client's unused blocks), nor blocks older
than ``RESERVATION_MAX_AGE_NS`` (the master frees unused ones after its write timeout).
"""

from __future__ import annotations

from collections import OrderedDict, deque

RESERVE_MAX_BLOCK = 16 << 20  # above this a put's round trip is small next to its copy
RESERVE_BUDGET_MAX = 64 << 20
RESERVE_DEPTH = 8  # blocks per class in stock or on their way: back-to-back puts find one ready
RESERVE_LOW = RESERVE_DEPTH // 2  # refill a class when no more than this many are left
# A reservation older than this is not used: the master frees unused ones after WRITE_TIMEOUT_S.
RESERVATION_MAX_AGE_NS = 30_000_000_000


class Reservations:
    """Blocks taken ahead of time for the next puts of each size class this client has put twice.

    Stock is refilled in batches (one ``reserve`` call per several puts) that grow with how often
    the class is put, up to ``RESERVE_DEPTH`` blocks per class and ``budget`` bytes in all.
    Pure bookkeeping, no I/O: the client calls every method under its lock (reserved blocks
    arrive on the RPC loop thread) and makes the ``reserve`` calls this asks for.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # class -> (oid, at, when it arrived (monotonic ns), the connection it was reserved on)
        self.stock: dict[int, deque[tuple[int, int, int, int]]] = {}
        self.in_flight: dict[int, int] = {}  # class -> blocks asked for, not arrived
        self.seen: OrderedDict[int, int] = OrderedDict()  # class -> puts, most recent last
        self.bytes = 0  # in stock + in flight

    def next(
        self, block: int, now_ns: int, connection: int
    ) -> tuple[tuple[int, int, int, int] | None, int]:
        """For a put of this class: (a reserved block or None, how many blocks to ask for now);
        a block is (oid, offset, when it arrived, its connection). The usual case, a class well
        in stock, is decided first and alone.

        Blocks reserved on an earlier connection are dropped, not used: the master frees a
        disconnected client's unused blocks (``state.DISCONNECT_GRACE_S``)."""
        stock = self.stock.get(block)
        while stock:
            entry = stock.popleft()
            _, _, taken, reserved_on = entry
            self.bytes -= block
            if now_ns - taken < RESERVATION_MAX_AGE_NS and reserved_on == connection:
                if len(stock) + self.in_flight.get(block, 0) > RESERVE_LOW:
                    return entry, 0
                return entry, self._wanted(block)
        return None, self._wanted(block)

    def put_back(self, block: int, entry: tuple[int, int, int, int]) -> None:
        """Return an unused block that ``next`` handed out, to be handed out first again."""
        self.stock.setdefault(block, deque()).appendleft(entry)
        self.bytes += block

    def _wanted(self, block: int) -> int:
        """Count a put of this class that found its stock low; how many blocks to ask for."""
        seen = self.seen[block] = self.seen.get(block, 0) + 1
        self.seen.move_to_end(block)
        while len(self.seen) > 64:
            self.seen.popitem(last=False)
        if block > RESERVE_MAX_BLOCK or seen < 2:
            return 0
        have = len(self.stock.get(block, ())) + self.in_flight.get(block, 0)
        if have > RESERVE_LOW:
            return 0
        # Grows with how often the class is put (counted while its stock runs low).
        count = min(RESERVE_DEPTH - have, seen, (self.budget - self.bytes) // block)
        if count <= 0:
            return 0
        self.in_flight[block] = self.in_flight.get(block, 0) + count
        self.bytes += count * block
        return count

    def arrived(
        self, block: int, asked: int, blocks: list[tuple[int, int]], now_ns: int, connection: int
    ) -> None:
        self.in_flight[block] -= asked
        self.bytes -= (asked - len(blocks)) * block
        stock = self.stock.setdefault(block, deque())
        stock.extend((oid, at, now_ns, connection) for oid, at in blocks)

    def drain(self) -> list[int]:
        """Forget every block in stock; returns their oids (to release)."""
        oids = [entry[0] for stock in self.stock.values() for entry in stock]
        for block, stock in self.stock.items():
            self.bytes -= block * len(stock)
        self.stock.clear()
        return oids
