"""Fault injection for developers: delay, drop or fail master operations, or kill the master.

A plan is a ``;``-separated list of rules ``OP:ACTION[=VALUE][@PROBABILITY][#COUNT]``:

- ``OP``: an operation name (``hello alloc seal reserve get release extend pin stats wait_gone
  fetch send_to read_range describe``; for keyed objects ``put_keyed`` (the allocation of a
  ``Client.put_keyed`` batch), ``seal_keyed``, ``lookup``, ``unhold``, ``subscribe_keys``,
  ``key_events``; between peer masters ``peer_lookup`` (a peer asking this master for keys)
  and ``peers``) or ``*`` for all of them; and ``hold``, which only takes ``ignore``;
- ``ACTION``: ``delay=SECONDS`` (answer late), ``drop`` (never answer: the caller times out and
  raises ``MasterUnavailable``), ``fail`` (answer with ``InjectedFault``), ``kill`` (the master
  process dies with SIGKILL, as in a crash: no cleanup, its discovery file stays behind),
  ``ignore`` (``hold:ignore``: lookups grant no holds, so an object may be evicted between a
  lookup and a get), ``cut`` (``send_to:cut``, ``read_range:cut``: this master, sending an
  object to a peer, stops mid-transfer: over kvt the link dies once the first frame's header
  and half its payload are out (kvt's TCP path; on its same-host path the requester may still
  read the object whole), over simple-rpc the read is answered with half its bytes);
- ``@P`` applies the rule with probability P (default 1), ``#N`` at most N times (default: always).

Examples: ``get:delay=0.05@0.5``, ``alloc:fail#1``, ``seal:kill#1``, ``*:drop@0.01``,
``lookup:drop#1``, ``put_keyed:fail``, ``hold:ignore``. A peer that refuses, stalls, or drops
mid-transfer, set on the peer: ``peer_lookup:fail``, ``peer_lookup:drop`` (or ``send_to:drop``
for a stall after the lookup), ``send_to:cut#1``.

``evict_keys(client, keys)`` evicts the objects bound to ``keys`` now (holds and leases
notwithstanding), for a test that loses an object between a lookup and a get.

Where to set it:
- environment variable ``REFSTORE_FAULTS`` of the master process (read at start);
- at run time from any client: ``refstore.faults.inject(client, "get:delay=0.1")``,
  ``refstore.faults.clear(client)``, ``refstore.faults.kill_master(client)``,
  ``refstore.faults.evict_keys(client, keys)``.

Faults are applied by the master before it touches its state, so a dropped or failed operation has
no effect and can be retried. ``kill`` is meant for a master running in its own process
(``refstore serve``); inside a process that also does other work it kills that process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import threading

import msgspec

from .errors import CallerError, InjectedFault

ENV_VAR = "REFSTORE_FAULTS"
ACTIONS = ("delay", "drop", "fail", "kill", "ignore", "cut")
# Actions a handler asks about (``takes``) rather than ones ``apply`` carries out before it.
HANDLER_ACTIONS = ("ignore", "cut")

log = logging.getLogger("refstore.faults")


class FaultRule(msgspec.Struct):
    op: str
    action: str
    value: float = 0.0
    probability: float = 1.0
    remaining: int = -1  # -1: unlimited


def parse(spec: str) -> list[FaultRule]:
    """Parse a plan; raises CallerError naming the bad rule."""
    rules = []
    for raw in spec.replace(",", ";").split(";"):
        text = raw.strip()
        if not text:
            continue
        try:
            op, rest = text.split(":", 1)
            count = -1
            if "#" in rest:
                rest, count_text = rest.split("#", 1)
                count = int(count_text)
            probability = 1.0
            if "@" in rest:
                rest, prob_text = rest.split("@", 1)
                probability = float(prob_text)
            action, _, value_text = rest.partition("=")
            value = float(value_text) if value_text else 0.0
        except ValueError as err:
            raise CallerError(f"bad fault rule {text!r}: {err}") from err
        if action not in ACTIONS:
            raise CallerError(f"bad fault rule {text!r}: action must be one of {ACTIONS}")
        if not 0.0 <= probability <= 1.0:
            raise CallerError(f"bad fault rule {text!r}: probability must be in [0, 1]")
        rules.append(FaultRule(op.strip(), action, value, probability, count))
    return rules


class FaultPlan:
    """The master's active rules. ``apply`` is awaited at the start of every handler."""

    def __init__(self, spec: str = "") -> None:
        self._lock = threading.Lock()
        self._rules = parse(spec)
        self._rng = random.Random()
        self._never = asyncio.Event()  # awaited by dropped calls; never set

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls(os.environ.get(ENV_VAR, ""))

    def set(self, spec: str) -> None:
        rules = parse(spec)
        with self._lock:
            self._rules = rules

    def __bool__(self) -> bool:
        return bool(self._rules)

    def ignores(self, what: str) -> bool:
        """True if an ``ignore`` rule for ``what`` (e.g. ``hold``) applies now."""
        return self.takes(what, "ignore")

    def takes(self, op: str, action: str) -> bool:
        """True if a rule ``op:action`` of a handler's own (``ignore``, ``cut``) applies now."""
        if not self._rules:
            return False
        rule = self._pick(op, action)
        if rule is not None:
            log.warning("injecting fault %s:%s", op, action)
        return rule is not None

    def _pick(self, op: str, action: str | None = None) -> FaultRule | None:
        with self._lock:
            for rule in self._rules:
                if rule.op not in (op, "*") or rule.remaining == 0:
                    continue
                if (action is None and rule.action in HANDLER_ACTIONS) or (
                    action is not None and rule.action != action
                ):
                    continue  # handler actions say what a handler does, not what fails
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                if rule.remaining > 0:
                    rule.remaining -= 1
                return rule
        return None

    async def apply(self, op: str, peer: str) -> None:
        rule = self._pick(op)
        if rule is None:
            return
        log.warning("injecting fault %s:%s on %s from %s", op, rule.action, op, peer)
        if rule.action == "delay":
            await asyncio.sleep(rule.value)
        elif rule.action == "fail":
            raise InjectedFault(f"injected failure of {op}")
        elif rule.action == "drop":
            await self._never.wait()
        elif rule.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


def inject(client: object, spec: str) -> None:
    """Replace the fault plan of the client's master (``""`` clears it)."""
    parse(spec)  # fail here, on the caller's side, for a bad spec
    client._set_faults(spec)  # type: ignore[attr-defined]


def clear(client: object) -> None:
    inject(client, "")


def kill_master(client: object) -> None:
    """Kill the client's master now (SIGKILL, no cleanup), as a crash would."""
    client._set_faults("kill!")  # type: ignore[attr-defined]


def evict_keys(client: object, keys: list[bytes]) -> None:
    """Evict the objects bound to ``keys`` now (holds and leases notwithstanding)."""
    from . import protocol

    client._link.call(protocol.EVICT_KEYS, protocol.EvictKeys(list(keys)))  # type: ignore[attr-defined]
