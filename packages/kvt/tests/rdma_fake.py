"""A fake RDMA NIC for tests: the rdma path runs unchanged, only the device is simulated.

It stands in for the NIC and nothing else: memory regions with keys, RC queue pairs that connect
by QP number, RDMA WRITE (WITH_IMM) executed by a per-QP "NIC" thread as ``ctypes.memmove`` into
the peer's registered memory (both engines live in this process), and completions delivered from
a per-QP thread. What a real NIC refuses, it refuses: a scatter entry outside its lkey's region, a
remote range outside the rkey's writable region, a write to a QP in the error state (all become
failed completions), more outstanding work requests than the send queue holds, more scatter
entries or bytes per request than the limits (``post_write`` raises). ``shutdown()`` moves the QP
to the error state under the fabric lock, so no copy into or out of its memory runs after it.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from collections import deque

from kvt.rdma import MemoryKeys, QpInfo, QueuePair, RdmaDevice, WorkCompletion
from kvt.rdma_plan import DeviceLimits

_fabric_lock = threading.Lock()  # every copy and every state change: shutdown waits for copies
_mrs: dict[int, tuple[int, int, bool]] = {}  # key (lkey == rkey) -> (address, nbytes, writable)
_qps: dict[int, FakeQueuePair] = {}
_keys = itertools.count(0x100)
_qpns = itertools.count(1)


class FakeDevice(RdmaDevice):
    def __init__(
        self,
        limits: DeviceLimits | None = None,
        recv_depth: int = 8,
        name: str = "fake0",
        hold: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.hold = hold  # a stalled NIC: each work request waits for this event
        self.limits = limits or DeviceLimits(max_sge=4, max_msg_size=1 << 20, sq_depth=16)
        self.recv_depth = recv_depth
        self.registered: set[int] = set()
        self.qps: list[FakeQueuePair] = []
        self.writes = 0  # work requests executed (tests look at coalescing through it)
        self.closed = False

    def register(self, address: int, nbytes: int, writable: bool) -> MemoryKeys:
        key = next(_keys)
        with _fabric_lock:
            _mrs[key] = (address, nbytes, writable)
        self.registered.add(key)
        return MemoryKeys(key, key)

    def deregister(self, keys: MemoryKeys) -> None:
        with _fabric_lock:
            del _mrs[keys.lkey]
        self.registered.discard(keys.lkey)

    def create_qp(self) -> FakeQueuePair:
        qp = FakeQueuePair(self)
        self.qps.append(qp)
        return qp

    def close(self) -> None:
        self.closed = True


def _inside(key: int, address: int, nbytes: int, *, write: bool) -> bool:
    mr = _mrs.get(key)
    if mr is None or (write and not mr[2]):
        return False
    base, size, _ = mr
    return base <= address and address + nbytes <= base + size


class FakeQueuePair(QueuePair):
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.info = QpInfo(b"\0" * 16, 1, next(_qpns), 0, 5)
        self.state = "INIT"
        self.peer: int | None = None
        self._recvs: deque[int] = deque()
        self._sq: queue.SimpleQueue = queue.SimpleQueue()
        self._cq: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding = 0  # posted, not yet retired by a signaled completion
        self._unsignaled = 0
        self._threads: list[threading.Thread] = []
        self.closed = False
        with _fabric_lock:
            _qps[self.info.qpn] = self

    def connect(self, peer: QpInfo) -> None:
        with _fabric_lock:
            if self.state != "INIT":
                raise OSError(f"fake QP {self.info.qpn} in {self.state}, cannot connect")
            self.peer, self.state = peer.qpn, "RTS"

    def start(self, on_completion, on_thread_start) -> None:
        name = f"kvt-fakenic-{self.info.qpn}"
        self._threads = [
            threading.Thread(target=self._nic_main, name=f"{name}-sq", daemon=True),
            threading.Thread(
                target=self._cq_main, args=(on_completion, on_thread_start), name=f"{name}-cq",
                daemon=True,
            ),
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def post_write(self, wr_id, sges, remote_addr, rkey, *, imm, signaled) -> None:
        limits = self.device.limits
        if len(sges) > limits.max_sge or sum(n for _, n, _ in sges) > limits.max_msg_size:
            raise OSError(f"fake NIC: work request over the limits ({len(sges)} sge)")
        with _fabric_lock:
            if self.state != "RTS":
                raise OSError(f"fake NIC: post on a QP in {self.state}")
            if self._outstanding >= limits.sq_depth:
                raise OSError("fake NIC: send queue full (ENOMEM)")
            self._outstanding += 1
        self._sq.put((wr_id, list(sges), remote_addr, rkey, imm, signaled))

    def post_recv(self, wr_id: int) -> None:
        with _fabric_lock:
            if self.state == "ERR":
                self._cq.put(WorkCompletion(wr_id, True, False, "WR_FLUSH_ERR"))
                return
            self._recvs.append(wr_id)

    def shutdown(self) -> None:
        with _fabric_lock:
            if self.state == "ERR":
                return
            self.state = "ERR"
            flushed, self._recvs = list(self._recvs), deque()
        for wr_id in flushed:
            self._cq.put(WorkCompletion(wr_id, True, False, "WR_FLUSH_ERR"))
        self._sq.put(None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.shutdown()
        self._cq.put(None)
        for thread in self._threads:
            thread.join()
        with _fabric_lock:
            _qps.pop(self.info.qpn, None)

    # ------------------------------------------------------------ the "NIC"
    def _nic_main(self) -> None:
        while (wr := self._sq.get()) is not None:
            wr_id, sges, remote_addr, rkey, imm, signaled = wr
            if self.device.hold is not None:
                self.device.hold.wait()
            status = self._execute(sges, remote_addr, rkey, imm)
            with _fabric_lock:
                self._unsignaled += 1
                if signaled or status != "success":
                    self._outstanding -= self._unsignaled
                    self._unsignaled = 0
            if status != "success":
                self._cq.put(WorkCompletion(wr_id, False, False, status))
                with _fabric_lock:
                    self.state = "ERR"  # a failed work request takes the QP to the error state
                return
            if signaled:
                self._cq.put(WorkCompletion(wr_id, False, True, "success"))
        while (wr := self._sq.get_nowait() if not self._sq.empty() else None) is not None:
            self._cq.put(WorkCompletion(wr[0], False, False, "WR_FLUSH_ERR"))

    def _execute(self, sges, remote_addr, rkey, imm) -> str:
        total = sum(n for _, n, _ in sges)
        with _fabric_lock:
            if self.state != "RTS":
                return "WR_FLUSH_ERR"
            target = _qps.get(self.peer) if self.peer is not None else None
            if target is None or target.state != "RTS":
                return "RETRY_EXC_ERR"  # the peer's QP is gone or in error: no ack ever comes
            for address, n, lkey in sges:
                if not _inside(lkey, address, n, write=False):
                    return "LOC_PROT_ERR"
            if total and not _inside(rkey, remote_addr, total, write=True):
                target.state = "ERR"
                return "REM_ACCESS_ERR"
            if imm is not None and not target._recvs:
                return "RNR_RETRY_EXC_ERR"
            offset = 0
            for address, n, _ in sges:
                ctypes.memmove(remote_addr + offset, address, n)
                offset += n
            self.device.writes += 1
            if imm is not None:
                recv = target._recvs.popleft()
                target._cq.put(WorkCompletion(recv, True, True, "success", imm))
        return "success"

    def _cq_main(self, on_completion, on_thread_start) -> None:
        on_thread_start()
        while (wc := self._cq.get()) is not None:
            on_completion(wc)
