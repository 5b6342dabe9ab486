"""The proxy's opt-in ``routed_experts`` field: D's R3 record, inlined as vLLM encodes it.

With R3 on (``pdserve up --r3``) a finished request's ``kv_transfer_params["r3"]`` names its
routing record in the node's refstore master (``hybrid_connector.r3``); the proxy passes it
through as it is. With ``ProxyConfig.routed_experts`` on, a non-streamed answer also gets each
record read and set as ``choices[i].routed_experts``: base64 of the ``.npy`` bytes of the
``[tokens, layers, top_k]`` array, the field and encoding of vLLM's own
``enable_return_routed_experts`` (``np.load(io.BytesIO(base64.b64decode(s)))``). The answer
names one record (vLLM's response carries one ``kv_transfer_params``), so only the first choice
of a one-prompt request gets it. A record that cannot be read leaves the answer as it is (a
WARNING naming the record): the client still gets its tokens and the reference.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class RoutedExperts:
    """Reads records for answers (one refstore client per store, made on first use)."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()  # the client table; never held across a read

    def _client(self, store: str) -> Any:
        with self._lock:
            client = self._clients.get(store)
        if client is None:
            import refstore

            client = refstore.Client(store)
            with self._lock:
                client, spare = self._clients.setdefault(store, client), client
            if spare is not client:
                spare.close()
        return client

    def _encode(self, params: dict[str, Any]) -> str:
        import numpy as np
        from hybrid_connector.r3 import read_record

        rows = read_record(
            params, self._client(str(params["r3"]["store"])), timeout_s=self._timeout_s
        )
        with io.BytesIO() as buffer:
            np.save(buffer, rows, allow_pickle=False)
            return base64.b64encode(buffer.getvalue()).decode("ascii")

    async def attach(self, data: bytes) -> bytes:
        """``data`` (a completion's JSON) with ``routed_experts`` set, or as it was."""
        try:
            answer = json.loads(data)
            params = answer.get("kv_transfer_params") or {}
            choices = answer.get("choices") or []
        except (ValueError, AttributeError):
            return data
        if not isinstance(params, dict) or "r3" not in params or len(choices) != 1:
            return data
        try:
            choices[0]["routed_experts"] = await asyncio.to_thread(self._encode, params)
        except Exception as exc:
            log.warning("routed_experts: record %s not read (%s)", params["r3"].get("key"), exc)
            return data
        return json.dumps(answer).encode()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
