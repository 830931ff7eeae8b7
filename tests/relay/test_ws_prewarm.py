"""Issue 33 item 1: Codex's WebSocket warm-up (``generate: false``) is never a generation,
and one refused upgrade is not a verdict.

Each test fails on the code before issue 33: the warm-up went upstream as
``POST /v1/responses {"generate": false, "background": true, ...}`` (a provider that
ignores ``generate`` generated and billed a whole answer), and a single 503 on the
upgrade switched the connection to HTTP for the cool-down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp

from relayfix import make_config, start_relay
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

STREAM = {"first_frame_timeout_s": 2, "idle_timeout_s": 2, "keepalive_s": 30}
INPUT = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
WARMUP: dict[str, Any] = {
    "type": "response.create",
    "model": "m",
    "input": INPUT,
    "store": False,
    "generate": False,
}


def _ws_url(server: RelayServer) -> str:
    return server.url.replace("http://", "ws://") + "/mock/v1/responses"


async def _turn(ws: aiohttp.ClientWebSocketResponse, create: dict[str, Any]) -> list[Any]:
    await ws.send_str(json.dumps(create))
    out: list[Any] = []
    while True:
        msg = await asyncio.wait_for(ws.receive(), 30)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        event = json.loads(msg.data)
        out.append(event)
        if event["type"] in ("response.completed", "response.failed", "error"):
            return out


async def _warmup_then_turn(server: RelayServer, mock: MockProvider) -> list[Any]:
    """Codex's pattern: the warm-up, then the first turn chained from it with no new
    input (`previous_response_id` names the warm-up's response)."""
    async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
        warm = await _turn(ws, WARMUP)
        assert [e["type"] for e in warm] == ["response.created", "response.completed"]
        done = warm[-1]["response"]
        assert done["status"] == "completed" and done["output"] == []
        assert done["usage"]["output_tokens"] == 0
        rid = done["id"]
        assert rid.startswith("resp_") and warm[0]["response"]["id"] == rid
        assert [e["sequence_number"] for e in warm] == [0, 1]
        assert not mock.requests  # nothing went upstream for the warm-up
        create = {
            "type": "response.create",
            "model": "m",
            "input": [],
            "store": False,
            "previous_response_id": rid,
        }
        return await _turn(ws, create)


async def test_warmup_is_answered_not_generated_in_continue_mode(mock: MockProvider) -> None:
    """Continue mode serves a socket's turns over HTTP in background mode: the warm-up
    is answered by the relay, and the turn chained from it goes upstream whole (the
    warm-up's input, no ``previous_response_id`` the upstream never saw)."""
    cfg = make_config([{"url": mock.url}], stream={**STREAM, "after_commit": "continue"})
    server, rec = await start_relay(cfg)
    try:
        got = await _warmup_then_turn(server, mock)
        assert got[-1]["type"] == "response.completed"
        assert [r.method for r in mock.requests] == ["POST"]  # one generation
        sent = mock.requests[0].json()
        assert "generate" not in sent and "previous_response_id" not in sent
        assert sent["input"] == INPUT and sent["background"] is True
        turns = await rec.wait_turns(2)
        assert [t.outcome for t in turns] == ["ok", "ok"]
    finally:
        await server.stop()


async def test_warmup_is_answered_during_the_http_fallback(mock: MockProvider) -> None:
    """The upstream refused the upgrade (426: a verdict): the warm-up is not POSTed,
    (a strict provider answers ``generate`` over HTTP with a 400)."""
    server, _ = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    try:
        mock.script_upgrades([{"status": 426}])
        got = await _warmup_then_turn(server, mock)
        assert got[-1]["type"] == "response.completed"
        assert [r.method for r in mock.requests] == ["POST"]
        sent = mock.requests[0].json()
        assert "generate" not in sent and sent["input"] == INPUT
    finally:
        await server.stop()


async def test_warmup_on_an_upstream_socket_goes_as_it_is(mock: MockProvider) -> None:
    """Kept on the socket: the provider answers the warm-up itself."""
    server, _ = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            await _turn(ws, WARMUP)
        [req] = mock.requests
        assert req.method == "WS" and req.json()["generate"] is False
    finally:
        await server.stop()


async def test_one_transient_refusal_is_retried_not_a_fallback(mock: MockProvider) -> None:
    """A 503 on the upgrade (before the client is accepted, then on the turn's own
    connect): retried on a socket, the turn stays on WebSocket; no HTTP cool-down."""
    cfg = make_config([{"url": mock.url}], stream=STREAM)
    cfg = dataclasses.replace(cfg, websocket_fallback_cooldown_s=300.0)
    server, _ = await start_relay(cfg)
    try:
        mock.script_upgrades([{"status": 503}, {"status": 503}])
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            got = await _turn(ws, {**WARMUP, "generate": True})
            assert got[-1]["type"] == "response.completed"
            got = await _turn(ws, {**WARMUP, "generate": True})
            assert got[-1]["type"] == "response.completed"
        assert [u.status for u in mock.upgrades] == [503, 503, 101]
        assert [r.method for r in mock.requests] == ["WS", "WS"]
    finally:
        await server.stop()


async def test_repeated_refusals_start_the_fallback(mock: MockProvider) -> None:
    """Three transient refusals in a row are a verdict: the turn goes over HTTP."""
    server, _ = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    try:
        mock.script_upgrades([{"status": 503}] * 3)
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            got = await _turn(ws, {**WARMUP, "generate": True})
            assert got[-1]["type"] == "response.completed"
        assert [u.status for u in mock.upgrades] == [503, 503, 503]
        assert [r.method for r in mock.requests] == ["POST"]
    finally:
        await server.stop()
