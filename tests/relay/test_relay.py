"""The foundation relay over real sockets: retry, reroute, pass-through, limits."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from relayfix import KEY_AUTH, make_config, start_relay
from unbroken.mock import MockProvider

CHAT: dict[str, Any] = {"model": "m-1", "messages": [{"role": "user", "content": "hi"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with http.post(url, json=body, headers=headers or {}) as r:
        return r.status, dict(r.headers), await r.read()


async def test_503_storm_then_200_gets_exact_bytes(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"status": 503}] * 5)
        status, _, body = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        direct_status, _, direct = await _post(http, f"{mock.url}/v1/chat/completions", CHAT)
        assert status == 200 and direct_status == 200
        assert body == direct
        provider_calls = mock.requests[:6]
        assert len(provider_calls) == 6
        assert len({r.body for r in provider_calls}) == 1  # replayed byte-identical
        assert [f[0] for f in rec.failures] == ["503"] * 5
    finally:
        await server.stop()


async def test_retry_after_is_honoured(mock: MockProvider, http: aiohttp.ClientSession) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"status": 429, "headers": {"Retry-After": "1"}}])
        t0 = time.monotonic()
        status, _, _ = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 200
        assert time.monotonic() - t0 >= 1.0
        assert rec.failures[0][2] == pytest.approx(1.0)
    finally:
        await server.stop()


async def test_retry_after_is_capped(mock: MockProvider, http: aiohttp.ClientSession) -> None:
    cfg = make_config([{"url": mock.url}], retry={"max_retry_after_ms": 50})
    server, rec = await start_relay(cfg)
    try:
        mock.script([{"status": 503, "headers": {"Retry-After": "3600"}}])
        status, _, _ = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 200
        assert rec.failures[0][2] == pytest.approx(0.05)
    finally:
        await server.stop()


async def test_testing_mode_skips_real_waits_and_still_reports_them(
    mock: MockProvider, http: aiohttp.ClientSession, no_waits: None
) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"status": 429, "headers": {"Retry-After": "30"}}])
        t0 = time.monotonic()
        status, _, _ = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 200
        assert time.monotonic() - t0 < 10  # not the 30 s the upstream asked for
        assert rec.failures[0][2] == pytest.approx(30.0)  # reported as it would be
    finally:
        await server.stop()


async def test_retry_after_ms_and_http_date(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"status": 503, "headers": {"retry-after-ms": "120"}}])
        assert (await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT))[0] == 200
        assert rec.failures[0][2] == pytest.approx(0.12)
    finally:
        await server.stop()


async def test_400_passes_straight_through(mock: MockProvider, http: aiohttp.ClientSession) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        body = '{"error": {"message": "bad", "type": "invalid_request_error"}}'
        mock.script([{"status": 400, "body": body, "headers": {"x-upstream": "yes"}}])
        status, headers, got = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 400
        assert got == body.encode()
        assert headers.get("x-upstream") == "yes"
        assert len(mock.requests) == 1
        assert rec.failures == []
    finally:
        await server.stop()


async def test_refused_primary_fails_over_without_delay(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    # delay_ms is large: a failover that waited would take 5 s.
    cfg = make_config([{"url": dead}, {"url": mock.url}], retry={"delay_ms": 5000})
    server, rec = await start_relay(cfg)
    try:
        t0 = time.monotonic()
        status, _, _ = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 200
        assert time.monotonic() - t0 < 4.0
        assert rec.failures == [("connection_refused", "connect", 0.0)]
    finally:
        await server.stop()


async def test_dns_failure_is_retryable(mock: MockProvider, http: aiohttp.ClientSession) -> None:
    cfg = make_config([{"url": "http://no-such-host.invalid"}, {"url": mock.url}])
    server, rec = await start_relay(cfg)
    try:
        status, _, _ = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 200
        assert rec.failures[0][0] == "dns"
    finally:
        await server.stop()


async def test_max_attempts_passes_last_answer_through(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    server, _ = await start_relay(make_config([{"url": mock.url}], retry={"max_attempts": 3}))
    try:
        mock.script(
            [{"status": 503, "body": f'{{"n": {i}}}', "headers": {"x-n": str(i)}} for i in range(5)]
        )
        status, headers, body = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 503
        assert body == b'{"n": 2}' and headers["x-n"] == "2"
        assert len(mock.requests) == 3
    finally:
        await server.stop()


async def test_network_failure_exhausted_gives_protocol_shaped_502(
    http: aiohttp.ClientSession,
) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    server, _ = await start_relay(make_config([{"url": dead}], retry={"max_attempts": 2}))
    try:
        status, _, body = await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
        assert status == 502
        err = json.loads(body)["error"]
        assert set(err) >= {"message", "type", "code"}
        status, _, body = await _post(http, f"{server.url}/mock/v1/messages", CHAT)
        assert status == 502
        payload = json.loads(body)
        assert payload["type"] == "error" and set(payload["error"]) >= {"type", "message"}
    finally:
        await server.stop()


async def test_client_disconnect_during_wait_stops_retrying(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}], retry={"delay_ms": 60_000})
    server, rec = await start_relay(cfg)
    try:
        mock.script([{"status": 503}, {"status": 503}])
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(
                session.post(f"{server.url}/mock/v1/chat/completions", json=CHAT)
            )
            await mock.wait_for_requests(1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        turns = await rec.wait_turns(1)
        assert turns[0].outcome == "aborted_by_client"
        assert len(mock.requests) == 1
        assert not server.relay.inflight
    finally:
        await server.stop()


async def test_oversize_body_gets_413(mock: MockProvider, http: aiohttp.ClientSession) -> None:
    cfg = make_config([{"url": mock.url}], retry={"max_body_mb": 0.001})
    server, _ = await start_relay(cfg)
    try:
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
        status, _, body = await _post(http, f"{server.url}/mock/v1/chat/completions", big)
        assert status == 413
        assert "max_body_mb" in json.loads(body)["error"]["message"]
        assert mock.requests == []
    finally:
        await server.stop()


async def test_unknown_route_404_lists_routes(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    try:
        async with http.get(f"{server.url}/nope/v1/models") as r:
            assert r.status == 404
            payload = await r.json()
        assert "/mock/..." in payload["routes"] and "/openai/..." in payload["routes"]
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 200
            assert (await r.json())["status"] == "ok"
    finally:
        await server.stop()


async def test_streamed_200_chunks_byte_identical(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    try:
        body = {**CHAT, "stream": True}
        action = {"x-mock-action": json.dumps({"deltas": 200})}
        _, _, direct = await _post(http, f"{mock.url}/v1/chat/completions", body, action)
        status, headers, got = await _post(
            http, f"{server.url}/mock/v1/chat/completions", body, action
        )
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        assert got == direct
        assert got.count(b"data: ") >= 200
    finally:
        await server.stop()


async def test_non_streamed_cut_after_bytes_is_not_complete(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"fault": "reset", "after_frame": 1}])
        with pytest.raises(aiohttp.ClientPayloadError):
            await _post(http, f"{server.url}/mock/v1/chat/completions", CHAT)
    finally:
        await server.stop()


async def test_model_rewrite_and_key_injection(
    mock: MockProvider, http: aiohttp.ClientSession
) -> None:
    env = {"BACKUP_KEY": "sk-injected-123"}
    cfg = make_config(
        [{"url": mock.url, "api_key_env": "BACKUP_KEY", "models": {"m-1": "vendor/m-1"}}], env=env
    )
    server, _ = await start_relay(cfg)
    try:
        await _post(
            http,
            f"{server.url}/mock/v1/chat/completions?x=1",
            CHAT,
            {"Authorization": "Bearer sk-client", "OpenAI-Beta": "b", **KEY_AUTH},
        )
        req = mock.requests[0]
        assert req.json()["model"] == "vendor/m-1"
        assert req.headers["Authorization"] == "Bearer sk-injected-123"
        assert req.headers["OpenAI-Beta"] == "b"
        assert req.headers["Accept-Encoding"] == "identity"
        assert req.query == "x=1" or req.query.get("x") == "1"
        await _post(
            http, f"{server.url}/mock/v1/messages", CHAT, {"x-api-key": "sk-client", **KEY_AUTH}
        )
        assert mock.requests[1].headers["x-api-key"] == "sk-injected-123"
        assert "Authorization" not in mock.requests[1].headers
    finally:
        await server.stop()


async def test_canary_key_never_logged(
    mock: MockProvider, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    canary = "sk-canary-7f3e9d"
    env = {"CANARY": canary + "-configured"}
    cfg = make_config([{"url": mock.url, "api_key_env": "CANARY"}], env=env)
    caplog.set_level(logging.DEBUG)
    server, rec = await start_relay(cfg)
    try:
        mock.script([{"status": 503}, {"fault": "close_before_headers"}, {"status": 429}])
        status, _, _ = await _post(
            http,
            f"{server.url}/mock/v1/chat/completions",
            CHAT,
            {"Authorization": f"Bearer {canary}", "x-api-key": canary, **KEY_AUTH},
        )
        assert status == 200
        assert len(rec.failures) == 3
        assert "retry route=mock" in caplog.text
        assert canary not in caplog.text
    finally:
        await server.stop()


async def test_openai_sdk_through_relay(mock: MockProvider) -> None:
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"status": 503}, {"fault": "close_before_headers"}])
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/mock/v1", api_key="sk-test", max_retries=0
        )
        done = await client.chat.completions.create(**CHAT)
        assert done.choices[0].message.content
        mock.script([{"status": 502}])
        stream = await client.chat.completions.create(**CHAT, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == done.choices[0].message.content
        await client.close()
    finally:
        await server.stop()
