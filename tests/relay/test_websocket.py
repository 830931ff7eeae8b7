"""Responses over WebSocket through the relay: the client socket outlives upstream sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from relayfix import Recorder, make_config, start_relay
from unbroken.mock import MockProvider, ws_messages_for
from unbroken.relay.server import RelayServer

CREATE: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", "store": False}
STREAM = {"first_frame_timeout_s": 1, "idle_timeout_s": 1}
# Frames of the mock's default text reply: 1 created, 2 in_progress, 3 output_item.added,
# 4 content_part.added (all CONTROL), 5.. text deltas.  Tool reply: 3 output_item.added
# (function_call), 4.. argument deltas.
AFTER_CONTROL, MID_TOOL, AFTER_OUTPUT = 4, 4, 6


Relay = tuple[RelayServer, Recorder]


@pytest.fixture
async def relay(mock: MockProvider) -> AsyncIterator[Relay]:
    server, rec = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    yield server, rec
    await server.stop()


def _ws_url(server: RelayServer) -> str:
    return server.url.replace("http://", "ws://") + "/mock/v1/responses"


async def _turn(ws: aiohttp.ClientWebSocketResponse, create: dict[str, Any]) -> list[bytes]:
    """Send one create; collect messages up to the turn's terminal event."""
    await ws.send_str(json.dumps(create))
    got: list[bytes] = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        got.append(msg.data.encode())
        kind = json.loads(msg.data)["type"]
        if kind in ("response.completed", "response.failed", "response.incomplete"):
            return got
        if kind == "error" and "response.failed" not in got[-1].decode():
            status = json.loads(msg.data).get("status")
            if status and status < 500 and status != 429:
                return got


async def test_openai_sdk_websocket_through_relay(mock: MockProvider, relay: Relay) -> None:
    server, _ = relay
    client = openai.AsyncOpenAI(base_url=f"{server.url}/mock/v1", api_key="sk-x", max_retries=0)
    mock.script([{"fault": "reset", "after_frame": AFTER_CONTROL}, {}, {"reply": "tool"}])
    async with client.responses.connect() as conn:
        await conn.response.create(model="m", input="hi", store=False)
        text, first_id = "", None
        async for event in conn:
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.completed":
                first_id = event.response.id
                break
        assert text == "Hello from the mock provider."
        # a second turn on the same client socket, chained to the first
        await conn.response.create(model="m", input="go on", previous_response_id=first_id)
        calls = []
        async for event in conn:
            if event.type == "response.output_item.done" and event.item.type == "function_call":
                calls.append(event.item)
            if event.type == "response.completed":
                break
        assert len(calls) == 1
    await client.close()


@pytest.mark.parametrize(
    ("fault", "reply"),
    [
        ({"fault": "reset", "after_frame": 0}, "text"),
        ({"fault": "reset", "after_frame": AFTER_CONTROL}, "text"),
        ({"fault": "close", "after_frame": AFTER_CONTROL, "code": 1011}, "text"),
        ({"fault": "close", "after_frame": 2, "code": 1012}, "text"),
        ({"fault": "close", "after_frame": 2, "code": 1013}, "text"),
        ({"fault": "reset", "after_frame": MID_TOOL}, "tool"),
        ({"fault": "error_event", "after_frame": 2, "error": "overloaded"}, "text"),
        ({"fault": "error_event", "after_frame": 0, "error": "server_error"}, "text"),
        ({"fault": "stall", "after_frame": AFTER_CONTROL, "seconds": 30}, "text"),
        ({"fault": "end", "after_frame": MID_TOOL}, "tool"),
        ({"status": 503}, "text"),
    ],
)
async def test_failure_before_commit_is_invisible(
    mock: MockProvider, relay: Relay, fault: dict[str, Any], reply: str
) -> None:
    server, rec = relay
    expected = ws_messages_for({"reply": reply}, CREATE)
    mock.script([{**fault, "reply": reply}, {"reply": reply}, {}])
    async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
        got = await _turn(ws, CREATE)
        assert got == expected  # one coherent turn: nothing of the dead attempt
        # the client socket stayed open: the next turn works
        assert (await _turn(ws, CREATE))[-1] == ws_messages_for({}, CREATE)[-1]
    assert [t.outcome for t in (await rec.wait_turns(2))[:1]] == ["recovered"]
    assert len({r.socket for r in mock.requests[:2]}) == 2  # a fresh upstream socket


