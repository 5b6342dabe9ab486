"""A master's peer masters: which to ask, which answered, back-off. Pure logic, no I/O.

A master given peers (other nodes' masters) answers a ``lookup`` whose local run of keys stops
short by asking its peers for the **continuation** (the keys past the local run), fetching the
longest one into its own pool and storing it there as keyed objects (``master.py`` is the shell
that does the I/O; this module only decides). Time comes from the caller (``now``, the master's
clock), so back-off runs on a test's fake clock.

One peer::

                 asked by a round, answers (continuation of any length, 0 included)
               .-----.
               v     |
    (added) --> UP --'--asked, fails: no answer in time, refused, bad answer, or its
                ^       transfer failed --> DOWN (retry at now + backoff; logged, once)
                |                             |
                |                             '--retry time passes: the next round probes it
                |                                  (PROBING: one probe at a time)
                |                                    |
                '--the probe answers (logged)--------'--the probe fails --> DOWN again,
                                                         backoff doubled up to MAX_BACKOFF_S
                                                         (not logged again)

One lookup's round (``PeerRound``)::

    begin(now): asks the UP peers and the DOWN ones due a probe (none in back-off)
      --> answered(peer, run) / failed(peer, why) once per peer asked; the shell fails a
          peer that has not answered by its deadline
      --> best(): the peer with the longest continuation (ties: the one listed first);
          None when no peer had one
      --> fetched(keys, nbytes) and, if its objects could not all be moved,
          fetch_failed(why): the peer is failed as above (DOWN, back-off)

Counters per peer (``PeerStatus``): ``asked`` (rounds that asked it), ``hits`` (rounds that
fetched from it), ``keys``/``bytes`` (fetched from it), ``misses`` (it answered and nothing was
fetched from it: no continuation, or a shorter one than another peer's), ``failures``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from .protocol import PeerStatus

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class PeerState(enum.Enum):
    UP = "up"
    DOWN = "down"  # in back-off until ``retry_at``
    PROBING = "probing"  # DOWN, its retry time passed, one round is asking it


class _Peer:
    __slots__ = (
        "address",
        "asked",
        "backoff_s",
        "bytes",
        "failures",
        "hits",
        "keys",
        "last_error",
        "misses",
        "retry_at",
        "state",
    )

    def __init__(self, address: str) -> None:
        self.address = address
        self.state = PeerState.UP
        self.retry_at = 0.0
        self.backoff_s = 0.0  # 0 while UP: the next failure starts at the table's base
        self.last_error = ""
        self.asked = self.hits = self.keys = self.bytes = self.misses = self.failures = 0


class PeerTable:
    """The peers of one master, in the order they were added (which breaks ties)."""

    def __init__(
        self,
        addresses: Iterable[str] = (),
        *,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"backoff must be in (0, {max_backoff_s}], got {backoff_s}")
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._peers: dict[str, _Peer] = {}
        self.lookups = 0  # rounds begun (lookups that asked at least one peer)
        self.add(addresses)

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, address: str) -> bool:
        return address in self._peers

    @property
    def addresses(self) -> list[str]:
        return list(self._peers)

    def add(self, addresses: Iterable[str]) -> list[str]:
        """Add peers (known ones are kept as they are); returns those that are new."""
        new = []
        for address in addresses:
            if address not in self._peers:
                self._peers[address] = _Peer(address)
                new.append(address)
        return new

    def remove(self, addresses: Iterable[str]) -> list[str]:
        """Forget peers (a round still asking one ignores its answer); returns those removed."""
        return [a for a in addresses if self._peers.pop(a, None) is not None]

    def state(self, address: str) -> PeerState | None:
        peer = self._peers.get(address)
        return None if peer is None else peer.state

    def begin(self, now: float) -> PeerRound:
        """A round for one lookup: the peers to ask now (possibly none)."""
        asked = []
        for peer in self._peers.values():
            if peer.state is PeerState.DOWN and peer.retry_at <= now:
                peer.state = PeerState.PROBING
            elif peer.state is not PeerState.UP:
                continue  # in back-off, or another round's probe is out
            peer.asked += 1
            asked.append(peer.address)
        if asked:
            self.lookups += 1
        return PeerRound(self, asked, now)

    # -- what rounds report (through PeerRound) -----------------------------------------------
    def _answered(self, address: str) -> bool:
        """True if the peer was DOWN and is back (worth a log line)."""
        peer = self._peers.get(address)
        if peer is None or peer.state is PeerState.UP:
            return False
        peer.state = PeerState.UP
        peer.backoff_s = 0.0
        return True

    def _failed(self, address: str, why: str, now: float) -> bool:
        """Back off from the peer; True if it was UP (the one failure worth a log line)."""
        peer = self._peers.get(address)
        if peer is None:
            return False
        peer.failures += 1
        peer.last_error = why
        was_up = peer.state is PeerState.UP
        if was_up or not peer.backoff_s:
            peer.backoff_s = self.backoff_s
        else:
            peer.backoff_s = min(2 * peer.backoff_s, self.max_backoff_s)
        peer.retry_at = now + peer.backoff_s
        peer.state = PeerState.DOWN
        return was_up

    def _abandoned(self, address: str) -> None:
        """A round gave up on the peer for reasons of its own (the master closing): a probe
        that was out is due again, an UP peer stays UP."""
        peer = self._peers.get(address)
        if peer is not None and peer.state is PeerState.PROBING:
            peer.state = PeerState.DOWN

    def status(self, now: float) -> list[PeerStatus]:
        return [
            PeerStatus(
                address=p.address,
                state=p.state.value,
                retry_in_s=max(0.0, p.retry_at - now) if p.state is PeerState.DOWN else 0.0,
                asked=p.asked,
                hits=p.hits,
                keys=p.keys,
                bytes=p.bytes,
                misses=p.misses,
                failures=p.failures,
                last_error=p.last_error,
            )
            for p in self._peers.values()
        ]

    def totals(self) -> dict[str, int]:
        """Counters for ``Stats``: rounds, and keys and bytes fetched from all peers."""
        peers = self._peers.values()
        return {
            "peer_lookups": self.lookups,
            "peer_hits": sum(p.hits for p in peers),
            "peer_keys": sum(p.keys for p in peers),
            "peer_bytes": sum(p.bytes for p in peers),
            "peer_misses": sum(p.misses for p in peers),
            "peer_failures": sum(p.failures for p in peers),
        }


class PeerRound:
    """The peers one lookup asked and what each said (see the module docstring)."""

    def __init__(self, table: PeerTable, asked: list[str], now: float) -> None:
        self._table = table
        self.asked = asked
        self.now = now
        self.runs: dict[str, int] = {}  # peer -> length of its continuation
        self.failed_peers: dict[str, str] = {}  # peer -> why
        self.chosen: str | None = None

    @property
    def settled(self) -> bool:
        """Every peer asked has answered or failed."""
        return len(self.runs) + len(self.failed_peers) == len(self.asked)

    def _check(self, address: str) -> None:
        if address not in self.asked:
            raise ValueError(f"{address} was not asked in this round")
        if address in self.runs or address in self.failed_peers:
            raise ValueError(f"{address} already answered or failed in this round")

    def answered(self, address: str, run: int) -> bool:
        """The peer has the first ``run`` keys of the continuation; True: it is back (log)."""
        self._check(address)
        if run < 0:
            raise ValueError(f"a continuation has no negative length ({run})")
        self.runs[address] = run
        return self._table._answered(address)

    def failed(self, address: str, why: str) -> bool:
        """No usable answer from the peer; True: it was up until now (log it, once)."""
        self._check(address)
        self.failed_peers[address] = why
        return self._table._failed(address, why, self.now)

    def abandon(self) -> None:
        """The round ends before every peer asked was settled (its lookup was cancelled): the
        unsettled peers are neither failed nor answered (a probe out is due again)."""
        for address in self.asked:
            if address not in self.runs and address not in self.failed_peers:
                self._table._abandoned(address)
                self.failed_peers[address] = "abandoned"

    def best(self) -> tuple[str, int] | None:
        """The peer to fetch from: the longest continuation, ties to the one listed first (the
        order of ``asked``); None if no peer has a key of it. Counts the misses."""
        if not self.settled:
            raise ValueError("best() before every peer asked answered or failed")
        chosen = None
        for address in self.asked:
            run = self.runs.get(address, 0)
            if run and (chosen is None or run > self.runs[chosen]):
                chosen = address
        for address in self.runs:
            peer = self._table._peers.get(address)
            if peer is not None and address != chosen:
                peer.misses += 1
        self.chosen = chosen
        return None if chosen is None else (chosen, self.runs[chosen])

    def fetched(self, keys: int, nbytes: int) -> None:
        """``keys`` objects (``nbytes`` payload bytes) of the chosen peer are local now."""
        peer = self._table._peers.get(self.chosen or "")
        if peer is None:
            return
        if keys:
            peer.hits += 1
            peer.keys += keys
            peer.bytes += nbytes
        else:
            peer.misses += 1

    def fetch_failed(self, why: str, now: float) -> bool:
        """Moving the chosen peer's objects failed (all or some): the peer backs off; True: it
        was up until now (log it, once)."""
        if self.chosen is None:
            raise ValueError("fetch_failed() without a chosen peer")
        return self._table._failed(self.chosen, why, now)
