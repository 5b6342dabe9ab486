"""One offline vLLM engine (``vllm.LLM``) in a child process, driven over a pipe.

The child steps its engine the way vLLM's engine-core busy loop does, but only while the
scheduler has work (requests running, or finished ones whose blocks the connector still holds):
then it paces itself by waiting on the pipe for a few milliseconds; when idle it blocks on the
pipe. Requests are submitted in batches that run concurrently, so one engine can be P and D of
the same transfer (``kv_both``: D's pull parks on P's side of the same engine until P's prefill
runs) and a parallel-dispatch test needs no second engine.

Parent and child speak in tuples: ``(command, call_id, argument)`` down; ``("reply", call_id,
ok, value)`` and ``("batch", batch_id, ok, outputs)`` up. ``call`` runs any importable function
with the ``LLM`` in the child (a test's own probe needs no new command).

With ``multiprocessing=True`` the engine core is its own process (vLLM's busy loop, as in
``vllm serve``): the scheduler is out of reach, batches run one at a time, stats come from
vLLM's gauges.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import shm

_STEP_PACING_S = 0.002
_HERE = Path(__file__).resolve().parent
CONNECTOR = {
    "kv_connector": "HybridConnector",
    "kv_connector_module_path": "hybrid_connector.connector",
    "kv_load_failure_policy": "recompute",
}
OWN_THREADS = ("hybrid-connector", "kvt-")
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class EngineSpec:
    """What to start: one tiny model with HybridConnector in the given role."""

    name: str
    model: str
    kv_role: str | None = "kv_both"
    extra_config: dict[str, Any] = field(default_factory=dict)
    tp: int = 1
    block_size: int | None = None
    prefix_caching: bool = True
    multiprocessing: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Explicit, so vLLM skips its memory profiling run; plenty for tiny models and short prompts.
    kv_cache_bytes: int = 64 << 20
    max_model_len: int = 1024
    record_kv: bool = False  # digest each request's prompt KV when vLLM frees its blocks

    @property
    def rpc_address(self) -> str | None:
        port = self.extra_config.get("rpc_port")
        return None if port is None else f"127.0.0.1:{port}"


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:12]}")


@dataclass
class Gen:
    request_id: str
    token_ids: list[int]
    # Per generated position: {token id: logprob} of the top TOP_LOGPROBS (and the sampled one).
    logprobs: list[dict[int, float]]
    kv_transfer_params: dict[str, Any] | None


# ------------------------------------------------------------------ in the child


def _engine_env(spec: EngineSpec) -> dict[str, str]:
    from hybrid_connector.tiny_model import OFFLINE_VLLM_ENV

    env = {k: v for k, v in OFFLINE_VLLM_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.multiprocessing else "0"
    # collective_rpc ships this module's probes to worker processes pickled by reference.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(_HERE.parent), os.environ.get("PYTHONPATH", "")])
    if spec.tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def _make_llm(spec: EngineSpec) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": spec.model,
        "enforce_eager": True,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": 8,
        "seed": 0,
        "enable_prefix_caching": spec.prefix_caching,
        "disable_log_stats": False,  # prompt tokens by source, the block-pool gauges
        "kv_cache_memory_bytes": spec.kv_cache_bytes,
        **spec.engine_args,
    }
    if spec.block_size is not None:
        kwargs["block_size"] = spec.block_size
    if spec.tp > 1:
        kwargs["tensor_parallel_size"] = spec.tp
        kwargs["distributed_executor_backend"] = "mp"
    if spec.kv_role is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            **CONNECTOR, kv_role=spec.kv_role, kv_connector_extra_config=spec.extra_config
        )
    return LLM(**kwargs)


def worker_peek(worker: Any) -> dict[str, Any]:
    """Runs in each vLLM worker (``collective_rpc``): that rank's connector counters and the
    payload path of each live kvt link."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    if not kv_transfer_state.has_kv_transfer_group():
        return {"counters": {}, "kvt_paths": [], "threads": [], "socket_fds": []}
    connector = kv_transfer_state.get_kv_transfer_group()
    engine = getattr(connector._worker, "_engine", None)
    links = getattr(getattr(engine, "backend", None), "links", None)
    return {
        "counters": connector.transfer_counters(),
        "kvt_paths": sorted({link.path for link in links()}) if links is not None else [],
        "threads": sorted(t.name for t in threading.enumerate()),
        "socket_fds": socket_fds(),
    }


