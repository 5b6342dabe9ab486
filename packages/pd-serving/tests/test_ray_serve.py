"""1P1D on Ray Serve LLM with HybridConnector, token for token a single vLLM instance's answers.

A local Ray cluster (logical CPUs only: Ray Serve LLM reserves a placement-group bundle per
engine), ``pd_serving.ray_serve.build_pd_openai_app`` on the tiny model; the single instance it
is compared with is the session's xPyD deployment's P1 asked directly (the same model and engine
settings, no transfer). Afterwards Serve and Ray are shut down and no process the test started
is left.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from harness import shm
from harness.pool import Xpyd, count_vllm_start
from pd_serving.client import complete, exact_length_prompt, load_tokenizer
from pd_serving.launcher import free_port
from pd_serving.servers import CpuSettings

pytestmark = [
    pytest.mark.needs_vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="needs pd-serving[ray] (ray[serve])"
    ),
    # Starting Ray, two vLLM engines inside it and a third beside them on 2 cores.
    pytest.mark.timeout(900),
]

MODEL_ID = "tiny"
MAX_TOKENS = 16
# Shorter than a block, exactly one and two blocks (128 tokens), several plus a partial one.
PROMPT_TOKENS = (5, 128, 256, 300)
CPU = CpuSettings()
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}


@dataclass
class Deployed:
    pd_url: str
    single_url: str
    single_model: str
    model: Path
    decode_metrics_url: str  # HybridConnector's kvt metrics in D's worker


def _llm_config(model: Path, role: str, **connector: object) -> dict:
    from pd_serving.ray_serve import hybrid_kv_transfer_config

    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
        "accelerator_config": {"kind": "cpu"},
        "deployment_config": {"num_replicas": 1},
        "runtime_env": {"env_vars": ENGINE_ENV},
        "engine_kwargs": {
            "enforce_eager": True,
            "max_model_len": CPU.max_model_len,
            "kv_cache_memory_bytes": CPU.kv_cache_bytes,
            "max_num_seqs": CPU.max_num_seqs,
            "kv_transfer_config": hybrid_kv_transfer_config(role, **connector),
        },
    }


def _descendants() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


@pytest.fixture(scope="module")
def deployed(xpyd: Xpyd) -> Iterator[Deployed]:
    pytest.importorskip("ray.serve.llm", reason="needs pd-serving[ray]")
    import psutil
    import ray
    from pd_serving.ray_serve import build_pd_openai_app
    from ray import serve

    model = xpyd.model
    before = {p.pid for p in _descendants()}
    started: list = []
    try:
        _start_ray(ray)
        port, metrics_port = free_port(), free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_pd_openai_app(
            {
                # P's transfer_kv port: a free one, the default base may be taken here.
                "prefill_config": _llm_config(model, "prefill", rpc_port_base=free_port()),
                "decode_config": _llm_config(model, "decode", metrics_port=metrics_port),
            }
        )
        count_vllm_start("ray-serve", 2)
        serve.run(app, name="pd", route_prefix="/")  # returns once every deployment is ready
        started = [p for p in _descendants() if p.pid not in before]
        yield Deployed(
            pd_url=f"http://127.0.0.1:{port}",
            single_url=xpyd.reference_url,
            single_model=xpyd.model_name,
            model=model,
            decode_metrics_url=f"http://{ray.util.get_node_ip_address()}:{metrics_port}/metrics",
        )
    finally:
        segments: set[str] = set()
        if ray.is_initialized():
            started = started or [p for p in _descendants() if p.pid not in before]
            # Ray ends its workers with the engines in them before vLLM unlinks its shared
            # memory (and the semaphores of its locks): those are unlinked after.
            segments = shm.mapped_segments(p.pid for p in started)
            serve.shutdown()
            ray.shutdown()
        _gone, alive = psutil.wait_procs(started, timeout=60)
        leftover = [f"{p.pid} {p.name()}" for p in alive if p.is_running()]
        for proc in alive:
            proc.kill()
        shm.unlink(segments)
        assert not leftover, f"processes left after serve/ray shutdown: {leftover}"


def _start_ray(ray) -> None:
    """A local cluster. P and D reserve a bundle of 2 logical CPUs each, the ingress one:
    logical, not cores. Ray waits a fixed 30 s for its raylet to register (ray/_private/node.py,
    ``raylet_start_wait_time_s``); on this shared 2-core box that can run out, so once more."""
    # Under `uv run` (an ancestor of this process), Ray starts its workers with `uv run` in a
    # packaged copy of the working tree; under `--no-sync` they never register (the Serve
    # controller waits forever). Ray read the variable at import, so the constant too.
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    ray._private.ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    for attempt in (1, 2):
        try:
            ray.init(num_cpus=8, log_to_driver=False)
            return
        except Exception as err:
            if attempt == 2 or "timed out during startup" not in str(err):
                raise
            ray.shutdown()


async def _answers(url: str, model: str, prompts: list[str], *, stream: bool) -> list[list[int]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        outs = await asyncio.gather(
            *(
                complete(session, url, model, p, max_tokens=MAX_TOKENS, stream=stream)
                for p in prompts
            )
        )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("stream", [False, True])
def test_1p1d_on_ray_serve_is_token_identical_to_one_instance(
    deployed: Deployed, stream: bool
) -> None:
    tokenizer = load_tokenizer(deployed.model)
    seed = 100 if stream else 0
    prompts = [exact_length_prompt(tokenizer, n, seed=seed + n) for n in PROMPT_TOKENS]
    reference = asyncio.run(
        _answers(deployed.single_url, deployed.single_model, prompts, stream=stream)
    )
    got = asyncio.run(_answers(deployed.pd_url, MODEL_ID, prompts, stream=stream))
    for n, ref, out in zip(PROMPT_TOKENS, reference, got, strict=True):
        assert len(ref) == MAX_TOKENS
        assert out == ref, f"prompt of {n} tokens"


def _kvt_requests_ok(metrics_url: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvt_requests_total" and sample.labels.get("status") == "done"
    )


def test_d_pulled_the_kv_from_p(deployed: Deployed) -> None:
    """D's prompt KV came through HybridConnector (kvt counted the pull), not a recompute."""
    tokenizer = load_tokenizer(deployed.model)
    before = _kvt_requests_ok(deployed.decode_metrics_url)
    prompt = exact_length_prompt(tokenizer, 200, seed=777)
    asyncio.run(_answers(deployed.pd_url, MODEL_ID, [prompt], stream=False))
    assert _kvt_requests_ok(deployed.decode_metrics_url) == before + 1
