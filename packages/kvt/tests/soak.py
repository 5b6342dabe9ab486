"""The reliability soak: many transfers under random aborts and injected faults, then checked.

Used by test_reliability.py (CI-sized) and benchmarks/bench_reliability.py (10,000), which puts
this directory on its path. Two senders and one receiver, all in this process, on one transport
("samehost" in one process still pulls with ``process_vm_readv``, from its own pid). The
transfers go in waves: each wave's requests (1-3 batches of 1-3 scattered blocks, each request
into its own destination slot) are sent in a random interleaving while two threads abort random
ones from the sender's and the receiver's side at random moments, some before the request
starts, and the senders' fault plan drops links, stalls writes and corrupts headers. When every
request of the wave has completed on both sides, each pair of completions is checked against the
rule of agreement (README, "Faults on purpose", and :func:`disagreement`), and every DONE
destination is compared byte for byte.

The abort storm (``soak(..., storm=True)``) aborts every request from both sides, the two aborts
of one request within about a millisecond of each other, without link faults: crossed aborts,
which must still name one side as the first aborter (:func:`crossed_two_answers`).
"""

from __future__ import annotations

import collections
import gc
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from fault_plans import FaultRates, RandomFaults
from ipcblock import make_blocks
from kvt.engine import Engine
from kvt.faults import FaultKind, FaultPlan
from kvt.memory import InMemoryBackend
from kvt.outcome import AbortCode, AbortOrigin, Completion
from kvt.tcp import TcpBackend

SOAK_TRANSPORTS = ("memory", "tcp", "samehost")
_BLOCK_SIZES = (4096, 16384, 65536)
_MAX_BLOCKS = 9  # 3 batches x 3 blocks
_SRC_BYTES = 4 << 20
INITIATORS = (AbortOrigin.LOCAL, AbortOrigin.TIMEOUT)
# The receiver refused its peer's input: it says PEER (the sender's fault), and so does the
# sender, told by the receiver's ABORT. The one pair where PEER meets PEER.
REFUSALS = (AbortCode.BAD_BLOCK, AbortCode.UNKNOWN_REQUEST)


def new_engine(transport: str, name: str, plan: FaultPlan | None = None, **kwargs) -> Engine:
    """An engine on ``transport`` whose backend consults ``plan`` (None: no faults)."""
    if transport in ("tcp", "samehost"):  # samehost: TCP control, payload pulled with CMA
        backend = TcpBackend(name=name, faults=plan, transport=transport)
    elif transport == "memory":
        backend = InMemoryBackend(name, faults=plan)
    else:
        raise ValueError(f"unknown transport {transport!r}")
    return Engine(backend, name=name, **kwargs)


def crossed_two_answers(send: Completion, recv: Completion) -> bool:
    """Both sides say they aborted first (LOCAL or TIMEOUT on each): two answers to "who
    aborted first", where the rule of agreement wants one."""
    return send.origin in INITIATORS and recv.origin in INITIATORS


def disagreement(
    send: Completion, recv: Completion, aborted: set[str], link_hit: bool
) -> str | None:
    """Why this pair of completions breaks the rule of agreement (None: it keeps it).

    ``aborted``: the sides ("send", "recv") the test called abort() on; ``link_hit``: a link
    fault (drop, drop-mid, corrupt header) hit the sender's link while the request was open.
    """
    if send.ok and not recv.ok:
        return "sender DONE but receiver not"
    if send.ok and recv.ok:
        return None if send.nbytes == recv.nbytes else "DONE with different byte counts"
    if recv.ok:  # the one split allowed: the link died after the receiver's DONE left
        if send.origin is AbortOrigin.TRANSPORT and link_hit:
            return None
        return f"receiver DONE, sender ABORTED({send.origin.name})"
    for c, side in ((send, "send"), (recv, "recv")):
        if c.origin is AbortOrigin.LOCAL and side not in aborted:
            return f"{side} ABORTED(LOCAL) without abort() on that side"
        if c.origin is AbortOrigin.TRANSPORT and not link_hit:
            return f"{side} ABORTED(TRANSPORT) on a link no fault hit"
    if crossed_two_answers(send, recv):
        return f"both sides say they aborted first ({send.origin.name}/{recv.origin.name})"
    if send.origin is recv.origin is AbortOrigin.PEER and send.code is recv.code in REFUSALS:
        return None
    if send.origin is AbortOrigin.PEER and recv.origin not in INITIATORS:
        return f"sender says PEER, receiver says {recv.origin.name}"
    if recv.origin is AbortOrigin.PEER and send.origin not in INITIATORS:
        return f"receiver says PEER, sender says {send.origin.name}"
    return None


