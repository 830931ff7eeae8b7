"""Issue 25: what a relay reads from Redis is validated and clamped to its own config.

A real ``redis-server`` (``redisfix``) holds poisoned keys: a breaker with a TTL of
31 years, garbage values, keys of the wrong type.  Each relay keeps its breakers
within ``max_open_s`` and its cool-offs within ``max_retry_after_ms`` /
``quota_cooloff_s``, shortens a key that outlives them, logs the garbage at most
once a minute per kind, and never turns sharing off ("degraded") over it.  Waits
poll a condition with a deadline.
"""

from __future__ import annotations

import functools
import json
import logging
import time

import aiohttp
import pytest

from redisfix import RedisServer
from relay.test_health_relay import until
from relay.test_redis_store import fleet_config, from_instance, mock2, post, up
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

__all__ = ["mock2"]  # a fixture

HUGE_MS = 999_999_999_999


def open_for(server: RelayServer, key: str) -> float:
    board = server.relay.board
    now = time.monotonic()
    if board.state(key, now) != "open":
        return 0.0
    return board.records[key].open_until - now


def degraded_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "degraded" in r.getMessage()]


async def test_a_breaker_key_with_a_31_year_ttl_opens_for_max_open_s_at_most(
    redis_server: RedisServer,
    mock: MockProvider,
    mock2: MockProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url, mock2.url], redis_server.url, open_s=0.25, max_open_s=0.5)
    key = f"mock|{mock.url}"
    name = f"unbroken:{key}:breaker"
    async with RelayServer(cfg) as a, RelayServer(cfg) as b:
        await until(lambda: up(a))
        await until(lambda: up(b))
        opens: list[float] = []  # every open either relay takes from the key
        for s in (a, b):
            s.relay.board.listeners.append(
                lambda c: opens.append(c.ttl_s) if c.kind == "open" and c.key == key else None
            )
        redis = a.relay.store.redis  # type: ignore[attr-defined]
        await redis.set(name, "1", px=HUGE_MS)
        await until(lambda: bool(opens), cap=5)
        assert open_for(a, key) <= 0.5 and open_for(b, key) <= 0.5
        # the key itself is shortened to the relays' bound: it dies with the breaker
        await until(lambda: _pttl_at_most(redis, name, 500), cap=5)
        await until(lambda: _gone(redis, name), cap=5)
        # a 31-year key that is deleted leaves nothing behind
        opened = len(opens)
        await redis.set(name, "1", px=HUGE_MS)
        await until(lambda: len(opens) > opened, cap=5)
        await redis.delete(name)
        await until(lambda: open_for(a, key) == 0 and open_for(b, key) == 0, cap=3)
        # ... nor does a Redis restart: what the relays write back is bounded
        opened = len(opens)
        await redis.set(name, "1", px=HUGE_MS)
        await until(lambda: len(opens) > opened, cap=5)
        redis_server.stop()
        await until(lambda: _degraded(a) and _degraded(b), cap=6)
        redis_server.start()
        await until(lambda: up(a), cap=10)
        await until(lambda: up(b), cap=10)
        # a cool-off each relay learns now is written after what it wrote back
        k2 = f"mock|{mock2.url}"
        for s, secs, reason in ((a, 5.0, "retry_after"), (b, 6.0, "quota")):
            s.relay.board.cooloff(k2, time.monotonic(), secs, reason)
            await until(
                functools.partial(_value_is, redis, f"unbroken:{k2}:cooloff", reason), cap=5
            )
        ttl = await _pttl(redis, name)
        assert ttl <= 500, ttl
        assert all(t <= 0.5 for t in opens), opens
    assert not any("Traceback" in r.getMessage() for r in caplog.records)


