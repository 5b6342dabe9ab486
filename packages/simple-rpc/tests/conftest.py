from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest
from simple_rpc import CallContext, Method, Server
from simple_rpc.server import _ServerConnection

# How long a test waits for something that should happen at once before it fails (a hang fails
# fast instead of at the suite's timeout).
WAIT_S = 10.0


async def until(condition: Callable[[], bool], changed: asyncio.Event) -> None:
    """The one wait of these tests: until `condition()` holds, re-checked each time `changed`
    is set (no polling, no sleep); fails after WAIT_S. For a plain event: until(ev.is_set, ev)."""
    async with asyncio.timeout(WAIT_S):
        while not condition():
            changed.clear()
            await changed.wait()


async def assert_closed_by_server(reader: asyncio.StreamReader) -> None:
    try:
        rest = await asyncio.wait_for(reader.read(), WAIT_S)
    except ConnectionResetError:  # closed with unread data: RST instead of FIN
        return
    assert rest == b""


class Gate:
    """The handler of HOLD: counts the calls that arrived and answers them once released."""

    def __init__(self) -> None:
        self.arrived = 0
        self.contexts: list[CallContext] = []
        self.changed = asyncio.Event()
        self.released = asyncio.Event()

    async def handler(self, value: float, ctx: CallContext) -> float:
        self.arrived += 1
        self.contexts.append(ctx)
        self.changed.set()
        await self.released.wait()
        return value

    async def wait_arrived(self, count: int) -> None:
        await until(lambda: self.arrived >= count, self.changed)


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
# Answered only when the server's Gate is released (make_server(gate=...)).
HOLD = Method(
    "hold",
    request_head=0x53520105,
    response_head=0x53528105,
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


def make_server(gate: Gate | None = None, **kwargs) -> Server:
    server = Server(**kwargs)
    server.register(PING, on_ping)
    server.register(RAW, on_raw)
    server.register(SLOW, on_slow)
    server.register(FAIL, on_fail)
    if gate is not None:
        server.register(HOLD, gate.handler)
    return server


def pytest_asyncio_loop_factories(config, item):
    """Run every async test on both loops (uvloop is what production uses)."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.SelectorEventLoop}


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
async def server(gate):
    srv = make_server(gate)
    await srv.start("127.0.0.1", 0)
    yield srv
    gate.released.set()
    await srv.close()


def event_after(monkeypatch: pytest.MonkeyPatch, callback: str) -> asyncio.Event:
    """An event set each time any server connection's asyncio `callback` has returned."""
    event = asyncio.Event()
    original = getattr(_ServerConnection, callback)

    def patched(conn: _ServerConnection, *args: object) -> None:
        original(conn, *args)
        event.set()

    monkeypatch.setattr(_ServerConnection, callback, patched)
    return event


@pytest.fixture
def received(monkeypatch) -> asyncio.Event:
    """Set each time any server connection has handled a read (its data_received returned)."""
    return event_after(monkeypatch, "data_received")
