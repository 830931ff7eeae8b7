"""The relay's wait for a streamed request's response headers follows the client's own
header timer (issue 33): Claude Code waits 360 s for headers and gets no early headers,
so the relay must not cut at 120 s and ask again; Gemini CLI's ~60 s header timer is
disarmed by early headers, so the relay asks again by then, not after 120 s."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import aiohttp
import pytest

from agents.test_profiles import CLAUDE, MESSAGES, machine
from relayfix import start_relay
from unbroken.config import parse_config
from unbroken.core.profiles import PROFILES
from unbroken.core.turn.turn_types import Open
from unbroken.core.wire.protocols import ANTHROPIC


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("header_s", [30.0, 120.0, 900.0])
def test_the_header_wait_never_cuts_what_the_client_would_take_nor_outwaits_a_disarmed_timer(
    name: str, header_s: float
) -> None:
    profile = PROFILES[name]
    wait = profile.header_timeout(header_s)
    client = profile.client_header_timeout_s
    if client is None:
        assert wait == header_s  # an unknown timer: [stream] header_timeout_s
    elif profile.early_headers:
        assert wait <= client  # the client's timer is disarmed: ask again by its time
        assert wait <= header_s
    else:
        assert wait >= client  # its own timer runs: never cut an answer it would take


def test_known_header_timers() -> None:
    assert PROFILES["claude-code"].client_header_timeout_s == 360.0  # 2.1.328, measured
    assert PROFILES["gemini-cli"].client_header_timeout_s == 60.0  # 0.61.0, about 60 s
    assert machine(PROFILES["claude-code"], ANTHROPIC).start(0.0) == Open(0, 360.0)
    assert machine(PROFILES["gemini-cli"], ANTHROPIC).start(0.0) == Open(0, 60.0)
    assert machine(PROFILES["unknown"], ANTHROPIC).start(0.0) == Open(0, 120.0)


async def _relay(mock: Any, clients: dict[str, Any], stream: dict[str, Any]) -> Any:
    cfg = parse_config(
        {
            "retry": {"delay_ms": 5, "backoff": "fixed"},
            "routes": {"mock": {"upstreams": [{"url": mock.url}]}},
            "journal": {"enabled": False},
            "stream": stream,
            "clients": clients,
        },
        env={},
    )
    server, _ = await start_relay(dataclasses.replace(cfg, port=0, grace_s=5.0))
    return server


STREAMED = {
    "model": "m",
    "max_tokens": 16,
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}


async def test_slow_headers_reach_claude_code_after_one_request(mock: Any) -> None:
    """Scaled down 100x: Claude Code waits 3.6 s (360 s) for headers that come after
    1.5 s (150 s) every time; the relay's [stream] header_timeout_s is 1.2 s (120 s).
    Before: the relay cut at 1.2 s and asked again, forever (4 requests in 450 s)."""
    mock.set_default({"delay_ms": 1500})
    server = await _relay(
        mock, {"claude-code": {"client_header_timeout_s": 3.6}}, {"header_timeout_s": 1.2}
    )
    try:
        timeout = aiohttp.ClientTimeout(total=3.6)
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.post(f"{server.url}/{MESSAGES}", json=STREAMED, headers=CLAUDE) as r,
        ):
            assert r.status == 200
            body = await r.read()
        assert b"message_stop" in body
        assert len(mock.requests) == 1
    finally:
        await server.stop()


GEMINI = {"User-Agent": "GeminiCLI/0.61.0/gemini-2.5-pro (linux; x64)"}
GEMINI_PATH = "mock/v1beta/models/m:streamGenerateContent?alt=sse"
GEMINI_BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}


async def test_a_stall_before_headers_is_asked_again_at_geminis_own_time(mock: Any) -> None:
    """Scaled down: Gemini CLI's header timer (0.6 s here) is disarmed by early headers
    (0.2 s here); the first request hangs before its headers, the second answers.  The
    relay asks again at the client's 0.6 s, not at its own header_timeout_s (30 s)."""
    mock.script([{"delay_ms": 60_000}])  # the first request: no headers for a minute
    server = await _relay(
        mock,
        {"gemini-cli": {"client_header_timeout_s": 0.6, "early_headers_s": 0.2}},
        {"header_timeout_s": 30.0},
    )
    try:
        t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=20.0)
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.post(f"{server.url}/{GEMINI_PATH}", json=GEMINI_BODY, headers=GEMINI) as r,
        ):
            assert r.status == 200
            body = await r.read()
        took = time.monotonic() - t0
        assert b"finishReason" in body
        assert len(mock.requests) == 2
        assert took < 20.0  # (the old relay waited out its 30 s header timeout)
    finally:
        await server.stop()