async def _value_is(redis, name: str, value: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(await redis.get(name) == value.encode())
    except Exception:  # a stale connection after the restart: ask again
        return False


def _degraded(server: RelayServer) -> bool:
    return bool(server.relay.store.status()["state"] == "degraded")


async def _pttl(redis, name: str) -> int:  # type: ignore[no-untyped-def]
    for _ in range(3):  # the first command after a restart may meet a stale connection
        try:
            return int(await redis.pttl(name))
        except Exception:
            continue
    return int(await redis.pttl(name))


async def _pttl_at_most(redis, name: str, ms: int) -> bool:  # type: ignore[no-untyped-def]
    return await _pttl(redis, name) <= ms


async def _written(redis, name: str) -> bool:  # type: ignore[no-untyped-def]
    return await _pttl(redis, name) > 0


async def _gone(redis, name: str) -> bool:  # type: ignore[no-untyped-def]
    return await _pttl(redis, name) == -2


async def test_cooloff_keys_are_clamped_to_the_relays_own_bounds(
    redis_server: RedisServer, mock: MockProvider, mock2: MockProvider
) -> None:
    cfg = fleet_config([mock.url, mock2.url], redis_server.url, quota_cooloff_s=30)
    k1, k2 = f"mock|{mock.url}", f"mock|{mock2.url}"
    async with RelayServer(cfg) as a:
        await until(lambda: up(a))
        redis = a.relay.store.redis  # type: ignore[attr-defined]
        await redis.set(f"unbroken:{k1}:cooloff", "retry_after", px=HUGE_MS)
        await redis.set(f"unbroken:{k2}:cooloff", "quota", px=HUGE_MS)
        board = a.relay.board
        await until(lambda: board.blocked_until(k1, time.monotonic()) > 0, cap=5)
        await until(lambda: board.blocked_until(k2, time.monotonic()) > 0, cap=5)
        now = time.monotonic()
        assert board.blocked_until(k1, now) - now <= 60.0  # max_retry_after_ms
        assert board.blocked_until(k2, now) - now <= 30.0  # quota_cooloff_s
        await until(lambda: _pttl_at_most(redis, f"unbroken:{k1}:cooloff", 60_000), cap=5)
        await until(lambda: _pttl_at_most(redis, f"unbroken:{k2}:cooloff", 30_000), cap=5)


async def test_garbage_in_redis_is_ignored_and_never_turns_sharing_off(
    redis_server: RedisServer,
    mock: MockProvider,
    mock2: MockProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url, mock2.url], redis_server.url)
    k1, k2 = f"mock|{mock.url}", f"mock|{mock2.url}"
    async with RelayServer(cfg) as a, RelayServer(cfg) as b, aiohttp.ClientSession() as http:
        await until(lambda: up(a))
        await until(lambda: up(b))
        redis = a.relay.store.redis  # type: ignore[attr-defined]
        bucket = int(time.time() // 3)
        await redis.set(f"unbroken:{k2}:breaker", "not-a-count", px=60_000)
        await redis.set(f"unbroken:{k2}:cooloff", b"\xff\xfe\n", px=50)
        await redis.set(f"unbroken:{k1}:n:{bucket}:ok", "abc", ex=60)
        await redis.set(f"unbroken:{k1}:n:{bucket}:fail", "-99999999999999999999", ex=60)
        await redis.set(f"unbroken:{k1}:waiters", "not-a-hash", ex=60)
        await redis.hset(f"unbroken:{k2}:waiters", "x", str(HUGE_MS * 1000))
        await until(lambda: any("ignored" in m for m in _messages(caplog)), cap=5)
        # a garbage breaker value is still a breaker key: open, within the bound.  The
        # first relay to read it shortens it to that bound (0.5 s), so the other may
        # find it gone at its next read (once a second): each is checked on its own,
        # and the key written again while one has not seen it yet.
        breaker = f"unbroken:{k2}:breaker"
        seen: set[str] = set()

        async def each_saw_it_open() -> bool:
            for name, relay in (("a", a), ("b", b)):
                left = open_for(relay, k2)
                if left > 0:
                    assert left <= 0.5
                    seen.add(name)
            if len(seen) < 2 and not await redis.exists(breaker):
                await redis.set(breaker, "not-a-count", px=60_000)
            return len(seen) == 2

        await until(each_saw_it_open, cap=10)
        await redis.delete(breaker)
        await until(lambda: open_for(a, k2) == 0 and open_for(b, k2) == 0, cap=3)
        # a garbage mark counts as nobody (no relay waits, so each keeps its floor)
        assert a.relay.board.pacer(k2).share == 1
        assert await up(a) and await up(b), degraded_lines(caplog)
        # sharing still works: A's Retry-After steers B
        mock.script([{"status": 429, "headers": {"Retry-After": "20"}}])
        assert await post(http, a.url, "A") == 200
        await until(lambda: b.relay.board.blocked_until(k1, time.monotonic()) > 0, cap=3)
        for _ in range(3):
            assert await post(http, b.url, "B") == 200
        assert from_instance(mock, "B") == 0
        assert await up(a) and await up(b)
        assert degraded_lines(caplog) == []
        assert not any("Traceback" in m or "\n" in m for m in _messages(caplog))
        store = (await (await http.get(a.url + "/status")).json())["store"]
        assert store["state"] == "ok" and store["ignored"]["malformed value"] >= 1


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The relay's own log lines (an earlier test's unclosed SDK client, collected on
    this xdist worker, can log its own traceback through asyncio meanwhile)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("unbroken")]


