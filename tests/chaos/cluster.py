"""P's, D's and a proxy, each in a network namespace of its own (a "host"), plus the references.

``HostedCluster`` starts HybridConnector P and D vLLM servers inside a ``NetnsLab`` (each binds,
and P advertises, its host's address: ``rpc_host``/``data_host`` are that address, kvt forced to
TCP so the data really crosses the namespaces' network), `pdserve proxy` on a host of its own,
and a single vLLM instance in the root namespace for the reference answers. Each instance can
be killed (``kill -9`` of its API server) and restarted on the same host and ports; every
process group it ever had is remembered so the test can check none is left.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from pd_serving.client import complete
from pd_serving.launcher import ManagedProcess, free_port, stop_all, wait_all_ready
from pd_serving.proxy import READY_LINE
from pd_serving.servers import Connector, CpuSettings, Role, VllmServer
from stand_ins import wait_all_gone

from .netns import NetnsLab

STARTUP_TIMEOUT_S = 600.0


@dataclass
class Instance:
    """One vLLM server on one lab host; ``process`` is its current run."""

    server: VllmServer
    host: str
    process: ManagedProcess
    pids: list[int] = field(default_factory=list)  # the group leader of every run

    @property
    def name(self) -> str:
        return self.server.name

    @property
    def url(self) -> str:
        return self.server.url


def hosted_process(lab: NetnsLab, host: str, server: VllmServer) -> ManagedProcess:
    """``server`` run inside ``host``'s namespace (the same command line, env and CPUs)."""
    return ManagedProcess(
        server.name,
        lab.argv(host, server.argv()),
        log_path=server.log_dir / f"{server.name}.log",
        env=server.env(),
        health_url=f"{server.url}/health",
        cpus=server.cpus,
    )


