"""The Redis store's writer stops when cancelled, even if a write swallowed the cancel.

Seen once in a ``--workers 2 --redis`` soak (issue 25): after SIGTERM a worker never
exited; ``asyncio.run`` sat in ``_cancel_all_tasks`` with ``RedisStore._writer``
*cancelling* yet awaiting ``queue.get()`` again: a cancellation had been swallowed below
a ``pipeline.execute()`` and the writer went back to its loop.  The write below stands
in for that library code.
"""

from __future__ import annotations

import asyncio
import types

from redisfix import RedisServer
from relay.test_health_relay import until
from relay.test_redis_store import fleet_config
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer
from unbroken.relay.store import RedisStore


async def test_a_swallowed_cancellation_still_stops_the_writer(
    redis_server: RedisServer, mock: MockProvider
) -> None:
    cfg = fleet_config([mock.url], redis_server.url)
    async with RelayServer(cfg) as server:
        store = server.relay.store
        assert isinstance(store, RedisStore)
        writing = asyncio.Event()

        async def swallowing_write(key: str, failed: bool) -> None:
            writing.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # what a library below a write may do

        store._write_count = swallowing_write  # type: ignore[method-assign]
        store._queue.put_nowait(("count", ("k", False)))
        store._queue.put_nowait(("count", ("k", True)))
        await asyncio.wait_for(writing.wait(), 5)
        writer = next(t for t in store._tasks if _runs(t, "_writer"))
        writer.cancel()
        await until(writer.done, cap=5)
        assert writer.cancelled()


async def test_a_cancellation_swallowed_below_a_read_still_stops_the_reader(
    redis_server: RedisServer, mock: MockProvider
) -> None:
    """The same for the reader (`RedisStore._run`): seen as a test run's teardown that
    hung for two minutes in ``_cancel_all_tasks`` on a loaded machine, the reader
    *cancelling* and reading on."""
    cfg = fleet_config([mock.url], redis_server.url)
    async with RelayServer(cfg) as server:
        store = server.relay.store
        assert isinstance(store, RedisStore)
        reading = asyncio.Event()

        async def swallowing_resync(*, budget: float) -> bool:
            reading.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass  # what a library below a read may do
            return True

        store._resync = swallowing_resync  # type: ignore[method-assign]
        reader = next(t for t in store._tasks if _runs(t, "_run"))
        await asyncio.wait_for(reading.wait(), 10)
        reader.cancel()
        await until(reader.done, cap=5)
        assert reader.cancelled()


def _runs(task: asyncio.Task[None], name: str) -> bool:
    coro = task.get_coro()
    return isinstance(coro, types.CoroutineType) and coro.__name__ == name
