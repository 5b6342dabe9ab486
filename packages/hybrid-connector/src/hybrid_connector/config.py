"""Connector configuration, read from ``kv_transfer_config.kv_connector_extra_config``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from hybrid_connector.errors import ConfigError

KVT_TRANSPORTS = ("auto", "tcp", "samehost", "rdma")  # kvt.paths.TRANSPORTS (kvt not imported)


KVS_VERIFY = ("checksum", "header")


class KvsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kv_connector_extra_config["kvs"]``: the shared KV store (see ``kvs.py``)."""

    # The node's refstore master (``refstore serve --name``); pdserve starts one.
    store: str = "default"
    # Part of every key: instances share blocks only within one namespace (e.g. a weights
    # version that the model path does not tell apart).
    namespace: str = ""
    save: bool = True
    load: bool = True
    # A lookup not answered in this time is a miss (the request is scheduled without it).
    lookup_timeout_s: float = 2.0
    # The first ask for a request waits this long for its lookup (a local store answers in
    # well under a millisecond); past it vLLM is told to ask again (None) and schedules others.
    lookup_wait_s: float = 0.005
    # Looked-up objects are kept from eviction this long, for the load to read them.
    hold_s: float = 30.0
    # A hit of a request that pulls nothing from P, on a model of one KV-cache group, is copied
    # in the step that admits the request, before its forward pass (on vLLM's worker thread,
    # from this node's pool: no call, no network), and the request computes the rest in that
    # same step; off (and for PD pulls and hybrid models), the request waits outside the
    # running set while the load thread copies, as for a pull, and runs a step later.
    load_in_step: bool = True
    # Load only hits of at least this many blocks past vLLM's local prefix hit.
    min_load_blocks: int = 1
    # Soft-pin a block once this many requests loaded it (hot prefixes: system prompts); 0: never.
    pin_after_loads: int = 2
    # What a load checks before a byte reaches vLLM's blocks. "header": each object's length,
    # its key (the block it holds) and the layout that wrote it; "checksum": also the XXH64 of
    # its bytes (written on every save), which costs one more pass over them (the KVS load
    # benchmark measures both).
    verify: str = "header"
    # Gather a save's bytes layer by layer while the forward pass runs (each layer as soon as
    # it is written), not all after it: the save is in the store sooner after the step.
    save_by_layer: bool = True
    # Added to the nice value of the worker's save thread (0-19; 0: the worker's own, at most
    # 19 in all): its gathers and puts run when the forward pass on its core leaves time;
    # loads keep the worker's priority (a request waits for them).
    save_nice: int = 19

    def __post_init__(self) -> None:
        if not 0 <= self.save_nice <= 19:
            raise ConfigError(f"kvs.save_nice must be in [0, 19], got {self.save_nice}")
        if self.verify not in KVS_VERIFY:
            raise ConfigError(f"kvs.verify must be one of {', '.join(KVS_VERIFY)}")
        if not 0 <= self.lookup_wait_s <= self.lookup_timeout_s:
            raise ConfigError("kvs.lookup_wait_s must be in [0, lookup_timeout_s]")
        for name in ("lookup_timeout_s", "hold_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kvs.{name} must be positive, got {getattr(self, name)}")
        if self.pin_after_loads < 0:
            raise ConfigError("kvs.pin_after_loads must be 0 (off) or more")
        if self.min_load_blocks < 1:
            raise ConfigError("kvs.min_load_blocks must be at least 1")


