"""The whole Ray pipeline, tiny: all three R3 modes run, by value and by ref train on the same
bytes (checksums of the trainer's final layout agree), and refstore is empty afterwards."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from rl_dataflow.cli import format_table, init_ray  # noqa: E402
from rl_dataflow.pipeline import (  # noqa: E402
    PipelineConfig,
    R3Format,
    R3Mode,
    run_formats,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("REFSTORE_DIR", str(tmp_path_factory.mktemp("rl-refstore")))
    init_ray(object_store_gib=0.5)
    try:
        yield
    finally:
        ray.shutdown()
        mp.undo()


def test_three_modes_train_on_identical_recordings(cluster):
    config = PipelineConfig(
        samples=16,
        group_size=4,
        mean_len=64,
        layers=4,
        topk=4,
        hidden=64,
        micro_batch_tokens=256,
        verify=True,
    )
    steps: list[tuple[str, int]] = []
    by_format = run_formats(
        config,
        [R3Mode.OFF, R3Mode.VALUE, R3Mode.REF],
        list(R3Format),
        steps=2,
        warmup=0,  # the box is small: keep the test short
        pool_size="64M",
        overlap=[R3Mode.OFF, R3Mode.REF],
        progress=lambda label, step, outcome: steps.append((label, step)),
    )
    # Every run reported every step, rounds in order.
    assert [step for _, step in steps] == [0] * 8 + [1] * 8
    assert set(by_format) == {"torch", "numpy"}
    # R3 off records nothing: one run, shared by both formats.
    assert by_format["torch"]["off"] is by_format["numpy"]["off"]
    # Torch and numpy recordings are the same bytes: every checksum agrees across formats.
    assert by_format["torch"]["ref"]["r3_checksums"] == by_format["numpy"]["ref"]["r3_checksums"]
    for fmt, results in by_format.items():
        assert set(results) == {"off", "value", "ref", "off+overlap", "ref+overlap"}
        assert results["off"]["r3_checksums"] == results["off+overlap"]["r3_checksums"] == [0, 0]
        # Prefetched or not, by ref trains on the same bytes as by value, batch by batch.
        assert results["value"]["r3_checksums"] == results["ref"]["r3_checksums"]
        assert results["ref+overlap"]["r3_checksums"] == results["ref"]["r3_checksums"]
        assert all(results["ref"]["r3_checksums"])
        assert results["ref"]["objects_left"] == results["ref+overlap"]["objects_left"] == 0
        assert results["ref+overlap"]["memcpy_s"] > 0
        # The always-on memory profiler runs in the actors (memprof is a dependency; it works).
        assert all(step["memprof"] for r in results.values() for step in r["steps"])
        tokens = {mode: [s["tokens"] for s in r["steps"]] for mode, r in results.items()}
        assert tokens["off"] == tokens["value"] == tokens["ref"] == tokens["ref+overlap"]
        table = format_table(results, config, fmt)
        assert "by ref vs by value" in table
        assert f"as {fmt}" in table
