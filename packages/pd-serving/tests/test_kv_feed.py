"""The KV-event feed over real zmq sockets: a stand-in publisher sends what vLLM's
ZmqEventPublisher sends (stand_ins.FakeKvPublisher)."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import zmq
import zmq.asyncio
from harness.fds import fd_targets
from pd_serving.kv_feed import KvEventFeed
from pd_serving.launcher import free_port
from pd_serving.prefix_index import PrefixIndex
from stand_ins import FakeKvPublisher

BS = 4
PROMPT = list(range(40, 52))  # 3 blocks
WAIT_S = 30  # only a broken feed waits this long


def _stored(tokens: list[int], blocks: int, salt: int = 0) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [salt * 1000 + b for b in range(blocks)],
        "parent_block_hash": None,
        "token_ids": tokens[: blocks * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@pytest.fixture
async def context():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


def _cached(index: PrefixIndex, instance: str) -> int:
    return index.lookup(PROMPT, [instance])[instance].local_tokens


async def _connected(feed: KvEventFeed, *instances: str) -> None:
    await asyncio.wait_for(feed.wait_for(lambda: all(feed.connected[i] for i in instances)), WAIT_S)


async def test_batches_feed_the_index_of_their_instance(context) -> None:
    ports = {"a": free_port(), "b": free_port()}
    pubs = {name: FakeKvPublisher(context, port) for name, port in ports.items()}
    index = PrefixIndex()
    batches: list[tuple[str, int]] = []
    feed = KvEventFeed(
        index,
        {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()},
        on_batch=lambda instance, batch, applied: batches.append((instance, applied.stored)),
    )
    try:
        async with feed:
            await _connected(feed, "a", "b")
            await pubs["a"].subscribed()
            await pubs["b"].subscribed()
            await pubs["a"].send(_stored(PROMPT, 2))
            await asyncio.wait_for(feed.wait_for(lambda: _cached(index, "a") == 8), WAIT_S)
            assert _cached(index, "b") == 0
            assert ("a", 2) in batches
            await pubs["b"].send(_stored(PROMPT, 3, salt=7))
            await asyncio.wait_for(feed.wait_for(lambda: _cached(index, "b") == 12), WAIT_S)
    finally:
        for pub in pubs.values():
            pub.close()


async def test_a_message_that_does_not_decode_forgets_that_instance_only(
    context, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    pub = FakeKvPublisher(context, port)
    index = PrefixIndex()
    errors: list[str] = []
    endpoint = f"tcp://127.0.0.1:{port}"
    feed = KvEventFeed(index, {"a": endpoint}, on_error=lambda i, exc: errors.append(i))
    try:
        async with feed:
            await pub.subscribed()
            await pub.send(_stored(PROMPT, 3))
            await asyncio.wait_for(feed.wait_for(lambda: _cached(index, "a") == 12), WAIT_S)
            with caplog.at_level(logging.WARNING, logger="pd_serving.kv_feed"):
                await pub.send(raw=b"\xc1 not msgpack")
                await asyncio.wait_for(feed.wait_for(lambda: bool(errors)), WAIT_S)
            assert errors == ["a"]
            assert _cached(index, "a") == 0
            (record,) = [r for r in caplog.records if r.name == "pd_serving.kv_feed"]
            assert "KV events of a" in record.getMessage()
            assert endpoint in record.getMessage()
            # The feed goes on: the next batch is a new baseline.
            await pub.send(_stored(PROMPT, 1))
            await asyncio.wait_for(feed.wait_for(lambda: _cached(index, "a") == 4), WAIT_S)
    finally:
        pub.close()


async def test_a_publisher_that_goes_away_is_forgotten_and_its_successor_followed(
    context,
) -> None:
    port = free_port()
    pub = FakeKvPublisher(context, port)
    index = PrefixIndex()
    changes: list[bool] = []
    feed = KvEventFeed(
        index,
        {"a": f"tcp://127.0.0.1:{port}"},
        on_connection=lambda instance, up: changes.append(up),
    )
    async with feed:
        await _connected(feed, "a")
        await pub.subscribed()
        await pub.send(_stored(PROMPT, 3))
        await asyncio.wait_for(feed.wait_for(lambda: _cached(index, "a") == 12), WAIT_S)
        pub.close()  # the instance died
        await asyncio.wait_for(feed.wait_for(lambda: not feed.connected["a"]), WAIT_S)
        assert _cached(index, "a") == 0
        pub = FakeKvPublisher(context, port)  # restarted: sequence numbers from 0 again
        try:
            await _connected(feed, "a")
            await pub.subscribed()
            await pub.send(_stored(PROMPT, 2))
            await asyncio.wait_for(feed.wait_for(lambda: _cached(index, "a") == 8), WAIT_S)
        finally:
            pub.close()
    assert changes[:3] == [True, False, True]


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))  # zmq's I/O threads are not Python threads


async def test_close_leaves_no_descriptor_thread_or_task() -> None:
    fds_before, threads_before = len(fd_targets()), _os_threads()
    feed = KvEventFeed(PrefixIndex(), {"a": f"tcp://127.0.0.1:{free_port()}"})
    feed.start()
    assert _os_threads() > threads_before
    assert len(fd_targets()) > fds_before
    await feed.close()
    assert _os_threads() == threads_before
    assert len(fd_targets()) == fds_before
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-")]
    await feed.close()  # idempotent
