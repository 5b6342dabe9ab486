"""HybridConnector: the vLLM KV connector (``kv_connector_module_path=hybrid_connector.connector``).

One class, two roles. vLLM builds one instance per role: in the scheduler (engine core process)
and in each worker. The roles never share state: the scheduler tells the worker through vLLM's
connector metadata (every step); the worker answers through ``get_transfer_results`` (every
step; R3's capture check through ``build_connector_worker_meta``) and, for blocks the scheduler
holds itself, with a SEND_DONE RPC (``send_done``) that needs no step.

The only module of the package that imports vLLM: it maps vLLM's hooks onto ``SchedulerSide``
and ``WorkerSide`` and the connector's plain metadata/results onto vLLM's classes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.forward_context import get_forward_context, is_forward_context_available

from hybrid_connector import r3
from hybrid_connector.config import HybridConfig, parse_config
from hybrid_connector.errors import ConfigError, UnsupportedLayoutError
from hybrid_connector.layout import KvGroup
from hybrid_connector.mapping import rank_heads
from hybrid_connector.metadata import HybridConnectorMetadata, StepReport
from hybrid_connector.scheduler_side import SchedulerSide
from hybrid_connector.send_done import SendDoneServer
from hybrid_connector.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hybrid_connector.kvs import KvsScheduler

log = logging.getLogger(__name__)

# The metadata and the workers' step reports are plain dataclasses (metadata.py imports no
# vLLM); vLLM sees them as its own.
KVConnectorMetadata.register(HybridConnectorMetadata)
KVConnectorWorkerMetadata.register(StepReport)


def _kvs_scheduler(
    vllm_config: VllmConfig, config: HybridConfig, groups: list[KvGroup] | None, tp_size: int
) -> KvsScheduler | None:
    """The scheduler half of KVS, or None when it is off; ConfigError if this model's cache
    cannot be stored whole."""
    kvs = config.kvs
    if kvs is None:
        return None
    from hybrid_connector import kvs_keys
    from hybrid_connector.kvs import KvsScheduler, Lookups, unsupported_reason

    block_size = int(vllm_config.cache_config.block_size)
    groups = groups or [KvGroup("attention", (), block_size)]
    why = unsupported_reason(
        groups, state_cache_mode=str(vllm_config.cache_config.mamba_cache_mode)
    )
    if why is not None:
        raise ConfigError(f"kvs: this model's KV cache cannot be stored: {why}")
    model = vllm_config.model_config
    identity = kvs_keys.ModelIdentity(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=_dtype_name(model.dtype),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        tp_size=tp_size,
        namespace=kvs.namespace,
    )

    def connect() -> Any:
        import refstore

        return refstore.Client(kvs.store, timeout=min(kvs.lookup_timeout_s, 10.0))

    return KvsScheduler(
        kvs,
        groups,
        block_size=block_size,
        tp_size=tp_size,
        identity=identity,
        lookups=Lookups(connect, hold_s=kvs.hold_s) if kvs.load else None,
    )


def r3_rows(vllm_config: VllmConfig) -> r3.RowGeometry:
    """R3: a token's routing row from the model's config (its MoE layers, top-k, expert count);
    ConfigError for a model without MoE routers. The worker checks it against the routers."""
    hf = vllm_config.model_config.hf_text_config
    experts = next(
        (int(v) for k in ("num_experts", "num_local_experts", "n_routed_experts")
         if (v := getattr(hf, k, None))),
        0,
    )  # fmt: skip
    top_k = int(getattr(hf, "num_experts_per_tok", 0) or 0)
    if experts <= 0 or top_k <= 0:
        raise ConfigError(
            f"r3: {vllm_config.model_config.model} has no MoE routers (its config names no "
            "experts per token): routing records need a MoE model; turn r3 off"
        )
    total = int(getattr(hf, "num_hidden_layers", 0) or 0)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)  # Qwen-MoE: every step-th layer
    first = int(getattr(hf, "first_k_dense_replace", 0) or 0)  # DeepSeek: dense first layers
    freq = int(getattr(hf, "moe_layer_freq", 1) or 1)
    layers = sum(
        1
        for i in range(total)
        if i not in dense and (i + 1) % step == 0 and i >= first and i % freq == 0
    )
    if layers == 0:
        raise ConfigError(f"r3: {vllm_config.model_config.model} has no MoE layers")
    return r3.RowGeometry(layers, top_k, r3.routing_dtype(experts).name)


def _with_routing_layer(groups: list[KvGroup] | None) -> list[KvGroup]:
    """R3: the routing buffer is one more layer of the first full-attention group."""
    for i, group in enumerate(groups or ()):
        if group.family == "attention":
            assert groups is not None
            routed = dataclasses.replace(group, layer_names=(*group.layer_names, r3.ROUTING_LAYER))
            return [*groups[:i], routed, *groups[i + 1 :]]
    raise ConfigError("r3: the routing rows live in a full-attention KV-cache group; none here")


def _moe_routers(vllm_config: VllmConfig) -> list[Any]:
    """The MoE layers' routers (vLLM's ``BaseRouter``s with a capture hook), in layer order."""
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    runners = [context[name] for name in compilation.static_all_moe_layers]
    runners.sort(key=lambda runner: int(runner.layer_id))
    routers = [getattr(runner, "router", None) for runner in runners]
    if not routers or not all(hasattr(router, "set_capture_fn") for router in routers):
        raise ConfigError(
            "r3: this model's MoE layers have no router with a capture hook "
            f"({[type(router).__name__ for router in routers][:3]})"
        )
    return routers


def _forward_slots(layer_name: str) -> torch.Tensor | None:
    """The running forward pass's slot mapping of ``layer_name``'s group (None outside one, or
    with micro-batches)."""
    if not is_forward_context_available():
        return None
    slots = get_forward_context().slot_mapping
    if not isinstance(slots, dict):
        return None
    return slots.get(layer_name)


def _adopt_vllm_logging() -> None:
    """Let our log lines reach vLLM's log, in its format and at its level.

    vLLM configures only the ``vllm`` logger; without this, INFO lines of ``hybrid_connector``
    would be dropped in a vLLM server. An application that configured ``hybrid_connector``
    itself (handlers present) is left alone.
    """
    ours = logging.getLogger("hybrid_connector")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except Exception:  # the scheduler role has no TP group; heads do not matter there
        return 0


def _total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads across all ranks (0 if vLLM cannot tell: heads left undescribed)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:
        return 0


def cpu_attn_isa(vllm_config: VllmConfig) -> Callable[[Any], str]:
    """The ISA vLLM's CPU attention backend picks for an attention spec ("" off the CPU).

    It decides the byte order inside a CPU block (the AMX kernel tiles K and V), so it is asked
    exactly as the backend's metadata builder asks it. "unknown" if vLLM no longer answers: such
    a cache is then copied only whole, between ranks that say the same."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return lambda spec: ""

    def isa(spec: Any) -> str:
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            return str(
                _get_attn_isa(
                    vllm_config.model_config.dtype,
                    int(spec.block_size),
                    int(spec.head_size),
                    vllm_config.cache_config.cache_dtype,
                )
            )
        except Exception:
            log.warning("vLLM's CPU attention ISA unknown: resized pulls of this cache refused")
            return "unknown"

    return isa


