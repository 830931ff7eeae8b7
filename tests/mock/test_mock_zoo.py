"""The mock's rate-limit zoo: each provider behaviour, driven over loopback on a moved clock."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from unbroken.core.admission.ratehead import parse_rate_headers
from unbroken.mock import MockProvider, main_mock
from unbroken.mock.limits import BEHAVIOURS, MockLimits

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
WALL = 1_800_000_000.0  # the wall clock the mock reads (fixed: RFC 3339 resets are exact)
RATE_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "retry-after")


class Clock:
    """The mock's monotonic clock, moved by the test instead of sleeping."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


Post = Callable[..., Any]


@asynccontextmanager
async def zoo(behaviour: str, **kw: Any) -> AsyncIterator[tuple[Post, Clock, MockLimits]]:
    """A mock with one zoo member's limits on a test clock, and a way to post to it."""
    clock = Clock()
    limits = MockLimits(behaviour=behaviour, clock=clock, wall=lambda: WALL, **kw)
    async with MockProvider(limits=limits) as mock, aiohttp.ClientSession() as http:

        async def post(
            key: str = "k", body: dict[str, Any] | None = None, path: str = "/v1/chat/completions"
        ) -> tuple[int, dict[str, str]]:
            async with http.post(
                mock.url + path, json=body or CHAT, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                await r.read()
                return r.status, {k.lower(): v for k, v in r.headers.items()}

        yield post, clock, limits


def rate_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith(RATE_PREFIXES)}


async def test_textbook_refills_continuously_with_truthful_headers_and_retry_after() -> None:
    async with zoo("textbook", rpm=3) as (post, clock, limits):
        got = [await post() for _ in range(4)]
        assert [s for s, _ in got] == [200, 200, 200, 429]
        first, last = got[0][1], got[3][1]
        assert first["x-ratelimit-limit-requests"] == "3"
        assert first["x-ratelimit-remaining-requests"] == "2"
        assert first["x-ratelimit-reset-requests"] == "20.000s"  # one of three a minute back
        assert last["x-ratelimit-remaining-requests"] == "0"
        assert last["x-ratelimit-reset-requests"] == "1m0.000s"  # until full
        assert last["retry-after"] == "20"
        clock.t += 20.0
        assert (await post())[0] == 200
        assert [s for _, _, s in limits.log] == [200, 200, 200, 429, 200]
        assert limits.view()["behaviour"] == "textbook"


async def test_quantized_reports_per_minute_but_enforces_per_second() -> None:
    async with zoo("quantized", rpm=300) as (post, clock, _):
        got = [await post() for _ in range(6)]
        # 300 a minute is reported, 5 a second is enforced: the sixth in a second is refused
        assert [s for s, _ in got] == [200] * 5 + [429]
        h = got[5][1]
        assert h["x-ratelimit-limit-requests"] == "300"
        assert h["x-ratelimit-remaining-requests"] == "295"  # the minute's budget looks ample
        assert h["x-ratelimit-reset-requests"] == "200ms"  # when the next request may go
        assert h["retry-after"] == "1"
        assert got[0][1]["x-ratelimit-reset-requests"] == "0ms"
        clock.t += 0.2
        assert (await post())[0] == 200
        assert (await post())[0] == 429
        clock.t += 1.0  # a second later: five more, never a minute's worth
        assert [(await post())[0] for _ in range(6)] == [200] * 5 + [429]


async def test_quantized_does_not_enforce_per_second_under_textbook() -> None:
    async with zoo("textbook", rpm=300) as (post, _, _):
        assert [(await post())[0] for _ in range(6)] == [200] * 6


async def test_reset_next_says_when_the_next_request_may_go() -> None:
    async with zoo("reset-next", rpm=3, tpm=1000) as (post, clock, _):
        got = [await post() for _ in range(4)]
        assert [s for s, _ in got] == [200, 200, 200, 429]
        assert got[0][1]["x-ratelimit-remaining-requests"] == "2"
        assert got[0][1]["x-ratelimit-reset-requests"] == "0ms"  # textbook: 20 s until full
        assert got[0][1]["x-ratelimit-reset-tokens"] == "0ms"
        assert got[2][1]["x-ratelimit-reset-requests"] == "20.000s"  # textbook: 1m0s
        assert got[3][1]["retry-after"] == "20"
        clock.t += 20.0
        assert (await post())[0] == 200


async def test_no_retry_after_sends_budgets_but_no_retry_after() -> None:
    async with zoo("no-retry-after", rpm=1, start=0.0) as (post, _, _):
        status, h = await post()
        assert status == 429
        assert "retry-after" not in h and "retry-after-ms" not in h
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-reset-requests"] == "1m0.000s"


async def test_bare_sends_no_rate_limit_headers_at_all() -> None:
    async with zoo("bare", rpm=2, tpm=1000) as (post, clock, limits):
        got = [await post() for _ in range(3)]
        assert [s for s, _ in got] == [200, 200, 429]
        assert [rate_headers(h) for _, h in got] == [{}, {}, {}]
        clock.t += 30.0
        status, h = await post()
        assert status == 200 and rate_headers(h) == {}
        assert [s for _, _, s in limits.log] == [200, 200, 429, 200]


