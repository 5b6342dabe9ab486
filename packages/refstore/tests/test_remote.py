"""Remote get: a ref owned by another node's master is pulled into the local pool.

Two masters on two loopback ports in this process (kvt and raw-RPC paths), and two masters in two
network namespaces joined by a veth pair (created and deleted by the test; skipped without root
or ``ip``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import uuid
import zlib

import numpy as np
import pytest
import refstore
import torch
from refstore import Client, MasterThread, start_master_process


@pytest.mark.parametrize("mode", ["kvt", "rpc"])
def test_remote_get_between_two_masters(no_leaks, mode):
    with (
        MasterThread("node-a", "32M", remote=mode) as a,
        MasterThread("node-b", "32M", remote=mode),
        Client("node-a") as ca,
        Client("node-b") as cb,
    ):
        data = np.random.default_rng(1).integers(0, 1 << 30, (3, 1 << 20), dtype=np.int32)
        ref = cb.put({"topk": data, "t": torch.arange(7)})
        assert ref.node != ca.node
        got = ca.get(pickle.loads(pickle.dumps(ref)))  # as it would arrive through Ray
        np.testing.assert_array_equal(got["topk"], data)
        assert torch.equal(got["t"], torch.arange(7))
        assert a.master.state.counters["remote_fetches"] == 1
        ca.get(ref)  # the local copy is reused, not pulled again
        assert a.master.state.counters["remote_fetches"] == 1
        ca.release(ref)  # released at its owner, and the local copy with it
        with pytest.raises(refstore.ObjectReleased):
            cb.get(ref)
        assert ca.stats().objects == 0


def test_remote_get_of_a_gone_object_says_why(no_leaks, clock):
    on_clock = {"clock": clock.monotonic, "wall_clock": clock.time}
    with (
        MasterThread("node-a", "8M", **on_clock) as a,
        MasterThread("node-b", "8M", **on_clock) as b,
        Client("node-a") as ca,
        Client("node-b") as cb,
    ):
        clock.masters += [a, b]
        ref = cb.put(b"short-lived", ttl=0.1)
        clock.advance(1.0)
        assert cb.wait_gone(ref, timeout=0)[0] == "lease expired"
        with pytest.raises(refstore.ObjectExpired):
            ca.get(ref)
        assert ca.stats().used == 0  # the room reserved for the copy was given back


def _netns_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"rsprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@contextlib.contextmanager
def _two_namespaces():
    """ns A (10.77.x.1) <-veth-> ns B (10.77.x.2); deleted on exit."""
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"rsa{tag}", f"rsb{tag}"
    subnet = f"10.77.{int(tag[:2], 16)}"
    cmds = [
        ["ip", "netns", "add", ns_a],
        ["ip", "netns", "add", ns_b],
        ["ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"],
        ["ip", "link", "set", f"va{tag}", "netns", ns_a],
        ["ip", "link", "set", f"vb{tag}", "netns", ns_b],
        ["ip", "-n", ns_a, "addr", "add", f"{subnet}.1/24", "dev", f"va{tag}"],
        ["ip", "-n", ns_b, "addr", "add", f"{subnet}.2/24", "dev", f"vb{tag}"],
        ["ip", "-n", ns_a, "link", "set", f"va{tag}", "up"],
        ["ip", "-n", ns_b, "link", "set", f"vb{tag}", "up"],
        ["ip", "-n", ns_a, "link", "set", "lo", "up"],
        ["ip", "-n", ns_b, "link", "set", "lo", "up"],
    ]
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True)
        yield (ns_a, f"{subnet}.1"), (ns_b, f"{subnet}.2")
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


NS_CLIENT = """
import pickle, sys, zlib
import numpy as np
from refstore import Client
with Client(sys.argv[1]) as c:
    if sys.argv[2] == "put":
        data = np.random.default_rng(7).integers(0, 255, 48 << 20, dtype=np.uint8)
        ref = c.put(data)
        sys.stdout.buffer.write(pickle.dumps((ref, zlib.crc32(data))))
    else:
        ref, crc = pickle.loads(sys.stdin.buffer.read())
        got = c.get(ref)
        assert zlib.crc32(got) == crc, "checksum mismatch"
        print(c.stats().remote_fetches)
"""


@pytest.mark.skipif(_netns_available() is not None, reason=str(_netns_available()))
def test_remote_get_across_network_namespaces(no_leaks):
    """Each master and its client run inside their own namespace: B's payload reaches A only
    through the veth pair (kvt over TCP between 10.77.x.2 and 10.77.x.1)."""
    with _two_namespaces() as ((ns_a, ip_a), (ns_b, ip_b)):
        procs = []
        try:
            for ns, ip, name in ((ns_a, ip_a, "ns-a"), (ns_b, ip_b, "ns-b")):
                procs.append(
                    start_master_process(
                        name,
                        "96M",
                        extra_args=["--host", ip, "--remote", "kvt"],
                        prefix=["ip", "netns", "exec", ns],
                    )
                )
            put = subprocess.run(
                ["ip", "netns", "exec", ns_b, sys.executable, "-c", NS_CLIENT, "ns-b", "put"],
                capture_output=True,
                check=True,
                timeout=120,
            )
            ref, _crc = pickle.loads(put.stdout)
            assert ref.node.startswith(ip_b)
            got = subprocess.run(
                ["ip", "netns", "exec", ns_a, sys.executable, "-c", NS_CLIENT, "ns-a", "get"],
                input=put.stdout,
                capture_output=True,
                check=False,
                timeout=120,
            )
            assert got.returncode == 0, got.stderr.decode()[-2000:]
            assert got.stdout.strip() == b"1"
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
    assert zlib.crc32(b"") == 0