class R3Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``kv_connector_extra_config["r3"]``: record each request's MoE routing (``r3.py``);
    ``true`` is this with its defaults."""

    # The node's refstore master that takes the finished requests' records.
    store: str = "default"
    # A record's lease in the store (seconds): the trainer reads it within this time.
    ttl_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.ttl_s <= 86400:
            raise ConfigError(f"r3.ttl_s must be in (0, 86400], got {self.ttl_s}")


class HybridConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Every key of ``kv_connector_extra_config`` the connector understands.

    ``rpc_port`` is the fixed port of the producer's (P's) transfer_kv server: the proxy must know
    it before P answers, so an ephemeral port (0) is refused on a producer. ``data_port`` may be 0
    (ephemeral): D's data address travels inside transfer_kv.
    """

    rpc_host: str = "127.0.0.1"
    rpc_port: int = 0
    # Host that peers use to reach this instance (defaults to rpc_host / data_host).
    advertise_host: str | None = None
    data_host: str = "127.0.0.1"
    data_port: int = 0
    # P: how long finished-request blocks (and early transfer_kv pulls) are held for a peer.
    lease_s: float = 30.0
    # D: how long a pull may take end to end (P reached, transfer_kv answered, every byte
    # written). It covers P holding an early pull until its request finishes, so keep it above
    # the prefill time you expect; on expiry D recomputes the prompt itself.
    transfer_timeout_s: float = 60.0
    # Serve kvt's and the connector's Prometheus metrics on this port (worker process); None: off.
    # In a vLLM server the worker is often its own process, so vLLM's /metrics cannot show them.
    metrics_port: int | None = None
    # kvt's payload path: "auto" (samehost when P and D share a host, rdma when both ends have
    # a device, else tcp; the KVT_TRANSPORT environment variable, if set, decides instead), or
    # "tcp", "samehost", "rdma" forced: a pull that cannot use it fails (D recomputes).
    kvt_transport: str = "auto"
    # The shared KV store; None: off.
    kvs: KvsConfig | None = None
    # Routing records of MoE models (R3); None: off. ``true`` in the JSON: the defaults.
    r3: R3Config | None = None

    def __post_init__(self) -> None:
        if self.kvt_transport not in KVT_TRANSPORTS:
            raise ConfigError(
                f"kvt_transport must be one of {', '.join(KVT_TRANSPORTS)}, "
                f"got {self.kvt_transport!r}"
            )
        for name in ("rpc_port", "data_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be in [0, 65535], got {port}")
        for name in ("lease_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    def for_rank(self, tp_rank: int, tp_size: int) -> HybridConfig:
        """The config of one TP rank's worker: each fixed port shifted by ``tp_rank``.

        A TP>1 instance runs one worker per rank, each with its own transfer_kv server, kvt data
        port and metrics endpoint; rank ``r`` listens on ``port + r`` (0, ephemeral, stays 0),
        so peers find rank ``r`` at :func:`rank_address` of the advertised base address.
        """
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
        shifted: dict[str, int] = {}
        for name in ("rpc_port", "data_port", "metrics_port"):
            port = getattr(self, name)
            if port:
                if port + tp_size - 1 > 65535:
                    raise ConfigError(
                        f"{name} {port} + {tp_size - 1} (one port per TP rank) exceeds 65535"
                    )
                shifted[name] = port + tp_rank
        return msgspec.structs.replace(self, **shifted)

    @property
    def transport(self) -> str | None:
        """The ``transport=`` for kvt's TransferEngine (None: auto, KVT_TRANSPORT may decide)."""
        return None if self.kvt_transport == "auto" else self.kvt_transport

    @property
    def rpc_address(self) -> str:
        """The address D uses to reach this instance's transfer_kv server."""
        return f"{self.advertise_host or self.rpc_host}:{self.rpc_port}"


def parse_config(extra: Mapping[str, Any] | None, *, is_producer: bool) -> HybridConfig:
    """Validate ``kv_connector_extra_config``; raise ConfigError naming the bad key."""
    raw = dict(extra or {})
    if isinstance(raw.get("r3"), bool):  # "r3": true / false, shorthand for {} / off
        raw["r3"] = {} if raw["r3"] else None
    try:
        cfg = msgspec.convert(raw, HybridConfig, strict=False)
    except msgspec.ValidationError as err:
        raise ConfigError(f"invalid kv_connector_extra_config: {err}") from err
    if is_producer and cfg.rpc_port == 0:
        raise ConfigError(
            "a producer (kv_role kv_producer/kv_both) needs a fixed rpc_port in "
            "kv_connector_extra_config: the proxy and D must know P's transfer_kv address"
        )
    return cfg


def rank_address(address: str, tp_rank: int) -> str:
    """``host:port`` of TP rank ``tp_rank`` of an instance advertising ``address`` (its rank 0)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"not a host:port address: {address!r}")
    if not 0 <= int(port) + tp_rank <= 65535:
        raise ConfigError(f"{address} has no TP rank {tp_rank} port")
    return f"{host}:{int(port) + tp_rank}"
