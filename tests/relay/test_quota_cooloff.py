"""Issue 36 items 2 and 3: a spent quota never parks a turn that has no other upstream,
and a cool-off read from Redis is believed only when it is one a relay writes.

* One 402 used to hold every later turn on that upstream (a lone relay's, and every
  relay's sharing Redis) as ``parked_for: cooloff`` for up to ``quota_cooloff_s``
  (3600 s).  Now the turn goes to the provider and ends with its answer at once (a
  quota error again, or an answer: the bill was paid), and the cool-off that steers
  turns to another upstream lasts at most `QUOTA_LOOK_AGAIN_S` before the provider
  is looked at again.
* ``SET unbroken:<key>:cooloff "<anything>"`` used to park the fleet for 60 s: a
  value that is no cool-off reason is garbage, ignored and logged.
Each turn runs under a deadline far below the old wait (so the old code fails fast).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from redisfix import RedisServer
from relay.test_health_relay import chat, config, mock2, until
from relay.test_redis_store import fleet_config, up
from unbroken.core.admission.health import QUOTA_LOOK_AGAIN_S
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

QUOTA = {"status": 402, "body": '{"error": {"type": "insufficient_quota", "message": "pay"}}'}
__all__ = ["mock2"]  # a fixture

DEADLINE_S = 10.0  # the old code held the second turn for quota_cooloff_s


async def turn(http: aiohttp.ClientSession, url: str) -> int:
    async with asyncio.timeout(DEADLINE_S):
        status, _ = await chat(http, url)
        return status


async def test_after_a_402_a_lone_upstreams_next_turn_asks_the_provider_at_once(
    mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = config([mock.url], health={"quota_cooloff_s": 3600})
    mock.script([QUOTA, QUOTA])
    async with RelayServer(cfg) as server, aiohttp.ClientSession() as http:
        assert await turn(http, server.url) == 402  # the provider's answer
        key = f"mock|{mock.url}"
        now = time.monotonic()
        assert 0 < server.relay.board.blocked_until(key, now) - now <= QUOTA_LOOK_AGAIN_S
        assert await turn(http, server.url) == 402  # still unpaid: answered at once
        assert await turn(http, server.url) == 200  # paid: served
    assert len(mock.requests) == 3
    assert not any("wait in line" in r.getMessage() for r in caplog.records)


async def test_a_quota_keeps_turns_on_the_other_upstream_for_a_minute_at_most(
    mock: MockProvider, mock2: MockProvider
) -> None:
    cfg = config([mock.url, mock2.url], health={"quota_cooloff_s": 3600})
    mock.script([QUOTA])
    async with RelayServer(cfg) as server, aiohttp.ClientSession() as http:
        assert await turn(http, server.url) == 200  # rerouted to mock2
        assert await turn(http, server.url) == 200
        board, key = server.relay.board, f"mock|{mock.url}"
        now = time.monotonic()
        left = board.blocked_until(key, now) - now
        assert 0 < left <= QUOTA_LOOK_AGAIN_S  # then mock is looked at again
    assert len(mock.requests) == 1 and len(mock2.requests) == 2


async def test_relays_sharing_redis_answer_a_quota_at_once_too(
    redis_server: RedisServer, mock: MockProvider
) -> None:
    cfg = fleet_config([mock.url], redis_server.url, quota_cooloff_s=3600)
    mock.script([QUOTA, QUOTA])
    key = f"mock|{mock.url}"
    async with RelayServer(cfg) as a, RelayServer(cfg) as b, aiohttp.ClientSession() as http:
        await until(lambda: up(a))
        await until(lambda: up(b))
        assert await turn(http, a.url) == 402
        await until(lambda: b.relay.board.blocked_until(key, time.monotonic()) > 0, cap=5)
        assert await turn(http, b.url) == 402  # B's turn asks the provider, unparked
        assert await turn(http, b.url) == 200


async def test_a_garbage_cooloff_in_redis_parks_nobody(
    redis_server: RedisServer, mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url], redis_server.url, quota_cooloff_s=3600)
    key = f"mock|{mock.url}"
    async with RelayServer(cfg) as a, aiohttp.ClientSession() as http:
        await until(lambda: up(a))
        redis = a.relay.store.redis  # type: ignore[attr-defined]
        await redis.set(f"unbroken:{key}:cooloff", "<anything>", px=600_000)
        store = a.relay.store
        await until(lambda: store.garbage.get("malformed value", 0) >= 1, cap=5)
        assert a.relay.board.blocked_until(key, time.monotonic()) == 0.0
        assert await turn(http, a.url) == 200
        # "quota" is a reason a relay writes: believed, for a minute at most, and a
        # lone upstream's turn still asks the provider
        await redis.set(f"unbroken:{key}:cooloff", "quota", px=3_600_000)
        board = a.relay.board
        await until(lambda: board.blocked_until(key, time.monotonic()) > 0, cap=5)
        now = time.monotonic()
        assert board.blocked_until(key, now) - now <= QUOTA_LOOK_AGAIN_S
        assert await turn(http, a.url) == 200
    ignored = [
        r.getMessage() for r in caplog.records if "ignored malformed value" in r.getMessage()
    ]
    assert len(ignored) == 1, ignored  # logged once, not at every read
