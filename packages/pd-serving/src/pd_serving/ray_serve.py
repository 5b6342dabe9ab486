"""PD across hosts on Ray Serve LLM: HybridConnector inside ``ray.serve.llm``'s PD deployment.

``pdserve`` is the one-machine path; this module is the cluster path. Ray Serve LLM's
``build_pd_openai_app`` runs an ingress, a decode deployment (D) and a prefill deployment (P);
D's replica sends the request to P with ``max_tokens=1`` and ``kv_transfer_params`` from the
connector's *backend* (``prepare_prefill_request``), then runs it on its own engine with
``kv_transfer_params`` taken from P's answer (``prepare_decode_request``). Ray picks the
backend class by the ``kv_connector`` name through a registry kept in Ray's internal KV store,
so it reaches every replica of the cluster.

:class:`HybridConnectorBackend` is that backend for HybridConnector. In each replica, before
vLLM starts, it fills ``kv_connector_extra_config``:

- ``rpc_host``, ``data_host``: the node's IP as Ray knows it (``ray.util.get_node_ip_address``),
  not 127.0.0.1, so a D on another node can reach P's transfer_kv server and P can write into
  D's kvt region. Given explicitly, they stay; a wildcard (``0.0.0.0``) is advertised as the
  node IP (``advertise_host``), which is what P returns to D as ``remote_rpc_address``.
- ``rpc_port`` of a producer: the configured base plus the replica's offset (Ray's replica rank
  times its devices, or the DP rank), so several P replicas on one node do not collide.

The requests (``hybrid_connector.contract``): P gets ``PrefillParams`` (``{"do_remote_decode":
true, "transfer_id": <uuid>, ...}``); D gets what P returned, its ``PullParams``
(``{"do_remote_prefill": true, "transfer_id", "remote_rpc_address", ...}``; Ray's default
sequential hand-off: D starts once P answered, as ``pdserve``'s default dispatch). P's answer is
checked against the contract: one that breaks it is logged (naming the transfer and P) and D
computes the prompt itself.

Nothing here imports ray at module level (pd-serving installs without the ``ray`` extra);
:data:`HybridConnectorBackend` is built on first access (module ``__getattr__``), in the replica
that Ray's registry loads it into.
"""

from __future__ import annotations

import ipaddress
import logging
import uuid
from collections.abc import Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid_connector.contract import PullParams
    from ray.serve.deployment import Application

log = logging.getLogger(__name__)

CONNECTOR_NAME = "HybridConnector"
CONNECTOR_MODULE = "hybrid_connector.connector"
BACKEND_PATH = f"{__name__}:HybridConnectorBackend"
# P's transfer_kv port on a node is this plus the replica's offset (NIXL's base is 20000, and
# Ray shifts D's to 22000).
DEFAULT_RPC_PORT_BASE = 23000

__all__ = [
    "BACKEND_PATH",
    "CONNECTOR_NAME",
    "DEFAULT_RPC_PORT_BASE",
    "answered_pull",
    "build_pd_openai_app",
    "hybrid_kv_transfer_config",
    "node_connector_config",
    "register_backend",
]


def hybrid_kv_transfer_config(
    role: str, *, rpc_port_base: int = DEFAULT_RPC_PORT_BASE, **extra: Any
) -> dict[str, Any]:
    """``engine_kwargs["kv_transfer_config"]`` of P (``role="prefill"``) or D (``"decode"``).

    ``extra`` goes to ``kv_connector_extra_config`` (e.g. ``kvt_transport="tcp"``,
    ``lease_s=30``, ``transfer_timeout_s=60``; hybrid_connector.config.HybridConfig lists them).
    Hosts are left out: each replica fills in its node's IP (:func:`node_connector_config`).
    """
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    connector_extra: dict[str, Any] = dict(extra)
    if role == "prefill":
        connector_extra.setdefault("rpc_port", rpc_port_base)
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        # D only pulls (no transfer_kv server, no fixed port); P only serves.
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        # A failed or timed-out pull: D recomputes the prompt instead of failing the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector_extra,
    }


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == ""