@dataclass
class SoakReport:
    transport: str
    transfers: int = 0
    done: int = 0
    local_aborts: int = 0  # abort() calls made by the soak
    crossed: int = 0  # requests the soak aborted from both sides, both of which completed ABORTED
    two_answers: int = 0  # of those, both sides saying they aborted first (must be 0)
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    faults: collections.Counter = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    frames: dict[str, int] = field(default_factory=dict)  # frames the fault plan saw, by kind

    @property
    def splits(self) -> int:
        """Pairs DONE on one side, ABORTED on the other (allowed only after a link loss)."""
        return sum(n for pair, n in self.outcomes.items() if pair.count("DONE") == 1)

    def summary(self) -> str:
        rate = self.transfers / self.seconds if self.seconds else 0.0
        pairs = ", ".join(f"{k} {v}" for k, v in self.outcomes.most_common())
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return (
            f"{self.transport}: {self.transfers} transfers in {self.seconds:.1f} s "
            f"({rate:.0f}/s), {self.done} DONE on both sides, {self.local_aborts} abort() calls, "
            f"frames {self.frames}, faults: {faults}; outcomes (sender/receiver): {pairs}; "
            f"DONE/ABORTED splits: {self.splits}; crossed aborts {self.crossed}, with two "
            f"answers: {self.two_answers}; violations: {len(self.violations)}"
        )


class _Collector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: dict[tuple[str, str], list[Completion]] = collections.defaultdict(list)
        self.arrived = threading.Semaphore(0)

    def __call__(self, c: Completion) -> None:
        with self.lock:
            self.got[(c.role, c.request_id)].append(c)
        self.arrived.release()


@dataclass
class _Request:
    rid: str
    sender: int
    batches: list[np.ndarray]
    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    block: int


def soak(
    transport: str,
    transfers: int,
    *,
    seed: int = 0,
    rates: FaultRates | None = None,
    wave: int = 64,
    abort_rate: float = 0.2,
    recv_timeout_s: float = 1.0,
    send_timeout_s: float = 20.0,
    storm: bool = False,
) -> SoakReport:
    """Run ``transfers`` requests (see the module docstring); returns counts and violations.
    ``storm``: every request aborted from both sides at about the same moment, no faults."""
    plan = RandomFaults(FaultRates() if storm else rates or FaultRates(), seed=seed)
    run = _Soak(transport, plan, seed, wave, abort_rate, recv_timeout_s, send_timeout_s, storm)
    try:
        start = time.monotonic()
        for w, first in enumerate(range(0, transfers, wave)):
            reqs = [run.plan_request(f"w{w}-r{j}", j) for j in range(min(wave, transfers - first))]
            run.dst.fill(0)
            injected_before = len(plan.injected)
            aborted = run.run_wave(reqs)
            hit = {  # the senders whose link a fault hit (at the sender, or at the receiver's pull)
                i.frame.engine if i.frame.engine != "D" else i.frame.peer.partition("(")[0]
                for i in plan.injected[injected_before:]
                if i.fault.kind is not FaultKind.STALL
            }
            run.check_wave(reqs, aborted, hit)
        run.report.seconds = time.monotonic() - start
    finally:
        for engine in (*run.senders, run.receiver):
            engine.close()
    report, collector = run.report, run.collector
    gc.collect()
    refs_after = [sys.getrefcount(a) for a in (*run.srcs, run.dst)]
    if refs_after != run.refs_before:
        report.violations.append(
            f"region memory still referenced: {run.refs_before} -> {refs_after}"
        )
    with collector.lock:  # nothing more may arrive after close()
        extra = [key for key, cs in collector.got.items() if len(cs) != 1]
    report.violations.extend(f"{key}: completed more than once" for key in extra)
    for injected in plan.injected:
        report.faults[f"{injected.fault.kind.value}@{injected.frame.kind}"] += 1
    report.frames = dict(plan.seen)
    return report


