"""A set of vLLM servers started together and stopped together."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

from pd_serving.launcher import stop_all, wait_all_ready
from pd_serving.proxy import Backend, Dispatch, ProxyConfig
from pd_serving.servers import Connector, Role, VllmServer

log = logging.getLogger(__name__)


class Deployment:
    """Owns the child processes of ``servers``: ``start`` launches them all at once and waits until
    every one is ready (the first crash fails fast); ``stop`` (idempotent, also on ``__exit__``)
    stops every process group."""

    def __init__(self, servers: Sequence[VllmServer]) -> None:
        self.servers = list(servers)
        self._processes = [server.make_process() for server in self.servers]

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 600.0) -> None:
        try:
            for proc in self._processes:
                proc.start()
            wait_all_ready(self._processes, timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_all(self._processes)

    def by_role(self, role: Role) -> list[VllmServer]:
        return [s for s in self.servers if s.role is role]

    def exited_futures(self) -> list[concurrent.futures.Future[int]]:
        """One per child, resolved with its exit code when it exits."""
        return [proc.exited for proc in self._processes]

    def proxy_config(
        self,
        connector: Connector,
        dispatch: Dispatch = Dispatch.SEQUENTIAL,
        model_names: Sequence[str] = (),
    ) -> ProxyConfig:
        return proxy_config_for(self.servers, connector, dispatch, model_names)


def proxy_config_for(
    servers: Sequence[VllmServer],
    connector: Connector,
    dispatch: Dispatch = Dispatch.SEQUENTIAL,
    model_names: Sequence[str] = (),
) -> ProxyConfig:
    """The proxy in front of the P's and D's among ``servers`` that use ``connector``."""

    def backends(role: Role) -> list[Backend]:
        return [
            Backend(
                url=s.url,
                # A D with HybridConnector too: its requests can migrate live (live.py).
                rpc_address=s.rpc_address
                if role is Role.PREFILL or connector is Connector.HYBRID
                else None,
                name=s.name,
                kv_events=s.kv_events_endpoint,
                kv_store=s.kv_store,
            )
            for s in servers
            if s.role is role and s.connector is connector
        ]

    return ProxyConfig(
        prefill=backends(Role.PREFILL),
        decode=backends(Role.DECODE),
        connector=connector,
        dispatch=dispatch,
        model_names=list(model_names),
    )