def kv_groups(
    kv_cache_config: KVCacheConfig | None,
    block_size: int,
    *,
    total_kv_heads: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    attn_isa: Callable[[Any], str] | None = None,
) -> list[KvGroup] | None:
    """vLLM's KV-cache groups as plain ``KvGroup``s (None: no config, one attention group).
    Attention groups carry this rank's KV heads out of the model's ``total_kv_heads`` and the
    CPU attention kernel ``attn_isa(spec)`` says stores them."""
    if kv_cache_config is None:
        return None
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            family, dtype = "state", ",".join(_dtype_name(d) for d in spec.dtypes)
        elif isinstance(spec, SlidingWindowMLASpec):
            raise UnsupportedLayoutError("sliding-window MLA KV-cache groups are not supported")
        elif isinstance(spec, SlidingWindowSpec):
            family, dtype = "sliding_window", _dtype_name(spec.dtype)
        elif isinstance(spec, MLAAttentionSpec):
            family, dtype = "mla", _dtype_name(spec.dtype)
        elif isinstance(spec, FullAttentionSpec):
            family, dtype = "attention", _dtype_name(spec.dtype)
        else:
            raise UnsupportedLayoutError(
                f"KV-cache group of {type(spec).__name__} (layers {group.layer_names[:2]}...) "
                "is not supported"
            )
        heads: dict[str, Any] = {}
        if family in ("attention", "sliding_window") and total_kv_heads > 0:
            ranks = rank_heads(total_kv_heads, tp_size, tp_rank)
            heads = {
                "total_heads": total_kv_heads,
                "head_start": ranks.start,
                "num_heads": int(getattr(spec, "num_kv_heads", len(ranks))),
            }
        if family in ("attention", "sliding_window") and attn_isa is not None:
            heads["attn_isa"] = attn_isa(spec)
        groups.append(
            KvGroup(
                family,
                tuple(group.layer_names),
                int(getattr(spec, "block_size", block_size)),
                dtype,
                int(getattr(spec, "num_speculative_blocks", 0) or 0),
                **heads,
            )
        )
    return groups


