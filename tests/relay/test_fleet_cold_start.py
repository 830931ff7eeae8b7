"""Issue 32: a fleet's cold start on a key is one relay's, not one per relay.

Two relays over a real ``redis-server``, and the two workers of one ``serve --workers
2`` (their rates file), start together on one key.  Before, each let its own
``cold_start`` (4) go before the provider had answered anything: on a key whose budget
was spent at the start, 8 of the benchmark's 16 429s over Redis came in its first 10 ms
(docs/benchmarks.md, `bare`).  Now the first to ask the store takes the cold start,
the other lets one go and widens as the answers come (`RateBoard.cold_gate`,
`RateShare._cold_gate`).  The mock holds every answer, so what the relays let go
before any answer is what the mock has received once every turn is in flight or in a
line.  Waits poll a condition with a deadline, never a bare sleep.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis

from redisfix import RedisServer
from relay.test_fleet_throttle import KEY, _pair, fleet
from relay.test_health_relay import CHAT, PATH, until
from unbroken.core.admission.rateboard import COLD_GATE_S
from unbroken.core.admission.ratelimit import Limiter
from unbroken.core.admission.shared import Garbage
from unbroken.mock import MockProvider
from unbroken.relay.ratestore import RATE_KEY_PREFIX
from unbroken.relay.server import RelayServer

__all__ = ["fleet"]  # (the fixture, from the throttle's tests)

TURNS = 10  # through each relay at once


def _limiters(servers: list[RelayServer]) -> list[Limiter]:
    return [lim for s in servers for lim in s.relay.board.rates.all()]


async def _post(http: aiohttp.ClientSession, server: RelayServer) -> int:
    async with http.post(server.url + PATH, json=CHAT, headers=KEY) as r:
        await r.read()
        return r.status


async def test_two_relays_starting_together_send_one_cold_start_and_one(
    fleet: tuple[str, Path | str], mock: MockProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, where = fleet
    # A loaded machine may answer slower than the store's budget (then each relay
    # starts on its own word, as it must when the store is slow): this test is about
    # the answer, not the budget.
    monkeypatch.setattr("unbroken.relay.ratestore.BUDGET_S", 30.0)
    mock.set_default({"delay_ms": 3000})  # no answer before everything is let go
    async with _pair(kind, mock.url, where) as servers, aiohttp.ClientSession() as http:
        turns = [asyncio.ensure_future(_post(http, s)) for _ in range(TURNS) for s in servers]

        def settled() -> bool:
            lims = _limiters(servers)
            return (
                len(lims) == 2
                and all(getattr(lim, "cold", "own") != "asking" for lim in lims)
                and sum(len(lim.running) + len(lim.line) for lim in lims) == 2 * TURNS
                and len(mock.requests) == sum(len(lim.running) for lim in lims)
            )

        await until(settled)
        lims = _limiters(servers)
        # the cold start's four, and the sibling's one: not four each
        assert len(mock.requests) == 4 + 1
        assert sorted(lim.cold for lim in lims) == ["fleet's", "mine"]
        mock.set_default(None)
        assert await asyncio.wait_for(asyncio.gather(*turns), 60) == [200] * (2 * TURNS)


async def test_garbage_at_the_cold_start_key_means_own_words_and_heals(
    redis_server: RedisServer, mock: MockProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key of another type where the lease lives: each relay starts on its own word
    (garbage is never an outage, nor a key stuck at one), it is counted, and the key
    is given the lease's expiry (it heals within `COLD_GATE_S`)."""
    monkeypatch.setattr("unbroken.relay.ratestore.BUDGET_S", 30.0)
    async with _pair("redis", mock.url, redis_server.url) as servers:
        async with aiohttp.ClientSession() as http:
            assert await _post(http, servers[0]) == 200
        [lim] = _limiters(servers)
        name = f"{RATE_KEY_PREFIX}{lim.key}|{lim.cred}:cold"
    r = aioredis.from_url(redis_server.url)
    try:
        await r.delete(name)
        await r.hset(name, "x", "1")  # no expiry, and not a string
        mock.set_default({"delay_ms": 3000})
        mock.requests.clear()
        async with _pair("redis", mock.url, redis_server.url) as servers:
            async with aiohttp.ClientSession() as http:
                turns = [
                    asyncio.ensure_future(_post(http, s)) for _ in range(TURNS) for s in servers
                ]
                await until(
                    lambda: (
                        len(_limiters(servers)) == 2
                        and all(lim.cold != "asking" for lim in _limiters(servers))
                        and len(mock.requests) == 8
                    )
                )
                assert [lim.cold for lim in _limiters(servers)] == ["mine", "mine"]
                for s in servers:
                    assert s.relay.store.garbage.get(Garbage.WRONG_TYPE) == 1
                assert 0 < await r.pttl(name) <= COLD_GATE_S * 1000
                mock.set_default(None)
                assert await asyncio.wait_for(asyncio.gather(*turns), 60) == [200] * (2 * TURNS)
    finally:
        await r.aclose()