def worker_wait_store(worker: Any, timeout: float) -> bool:
    """Runs in each vLLM worker (``collective_rpc``): its KVS threads' first connects to the
    store done or failed (True without KVS); False on timeout."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    if not kv_transfer_state.has_kv_transfer_group():
        return True
    kvs = getattr(kv_transfer_state.get_kv_transfer_group()._worker, "kvs", None)
    return kvs is None or kvs.wait_first_connect(timeout)


def _sum_counters(per_rank: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for counters in per_rank:
        for key, value in counters.items():
            total[key] = total.get(key, 0) + value
    return total


def _by_source(llm: Any) -> dict[str, int]:
    return {
        m.labels["source"]: int(m.value)
        for m in llm.get_metrics()
        if m.name == "vllm:prompt_tokens_by_source"
    }


def _is_state(group: Any) -> bool:
    return "Mamba" in type(group.kv_cache_spec).__name__


class _Child:
    """The child's side: the LLM, the batches in flight, the command handlers."""

    def __init__(self, conn: Any, spec: EngineSpec) -> None:
        self.conn = conn
        self.spec = spec
        self.llm = _make_llm(spec)
        self.engine = self.llm.llm_engine
        self.core = None if spec.multiprocessing else self.engine.engine_core.engine_core
        self.batches: dict[int, dict[str, Any]] = {}  # batch id -> {"ids": [...], "outs": {}}
        self.owner: dict[str, tuple[int, str]] = {}  # given request id -> (batch, given id)
        self.given_id: dict[str, str] = {}  # vLLM's request id -> the id the test gave
        self.kv_digests: dict[str, dict[str, str]] = {}
        if self.core is not None and spec.record_kv:
            self._record_kv_at_free()

    # ---- stats
    def wait_store(self) -> None:
        """A KVS engine is ready once its lookups connected to the store: that connection (and
        its key subscription) is made on the lookup thread, after vLLM's start, and a test's
        store baseline taken before it would count it as added by the test."""
        if self.core is None:
            return
        side = getattr(self.core.scheduler.connector, "_scheduler", None)
        kvs = getattr(side, "kvs", None)
        if kvs is None:
            return
        if not kvs.wait_store(timeout=30):
            raise RuntimeError("the KVS lookups did not connect to the store within 30 s")
        if not kvs.lookups_subscribed():
            # A later lookup would subscribe, which a test's store baseline would count.
            raise RuntimeError("the KVS lookups have no key subscription to the store")
        if not all(self.llm.collective_rpc(worker_wait_store, args=(30,))):
            raise RuntimeError("the KVS worker threads did not connect to the store within 30 s")

    def stats(self) -> dict[str, Any]:
        peeks = self.llm.collective_rpc(worker_peek)
        config = self.engine.vllm_config.cache_config
        out: dict[str, Any] = {
            "rank_counters": [p["counters"] for p in peeks],
            "counters": _sum_counters([p["counters"] for p in peeks]),
            "kvt_paths": sorted({path for p in peeks for path in p["kvt_paths"]}),
            "by_source": _by_source(self.llm),
            "prefix_caching": bool(config.enable_prefix_caching),
            "threads": sorted(t.name for t in threading.enumerate()),
            "worker_socket_fds": [p.get("socket_fds", []) for p in peeks],
            "kv_cache_memory_bytes": getattr(config, "kv_cache_memory_bytes", None),
            "num_gpu_blocks": config.num_gpu_blocks,
        }
        if self.core is None:
            gauges = {m.name: m.value for m in self.llm.get_metrics() if hasattr(m, "value")}
            total = config.num_gpu_blocks - 1  # one block is vLLM's reserved null block
            usage = gauges.get("vllm:kv_cache_usage_perc", 0.0)
            out |= {
                "block_size": config.block_size,
                "total_blocks": total,
                "free_blocks": total - round(usage * total),
                "requests": int(
                    gauges.get("vllm:num_requests_running", 0)
                    + gauges.get("vllm:num_requests_waiting", 0)
                ),
                "has_state": False,
            }
            return out
        sched = self.core.scheduler
        side = getattr(sched.connector, "_scheduler", None)
        if side is not None:
            # What the next schedule() does first: give back blocks whose SEND_DONE arrived (an
            # idle engine core runs no hook, so without this the count would wait for a request).
            side._drain()
        pool = sched.kv_cache_manager.block_pool
        groups = sched.kv_cache_config.kv_cache_groups
        kvs = getattr(side, "kvs", None)
        if kvs is not None:
            out["kvs"] = dict(kvs.counters, **kvs.gauges())
        out |= {
            "free_blocks": pool.get_num_free_blocks(),
            "total_blocks": pool.num_gpu_blocks - 1,  # one block is vLLM's reserved null block
            "requests": len(sched.requests),
            "block_size": min(g.kv_cache_spec.block_size for g in groups if not _is_state(g)),
            "has_state": any(_is_state(g) for g in groups),
        }
        return out

    # ---- prompt KV, read when vLLM frees a request's blocks (before anything can reuse them)
    def _record_kv_at_free(self) -> None:
        manager = self.core.scheduler.kv_cache_manager
        free = manager.free

        def recording_free(request: Any) -> None:
            given = self.given_id.pop(request.request_id, request.request_id)
            self.kv_digests[given] = self._digest(
                manager.get_block_ids(request.request_id), request.prompt_token_ids
            )
            free(request)

        manager.free = recording_free

    def _digest(self, block_ids: tuple[list[int], ...], prompt: list[int]) -> dict[str, str]:
        """sha256 per attention layer of the KV rows of the prompt's tokens but the last (which
        D recomputes itself). Token-major layers of a single-rank engine only."""
        import hashlib

        import torch

        config = self.core.scheduler.kv_cache_config
        runner = self.core.model_executor.driver_worker.worker.model_runner
        context = runner.compilation_config.static_forward_context
        digests = {}
        for group, ids in zip(config.kv_cache_groups, block_ids, strict=True):
            block_size = group.kv_cache_spec.block_size
            for name in group.layer_names:
                kv = context[name].kv_cache
                if not isinstance(kv, torch.Tensor) or not ids:
                    continue  # a state group (a list of tensors per layer): no token rows
                token_dim = list(kv.shape[1:]).index(block_size) + 1
                rows = kv[ids].movedim(token_dim, 1).reshape(len(ids) * block_size, -1)
                digests[name] = hashlib.sha256(
                    rows[: len(prompt) - 1].contiguous().view(torch.uint8).numpy().tobytes()
                ).hexdigest()
        return digests

    # ---- batches
    def _params(self, req: Req) -> Any:
        from vllm import SamplingParams

        kv = req.kv_transfer_params
        return SamplingParams(
            temperature=0.0,
            max_tokens=req.max_tokens,
            ignore_eos=True,
            logprobs=TOP_LOGPROBS,
            extra_args=None if kv is None else {"kv_transfer_params": dict(kv)},
        )

    @staticmethod
    def _prompt(req: Req) -> dict[str, Any]:
        prompt: dict[str, Any] = {"prompt_token_ids": req.prompt}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        return prompt

    @staticmethod
    def _gen(request_id: str, out: Any) -> Gen:
        completion = out.outputs[0]
        return Gen(
            request_id,
            list(completion.token_ids),
            [{t: lp.logprob for t, lp in pos.items()} for pos in completion.logprobs or []],
            out.kv_transfer_params,
        )

    def submit(self, batch_id: int, reqs: list[Req]) -> None:
        if self.core is None:  # vLLM's own loop steps the engine: run the batch to its end
            outs = self.llm.generate(
                [self._prompt(r) for r in reqs], [self._params(r) for r in reqs], use_tqdm=False
            )
            gens = [self._gen(r.request_id, o) for r, o in zip(reqs, outs, strict=True)]
            self.conn.send(("batch", batch_id, True, gens))
            return
        self.batches[batch_id] = {"ids": [r.request_id for r in reqs], "outs": {}}
        for req in reqs:
            internal = self.engine.add_request(req.request_id, self._prompt(req), self._params(req))
            # Outputs carry the given id; the scheduler knows vLLM's own (given id + suffix).
            self.owner[req.request_id] = (batch_id, req.request_id)
            self.given_id[internal if isinstance(internal, str) else req.request_id] = (
                req.request_id
            )

    def step(self) -> None:
        for out in self.engine.step():
            if not out.finished or out.request_id not in self.owner:
                continue
            batch_id, given = self.owner.pop(out.request_id)
            batch = self.batches[batch_id]
            batch["outs"][given] = self._gen(given, out)
            if len(batch["outs"]) == len(batch["ids"]):
                del self.batches[batch_id]
                self.conn.send(("batch", batch_id, True, [batch["outs"][i] for i in batch["ids"]]))

    def has_work(self) -> bool:
        return self.core is not None and self.core.scheduler.has_requests()

    def handle(self, cmd: str, call_id: int, arg: Any) -> bool:
        """One command; False ends the loop (close)."""
        if cmd == "close":
            return False
        try:
            if cmd == "submit":
                self.submit(call_id, arg)
                return True
            if cmd == "stats":
                value = self.stats()
            elif cmd == "prompt_kv":
                value = self.kv_digests[arg]
            elif cmd == "call":
                fn, args = arg
                value = fn(self, *args)
            else:
                raise ValueError(f"unknown command {cmd}")
        except Exception:
            kind = "batch" if cmd == "submit" else "reply"
            self.conn.send((kind, call_id, False, traceback.format_exc()))
            return True
        self.conn.send(("reply", call_id, True, value))
        return True

    def run(self) -> None:
        while True:
            if self.has_work() and not self.conn.poll(_STEP_PACING_S):
                self.step()
                continue
            cmd, call_id, arg = self.conn.recv()
            if not self.handle(cmd, call_id, arg):
                return

    def shutdown(self) -> dict[str, Any]:
        """Shut the engine down; what is left in this process (and, for an engine-core process,
        in its worker after the connector shut down)."""
        info: dict[str, Any] = {}
        if self.core is None:
            (info["worker"],) = self.llm.collective_rpc(worker_shutdown_connector)
            process = self.engine.engine_core.resources.engine_manager.processes[0]
            self.engine.engine_core.shutdown()
            process.join(30)
            info["engine_core_exitcode"] = process.exitcode
        else:
            self.core = None
            self.engine.engine_core.shutdown()
        info["threads"] = sorted(t.name for t in threading.enumerate())
        return info


