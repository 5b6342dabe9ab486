from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

import pytest
from conftest import FAIL, HOLD, PING, RAW, SLOW, UNKNOWN, Other, Ping, make_server, until
from simple_rpc import (
    CallerError,
    Client,
    ConnectError,
    ConnectionLost,
    Method,
    RemoteError,
    RpcTimeout,
    Server,
)


async def test_typed_call_round_trip(server):
    async with Client(server.address) as client:
        resp = await client.call(PING, Ping(41), timeout=5.0)
        assert isinstance(resp, Ping)
        assert resp.n == 42
        assert resp.note.startswith("127.0.0.1:")  # ctx.peer


async def test_raw_bytes_method_small_and_large(server):
    async with Client(server.address) as client:
        assert await client.call(RAW, b"abc") == b"cba"
        big = bytes(range(256)) * 20_000  # ~5 MiB, exercises the preallocated path both ways
        resp = await client.call(RAW, memoryview(big))
        assert isinstance(resp, memoryview)
        assert resp == big[::-1]


async def test_concurrent_calls_share_one_connection(server, gate):
    async with Client(server.address) as client:
        results = await asyncio.gather(*(client.call(PING, Ping(i)) for i in range(500)))
        assert [r.n for r in results] == list(range(1, 501))
        # Out-of-order completion: a quick call overtakes a held one on the same connection.
        held = asyncio.ensure_future(client.call(HOLD, 1.0))
        await gate.wait_arrived(1)
        assert await client.call(SLOW, 0.0) == 0.0
        assert not held.done()
        gate.released.set()
        assert await held == 1.0
        assert server.connection_count == 1


async def test_handler_exception_becomes_remote_error_and_server_lives(server):
    async with Client(server.address) as client:
        with pytest.raises(RemoteError, match="no thanks 3") as info:
            await client.call(FAIL, Ping(3))
        assert info.value.kind == "handler_error"
        assert "ValueError" in info.value.remote_message
        assert (await client.call(PING, Ping(1))).n == 2


async def test_unknown_head_gets_error_and_connection_stays(server, caplog):
    async with Client(server.address) as client:
        assert (await client.call(PING, Ping(1))).n == 2
        with pytest.raises(RemoteError) as info:
            await client.call(UNKNOWN, Ping(1), timeout=5.0)
        assert info.value.kind == "unknown_head"
        assert "0x53520199" in info.value.remote_message
        assert (await client.call(PING, Ping(2))).n == 3
        assert client.connected
        assert server.connection_count == 1
    assert "unknown head 0x53520199" in caplog.text


async def test_body_of_wrong_schema_is_a_bad_request(server):
    # Same heads as PING but a different request schema: the server cannot decode it.
    wrong = Method("ping", PING.request_head, PING.response_head, Other, Ping)
    async with Client(server.address) as client:
        with pytest.raises(RemoteError) as info:
            await client.call(wrong, Other("hi"))
        assert info.value.kind == "bad_request"
        assert (await client.call(PING, Ping(1))).n == 2


async def test_caller_errors(server):
    async with Client(server.address) as client:
        with pytest.raises(CallerError, match="request must be Ping"):
            await client.call(PING, Other("x"))
        with pytest.raises(CallerError):
            await client.call(RAW, "not bytes")
    with pytest.raises(CallerError, match="closed"):
        await client.call(PING, Ping(1))
    with pytest.raises(CallerError, match="already registered"):
        server.register(Method("dup", PING.request_head, 0x53528FFF, Ping, Ping), lambda r, c: r)
    with pytest.raises(CallerError, match="reserved"):
        Method("bad", 0x45525221, 1, Ping, Ping)
    with pytest.raises(CallerError, match="host:port"):
        Client("nowhere")


async def test_request_over_max_frame_size_is_a_caller_error(server):
    async with Client(server.address, max_frame_size=1024) as client:
        with pytest.raises(CallerError, match="max_frame_size"):
            await client.call(RAW, b"x" * 2000)
        assert await client.call(RAW, b"x" * 100) == b"x" * 100


