from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
from conftest import PING, SLOW, Ping, make_server
from simple_rpc import CallerError, ConnectionLost, LoopThread, RemoteError, SyncClient


@pytest.fixture
def served():
    """A server running on its own LoopThread; yields (address, loop_thread)."""
    loop = LoopThread(name="test-server")
    server = make_server()
    address = loop.run(server.start("127.0.0.1", 0))
    yield address, loop
    loop.run(server.close())
    loop.close()


def test_loop_thread_submit_run_close():
    before = set(threading.enumerate())
    loop = LoopThread(name="lt")
    assert loop.run(asyncio.sleep(0, result=5)) == 5
    fut = loop.submit(asyncio.sleep(0.01, result="x"))
    assert isinstance(fut, concurrent.futures.Future)
    assert fut.result(5) == "x"
    with pytest.raises(TimeoutError):
        loop.run(asyncio.sleep(10), timeout=0.05)
    forever = loop.submit(asyncio.sleep(3600))  # cancelled by close()
    loop.close()
    loop.close()
    assert forever.cancelled()
    assert not loop.thread.is_alive()
    assert set(threading.enumerate()) == before
    with pytest.raises(CallerError):
        loop.submit(asyncio.sleep(0))


def test_sync_client_from_many_threads(served):
    address, _ = served
    with SyncClient(address) as client:

        def work(k: int) -> list[int]:
            return [client.call(PING, Ping(k * 1000 + i), timeout=5.0).n for i in range(50)]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(work, range(8)))
        assert results == [[k * 1000 + i + 1 for i in range(50)] for k in range(8)]
        fut = client.call_future(PING, Ping(1), timeout=5.0)
        assert fut.result(5).n == 2
        assert client.connected
        assert client.connection == client.connections_opened == 1
        with pytest.raises(CallerError):
            client.call(PING, "nope")


def test_sync_client_errors_and_shared_loop(served):
    address, server_loop = served
    client = SyncClient(address, loop=server_loop)  # borrows the loop: must not close it
    with pytest.raises(RemoteError):
        client.call(PING.__class__("x", 0x53520777, 0x53528777, Ping, Ping), Ping(1), timeout=5.0)
    pending = client.call_future(SLOW, 30.0)
    client.close()
    with pytest.raises(ConnectionLost):
        pending.result(5)
    assert not server_loop.closed
    with pytest.raises(CallerError):
        client.call(PING, Ping(1))


def test_borrowed_loop_closing_first_fails_pending_calls():
    server_loop = LoopThread(name="srv")
    server = make_server()
    address = server_loop.run(server.start("127.0.0.1", 0))
    client_loop = LoopThread(name="borrowed")
    client = SyncClient(address, loop=client_loop)
    assert client.call(PING, Ping(1), timeout=5.0).n == 2  # connected: the Task-free path
    pending = client.call_future(SLOW, 30.0)
    client_loop.close()  # its close hook closes the client: the pending call fails, no hang
    with pytest.raises(ConnectionLost):
        pending.result(5)
    client.close()
    server_loop.run(server.close())
    server_loop.close()
