"""HybridConnector's kv-transfer config on Ray Serve: what each replica advertises (no Ray here)."""

from __future__ import annotations

import pytest
from hybrid_connector.config import parse_config
from pd_serving import ray_serve
from pd_serving.ray_serve import (
    DEFAULT_RPC_PORT_BASE,
    hybrid_kv_transfer_config,
    node_connector_config,
)

NODE_IP = "10.1.2.3"


def test_prefill_and_decode_roles() -> None:
    p = hybrid_kv_transfer_config("prefill", kvt_transport="tcp")
    d = hybrid_kv_transfer_config("decode")
    assert p["kv_role"] == "kv_producer"
    assert d["kv_role"] == "kv_consumer"
    for config in (p, d):
        assert config["kv_connector"] == "HybridConnector"
        assert config["kv_connector_module_path"] == "hybrid_connector.connector"
    assert p["kv_connector_extra_config"] == {
        "kvt_transport": "tcp",
        "rpc_port": DEFAULT_RPC_PORT_BASE,
    }
    assert d["kv_connector_extra_config"] == {}  # D serves no transfer_kv: no fixed port
    with pytest.raises(ValueError, match="role"):
        hybrid_kv_transfer_config("both")


def test_replica_advertises_its_node_ip_not_loopback() -> None:
    """P's transfer_kv address (what D is told) is on the node's IP, at base + replica offset."""
    extra = node_connector_config(
        {"rpc_port": 23000}, node_ip=NODE_IP, port_offset=2, is_producer=True
    )
    config = parse_config(extra, is_producer=True)  # the connector accepts it as is
    assert config.rpc_address == f"{NODE_IP}:23002"
    assert config.data_host == NODE_IP  # P writes into D's kvt region at D's data address


def test_wildcard_listen_is_advertised_as_node_ip() -> None:
    extra = node_connector_config(
        {"rpc_host": "0.0.0.0"}, node_ip=NODE_IP, port_offset=0, is_producer=True
    )
    config = parse_config(extra, is_producer=True)
    assert config.rpc_host == "0.0.0.0"
    assert config.rpc_address == f"{NODE_IP}:{DEFAULT_RPC_PORT_BASE}"


def test_explicit_hosts_and_consumer_ports_stay() -> None:
    given = {"rpc_host": "192.168.0.7", "data_host": "192.168.0.8", "advertise_host": "p.example"}
    extra = node_connector_config(given, node_ip=NODE_IP, port_offset=3, is_producer=True)
    assert extra["rpc_host"] == "192.168.0.7"
    assert extra["data_host"] == "192.168.0.8"
    assert parse_config(extra, is_producer=True).rpc_address == "p.example:23003"
    consumer = node_connector_config({}, node_ip=NODE_IP, port_offset=3, is_producer=False)
    assert consumer == {"rpc_host": NODE_IP, "data_host": NODE_IP}
    parse_config(consumer, is_producer=False)


def test_metrics_port_shifted_per_replica() -> None:
    extra = node_connector_config(
        {"metrics_port": 9400}, node_ip=NODE_IP, port_offset=1, is_producer=False
    )
    assert extra["metrics_port"] == 9401


def test_module_imports_without_ray_and_names_its_backend() -> None:
    assert ray_serve.BACKEND_PATH == "pd_serving.ray_serve:HybridConnectorBackend"
    with pytest.raises(AttributeError):
        _ = ray_serve.NoSuchThing


def test_importing_the_module_loads_no_ray() -> None:
    """pd-serving installs without the ``ray`` extra: the module imports ray only when used."""
    import subprocess
    import sys

    code = (
        "import sys, pd_serving.ray_serve; "
        "print(any(m.partition('.')[0] == 'ray' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_p_answer_is_checked_against_the_contract(caplog: pytest.LogCaptureFixture) -> None:
    answered = {"do_remote_prefill": True, "transfer_id": "t-1", "remote_rpc_address": "h:1"}
    pull = ray_serve.answered_pull(answered, "p-replica")
    assert pull is not None
    assert (pull.transfer_id, pull.remote_rpc_address) == ("t-1", "h:1")
    with caplog.at_level("WARNING", logger="pd_serving.ray_serve"):
        assert ray_serve.answered_pull({**answered, "remote_tp_size": 0}, "p-replica") is None
        assert ray_serve.answered_pull(None, "p-replica") is None
    first, second = (r.getMessage() for r in caplog.records)
    assert "'t-1'" in first
    assert "p-replica" in first
    assert "kv_transfer_params.remote_tp_size" in first
    assert "no PullParams" in second


@pytest.mark.needs_vllm
def test_backend_shapes_p_and_d_requests_for_the_connector() -> None:
    """P is asked to hold the KV under a transfer id; D gets exactly what P answered."""
    pytest.importorskip("ray.serve.llm", reason="needs pd-serving[ray]")
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    backend = ray_serve.HybridConnectorBackend(llm_config=None)
    request = CompletionRequest(model="tiny", prompt="hello", max_tokens=8, stream=True)
    p = backend.prepare_prefill_request(request=request, peer=None)
    assert p.max_tokens == 1
    assert not p.stream
    assert p.kv_transfer_params["do_remote_decode"] is True
    assert p.kv_transfer_params["transfer_id"]
    assert request.kv_transfer_params is None  # the client's request is left as it was

    answered = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": p.kv_transfer_params["transfer_id"],
        "remote_rpc_address": f"{NODE_IP}:23000",
    }

    class PrefillAnswer:
        kv_transfer_params = answered

    d = backend.prepare_decode_request(request=request, peer=None, prefill_response=PrefillAnswer)
    assert d.kv_transfer_params == answered
    assert d.max_tokens == 8
    assert d.stream
