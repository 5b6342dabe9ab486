"""The PD contract (``hybrid_connector.contract``): tables of dicts in -> Structs or the typed
error naming the field, the version rule, round trips, and a fuzzed decoder (any dict in -> a
Struct, None or ContractError, never another exception)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import hypothesis.strategies as st
import pytest
from hybrid_connector.contract import (
    CONTRACT_VERSION,
    ContractError,
    PrefillParams,
    PullParams,
    decode_params,
    encode_params,
)
from hybrid_connector.errors import PeerError
from hypothesis import given, settings

PULL = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_rpc_address": "10.0.0.1:8200"}
# What P's connector answers (and a proxy may forward to D as it is).
P_ANSWER = {
    **PULL,
    "do_remote_decode": False,
    "remote_request_id": "cmpl-1",
    "remote_block_ids": [[3, 5]],
    "remote_num_tokens": 6,
    "remote_tp_size": 2,
    "lease_s": 30.0,
    "remote_prefill_cached_tokens": 4,  # vLLM's own, for D's usage report
}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        ({}, None),
        ({"do_remote_decode": False, "do_remote_prefill": False}, None),
        ({"do_remote_decode": None}, None),  # vLLM's proxies send null for "not set"
        ({"do_remote_decode": True}, PrefillParams()),
        ({"do_remote_decode": True, "transfer_id": "t-1"}, PrefillParams(transfer_id="t-1")),
        (PULL, PullParams(transfer_id="t-1", remote_rpc_address="10.0.0.1:8200")),
        (
            P_ANSWER,
            PullParams(
                transfer_id="t-1",
                remote_rpc_address="10.0.0.1:8200",
                remote_tp_size=2,
                remote_request_id="cmpl-1",
                remote_block_ids=[[3, 5]],
                remote_num_tokens=6,
                lease_s=30.0,
                remote_prefill_cached_tokens=4,
            ),
        ),
        # NixlConnector-style extras and unknown fields are ignored.
        ({**PULL, "remote_engine_id": None, "something_new": [1]}, decode_params(PULL)),
        ({**PULL, "contract_version": CONTRACT_VERSION}, decode_params(PULL)),
        (
            {**PULL, "lease_s": 30},
            PullParams(transfer_id="t-1", remote_rpc_address="10.0.0.1:8200", lease_s=30.0),
        ),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_decodes(raw: Any, expected: Any) -> None:
    assert decode_params(raw) == expected


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([PULL], "kv_transfer_params"),
        ("do_remote_prefill", "kv_transfer_params"),
        ({**PULL, 7: "x"}, "kv_transfer_params"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
        ({"do_remote_decode": 1}, "do_remote_decode"),
        ({**PULL, "do_remote_decode": True}, "do_remote_decode"),
        ({"do_remote_prefill": True}, "transfer_id"),
        ({**PULL, "transfer_id": ""}, "transfer_id"),
        ({**PULL, "transfer_id": 7}, "transfer_id"),
        ({**PULL, "transfer_id": "x" * 257}, "transfer_id"),
        ({"do_remote_decode": True, "transfer_id": ["t"]}, "transfer_id"),
        ({**PULL, "remote_rpc_address": None}, "remote_rpc_address"),
        ({**PULL, "remote_rpc_address": "10.0.0.1"}, "remote_rpc_address"),
        ({**PULL, "remote_rpc_address": "a b:1"}, "remote_rpc_address"),
        ({**PULL, "remote_tp_size": 0}, "remote_tp_size"),
        ({**PULL, "remote_tp_size": True}, "remote_tp_size"),
        ({**PULL, "remote_tp_size": 2.0}, "remote_tp_size"),
        ({**PULL, "remote_tp_size": 10**6}, "remote_tp_size"),
        ({**PULL, "remote_block_ids": [[1, -1]]}, "remote_block_ids"),
        ({**PULL, "remote_block_ids": [1, 2]}, "remote_block_ids"),
        ({**PULL, "lease_s": float("nan")}, "lease_s"),
        ({**PULL, "lease_s": -1}, "lease_s"),
        ({**PULL, "remote_prefill_cached_tokens": "4"}, "remote_prefill_cached_tokens"),
        ({**PULL, "contract_version": 0}, "contract_version"),
        ({**PULL, "contract_version": "1"}, "contract_version"),
    ],
    ids=repr,
)
def test_a_dict_that_does_not_fit_names_the_field(raw: Any, field: str) -> None:
    with pytest.raises(ContractError) as caught:
        decode_params(raw)
    assert caught.value.field == field
    assert field in str(caught.value)
    assert isinstance(caught.value, PeerError), "the peer's fault (D recomputes)"


@pytest.mark.parametrize("flag", ["do_remote_prefill", "do_remote_decode"])
def test_a_newer_version_is_refused_whatever_else_it_says(flag: str) -> None:
    """The rule: a reader cannot tell what a newer sender meant; it refuses the transfer (the
    request is then served without one), even when every field it knows looks right."""
    raw = {**PULL, flag: True, "contract_version": CONTRACT_VERSION + 1}
    if flag == "do_remote_decode":
        raw = {"do_remote_decode": True, "contract_version": CONTRACT_VERSION + 1}
    with pytest.raises(ContractError) as caught:
        decode_params(raw)
    assert caught.value.field == "contract_version"
    assert "newer" in caught.value.reason


def test_an_older_or_absent_version_is_read() -> None:
    assert decode_params({**PULL, "contract_version": 1}) == decode_params(PULL)
    assert decode_params(PULL).contract_version == CONTRACT_VERSION


@pytest.mark.parametrize(
    "params",
    [
        PrefillParams(),
        PrefillParams(transfer_id="t-1"),
        PullParams(transfer_id="t-1", remote_rpc_address="h:1"),
        decode_params(P_ANSWER),
    ],
    ids=repr,
)
def test_encode_then_decode_is_the_identity_through_json(params: Any) -> None:
    wire = json.loads(json.dumps(encode_params(params)))
    assert decode_params(wire) == params


def test_the_wire_keys_are_the_ones_vllm_and_other_proxies_read() -> None:
    """vLLM's scheduler reads ``do_remote_prefill`` itself; the keys stay the README's."""
    assert encode_params(PrefillParams(transfer_id="x")) == {
        "do_remote_decode": True,
        "transfer_id": "x",
        "contract_version": CONTRACT_VERSION,
    }
    wire = encode_params(decode_params(P_ANSWER))
    assert {k: wire[k] for k in P_ANSWER} == P_ANSWER
    # An optional field that is not set is not sent (vLLM reads it only if it is an int).
    assert "remote_prefill_cached_tokens" not in encode_params(decode_params(PULL))


# ------------------------------------------------------------------ fuzzing the decoder
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_keys = st.sampled_from(
    [
        "do_remote_prefill",
        "do_remote_decode",
        "transfer_id",
        "remote_rpc_address",
        "remote_tp_size",
        "remote_request_id",
        "remote_block_ids",
        "remote_num_tokens",
        "lease_s",
        "remote_prefill_cached_tokens",
        "contract_version",
    ]
)
_values = (
    _json
    | st.sampled_from([True, False, "h:1", "10.0.0.1:8200", "t-1", 0, 1, 2, -1, 2**64])
    | st.lists(st.lists(st.integers(-2, 2**40), max_size=3), max_size=3)
)
# Dicts near the contract (its keys, plausible and wrong values), and anything at all.
_near = st.dictionaries(_keys | st.text(max_size=6) | st.integers(), _values, max_size=12)


@settings(max_examples=800, deadline=None)
@given(st.one_of(_near, _json, st.builds(lambda d: {**PULL, **d}, _near)))
def test_any_value_decodes_to_a_struct_none_or_the_typed_error(raw: Any) -> None:
    try:
        params = decode_params(raw)
    except ContractError as err:
        field = err.field
        params = None
    else:
        field = None
    assert field is None or field.isidentifier()
    if params is not None:
        assert isinstance(params, PrefillParams | PullParams)
        # What decodes re-encodes to what decodes the same (the proxy forwards P's answer).
        assert decode_params(json.loads(json.dumps(encode_params(params)))) == params


def test_the_contract_imports_nothing_heavy() -> None:
    """The proxy imports it without vLLM or torch installed."""
    code = (
        "import json, sys, hybrid_connector.contract\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('vllm', 'torch', 'numpy', 'kvt', 'simple_rpc'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
