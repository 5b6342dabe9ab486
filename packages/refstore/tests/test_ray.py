"""Refs through Ray tasks and actors. One Ray cluster for the whole module (ray.init is slow)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import refstore.ray as rsray  # noqa: E402
from refstore import Manifest, materialize  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("refstore-ray"))
    mp = pytest.MonkeyPatch()
    mp.setenv("REFSTORE_DIR", directory)
    # Under `uv run`, Ray would start its workers with `uv run` in a packaged copy of the working
    # tree: not needed here, and they never come up under `uv run --no-sync`. Ray read the
    # variable when it was imported, so the constant is set as well.
    mp.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    mp.setattr(ray._private.ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV", False)
    kwargs = {
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "runtime_env": {"env_vars": {"REFSTORE_DIR": directory}},
    }
    try:
        ray.init(**kwargs)
    except Exception as err:  # Ray allows its raylet a fixed 30 s: not always enough here
        if "timed out during startup" not in str(err):
            raise
        ray.shutdown()
        ray.init(**kwargs)
    try:
        rsray.start_masters(pool_size="64M", name="ray-test")
        yield directory
    finally:
        rsray.close_clients()
        rsray.stop_masters("ray-test")
        ray.shutdown()
        mp.undo()


@pytest.fixture
def refstore_dir(cluster, monkeypatch):  # overrides conftest: share the cluster's directory
    monkeypatch.setenv("REFSTORE_DIR", cluster)
    return cluster


@ray.remote(num_cpus=0)
def produce(n: int, seed: int):
    data = np.random.default_rng(seed).integers(0, 1 << 20, (n, 4, 2), dtype=np.int32)
    ref = rsray.client("ray-test").put({"topk": data})
    return ref, zlib.crc32(data)


@ray.remote(num_cpus=0)
class Reorganiser:
    def regroup(self, manifests):
        merged = Manifest.concat(manifests)
        return merged.sort_by_length()


@ray.remote(num_cpus=0)
class Trainer:
    def checksum_of(self, ref):
        return zlib.crc32(rsray.client("ray-test").get(ref)["topk"])

    def materialize(self, manifest):
        return materialize(manifest, client=rsray.client("ray-test")).sum(dtype=np.int64)


def test_refs_and_manifests_pass_through_tasks_and_actors(cluster):
    (ref_a, crc_a), (ref_b, crc_b) = ray.get([produce.remote(100, 0), produce.remote(50, 1)])
    trainer = Trainer.remote()
    assert ray.get(trainer.checksum_of.remote(ref_a)) == crc_a
    assert ray.get(trainer.checksum_of.remote(ref_b)) == crc_b
    manifests = [
        Manifest.from_packed(ref_a, [60, 40], dtype=np.int32, row_shape=(4, 2), key="topk"),
        Manifest.from_packed(ref_b, [50], dtype=np.int32, row_shape=(4, 2), key="topk"),
    ]
    regrouped = ray.get(Reorganiser.remote().regroup.remote(manifests))
    assert list(regrouped.length) == [60, 50, 40]
    driver = rsray.client("ray-test")
    expected = sum(int(driver.get(r)["topk"].sum(dtype=np.int64)) for r in (ref_a, ref_b))
    assert ray.get(trainer.materialize.remote(regrouped)) == expected
    driver.release([ref_a, ref_b])
    assert driver.stats().objects == 0
