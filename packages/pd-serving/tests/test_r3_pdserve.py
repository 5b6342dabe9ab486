"""R3 through ``pdserve up --r3 --r3-routed-experts`` (1P1D of the tiny Qwen3-MoE, vLLM's
OpenAI servers, the proxy): the answer's ``kv_transfer_params["r3"]`` names D's record, which
holds the same routing as one instance computing the request alone, and the proxy's inlined
``routed_experts`` is that record, as vLLM encodes the field. Every answer adds exactly its one
record to the store (P stores none for a prefill it hands over), no hold is left on it, and P
and D hold no KV block once the requests are done."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness.pool import STARTUP_TIMEOUT_S, count_vllm_start, pdserve_up, tiny_model_dir

pytestmark = [pytest.mark.starts_vllm, pytest.mark.timeout(900)]

STORE = f"pdserve-r3-{os.getpid()}"


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def _objects(store: str) -> tuple[int, int]:
    """(objects in the store, objects a lookup's hold keeps)."""
    import refstore

    with refstore.Client(store) as client:
        stats = client.stats()
    return stats.objects, stats.held


def _idle(url: str, model: str) -> bool:
    """No request running and no KV block held (cached free blocks count as free). An idle
    instance shows its gauges as of its last step: a one-token request makes it step."""
    _post(f"{url}/v1/completions", {"model": model, "prompt": [[1]], "max_tokens": 1})
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    gauges = [
        float(v)
        for name in ("kv_cache_usage_perc", "num_requests_running")
        for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)", text, re.M)
    ]
    return bool(gauges) and not any(gauges)


def _external_tokens(url: str) -> float:
    """Prompt tokens this instance got from a KV transfer (vLLM's by-source counter)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    pattern = (
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)'
    )
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


@pytest.fixture(scope="module")
def deployment(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from pd_serving.launcher import stop_all, wait_all_ready

    model = tiny_model_dir(models_dir, "qwen3-moe")
    log_dir = tmp_path_factory.mktemp("r3-pdserve-logs")
    args = ("--prefill", "1", "--decode", "1", "--r3", STORE, "--r3-routed-experts")
    pdserve = pdserve_up(model, log_dir, *args)
    count_vllm_start("pdserve-r3", 2)
    try:
        pdserve.start()
        wait_all_ready([pdserve], STARTUP_TIMEOUT_S)
        assert pdserve.health_url is not None
        with urllib.request.urlopen(pdserve.health_url) as resp:
            health = json.load(resp)
        yield {
            "model": str(model),
            "proxy": pdserve.health_url.removesuffix("/health"),
            "prefill": health["prefill"][0]["url"],
            "decode": health["decode"][0]["url"],
        }
    finally:
        stop_all([pdserve])


def test_the_proxy_answers_with_d_record_equal_to_a_single_instance(deployment: dict) -> None:
    import refstore
    from hybrid_connector.r3 import read_record

    body = {
        "model": deployment["model"],
        "prompt": [list(range(10, 150))],
        "max_tokens": 12,
        "temperature": 0,
    }
    pulled = _external_tokens(deployment["decode"])
    objects, _ = _objects(STORE)
    got = _post(f"{deployment['proxy']}/v1/completions", body)
    assert _external_tokens(deployment["decode"]) > pulled  # D pulled the prompt's KV
    # P alone, no transfer, no hit on what it prefilled for D
    want = _post(f"{deployment['prefill']}/v1/completions", {**body, "cache_salt": "alone"})
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    ref = got["kv_transfer_params"]["r3"]
    assert ref["store"] == STORE
    assert ref["tokens"] == 140 + 12 - 1
    with refstore.Client(STORE) as client:
        rows = read_record(got["kv_transfer_params"], client)
        alone = read_record(want["kv_transfer_params"], client)
    assert rows.tobytes() == alone.tobytes()
    inline = np.load(io.BytesIO(base64.b64decode(got["choices"][0]["routed_experts"])))
    assert inline.dtype == rows.dtype
    assert inline.tobytes() == rows.tobytes()
    assert _objects(STORE) == (objects + 2, 0)  # D's record and P's own, no hold left


@pytest.mark.parametrize("dead", ["decode", "prefill"])
async def test_after_a_failover_the_record_is_still_a_single_instance_s(
    deployment: dict, dead: str
) -> None:
    """A refused D: the other D pulls P's KV and its rows; a refused P: D prefills by itself.
    Either way the answer's record is the one of a single instance computing it alone."""
    import refstore
    from harness.ports import dead_address
    from hybrid_connector.r3 import read_record
    from pd_serving.launcher import free_port
    from pd_serving.proxy import Backend, PdProxy, ProxyConfig, serve

    dead_url = f"http://{dead_address()}"
    p_urls = [dead_url] if dead == "prefill" else [deployment["prefill"]]
    d_urls = [dead_url, deployment["decode"]] if dead == "decode" else [deployment["decode"]]
    config = ProxyConfig(
        prefill=[Backend(u) for u in p_urls],
        decode=[Backend(u) for u in d_urls],
        model_names=[deployment["model"]],
        health=None,  # no active checks: the requests themselves meet the dead instance
    )
    proxy = PdProxy(config)
    port = free_port()
    objects, _ = _objects(STORE)
    runner = await serve(proxy, "127.0.0.1", port)
    bodies = [
        {
            "model": deployment["model"],
            "prompt": [list(range(20 + i, 150 + i))],
            "max_tokens": 10,
            "temperature": 0,
        }
        for i in range(2)  # round robin over two D's: one of two meets the dead one first
    ]
    try:
        # The proxy runs on this loop: the blocking calls go on a thread.
        url = f"http://127.0.0.1:{port}/v1/completions"
        got = [await asyncio.to_thread(_post, url, b) for b in bodies]
        failovers = proxy.metrics.registry.get_sample_value(
            "pdserve_failovers_total", {"stage": dead, "reason": "refused"}
        )
    finally:
        await runner.cleanup()
    assert failovers is not None
    assert failovers >= 1
    want = [
        _post(f"{deployment['prefill']}/v1/completions", {**b, "cache_salt": f"alone-{dead}"})
        for b in bodies
    ]
    with refstore.Client(STORE) as client:
        for g, w in zip(got, want, strict=True):
            assert g["choices"][0]["text"] == w["choices"][0]["text"]
            assert g["kv_transfer_params"]["r3"]["complete"] is True
            rows = read_record(g["kv_transfer_params"], client)
            assert rows.tobytes() == read_record(w["kv_transfer_params"], client).tobytes()
    assert _objects(STORE) == (objects + len(got) + len(want), 0)


def test_p_and_d_hold_no_kv_once_the_requests_are_done(deployment: dict) -> None:
    """After every test above (pulled, refused, failed over): no block held on P or D. P lets
    go of a prompt's blocks when D's pull is done (its SEND_DONE, applied at P's next step)."""
    from harness.checks import wait_for

    for role in ("prefill", "decode"):
        wait_for(
            f"{role} to hold no request and no KV block",
            lambda role=role: _idle(deployment[role], deployment["model"]),
        )
