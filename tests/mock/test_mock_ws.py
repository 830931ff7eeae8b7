"""The Responses WebSocket mode of the mock provider, over real loopback sockets.

The happy paths go through the official openai SDK (``client.responses.connect()``);
faults are observed with aiohttp's ``ws_connect`` so every message and close code
is visible.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
import websockets.exceptions

from unbroken.mock import (
    ActionError,
    MockProvider,
    load_script,
    parse_action,
    ws_messages_for,
    ws_request,
)
from unbroken.mock.actions import parse_upgrade_action
from unbroken.mock.testing import read_body, split_sse
from unbroken.mock.wire import WS_GARBAGE

TEXT = "Hello from the mock provider."
RECV_TIMEOUT = 10.0
#: Events of the default text reply: created, in_progress, output_item.added,
#: content_part.added, 8 deltas, output_text.done, content_part.done,
#: output_item.done, completed.
TEXT_EVENTS = 16
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})


def oai(mock: MockProvider) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mock.url + "/v1", api_key="x", max_retries=0)


def create(**params: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": "m-test", "input": "hi", **params}


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def ws_url(mock: MockProvider, path: str = "/v1/responses") -> str:
    return mock.url + path


async def send(ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]) -> None:
    await ws.send_str(json.dumps(message))


async def recv_text(ws: aiohttp.ClientWebSocketResponse) -> str:
    msg = await ws.receive(timeout=RECV_TIMEOUT)
    assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data)
    assert isinstance(msg.data, str)
    return msg.data


async def read_reply(ws: aiohttp.ClientWebSocketResponse) -> list[str]:
    """TEXT messages up to and including a terminal event (completed/failed/error)."""
    out: list[str] = []
    while True:
        data = await recv_text(ws)
        out.append(data)
        try:
            kind = json.loads(data).get("type")
        except ValueError:
            continue
        if kind in TERMINAL:
            return out


async def read_to_close(ws: aiohttp.ClientWebSocketResponse) -> tuple[list[str], int | None]:
    """TEXT messages until the socket closes; returns them and the close code."""
    out: list[str] = []
    while True:
        msg = await ws.receive(timeout=RECV_TIMEOUT)
        if msg.type == aiohttp.WSMsgType.TEXT:
            out.append(msg.data)
            continue
        assert msg.type in (
            aiohttp.WSMsgType.CLOSE,
            aiohttp.WSMsgType.CLOSED,
            aiohttp.WSMsgType.CLOSING,
            aiohttp.WSMsgType.ERROR,
        ), msg
        return out, ws.close_code


def types(messages: list[str]) -> list[str]:
    return [json.loads(m)["type"] for m in messages]


def sse_data(frame: bytes) -> bytes:
    return frame.split(b"\ndata: ", 1)[1].removesuffix(b"\n\n")


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


# -- upgrades -----------------------------------------------------------------


async def test_refused_upgrade_and_counting(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script_upgrades([{"status": 426}, {"status": 503, "headers": {"Retry-After": "1"}}, {}])
    assert mock.pending_upgrades() == 3
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(ws_url(mock))
    assert info.value.status == 426
    async with session.get(
        ws_url(mock),
        headers={
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    ) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        body = await resp.json()
    assert body["error"]["type"] == "server_error"
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        await read_reply(ws)
    async with session.ws_connect(ws_url(mock)):  # the queue is empty: accept
        pass
    assert [(u.status, u.socket) for u in mock.upgrades] == [
        (426, None),
        (503, None),
        (101, 1),
        (101, 2),
    ]
    assert mock.sockets_accepted == 2
    assert mock.pending_upgrades() == 0
    assert [r.socket for r in mock.requests] == [1]  # upgrades are not requests


async def test_upgrade_close_before_headers(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    # aiohttp retries an idempotent GET once after a disconnect: two attempts
    mock.script_upgrades([{"fault": "close_before_headers", "count": 2}])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await session.ws_connect(ws_url(mock))
    async with session.ws_connect(ws_url(mock)):
        pass
    assert [(u.status, u.socket) for u in mock.upgrades] == [(None, None), (None, None), (101, 1)]


async def test_upgrade_queues_by_key_and_control_api(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with session.post(
        mock.url + "/_mock/script",
        json={"key": "k", "upgrades": [{"status": 401}], "actions": [{"status": 429}]},
    ) as resp:
        assert resp.status == 200
        assert await resp.json() == {"ok": True, "pending": 1, "pending_upgrades": 1}
    async with session.post(
        mock.url + "/_mock/script", json={"upgrades": [{"reply": "tool"}]}
    ) as resp:
        assert resp.status == 400
        assert "upgrades[0].reply" in (await resp.json())["error"]
    async with session.ws_connect(ws_url(mock)):  # no key: the default queue accepts
        pass
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(ws_url(mock), headers={"x-mock-key": "k"})
    assert info.value.status == 401
    async with session.ws_connect(ws_url(mock), headers={"x-mock-key": "k"}) as ws:
        await send(ws, create())
        (error,) = await read_reply(ws)  # the create pops from the named queue
    assert json.loads(error)["status"] == 429
    async with session.get(mock.url + "/_mock/upgrades") as resp:
        upgrades = await resp.json()
    assert [(u["status"], u["socket"], u["key"]) for u in upgrades] == [
        (101, 1, None),
        (401, None, "k"),
        (101, 2, "k"),
    ]
    async with session.get(mock.url + "/_mock/health") as resp:
        health = await resp.json()
    assert health["upgrades"] == 3 and health["sockets"] == 2


async def test_action_header_on_upgrade_applies_to_every_create(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"text": "queued"}])
    header = json.dumps({"fault": "error_event", "error": "rate_limit", "after_frame": 1})
    async with session.ws_connect(ws_url(mock), headers={"x-mock-action": header}) as ws:
        for _ in range(2):
            await send(ws, create())
            messages = await read_reply(ws)
            assert types(messages) == ["response.created", "error"]
            assert json.loads(messages[-1])["status"] == 429
    assert mock.pending() == 1  # the queue was not touched
    assert [r.action for r in mock.requests] == [json.loads(header)] * 2


async def test_invalid_action_header_refuses_upgrade(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(ws_url(mock), headers={"x-mock-action": '{"fault": "nope"}'})
    assert info.value.status == 400
    assert [(u.status, u.socket) for u in mock.upgrades] == [(400, None)]


async def test_pings_are_answered(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    async with session.ws_connect(ws_url(mock), autoping=False) as ws:
        await ws.ping(b"are you there")
        msg = await ws.receive(timeout=RECV_TIMEOUT)
        assert msg.type == aiohttp.WSMsgType.PONG and msg.data == b"are you there"


# -- previous_response_id -------------------------------------------------------


async def completed_id(ws: aiohttp.ClientWebSocketResponse, **params: Any) -> str:
    await send(ws, create(**params))
    messages = await read_reply(ws)
    last = json.loads(messages[-1])
    assert last["type"] == "response.completed", last
    response_id: str = last["response"]["id"]
    return response_id


async def test_socket_local_previous_response_id(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with session.ws_connect(ws_url(mock)) as ws1:
        local = await completed_id(ws1, store=False, input="one")
        unset = await completed_id(ws1, input="two")  # store missing: socket-local too
        stored = await completed_id(ws1, store=True, input="three")
        # the same socket knows all three
        for prev in (local, unset, stored):
            assert await completed_id(ws1, previous_response_id=prev, input="more")
        async with session.ws_connect(ws_url(mock)) as ws2:
            # a new socket knows only the stored one
            await send(ws2, create(previous_response_id=local))
            (message,) = await read_reply(ws2)
            assert json.loads(message) == {
                "type": "error",
                "status": 400,
                "error": {
                    "type": "invalid_request_error",
                    "code": "previous_response_not_found",
                    "message": f"Previous response with id '{local}' not found.",
                    "param": "previous_response_id",
                },
            }
            await send(ws2, create(previous_response_id=unset))
            assert json.loads((await read_reply(ws2))[0])["error"]["code"] == (
                "previous_response_not_found"
            )
            assert await completed_id(ws2, previous_response_id=stored)
    recs = mock.requests
    assert [(r.socket, r.previous_response_found) for r in recs] == [
        (1, None),
        (1, None),
        (1, None),
        (1, True),
        (1, True),
        (1, True),
        (2, False),
        (2, False),
        (2, True),
    ]
    assert recs[6].previous_response_id == local
    assert recs[6].to_dict()["previous_response_found"] is False
    assert recs[6].to_dict()["socket"] == 2


async def test_unknown_previous_response_id_on_new_socket(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "reset", "after_frame": 3}])  # consumed by the failing create
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create(previous_response_id="resp_never_seen"))
        (message,) = await read_reply(ws)
        payload = json.loads(message)
        assert payload["error"]["code"] == "previous_response_not_found"
        assert payload["error"]["param"] == "previous_response_id"
        assert "resp_never_seen" in payload["error"]["message"]
        # no reply was produced and the socket stays usable
        assert await completed_id(ws, input="fresh")
    assert mock.pending() == 0
    assert mock.requests[0].previous_response_found is False


async def test_http_previous_response_id_rule(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/responses"
    async with session.ws_connect(ws_url(mock)) as ws:
        local = await completed_id(ws, store=False)
        stored = await completed_id(ws, store=True, input="kept")
    async with session.post(
        url, json={"model": "m", "input": "x", "previous_response_id": local}
    ) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["code"] == "previous_response_not_found"
    assert body["error"]["param"] == "previous_response_id"
    assert body["error"]["type"] == "invalid_request_error"
    async with session.post(
        url, json={"model": "m", "input": "x", "previous_response_id": stored}
    ) as resp:
        assert resp.status == 200
        http_default = (await resp.json())["id"]  # store missing over HTTP: stored (API default)
    async with session.post(url, json={"model": "m", "input": "y", "store": False}) as resp:
        http_unstored = (await resp.json())["id"]
    async with session.post(
        url, json={"model": "m", "input": "z", "stream": True, "previous_response_id": http_default}
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with session.post(
        url, json={"model": "m", "previous_response_id": http_unstored}
    ) as resp:
        assert resp.status == 400
    async with session.ws_connect(ws_url(mock)) as ws:  # HTTP-stored ids are global
        assert await completed_id(ws, previous_response_id=http_default)
    found = [(r.method, r.previous_response_found) for r in mock.requests]
    assert found == [
        ("WS", None),
        ("WS", None),
        ("POST", False),
        ("POST", True),
        ("POST", None),
        ("POST", True),
        ("POST", False),
        ("WS", True),
    ]
    mock.reset()  # forgets the global store
    async with session.post(url, json={"model": "m", "previous_response_id": stored}) as resp:
        assert resp.status == 400


# -- recording, invalid messages, prefixes, shutdown ----------------------------


async def test_recording_and_path_prefix(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"text": "a", "deltas": 1}, {"text": "b", "deltas": 1}], key="q")
    url = ws_url(mock, "/openai/proxy/v1/responses?tenant=t1")
    raw = json.dumps(create(input="recorded"), separators=(",", ":"))
    async with session.ws_connect(url, headers={"x-mock-key": "q", "X-Trace": "t"}) as ws:
        await ws.send_str(raw)
        await read_reply(ws)
        await ws.send_str("not json")
        (error,) = await read_reply(ws)
        await ws.send_str(json.dumps({"type": "response.steer", "input": "x"}))
        (error2,) = await read_reply(ws)
        await send(ws, create())
        last = await read_reply(ws)
    assert json.loads(error)["error"]["message"].startswith("mock: message is not valid JSON")
    assert "response.steer" in json.loads(error2)["error"]["message"]
    assert json.loads(last[-1])["response"]["output"][0]["content"][0]["text"] == "b"
    recs = mock.requests
    assert [r.method for r in recs] == ["WS"] * 4
    assert {r.path for r in recs} == {"/openai/proxy/v1/responses"}
    assert recs[0].query["tenant"] == "t1"
    assert recs[0].headers["X-Trace"] == "t"
    assert recs[0].body == raw.encode()
    assert recs[1].body == b"not json"
    assert [r.action for r in recs] == [
        {"text": "a", "deltas": 1},
        None,
        None,
        {"text": "b", "deltas": 1},
    ]
    assert {r.key for r in recs} == {"q"}
    assert mock.pending("q") == 0
    assert recs[0].to_dict()["body"] == raw
    async with session.get(mock.url + "/_mock/requests") as resp:
        listed = await resp.json()
    assert [r["socket"] for r in listed] == [1, 1, 1, 1]
    assert (await mock.wait_for_requests(4))[3] is recs[3]


async def test_http_requests_have_no_socket(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with session.post(mock.url + "/v1/chat/completions", json={"messages": []}) as resp:
        await resp.read()
    (rec,) = mock.requests
    assert rec.socket is None and rec.previous_response_id is None
    assert rec.to_dict()["socket"] is None


async def test_websocket_only_on_responses(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(mock.url + "/v1/chat/completions")
    assert info.value.status == 405
    assert mock.upgrades == []


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


async def test_stop_with_open_and_stalled_sockets() -> None:
    async with MockProvider() as mock, aiohttp.ClientSession() as session:
        mock.script([{"fault": "stall", "after_frame": 1}])
        idle = await session.ws_connect(ws_url(mock))
        stalled = await session.ws_connect(ws_url(mock))
        await send(stalled, create())
        await recv_text(stalled)
        start = time.monotonic()
        await mock.stop()
        assert time.monotonic() - start < 5
        for ws in (idle, stalled):
            msg = await ws.receive(timeout=RECV_TIMEOUT)
            assert msg.type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSED,
                aiohttp.WSMsgType.ERROR,
            )
            await ws.close()


async def test_reset_clears_upgrades_but_not_the_socket_counter(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script_upgrades([{}, {"status": 500}])
    async with session.ws_connect(ws_url(mock)):
        pass
    mock.reset()
    assert mock.upgrades == [] and mock.pending_upgrades() == 0
    async with session.ws_connect(ws_url(mock)):
        pass
    assert [(u.status, u.socket) for u in mock.upgrades] == [(101, 2)]


# -- validation and scripts -----------------------------------------------------


def test_action_validation() -> None:
    assert parse_action({"fault": "close", "after_frame": 3, "code": 4000}).code == 4000
    assert parse_action({"fault": "connection_limit", "code": 1008}).code == 1008
    with pytest.raises(ActionError, match="code"):
        parse_action({"fault": "reset", "code": 1011})
    with pytest.raises(ActionError, match="code"):
        parse_action({"fault": "close", "code": 999})
    with pytest.raises(ActionError, match="code"):
        parse_action({"fault": "close", "code": 5000})
    with pytest.raises(ActionError, match="after_frame"):
        parse_action({"fault": "connection_limit", "after_frame": 1})
    assert parse_upgrade_action({"status": 426, "headers": {"X": "1"}}).status == 426
    with pytest.raises(ActionError, match="reply"):
        parse_upgrade_action({"reply": "tool"})
    with pytest.raises(ActionError, match="fault"):
        parse_upgrade_action({"fault": "reset"})


async def test_script_file_upgrades(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    path = tmp_path / "script.toml"
    path.write_text(
        '[[upgrades]]\nstatus = 426\n\n[[upgrades]]\n_comment = "accept"\n\n'
        '[upgrade_queues]\nk = [{fault = "close_before_headers"}]\n\n'
        '[[actions]]\nfault = "close"\ncode = 4002\n'
    )
    script = load_script(path)
    async with MockProvider() as mock:
        script.apply(mock)
        assert (mock.pending_upgrades(), mock.pending_upgrades("k"), mock.pending()) == (2, 1, 1)
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await session.ws_connect(ws_url(mock))
        async with session.ws_connect(ws_url(mock)) as ws:
            await send(ws, create())
            assert await read_to_close(ws) == ([], 4002)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"upgrades": [{"deltas": 3}]}))
    with pytest.raises(ActionError, match=r"upgrades\[0\]\.deltas"):
        load_script(bad)
