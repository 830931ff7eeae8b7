"""Fault injection over real loopback sockets, observed with a raw aiohttp client."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import aiohttp
import pytest

from unbroken.mock import MockProvider, frames_for
from unbroken.mock.testing import parse_sse_json, read_body, split_sse
from unbroken.mock.wire import BODY_GARBAGE, garbage_frame

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}
PROTOCOLS = list(PATHS)


def request_json(protocol: str, stream: bool = True) -> dict[str, Any]:
    if protocol == "responses":
        return {"model": "m-test", "stream": stream, "input": "hi"}
    req: dict[str, Any] = {
        "model": "m-test",
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if protocol == "anthropic":
        req["max_tokens"] = 64
    return req


async def post(
    session: aiohttp.ClientSession,
    mock: MockProvider,
    protocol: str,
    stream: bool = True,
    **kwargs: Any,
) -> aiohttp.ClientResponse:
    return await session.post(
        mock.url + PATHS[protocol], json=request_json(protocol, stream), **kwargs
    )


# -- status -----------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_status_with_headers(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str
) -> None:
    mock.script([{"status": 503, "headers": {"Retry-After": "1", "X-Extra": 5}}])
    async with await post(session, mock, protocol) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert resp.headers["X-Extra"] == "5"
        assert resp.content_type == "application/json"
        body = await resp.json()
    if protocol == "anthropic":
        assert body["type"] == "error"
        assert body["error"]["type"] == "overloaded_error"
        assert isinstance(body["error"]["message"], str)
    else:
        assert body["error"]["type"] == "server_error"
        assert set(body["error"]) >= {"message", "type", "code"}
    # the queue is consumed: the next request is the default OK reply
    async with await post(session, mock, protocol) as resp:
        assert resp.status == 200


@pytest.mark.parametrize(
    ("status", "protocol", "etype"),
    [
        (429, "chat", "tokens"),
        (400, "anthropic", "invalid_request_error"),
        (401, "anthropic", "authentication_error"),
        (500, "anthropic", "api_error"),
        (529, "anthropic", "overloaded_error"),
        (418, "responses", "invalid_request_error"),
    ],
)
async def test_status_default_bodies(
    mock: MockProvider, session: aiohttp.ClientSession, status: int, protocol: str, etype: str
) -> None:
    mock.script([{"status": status}])
    async with await post(session, mock, protocol) as resp:
        assert resp.status == status
        body = await resp.json()
    assert body["error"]["type"] == etype


async def test_status_custom_body(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script(
        [{"status": 502, "body": "<html>bad gateway</html>"}, {"status": 200, "body": "{}"}]
    )
    async with await post(session, mock, "chat") as resp:
        assert resp.status == 502
        assert resp.content_type == "text/plain"
        assert await resp.text() == "<html>bad gateway</html>"
    async with await post(session, mock, "chat") as resp:
        assert resp.status == 200
        assert await resp.json() == {}


# -- connection-level faults --------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_close_before_headers(
    mock: MockProvider, session: aiohttp.ClientSession, stream: bool
) -> None:
    mock.script([{"fault": "close_before_headers"}])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await post(session, mock, "chat", stream)
    await mock.wait_for_requests(1)
    assert mock.requests[0].json()["stream"] is stream  # the request was read and recorded


@pytest.mark.parametrize("stream", [True, False])
async def test_reset_after_headers(
    mock: MockProvider, session: aiohttp.ClientSession, stream: bool
) -> None:
    mock.script([{"fault": "reset_after_headers"}])
    async with await post(session, mock, "anthropic", stream) as resp:
        assert resp.status == 200
        data, error = await read_body(resp)
    assert data == b""
    assert isinstance(error, aiohttp.ClientPayloadError)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("k", [0, 1, 3])
async def test_reset_after_frame(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str, k: int
) -> None:
    expected = frames_for(protocol, {}, request_json(protocol))
    mock.script([{"fault": "reset", "after_frame": k}])
    async with await post(session, mock, protocol) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        data, error = await read_body(resp)
    assert isinstance(error, aiohttp.ClientPayloadError)
    frames, rest = split_sse(data)
    assert frames == expected[:k]
    assert rest == b""


async def test_reset_with_rst(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"fault": "reset", "after_frame": 2, "rst": True}])
    async with await post(session, mock, "chat") as resp:
        _, error = await read_body(resp)
    assert isinstance(error, aiohttp.ClientError)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_end_after_frame(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str
) -> None:
    expected = frames_for(protocol, {}, request_json(protocol))
    mock.script([{"fault": "end", "after_frame": 4}])
    async with await post(session, mock, protocol) as resp:
        data, error = await read_body(resp)
    assert error is None
    assert split_sse(data) == (expected[:4], b"")
    # the connection is still usable (clean end, keep-alive)
    async with await post(session, mock, protocol) as resp:
        assert await resp.read() == b"".join(expected)


async def test_stall_until_client_timeout(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    expected = frames_for("responses", {}, request_json("responses"))
    mock.script([{"fault": "stall", "after_frame": 3}])  # default: hold for an hour
    timeout = aiohttp.ClientTimeout(sock_read=0.3)
    async with await post(session, mock, "responses", timeout=timeout) as resp:
        data, error = await read_body(resp)
    assert isinstance(error, TimeoutError)
    assert split_sse(data) == (expected[:3], b"")


async def test_stall_seconds_then_abort(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    expected = frames_for("chat", {}, request_json("chat"))
    mock.script([{"fault": "stall", "after_frame": 2, "seconds": 0.2}])
    started = time.monotonic()
    async with await post(session, mock, "chat") as resp:
        data, error = await read_body(resp)
    assert time.monotonic() - started >= 0.2
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert split_sse(data) == (expected[:2], b"")


async def test_stop_while_stalled_is_prompt(session: aiohttp.ClientSession) -> None:
    mock = MockProvider()
    await mock.start()
    mock.script([{"fault": "stall", "after_frame": 1}])
    resp = await post(session, mock, "anthropic")
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"event: message_start")
    started = time.monotonic()
    await mock.stop()
    assert time.monotonic() - started < 2
    _, error = await read_body(resp)
    assert isinstance(error, aiohttp.ClientPayloadError)
    resp.release()


# -- in-stream errors -----------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "message_piece"),
    [("overloaded", "overloaded"), ("rate_limit", "try again"), ("context_length", "context")],
)
async def test_chat_error_event(
    mock: MockProvider, session: aiohttp.ClientSession, error: str, message_piece: str
) -> None:
    expected = frames_for("chat", {}, request_json("chat"))
    mock.script([{"fault": "error_event", "after_frame": 2, "error": error}])
    async with await post(session, mock, "chat") as resp:
        data, err = await read_body(resp)
    assert err is None
    frames, _ = split_sse(data)
    assert frames[:2] == expected[:2]
    assert len(frames) == 3
    event, payload = parse_sse_json(frames[2])
    assert event is None
    assert set(payload) == {"error"}
    assert message_piece in payload["error"]["message"].lower()
    assert payload["error"]["type"] in ("server_error", "tokens", "invalid_request_error")


async def test_anthropic_error_event_wire(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "error_event", "after_frame": 3, "error": "overloaded"}])
    async with await post(session, mock, "anthropic") as resp:
        data, _ = await read_body(resp)
    frames, _ = split_sse(data)
    assert len(frames) == 4
    assert frames[3] == (
        b'event: error\ndata: {"type":"error","error":'
        b'{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )


@pytest.mark.parametrize(
    ("protocol", "error", "status"),
    [
        ("chat", "overloaded", 503),
        ("anthropic", "overloaded", 529),
        ("responses", "rate_limit", 429),
        ("anthropic", "context_length", 400),
    ],
)
async def test_error_event_non_stream_is_http_error(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str, error: str, status: int
) -> None:
    mock.script([{"fault": "error_event", "error": error}])
    async with await post(session, mock, protocol, stream=False) as resp:
        assert resp.status == status
        body = await resp.json()
    assert "error" in body


# -- malformed ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_malformed_frame(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str
) -> None:
    expected = frames_for(protocol, {}, request_json(protocol))
    mock.script([{"fault": "malformed", "after_frame": 3}])
    async with await post(session, mock, protocol) as resp:
        data, error = await read_body(resp)
    assert error is None
    frames, _ = split_sse(data)
    assert frames == [*expected[:3], garbage_frame(protocol), *expected[3:]]
    with pytest.raises(json.JSONDecodeError):
        parse_sse_json(frames[3])


# -- non-streamed bodies --------------------------------------------------------


async def test_non_stream_reset_mid_body(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    body = b"".join(frames_for("responses", {}, request_json("responses", stream=False)))
    mock.script([{"fault": "reset", "after_frame": 1}])
    async with await post(session, mock, "responses", stream=False) as resp:
        assert resp.status == 200
        data, error = await read_body(resp)
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert data == body[: len(body) // 2]


async def test_non_stream_end_early(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    body = b"".join(frames_for("anthropic", {}, request_json("anthropic", stream=False)))
    mock.script([{"fault": "end", "after_frame": 1}, {"fault": "end", "after_frame": 2}])
    async with await post(session, mock, "anthropic", stream=False) as resp:
        data, error = await read_body(resp)
    assert error is None and data == body[: len(body) // 2]
    async with await post(session, mock, "anthropic", stream=False) as resp:
        assert await resp.read() == body


async def test_non_stream_malformed(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    body = b"".join(frames_for("chat", {}, request_json("chat", stream=False)))
    mock.script([{"fault": "malformed", "after_frame": 1}])
    async with await post(session, mock, "chat", stream=False) as resp:
        data = await resp.read()
    half = len(body) // 2
    assert data == body[:half] + BODY_GARBAGE + body[half:]
    with pytest.raises(ValueError):
        json.loads(data)


async def test_error_status_body_can_be_reset(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"status": 500, "fault": "reset", "after_frame": 1}])
    async with await post(session, mock, "chat") as resp:
        assert resp.status == 500
        data, error = await read_body(resp)
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert data.startswith(b'{"error":')


# -- timing ---------------------------------------------------------------------


async def test_chunk_delay(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"deltas": 5, "chunk_delay_ms": 30}])
    started = time.monotonic()
    async with await post(session, mock, "anthropic") as resp:
        arrivals: list[float] = []
        async for _ in resp.content.iter_chunks():
            arrivals.append(time.monotonic())
    elapsed = time.monotonic() - started
    n_frames = len(frames_for("anthropic", {"deltas": 5}, request_json("anthropic")))
    assert elapsed >= (n_frames - 1) * 0.03 * 0.9
    assert len(arrivals) >= 2  # frames trickle in instead of arriving at once


async def test_delay_before_headers(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"delay_ms": 150}])
    started = time.monotonic()
    async with await post(session, mock, "chat", stream=False) as resp:
        assert resp.status == 200
        assert time.monotonic() - started >= 0.15
        await resp.read()


async def test_concurrent_streams(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    expected = b"".join(frames_for("chat", {"deltas": 200}, request_json("chat")))

    async def one() -> bytes:
        async with await post(
            session, mock, "chat", headers={"x-mock-action": '{"deltas": 200}'}
        ) as resp:
            return await resp.read()

    results = await asyncio.gather(*(one() for _ in range(20)))
    assert all(r == expected for r in results)
    assert len(split_sse(expected)[0]) == 203


async def test_reset_with_chunk_delay(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    expected = frames_for("responses", {}, request_json("responses"))
    mock.script([{"fault": "reset", "after_frame": 3, "chunk_delay_ms": 10}])
    async with await post(session, mock, "responses") as resp:
        data, error = await read_body(resp)
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert split_sse(data) == (expected[:3], b"")


@pytest.mark.parametrize("delay_ms", [0, 20])
async def test_client_disconnect_mid_stream_is_quiet(
    mock: MockProvider,
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    delay_ms: int,
) -> None:
    caplog.set_level(logging.DEBUG)
    action = {"deltas": 20000 if delay_ms == 0 else 50, "chunk_delay_ms": delay_ms}
    mock.script([action])
    resp = await post(session, mock, "chat")
    await resp.content.readuntil(b"\n\n")
    resp.close()  # drop the connection mid-stream
    # the server stays healthy and logs no errors
    mock.script([{"deltas": 2}])
    async with await post(session, mock, "chat") as ok:
        assert ok.status == 200
        assert len(split_sse(await ok.read())[0]) == 5
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
