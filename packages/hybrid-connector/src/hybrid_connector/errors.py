"""Typed errors, by who is at fault: the operator/caller, the peer instance, or the transport."""

from __future__ import annotations


class HybridConnectorError(Exception):
    """Base class of every error raised by hybrid_connector."""


class ConfigError(HybridConnectorError, ValueError):
    """The local operator's configuration (kv_connector_extra_config) is invalid."""


class UnsupportedLayoutError(ConfigError):
    """vLLM handed us KV cache tensors in a layout this connector cannot describe."""


class PeerError(HybridConnectorError):
    """The peer instance sent something inconsistent (bad transfer_kv, mismatched layout)."""


class TransferError(HybridConnectorError):
    """A transfer did not complete: the peer is unreachable, timed out or aborted."""


class LeaseExpired(TransferError):
    """No peer claimed the held KV blocks (or the held pull) within the lease."""
