"""Bounded WebSocket input: message size (1009) and queued response.create messages (1008)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import aiohttp

from relayfix import make_config, start_relay
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

CREATE: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", "store": False}


def _ws_url(server: RelayServer) -> str:
    return server.url.replace("http://", "ws://") + "/mock/v1/responses"


async def test_a_message_over_max_body_mb_is_refused_with_1009(mock: MockProvider) -> None:
    cfg = dataclasses.replace(make_config([{"url": mock.url}]), max_body_mb=0.01)  # 10 kB
    server, _ = await start_relay(cfg)
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            await ws.send_str(json.dumps({**CREATE, "input": "x" * 50_000}))
            msg = await ws.receive(timeout=10)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            assert ws.close_code == 1009
        assert mock.requests == []  # nothing of it went upstream
    finally:
        await server.stop()


async def test_the_client_reads_1009_while_it_is_still_sending_the_oversized_message(
    mock: MockProvider,
) -> None:
    """Closed at once, the socket's unread input made the kernel send a reset, which threw
    away the close frame in the client's buffer: it saw 1006.  The relay now lingers."""
    cfg = dataclasses.replace(make_config([{"url": mock.url}]), max_body_mb=0.01)  # 10 kB
    server, _ = await start_relay(cfg)
    try:
        for size in (2_000_000, 8_000_000):
            async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
                await ws.send_str(json.dumps({**CREATE, "input": "x" * size}))
                msg = await ws.receive(timeout=10)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
                assert ws.close_code == 1009, (size, msg)
        assert mock.requests == []
    finally:
        await server.stop()


async def test_too_many_queued_creates_close_the_socket_with_1008(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}], retry={"delay_ms": 60_000})
    cfg = dataclasses.replace(cfg, websocket_max_queued_messages=2)
    server, _ = await start_relay(cfg)
    try:
        mock.script([{"status": 503}])  # the first turn waits a minute before its retry
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            await ws.send_str(json.dumps(CREATE))
            await mock.wait_for_requests(1)  # the first turn is running
            for _ in range(3):  # two may wait; the third is one too many
                await ws.send_str(json.dumps(CREATE))
            msg = await ws.receive(timeout=10)
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            assert ws.close_code == 1008
    finally:
        await server.stop()
