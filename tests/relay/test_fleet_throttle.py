"""Issue 32: a 429 that lowers one relay's admitted rate lowers its siblings' too.

Relays over a real ``redis-server`` (the channel) and the workers of one ``serve
--workers 2`` (their datagrams) tell each other when the provider refused what a
throttle let go, with what each was seen to accept and its demand
(`core.admission.throttle.AdmissionThrottle.fleet_refused`): the provider refuses the
fleet's total, so each comes down at once instead of finding the limit once per
relay, and they share the epoch's rate by demand.  A sibling that sent nothing lately
is not lowered; a message that is not one (garbage, a key or a credential this relay
does not have) changes nothing.  The mock sends no rate-limit headers (``bare``): the
throttle is all there is.  Waits poll a condition with a deadline, never a bare sleep.
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
    own = _limiter(server).throttle
    assert results == [200] * 30 and own.decreases - own.fleet_decreases >= 1


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


async def test_a_429_that_lowers_one_relay_lowers_its_sibling(
    fleet: tuple[str, Path | str], mock: MockProvider
) -> None:
    kind, where = fleet
    # 10 a second, six left at first, no headers
    mock.limits = MockLimits(rpm=600, behaviour="bare", start=0.01)
    async with _pair(kind, mock.url, where) as (a, b), aiohttp.ClientSession() as http:
        assert await _post(http, b) == 200  # the sibling has sent lately
        sibling = _limiter(b)
        assert not sibling.throttle.enabled
        await _crowd(http, a)  # a crowd through the other relay lowers its throttle
        # ... and its sibling's, which collected no 429 of its own
        await until(lambda: sibling.throttle.fleet_decreases >= 1)
        assert sibling.throttle.enabled and sibling.limited_total == 0
        assert b.relay.store.status()["ratelimits"]["sibling_decreases"] >= 1
        assert sibling.throttle.anchor > 0.0  # what it had been seen to accept


async def test_a_sibling_that_sent_nothing_lately_is_not_lowered(
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
        assert _limiter(b).throttle.fleet_decreases == 0


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
            await until(lambda: lim.throttle.fleet_decreases == 1)
            # the same message again and again moves nothing (no lease asked, no pump)
            moved: list[str] = []
            b.relay.board.rates.listeners.append(moved.append)
            for _ in range(50):
                await r.publish(CHANNEL, json.dumps({**told, "c": cred}))
            await r.publish(CHANNEL, json.dumps({**told, "c": cred, "o": "y", "d": 3}))
            await until(lambda: len(lim.throttle._peers) == 2)  # the last one was read
            assert len(moved) <= 1, moved  # only the new sibling's word moved the rate
        finally:
            await r.aclose()
        garbage = b.relay.store.garbage
        assert garbage.get(Garbage.MESSAGE) == 5, garbage
        assert garbage.get(Garbage.UNKNOWN_KEY) == 1, garbage
        assert b.relay.store.status()["ratelimits"]["sibling_decreases"] == 1
        await until(lambda: a.relay.store.garbage == garbage)  # a has no limiter: nothing
        assert list(a.relay.board.rates.all()) == []