def socket_fds() -> list[str]:
    from harness.fds import fd_targets

    return sorted({target for target in fd_targets() if target.startswith("socket:")})


def worker_shutdown_connector(worker: Any) -> dict[str, Any]:
    """Runs in a worker: shut the connector down as vLLM does at exit (idempotent: vLLM's own
    shutdown calls it again), then what is left in the process."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    if kv_transfer_state.has_kv_transfer_group():
        kv_transfer_state.get_kv_transfer_group().shutdown()
    return {"threads": sorted(t.name for t in threading.enumerate()), "socket_fds": socket_fds()}


def _child_main(conn: Any, spec: EngineSpec) -> None:
    os.setsid()  # its own process group: kill() takes vLLM's worker processes with it
    os.environ.update(_engine_env(spec))
    import logging

    logging.basicConfig(level=logging.WARNING)
    threads_before = sorted(t.name for t in threading.enumerate())
    try:
        child = _Child(conn, spec)
        child.wait_store()
        conn.send(("reply", 0, True, {"threads_before": threads_before, **child.stats()}))
        child.run()
        conn.send(("reply", -1, True, child.shutdown()))
    except BaseException:
        conn.send(("reply", -1, False, traceback.format_exc()))
        raise


# ------------------------------------------------------------------ in the parent


class EngineError(RuntimeError):
    pass


class EngineDied(EngineError):
    """The engine's process ended without answering (a crash, or a kill: -9 with no test
    killing it is most likely the kernel's OOM killer)."""

    def __init__(self, name: str, status: str) -> None:
        super().__init__(f"{name}: the engine's process died ({status})")
        self.name = name
        self.status = status


