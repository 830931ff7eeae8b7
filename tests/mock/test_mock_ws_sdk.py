"""The mock's Responses WebSocket mode as the official openai SDK sees it, over real sockets.

Text and tool-call replies, several turns on one socket, an error event, a refused
upgrade (``client.responses.connect()``), and byte identity with the SSE reply: each
WebSocket payload equals an SSE ``data:`` line, and a chunk delay paces both.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pytest
import websockets.exceptions

from mock.wsfix import TEXT, TEXT_EVENTS, create, oai, read_reply, send, sse_data, ws_url
from unbroken.mock import MockProvider, ws_messages_for, ws_request
from unbroken.mock.testing import read_body, split_sse

# -- the official SDK ---------------------------------------------------------


async def test_sdk_text_reply(mock: MockProvider) -> None:
    async with oai(mock) as client, client.responses.connect() as conn:
        await conn.response.create(model="gpt-test", input="hi", store=False)
        events: list[Any] = []
        async for event in conn:
            events.append(event)
            if event.type == "response.completed":
                break
    final = events[-1].response
    assert final.output_text == TEXT
    assert final.status == "completed" and final.model == "gpt-test"
    assert [e.sequence_number for e in events] == list(range(TEXT_EVENTS))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == TEXT

    (upgrade,) = mock.upgrades
    assert (upgrade.path, upgrade.status, upgrade.socket) == ("/v1/responses", 101, 1)
    assert upgrade.headers["Authorization"] == "Bearer x"
    assert upgrade.headers["User-Agent"].startswith("AsyncOpenAI/Python")
    (rec,) = mock.requests
    assert (rec.method, rec.path, rec.protocol, rec.socket) == (
        "WS",
        "/v1/responses",
        "responses",
        1,
    )
    assert rec.json() == {
        "type": "response.create",
        "model": "gpt-test",
        "input": "hi",
        "store": False,
    }
    assert rec.headers["User-Agent"] == upgrade.headers["User-Agent"]
    assert rec.action == {}
    assert rec.previous_response_id is None and rec.previous_response_found is None


async def test_sdk_tool_call(mock: MockProvider) -> None:
    mock.script([{"reply": "tool", "tool_args": {"command": "ls -la"}}])
    tools: Any = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]
    async with oai(mock) as client, client.responses.connect() as conn:
        await conn.response.create(model="gpt-test", input="list", tools=tools)
        deltas: list[str] = []
        async for event in conn:
            if event.type == "response.function_call_arguments.delta":
                deltas.append(event.delta)
            if event.type == "response.completed":
                final = event.response
                break
    (call,) = final.output
    assert call.type == "function_call"
    assert call.name == "shell"
    assert json.loads(call.arguments) == {"command": "ls -la"}
    assert "".join(deltas) == call.arguments
    assert call.call_id.startswith("call_")


async def test_sdk_multi_turn_previous_response_id_on_same_socket(mock: MockProvider) -> None:
    mock.script([{"text": "first", "deltas": 2}, {"reply": "tool"}, {"text": "third", "deltas": 1}])
    finals: list[Any] = []
    async with oai(mock) as client, client.responses.connect() as conn:
        previous: str | None = None
        for turn in range(3):
            kwargs: dict[str, Any] = {"previous_response_id": previous} if previous else {}
            await conn.response.create(
                model="gpt-test", input=f"turn {turn}", store=False, **kwargs
            )
            async for event in conn:
                assert event.type != "error", event
                if event.type == "response.completed":
                    finals.append(event.response)
                    previous = event.response.id
                    break
    assert finals[0].output_text == "first"
    assert finals[1].output[0].type == "function_call"
    assert finals[2].output_text == "third"
    assert finals[1].previous_response_id == finals[0].id
    assert finals[2].previous_response_id == finals[1].id
    assert len({f.id for f in finals}) == 3
    recs = mock.requests
    assert [r.socket for r in recs] == [1, 1, 1]
    assert [r.previous_response_id for r in recs] == [None, finals[0].id, finals[1].id]
    assert [r.previous_response_found for r in recs] == [None, True, True]
    assert len(mock.upgrades) == 1


async def test_sdk_sees_error_event_and_socket_stays_open(mock: MockProvider) -> None:
    mock.script([{"fault": "error_event", "error": "overloaded", "after_frame": 3}])
    async with oai(mock) as client, client.responses.connect() as conn:
        await conn.response.create(model="gpt-test", input="hi")
        seen: list[Any] = []
        async for event in conn:
            seen.append(event)
            if event.type == "error":
                break
        error = seen[-1]
        assert [e.type for e in seen[:3]] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert error.status == 503
        assert error.sequence_number == 3
        assert error.error.type == "server_error"
        assert error.error.code == "server_is_overloaded"
        assert error.error.param is None
        # same socket, next turn: a clean reply
        await conn.response.create(model="gpt-test", input="again")
        async for event in conn:
            if event.type == "response.completed":
                assert event.response.output_text == TEXT
                break
    assert [r.socket for r in mock.requests] == [1, 1]


async def test_sdk_refused_upgrade(mock: MockProvider) -> None:
    mock.script_upgrades([{"status": 426}])
    async with oai(mock) as client:
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with client.responses.connect():
                pass
    assert "426" in str(info.value)
    assert [(u.status, u.socket) for u in mock.upgrades] == [(426, None)]
    assert mock.requests == []


# -- byte identity with the SSE reply ------------------------------------------


@pytest.mark.parametrize("action", [{}, {"reply": "tools", "deltas": 3}, {"text": 'é ☃ "q"\n'}])
async def test_ws_payloads_equal_sse_data_lines(
    mock: MockProvider, session: aiohttp.ClientSession, action: dict[str, Any]
) -> None:
    message = create(
        input=[{"role": "user", "content": "hi"}], tools=[{"type": "function", "name": "sh"}]
    )
    mock.script([action, action])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, message)
        ws_payloads = [m.encode() for m in await read_reply(ws)]
    body = ws_request(message)
    assert body == {k: v for k, v in message.items() if k != "type"} | {"stream": True}
    async with session.post(mock.url + "/v1/responses", json=body) as resp:
        assert resp.status == 200
        raw, error = await read_body(resp)
    assert error is None
    frames, rest = split_sse(raw)
    assert rest == b""
    assert ws_payloads == [sse_data(f) for f in frames]
    assert ws_payloads == ws_messages_for(action, message)
    # ids are deterministic: the same message on a new socket gives the same bytes
    mock.script([action])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, message)
        assert [m.encode() for m in await read_reply(ws)] == ws_payloads


async def test_chunk_delay_is_respected(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"deltas": 4, "chunk_delay_ms": 40}])
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        start = time.monotonic()
        messages = await read_reply(ws)
        elapsed = time.monotonic() - start
    assert len(messages) == 4 + 8
    assert elapsed >= 0.040 * (len(messages) - 1) * 0.9
    assert [m.encode() for m in messages] == ws_messages_for({"deltas": 4}, create())
