"""The PD contract: what a proxy and the connector put in vLLM's ``kv_transfer_params``.

vLLM carries the dict through untouched: from the request body (``"kv_transfer_params"``, or
``SamplingParams.extra_args``) into ``Request.kv_transfer_params``, and from the connector's
``request_finished`` into the response's ``kv_transfer_params``. On the wire it stays JSON; on
either end it is one of two msgspec Structs, converted once at the boundary:

    proxy --PrefillParams--> P --PullParams (P's answer)--> proxy --PullParams--> D

- :class:`PrefillParams` (proxy -> P): compute the prompt and hold its KV for transfer
  ``transfer_id`` (the proxy sends ``max_tokens=1``).
- :class:`PullParams` (P -> proxy, proxy -> D): pull transfer ``transfer_id`` from P's
  transfer_kv server at ``remote_rpc_address``. P's answer carries what D needs plus fields for
  logs and other connectors' proxies; D needs only the first four.

``encode_params`` gives the dict to send; ``decode_params`` turns any received value into one of
the Structs, ``None`` (no transfer asked: neither flag set) or a :class:`ContractError` naming the
field, never another exception: a reader logs it with the request and the peer and serves the
request without a transfer (D computes the prompt itself).

Versions (``contract_version``; absent means 1): a field a reader does not know is ignored, so
adding an optional field keeps the version. A change an older reader would misread (a field's
type or meaning, a new required field) raises it. A reader accepts every version up to its own
and refuses a newer one with ``ContractError("contract_version", ...)``: it cannot tell what the
sender meant, and computing the prompt locally is always correct.

Imports msgspec only (the proxy runs without vLLM or torch).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from hybrid_connector.errors import PeerError

CONTRACT_VERSION = 1
# ContractError.field when the whole value is at fault (not an object, a non-string key).
WHOLE = "kv_transfer_params"

# Bounds keep a hostile dict from turning into huge values downstream (ids in logs, loops over
# ranks); real values are far inside them.
_Id = Annotated[str, msgspec.Meta(max_length=256)]
_RequiredId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Address = Annotated[str, msgspec.Meta(pattern=r"^\S+:[0-9]{1,5}$", max_length=300)]
_TpSize = Annotated[int, msgspec.Meta(ge=1, le=1024)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
_Version = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
_Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]


class ContractError(PeerError):
    """``kv_transfer_params`` does not fit the contract; ``field`` names the offending key."""

    def __init__(self, field: str, reason: str) -> None:
        where = field if field == WHOLE else f"{WHOLE}.{field}"
        super().__init__(f"{where}: {reason}")
        self.field = field
        self.reason = reason


class PrefillParams(msgspec.Struct, kw_only=True, frozen=True):
    """Proxy -> P: compute the prompt and keep its KV for D under ``transfer_id``."""

    do_remote_decode: Literal[True] = True
    # The proxy's id for the transfer; "" = P makes one up and returns it in PullParams.
    transfer_id: _Id = ""
    contract_version: _Version = CONTRACT_VERSION


class PullParams(msgspec.Struct, kw_only=True, frozen=True):
    """P -> proxy (P's answer) and proxy -> D: pull ``transfer_id`` from P."""

    do_remote_prefill: Literal[True] = True
    transfer_id: _RequiredId
    # P's transfer_kv server (its TP rank 0; rank r listens at config.rank_address(address, r)).
    remote_rpc_address: _Address
    remote_tp_size: _TpSize = 1
    do_remote_decode: Literal[False] = False
    # Set by P for logs and tools; D reads none of them but remote_num_tokens.
    remote_request_id: _Id = ""
    remote_block_ids: list[list[_Count]] = []
    # Tokens whose KV the sender holds (0: not said, the whole prompt). D pulls at most this
    # many and computes the rest: a migrated request's prompt ends with a token whose KV the
    # instance it leaves never computed.
    remote_num_tokens: _Count = 0
    lease_s: _Seconds = 0.0
    # Added by vLLM itself to P's answer (P's own prefix-cache hit); D's vLLM reports it in
    # usage.prompt_tokens_details. None: not set (and not sent).
    remote_prefill_cached_tokens: _Count | None = None
    contract_version: _Version = CONTRACT_VERSION


Params = PrefillParams | PullParams

# msgspec's messages end with "- at `$.field...`" or say "missing required field `field`".
_AT_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _flag(raw: dict[Any, Any], key: str) -> bool:
    value = raw.get(key, False)
    if value is None:  # vLLM's own proxies send null for "not set"
        return False
    if not isinstance(value, bool):
        raise ContractError(key, f"must be true or false, not {type(value).__name__}")
    return value


def _check_version(raw: dict[Any, Any]) -> None:
    version = raw.get("contract_version", 1)
    if isinstance(version, int) and not isinstance(version, bool) and version > CONTRACT_VERSION:
        raise ContractError(
            "contract_version",
            f"version {version} is newer than this reader's {CONTRACT_VERSION}",
        )


def decode_params(raw: object) -> Params | None:
    """``kv_transfer_params`` as received -> PrefillParams (``do_remote_decode``), PullParams
    (``do_remote_prefill``), or None (neither: no transfer). Raises ContractError only."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ContractError(WHOLE, f"must be an object, not {type(raw).__name__}")
    pull, hold = _flag(raw, "do_remote_prefill"), _flag(raw, "do_remote_decode")
    if pull and hold:
        raise ContractError("do_remote_decode", "set together with do_remote_prefill")
    if not (pull or hold):
        return None
    _check_version(raw)
    kind: type[Params] = PullParams if pull else PrefillParams
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as err:
        message = str(err)
        found = _AT_FIELD.search(message) or _MISSING.search(message)
        raise ContractError(found.group(1) if found else WHOLE, message) from None


def encode_params(params: Params) -> dict[str, Any]:
    """The JSON-ready dict for a request body's (or a response's) ``kv_transfer_params``
    (optional fields that are None are left out)."""
    return {k: v for k, v in msgspec.to_builtins(params).items() if v is not None}
