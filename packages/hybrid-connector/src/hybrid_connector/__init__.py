"""vLLM KV connector runtime on kvt (prefill/decode disaggregation).

Modules (importing this package pulls in nothing heavy):

* ``hybrid_connector.connector.HybridConnector``: the connector, for vLLM's
  ``kv_connector_module_path="hybrid_connector.connector"`` (imports vllm);
* ``hybrid_connector.config.HybridConfig``: the ``kv_connector_extra_config`` keys;
* ``hybrid_connector.control.release_transfer``: for a proxy, release a transfer on P;
* ``hybrid_connector.protocol``: the transfer_kv / release RPC methods and messages;
* ``hybrid_connector.contract``: the PD contract, ``kv_transfer_params`` as msgspec Structs
  (``PrefillParams``, ``PullParams``; ``decode_params`` / ``encode_params``), shared with proxies;
* ``hybrid_connector.producer`` / ``.consumer``: P's and D's transfer logic as pure state
  machines (events in, actions out; ``common`` what they share), ``holds`` the one owner of P's
  blocks (pure ``BlockOwner`` and its shell); ``worker_side`` is the I/O shell around the
  machines, ``scheduler_side`` the scheduler half, ``metadata`` the plain classes the two halves
  exchange;
* ``hybrid_connector.tiny_model.make_tiny_model``: the deterministic tiny model (tests, make-model).
"""

__version__ = "0.1.0"
