"""The Gemini API through the relay, over real loopback sockets to the mock: storms
absorbed, RetryInfo obeyed, cuts replayed before output and ended by the client's
profile after it, keys in ``x-goog-api-key`` and ``?key=`` injected and stripped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from relayfix import KEY_TOKEN, make_config, start_relay
from unbroken.config import BUILTIN_ROUTES
from unbroken.core.wire.protocols.gemini import BLANK_LINE_KEEPALIVE
from unbroken.mock import MockProvider
from unbroken.mock.testing import read_body
from unbroken.mock.wire import frames_for
from unbroken.relay.upstream import strip_key_param

MODEL = "gemini-2.5-flash"
STREAM = f"/g/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
PLAIN = f"/g/v1beta/models/{MODEL}:generateContent"
BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
VIEW = {**BODY, "model": MODEL, "stream": True}
CLI_UA = f"GeminiCLI/0.61.0/{MODEL} (linux; x64; terminal)"
CLEAN = b"".join(frames_for("gemini", None, VIEW))


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def relay(mock: MockProvider, **kw: Any) -> Any:
    upstream = {"url": mock.url, **kw.pop("upstream", {})}
    server, rec = await start_relay(make_config([upstream], route="g", **kw))
    return server, rec


async def post(
    session: aiohttp.ClientSession, url: str, path: str = STREAM, ua: str = CLI_UA, **kw: Any
) -> tuple[int, bytes, BaseException | None]:
    headers = {"user-agent": ua, "x-goog-api-key": "client-key", **kw.pop("headers", {})}
    async with session.post(url + path, json=BODY, headers=headers, **kw) as resp:
        data, err = await read_body(resp)
        return resp.status, data, err


def test_the_builtin_route() -> None:
    assert BUILTIN_ROUTES["gemini"] == "https://generativelanguage.googleapis.com"


async def test_a_503_storm_is_absorbed(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    server, rec = await relay(mock)
    try:
        mock.script([{"status": 503, "count": 30}])
        status, data, err = await post(session, server.url)
        assert (status, data, err) == (200, CLEAN, None)
        assert len(mock.requests) == 31
        [turn] = await rec.wait_turns(1)
        assert turn.protocol == "gemini" and turn.client == "gemini-cli"
        assert turn.outcome == "recovered"
    finally:
        await server.stop()


async def test_retry_info_is_obeyed(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    body = json.dumps(
        {
            "error": {
                "code": 429,
                "status": "RESOURCE_EXHAUSTED",
                "message": "You exceeded your current quota, please check your plan.",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.6s"}
                ],
            }
        }
    )
    server, rec = await relay(mock)
    try:
        mock.script([{"status": 429, "body": body}])
        status, data, _ = await post(session, server.url)
        assert (status, data) == (200, CLEAN)
        first, second = mock.requests
        assert second.at - first.at >= 0.6  # not the 5 ms retry delay
        assert rec.failures[0][0] == "429" and rec.failures[0][2] == pytest.approx(0.6)
    finally:
        await server.stop()


async def test_a_cut_before_output_is_replayed_invisibly(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    tool = {"reply": "tool", "tool_name": "run_shell_command", "tool_args": {"command": "ls"}}
    server, rec = await relay(mock, stream={"first_frame_timeout_s": 0.3})
    try:
        mock.script(
            [
                {"fault": "reset_after_headers"},
                {**tool, "fault": "stall", "after_frame": 0, "seconds": 30},
                tool,
            ]
        )
        status, data, err = await post(session, server.url, headers={})
        assert status == 200 and err is None
        assert data == b"".join(frames_for("gemini", tool, VIEW))
        assert len(mock.requests) == 3
        assert [f[:2] for f in rec.failures] == [
            ("server_disconnected", "pending"),
            ("stall", "stall"),
        ]
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("ua", "ends_with_error"), [(CLI_UA, False), ("google-genai-sdk/1.30.0 gl-python/3.12", True)]
)
async def test_a_cut_after_output_ends_as_the_client_profile_says(
    mock: MockProvider, session: aiohttp.ClientSession, ua: str, ends_with_error: bool
) -> None:
    server, rec = await relay(mock)
    try:
        mock.script([{"fault": "reset", "after_frame": 2}])
        status, data, err = await post(session, server.url, ua=ua)
        two = b"".join(frames_for("gemini", None, VIEW)[:2])
        assert status == 200 and data.startswith(two)
        if ends_with_error:
            assert err is None  # the stream ends with the native error event
            tail = data[len(two) :]
            assert json.loads(tail[6:])["error"]["code"] == 503 and tail.endswith(b"\r\n\r\n")
        else:
            assert err is not None and data == two  # a reset: no error event, no clean end
        assert len(mock.requests) == 1  # never replayed after output
        [turn] = await rec.wait_turns(1)
        assert turn.outcome == "ended_with_error"
    finally:
        await server.stop()


async def test_early_headers_then_blank_line_keepalives(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    server, _ = await relay(mock, stream={"early_headers_s": 0.2, "keepalive_s": 0.2})
    try:
        mock.script([{"delay_ms": 700}])
        status, data, err = await post(session, server.url)
        assert status == 200 and err is None
        assert data.endswith(CLEAN)
        lead = data[: -len(CLEAN)]
        # blank lines only, no SSE comment
        assert lead and lead == BLANK_LINE_KEEPALIVE * (len(lead) // len(BLANK_LINE_KEEPALIVE))
    finally:
        await server.stop()


async def test_generate_content_is_a_plain_body(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    server, _ = await relay(mock)
    try:
        mock.script([{"status": 503, "count": 2}])
        status, data, _ = await post(session, server.url, PLAIN)
        assert status == 200
        assert json.loads(data) == json.loads(
            b"".join(frames_for("gemini", None, {**BODY, "model": MODEL, "stream": False}))
        )
    finally:
        await server.stop()


async def test_an_injected_key_replaces_the_header_and_the_query_key(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    server, _ = await relay(
        mock, upstream={"api_key_env": "GEMINI_KEY"}, env={"GEMINI_KEY": "route-key-0123456789"}
    )
    base = f"{server.url}/t/{KEY_TOKEN}"  # the route injects a key: it needs the token
    try:
        await post(session, base, STREAM + "&key=client-query-key&$x=1")
        await post(session, base, STREAM + "&key=client-query-key", headers={"x-goog-api-key": ""})
        for req in mock.requests:
            assert req.headers.getall("x-goog-api-key") == ["route-key-0123456789"]
            assert "key" not in req.query and req.query["alt"] == "sse"
            assert "client" not in json.dumps(dict(req.headers))
        assert mock.requests[0].query["$x"] == "1"
    finally:
        await server.stop()


async def test_without_injection_the_clients_keys_pass(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    server, _ = await relay(mock)
    try:
        await post(session, server.url, STREAM + "&key=client-query-key")
        [req] = mock.requests
        assert req.query["key"] == "client-query-key"
        assert req.headers["x-goog-api-key"] == "client-key"
    finally:
        await server.stop()


def test_strip_key_param_keeps_the_rest_byte_for_byte() -> None:
    assert strip_key_param("alt=sse&key=abc") == ("alt=sse", True)
    assert strip_key_param("key=abc&alt=sse&x=%2F") == ("alt=sse&x=%2F", True)
    assert strip_key_param("alt=sse&monkey=1") == ("alt=sse&monkey=1", False)
    assert strip_key_param("") == ("", False)
