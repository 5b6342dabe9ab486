"""close() leaves nothing behind: no threads, no file descriptors, no tasks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import threading

from conftest import HOLD, PING, Gate, Ping, make_server
from simple_rpc import Client, ConnectionLost, LoopThread, SyncClient


def fd_count() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


async def test_async_server_and_clients_leave_no_fds_or_tasks():
    # libuv opens one /dev/null per loop on its first listen (its EMFILE reserve fd, owned by
    # the loop): warm up once so only what we own is counted.
    warm = make_server()
    await warm.start("127.0.0.1", 0)
    await warm.close()
    fds = fd_count()
    tasks = asyncio.all_tasks()
    gate = Gate()  # never released
    server = make_server(gate)
    address = await server.start("127.0.0.1", 0)
    clients = [Client(address) for _ in range(5)]
    for client in clients:
        assert (await client.call(PING, Ping(1))).n == 2
    # Handlers still running when the server closes are cancelled; their callers see the drop.
    hanging = [asyncio.ensure_future(c.call(HOLD, 60.0)) for c in clients]
    await gate.wait_arrived(len(clients))
    await server.close()
    results = await asyncio.gather(*hanging, return_exceptions=True)
    assert all(isinstance(r, ConnectionLost) for r in results)
    for client in clients:
        await client.close()
    assert asyncio.all_tasks() == tasks
    assert fd_count() == fds


def test_threads_and_fds_after_sync_close():
    threads = set(threading.enumerate())
    fds = fd_count()
    server_loop = LoopThread(name="leak-server")
    server = make_server()
    address = server_loop.run(server.start("127.0.0.1", 0))
    clients = [SyncClient(address) for _ in range(3)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: clients[i % 3].call(PING, Ping(i), timeout=5.0), range(60)))
    for client in clients:
        client.close()
        client.close()
    server_loop.run(server.close())
    server_loop.close()
    assert set(threading.enumerate()) == threads
    assert fd_count() == fds


async def test_server_close_cancels_handlers_of_dropped_connections():
    tasks = asyncio.all_tasks()
    gate = Gate()  # never released
    server = make_server(gate)
    address = await server.start("127.0.0.1", 0)
    client = Client(address)
    pending = asyncio.ensure_future(client.call(HOLD, 60.0))
    await gate.wait_arrived(1)
    await client.close()  # the handler keeps running: its connection is gone, the server owns it
    assert isinstance((await asyncio.gather(pending, return_exceptions=True))[0], ConnectionLost)
    assert len(asyncio.all_tasks()) == len(tasks) + 1
    await server.close()
    assert asyncio.all_tasks() == tasks
