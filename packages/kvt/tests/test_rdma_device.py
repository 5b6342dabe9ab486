"""The rdma path on a real device (pyverbs): two engines in this process over the first device.

Skipped, with the reason, where pyverbs cannot be imported or no RDMA device exists (the
development machines: no IB in the kernel, so ibv_get_device_list fails). Where a device exists:
``uv run --frozen --no-sync pytest packages/kvt/tests/test_rdma_device.py -v -rs`` (env
``KVT_RDMA_DEVICE``, ``KVT_RDMA_PORT``, ``KVT_RDMA_GID_INDEX`` pick the device, port and GID; RoCE
usually needs the RoCE v2 GID index, see ``show_gids``).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Completions
from ipcblock import make_blocks
from kvt import TransferEngine, TransferStatus
from kvt.rdma import (
    QpInfo,
    VerbsDevice,
    load_pyverbs,
    verbs_device_names,
    verbs_qp_init_attr,
    verbs_recv_wr,
    verbs_rts_attr,
    verbs_write_wr,
)
from kvt.rdma_plan import DeviceLimits

BLOCK = 64 << 10


@pytest.fixture(scope="module")
def pyverbs():
    try:
        return load_pyverbs()
    except ImportError as exc:
        pytest.skip(str(exc) if "pyverbs not importable" in str(exc) else
                    f"pyverbs not importable: {exc}")  # fmt: skip


@pytest.fixture(scope="module")
def device_name(pyverbs) -> str:
    try:
        return verbs_device_names()[0]
    except OSError as exc:
        pytest.skip(f"no RDMA device: {exc}")


def test_work_requests_and_qp_attributes_build_with_the_installed_pyverbs(pyverbs):
    """No device needed: the objects VerbsDevice posts match this pyverbs' constructors."""
    e = pyverbs.enums
    sges = [(0x1000, 64, 5), (0x3000, 64, 5)]
    wr = verbs_write_wr(pyverbs, 7 << 32, sges, remote_addr=1 << 40, rkey=77, imm=0xFFFF_FFFF,
                        signaled=True)  # fmt: skip
    assert (wr.wr_id, wr.num_sge, wr.imm_data) == (7 << 32, 2, 0xFFFF_FFFF)
    assert wr.opcode == e.IBV_WR_RDMA_WRITE_WITH_IMM
    plain = verbs_write_wr(pyverbs, 1, sges[:1], remote_addr=0x2000, rkey=3, imm=None,
                           signaled=False)  # fmt: skip
    assert plain.opcode == e.IBV_WR_RDMA_WRITE
    assert verbs_recv_wr(pyverbs, 3, (0x1000, 64, 5)).num_sge == 1
    peer = QpInfo(bytes.fromhex("fe80" + "00" * 13 + "01"), 3, 0x1234, 99, 5)
    attr = verbs_rts_attr(pyverbs, peer, port=1, gid_index=0, mtu=4, psn=42)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn, attr.path_mtu) == (0x1234, 99, 42, 4)
    init = verbs_qp_init_attr(pyverbs, None, DeviceLimits(4, 1 << 20, 16), 8)
    assert init.sq_sig_all == 0  # only the plan's signaled requests complete
    assert (init.cap.max_send_wr, init.cap.max_recv_wr, init.cap.max_send_sge) == (16, 8, 4)


def test_device_limits_are_usable(device_name):
    device = VerbsDevice(device_name)
    try:
        limits = device.limits
        assert limits.max_sge >= 1
        assert limits.max_msg_size >= 4096
        assert limits.sq_depth >= 2
        assert device.recv_depth >= 2
    finally:
        device.close()


@pytest.mark.parametrize("n_blocks", [64, 1024])  # 4 MiB in one frame; 64 MiB in two frames
def test_two_engines_scattered_transfer_is_byte_exact_over_rdma(device_name, no_leaks, n_blocks):
    p = TransferEngine(name="P", transport="rdma", default_timeout_s=60)
    d = TransferEngine(name="D", transport="rdma", default_timeout_s=60)
    try:
        src = np.random.default_rng(0).integers(0, 256, n_blocks * BLOCK, dtype=np.uint8)
        dst = np.zeros(n_blocks * BLOCK, dtype=np.uint8)
        rs, rd = p.register_region(src), d.register_region(dst)
        rng = np.random.default_rng(1)
        src_ids, dst_ids = rng.permutation(n_blocks), rng.permutation(n_blocks)
        blocks = make_blocks(src_ids * BLOCK, dst_ids * BLOCK, BLOCK, src_region=rs, dst_region=rd)
        got_send, got_recv = Completions(), Completions()
        d.expect("dev", on_complete=got_recv)
        p.send("dev", d.data_address, blocks, last=True, on_complete=got_send)
        sent, received = got_send.wait(60), got_recv.wait(60)
        assert sent.status is TransferStatus.DONE, sent
        assert received.status is TransferStatus.DONE, received
        assert received.nbytes == n_blocks * BLOCK
        link = p.backend.link_to(d.data_address)
        assert link.path == "rdma"
        expected = np.zeros_like(dst)
        for s, t in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
            expected[t * BLOCK : (t + 1) * BLOCK] = src[s * BLOCK : (s + 1) * BLOCK]
        np.testing.assert_array_equal(dst, expected)
    finally:
        p.close()
        d.close()