@pytest.mark.parametrize(
    "fault",
    [
        {"fault": "reset", "after_frame": AFTER_OUTPUT},
        {"fault": "close", "after_frame": AFTER_OUTPUT, "code": 1011},
        {"fault": "end", "after_frame": AFTER_OUTPUT},
        {"fault": "error_event", "after_frame": AFTER_OUTPUT, "error": "overloaded"},
    ],
)
async def test_failure_after_commit_fails_the_turn_and_keeps_the_socket(
    mock: MockProvider, relay: Relay, fault: dict[str, Any]
) -> None:
    server, rec = relay
    clean = ws_messages_for({}, CREATE)
    mock.script([fault, {}])
    async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
        got = await _turn(ws, CREATE)
        assert got[:AFTER_OUTPUT] == clean[:AFTER_OUTPUT]
        tail = [json.loads(m) for m in got[AFTER_OUTPUT:]]
        assert [e["type"] for e in tail] == ["error", "response.failed"]
        assert tail[0]["error"]["type"] == "server_error"
        assert tail[1]["response"]["status"] == "failed"
        created = json.loads(clean[0])["response"]["id"]
        assert tail[1]["response"]["id"] == created
        assert all(b"response.completed" not in m for m in got)
        assert len(mock.requests) == 1  # never replayed after commit
        # the socket is still usable
        assert json.loads((await _turn(ws, CREATE))[-1])["type"] == "response.completed"
    turns = await rec.wait_turns(2)
    assert turns[0].outcome == "ended_with_error"


async def test_previous_response_id_survives_upstream_socket_death(
    mock: MockProvider, relay: Relay
) -> None:
    server, _ = relay
    mock.script([{}, {"fault": "reset", "after_frame": 0}, {}])
    async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
        first = await _turn(ws, CREATE)
        first_id = json.loads(first[-1])["response"]["id"]
        second = {**CREATE, "input": "and then?", "previous_response_id": first_id}
        got = await _turn(ws, second)
        assert json.loads(got[-1])["type"] == "response.completed"
    reqs = mock.requests
    assert [r.socket for r in reqs] == [1, 1, 2]
    # on the dead socket the chained request went as the client sent it
    assert reqs[1].json()["previous_response_id"] == first_id
    # on the fresh socket it was rebuilt self-contained: the state lived on socket 1
    rebuilt = reqs[2].json()
    assert "previous_response_id" not in rebuilt
    first_output = json.loads(first[-1])["response"]["output"]
    assert rebuilt["input"] == [
        {"role": "user", "content": "hi"},
        *first_output,
        {"role": "user", "content": "and then?"},
    ]
    assert reqs[2].previous_response_found is None


async def test_http_fallback_when_upgrade_refused_then_back_to_websocket(
    mock: MockProvider,
) -> None:
    cfg = make_config([{"url": mock.url}], stream=STREAM)
    cfg = dataclasses.replace(cfg, websocket_fallback_cooldown_s=0.0)
    server, _ = await start_relay(cfg)
    try:
        mock.script_upgrades([{"status": 426}])
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            got = await _turn(ws, CREATE)
            assert got == ws_messages_for({}, CREATE)  # SSE events relayed as messages
            assert mock.requests[0].method == "POST"
            got = await _turn(ws, CREATE)  # cooldown over: back to WebSocket
            assert json.loads(got[-1])["type"] == "response.completed"
        assert [u.status for u in mock.upgrades] == [426, 101]
        assert [r.method for r in mock.requests] == ["POST", "WS"]
    finally:
        await server.stop()


async def test_connection_limit_falls_back_to_http_within_cooldown(
    mock: MockProvider, relay: Relay
) -> None:
    server, _ = relay
    mock.script([{"fault": "connection_limit"}, {}, {}])
    async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
        got = await _turn(ws, CREATE)
        assert got == ws_messages_for({}, CREATE)
        await _turn(ws, CREATE)
    assert [r.method for r in mock.requests] == ["WS", "POST", "POST"]


async def test_concurrent_client_sockets(mock: MockProvider, relay: Relay) -> None:
    server, _ = relay
    n = 8
    for i in range(n):
        mock.script([{"fault": "reset", "after_frame": i % 5}, {}], key=f"k{i}")

    async def one(i: int) -> list[bytes]:
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(_ws_url(server), headers={"x-mock-key": f"k{i}"}) as ws,
        ):
            return await _turn(ws, {**CREATE, "input": f"hi {i}"})

    results = await asyncio.gather(*(one(i) for i in range(n)))
    for i, got in enumerate(results):
        assert got == ws_messages_for({}, {**CREATE, "input": f"hi {i}"})
    assert len(mock.requests) == 2 * n


async def test_client_close_during_retry_stops_everything(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}], retry={"delay_ms": 60_000}, stream=STREAM)
    server, rec = await start_relay(cfg)
    try:
        mock.script([{"status": 503}, {}])
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(_ws_url(server))
            await ws.send_str(json.dumps(CREATE))
            await mock.wait_for_requests(1)
            await ws.close()
        turns = await rec.wait_turns(1)
        assert turns[0].outcome == "aborted_by_client"
        assert len(mock.requests) == 1
        assert not server.relay.inflight
    finally:
        await server.stop()


async def test_pings_are_answered_while_retrying(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}], retry={"delay_ms": 60_000}, stream=STREAM)
    server, _ = await start_relay(cfg)
    try:
        mock.script([{"status": 503}])
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(_ws_url(server), autoping=False) as ws,
        ):
            await ws.send_str(json.dumps(CREATE))
            await mock.wait_for_requests(1)
            await ws.ping(b"are-you-there")
            msg = await asyncio.wait_for(ws.receive(), 10)
            assert msg.type is aiohttp.WSMsgType.PONG and msg.data == b"are-you-there"
    finally:
        await server.stop()
