"""One vLLM instance (offline LLM) in a spawned subprocess, driven over a pipe.

The child steps its engine the way vLLM's engine-core busy loop does: while the scheduler still
has work (e.g. finished requests whose blocks the connector holds) it keeps stepping, pacing
itself by waiting on the pipe for a few milliseconds; when idle it blocks on the pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from hybrid_connector.tiny_model import OFFLINE_KV_CACHE_BYTES, OFFLINE_VLLM_ENV

ENV = OFFLINE_VLLM_ENV

_STEP_PACING_S = 0.002


@dataclass
class GenResult:
    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _stats(llm: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import kv_transfer_state

    sched = _core(llm).scheduler
    pool = sched.kv_cache_manager.block_pool
    side = getattr(sched.connector, "_scheduler", None)
    if side is not None:
        # What the next schedule() does first: give back blocks whose SEND_DONE arrived (an
        # idle engine core runs no hook, so without this the count would wait for a request).
        side._drain()
    counters: dict[str, int] = {}
    kvt_paths: list[str] = []
    if kv_transfer_state.has_kv_transfer_group():
        connector = kv_transfer_state.get_kv_transfer_group()
        counters = connector.transfer_counters()
        # Test-only peek: the payload path of each live kvt link (Link.path) of this worker.
        engine = getattr(connector._worker, "_engine", None)
        links = getattr(getattr(engine, "backend", None), "links", None)
        kvt_paths = sorted({link.path for link in links()}) if links is not None else []
    return {
        "free_blocks": pool.get_num_free_blocks(),
        # One block is vLLM's reserved null block.
        "total_blocks": pool.num_gpu_blocks - 1,
        "requests": len(sched.requests),
        "block_size": sched.block_size,
        "counters": counters,
        "kvt_paths": kvt_paths,
        "threads": sorted(t.name for t in threading.enumerate()),
    }


def _abort_while_pulling(llm: Any, prompt: list[int], kv_params: dict) -> bool:
    """Add one request, step until it waits for remote KV, then abort it (client gone)."""
    import uuid

    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    params = SamplingParams(
        temperature=0.0, max_tokens=4, extra_args={"kv_transfer_params": kv_params}
    )
    engine = llm.llm_engine
    request_id = engine.add_request(f"abort-{uuid.uuid4()}", {"prompt_token_ids": prompt}, params)
    scheduler = _core(llm).scheduler
    reached = False
    for _ in range(100):
        engine.step()
        request = scheduler.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            reached = True
            break
    engine.abort_request([request_id], internal=True)
    return reached


def _instance_main(conn: Any, model: str, kv_config: dict[str, Any] | None, opts: dict) -> None:
    os.environ.update(ENV)
    import logging

    logging.basicConfig(level=logging.WARNING)
    from vllm import LLM, SamplingParams

    llm = None
    threads_before = sorted(t.name for t in threading.enumerate())
    try:
        kwargs: dict[str, Any] = {
            "model": model,
            "enforce_eager": True,
            "max_model_len": opts.get("max_model_len", 1024),
            "max_num_seqs": 8,
            "seed": 0,
            "enable_prefix_caching": opts.get("enable_prefix_caching", False),
            "kv_cache_memory_bytes": OFFLINE_KV_CACHE_BYTES,
        }
        if kv_config is not None:
            from vllm.config import KVTransferConfig

            kwargs["kv_transfer_config"] = KVTransferConfig(**kv_config)
        llm = LLM(**kwargs)
        conn.send(("ready", {"threads_before": threads_before, **_stats(llm)}))
        core = _core(llm)
        while True:
            # Busy only while the scheduler has work; otherwise block on the pipe.
            if core.scheduler.has_requests() and not conn.poll(_STEP_PACING_S):
                llm.llm_engine.step()
                continue
            cmd, arg = conn.recv()
            if cmd == "generate":
                prompts = [{"prompt_token_ids": ids} for ids in arg["prompts"]]
                params = [
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=arg["max_tokens"],
                        ignore_eos=True,
                        extra_args={"kv_transfer_params": kv} if kv is not None else None,
                    )
                    for kv in arg["kv_transfer_params"]
                ]
                outs = llm.generate(prompts, params, use_tqdm=False)
                conn.send(
                    (
                        "ok",
                        [
                            GenResult(list(o.outputs[0].token_ids), o.kv_transfer_params)
                            for o in outs
                        ],
                    )
                )
            elif cmd == "abort_while_pulling":
                conn.send(
                    ("ok", _abort_while_pulling(llm, arg["prompt"], arg["kv_transfer_params"]))
                )
            elif cmd == "stats":
                conn.send(("ok", _stats(llm)))
            elif cmd == "close":
                break
            else:
                conn.send(("error", f"unknown command {cmd}"))
        del core
        llm.llm_engine.engine_core.shutdown()
        conn.send(("ok", {"threads": sorted(t.name for t in threading.enumerate())}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


class Instance:
    """Parent-side handle of one vLLM instance in a child process."""

    def __init__(
        self,
        name: str,
        model: str,
        kv_config: dict[str, Any] | None,
        *,
        opts: dict | None = None,
    ) -> None:
        self.name = name
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_instance_main, args=(child, model, kv_config, opts or {}), name=name
        )
        self.process.start()
        child.close()
        self.ready_info: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 300) -> dict[str, Any]:
        self.ready_info = self._reply(timeout)
        return self.ready_info

    def _reply(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout}s")
        status, value = self._conn.recv()
        if status not in {"ok", "ready"}:
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def submit_generate(
        self, prompts: list[list[int]], max_tokens: int, kv_params: list[dict | None]
    ) -> None:
        self._conn.send(
            (
                "generate",
                {"prompts": prompts, "max_tokens": max_tokens, "kv_transfer_params": kv_params},
            )
        )

    def result(self, timeout: float = 120) -> Any:
        return self._reply(timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_params: list[dict | None] | None = None,
        timeout: float = 120,
    ) -> list[GenResult]:
        self.submit_generate(prompts, max_tokens, kv_params or [None] * len(prompts))
        return self.result(timeout)

    def abort_while_pulling(self, prompt: list[int], kv_params: dict) -> bool:
        self._conn.send(
            ("abort_while_pulling", {"prompt": prompt, "kv_transfer_params": kv_params})
        )
        return self._reply(60)

    def stats(self, timeout: float = 30) -> dict[str, Any]:
        self._conn.send(("stats", None))
        return self._reply(timeout)

    def close(self, timeout: float = 60) -> dict[str, Any] | None:
        info = None
        if self.process.is_alive():
            try:
                self._conn.send(("close", None))
                info = self._reply(timeout)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                info = None
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()
        return info

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self._conn.close()
