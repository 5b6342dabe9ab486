"""vLLM KV connector runtime on kvt (prefill/decode disaggregation).

Modules (importing this package pulls in nothing heavy):

* ``hybrid_connector.connector.HybridConnector``: the connector, for vLLM's
  ``kv_connector_module_path="hybrid_connector.connector"`` (imports vllm);
* ``hybrid_connector.config.HybridConfig``: the ``kv_connector_extra_config`` keys;
* ``hybrid_connector.control.release_transfer``: for a proxy, release a transfer on P;
* ``hybrid_connector.protocol``: the transfer_kv / release RPC methods and messages;
* ``hybrid_connector.testing.make_tiny_model``: the deterministic tiny model used in tests.
"""

__version__ = "0.1.0"
