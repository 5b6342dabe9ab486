from __future__ import annotations

import asyncio

import msgspec
import pytest
from simple_rpc import CallContext, Method, Server


class Ping(msgspec.Struct):
    n: int
    note: str = ""


class Other(msgspec.Struct):
    text: str


PING = Method(
    "ping", request_head=0x53520101, response_head=0x53528101, request_type=Ping, response_type=Ping
)
RAW = Method(
    "raw",
    request_head=0x53520102,
    response_head=0x53528102,
    request_type=bytes,
    response_type=bytes,
)
SLOW = Method(
    "slow",
    request_head=0x53520103,
    response_head=0x53528103,
    request_type=float,
    response_type=float,
)
FAIL = Method(
    "fail", request_head=0x53520104, response_head=0x53528104, request_type=Ping, response_type=Ping
)
# Registered nowhere: the server answers it with unknown_head.
UNKNOWN = Method(
    "unknown",
    request_head=0x53520199,
    response_head=0x53528199,
    request_type=Ping,
    response_type=Ping,
)


async def on_ping(req: Ping, ctx: CallContext) -> Ping:
    return Ping(req.n + 1, note=ctx.peer)


def on_raw(req: memoryview, ctx: CallContext) -> bytes:
    # A plain (non-async) handler: runs inline on the loop.
    return bytes(req)[::-1]


async def on_slow(seconds: float, ctx: CallContext) -> float:
    await asyncio.sleep(seconds)
    return seconds


async def on_fail(req: Ping, ctx: CallContext) -> Ping:
    raise ValueError(f"no thanks {req.n}")


def make_server(**kwargs) -> Server:
    server = Server(**kwargs)
    server.register(PING, on_ping)
    server.register(RAW, on_raw)
    server.register(SLOW, on_slow)
    server.register(FAIL, on_fail)
    return server


def pytest_asyncio_loop_factories(config, item):
    """Run every async test on both loops (uvloop is what production uses)."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.SelectorEventLoop}


@pytest.fixture
async def server():
    srv = make_server()
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.close()
