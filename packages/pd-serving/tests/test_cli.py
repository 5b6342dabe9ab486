"""The `pdserve` command line: make-model, argument errors, prompts of exact token lengths.

Tests marked ``needs_vllm`` make the tiny model (torch, transformers) or pass the check of the
``vllm`` extra; ``nox -s pd_serving`` runs the others where that extra is not installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import zmq.asyncio
from pd_serving.bench import percentile, plan_pairs
from pd_serving.cli import build_parser, main
from pd_serving.client import Completion, _top_logprobs, exact_length_prompt, load_tokenizer
from pd_serving.demo import compare
from pd_serving.launcher import ManagedProcess, free_port
from pd_serving.model import TINY_ARCHES, default_model_dir, engine_cli_args
from pd_serving.proxy import READY_LINE
from pd_serving.routing import DEFAULT_BYPASS_BELOW_TOKENS
from pd_serving.servers import Connector, CpuSettings, connector_extra, plan_servers
from stand_ins import MODEL, FakeKvPublisher, FakeUpstream


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("m") / "tiny"
    assert main(["make-model", str(target)]) == 0
    return target


@pytest.mark.needs_vllm
def test_make_model_writes_a_model_and_is_idempotent(model_dir: Path) -> None:
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "tokenizer.json").is_file()
    weights = (model_dir / "model.safetensors").read_bytes()
    assert main(["make-model", str(model_dir)]) == 0
    assert (model_dir / "model.safetensors").read_bytes() == weights


@pytest.mark.needs_vllm
@pytest.mark.parametrize("n", [1, 5, 127, 128, 129, 300, 1000])
def test_prompts_of_exact_token_length(model_dir: Path, n: int) -> None:
    tokenizer = load_tokenizer(model_dir)
    text = exact_length_prompt(tokenizer, n, seed=n)
    assert len(tokenizer.encode(text, add_special_tokens=False).ids) == n


@pytest.mark.needs_vllm
def test_up_with_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not a model directory"):
        main(["up", "--model", str(tmp_path / "nope")])


@pytest.mark.parametrize("command", ["demo", "up", "bench"])
def test_arch_defaults_to_qwen2_and_accepts_every_family(command: str) -> None:
    parser = build_parser()
    assert parser.parse_args([command]).arch == "qwen2"
    for arch in TINY_ARCHES:
        assert parser.parse_args([command, "--arch", arch]).arch == arch


def _connector_json(server) -> dict:
    argv = server.argv()
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize("command", ["demo", "up", "bench"])
def test_kvt_transport_goes_into_the_connector_config_of_p_and_d(command: str) -> None:
    parser = build_parser()
    for transport in ("auto", "tcp", "samehost"):
        args = parser.parse_args([command, "--kvt-transport", transport])
        servers = plan_servers(
            Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID,
            extra_connector_config=connector_extra(args),
        )  # fmt: skip
        for server in servers:
            extra = _connector_json(server)["kv_connector_extra_config"]
            assert extra["kvt_transport"] == transport
    # Not given: the key stays out, so the connector's own default (auto) applies.
    args = parser.parse_args([command])
    servers = plan_servers(
        Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID,
        extra_connector_config=connector_extra(args),
    )  # fmt: skip
    assert "kvt_transport" not in _connector_json(servers[0])["kv_connector_extra_config"]
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--kvt-transport", "rdma-please"])


def test_bench_compare_transports_plans_samehost_and_tcp_pairs() -> None:
    parser = build_parser()
    assert plan_pairs(parser.parse_args(["bench", "--compare-transports"])) == [
        (Connector.HYBRID, "samehost"),
        (Connector.HYBRID, "tcp"),
    ]
    assert plan_pairs(parser.parse_args(["bench", "--kvt-transport", "tcp"])) == [
        (Connector.HYBRID, "tcp")
    ]
    assert plan_pairs(parser.parse_args(["bench", "--compare"])) == [
        (Connector.HYBRID, None),
        (Connector.NIXL, None),
    ]
    # NIXL has no kvt underneath: the option does not apply to it.
    assert plan_pairs(
        parser.parse_args(["bench", "--connector", "nixl", "--kvt-transport", "tcp"])
    ) == [(Connector.NIXL, None)]


@pytest.mark.parametrize(
    "argv",
    [["bench", "--compare"], ["bench", "--connector", "nixl"], ["up", "--connector", "nixl"]],
)
def test_nixl_without_its_group_is_a_clear_error(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pd_serving import cli

    monkeypatch.setitem(sys.modules, "nixl", None)  # as if not installed: import fails
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit, match=r"uv run --group transfer-competitors pdserve"):
        cli._require_nixl(args)
    for others in (["bench"], ["bench", "--compare-transports"], ["up"], ["demo"]):
        cli._require_nixl(build_parser().parse_args(others))  # hybrid only: no NIXL needed


def test_make_model_takes_an_arch() -> None:
    args = build_parser().parse_args(["make-model", "--arch", "mla", "some/dir"])
    assert (args.arch, args.dir) == ("mla", Path("some/dir"))
    assert build_parser().parse_args(["make-model", "d"]).arch == "qwen2"
    assert {"qwen2", "mla", "gdn"} <= set(TINY_ARCHES)


def test_an_unknown_arch_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", "--arch", "mamba"])
    assert exc.value.code == 2
    assert "invalid choice: 'mamba'" in capsys.readouterr().err


def test_each_arch_has_its_own_default_model_dir() -> None:
    dirs = {default_model_dir(arch) for arch in TINY_ARCHES}
    assert len(dirs) == len(TINY_ARCHES)
    assert default_model_dir().name == "tiny-qwen2"  # where the demo always kept it


def test_servers_pass_the_arch_engine_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybrid_connector import tiny_model

    monkeypatch.setitem(
        tiny_model.TINY_ENGINE_ARGS, "mla", {"block_size": 16, "enable_prefix_caching": False}
    )
    assert engine_cli_args("mla") == ["--block-size", "16", "--no-enable-prefix-caching"]
    assert engine_cli_args("qwen2") == []
    servers = plan_servers(
        tmp_path,
        log_dir=tmp_path,
        connector=Connector.HYBRID,
        single=1,
        cpu=CpuSettings(arch="mla"),
    )
    for server in servers:
        argv = server.argv()
        assert argv[-3:] == ["--block-size", "16", "--no-enable-prefix-caching"], server.name


@pytest.mark.needs_vllm
def test_make_model_builds_the_mla_model(tmp_path: Path) -> None:
    import json

    assert main(["make-model", "--arch", "mla", str(tmp_path / "mla")]) == 0
    config = json.loads((tmp_path / "mla" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"]
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576


def test_console_script_is_installed() -> None:
    exe = shutil.which("pdserve")
    assert exe is not None
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("make-model", "up", "demo", "bench"):
        assert command in out


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 100) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


async def test_pdserve_proxy_in_front_of_running_instances(tmp_path: Path) -> None:
    """`pdserve proxy` as a real process: answers through P and D, subscribes to D's KV events,
    stops on SIGTERM."""
    p, d = FakeUpstream("P", kv_params={}), FakeUpstream("D")
    await p.start()
    await d.start()
    port = free_port()
    context = zmq.asyncio.Context()
    events = FakeKvPublisher(context, free_port())
    proc = ManagedProcess(
        "proxy",
        [
            sys.executable,
            "-m",
            "pd_serving.cli",
            "proxy",
            "--port",
            str(port),
            "--prefill",
            f"{p.url}@127.0.0.1:1",
            "--decode",
            d.url,
            "--kv-events-from",
            f"{d.url}={events.endpoint}@node",
        ],
        log_path=tmp_path / "proxy.log",
        ready_marker=READY_LINE,
        health_url=f"http://127.0.0.1:{port}/health",
    )
    try:
        proc.start()
        await asyncio.wrap_future(proc.ready)
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                # Long enough to go through P with the default bypass of short prompts.
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": MODEL, "prompt": "x " * 4 * DEFAULT_BYPASS_BELOW_TOKENS},
            ) as resp,
        ):
            assert resp.status == 200
        assert len(p.received) == 1
        assert d.received[0]["kv_transfer_params"]["remote_rpc_address"] == "127.0.0.1:1"
        await events.subscribed()
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/health") as resp,
        ):
            (decode,) = (await resp.json())["decode"]
        assert decode["kv_events"] == events.endpoint
        assert decode["kv_store"] == "node"
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGTERM)
        assert await asyncio.wait_for(asyncio.wrap_future(proc.exited), timeout=30) == 0
    finally:
        proc.stop()
        await p.close()
        await d.close()
        events.close()
        context.term()


def test_kv_events_options() -> None:
    from pd_serving.cli import _kv_event_sources, build_parser

    assert build_parser().parse_args(["up"]).kv_events is True
    assert build_parser().parse_args(["up", "--no-kv-events"]).kv_events is False
    assert _kv_event_sources(["http://d:1/=tcp://d:5557@node", "http://e:1=tcp://e:5557"]) == {
        "http://d:1": ("tcp://d:5557", "node"),
        "http://e:1": ("tcp://e:5557", None),
    }
    with pytest.raises(SystemExit, match="URL=tcp://HOST:PORT"):
        _kv_event_sources(["http://d:1=d:5557"])


def _completion(ids: list[int], tops: list[dict[int, float]]) -> Completion:
    return Completion(text="".join(map(str, ids)), token_ids=ids, top_logprobs=tops)


def test_demo_compare_allows_a_near_tie_only_where_asked() -> None:
    tops = [{5: -1.0, 6: -1.1}, {7: -0.5}]
    single = _completion([5, 7], tops)
    assert compare(single, _completion([5, 7], tops), near_ties=False) == "yes"
    flipped = _completion([6, 9], [{6: -1.0, 5: -1.05}, {9: -0.1}])
    assert compare(single, flipped, near_ties=True) == "near tie at 0"
    assert compare(single, flipped, near_ties=False) == "NO"
    far = _completion([8, 7], [{8: -0.1}, {7: -0.5}])  # 8 is not in single's top: no tie
    assert compare(single, far, near_ties=True) == "NO"


def test_top_logprobs_parse_vllm_token_id_names() -> None:
    choice = {"logprobs": {"top_logprobs": [{"token_id:12": -0.5, "token_id:3": -1.5}, None]}}
    assert _top_logprobs(choice) == [{12: -0.5, 3: -1.5}, {}]
    assert _top_logprobs({"text": "x"}) == []


def test_up_places_p_and_d_on_the_cores_threads_and_priority_asked() -> None:
    from pd_serving.cli import _place

    args = build_parser().parse_args(
        ["up", "--prefill-cpus", "0-1", "--prefill-threads", "2", "--prefill-nice", "10",
         "--prefill-omp-wait-policy", "passive", "--decode-worker-in-engine"]
    )  # fmt: skip
    servers = plan_servers(Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID)
    _place(servers, args)
    p, d = servers
    assert (p.cpus, p.cpu.omp_threads, p.cpu.nice) == ({0, 1}, 2, 10)
    assert p.env()["OMP_WAIT_POLICY"] == "passive"
    assert d.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert (d.cpu.omp_threads, d.cpu.nice, d.cpu.cpu_bind) == (1, 0, None)
    # Nothing asked: one core and one thread each, normal priority.
    plain = plan_servers(Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID)
    _place(plain, build_parser().parse_args(["up"]))
    assert [(s.cpu.omp_threads, s.cpu.nice, s.cpu.cpu_bind) for s in plain] == [(1, 0, None)] * 2


def test_up_places_a_p_for_idle_times_on_every_core_of_the_others() -> None:
    from pd_serving.cli import _place, _place_when_idle

    args = build_parser().parse_args(
        ["up", "--prefill-cpus", "0", "--decode-cpus", "1", "--prefill-when-idle", "1"]
    )
    servers = plan_servers(
        Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID, prefill=2, decode=1
    )
    _place(servers, args)
    assert _place_when_idle(servers, args.prefill_when_idle) == {"prefill-idle0"}
    p, idle, d = servers
    assert (p.name, p.cpus, p.cpu.omp_threads) == ("prefill0", {0}, 1)
    assert (idle.cpus, idle.cpu.omp_threads, idle.cpu.nice) == ({0, 1}, 2, 10)
    assert idle.env()["OMP_WAIT_POLICY"] == "passive"
    assert d.cpus == {1}
    assert all(s.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" for s in servers)
    assert _place_when_idle(servers, 0) == set()


def test_up_runs_its_proxy_on_the_p_cores_by_default() -> None:
    from pd_serving.servers import proxy_cores

    servers = plan_servers(
        Path("/m"), log_dir=Path("/l"), connector=Connector.HYBRID, prefill=2, decode=1
    )
    p0, p1, _d = servers
    for server, core in zip(servers, "012", strict=True):
        server.cpu = dataclasses.replace(server.cpu, cpu_bind=core)
    eight = range(8)
    assert proxy_cores(servers, "prefill", machine=eight) == {0, 1}
    assert proxy_cores(servers, "prefill", idle={p1.name}, machine=eight) == {0}
    assert proxy_cores(servers, "prefill", machine=range(2)) is None  # P's on every core
    assert proxy_cores(servers, "any", machine=eight) is None
    assert proxy_cores(servers, "2-3", machine=eight) == {2, 3}
    p0.cpu = dataclasses.replace(p0.cpu, cpu_bind="nobind")
    assert proxy_cores(servers, "prefill", machine=eight) is None  # a P unpinned: so is it
    assert build_parser().parse_args(["up"]).proxy_cpus == "prefill"
