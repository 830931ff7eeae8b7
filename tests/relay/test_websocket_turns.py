"""WebSocket turns read their own events: repeated response ids, and replays with new ids."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest_asyncio
from aiohttp import web

from relayfix import make_config, start_relay
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

CREATE: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", "store": False}


def _ws_url(server: RelayServer) -> str:
    return server.url.replace("http://", "ws://") + "/mock/v1/responses"


async def _turn(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    await ws.send_str(json.dumps(CREATE))
    events: list[dict[str, Any]] = []
    while True:
        msg = await ws.receive(timeout=10)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        events.append(json.loads(msg.data))
        if events[-1]["type"] in ("response.completed", "response.failed", "error"):
            return events


async def test_turns_on_one_socket_complete_even_when_the_upstream_reuses_ids(
    mock: MockProvider,
) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            for _ in range(3):
                events = await _turn(ws)
                assert events[0]["type"] == "response.created"
                assert events[-1]["type"] == "response.completed"
        turns = await rec.wait_turns(3)
        assert [t.outcome for t in turns] == ["ok", "ok", "ok"]
    finally:
        await server.stop()


def _event(etype: str, rid: str, **extra: Any) -> str:
    body: dict[str, Any] = {"type": etype, **extra}
    if etype.startswith("response.") and "delta" not in etype:
        body["response"] = {"id": rid, "object": "response", "status": "in_progress", "output": []}
    return json.dumps(body)


@pytest_asyncio.fixture
async def new_id_per_socket() -> AsyncIterator[str]:
    """A Responses WebSocket upstream: the first socket says response.created and resets;
    every later one answers in full, each with its own response id."""
    sockets = 0

    async def handler(request: web.Request) -> web.WebSocketResponse:
        nonlocal sockets
        sockets += 1
        n = sockets
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            rid = f"resp_{n}"
            await ws.send_str(_event("response.created", rid))
            if n == 1:
                assert request.transport is not None
                request.transport.abort()  # cut before any output: a replay
                break
            await ws.send_str(
                json.dumps(
                    {"type": "response.output_text.delta", "item_id": "m1", "delta": "hello"}
                )
            )
            await ws.send_str(_event("response.completed", rid))
        return ws

    app = web.Application()
    app.router.add_get("/v1/responses", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_replay_with_a_new_response_id_shows_the_client_one_response(
    new_id_per_socket: str,
) -> None:
    server, rec = await start_relay(make_config([{"url": new_id_per_socket}]))
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            events = await _turn(ws)
        created = [e for e in events if e["type"] == "response.created"]
        assert [e["response"]["id"] for e in created] == ["resp_2"]  # the dead one never shows
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["id"] == "resp_2"
        turns = await rec.wait_turns(1)
        assert turns[0].outcome == "recovered"
    finally:
        await server.stop()
