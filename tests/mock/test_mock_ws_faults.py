"""Faults the mock plays on a WebSocket ``response.create``, seen with aiohttp's ``ws_connect``.

Resets, close codes, stalls, a clean end that leaves the socket open, error events,
the connection limit, malformed messages, statuses as error messages, faults before
the reply, and the WebSocket-only faults on the HTTP transport.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from mock.wsfix import (
    TEXT_EVENTS,
    create,
    read_reply,
    read_to_close,
    recv_text,
    send,
    types,
    ws_url,
)
from unbroken.mock import MockProvider, ws_messages_for
from unbroken.mock.testing import read_body, split_sse
from unbroken.mock.wire import WS_GARBAGE

# -- faults on a create message -------------------------------------------------


async def test_reset_after_frame(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"fault": "reset", "after_frame": 5}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages, code = await read_to_close(ws)
    clean = [m.decode() for m in ws_messages_for({}, create())]
    assert messages == clean[:5]
    assert code == 1006


@pytest.mark.parametrize(
    ("extra", "code"), [({}, 1011), ({"code": 4001}, 4001), ({"code": 1000}, 1000)]
)
async def test_close_with_code(
    mock: MockProvider, session: aiohttp.ClientSession, extra: dict[str, Any], code: int
) -> None:
    mock.script([{"fault": "close", "after_frame": 2, **extra}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages, close_code = await read_to_close(ws)
    assert types(messages) == ["response.created", "response.in_progress"]
    assert close_code == code


async def test_close_after_all_frames(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"fault": "close", "after_frame": 1000, "code": 1001}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages, close_code = await read_to_close(ws)
    assert len(messages) == TEXT_EVENTS and types(messages)[-1] == "response.completed"
    assert close_code == 1001


async def test_stall_then_abort(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"fault": "stall", "after_frame": 4, "seconds": 0.3}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        start = time.monotonic()
        messages, code = await read_to_close(ws)
        elapsed = time.monotonic() - start
    assert len(messages) == 4
    assert code == 1006
    assert elapsed >= 0.25


async def test_stall_ends_when_client_closes(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "stall", "after_frame": 2}])  # default: an hour
    async with asyncio.timeout(5):
        ws = await session.ws_connect(ws_url(mock))
        await send(ws, create())
        assert types([await recv_text(ws), await recv_text(ws)]) == [
            "response.created",
            "response.in_progress",
        ]
        await ws.close()  # the mock answers the close handshake while stalling
        assert ws.close_code == 1000
        # and the mock goes on serving new sockets
        async with session.ws_connect(ws_url(mock)) as ws2:
            await send(ws2, create())
            assert len(await read_reply(ws2)) == TEXT_EVENTS
    assert [u.socket for u in mock.upgrades] == [1, 2]


async def test_end_keeps_socket_open_and_idle(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "end", "after_frame": 6}, {"text": "next", "deltas": 2}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        first = [await recv_text(ws) for _ in range(6)]
        # nothing more for the truncated turn: the next message on the socket is
        # the start of the next reply
        await send(ws, create(input="again"))
        second = await read_reply(ws)
        # the truncated response never completed, so it cannot be continued
        truncated_id = json.loads(first[0])["response"]["id"]
        await send(ws, create(input="more", previous_response_id=truncated_id))
        (error,) = await read_reply(ws)
        assert not ws.closed
    assert first == [m.decode() for m in ws_messages_for({}, create())][:6]
    assert types(second)[0] == "response.created"
    assert json.loads(second[0])["sequence_number"] == 0
    assert json.loads(second[-1])["response"]["output"][0]["content"][0]["text"] == "next"
    assert json.loads(error)["error"]["code"] == "previous_response_not_found"


@pytest.mark.parametrize(
    ("error", "status", "etype", "code"),
    [
        ("overloaded", 503, "server_error", "server_is_overloaded"),
        ("server_error", 500, "server_error", "server_error"),
        ("rate_limit", 429, "tokens", "rate_limit_exceeded"),
        ("invalid_request", 400, "invalid_request_error", "invalid_request_error"),
        ("context_length", 400, "invalid_request_error", "context_length_exceeded"),
    ],
)
async def test_error_event(
    mock: MockProvider,
    session: aiohttp.ClientSession,
    error: str,
    status: int,
    etype: str,
    code: str,
) -> None:
    mock.script([{"fault": "error_event", "error": error, "after_frame": 4}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages = await read_reply(ws)
        # the socket stays open: a second turn works
        await send(ws, create(input="again"))
        assert types(await read_reply(ws))[-1] == "response.completed"
    assert len(messages) == 5
    payload = json.loads(messages[-1])
    assert list(payload) == ["type", "status", "error", "sequence_number"]
    assert payload["type"] == "error"
    assert payload["status"] == status
    assert payload["sequence_number"] == 4
    assert payload["error"]["type"] == etype
    assert payload["error"]["code"] == code
    assert payload["error"]["param"] is None
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


async def test_error_event_failed_style(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"fault": "error_event", "error": "server_error", "error_style": "failed"}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages = await read_reply(ws)
    (failed,) = [json.loads(m) for m in messages]
    assert failed["type"] == "response.failed" and failed["sequence_number"] == 0
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"


@pytest.mark.parametrize(("extra", "code"), [({}, 1013), ({"code": 1008}, 1008)])
async def test_connection_limit(
    mock: MockProvider, session: aiohttp.ClientSession, extra: dict[str, Any], code: int
) -> None:
    mock.script([{"fault": "connection_limit", **extra}, {}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages, close_code = await read_to_close(ws)
    (error,) = [json.loads(m) for m in messages]
    assert error["type"] == "error" and error["status"] == 400
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == "websocket_connection_limit_reached"
    assert "sequence_number" not in error
    assert close_code == code
    # a new socket carries on with the queue
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        assert types(await read_reply(ws))[-1] == "response.completed"
    assert [r.socket for r in mock.requests] == [1, 2]


async def test_malformed_message(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"fault": "malformed", "after_frame": 3}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages = await read_reply(ws)
    clean = [m.decode() for m in ws_messages_for({}, create())]
    assert messages == [*clean[:3], WS_GARBAGE.decode(), *clean[3:]]
    with pytest.raises(ValueError):
        json.loads(messages[3])


@pytest.mark.parametrize(
    ("status", "etype", "code"),
    [
        (503, "server_error", None),
        (429, "tokens", "rate_limit_exceeded"),
        (401, "invalid_request_error", "invalid_api_key"),
    ],
)
async def test_status_sends_error_message(
    mock: MockProvider, session: aiohttp.ClientSession, status: int, etype: str, code: str | None
) -> None:
    mock.script([{"status": status}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        (message,) = await read_reply(ws)
        await send(ws, create())
        assert types(await read_reply(ws))[-1] == "response.completed"
    payload = json.loads(message)
    assert payload["type"] == "error" and payload["status"] == status
    assert payload["error"]["type"] == etype and payload["error"]["code"] == code


async def test_status_with_custom_body(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"status": 500, "body": '{"type":"error","status":500}'}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        assert await recv_text(ws) == '{"type":"error","status":500}'


@pytest.mark.parametrize("fault", ["close_before_headers", "reset_after_headers"])
async def test_pre_reply_faults_abort(
    mock: MockProvider, session: aiohttp.ClientSession, fault: str
) -> None:
    mock.script([{"fault": fault}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        messages, code = await read_to_close(ws)
    assert messages == [] and code == 1006


# -- the WebSocket faults on the HTTP transport ------------------------------


async def test_http_close_and_connection_limit_faults(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "close", "after_frame": 2}, {"fault": "connection_limit"}])
    url = mock.url + "/v1/responses"
    async with session.post(url, json={"model": "m", "stream": True}) as resp:
        raw, error = await read_body(resp)
    assert error is None
    frames, _ = split_sse(raw)
    assert len(frames) == 2  # like "end": a clean end of the stream without a terminal event
    async with session.post(url, json={"model": "m"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "websocket_connection_limit_reached"
