"""Stages you can see: every stage observed where it belongs, labelled with the link's path, and
``engine.stats()`` consistent with the Prometheus text. Runs on every backend (``pair``).

Stage durations are checked exactly against a fake clock: ``kvt.engine`` reads time through its
``time`` module attribute, which the tests replace; the deadline timers keep the real clock.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from conftest import Completions
from ipcblock import make_blocks
from kvt import CpuLayerEvents, TransferStatus
from kvt.metrics import NO_PATH, EngineStats, quantile
from prometheus_client.parser import text_string_to_metric_families

BLOCK = 64 << 10


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr("kvt.engine.time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


def _blocks(n, rs, rd):
    ids = np.arange(n)
    return make_blocks(ids * BLOCK, ids[::-1] * BLOCK, BLOCK, src_region=rs, dst_region=rd)


def test_each_stage_observed_where_it_belongs(pair, make_engine, clock) -> None:
    p, d, _, _, rs, rd = pair
    events = CpuLayerEvents(1)
    with p.timed_stage("parse"):
        clock.now += 0.2
        blocks = _blocks(8, rs, rd)
    got_send, got_recv = Completions(), Completions()
    d.expect("s", on_complete=got_recv)
    p.send("s", d.data_address, blocks, last=True, on_complete=got_send, after=(events, 0))
    clock.now += 5.0  # the layer computes for 5 s; nothing moves meanwhile
    events.mark_ready(0)
    assert got_send.wait().ok
    assert got_recv.wait().ok

    path = p.backend.link_to(d.data_address).path  # chosen by now (the handshake is over)
    assert path == make_engine.backend.removesuffix("-fake")  # the path each variant forces
    sent = p.stats()
    assert set(sent.stages) == {
        ("parse", NO_PATH),
        ("compute_wait", path),
        ("queue", path),
        ("wire", path),
        ("notify", path),
        ("transfer", path),
    }
    assert sent.stage("parse", NO_PATH).sum_s == pytest.approx(0.2)
    assert sent.stage("compute_wait", path).count == 1
    assert sent.stage("compute_wait", path).sum_s == pytest.approx(5.0)
    # The queue stage starts when the layer is computed: the compute wait is not queueing.
    assert sent.stage("queue", path).sum_s == pytest.approx(0.0)
    assert sent.stage("transfer", path).sum_s == pytest.approx(5.0)
    assert sent.stage("notify", path).count == 1
    assert sent.bytes == {"sent": 8 * BLOCK}
    assert sent.requests == {("send", "done"): 1}
    assert sent.aborts == {}
    assert sent.active == {"send": 0}

    received = d.stats()
    assert set(received.stages) == {("recv_chunk", path), ("notify", path), ("transfer", path)}
    assert received.stage("transfer", path).sum_s == pytest.approx(5.0)
    assert received.bytes == {"received": 8 * BLOCK}
    assert received.requests == {("recv", "done"): 1}
    assert received.active == {"recv": 0}


def _text_figures(engine) -> dict:
    """The same figures as stats(), read from the Prometheus text instead."""
    out: dict = {"count": {}, "sum": {}, "bytes": {}, "requests": {}, "aborts": {}, "active": {}}
    for family in text_string_to_metric_families(engine.metrics_text().decode()):
        for s in family.samples:
            if s.name == "kvt_stage_seconds_count" and s.value:
                out["count"][(s.labels["stage"], s.labels["path"])] = int(s.value)
            elif s.name == "kvt_stage_seconds_sum" and s.value:
                out["sum"][(s.labels["stage"], s.labels["path"])] = s.value
            elif s.name == "kvt_bytes_total":
                out["bytes"][s.labels["direction"]] = int(s.value)
            elif s.name == "kvt_requests_total":
                out["requests"][(s.labels["role"], s.labels["status"])] = int(s.value)
            elif s.name == "kvt_aborts_total":
                out["aborts"][(s.labels["role"], s.labels["origin"])] = int(s.value)
            elif s.name == "kvt_active_requests":
                out["active"][s.labels["role"]] = int(s.value)
    return out


def test_snapshot_matches_the_prometheus_text(pair) -> None:
    p, d, _, _, rs, rd = pair
    for i in range(3):
        got = Completions()
        d.expect(f"ok{i}", on_complete=got)
        p.send(f"ok{i}", d.data_address, _blocks(4, rs, rd), last=True, on_complete=got)
        assert got.wait().ok
        assert got.wait().ok
    aborted = Completions()
    d.expect("gone", on_complete=aborted)
    d.abort("gone")
    assert aborted.wait().status is TransferStatus.ABORTED
    d.expect("open")  # still active when the snapshot is taken

    for engine in (p, d):
        stats = engine.stats()
        assert isinstance(stats, EngineStats)
        assert stats.engine == engine.name
        text = _text_figures(engine)
        assert {k: v.count for k, v in stats.stages.items()} == text["count"]
        for key, value in text["sum"].items():
            assert stats.stages[key].sum_s == pytest.approx(value)
            assert stats.stages[key].mean_s == pytest.approx(value / text["count"][key])
        assert stats.bytes == text["bytes"]
        assert stats.requests == text["requests"]
        assert stats.aborts == text["aborts"]
        assert stats.active == text["active"]
    assert d.stats().aborts == {("recv", "local"): 1}
    assert d.stats().requests == {("recv", "done"): 3, ("recv", "aborted"): 1}
    assert d.stats().active == {"recv": 1}
    assert p.stats().bytes["sent"] == d.stats().bytes["received"] == 3 * 4 * BLOCK
    for stage in p.stats().stages.values():
        assert stage.p50_s <= stage.p99_s


def test_quantiles_from_buckets() -> None:
    buckets = [(1.0, 0.0), (2.0, 10.0), (4.0, 20.0), (math.inf, 20.0)]
    assert quantile(0.5, buckets) == pytest.approx(2.0)
    assert quantile(0.99, buckets) == pytest.approx(2.0 + 2.0 * 9.8 / 10)
    assert quantile(0.25, buckets) == pytest.approx(1.5)
    # A rank in the +Inf bucket: the last finite bound (as Prometheus' histogram_quantile).
    assert quantile(0.99, [(1.0, 5.0), (math.inf, 10.0)]) == 1.0
    assert math.isnan(quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))


def test_snapshot_quantiles_follow_observations(pair) -> None:
    p = pair[0]
    for _ in range(99):
        p.observe_stage("parse", 0.003)  # bucket (2.5 ms, 5 ms]
    p.observe_stage("parse", 20.0)  # bucket (10 s, 30 s]
    parse = p.stats().stage("parse", NO_PATH)
    assert parse.count == 100
    assert parse.mean_s == pytest.approx((99 * 0.003 + 20.0) / 100)
    assert 0.0025 < parse.p50_s <= 0.005
    assert 0.0025 < parse.p99_s <= 0.005  # rank 99 of 100 is still in the 5 ms bucket


def test_caller_stage_hook(pair) -> None:
    p = pair[0]
    with pytest.raises(ValueError, match="caller stage"):
        p.observe_stage("wire", 1.0)
    with pytest.raises(ValueError, match="caller stage"), p.timed_stage("queue"):
        pass
    with pytest.raises(RuntimeError), p.timed_stage("parse"):
        raise RuntimeError("the parse failed")
    assert p.stats().stage("parse", NO_PATH) is None  # a failed step records no duration
    p.observe_stage("parse", 0.5, path="tcp")
    assert p.stats().stage("parse", "tcp").sum_s == 0.5