async def test_anthropic_sends_its_four_header_families_with_rfc3339_resets() -> None:
    body = {
        "model": "claude",
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with zoo("anthropic", rpm=50, tpm=40_000) as (post, _, limits):
        assert limits.style == "anthropic"
        status, h = await post(body=body, path="/v1/messages")
        assert status == 200
        for fam in ("requests", "tokens", "input-tokens", "output-tokens"):
            for part in ("limit", "remaining", "reset"):
                assert f"anthropic-ratelimit-{fam}-{part}" in h, (fam, part)
        assert not any(k.startswith("x-ratelimit-") for k in h)
        assert h["anthropic-ratelimit-requests-limit"] == "50"
        assert h["anthropic-ratelimit-requests-remaining"] == "49"
        reset = datetime.fromisoformat(h["anthropic-ratelimit-requests-reset"]).timestamp()
        assert reset == pytest.approx(WALL + 1.2)  # one of 50 a minute
        assert h["anthropic-ratelimit-input-tokens-limit"] == "40000"
        assert h["anthropic-ratelimit-output-tokens-limit"] == "8000"
        assert h["anthropic-ratelimit-output-tokens-remaining"] == "7000"  # max_tokens held
        # "tokens" is the most restrictive of the two: output, an eighth spent
        assert h["anthropic-ratelimit-tokens-remaining"] == "7000"
        parsed = parse_rate_headers(h, now_wall=WALL)
        assert parsed.problems == ()
        assert parsed.requests is not None and parsed.requests.remaining == 49
        # output tokens run out first: 7 more fit, the 9th waits with retry-after
        statuses = [(await post(body=body, path="/v1/messages")) for _ in range(8)]
        assert [s for s, _ in statuses] == [200] * 7 + [429]
        assert statuses[7][1]["retry-after"] == "8"  # 1000 output tokens at 8000 a minute


async def test_tpm_binds_on_a_large_first_request_while_requests_are_ample() -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 39_000}]}  # Codex: 39 KB
    async with zoo("tpm", rpm=500, tpm=15_000) as (post, clock, _):
        status, h = await post(body=big)
        assert status == 200
        cost = 15_000 - int(h["x-ratelimit-remaining-tokens"])
        assert 9_700 < cost < 10_000  # a quarter of the body's length
        status, h = await post(body=big)
        assert status == 429
        assert h["x-ratelimit-remaining-requests"] == "499"  # requests are not the limit
        need = cost - (15_000 - cost)  # tokens missing, at 250 a second
        assert h["retry-after"] == str(-(-need // 250))
        clock.t += need / 250 + 0.01
        assert (await post(body=big))[0] == 200


async def test_overstated_reports_more_left_than_the_bucket_holds() -> None:
    async with zoo("overstated", rpm=10, start=0.0) as (post, _, limits):
        status, h = await post()
        assert status == 429  # the bucket is empty...
        assert h["x-ratelimit-remaining-requests"] == "5"  # ...but half the limit is reported
        assert h["retry-after"] == "6"  # the retry-after is true
        assert limits.keys["Bearer k"].requests.level == 0


async def test_shared_drains_the_bucket_with_traffic_the_client_does_not_see() -> None:
    async with zoo("shared", rpm=60, start=0.0, shared=0.5) as (post, clock, _):
        assert (await post())[0] == 429
        clock.t += 10.0  # ten requests' worth refilled; the unseen traffic took half
        got = [await post() for _ in range(6)]
        assert [s for s, _ in got] == [200] * 5 + [429]
        assert got[0][1]["x-ratelimit-limit-requests"] == "60"  # the limit is the key's
        assert got[5][1]["x-ratelimit-remaining-requests"] == "0"
    async with zoo("textbook", rpm=60, start=0.0) as (post, clock, _):
        assert (await post())[0] == 429  # the key is first seen spent
        clock.t += 10.0
        assert [(await post())[0] for _ in range(11)] == [200] * 10 + [429]


async def test_every_zoo_member_logs_each_request_and_is_named_in_view() -> None:
    for behaviour in BEHAVIOURS:
        kw: dict[str, Any] = {"rpm": 1, "start": 0.0}
        if behaviour == "tpm":
            kw["tpm"] = 1000
        async with zoo(behaviour, **kw) as (post, _, limits):
            assert (await post("a"))[0] == 429
            assert limits.log == [(1000.0, "Bearer a", 429)]
            assert limits.view()["behaviour"] == behaviour


async def test_the_control_api_sets_a_zoo_member_and_rejects_bad_ones() -> None:
    async with MockProvider() as mock, aiohttp.ClientSession() as http:
        url = mock.url + "/_mock/limits"
        async with http.post(url, json={"rpm": 60, "behaviour": "quantized"}) as r:
            assert r.status == 200
        async with http.get(url) as r:
            assert (await r.json())["behaviour"] == "quantized"
        for bad, where in (
            ({"behaviour": "lenient"}, "limits.behaviour"),
            ({"behaviour": "shared", "shared": 1}, "limits.shared"),
            ({"behaviour": "tpm"}, "limits.tpm"),
            ({"overstate": -1}, "limits.overstate"),
        ):
            async with http.post(url, json=bad) as r:
                assert r.status == 400 and where in (await r.json())["error"], bad


def test_cli_rejects_bad_rate_limit_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_mock(["--rate-limits", "lenient"]) == 2
    assert main_mock(["--rpm", "nan"]) == 2
    assert "--rpm" in capsys.readouterr().err
    assert main_mock(["--rate-limits", "tpm"]) == 2
    assert "--tpm" in capsys.readouterr().err


async def test_cli_serves_a_zoo_member() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken.mock",
        "--port",
        "0",
        "--rate-limits",
        "bare",
        "--rpm",
        "1",
        "--rate-start",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        url = line.rsplit(" ", 1)[-1]
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 429
                assert rate_headers({k.lower(): v for k, v in r.headers.items()}) == {}
            async with http.get(url + "/_mock/limits") as r:
                view = await r.json()
        assert view["behaviour"] == "bare" and view["rpm"] == 1 and view["limited"] == 1
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
