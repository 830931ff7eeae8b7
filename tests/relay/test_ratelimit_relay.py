"""Rate-limit admission through real sockets: the mock enforces RPM and sends the
providers' headers; the relay learns them and turns wait at the relay, not in 429s.

Nothing sleeps to synchronise: each wait polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from relay.test_health_relay import CHAT, PATH, config, until
from unbroken.core.admission.ratelimit import credential_hash
from unbroken.mock import MockProvider
from unbroken.mock.limits import MockLimits
from unbroken.observe.journal import SCHEMA, SCHEMA_VERSION, Journal
from unbroken.observe.stats import compute_stats, format_stats
from unbroken.relay.pacing import RateLimitIO
from unbroken.relay.server import RelayServer

KEY = {"Authorization": "Bearer sk-test-ratelimit-0001"}


async def chat(http: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, bytes]:
    async with http.post(url + PATH, json=CHAT, headers={**KEY, **headers}) as r:
        return r.status, await r.read()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


def statuses(mock: MockProvider) -> list[int]:
    assert mock.limits is not None
    return [status for _, _, status in mock.limits.log]


@pytest.mark.parametrize("style", ["openai", "anthropic"])
async def test_turns_wait_at_the_relay_for_the_learned_budget_not_in_429s(
    mock: MockProvider, http: aiohttp.ClientSession, style: str
) -> None:
    # 300 a minute (5 a second), the key's budget spent when the test begins
    mock.limits = MockLimits(rpm=300, style=style, start=0.0)
    async with RelayServer(config([mock.url])) as server:
        # the first wave goes out blind (nothing is known yet): 429s teach the relay
        first = await asyncio.gather(*(chat(http, server.url) for _ in range(6)))
        assert all(status == 200 and b"[DONE]" in body for status, body in first)
        # a cold start sends four; their 429s teach the relay: not six
        assert 1 <= statuses(mock).count(429) <= 4, statuses(mock)
        # the second wave: the relay knows the budget; the turns wait in its line
        mock.limits.log.clear()
        second = await asyncio.gather(*(chat(http, server.url) for _ in range(8)))
        assert all(status == 200 for status, _ in second)
        seen = statuses(mock)
        assert seen.count(200) == 8 and seen.count(429) <= 1, seen
        lim = next(server.relay.board.rates.all())
        assert lim.buckets["requests"].limit == 300
        assert lim.cred != "-" and "sk-test" not in lim.cred  # a hash, never the key
        assert lim.waited_total >= 5  # they waited at the relay


async def test_a_waiting_turn_shows_why_in_status_and_metrics(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    mock.limits = MockLimits(rpm=6, start=0.0)  # one every ten seconds
    async with RelayServer(config([mock.url])) as server:
        # a 429 that teaches the relay the budget, Retry-After 10: a cool-off first
        first = asyncio.ensure_future(chat(http, server.url))
        await until(lambda: len(mock.limits.log) >= 1)  # type: ignore[union-attr]
        second = asyncio.ensure_future(chat(http, server.url, **{"x-session-id": "b"}))

        async def parked() -> bool:
            data = await (await http.get(server.url + "/status")).json()
            return any(t.get("parked_for") in ("ratelimit", "cooloff") for t in data["inflight"])

        await until(parked)
        data = await (await http.get(server.url + "/status")).json()
        [up] = [u for u in data["upstreams"] if u["route"] == "mock"]
        [lim] = up["ratelimits"]
        assert lim["buckets"]["requests"]["limit"] == 6 and lim["limited_total"] >= 1
        metrics = await (await http.get(server.url + "/metrics")).text()
        assert 'unbroken_ratelimit_limit{bucket="requests"' in metrics
        assert "unbroken_ratelimit_waiting{" in metrics
        first.cancel()
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)


async def test_a_429_explained_by_the_limiter_is_not_also_a_pacer_failure(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    mock.script(
        [
            {
                "status": 429,
                "headers": {
                    "x-ratelimit-limit-requests": "600",
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset-requests": "100ms",
                },
            }
        ]
    )
    async with RelayServer(config([mock.url])) as server:
        assert (await chat(http, server.url))[0] == 200
        board = server.relay.board
        key = f"mock|{mock.url}"
        assert board.pacer(key).fail_streak == 0 and board.pacer(key).waited_total == 0
        assert board.get(key).cooloff_until == 0.0
        [lim] = list(board.rates.all())
        assert lim.limited_total == 1 and lim.waited_total == 1  # waited in the rate line once
        assert len(mock.requests) == 2


async def test_bad_rate_limit_headers_are_ignored_and_logged_once(
    mock: MockProvider, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    bad = {
        "x-ratelimit-limit-requests": "-5",
        "x-ratelimit-remaining-requests": "lots",
        "x-ratelimit-reset-requests": "87600h",
        "x-ratelimit-limit-tokens": "1e15",
    }
    mock.script([{"headers": bad, "count": 5}])
    caplog.set_level(logging.WARNING, logger="unbroken")
    async with RelayServer(config([mock.url])) as server:
        for _ in range(5):
            assert (await chat(http, server.url))[0] == 200  # never blocked by garbage
        [lim] = list(server.relay.board.rates.all())
        assert lim.buckets == {} and lim.waited_total == 0
    lines = [r.getMessage() for r in caplog.records if "rate-limit header" in r.getMessage()]
    assert len(lines) == len(bad), lines  # one per bad header, not one per answer
    for header in bad:
        assert sum(header + "=" in line for line in lines) == 1, header
    assert any("87600h" in line and "clamped" in line for line in lines)


async def test_a_busy_session_does_not_starve_the_others(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    mock.limits = MockLimits(rpm=300, start=0.0)  # five a second, spent at first
    async with RelayServer(config([mock.url])) as server:
        # a 429 (Retry-After: 1) teaches the relay the budget; its retry spends one
        assert (await chat(http, server.url, **{"x-session-id": "warm"}))[0] == 200
        lim = next(server.relay.board.rates.all())
        mock.requests.clear()
        busy = [
            asyncio.ensure_future(chat(http, server.url, **{"x-session-id": "busy"}))
            for _ in range(8)
        ]
        # what is left of the budget goes at once; the rest of the busy turns wait
        await until(lambda: len(lim.line) + len(mock.requests) >= 8)
        assert len(lim.line) >= 3
        light = [
            asyncio.ensure_future(chat(http, server.url, **{"x-session-id": f"light{i}"}))
            for i in range(3)
        ]
        results = await asyncio.gather(*busy, *light)
        assert all(status == 200 for status, _ in results)
        served = [r.headers.get("x-session-id", "") for r in mock.requests]
        assert sorted(set(served)) == ["busy", "light0", "light1", "light2"]
        # round robin across sessions: the light sessions, queued last, are served
        # before the busy one's last two turns (first come first served would put them
        # last)
        assert served[-2:] == ["busy", "busy"], served
        assert statuses(mock).count(429) <= 2


async def test_the_journal_records_time_queued_and_stats_report_it(
    mock: MockProvider, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = tmp_path / "journal.sqlite3"
    mock.limits = MockLimits(rpm=300, start=0.0)  # five a second, spent at first
    cfg = config([mock.url], journal={"enabled": True, "path": str(path)})
    async with RelayServer(cfg) as server:
        assert (await chat(http, server.url))[0] == 200  # learns the budget (a 429 first)
        lim = next(server.relay.board.rates.all())
        results = await asyncio.gather(*(chat(http, server.url) for _ in range(10)))
        assert all(status == 200 for status, _ in results)
        assert lim.waited_total >= 3
        metrics = await (await http.get(server.url + "/metrics")).text()
        assert 'unbroken_ratelimit_queued_seconds_count{route="mock"}' in metrics
    conn = sqlite3.connect(path)
    try:
        queued = [q for (q,) in conn.execute("SELECT queued_s FROM turns ORDER BY started")]
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        stats = compute_stats(conn, since_s=None)
    finally:
        conn.close()
    assert len(queued) == 11 and queued[0] == 0.0  # the first waited out a cool-off
    waited = [q for q in queued if q > 0]
    assert len(waited) >= 3
    assert stats["queued_s"]["turns"] == len(waited)
    assert stats["queued_s"]["total"] == pytest.approx(sum(queued), abs=1e-3)
    assert "Queued for rate limits" in format_stats(stats)


def test_an_older_journal_gains_the_queued_column_and_stats_read_one_without_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite3"
    lines = SCHEMA.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("wait_s"))
    lines[at] = "    wait_s       REAL NOT NULL DEFAULT 0"
    drop = ("queued_s", "splices", "saved_tokens", "continuation")  # versions 4 to 6
    old_schema = "\n".join(ln for ln in lines if not ln.lstrip().startswith(drop))
    assert "queued_s" not in old_schema.split("CREATE TABLE IF NOT EXISTS attempts")[0]
    conn = sqlite3.connect(path)
    conn.executescript(old_schema)
    conn.execute(
        "INSERT INTO turns (uid, run, turn_id, route, path, protocol, stream, started,"
        " ended, outcome, attempts, wait_s) VALUES ('r:1', 'r', 1, 'mock', 'p', 'chat', 1,"
        " ?, ?, 'ok', 1, 0)",
        (time.time(), time.time()),
    )
    conn.execute("PRAGMA user_version=3")
    conn.commit()
    stats = compute_stats(conn, since_s=None)  # a version 3 journal, read as it is
    conn.close()
    assert stats["turns"] == 1 and stats["queued_s"]["total"] == 0
    journal = Journal(path)
    conn = journal._open()  # what the writer thread does when the relay starts
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
        assert "queued_s" in columns
        assert conn.execute("SELECT queued_s FROM turns").fetchall() == [(0.0,)]
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


async def test_geminis_retry_delay_in_a_429_body_blocks_the_key_for_that_long(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    # The Gemini protocol reads the delay (`protocols.gemini.retry_delay`): the limiter
    # is told it as the 429's Retry-After, and the retry waits it once.
    body = json.dumps(
        {
            "error": {
                "code": 429,
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.4s"}
                ],
            }
        }
    )
    mock.script([{"status": 429, "body": body}])
    gemini = "/mock/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
    request = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    async with RelayServer(config([mock.url])) as server:
        async with http.post(
            server.url + gemini, json=request, headers={"x-goog-api-key": "AIza-test-rl-0001"}
        ) as r:
            assert r.status == 200
            assert b"finishReason" in await r.read()
        [first, second] = mock.requests
        assert second.at - first.at >= 0.4  # the delay the body asked for, not 5 ms
        [lim] = list(server.relay.board.rates.all())
        assert lim.limited_total == 1
        assert server.relay.board.get(f"mock|{mock.url}").cooloff_reason == "retry_after"


def test_a_credential_is_the_injected_key_else_the_clients_header_else_its_key_param() -> None:
    cfg = config(["http://127.0.0.1:1"])
    route = cfg.routes["mock"]
    io = RateLimitIO()
    assert io.creds_for(route, {"x-goog-api-key": "AIza-h"}, "alt=sse&key=AIza-q") == (
        credential_hash("AIza-h"),
    )
    # a Gemini API key in the URL (the header wins when both are sent)
    assert io.creds_for(route, {}, "alt=sse&key=AIza-q") == (credential_hash("AIza-q"),)
    assert io.creds_for(route, {}, "alt=sse&monkey=x") == ("-",)
    keyed = dataclasses.replace(
        route, upstreams=tuple(dataclasses.replace(u, api_key="sk-own") for u in route.upstreams)
    )
    assert io.creds_for(keyed, {}, "key=AIza-q") == (credential_hash("sk-own"),)


async def test_a_quantized_provider_is_not_stormed_through_the_relay(
    mock: MockProvider, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # issue 32: it reports 600 a minute and enforces 10 a second, with no Retry-After;
    # before, a 429 was waited until the learned rate "refilled" one request (under a
    # millisecond) with no retry delay and no pacer: thousands of requests a second
    caplog.set_level(logging.INFO, logger="unbroken")
    mock.limits = MockLimits(rpm=600, behaviour="quantized")
    cfg = config([mock.url], retry={"delay_ms": 250, "max_delay_ms": 30_000})
    async with RelayServer(cfg) as server:
        results = await asyncio.gather(*(chat(http, server.url) for _ in range(30)))
        assert all(status == 200 and b"[DONE]" in body for status, body in results)
        sent = statuses(mock)
        assert sent.count(200) == 30
        # the first second's (4 to 5 measured), and a probe: not one for every turn
        assert sent.count(429) <= 8, f"{sent.count(429)} 429s for 30 turns"
        # what the provider refused shows in /status: the throttle is on, at its rate
        up = await (await http.get(server.url + "/status")).json()
        [u] = [u for u in up["upstreams"] if u["route"] == "mock"]
        throttle = u["ratelimits"][0]["throttle"]
        assert throttle["on"] == (sent.count(429) > 0)
        metrics = await (await http.get(server.url + "/metrics")).text()
        assert ("unbroken_ratelimit_throttle_per_s{" in metrics) == throttle["on"]
    # the wait is in the log: one line when the line forms, with why; one when it clears
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pacing")]
    assert any("wait in line (rate limit (key " in line for line in lines), lines
    assert any("line cleared" in line for line in lines), lines
