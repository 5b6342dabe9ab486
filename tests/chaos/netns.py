"""Network namespaces as hosts: a few ``ip netns`` "machines" on one bridge, links to cut.

``NetnsLab(["p0", "d0", "proxy"])`` is a context manager that makes one namespace per name, each
joined to a bridge in the root namespace by a veth pair, with an address on a /24 of its own
(the bridge has ``.1``, so this process reaches every host and every host reaches the others).
Processes run inside with ``lab.argv(host, [...])`` (``ip netns exec``, which execs the command:
the pid is the command's). Faults:

- ``cut(a, b)`` / ``restore(a, b)``: the network between two hosts only (a ``blackhole`` route to
  the other's address in each one's namespace, both directions; new connections fail, packets of
  open ones vanish), the rest of each host's traffic untouched. ``tc netem`` would be the usual
  tool, but this box's kernel has no netem/prio qdisc (no modules in the container).
- ``link_down(host)`` / ``link_up(host)``: the host's cable (its veth's bridge side).

Names carry a random tag (several jobs share the box); interface names stay within the kernel's
15 characters. Everything is removed on exit, whatever happened inside: processes still inside a
namespace are killed first (their owners should have stopped them: it is logged), then the
veths, the bridge and the namespaces; ``leftovers()`` says what of this lab the system still
shows (empty after exit; the tests check it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import random
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, or the kernel refuses)."""


def unavailable_reason() -> str | None:
    """Why ``NetnsLab`` cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str  # its IPv4 address on the lab's bridge
    veth: str  # the bridge side of its cable, in the root namespace


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface or route of this box uses yet."""
    used = _ip("-4", "route", "show", "table", "all") + _ip("-4", "addr")
    rng = random.Random(secrets.randbits(64))
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(100, 250)}.{rng.randrange(0, 256)}.0/24")
        if f"{net.network_address.exploded.rsplit('.', 1)[0]}." not in used:
            return net
    raise NetnsUnavailable("no free 10.x.y.0/24 subnet found")


class NetnsLab:
    """Namespaces on one bridge, owned by this object (see the module docstring)."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be unique and non-empty: {names!r}")
        self.tag = secrets.token_hex(3)
        self.bridge = f"pdc{self.tag}br"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])
        self.hosts: dict[str, Host] = {
            name: Host(
                name=name,
                netns=f"pdchaos-{self.tag}-{name}",
                address=str(addresses[i + 1]),
                veth=f"pdc{self.tag}v{i}",
            )
            for i, name in enumerate(names)
        }
        self._made_netns: list[str] = []
        self._made_links: list[str] = []
        self._cuts: set[frozenset[str]] = set()

    def __enter__(self) -> NetnsLab:
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_links.append(self.bridge)
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts.values()):
            _ip("netns", "add", host.netns)
            self._made_netns.append(host.netns)
            peer = f"pdc{self.tag}p{i}"
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            self._made_links.append(host.veth)
            _ip("link", "set", peer, "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("link", "set", "lo", "up", netns=host.netns)  # vLLM's own processes talk on lo
            _ip("link", "set", peer, "name", "eth0", netns=host.netns)
            _ip(
                "addr",
                "add",
                f"{host.address}/{self.subnet.prefixlen}",
                "dev",
                "eth0",
                netns=host.netns,
            )
            _ip("link", "set", "eth0", "up", netns=host.netns)
            # A default route: code that asks "what is my address" (a UDP connect) gets eth0's.
            _ip("route", "add", "default", "via", self.gateway, netns=host.netns)
        log.info("netns lab %s: %s on %s", self.tag, list(self.hosts), self.subnet)

    # -- processes -------------------------------------------------------------------------
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.hosts[host].netns, check=False)
        return [int(p) for p in out.split()]

    # -- faults ----------------------------------------------------------------------------
    def cut(self, a: str, b: str) -> None:
        """No packet between hosts ``a`` and ``b`` any more, either way; idempotent."""
        pair = frozenset((a, b))
        if pair in self._cuts:
            return
        self._blackhole("add", a, b)
        self._cuts.add(pair)
        log.info("netns lab %s: cut %s <-> %s", self.tag, a, b)

    def restore(self, a: str, b: str) -> None:
        pair = frozenset((a, b))
        if pair not in self._cuts:
            return
        self._blackhole("del", a, b)
        self._cuts.discard(pair)
        log.info("netns lab %s: restored %s <-> %s", self.tag, a, b)

    def _blackhole(self, action: str, a: str, b: str) -> None:
        """``ip route add|del blackhole`` of each host's address in the other's namespace."""
        for src, dst in ((a, b), (b, a)):
            _ip(
                "route",
                action,
                "blackhole",
                f"{self.hosts[dst].address}/32",
                netns=self.hosts[src].netns,
            )

    def link_down(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].veth, "down")

    def link_up(self, host: str) -> None:
        _ip("link", "set", self.hosts[host].veth, "up")

    # -- teardown --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill what still runs inside, delete links and namespaces; idempotent, never raises."""
        for netns in self._made_netns:
            out = _ip("netns", "pids", netns, check=False).split()
            if out:
                log.warning("netns %s still had processes %s at teardown; killing", netns, out)
            for pid in map(int, out):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for link in reversed(self._made_links):  # deleting a veth end deletes its peer too
            _ip("link", "del", link, check=False)
        for netns in reversed(self._made_netns):
            _ip("netns", "del", netns, check=False)
        self._made_links.clear()
        self._made_netns.clear()
        self._cuts.clear()

    def leftovers(self) -> list[str]:
        """This lab's namespaces and links the system still shows."""
        netns = _ip("netns", "list", check=False)
        links = _ip("-o", "link", check=False)
        found = [h.netns for h in self.hosts.values() if h.netns in netns]
        found += [
            name
            for name in (self.bridge, *(h.veth for h in self.hosts.values()))
            if f" {name}:" in links or f" {name}@" in links
        ]
        return found