def node_connector_config(
    extra: Mapping[str, Any] | None, *, node_ip: str, port_offset: int, is_producer: bool
) -> dict[str, Any]:
    """``kv_connector_extra_config`` of one replica on the node at ``node_ip``.

    Unset hosts become ``node_ip``; a wildcard ``rpc_host`` is advertised as ``node_ip``; a
    producer's fixed ports (``rpc_port``, ``metrics_port``) are shifted by ``port_offset``
    (``rpc_port`` defaults to :data:`DEFAULT_RPC_PORT_BASE`). Pure: the backend's ``setup``
    calls it with what Ray says about the replica.
    """
    config = dict(extra or {})
    config.setdefault("rpc_host", node_ip)
    config.setdefault("data_host", node_ip)
    if _is_wildcard(str(config["rpc_host"])):
        config.setdefault("advertise_host", node_ip)
    if is_producer:
        config["rpc_port"] = int(config.get("rpc_port") or DEFAULT_RPC_PORT_BASE) + port_offset
    if config.get("metrics_port"):
        config["metrics_port"] = int(config["metrics_port"]) + port_offset
    return config


def _is_producer(kv_transfer_config: Mapping[str, Any]) -> bool:
    return kv_transfer_config.get("kv_role", "kv_both") in ("kv_producer", "kv_both")


@cache
def _backend_class() -> type:
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
        BaseConnectorBackend,
        DefaultPDProtocolMixin,
    )

    class HybridConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
        """Ray Serve LLM's connector backend for HybridConnector (see the module docstring)."""

        def setup(self) -> None:
            import ray

            transfer = self.kv_transfer_config
            transfer.setdefault("kv_connector_module_path", CONNECTOR_MODULE)
            producer = _is_producer(transfer)
            transfer["kv_connector_extra_config"] = node_connector_config(
                transfer.get("kv_connector_extra_config"),
                node_ip=ray.util.get_node_ip_address(),
                port_offset=self._compute_port_offset() if producer else 0,
                is_producer=producer,
            )
            log.info(
                "HybridConnector on Ray Serve: %s with %s",
                transfer.get("kv_role"),
                transfer["kv_connector_extra_config"],
            )

        def prepare_prefill_request(self, *, request, peer):
            from hybrid_connector.contract import PrefillParams, encode_params

            prefill_request = super().prepare_prefill_request(request=request, peer=peer)
            # The id both ends log; P would make one up otherwise (and return it).
            params = PrefillParams(transfer_id=uuid.uuid4().hex)
            prefill_request.kv_transfer_params = encode_params(params)
            return prefill_request

        def prepare_decode_request(self, *, request, peer, prefill_response):
            decode_request = super().prepare_decode_request(
                request=request, peer=peer, prefill_response=prefill_response
            )
            if prefill_response is not None:
                pull = answered_pull(decode_request.kv_transfer_params, peer)
                if pull is None:
                    decode_request.kv_transfer_params = None  # D computes the prompt itself
            return decode_request

    HybridConnectorBackend.__module__ = __name__
    HybridConnectorBackend.__qualname__ = "HybridConnectorBackend"
    return HybridConnectorBackend


def answered_pull(raw: object, peer: object = None) -> PullParams | None:
    """P's answered ``kv_transfer_params`` as the contract's PullParams, or None (logged, naming
    the transfer and P ``peer``: D then computes the prompt itself, correct but without the
    transfer)."""
    from hybrid_connector.contract import ContractError, PullParams, decode_params

    transfer = raw.get("transfer_id") if isinstance(raw, dict) else None
    try:
        pull = decode_params(raw)
    except ContractError as err:
        log.warning(
            "transfer %r: P %s answered %s; D will compute the prompt itself", transfer, peer, err
        )
        return None
    if not isinstance(pull, PullParams):
        log.warning(
            "transfer %r: P %s answered no PullParams (%r); D will compute the prompt itself",
            transfer,
            peer,
            raw,
        )
        return None
    return pull


def __getattr__(name: str) -> Any:
    if name == "HybridConnectorBackend":
        return _backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_backend() -> None:
    """Tell Ray Serve LLM (cluster-wide) to use :class:`HybridConnectorBackend` for
    ``kv_connector: HybridConnector``. Needs ``ray.init`` first; idempotent."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )

    if not KVConnectorBackendFactory.is_registered(CONNECTOR_NAME):
        KVConnectorBackendFactory.register_backend(CONNECTOR_NAME, BACKEND_PATH)


def build_pd_openai_app(pd_serving_args: dict[str, Any]) -> Application:
    """``ray.serve.llm.build_pd_openai_app`` with HybridConnector's backend registered first.

    A drop-in for Ray's builder, also as an import path:
    ``serve run pd_serving.ray_serve:build_pd_openai_app --config ...``.
    """
    from ray.serve.llm import build_pd_openai_app as ray_build_pd_openai_app

    register_backend()
    return ray_build_pd_openai_app(pd_serving_args)
