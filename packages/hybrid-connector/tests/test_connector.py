"""The vLLM-facing class (imports vLLM): metadata and results cross the boundary intact."""

from __future__ import annotations

import pytest
from hybrid_connector.metadata import HybridConnectorMetadata, TransferResults

base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")


class _Worker:
    def drain(self) -> TransferResults:
        return TransferResults({"p-1"}, {"d-ok", "d-bad"}, {"d-bad"})


def test_failed_receives_reach_vllm() -> None:
    from hybrid_connector.connector import HybridConnector

    connector = object.__new__(HybridConnector)  # the worker role without a vLLM engine
    connector._worker = _Worker()  # type: ignore[assignment]
    results = connector.get_transfer_results(set())
    assert results.finished_sending == {"p-1"}
    assert results.finished_recving == {"d-ok", "d-bad"}
    assert results.failed_recving == {"d-bad"}
    # No override of the older get_finished hook, which has no place for failed receives.
    assert HybridConnector.get_finished is base.KVConnectorBase_V1.get_finished


def test_plain_metadata_is_vllm_metadata() -> None:
    import hybrid_connector.connector  # noqa: F401  (registers the class with vLLM's ABC)

    assert isinstance(HybridConnectorMetadata(), base.KVConnectorMetadata)
