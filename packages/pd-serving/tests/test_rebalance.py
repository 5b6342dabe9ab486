"""The rebalancing policy alone (rebalance.py), on a fake clock."""

from __future__ import annotations

from pd_serving.rebalance import DecodeLoad, RebalanceConfig, RebalancePolicy, Verdict


def _loads(**kv_streams: tuple[float, int]) -> dict[str, DecodeLoad]:
    return {k: DecodeLoad(kv_usage=kv, streams=n) for k, (kv, n) in kv_streams.items()}


def _verdicts(decisions) -> list[tuple[str, str, str]]:
    return [(d.verdict.value, d.source, d.target) for d in decisions]


def test_balanced_does_nothing() -> None:
    policy = RebalancePolicy()
    assert _verdicts(policy.decide(0.0, _loads(a=(0.5, 3), b=(0.4, 3)))) == [("balanced", "", "")]


def test_a_hot_d_gives_a_stream_to_the_coolest() -> None:
    policy = RebalancePolicy()
    loads = _loads(a=(0.9, 5), b=(0.2, 2), c=(0.1, 1))
    assert _verdicts(policy.decide(0.0, loads)) == [("migrate", "a", "c")]


def test_waiting_requests_make_a_d_hot_too() -> None:
    policy = RebalancePolicy()
    loads = {"a": DecodeLoad(0.1, waiting=6, streams=3), "b": DecodeLoad(0.1, waiting=0)}
    assert _verdicts(policy.decide(0.0, loads)) == [("migrate", "a", "b")]


def test_cooldown_then_again() -> None:
    policy = RebalancePolicy(RebalanceConfig(cooldown_s=5.0))
    loads = _loads(a=(0.9, 5), b=(0.2, 2))
    assert policy.decide(0.0, loads)[0].verdict is Verdict.MIGRATE
    assert policy.decide(2.0, loads)[0].verdict is Verdict.COOLDOWN
    assert policy.decide(5.0, loads)[0].verdict is Verdict.MIGRATE


def test_the_limit_per_interval_holds_over_all_ds() -> None:
    config = RebalanceConfig(max_per_interval=1, interval_s=10.0, cooldown_s=0.0)
    policy = RebalancePolicy(config)
    loads = _loads(a=(0.9, 5), b=(0.85, 5), c=(0.0, 0), d=(0.0, 0))
    assert _verdicts(policy.decide(0.0, loads)) == [
        ("migrate", "a", "c"),
        ("rate_limited", "b", "c"),
    ]
    assert [d.verdict for d in policy.decide(5.0, loads)] == [Verdict.RATE_LIMITED] * 2
    assert policy.decide(10.0, loads)[0].verdict is Verdict.MIGRATE


def test_hysteresis_keeps_it_hot_until_well_under() -> None:
    policy = RebalancePolicy(RebalanceConfig(kv_gap=0.3, release=0.5, cooldown_s=0.0))
    policy.decide(0.0, _loads(a=(0.7, 0), b=(0.3, 0)))  # gap 0.4: hot
    # gap 0.2: under the trigger, over the release: still hot (no stream to give)
    assert _verdicts(policy.decide(1.0, _loads(a=(0.5, 0), b=(0.3, 0)))) == [("no_stream", "a", "")]
    assert _verdicts(policy.decide(2.0, _loads(a=(0.44, 0), b=(0.3, 0)))) == [("balanced", "", "")]
    assert "a" not in policy.hot
    # gap 0.2 again: cool stays cool
    assert policy.decide(3.0, _loads(a=(0.5, 2), b=(0.3, 0)))[0].verdict is Verdict.BALANCED


def test_no_target_when_the_others_are_not_cooler_by_the_gap() -> None:
    policy = RebalancePolicy(RebalanceConfig(kv_gap=0.3))
    # a's gap over the mean of b and c is 0.35; b is only 0.1 under it, c is hot-ish but
    # the mean hides it: c is 0.7 under a.
    loads = _loads(a=(0.8, 3), b=(0.7, 1), c=(0.2, 1))
    assert _verdicts(policy.decide(0.0, loads)) == [("migrate", "a", "c")]
    policy = RebalancePolicy(RebalanceConfig(kv_gap=0.3, waiting_gap=100))
    loads = {"a": DecodeLoad(0.9, streams=2), "b": DecodeLoad(0.7), "c": DecodeLoad(0.65)}
    policy.hot.add("a")  # a hot D whose others are all within the gap of it
    assert _verdicts(policy.decide(0.0, loads)) == [("no_target", "a", "")]


def test_one_d_is_too_few() -> None:
    assert RebalancePolicy().decide(0.0, _loads(a=(1.0, 9)))[0].verdict is Verdict.TOO_FEW