class HostedCluster:
    """``prefill`` P's and ``decode`` D's on hosts ``p0.., d0..``, the proxy on host ``proxy``
    (started by ``start_proxy`` once they are up), ``single`` in the root namespace."""

    def __init__(
        self,
        lab: NetnsLab,
        model: Path,
        log_dir: Path,
        *,
        prefill: int,
        decode: int,
        connector_config: dict | None = None,
        dispatch: str = "sequential",
    ) -> None:
        self.lab = lab
        self.model = model
        self.log_dir = log_dir
        self.dispatch = dispatch
        cpu = CpuSettings()
        self.instances: dict[str, Instance] = {}
        for role, count, prefix in ((Role.PREFILL, prefill, "p"), (Role.DECODE, decode, "d")):
            for index in range(count):
                host = f"{prefix}{index}"
                server = VllmServer(
                    name=f"{role.value}{index}",
                    model=model,
                    role=role,
                    connector=Connector.HYBRID,
                    log_dir=log_dir,
                    host=lab[host].address,
                    index=index,
                    cpu=cpu,
                    # What crosses hosts must use the network: never kvt's same-host shm path.
                    extra_connector_config={"kvt_transport": "tcp", **(connector_config or {})},
                )
                self.instances[server.name] = Instance(
                    server, host, hosted_process(lab, host, server)
                )
        self.single = VllmServer(
            name="single0", model=model, role=Role.SINGLE, connector=None, log_dir=log_dir, cpu=cpu
        )
        self.single_process = self.single.make_process()
        self.proxy_process: ManagedProcess | None = None
        self.proxy_url = ""
        self.proxy_pids: list[int] = []

    @property
    def model_name(self) -> str:
        return str(self.model)

    def by_role(self, role: Role) -> list[Instance]:
        return [i for i in self.instances.values() if i.server.role is role]

    def processes(self) -> Iterator[ManagedProcess]:
        yield from (i.process for i in self.instances.values())
        yield self.single_process
        if self.proxy_process is not None:
            yield self.proxy_process

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, with_single: bool = True) -> None:
        """Every vLLM instance at once; the first crash raises (with its log tail)."""
        procs = [i.process for i in self.instances.values()]
        if with_single:
            procs.append(self.single_process)
        for proc in procs:
            proc.start()
        for inst in self.instances.values():
            inst.pids.append(inst.process.pid)
        wait_all_ready(procs, STARTUP_TIMEOUT_S)

    def start_proxy(self, extra_args: Sequence[str] = (), decode_rpc: bool = False) -> str:
        address = self.lab["proxy"].address
        port = free_port()
        argv = [sys.executable, "-m", "pd_serving.cli", "proxy", "--dispatch", self.dispatch]
        argv += ["--bypass-below-tokens", "0"]  # every prompt through P: P's faults matter
        for inst in self.by_role(Role.PREFILL):
            argv += ["--prefill", f"{inst.url}@{inst.server.rpc_address}"]
        for inst in self.by_role(Role.DECODE):
            # With its transfer address a D's streams can migrate live (drains).
            rpc = f"@{inst.server.rpc_address}" if decode_rpc else ""
            argv += ["--decode", f"{inst.url}{rpc}"]
        argv += ["--model-name", self.model_name, "--host", address, "--port", str(port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proxy_url = f"http://{address}:{port}"
        self.proxy_process = ManagedProcess(
            "proxy",
            self.lab.argv("proxy", [*argv, *extra_args]),
            log_path=self.log_dir / "proxy.log",
            env=env,
            ready_marker=READY_LINE,
            health_url=f"{self.proxy_url}/health",
        )
        self.proxy_process.start()
        self.proxy_pids.append(self.proxy_process.pid)
        wait_all_ready([self.proxy_process], 60.0)
        return self.proxy_url

    def kill(self, name: str) -> None:
        """``kill -9`` the instance's API server, then reap its group as a supervisor would."""
        proc = self.instances[name].process
        proc.kill()
        proc.exited.result(timeout=30)
        proc.stop()

    def restart(self, name: str) -> ManagedProcess:
        """The instance again, same host and ports; returns its process (wait on ``ready``)."""
        inst = self.instances[name]
        inst.process = inst.process.restart()
        inst.pids.append(inst.process.pid)
        return inst.process

    def stop(self) -> None:
        stop_all(list(self.processes()))

    # -- what is left ----------------------------------------------------------------------
    def all_pids(self) -> list[int]:
        pids = [pid for inst in self.instances.values() for pid in inst.pids]
        pids += self.proxy_pids
        if self.single_process.pid is not None:
            pids.append(self.single_process.pid)
        return pids

    def survivors(self, grace_s: float = 30.0) -> list[str]:
        """Processes still in any group this cluster ever started, or in a lab namespace, or
        vLLM processes under this test process, ``grace_s`` after the call (a SIGKILLed group
        takes a moment to exit): each ``pid cmdline``; empty when all is clean."""
        groups = set(self.all_pids())
        found: dict[int, str] = {}
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if os.getpgid(proc.pid) in groups:
                    found[proc.pid] = " ".join(proc.info["cmdline"] or [])[:160]
            except (ProcessLookupError, psutil.Error):
                continue
        for host in self.lab.hosts:
            for pid in self.lab.pids(host):
                found.setdefault(pid, f"in netns {host}")
        for child in psutil.Process().children(recursive=True):
            try:
                cmdline = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "vllm" in cmdline:
                found.setdefault(child.pid, cmdline[:160])
        alive = wait_all_gone(found, grace_s)
        return [f"{pid} {what}" for pid, what in sorted(found.items()) if pid in alive]


async def reference_answers(
    session: aiohttp.ClientSession,
    single_url: str,
    model: str,
    prompts: Sequence[str | list[int]],
    max_tokens: int,
) -> list[list[int]]:
    """The single instance's greedy token ids for each prompt (what PD must reproduce)."""
    out = []
    for prompt in prompts:
        answer = await complete(
            session, single_url, model, prompt, max_tokens=max_tokens, stream=False
        )
        out.append(answer.token_ids)
    return out
