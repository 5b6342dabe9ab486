"""How vLLM servers are planned: which CPUs each instance's processes may use, their KV size."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest
from pd_serving.servers import (
    KV_CACHE_SPACE_ENV,
    Connector,
    CpuSettings,
    Role,
    parse_cpu_list,
    plan_servers,
)
from stand_ins import FakeUpstream


def test_cpu_lists_parse_like_vllm_bind_strings() -> None:
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("2,5-7") == {2, 5, 6, 7}
    assert parse_cpu_list("nobind") is None
    assert parse_cpu_list("auto") is None


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing is bound")
def test_p_and_d_processes_stay_on_their_workers_cores(tmp_path: Path) -> None:
    servers = plan_servers(tmp_path, log_dir=tmp_path, connector=Connector.HYBRID, single=1)
    by_role = {s.role: s for s in servers}
    last = (os.cpu_count() or 1) - 1
    # The whole P (API server, engine core, worker) on core 0, the whole D on the last core:
    # D's busy loop (waiting for KV, decoding) never runs on the core P prefills on.
    assert by_role[Role.PREFILL].cpus == {0}
    assert by_role[Role.PREFILL].env()["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert by_role[Role.DECODE].cpus == {last}
    assert by_role[Role.DECODE].env()["VLLM_CPU_OMP_THREADS_BIND"] == str(last)
    # The single instance may use the whole machine; only its worker is bound (as before).
    assert by_role[Role.SINGLE].cpus is None
    assert by_role[Role.SINGLE].make_process().cpus is None
    assert by_role[Role.PREFILL].make_process().cpus == {0}


def test_pinning_follows_an_explicit_bind_and_can_be_turned_off(tmp_path: Path) -> None:
    pinned = plan_servers(
        tmp_path, log_dir=tmp_path, connector=Connector.HYBRID, cpu=CpuSettings(cpu_bind="0-1")
    )
    assert [s.cpus for s in pinned] == [{0, 1}, {0, 1}]
    unbound = plan_servers(
        tmp_path, log_dir=tmp_path, connector=Connector.HYBRID, cpu=CpuSettings(cpu_bind="nobind")
    )
    assert [s.cpus for s in unbound] == [None, None]
    loose = plan_servers(
        tmp_path, log_dir=tmp_path, connector=Connector.HYBRID, cpu=CpuSettings(pin_processes=False)
    )
    assert [s.cpus for s in loose] == [None, None]


def test_kv_size_is_the_engine_argument_and_an_inherited_env_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # vllm-cpu lets VLLM_CPU_KVCACHE_SPACE (GiB) override --kv-cache-memory-bytes.
    kv_bytes = 48 * 1024 * 1024
    monkeypatch.delenv(KV_CACHE_SPACE_ENV, raising=False)
    servers = plan_servers(
        tmp_path,
        log_dir=tmp_path,
        connector=Connector.HYBRID,
        cpu=CpuSettings(kv_cache_bytes=kv_bytes),
    )
    for server in servers:
        argv = server.argv()
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(kv_bytes)
        assert KV_CACHE_SPACE_ENV not in server.env()
    assert not caplog.records

    monkeypatch.setenv(KV_CACHE_SPACE_ENV, "4")
    with caplog.at_level(logging.WARNING, logger="pd_serving.servers"):
        envs = {server.name: server.env() for server in servers}
    assert all(KV_CACHE_SPACE_ENV not in env for env in envs.values())
    assert os.environ[KV_CACHE_SPACE_ENV] == "4"  # this process's own stays as it was
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(warnings) == sorted(
        f"{name}: ignoring inherited {KV_CACHE_SPACE_ENV}='4'; its KV cache is "
        f"--kv-cache-memory-bytes {kv_bytes}"
        for name in envs
    )


def test_kv_events_give_each_instance_its_endpoint_and_the_proxy_its_sources(
    tmp_path: Path,
) -> None:
    from pd_serving.deploy import proxy_config_for

    extra = {"kvs": {"store": "node"}}
    servers = plan_servers(
        tmp_path,
        log_dir=tmp_path,
        connector=Connector.HYBRID,
        decode=2,
        extra_connector_config=extra,
        kv_events=True,
    )
    ports = set()
    for server in servers:
        argv = server.argv()
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert config == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{server.kv_events_port}",  # vLLM binds only a "*" endpoint
        }
        ports.add(server.kv_events_port)
    assert len(ports) == 3
    config = proxy_config_for(servers, Connector.HYBRID)
    for backend, server in zip([*config.prefill, *config.decode], servers, strict=True):
        assert backend.kv_events == f"tcp://127.0.0.1:{server.kv_events_port}"
        assert backend.kv_store == "node"
    plain = plan_servers(tmp_path, log_dir=tmp_path, connector=Connector.HYBRID)
    assert all("--kv-events-config" not in s.argv() for s in plain)
    assert all(b.kv_events is None for b in proxy_config_for(plain, Connector.HYBRID).decode)


def test_cpu_settings_reach_the_childs_environment_and_priority(tmp_path: Path) -> None:
    (server,) = plan_servers(
        tmp_path,
        log_dir=tmp_path,
        connector=Connector.HYBRID,
        prefill=1,
        decode=0,
        cpu=CpuSettings(
            cpu_bind="0-1", omp_threads=2, nice=10, omp_wait_policy="passive",
            worker_in_engine=True,
        ),
    )  # fmt: skip
    env = server.env()
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["OMP_WAIT_POLICY"] == "passive"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert server.make_process().nice == 10
    (plain,) = plan_servers(tmp_path, log_dir=tmp_path, connector=Connector.HYBRID, decode=0)
    assert "OMP_WAIT_POLICY" not in plain.env() or "OMP_WAIT_POLICY" in os.environ
    assert plain.make_process().nice == 0


async def test_the_warm_up_asks_one_token_with_logprobs_of_a_plain_server(tmp_path: Path) -> None:
    upstream = FakeUpstream("D")
    await upstream.start()
    try:
        (server,) = plan_servers(tmp_path, log_dir=tmp_path, connector=Connector.HYBRID,
                                 prefill=0, served_model_name="m")  # fmt: skip
        server.port = upstream.port
        assert server.make_process().warm_up == server.warm_up_request
        await asyncio.to_thread(server.warm_up_request)
    finally:
        await upstream.close()
    bodies = upstream.received
    # vLLM compiles its logprobs kernel on the first request asking for logprobs.
    assert bodies == [
        {"model": "m", "prompt": "warm up", "max_tokens": 1, "temperature": 0.0, "logprobs": 1}
    ]
    server.warm_up = False
    assert server.make_process().warm_up is None
    # An R3 instance would store the warm-up's record, which nobody reads.
    (r3,) = plan_servers(tmp_path, log_dir=tmp_path, connector=Connector.HYBRID, prefill=0,
                         extra_connector_config={"r3": {"store": "s"}})  # fmt: skip
    assert r3.make_process().warm_up is None