async def test_per_call_timeout_and_late_answer_is_dropped(server, gate, caplog):
    caplog.set_level(logging.DEBUG, logger="simple_rpc.client")
    async with Client(server.address) as client:
        with pytest.raises(RpcTimeout):
            await client.call(HOLD, 0.5, timeout=0.05)
        with pytest.raises(TimeoutError):  # RpcTimeout is a builtin TimeoutError too
            await client.call(HOLD, 0.5, timeout=0.05)
        await gate.wait_arrived(2)
        gate.released.set()  # the two late answers go out before the next call's answer
        # The connection is still good, and the late answers do not confuse later calls.
        assert await client.call(HOLD, 0.6, timeout=5.0) == 0.6
        assert (await client.call(PING, Ping(5))).n == 6
    dropped = [r for r in caplog.records if "no such pending call" in r.getMessage()]
    assert len(dropped) == 2


async def test_connection_drop_fails_all_pending_at_once_then_reconnects():
    server = make_server()
    address = await server.start("127.0.0.1", 0)
    port = int(address.rsplit(":", 1)[1])
    client = Client(address)
    assert client.connections_opened == 0
    assert client.connection == 0
    pending = [asyncio.ensure_future(client.call(SLOW, 30.0)) for _ in range(10)]
    assert (await client.call(PING, Ping(0))).n == 1
    assert client.connections_opened == 1
    assert client.connection == 1
    await server.close()
    results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 5.0)
    assert all(isinstance(r, ConnectionLost) for r in results), results
    assert not client.connected
    assert client.connection == 0  # down: no connection in use
    with pytest.raises(ConnectError):  # nothing listens any more
        await client.call(PING, Ping(1), timeout=5.0)
    server2 = make_server()
    await server2.start("127.0.0.1", port)
    try:
        assert (await client.call(PING, Ping(1), timeout=5.0)).n == 2  # reconnected lazily
        assert client.connections_opened == 2
        assert client.connection == 2
    finally:
        await client.close()
        await server2.close()
    assert client.connection == 0


async def test_cancelled_call_leaves_client_usable(server, gate):
    async with Client(server.address) as client:
        task = asyncio.ensure_future(client.call(HOLD, 0.3))
        await gate.wait_arrived(1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await client.call(PING, Ping(1))).n == 2
        gate.released.set()  # the cancelled call's answer arrives and is dropped
        assert (await client.call(HOLD, 0.4)) == 0.4


async def test_close_fails_pending_calls(server, gate):
    client = Client(server.address)
    pending = asyncio.ensure_future(client.call(HOLD, 30.0))
    await gate.wait_arrived(1)
    await client.close()
    with pytest.raises(ConnectionLost):
        await pending
    await client.close()  # idempotent


async def test_a_handler_learns_that_its_caller_left_while_it_waited(gate):
    disconnected = asyncio.Event()
    server = make_server(gate, on_disconnect=lambda peer: disconnected.set())
    await server.start("127.0.0.1", 0)
    try:
        client = Client(server.address)
        pending = asyncio.ensure_future(client.call(HOLD, 30.0))
        await gate.wait_arrived(1)
        [ctx] = gate.contexts
        assert ctx.connected
        await client.close()
        await until(disconnected.is_set, disconnected)
        assert not ctx.connected  # what the handler sees once it resumes
        gate.released.set()
        with pytest.raises(ConnectionLost):
            await pending
    finally:
        await server.close()


async def test_server_close_is_idempotent_and_start_twice_is_refused():
    server = Server()
    await server.start()
    with pytest.raises(CallerError):
        await server.start()
    await server.close()
    await server.close()


