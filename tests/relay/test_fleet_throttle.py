"""Issue 32: relays that share a key share what each was seen to accept.

Relays over a real ``redis-server`` (the channel) and the workers of one ``serve
--workers 2`` (their datagrams) tell each other their measure when a 429 lowered a
throttle: the rate each was seen to accept and its demand; a sibling that sent lately
answers with its own, and each pools them: one served below its share of the fleet's
accepted rate is raised to it, none is lowered by a sibling's word
(`core.admission.throttle.AdmissionThrottle.sibling_news`).  A message that is not one
(garbage, a key or a credential this relay does not have) changes nothing.  The mock
sends no rate-limit headers (``bare``): the throttle is all there is.  Waits poll a
condition with a deadline, never a bare sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from redisfix import RedisServer
from relay.test_health_relay import CHAT, PATH, until
from relay.test_ratelimit_redis import fleet_config
from unbroken.core.admission.ratelimit import Limiter
from unbroken.core.admission.shared import Garbage
from unbroken.mock import MockProvider
from unbroken.mock.limits import MockLimits
from unbroken.relay.server import RelayServer
from unbroken.relay.siblings import WorkerSpec
from unbroken.relay.store import CHANNEL

KEY = {"Authorization": "Bearer sk-fleet-throttle-key"}


async def _post(http: aiohttp.ClientSession, server: RelayServer) -> int:
    async with http.post(server.url + PATH, json=CHAT, headers=KEY) as r:
        await r.read()
        return r.status


async def _crowd(http: aiohttp.ClientSession, server: RelayServer) -> None:
    """Thirty turns at once through ``server``: the provider refuses some, and the
    first unexplained 429 lowers that relay's throttle (its own decrease)."""
    results = await asyncio.wait_for(asyncio.gather(*(_post(http, server) for _ in range(30))), 60)
    assert results == [200] * 30 and _limiter(server).throttle.decreases >= 1


def _limiter(server: RelayServer) -> Limiter:
    [lim] = list(server.relay.board.rates.all())
    return lim


@contextlib.asynccontextmanager
async def _pair(kind: str, upstream: str, where: Path | str) -> AsyncIterator[list[RelayServer]]:
    """Two relays over Redis (``where``: its URL), or two workers (``where``: their
    runtime directory)."""
    if kind == "redis":
        servers = [RelayServer(fleet_config(upstream, str(where))) for _ in range(2)]
    else:
        cfg = fleet_config(upstream, "memory")
        servers = [RelayServer(cfg, worker=WorkerSpec(i, str(where))) for i in (0, 1)]
    for s in servers:
        await s.start()
    try:
        await until(lambda: all(s.relay.store.status()["state"] == "ok" for s in servers))
        yield servers
    finally:
        for s in servers:
            await s.stop()


@pytest.fixture(params=["redis", "workers"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path | str]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return "redis", server.url
    return "workers", tmp_path


async def test_a_relays_429_is_answered_by_its_sibling_and_pooled(
    fleet: tuple[str, Path | str], mock: MockProvider
) -> None:
    kind, where = fleet
    # 10 a second, six left at first, no headers
    mock.limits = MockLimits(rpm=600, behaviour="bare", start=0.01)
    async with _pair(kind, mock.url, where) as (a, b), aiohttp.ClientSession() as http:
        assert await _post(http, b) == 200  # the sibling has sent lately
        sibling = _limiter(b)
        await _crowd(http, a)  # a crowd through the other relay lowers its throttle
        crowd = _limiter(a).throttle
        # the sibling heard it and answered with its own measure, once a window; it was
        # not lowered (it collected no 429 of its own)
        await until(lambda: sibling.throttle.replies >= 1)
        assert not sibling.throttle.enabled and sibling.limited_total == 0
        assert b.relay.store.status()["ratelimits"]["sibling_news"] >= 1
        assert sibling.throttle.anchor > 0.0  # what it had been seen to accept
        # ... and the crowd's relay heard the answer (and pooled it: `pooled_with`,
        # until its next window)
        await until(lambda: a.relay.store.status()["ratelimits"]["sibling_news"] >= 1)
        assert crowd.decreases >= 1


async def test_a_sibling_without_the_key_changes_nothing(
    fleet: tuple[str, Path | str], mock: MockProvider
) -> None:
    kind, where = fleet
    mock.limits = MockLimits(rpm=600, behaviour="bare", start=0.01)
    async with _pair(kind, mock.url, where) as (a, b), aiohttp.ClientSession() as http:
        await _crowd(http, a)
        # b has no limiter for the key: the message names nothing it has (no state for
        # strangers); its first turn is paced by its own answers only
        assert list(b.relay.board.rates.all()) == []
        assert await _post(http, b) == 200
        assert _limiter(b).throttle.replies == 0


async def test_garbage_on_the_channel_changes_nothing(
    redis_server: RedisServer, mock: MockProvider
) -> None:
    mock.limits = MockLimits(rpm=600, behaviour="bare", start=1.0)
    async with _pair("redis", mock.url, redis_server.url) as (a, b):
        async with aiohttp.ClientSession() as http:
            assert await _post(http, b) == 200
        lim = _limiter(b)
        key, cred = lim.key, lim.cred
        r = aioredis.from_url(redis_server.url)
        try:
            told = {"o": "x", "kind": "throttle", "k": key, "a": 1.0, "d": 1}
            bad: list[object] = [
                told,  # no credential
                {**told, "c": 7},
                {**told, "c": "a b"},
                {**told, "c": "f" * 65},
                {**told, "c": cred, "a": -1},
                {**told, "k": "no-such|key", "c": cred},
                {**told, "c": "0123456789ab"},  # a credential it has no limiter for
            ]
            for msg in bad:
                await r.publish(CHANNEL, json.dumps(msg))
            # a valid one last: once it is applied, every one before it was read
            await r.publish(CHANNEL, json.dumps({**told, "c": cred}))
            await until(lambda: lim.throttle.replies == 1)  # it had sent: it answers
            # the same message again and again moves nothing (no lease asked, no pump)
            moved: list[str] = []
            b.relay.board.rates.listeners.append(moved.append)
            for _ in range(50):
                await r.publish(CHANNEL, json.dumps({**told, "c": cred}))
            await r.publish(CHANNEL, json.dumps({**told, "c": cred, "o": "y", "d": 3}))
            rates = b.relay.store.status
            await until(lambda: rates()["ratelimits"]["sibling_news"] == 52)  # all were read
            # (its throttle is off: nothing to raise; only a new window's answer moves)
            assert len(moved) == lim.throttle.replies - 1, moved
        finally:
            await r.aclose()
        garbage = b.relay.store.garbage
        assert garbage.get(Garbage.MESSAGE) == 5, garbage
        assert garbage.get(Garbage.UNKNOWN_KEY) == 1, garbage
        await until(lambda: a.relay.store.garbage == garbage)  # a has no limiter: nothing
        assert list(a.relay.board.rates.all()) == []
