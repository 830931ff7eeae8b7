"""Issue 25: a Redis store that heals, through a real ``redis-server`` and two relays.

After Redis stalls (``SIGSTOP`` / ``SIGCONT``), restarts, or drops every client
connection, each relay is back to ``ok`` within a few seconds and shares again
(relay A's 429 Retry-After steers relay B), and each transition is logged once.
Waits poll a condition with a deadline, never a bare sleep.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import aiohttp
import pytest

from redisfix import RedisServer
from relay.test_health_relay import until
from relay.test_redis_store import fleet_config, from_instance, mock2, post, up
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

__all__ = ["mock2"]  # a fixture

DOWN = "health store degraded"
BACK = "redis is back"


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def degraded(server: RelayServer) -> bool:
    return bool(server.relay.store.status()["state"] == "degraded")


async def shares(
    http: aiohttp.ClientSession, a: RelayServer, b: RelayServer, mock: MockProvider
) -> None:
    """A's 429 Retry-After keeps B off that upstream (proof that they share again).
    Waits first for the last proof's cool-off to be over for both."""
    key = f"mock|{mock.url}"

    def free() -> bool:
        now = time.monotonic()
        return a.relay.board.blocked_until(key, now) == b.relay.board.blocked_until(key, now) == 0

    await until(free, cap=5)
    mock.script([{"status": 429, "headers": {"Retry-After": "3"}}])
    assert await post(http, a.url, "A") == 200
    await until(lambda: b.relay.board.blocked_until(key, time.monotonic()) > 0, cap=2.5)
    before = from_instance(mock, "B")
    for _ in range(3):
        assert await post(http, b.url, "B") == 200
    assert from_instance(mock, "B") == before


def redis_command(port: int, *args: str) -> bytes:
    """One command on a fresh connection (RESP), outside the relays' own clients."""
    wire = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(wire.encode())
        return s.recv(1024)


async def test_after_sigstop_and_sigcont_both_relays_are_ok_and_share_again(
    redis_server: RedisServer,
    mock: MockProvider,
    mock2: MockProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url, mock2.url], redis_server.url)
    async with RelayServer(cfg) as a, RelayServer(cfg) as b, aiohttp.ClientSession() as http:
        await until(lambda: up(a))
        await until(lambda: up(b))
        assert redis_server.proc is not None
        pid = redis_server.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            # both relays notice Redis no longer answers (one has a write to make)
            mock2.script([{"status": 429, "headers": {"Retry-After": "1"}}])
            assert await post(http, a.url, "A") == 200
            await until(lambda: degraded(a), cap=6)
            await until(lambda: degraded(b), cap=6)
        finally:
            os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        await until(lambda: up(a), cap=5)
        await until(lambda: up(b), cap=5)
        assert time.monotonic() - t0 < 4
        await shares(http, a, b, mock)
        assert await up(a) and await up(b)
        assert len(lines(caplog, DOWN)) == 2, lines(caplog, DOWN)
        assert len(lines(caplog, BACK)) == 2, lines(caplog, BACK)


async def test_after_a_restart_both_relays_are_ok_share_again_and_log_it_once(
    redis_server: RedisServer,
    mock: MockProvider,
    mock2: MockProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url, mock2.url], redis_server.url)
    async with RelayServer(cfg) as a, RelayServer(cfg) as b, aiohttp.ClientSession() as http:
        await until(lambda: up(a))
        await until(lambda: up(b))
        await shares(http, a, b, mock)  # every pooled connection has been used
        redis_server.stop()
        await until(lambda: degraded(a), cap=6)
        await until(lambda: degraded(b), cap=6)
        redis_server.start()
        t0 = time.monotonic()
        await until(lambda: up(a), cap=5)
        await until(lambda: up(b), cap=5)
        assert time.monotonic() - t0 < 4
        await shares(http, a, b, mock)  # the 429's write goes over the pool
        await shares(http, b, a, mock)  # and the other way round
        assert await up(a) and await up(b)
        assert len(lines(caplog, DOWN)) == 2, lines(caplog, DOWN)
        assert len(lines(caplog, BACK)) == 2, lines(caplog, BACK)


async def test_dropped_connections_heal_without_a_flap(
    redis_server: RedisServer,
    mock: MockProvider,
    mock2: MockProvider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = fleet_config([mock.url, mock2.url], redis_server.url)
    async with RelayServer(cfg) as a, RelayServer(cfg) as b, aiohttp.ClientSession() as http:
        await until(lambda: up(a))
        await until(lambda: up(b))
        await shares(http, a, b, mock)
        redis_command(redis_server.port, "CLIENT", "KILL", "TYPE", "normal")
        redis_command(redis_server.port, "CLIENT", "KILL", "TYPE", "pubsub")
        await shares(http, a, b, mock)
        await shares(http, b, a, mock)
        assert await up(a) and await up(b)
        # a dropped connection is reconnected at once: never degraded, never "back"
        assert lines(caplog, DOWN) == [] and lines(caplog, BACK) == []