class _Soak:
    """Two senders, one receiver, their regions, and what the waves found."""

    def __init__(  # noqa: PLR0917
        self, transport, plan, seed, wave, abort_rate, recv_timeout_s, send_timeout_s, storm
    ):
        self.rng = random.Random(seed)
        self.storm = storm
        self.abort_rate, self.recv_t, self.send_t = abort_rate, recv_timeout_s, send_timeout_s
        self.report = SoakReport(transport)
        self.collector = _Collector()
        self.senders = [new_engine(transport, f"P{i}", plan) for i in range(2)]
        self.receiver = new_engine(transport, "D", plan)  # faults at its pulls (samehost)
        gen = np.random.default_rng(seed)
        self.srcs = [gen.integers(0, 256, _SRC_BYTES, dtype=np.uint8) for _ in self.senders]
        self.slot = _MAX_BLOCKS * max(_BLOCK_SIZES)
        self.dst = np.zeros(wave * self.slot, dtype=np.uint8)
        # References to the region memory before kvt saw it: afterwards nothing of kvt (a view
        # held by a job, a sink, a path) may still hold one.
        self.refs_before = [sys.getrefcount(a) for a in (*self.srcs, self.dst)]
        self.src_ids = [
            s.register_region(src) for s, src in zip(self.senders, self.srcs, strict=True)
        ]
        self.dst_id = self.receiver.register_region(self.dst)

    def plan_request(self, rid: str, j: int) -> _Request:
        rng = self.rng
        sender = rng.randrange(len(self.src_ids))
        block = rng.choice(_BLOCK_SIZES)
        sizes = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
        n = sum(sizes)
        src_offsets = np.array(rng.sample(range(_SRC_BYTES // block), n), dtype=np.int64) * block
        dst_offsets = (
            j * self.slot + np.array(rng.sample(range(_MAX_BLOCKS), n), dtype=np.int64) * block
        )
        blocks = make_blocks(src_offsets, dst_offsets, block, src_region=self.src_ids[sender],
                             dst_region=self.dst_id)  # fmt: skip
        batches, at = [], 0
        for size in sizes:
            batches.append(blocks[at : at + size])
            at += size
        return _Request(rid, sender, batches, src_offsets, dst_offsets, block)

    def run_wave(self, reqs: list[_Request]) -> dict[str, set[str]]:
        """Expect, send and abort the wave's requests; returns who the soak aborted, by id."""
        rng, senders, receiver, collector = self.rng, self.senders, self.receiver, self.collector
        aborted: dict[str, set[str]] = collections.defaultdict(set)
        early: list[tuple[str, str]] = []
        victims: dict[str, list[str]] = {"send": [], "recv": []}
        for req in reqs:
            if self.storm:  # both sides, never before the start: the aborts cross
                for side in ("send", "recv"):
                    aborted[req.rid].add(side)
                    victims[side].append((side, req.rid))
            elif rng.random() < self.abort_rate:
                sides = rng.choice((("send",), ("recv",), ("send", "recv")))
                for side in sides:
                    aborted[req.rid].add(side)
                    (early if rng.random() < 0.15 else victims[side]).append((side, req.rid))
        engine_of = {"recv": lambda req: receiver, "send": lambda req: senders[req.sender]}
        by_id = {req.rid: req for req in reqs}
        self.report.local_aborts += len(early) + len(victims["send"]) + len(victims["recv"])
        for side, rid in early:  # aborted before the request started on that side
            engine_of[side](by_id[rid]).abort(rid, "soak: aborted before start")
        for req in reqs:
            peer = senders[req.sender].data_address if rng.random() < 0.5 else None
            receiver.expect(req.rid, timeout_s=self.recv_t, on_complete=collector,
                            peer_data_address=peer)  # fmt: skip
        # A random interleaving of every request's batches, each request's batches in order.
        steps = [req for req in reqs for _ in req.batches]
        rng.shuffle(steps)
        go = threading.Barrier(3)

        def send_all() -> None:
            go.wait()
            sent = collections.Counter()
            for req in steps:
                i = sent[req.rid]
                sent[req.rid] += 1
                senders[req.sender].send(
                    req.rid, receiver.data_address, req.batches[i],
                    last=i == len(req.batches) - 1, on_complete=collector if i == 0 else None,
                    timeout_s=self.send_t,
                )  # fmt: skip

        # A storm aborts in the order the requests start, close behind their first batches.
        started = list(dict.fromkeys(req.rid for req in steps))
        most_pause = 0.0003 if self.storm else 0.002

        def abort_some(side: str, seed: float) -> None:
            pace = random.Random(seed)
            order = [rid for _, rid in victims[side]]
            if self.storm:
                order.sort(key=started.index)
            else:
                pace.shuffle(order)
            pause = threading.Event()  # never set: a random pause, not a wait for anything
            go.wait()
            for rid in order:
                pause.wait(pace.uniform(0, most_pause))
                engine_of[side](by_id[rid]).abort(rid, f"soak: {side} side gave up")

        # In a storm both sides walk the same order at the same pace: each request's two aborts
        # come within about a millisecond of each other.
        pace_p = rng.random()
        pace_d = pace_p if self.storm else rng.random()
        threads = [
            threading.Thread(target=send_all, name="soak-send"),
            threading.Thread(target=abort_some, args=("send", pace_p), name="soak-abort-p"),
            threading.Thread(target=abort_some, args=("recv", pace_d), name="soak-abort-d"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + self.send_t + 10
        for _ in range(2 * len(reqs)):
            if not collector.arrived.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        return aborted

    def check_wave(self, reqs: list[_Request], aborted: dict[str, set[str]], hit: set[str]):
        report = self.report
        with self.collector.lock:
            got = {key: list(cs) for key, cs in self.collector.got.items()}
        for req in reqs:
            report.transfers += 1
            pair = []
            for role in ("send", "recv"):
                cs = got.get((role, req.rid), [])
                if len(cs) != 1:
                    report.violations.append(f"{req.rid}: {role} completed {len(cs)} times")
                pair.append(cs[0] if cs else None)
            send, recv = pair
            if send is None or recv is None:
                continue
            report.outcomes[f"{_label(send)}/{_label(recv)}"] += 1
            if aborted.get(req.rid) == {"send", "recv"} and not send.ok and not recv.ok:
                report.crossed += 1
                report.two_answers += crossed_two_answers(send, recv)
            link_hit = self.senders[req.sender].name in hit
            why = disagreement(send, recv, aborted.get(req.rid, set()), link_hit)
            if why is not None:
                report.violations.append(f"{req.rid}: {why} (sender {send}, receiver {recv})")
            if recv.ok:
                src = self.srcs[req.sender]
                for s, d in zip(req.src_offsets.tolist(), req.dst_offsets.tolist(), strict=True):
                    if not np.array_equal(self.dst[d : d + req.block], src[s : s + req.block]):
                        report.violations.append(f"{req.rid}: DONE but bytes at {d} differ")
                        break
            if send.ok and recv.ok:
                report.done += 1


def _label(c: Completion) -> str:
    return "DONE" if c.ok else c.origin.name  # type: ignore[union-attr]


__all__ = [
    "SOAK_TRANSPORTS",
    "SoakReport",
    "crossed_two_answers",
    "disagreement",
    "new_engine",
    "soak",
]