def _kv_events(events: list[Any]) -> list[Any]:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from hybrid_connector.kvs import MEDIUM

    out: list[Any] = []
    for event in events:
        if event[0] == "stored":
            _, chains, parent, tokens, block_size = event
            out.append(
                BlockStored(
                    block_hashes=list(chains),
                    parent_block_hash=parent,
                    token_ids=list(tokens),
                    block_size=block_size,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=None,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=list(event[1]), medium=MEDIUM))
    return out


class HybridConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode KV migration over simple_rpc (control) and kvt (data).

    ``SupportsHMA``: vLLM keeps its hybrid KV-cache manager on (several KV-cache groups, e.g.
    Qwen3-Next's linear-attention state plus full attention) and calls
    ``request_finished_all_groups`` with every group's blocks.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _adopt_vllm_logging()
        transfer_config = self._kv_transfer_config
        self.is_producer = bool(transfer_config.is_kv_producer)
        self.is_consumer = bool(transfer_config.is_kv_consumer)
        self.config: HybridConfig = parse_config(
            transfer_config.kv_connector_extra_config, is_producer=self.is_producer
        )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                "HybridConnector supports pipeline_parallel_size = 1 (each pipeline stage "
                "would need its own layers' pull); tensor parallelism is supported"
            )
        if parallel.data_parallel_size > 1 and parallel.tensor_parallel_size > 1:
            # Ports are shifted per TP rank only: DP ranks of one instance would collide.
            raise ConfigError(
                "HybridConnector does not support data parallelism together with TP > 1"
            )
        self.block_size = int(vllm_config.cache_config.block_size)
        tp_size = int(parallel.tensor_parallel_size)
        self.tp_rank = _tp_rank(tp_size) if role != KVConnectorRole.SCHEDULER else 0
        self.tp_size = tp_size
        self.kv_groups = kv_groups(
            kv_cache_config,
            self.block_size,
            total_kv_heads=_total_kv_heads(vllm_config),
            tp_size=tp_size,
            tp_rank=self.tp_rank,
            attn_isa=cpu_attn_isa(vllm_config),
        )
        self.r3_rows = r3_rows(vllm_config) if self.config.r3 is not None else None
        if self.r3_rows is not None:
            self.kv_groups = _with_routing_layer(self.kv_groups)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._send_done_server: SendDoneServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self.config,
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                block_size=self.block_size,
                groups=self.kv_groups,
                tp_size=tp_size,
                kvs=_kvs_scheduler(vllm_config, self.config, self.kv_groups, tp_size),
                r3_rows=self.r3_rows,
                prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
            )
        else:
            name = f"{transfer_config.kv_role}-{str(transfer_config.engine_id)[:8]}"
            if tp_size > 1:
                name = f"{name}-tp{self.tp_rank}"
            # Each TP rank's worker has its own transfer_kv server, kvt port and metrics port.
            self._worker = WorkerSide(
                self.config.for_rank(self.tp_rank, tp_size),
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                name=name,
            )

    # ================================================================= worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if self.r3_rows is not None:
            kv_caches = self._attach_r3(kv_caches)
        self._worker.register_kv_caches(
            kv_caches,
            self.block_size,
            num_blocks,
            self.kv_groups,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    def _attach_r3(self, kv_caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """R3: the routing buffer, hooked to the routers, as one more layer of its group."""
        from hybrid_connector.r3_worker import R3Recorder

        assert self._worker is not None
        assert self.r3_rows is not None
        assert self.config.r3 is not None
        assert self.kv_groups is not None
        group = next(g for g in self.kv_groups if r3.ROUTING_LAYER in g.layer_names)
        first = group.layer_names[0]
        recorder = R3Recorder(
            self.config.r3, self.r3_rows, tp_rank=self.tp_rank, name=f"-tp{self.tp_rank}"
        )
        self._worker.r3 = recorder  # closed with the worker
        routers = _moe_routers(self._vllm_config)
        tensor = recorder.attach(kv_caches[first], group.block_size, first, routers, _forward_slots)
        return {**kv_caches, r3.ROUTING_LAYER: tensor}

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the forward pass (start_load_kv usually runs after it): rapid transfer_kv must
        # know this step's finishing prefills before save_kv_layer is called.
        assert self._worker is not None
        assert isinstance(connector_metadata, HybridConnectorMetadata)
        self._worker.handle_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Pulls were already handed to the loop thread in bind_connector_metadata.
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Async loads only: a request runs after its whole KV arrived.
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Rapid transfer_kv: this layer's KV is written; a parked pull may send it now.
        assert self._worker is not None
        self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.step_done()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # vLLM 0.32 reads finished and failed receives together here; there is no get_finished
        # override: one that drained the results would drop failed_recving (a failed pull
        # would then count as loaded).
        assert self._worker is not None
        results = self._worker.drain()
        # P's requests are never in finished_sending: their blocks go back by SEND_DONE.
        return KVConnectorTransferResults(
            finished_recving=results.finished_recving, failed_recving=results.failed_recving
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        # KVS loads copied in the step (sync): the blocks of those that failed; vLLM recomputes
        # them. Async loads and pulls fail by request, in failed_recving.
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> StepReport | None:
        # After the forward pass: the step's in-step KVS loads, done or failed (their holds in
        # the store end), and R3's steps whose pass skipped a routing capture (None: neither).
        assert self._worker is not None
        loaded = tuple(self._worker.take_loaded_in_step())
        missed = () if self._worker.r3 is None else self._worker.r3.report()
        return StepReport(loaded, missed) if loaded or missed else None

    def transfer_counters(self) -> dict[str, int]:
        """Worker role: event counts (offers, sends_done, leases_expired, pulls_done, ...)."""
        assert self._worker is not None
        return self._worker.counters()

    @property
    def metrics_registry(self) -> CollectorRegistry | None:
        """Worker role: kvt's prometheus CollectorRegistry (expose it on a /metrics endpoint)."""
        return None if self._worker is None else self._worker.metrics_registry

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.release_holds()
        if self._send_done_server is not None:
            self._send_done_server.close()
            self._send_done_server = None

    # ================================================================= scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)
        if (self.is_producer or self.config.kvs is not None) and self._send_done_server is None:
            # P's blocks are owned by the scheduler half (so vLLM's engine core can sleep while D
            # pulls); its workers give them back by SEND_DONE, on an ephemeral port. KVS saves
            # hold blocks too, and are reported done the same way.
            self._send_done_server = SendDoneServer(
                self._scheduler,
                host=self.config.rpc_host,
                advertise_host=self.config.advertise_host,
                migrations=self._scheduler.migrations if self.is_producer else None,
            )
            self._scheduler.send_done_address = self._send_done_server.address

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> list[Any]:
        # The store's contents, in vLLM's KV-event vocabulary (vLLM publishes them with its own).
        if self._scheduler is None or self._scheduler.kvs is None:
            return []
        return _kv_events(self._scheduler.kvs.take_events())

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Only without the hybrid manager (one group); see request_finished_all_groups.
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # A pull transfers the request's own blocks for every KV-cache group.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))