async def test_garbage_in_a_shared_rate_limit_budget_is_replaced_not_fatal(
    redis_server: RedisServer, mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    from relay.test_ratelimit_redis import fleet_config as rate_config
    from relay.test_ratelimit_redis import post as rate_post
    from relay.test_ratelimit_redis import shared
    from unbroken.mock.limits import MockLimits

    caplog.set_level(logging.INFO, logger="unbroken")
    mock.limits = MockLimits(rpm=600, start=0.0)  # ten a second
    cfg = rate_config(mock.url, redis_server.url)
    async with RelayServer(cfg) as a, RelayServer(cfg) as b:
        async with aiohttp.ClientSession() as http:
            await until(lambda: up(a))
            await until(lambda: up(b))
            assert await rate_post(http, a.url, "A") == 200
            assert await rate_post(http, b.url, "B") == 200
            await until(lambda: shared(a) and shared(b))
            redis = a.relay.store.redis  # type: ignore[attr-defined]
            names = sorted(n.decode() for n in await redis.keys("unbroken:rl:*"))
            assert names
            for i, name in enumerate(names):
                if i % 2:
                    await redis.delete(name)
                    await redis.set(name, "not a hash")
                else:
                    await redis.hset(name, mapping={"level": "abc", "t": "inf", "limit": "-1"})

            async def shared_again() -> bool:
                assert await rate_post(http, a.url, "A") == 200
                assert await rate_post(http, b.url, "B") == 200
                for n in names:
                    if await redis.type(n) != b"hash" or await redis.hget(n, "level") == b"abc":
                        return False
                return shared(a) and shared(b)

            await until(shared_again, cap=10)
            assert await up(a) and await up(b)
    assert degraded_lines(caplog) == []
    assert any(
        "ignored malformed value from redis (a rate-limit key" in m for m in _messages(caplog)
    )
    assert not any("Traceback" in m for m in _messages(caplog))


async def test_a_probe_key_that_never_expires_holds_the_probe_no_longer_than_probe_timeout_s(
    redis_server: RedisServer, mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    from relay.test_health_relay import DeadPort
    from relay.test_redis_store import post as fleet_post

    async with DeadPort() as dead:
        cfg = fleet_config(
            [dead.url, mock.url],
            redis_server.url,
            failures_to_open=2,
            probe_timeout_s=1.0,
            open_s=1.0,
            max_open_s=1.0,
        )
        key = f"mock|{dead.url}"
        async with RelayServer(cfg) as a, aiohttp.ClientSession() as http:
            await until(lambda: up(a))
            redis = a.relay.store.redis  # type: ignore[attr-defined]
            for _ in range(2):
                assert await fleet_post(http, a.url, "A") == 200
            assert dead.accepted == 2  # the breaker is open (its write clears the probe)
            await until(lambda: _written(redis, f"unbroken:{key}:breaker"), cap=2)
            await redis.set(f"unbroken:{key}:probe", "nobody")  # no expiry: garbage

            async def probed() -> bool:
                assert await fleet_post(http, a.url, "A") == 200
                return dead.accepted > 2

            await until(probed, cap=6)  # the lease is ours within probe_timeout_s
            assert await _pttl(redis, f"unbroken:{key}:probe") <= 1000  # or gone: reopened


async def test_messages_on_the_redis_channel_are_checked_like_datagrams(
    redis_server: RedisServer,
    mock: MockProvider,
    mock2: MockProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url, mock2.url], redis_server.url)
    k1, k2 = f"mock|{mock.url}", f"mock|{mock2.url}"
    async with RelayServer(cfg) as a:
        await until(lambda: up(a))
        redis = a.relay.store.redis  # type: ignore[attr-defined]
        opens: list[float] = []
        a.relay.board.listeners.append(
            lambda c: opens.append(c.ttl_s) if c.kind == "open" and c.key == k1 else None
        )
        channel = "unbroken:health"
        for raw in (
            b'{"o": "x", "kind": "open", "k": "%s", "ttl": NaN}' % k2.encode(),
            b'{"o": "x", "kind": "cooloff", "k": "%s", "ttl": Infinity}' % k2.encode(),
            b'{"o": "x", "kind": "open", "k": "%s", "ttl": 1, "r": 5}' % k2.encode(),
            b"\xff" * 10,
        ):
            await redis.publish(channel, raw)
        await redis.publish(channel, json.dumps({"o": "x", "kind": "open", "k": k1, "ttl": 1e9}))
        await until(lambda: bool(opens), cap=5)  # in order: the garbage was read before
        assert opens == [0.5]
        now = time.monotonic()
        assert a.relay.board.state(k2, now) == "closed"
        assert a.relay.board.blocked_until(k2, now) == 0.0
        assert await up(a)
    messages = _messages(caplog)
    assert any("ignored malformed message from redis (the channel;" in m for m in messages)
    assert not any("Traceback" in m for m in messages)
