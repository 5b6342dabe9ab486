"""simple-rpc against pyzmq (DEALER/ROUTER on zmq.asyncio, REQ/REP sync) and grpcio aio, one run.

Each measurement runs one server subprocess and one fresh client subprocess, alone: nothing of
another competitor (grpc's and zmq's background threads, say) lives in either process or beside
them. Every competitor encodes/decodes the same ~100-byte msgspec request and answer on both sides,
and every asyncio side runs on uvloop when it is installed. Measured: round trip p50/p99 with one
call at a time, and calls/s with 64 calls in flight on one connection/socket/channel. Rounds
alternate the competitors; the table reports the median over rounds.

    python packages/simple-rpc/benchmarks/bench_rpc.py            # full: table + results/rpc.json
    python packages/simple-rpc/benchmarks/bench_rpc.py --smoke    # seconds; CI
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import simple_rpc
from simple_rpc import CallContext, Client, Method, Server, SyncClient, new_event_loop

RESULTS = Path(__file__).parent / "results" / "rpc.json"
IN_FLIGHT = 64


class BenchRequest(msgspec.Struct):
    request_id: str
    peer: str
    block_ids: list[int]
    layer: int


class BenchResponse(msgspec.Struct):
    request_id: str
    accepted: int
    ok: bool


BENCH = Method(
    "bench",
    request_head=0x53520F01,
    response_head=0x53528F01,
    request_type=BenchRequest,
    response_type=BenchResponse,
)
REQUEST = BenchRequest(
    request_id="cmpl-3f6c2a7e9b1d4c58a0e2",
    peer="10.0.0.17:41234",
    block_ids=list(range(1000, 1032)),
    layer=7,
)
_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(BenchRequest).decode
_decode_response = msgspec.msgpack.Decoder(BenchResponse).decode
REQUEST_BYTES = _encode(REQUEST)


def answer(request: BenchRequest) -> BenchResponse:
    return BenchResponse(request_id=request.request_id, accepted=len(request.block_ids), ok=True)


def answer_bytes(payload: bytes) -> bytes:
    """The same work for the byte-oriented competitors: decode, answer, encode."""
    return _encode(answer(_decode_request(payload)))


# ---------------------------------------------------------------------------------------------
# Servers (each in its own subprocess: `bench_rpc.py --serve KIND`; prints its port, then
# serves until terminated).


async def serve_simple_rpc(inline: bool = False) -> None:
    async def on_bench(request: BenchRequest, ctx: CallContext) -> BenchResponse:
        return answer(request)

    def on_bench_inline(request: BenchRequest, ctx: CallContext) -> BenchResponse:
        return answer(request)

    server = Server()
    server.register(BENCH, on_bench_inline if inline else on_bench)
    address = await server.start("127.0.0.1", 0)
    print(address.rsplit(":", 1)[1], flush=True)
    await asyncio.Event().wait()


async def serve_zmq_router() -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    while True:
        ident, call_id, payload = await sock.recv_multipart()
        await sock.send_multipart([ident, call_id, answer_bytes(payload)])


def serve_zmq_rep() -> None:
    import zmq

    sock = zmq.Context().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    while True:
        sock.send(answer_bytes(sock.recv()))


async def serve_grpc() -> None:
    import grpc

    async def handler(payload: bytes, context: object) -> bytes:
        return answer_bytes(payload)

    server = grpc.aio.server()
    generic = grpc.method_handlers_generic_handler(
        "bench.Bench", {"Call": grpc.unary_unary_rpc_method_handler(handler)}
    )
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def serve_simple_rpc_inline() -> None:
    await serve_simple_rpc(inline=True)


SERVERS: dict[str, Callable[[], object]] = {
    "simple_rpc": serve_simple_rpc,
    "simple_rpc_inline": serve_simple_rpc_inline,
    "zmq_router": serve_zmq_router,
    "zmq_rep": serve_zmq_rep,
    "grpc": serve_grpc,
}


def run_server(kind: str) -> None:
    target = SERVERS[kind]
    if asyncio.iscoroutinefunction(target):
        loop = new_event_loop()
        loop.run_until_complete(target())
    else:
        target()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_prefix(cpus: set[int] | None) -> list[str]:
    """`taskset` prefix that runs a command on ``cpus`` (nothing when None)."""
    return [] if cpus is None else ["taskset", "-c", ",".join(map(str, sorted(cpus)))]


class ServerProcess:
    """One benchmark server subprocess; owns it and terminates it on close()."""

    def __init__(self, kind: str, cpus: set[int] | None = None) -> None:
        self.kind = kind
        self.proc = subprocess.Popen(
            [*pin_prefix(cpus), sys.executable, __file__, "--serve", kind],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()  # blocks until the server listens
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"{kind} server did not start (got {line!r})")
        self.port = int(line)

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.proc.stdout.close()


# ---------------------------------------------------------------------------------------------
# Clients. Each returns an async "one call" function, plus its own cleanup.

AsyncCall = Callable[[], Awaitable[object]]


async def client_simple_rpc(port: int) -> tuple[AsyncCall, Callable[[], Awaitable[None]]]:
    client = Client(f"127.0.0.1:{port}")
    await client.connect()

    async def call() -> object:
        return await client.call(BENCH, REQUEST)

    return call, client.close


async def client_zmq_dealer(port: int) -> tuple[AsyncCall, Callable[[], Awaitable[None]]]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    loop = asyncio.get_running_loop()
    pending: dict[bytes, asyncio.Future] = {}
    counter = iter(range(1 << 62))

    async def receive() -> None:
        while True:
            call_id, payload = await sock.recv_multipart()
            pending.pop(call_id).set_result(_decode_response(payload))

    receiver = asyncio.ensure_future(receive())

    async def call() -> object:
        call_id = next(counter).to_bytes(8, "little")
        future = loop.create_future()
        pending[call_id] = future
        await sock.send_multipart([call_id, _encode(REQUEST)])
        return await future

    async def close() -> None:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
        sock.close(linger=0)
        ctx.term()

    return call, close


async def client_grpc(port: int) -> tuple[AsyncCall, Callable[[], Awaitable[None]]]:
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await channel.channel_ready()
    stub = channel.unary_unary("/bench.Bench/Call")

    async def call() -> object:
        return _decode_response(await stub(_encode(REQUEST)))

    return call, channel.close


async def measure_async(
    make_client: Callable, server: ServerProcess, seq_calls: int, seconds: float
) -> dict:
    call, close = await make_client(server.port)
    try:
        for _ in range(min(200, seq_calls)):  # warm-up (connection, caches, JIT-free paths)
            await call()
        latencies = []
        clock = time.perf_counter_ns
        for _ in range(seq_calls):
            start = clock()
            await call()
            latencies.append(clock() - start)
        result = latency_stats(latencies)
        if seconds <= 0:
            return result
        server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
        calls, elapsed = await throughput(call, seconds)
        cpu = server.cpu_seconds() - server_cpu + time.process_time() - client_cpu
        result["calls_per_s"] = calls / elapsed
        # Load-independent cost: CPU of both processes (all threads) per call, 64 in flight.
        result["cpu_us_per_call"] = cpu / calls * 1e6
        return result
    finally:
        await close()


async def throughput(call: AsyncCall, seconds: float) -> tuple[int, float]:
    loop = asyncio.get_running_loop()
    done = 0
    deadline = loop.time() + seconds

    async def worker() -> None:
        nonlocal done
        while loop.time() < deadline:
            await call()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
    return done, time.perf_counter() - start


def measure_sync_simple_rpc(port: int, seq_calls: int) -> dict:
    with SyncClient(f"127.0.0.1:{port}") as client:
        for _ in range(min(200, seq_calls)):
            client.call(BENCH, REQUEST)
        latencies = []
        clock = time.perf_counter_ns
        for _ in range(seq_calls):
            start = clock()
            client.call(BENCH, REQUEST)
            latencies.append(clock() - start)
    return latency_stats(latencies)


def measure_zmq_req(port: int, seq_calls: int) -> dict:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(min(200, seq_calls)):
            sock.send(_encode(REQUEST))
            _decode_response(sock.recv())
        latencies = []
        clock = time.perf_counter_ns
        for _ in range(seq_calls):
            start = clock()
            sock.send(_encode(REQUEST))
            _decode_response(sock.recv())
            latencies.append(clock() - start)
    finally:
        sock.close(linger=0)
        ctx.term()
    return latency_stats(latencies)


def latency_stats(latencies_ns: list[int]) -> dict:
    ordered = sorted(latencies_ns)
    return {
        "p50_us": ordered[len(ordered) // 2] / 1000,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000,
        "calls": len(ordered),
    }


# ---------------------------------------------------------------------------------------------

# (row name, server kind, how the client runs)
COMPETITORS = [
    ("simple-rpc Client (async)", "simple_rpc", "async:simple_rpc"),
    ("simple-rpc Client, plain-def handler", "simple_rpc_inline", "async:simple_rpc"),
    ("simple-rpc SyncClient (plain thread)", "simple_rpc", "sync:simple_rpc"),
    ("pyzmq DEALER/ROUTER (zmq.asyncio)", "zmq_router", "async:zmq_dealer"),
    ("pyzmq REQ/REP (sync)", "zmq_rep", "sync:zmq_req"),
    ("grpcio aio unary (generic bytes)", "grpc", "async:grpc"),
]
ASYNC_CLIENTS = {
    "simple_rpc": client_simple_rpc,
    "zmq_dealer": client_zmq_dealer,
    "grpc": client_grpc,
}


def available(kind: str) -> bool:
    module = {"zmq_router": "zmq", "zmq_rep": "zmq", "grpc": "grpc"}.get(kind)
    if module is None:
        return True
    try:
        __import__(module)
    except ImportError:
        return False
    return True


class MeasuredServer:
    """The server as seen from a client subprocess: its port and its CPU clock."""

    def __init__(self, port: int, pid: int) -> None:
        self.port = port
        self.pid = pid

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)


def measure_in_this_process(how: str, port: int, pid: int, seq_calls: int, seconds: float) -> dict:
    mode, client = how.split(":")
    if mode == "sync":
        if client == "simple_rpc":
            return measure_sync_simple_rpc(port, seq_calls)
        return measure_zmq_req(port, seq_calls)
    loop = new_event_loop()
    try:
        return loop.run_until_complete(
            measure_async(ASYNC_CLIENTS[client], MeasuredServer(port, pid), seq_calls, seconds)
        )
    finally:
        loop.close()


def measure_once(
    how: str, kind: str, seq_calls: int, seconds: float, cpus: set[int] | None
) -> dict:
    server = ServerProcess(kind, cpus)
    try:
        command = [*pin_prefix(cpus), sys.executable, __file__, "--measure", how]
        command += ["--port", str(server.port)]
        command += ["--server-pid", str(server.proc.pid), "--calls", str(seq_calls)]
        command += ["--seconds", str(seconds)]
        out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        server.close()


def run_round(kinds: set[str], seq_calls: int, seconds: float) -> dict:
    """Each competitor twice: server and client on one core (sequential latency only: the
    software's own cost), then wherever the kernel puts them (latency and throughput). On this
    2-vCPU VM, waking an idle vCPU costs about 40 µs, so with the machine idle the default
    placement's round trip is mostly two such wake-ups, whatever the RPC does."""
    results = {}
    one_core = {min(os.sched_getaffinity(0))}
    for name, kind, how in COMPETITORS:
        if kind not in kinds:
            continue
        pinned = measure_once(how, kind, seq_calls, 0.0, one_core)
        row = measure_once(how, kind, seq_calls, seconds, None)
        row["p50_us_one_core"] = pinned["p50_us"]
        row["p99_us_one_core"] = pinned["p99_us"]
        results[name] = row
    return results


def median_of(rounds: list[dict]) -> dict:
    table = {}
    for name in rounds[0]:
        row = {}
        for key in rounds[0][name]:
            row[key] = statistics.median(r[name][key] for r in rounds)
        table[name] = row
    return table


# Ours, by server handler style: `async def` (a Task per call) and plain `def` (inline).
OURS = {
    "async handler": "simple-rpc Client (async)",
    "plain handler": "simple-rpc Client, plain-def handler",
}
DEALER = "pyzmq DEALER/ROUTER (zmq.asyncio)"
REQ_REP = "pyzmq REQ/REP (sync)"
GRPC = "grpcio aio unary (generic bytes)"
# (label, competitor, metric, target or None (reported only), sense)
CHECKS = [
    ("p50 one core vs pyzmq DEALER/ROUTER", DEALER, "p50_us_one_core", 0.3, "<="),
    ("p50 one core vs pyzmq REQ/REP", REQ_REP, "p50_us_one_core", 0.6, "<="),
    ("p50 one core vs grpcio aio", GRPC, "p50_us_one_core", None, "<="),
    ("p50 vs pyzmq DEALER/ROUTER", DEALER, "p50_us", 0.3, "<="),
    ("p50 vs pyzmq REQ/REP", REQ_REP, "p50_us", 0.6, "<="),
    ("p50 vs grpcio aio", GRPC, "p50_us", None, "<="),
    ("calls/s vs pyzmq DEALER/ROUTER", DEALER, "calls_per_s", 5, ">="),
    ("calls/s vs grpcio aio", GRPC, "calls_per_s", 15, ">="),
    ("CPU/call vs pyzmq DEALER/ROUTER", DEALER, "cpu_us_per_call", None, "<="),
    ("CPU/call vs grpcio aio", GRPC, "cpu_us_per_call", None, "<="),
]


def ratios(rounds: list[dict]) -> dict:
    """Ours / competitor within each round (same load), then the median over rounds."""
    out = {}
    for style, ours in OURS.items():
        for label, other, key, target, sense in CHECKS:
            if other not in rounds[0]:
                continue
            per_round = [r[ours][key] / r[other][key] for r in rounds]
            ratio = statistics.median(per_round)
            row: dict = {
                "ratio": round(ratio, 3),
                "min": round(min(per_round), 3),
                "max": round(max(per_round), 3),
            }
            if target is not None:
                row["target"] = f"{sense} {target}"
                row["met"] = ratio <= target if sense == "<=" else ratio >= target
            out[f"{label} ({style})"] = row
    return out


def print_table(table: dict, ratio_rows: dict) -> None:
    header = (
        f"{'variant':38} {'p50 1core':>9} {'p99 1core':>9} {'p50 us':>8} {'p99 us':>8}"
        f" {'calls/s @64':>12} {'CPU us/call':>12}"
    )
    print("\n" + header)
    for name, row in table.items():
        cps = f"{row['calls_per_s']:,.0f}" if "calls_per_s" in row else "-"
        cpu = f"{row['cpu_us_per_call']:.1f}" if "cpu_us_per_call" in row else "-"
        print(
            f"{name:38} {row['p50_us_one_core']:9.1f} {row['p99_us_one_core']:9.1f}"
            f" {row['p50_us']:8.1f} {row['p99_us']:8.1f} {cps:>12} {cpu:>12}"
        )
    print()
    for label, r in ratio_rows.items():
        verdict = ""
        if "target" in r:
            verdict = f"target {r['target']:6}  {'met' if r['met'] else 'MISSED'}"
        spread = f"[{r['min']:.3f} .. {r['max']:.3f}]"
        print(f"{label:50} {r['ratio']:8.3f} {spread:18}  {verdict}")


def markdown(report: dict) -> str:
    """The README's table, rendered from a results JSON."""
    lines = [
        "| variant | p50 µs, one core | p99 µs, one core | p50 µs | p99 µs"
        " | calls/s, 64 in flight | CPU µs/call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["table"].items():
        cps = f"{row['calls_per_s']:,.0f}" if "calls_per_s" in row else "—"
        cpu = f"{row['cpu_us_per_call']:.1f}" if "cpu_us_per_call" in row else "—"
        lines.append(
            f"| {name} | {row['p50_us_one_core']:.1f} | {row['p99_us_one_core']:.1f}"
            f" | {row['p50_us']:.1f} | {row['p99_us']:.1f} | {cps} | {cpu} |"
        )
    lines += [
        "",
        "| ours / theirs | median | rounds' range | target | |",
        "|---|---:|---:|---|---|",
    ]
    for label, r in report["ratios"].items():
        met = ("met" if r["met"] else "**missed**") if "target" in r else ""
        spread = f"{r['min']:.2f} to {r['max']:.2f}"
        target = r.get("target", "").replace("<=", "≤").replace(">=", "≥")
        lines.append(f"| {label} | {r['ratio']:.3f} | {spread} | {target} | {met} |")
    load = ", ".join(f"{x:.1f}" for x in report["loadavg_at_end"])
    lines += [
        "",
        f"{report['rounds']} rounds, {report['sequential_calls_per_round']} sequential calls and "
        f"{report['throughput_seconds_per_round']:.1f} s at 64 in flight per competitor per round; "
        f"load average at the end {load} on {report['cpus']} CPUs.",
    ]
    return "\n".join(lines)


def versions() -> dict:
    out = {
        "python": platform.python_version(),
        "simple_rpc": simple_rpc.__version__,
        "msgspec": msgspec.__version__,
    }
    for module in ("uvloop", "zmq", "grpc"):
        try:
            out[module] = __import__(module).__version__
        except ImportError:
            out[module] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, for CI")
    parser.add_argument("--serve", choices=sorted(SERVERS), help=argparse.SUPPRESS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # client subprocess: "mode:client"
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--markdown", action="store_true", help="print the README table from results/rpc.json"
    )
    # Many short rounds: the shared machine's load changes by the second, and each ratio is
    # taken within a round.
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls per round")
    parser.add_argument("--seconds", type=float, default=1.5, help="64-in-flight phase per round")
    args = parser.parse_args()
    if args.serve:
        run_server(args.serve)
        return
    if args.measure:
        result = measure_in_this_process(
            args.measure, args.port, args.server_pid, args.calls, args.seconds
        )
        print(json.dumps(result))
        return
    if args.markdown:
        print(markdown(json.loads(RESULTS.read_text())))
        return
    if args.smoke:
        args.rounds, args.calls, args.seconds = 1, 200, 0.2

    kinds = {kind for _, kind, _ in COMPETITORS if available(kind)}
    rounds = []
    for i in range(args.rounds):
        rounds.append(run_round(kinds, args.calls, args.seconds))
        print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    table = median_of(rounds)
    ratio_rows = ratios(rounds)
    print_table(table, ratio_rows)
    if args.smoke:
        return
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "rpc round trip and throughput, ~100-byte msgspec request",
        "request_bytes": len(REQUEST_BYTES),
        "response_bytes": len(_encode(answer(REQUEST))),
        "in_flight": IN_FLIGHT,
        "rounds": args.rounds,
        "sequential_calls_per_round": args.calls,
        "throughput_seconds_per_round": args.seconds,
        "event_loop": "uvloop" if versions()["uvloop"] else "asyncio",
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),
        "versions": versions(),
        "table": table,
        "per_round": rounds,
        "ratios": ratio_rows,
        "command": (
            "flock /tmp/bench.lock uv run --frozen python "
            "packages/simple-rpc/benchmarks/bench_rpc.py"
        ),
        "threads_at_end": threading.active_count(),
    }
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