class Batch:
    """Requests submitted together; ``result()`` waits for all of them to finish."""

    def __init__(self, engine: OfflineEngine, batch_id: int) -> None:
        self.engine = engine
        self.batch_id = batch_id

    def result(self, timeout: float = 180) -> list[Gen]:
        return self.engine._wait(("batch", self.batch_id), timeout)


class OfflineEngine:
    """Parent-side handle of one offline engine in a child process."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.name = spec.name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(child, spec), name=spec.name)
        self.process.start()
        child.close()
        self._ids = itertools.count(1)
        self._arrived: dict[tuple[str, int], tuple[bool, Any]] = {}
        self.ready_info: dict[str, Any] = {}

    @property
    def rpc_address(self) -> str:
        address = self.spec.rpc_address
        assert address is not None, f"{self.name} serves no transfer_kv"
        return address

    @property
    def tp(self) -> int:
        return self.spec.tp

    @property
    def block_size(self) -> int:
        return int(self.ready_info["block_size"])

    def _wait(self, key: tuple[str, int], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while key not in self._arrived:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not self._conn.poll(left):
                    raise TimeoutError(f"{self.name}: no answer to {key} within {timeout}s")
                kind, call_id, ok, value = self._conn.recv()
            except (EOFError, ConnectionResetError) as exc:
                raise EngineDied(self.name, self._exit_status()) from exc
            self._arrived[(kind, call_id)] = (ok, value)
            if (kind, call_id) == ("reply", -1) and not ok and key != ("reply", -1):
                # The child's last words (it failed and is exiting): whatever was awaited, it
                # will not come.
                raise EngineError(f"{self.name}: the engine failed: {value}")
        ok, value = self._arrived.pop(key)
        if not ok:
            raise EngineError(f"{self.name}: {value}")
        return value

    def _exit_status(self) -> str:
        self.process.join(5)  # its pipe closes a moment before it is reaped
        code = self.process.exitcode
        if code is None:
            return "still running, its pipe closed"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _call(self, cmd: str, arg: Any = None, timeout: float = 60) -> Any:
        call_id = next(self._ids)
        self._conn.send((cmd, call_id, arg))
        return self._wait(("reply", call_id), timeout)

    def wait_ready(self, timeout: float = 600) -> dict[str, Any]:
        if not self.ready_info:
            self.ready_info = self._wait(("reply", 0), timeout)
        return self.ready_info

    def submit(self, reqs: list[Req]) -> Batch:
        batch_id = next(self._ids)
        self._conn.send(("submit", batch_id, reqs))
        return Batch(self, batch_id)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_params: list[dict[str, Any] | None] | None = None,
        *,
        salt: str | None = None,
        timeout: float = 180,
    ) -> list[Gen]:
        kv = kv_params or [None] * len(prompts)
        reqs = [Req(p, max_tokens, k, salt) for p, k in zip(prompts, kv, strict=True)]
        return self.submit(reqs).result(timeout)

    def stats(self, timeout: float = 60) -> dict[str, Any]:
        return self._call("stats", timeout=timeout)

    def counters(self) -> dict[str, int]:
        return self.stats()["counters"]

    def prompt_kv(self, request_id: str) -> dict[str, str]:
        """Digests of the prompt KV rows of a finished request (``record_kv`` engines)."""
        return self._call("prompt_kv", request_id)

    def call(self, fn: Any, *args: Any, timeout: float = 120) -> Any:
        """``fn(child, *args)`` in the child (``child.llm`` is the ``vllm.LLM``)."""
        return self._call("call", (fn, args), timeout=timeout)

    def close(self, timeout: float = 60) -> dict[str, Any] | None:
        """Shut down; returns the threads (and sockets) left, or None if it was dead."""
        info = None
        if self.process.is_alive():
            try:
                self._conn.send(("close", 0, None))
                info = self._wait(("reply", -1), timeout)
            except (OSError, EOFError, TimeoutError, EngineError):
                info = None
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        self._conn.close()
        return info

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (its TP workers too), then unlink the
        shared-memory segments of vLLM's TP message queues and CPU collectives that it had
        mapped, as a crashed instance's supervisor would: the killed processes cannot, and
        nothing else knows them."""
        from pd_serving.launcher import group_pids

        segments: set[str] = set()
        if self.process.pid is not None:
            segments = shm.mapped_segments(group_pids(self.process.pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join()
        shm.unlink(segments)


def abort_while_pulling(child: _Child, prompt: list[int], kv_params: dict) -> bool:
    """(``call``) Add one request, step until it waits for remote KV, then abort it (D's client
    gone). True if it reached WAITING_FOR_REMOTE_KVS."""
    from vllm.v1.request import RequestStatus

    req = Req(prompt, 4, kv_params)
    engine = child.engine
    request_id = engine.add_request(req.request_id, child._prompt(req), child._params(req))
    if not isinstance(request_id, str):
        request_id = req.request_id
    scheduler = child.core.scheduler
    reached = False
    for _ in range(100):
        engine.step()
        request = scheduler.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            reached = True
            break
    engine.abort_request([request_id], internal=True)
    return reached