async def test_handler_that_suspends_then_raises_or_returns():
    """Handlers start eagerly; one that suspends is finished by a task, errors included."""
    late_fail = Method("late_fail", 0x53520110, 0x53528110, Ping, Ping)
    late_ok = Method("late_ok", 0x53520111, 0x53528111, Ping, Ping)

    async def on_late_fail(req: Ping, ctx) -> Ping:
        await asyncio.sleep(0.01)
        raise KeyError("gone")

    async def on_late_ok(req: Ping, ctx) -> Ping:
        for _ in range(3):
            await asyncio.sleep(0)
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, fut.set_result, req.n * 2)
        return Ping(await fut)

    server = Server()
    server.register(late_fail, on_late_fail)
    server.register(late_ok, on_late_ok)
    server.register(PING, lambda req, ctx: "not a Ping")  # wrong response type
    address = await server.start()
    try:
        async with Client(address) as client:
            with pytest.raises(RemoteError, match="KeyError"):
                await client.call(late_fail, Ping(1), timeout=5.0)
            assert (await client.call(late_ok, Ping(21), timeout=5.0)).n == 42
            with pytest.raises(RemoteError, match="handler returned str, expected Ping"):
                await client.call(PING, Ping(1), timeout=5.0)
    finally:
        await server.close()


async def test_async_handlers_run_in_their_own_task(server):
    """current_task() and asyncio.timeout() work in handlers, also before their first await,
    and a handler may itself call another server through a lazily connecting Client."""
    nested = Method("nested", 0x53520120, 0x53528120, Ping, Ping)
    seen_tasks = []

    async def on_nested(req: Ping, ctx) -> Ping:
        seen_tasks.append(asyncio.current_task())
        async with asyncio.timeout(5.0), Client(server.address) as inner:
            return await inner.call(PING, Ping(req.n))

    outer = Server()
    outer.register(nested, on_nested)
    address = await outer.start()
    try:
        async with Client(address) as client:
            results = await asyncio.gather(*(client.call(nested, Ping(i)) for i in range(3)))
        assert [r.n for r in results] == [1, 2, 3]
        assert all(t is not None for t in seen_tasks)
        assert len(set(seen_tasks)) == 3
    finally:
        await outer.close()


async def test_plain_handler_may_return_a_coroutine():
    maybe = Method("maybe", 0x53520130, 0x53528130, Ping, Ping)

    async def later(n: int) -> Ping:
        assert asyncio.current_task() is not None
        await asyncio.sleep(0.01)
        if n < 0:
            raise ValueError("negative")
        return Ping(n * 10)

    def on_maybe(req: Ping, ctx) -> Ping | Coroutine:
        return Ping(req.n) if req.n < 10 else later(req.n if req.n != 99 else -1)

    server = Server()
    server.register(maybe, on_maybe)
    address = await server.start()
    try:
        async with Client(address) as client:
            assert (await client.call(maybe, Ping(3))).n == 3
            assert (await client.call(maybe, Ping(12))).n == 120
            with pytest.raises(RemoteError, match="negative"):
                await client.call(maybe, Ping(99))
    finally:
        await server.close()


async def test_on_disconnect_names_each_peer_once_and_a_raising_hook_is_logged(caplog):
    gone: list[str] = []
    disconnected = asyncio.Event()

    def on_disconnect(peer: str) -> None:
        gone.append(peer)
        disconnected.set()
        raise RuntimeError("hook trouble")

    server = make_server(on_disconnect=on_disconnect)
    await server.start("127.0.0.1", 0)
    try:
        client = Client(server.address)
        peer = (await client.call(PING, Ping(0))).note  # the server's name for this client
        assert gone == []
        await client.close()
        await until(disconnected.is_set, disconnected)
        assert gone == [peer]
        other = Client(server.address)
        assert (await other.call(PING, Ping(1))).n == 2  # the server lives on
        await other.close()
    finally:
        await server.close()
    assert "on_disconnect" in caplog.text
    assert "hook trouble" in caplog.text
