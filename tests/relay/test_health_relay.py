"""Upstream health through real sockets: breakers, parking, quota, budget, stickiness.

One relay in-process in front of real mock providers (and a real dead listener).
Nothing sleeps to synchronise: each wait polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from unbroken.config import parse_config
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
PATH = "/mock/v1/chat/completions"


def config(upstreams: list[str], **sections: dict[str, Any]) -> Any:
    data: dict[str, Any] = {
        "retry": {"delay_ms": 5, "max_delay_ms": 50, **sections.pop("retry", {})},
        "routes": {"mock": {"upstreams": [{"url": u} for u in upstreams]}},
        "journal": {"enabled": False},
        **sections,
    }
    return dataclasses.replace(parse_config(data, env={}), port=0, grace_s=2.0)


async def until(cond: Callable[[], Awaitable[bool] | bool], cap: float = 20.0) -> None:
    deadline = time.monotonic() + cap
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def chat(http: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, bytes]:
    async with http.post(url + PATH, json=CHAT, headers=headers) as r:
        return r.status, await r.read()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


@pytest_asyncio.fixture
async def mock2() -> AsyncIterator[MockProvider]:
    async with MockProvider(host="127.0.0.1", port=0) as provider:
        yield provider


class DeadPort:
    """A listener that accepts and drops every connection, counting them."""

    def __init__(self) -> None:
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> DeadPort:
        async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            writer.transport.abort()

        self.server = await asyncio.start_server(drop, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_an_open_breaker_sends_nothing_to_the_dead_upstream_until_the_probe(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    async with DeadPort() as dead:
        # (the open period is min(open_s, max_open_s): with the default max_open_s of
        # 0.5 s this test's breaker was open for half a second, not four, and a loaded
        # machine's 20 turns outlasted it)
        health = {"failures_to_open": 5, "open_s": 4.0, "max_open_s": 4.0}
        cfg = config([dead.url, mock.url], health=health)
        async with RelayServer(cfg) as server:
            key = f"mock|{dead.url}"
            for _ in range(5):  # five turns fail on it once each (then go to the mock)
                assert (await chat(http, server.url))[0] == 200
            assert dead.accepted == 5
            assert server.relay.board.state(key, time.monotonic()) == "open"
            reopens = server.relay.board.blocked_until(key, time.monotonic())
            for _ in range(20):  # few enough to finish before the probe on a loaded machine
                assert (await chat(http, server.url))[0] == 200
            assert time.monotonic() < reopens, "too slow to test before the probe"
            assert dead.accepted == 5  # zero connection attempts while open
            await until(lambda: server.relay.board.blocked_until(key, time.monotonic()) == 0.0)
            for _ in range(10):
                assert (await chat(http, server.url))[0] == 200
            assert dead.accepted == 6  # exactly one probe; it failed: open again
            status = await (await http.get(server.url + "/status")).json()
            [up] = [u for u in status["upstreams"] if u["upstream"] == dead.url]
            assert up["breaker"] == "open" and up["open_until"] > time.time()
            metrics = await (await http.get(server.url + "/metrics")).text()
            assert (
                f'unbroken_upstream_state{{route="mock",state="open",upstream="{dead.url}"}} 1.0'
            ) in metrics
            assert "unbroken_breaker_transitions_total{" in metrics


async def test_a_down_upstream_parks_turns_and_they_all_complete_when_it_returns(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    down_s = 10.0
    cfg = config([mock.url], health={"failures_to_open": 3, "open_s": 0.5, "max_open_s": 1.0})
    mock.script([{"status": 503, "count": 100_000}])
    async with RelayServer(cfg) as server:
        turns = [asyncio.ensure_future(chat(http, server.url)) for _ in range(10)]
        t0 = time.monotonic()

        async def parked() -> bool:
            data = await (await http.get(server.url + "/status")).json()
            n: int = sum(t["state"] == "parked" for t in data["inflight"])
            return n >= 9

        await until(parked)
        metrics = await (await http.get(server.url + "/metrics")).text()
        assert any(
            line.startswith("unbroken_parked_turns ") and float(line.split()[1]) >= 9
            for line in metrics.splitlines()
        )
        opened_at = len(mock.requests)
        await asyncio.sleep(max(0.0, down_s - (time.monotonic() - t0)))  # the outage itself
        during = len(mock.requests) - opened_at
        # while parked, only probes: one per open period (0.5 s, then 1 s) at most
        assert during <= down_s / 0.5 + 1, during
        assert opened_at <= 10 + 3  # each turn's first try, a few retries before opening
        mock.reset()  # the upstream is back
        results = await asyncio.wait_for(asyncio.gather(*turns), 15)
        assert all(status == 200 and b"[DONE]" in body for status, body in results)


async def test_quota_with_no_other_upstream_ends_with_the_provider_answer(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    mock.script([{"status": 402, "count": 5}])
    async with RelayServer(config([mock.url])) as server:
        async with http.post(server.url + PATH, json=CHAT) as r:
            assert r.status == 402
            assert r.headers["x-should-retry"] == "false"
        assert len(mock.requests) == 1  # never retried into the quota wall
        status = await (await http.get(server.url + "/status")).json()
        [up] = [u for u in status["upstreams"] if u["route"] == "mock"]
        assert up["cooloff_reason"] == "quota" and 20 < up["cooloff_s"] <= 30  # the default


async def test_quota_reroutes_to_the_next_upstream(
    mock: MockProvider, mock2: MockProvider, http: aiohttp.ClientSession
) -> None:
    mock.script([{"status": 429, "body": '{"error": {"code": "insufficient_quota"}}'}])
    async with RelayServer(config([mock.url, mock2.url])) as server:
        assert (await chat(http, server.url))[0] == 200
        assert (await chat(http, server.url))[0] == 200
        assert len(mock.requests) == 1 and len(mock2.requests) == 2


async def test_the_relays_own_final_errors_say_do_not_retry(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    mock.script([{"status": 503, "count": 10}])
    async with RelayServer(config([mock.url], retry={"max_attempts": 2})) as server:
        async with http.post(server.url + PATH, json=CHAT) as r:
            assert r.status == 503 and r.headers["x-should-retry"] == "false"
    async with DeadPort() as dead:
        async with RelayServer(config([dead.url], retry={"max_attempts": 2})) as server:
            async with http.post(server.url + PATH, json=CHAT) as r:
                assert r.status == 502 and r.headers["x-should-retry"] == "false"


async def test_sticky_sessions_stay_on_one_upstream_and_spread_across_sessions(
    mock: MockProvider, mock2: MockProvider, http: aiohttp.ClientSession
) -> None:
    async with RelayServer(config([mock.url, mock2.url])) as server:
        for _ in range(20):
            assert (await chat(http, server.url, **{"x-session-id": "one"}))[0] == 200
        assert sorted([len(mock.requests), len(mock2.requests)]) == [0, 20]
        mock.reset()
        mock2.reset()
        for i in range(20):
            assert (await chat(http, server.url, **{"session-id": f"s-{i}"}))[0] == 200
        assert len(mock.requests) >= 3 and len(mock2.requests) >= 3


@pytest.mark.parametrize("encoding", [None, "gzip"])
async def test_a_body_prompt_cache_key_is_a_sticky_session_gzip_or_not(
    mock: MockProvider, mock2: MockProvider, http: aiohttp.ClientSession, encoding: str | None
) -> None:
    """Codex sends ``prompt_cache_key`` in the body; Claude Code may gzip its body."""
    async with RelayServer(config([mock.url, mock2.url])) as server:
        for i in range(40):  # 10 turns of one session, then 30 sessions
            body = json.dumps({**CHAT, "prompt_cache_key": "one" if i < 10 else f"k{i}"})
            data = body.encode()
            headers = {"Content-Type": "application/json"}
            if encoding:
                data, headers["Content-Encoding"] = gzip.compress(data), encoding
            async with http.post(server.url + PATH, data=data, headers=headers) as r:
                assert r.status == 200
            if i == 9:
                assert sorted([len(mock.requests), len(mock2.requests)]) == [0, 10]
        assert len(mock.requests) >= 1 and len(mock2.requests) >= 1


async def test_a_fast_failing_storm_gets_retries_at_the_pacers_rate_and_every_turn_completes(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    """Issue 22: 503s answer in milliseconds, so a budget of retries *in flight* never
    engaged (``budget_percent = 20`` sent 374 requests where 0 % sent 376).  The pacer
    bounds the rate: after the first attempts, at most its burst plus its floor a
    second, however many turns wait; and every turn still completes."""
    cfg = config(
        [mock.url],
        # the floor: 20 a second (at the default, 1000 / delay_ms = 50, a loaded machine's
        # turns came slower than the floor let them go, and few waited in its line)
        retry={"delay_ms": 20, "budget_percent": 20, "pace_floor_per_s": 20.0},
        health={"breakers": False},
    )
    mock.script([{"status": 503, "count": 120}])
    async with RelayServer(cfg) as server:
        turns = [
            asyncio.ensure_future(chat(http, server.url, **{"x-session-id": f"turn-{i}"}))
            for i in range(50)
        ]
        lines: list[int] = []
        while len(mock.requests) < 120:
            data = await (await http.get(server.url + "/status")).json()
            [up] = [u for u in data["upstreams"] if u["route"] == "mock"]
            lines.append(up["pacer"]["waiting"])
            await asyncio.sleep(0.02)
        results = await asyncio.wait_for(asyncio.gather(*turns), 30)
        assert all(status == 200 for status, _ in results)
        assert max(lines) > 10  # turns waited in the upstream's line
        metrics = await (await http.get(server.url + "/metrics")).text()
        assert 'unbroken_pacer_waited_total{route="mock",upstream=' in metrics
    seen: set[str] = set()
    retries: list[float] = []
    for r in sorted(mock.requests[:120], key=lambda r: r.at):
        turn = r.headers["x-session-id"]
        if turn in seen:
            retries.append(r.at)
        seen.add(turn)
    # 70 retries: 10 at once (the burst), 60 at the floor (20 a second): the relay lets
    # them go over at least 2.95 s (the old budget sent them in ~0.2 s).  The mock's
    # clock sees them later than the relay let them go, and on a loaded machine they can
    # reach it bunched, so the bound is half the pacer's spread: still seven times what
    # the old budget took
    assert len(retries) == 70 and retries[-1] - retries[0] >= (70 - 10 - 1) / 20 / 2


async def test_a_failover_to_another_vendor_rewrites_the_model(
    mock: MockProvider, mock2: MockProvider, http: aiohttp.ClientSession
) -> None:
    data = {
        "retry": {"delay_ms": 5},
        "journal": {"enabled": False},
        "routes": {
            "mock": {
                "upstreams": [
                    {"url": mock.url},
                    {"url": mock2.url, "models": {"m": "vendor/m-large"}},
                ]
            }
        },
    }
    cfg = dataclasses.replace(parse_config(data, env={}), port=0, grace_s=2.0)
    mock.script([{"status": 503}])
    async with RelayServer(cfg) as server:
        assert (await chat(http, server.url))[0] == 200
    assert mock.requests[0].json()["model"] == "m"
    assert mock2.requests[0].json()["model"] == "vendor/m-large"


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"health": {"failures_to_open": 0}}, "health.failures_to_open"),
        ({"health": {"failure_rate_to_open": 1.5}}, "health.failure_rate_to_open"),
        ({"health": {"open_s": 0}}, "health.open_s"),
        ({"health": {"store": "memcached://x"}}, "health.store"),
        ({"health": {"nope": 1}}, "health.nope"),
        ({"retry": {"budget_percent": 120}}, "retry.budget_percent"),
    ],
)
def test_health_config_errors_name_the_key(section: dict[str, Any], key: str) -> None:
    from unbroken.config import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_config(section, env={})
    assert err.value.key == key


def test_health_config_defaults() -> None:
    cfg = parse_config({}, env={})
    h = cfg.health
    assert (h.failures_to_open, h.open_s, h.max_open_s, h.quota_cooloff_s, h.store) == (
        5,
        0.25,
        0.5,
        30.0,
        "",
    )
    r = cfg.retry
    assert (r.backoff, r.delay_ms, r.pace_floor_per_s, r.pace_ratio, r.pace_burst) == (
        "fixed",
        250,
        0.0,
        1.0,
        10.0,
    )
    assert r.pace_settings().floor_per_s == 4.0  # 1000 / delay_ms: a lone turn's own pace
    # a config from before the pacer still loads: its budget becomes the pacer's ratio
    old = parse_config({"retry": {"budget_percent": 20, "min_retry_concurrency": 3}}, env={})
    assert old.retry.pace_ratio == 0.2
    assert parse_config({"health": {"store": "redis://h:6379/0"}}, env={}).health.store == (
        "redis://h:6379/0"
    )


async def test_the_journal_records_how_each_upstream_was_chosen_and_breaker_transitions(
    mock: MockProvider, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    import sqlite3

    path = tmp_path / "journal.sqlite3"
    async with DeadPort() as dead:
        dead_url = dead.url
        cfg = config(
            [dead_url, mock.url],
            # (max_open_s too: the open period is the smaller of the two, 0.5 s by default)
            health={"failures_to_open": 2, "open_s": 60.0, "max_open_s": 60.0},
            journal={"enabled": True, "path": str(path)},
        )
        async with RelayServer(cfg) as server:
            for _ in range(3):  # two turns open the breaker; the third skips the dead one
                assert (await chat(http, server.url))[0] == 200
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT t.turn_id, a.number, a.upstream, a.choice FROM attempts a"
            " JOIN turns t ON t.uid = a.turn_uid ORDER BY t.turn_id, a.number"
        ).fetchall()
        events = db.execute("SELECT route, upstream, kind, reason FROM upstream_events").fetchall()
    choices = [(n, up == dead_url, choice) for _, n, up, choice in rows]
    assert choices == [
        (1, True, "first"),
        (2, False, "rotated"),
        (1, True, "first"),
        (2, False, "rotated"),
        (1, False, "breaker_skip"),
    ]
    assert [(r, u, k) for r, u, k, _ in events] == [("mock", dead_url, "open")]
    assert events[0][3]  # the failure that opened it


async def test_websocket_turns_stick_to_their_sessions_upstream(
    mock: MockProvider, mock2: MockProvider
) -> None:
    cfg = config([mock.url, mock2.url])
    async with RelayServer(cfg) as server, aiohttp.ClientSession() as s:
        ws_url = server.url.replace("http://", "ws://") + "/mock/v1/responses"
        create = json.dumps({"type": "response.create", "model": "m", "input": "hi"})

        async def turn(session: str) -> None:
            async with s.ws_connect(ws_url, headers={"session-id": session}) as ws:
                await ws.send_str(create)
                while True:
                    msg = await ws.receive(timeout=10)
                    assert msg.type is aiohttp.WSMsgType.TEXT, msg
                    if '"response.completed"' in msg.data:
                        return

        for _ in range(6):  # one session, many connections: always the same upstream
            await turn("one-session")
        used = {len(mock.requests) > 0, len(mock2.requests) > 0}
        assert used == {True, False}
        before = (len(mock.requests), len(mock2.requests))
        for i in range(12):  # many sessions: both upstreams get some
            await turn(f"session-{i}")
        assert len(mock.requests) > before[0] and len(mock2.requests) > before[1]


async def test_parked_turns_are_woken_when_the_upstream_answers_not_by_a_timer(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    """Issue 22: a parked turn looked again only every ``park_check_s`` (and a turn that
    found the probe out waited for the probe's 30 s lease).  Now the turns in the line
    are released as soon as the probe is answered: with ``park_check_s`` at 10 minutes,
    30 turns behind an outage still all complete."""
    cfg = config(
        [mock.url],
        health={"failures_to_open": 1, "open_s": 0.2, "max_open_s": 0.2, "park_check_s": 600},
    )
    mock.script([{"status": 503, "count": 40}])
    async with RelayServer(cfg) as server:
        results = await asyncio.wait_for(
            asyncio.gather(*[chat(http, server.url) for _ in range(30)]), 20
        )
        assert all(status == 200 for status, _ in results)
        views = await (await http.get(server.url + "/status")).json()
        [u] = [u for u in views["upstreams"] if u["route"] == "mock"]
        assert u["pacer"]["waited_total"] > 0 and u["pacer"]["waiting"] == 0
    # while the breaker was open only probes went: far fewer requests than 30 turns x 40
    assert len(mock.requests) < 120


async def test_a_websocket_turn_on_its_sessions_second_upstream_is_never_a_retry(
    mock: MockProvider, mock2: MockProvider
) -> None:
    """Issue 22: ``relay/websocket.py`` set ``current = upstream_idx - 1``, so on any
    upstream but the first a turn's first attempt counted as a retry (and was never
    given back): with two upstreams, ``budget_percent = 20`` and a sticky session,
    turn 5 parked forever.  A turn now starts on its connection's upstream as a
    first attempt."""
    from unbroken.core.admission.policy import rendezvous_order

    cfg = config([mock.url, mock2.url], retry={"budget_percent": 20})
    keys = [f"mock|{mock.url}", f"mock|{mock2.url}"]
    session = next(f"s{i}" for i in range(100) if rendezvous_order(f"s{i}", keys)[0] == 1)
    async with RelayServer(cfg) as server, aiohttp.ClientSession() as s:
        ws_url = server.url.replace("http://", "ws://") + "/mock/v1/responses"
        create = json.dumps({"type": "response.create", "model": "m", "input": "hi"})
        async with s.ws_connect(ws_url, headers={"session-id": session}) as ws:
            for _ in range(8):
                await ws.send_str(create)
                while True:
                    msg = await ws.receive(timeout=10)
                    assert msg.type is aiohttp.WSMsgType.TEXT, msg
                    if '"response.completed"' in msg.data:
                        break
        stats = server.relay.board.pacer(keys[1])
        assert stats.waited_total == 0 and stats.granted_total == 0  # no turn was paced
    assert len(mock2.requests) == 8 and len(mock.requests) == 0


async def test_a_line_is_logged_once_when_it_forms_and_once_when_it_clears(
    mock: MockProvider, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Every long wait is visible in the logs too: one line per upstream's line, not
    one per waiting turn."""
    caplog.set_level("INFO", logger="unbroken")
    cfg = config([mock.url], health={"failures_to_open": 1, "open_s": 0.1, "max_open_s": 0.1})
    mock.script([{"status": 503, "count": 20}])
    async with RelayServer(cfg) as server:
        results = await asyncio.gather(*[chat(http, server.url) for _ in range(20)])
        assert all(status == 200 for status, _ in results)
    formed = [r for r in caplog.records if "wait in line" in r.getMessage()]
    cleared = [r for r in caplog.records if "line cleared after" in r.getMessage()]
    assert 1 <= len(formed) <= 3 and len(cleared) == len(formed)  # not one per turn
