"""The WebSocket relay is faithful: the first upstream socket opens before the client is
accepted and its handshake headers (x-codex-turn-state, x-models-etag, ...) reach the
client; later upstream sockets carry the turn state back; a refused upgrade still
falls back to HTTP, without the headers."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import aiohttp

from relayfix import make_config, start_relay
from unbroken.mock import MockProvider

CREATE: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", "store": False}
HEADERS = {
    "x-codex-turn-state": "ts-1",
    "x-models-etag": "etag-1",
    "x-reasoning-included": "true",
    "openai-model": "gpt-test",
    "x-request-id": "req-ws-1",
    "x-ratelimit-remaining-requests": "99",
    "x-unrelated": "no",
}


def _ws_url(server: Any) -> str:
    url: str = server.url
    return url.replace("http://", "ws://") + "/mock/v1/responses"


async def _turn(ws: aiohttp.ClientWebSocketResponse, create: dict[str, Any]) -> list[Any]:
    await ws.send_str(json.dumps(create))
    got = []
    async for msg in ws:
        obj = json.loads(msg.data)
        got.append(obj)
        if obj.get("type") in ("response.completed", "response.failed", "error"):
            break
    return got


async def test_handshake_headers_reach_the_client_and_the_turn_state_goes_back(
    mock: MockProvider,
) -> None:
    server, _ = await start_relay(
        make_config([{"url": mock.url}], stream={"first_frame_timeout_s": 2})
    )
    mock.script_upgrades([{"headers": HEADERS}, {"headers": {"x-codex-turn-state": "ts-2"}}])
    # the first turn's socket dies before output: unbroken opens a second upstream socket
    mock.script([{"fault": "close", "after_frame": 1, "code": 1011}])
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(_ws_url(server), headers={"x-codex-turn-state": "from-client"}) as ws,
        ):
            got = ws._response.headers
            for name, value in HEADERS.items():
                if name == "x-unrelated":
                    assert name not in got
                else:
                    assert got[name] == value, name
            turn = await _turn(ws, CREATE)
            assert turn[-1]["type"] == "response.completed"
        assert [u.status for u in mock.upgrades] == [101, 101]
        # the client's own turn state went up first; the upstream's newest on the reconnect
        assert mock.upgrades[0].headers["x-codex-turn-state"] == "from-client"
        assert mock.upgrades[1].headers["x-codex-turn-state"] == "ts-1"
    finally:
        await server.stop()


async def test_refused_upgrade_falls_back_to_http_without_headers(mock: MockProvider) -> None:
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    mock.script_upgrades([{"status": 426, "headers": {"x-codex-turn-state": "nope"}}])
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            assert "x-codex-turn-state" not in ws._response.headers
            turn = await _turn(ws, CREATE)
            assert turn[-1]["type"] == "response.completed"
        assert [u.status for u in mock.upgrades] == [426]
        assert [r.method for r in mock.requests] == ["POST"]
    finally:
        await server.stop()


async def test_unreachable_upstream_still_accepts_the_client(unused_tcp_port: int) -> None:
    server, _ = await start_relay(
        make_config([{"url": f"http://127.0.0.1:{unused_tcp_port}"}], retry={"max_attempts": 1})
    )
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            turn = await _turn(ws, CREATE)
            assert turn[-1]["type"] in ("error", "response.failed")
    finally:
        await server.stop()


async def test_codex_gets_keepalive_messages_on_a_quiet_socket(mock: MockProvider) -> None:
    """Codex's idle timer counts WebSocket messages, not pings: while the upstream is
    quiet, a Codex client gets ``{"type":"keepalive"}`` messages; another client none."""
    cfg = make_config([{"url": mock.url}], stream={"first_frame_timeout_s": 5, "idle_timeout_s": 5})
    cfg = dataclasses.replace(cfg, clients={"codex": {"keepalive_s": 0.08}})
    server, _ = await start_relay(cfg)
    slow = {"deltas": 1, "chunk_delay_ms": 250}
    try:
        for ua, want in (("codex_cli_rs/0.169.0", True), ("curl/8", False)):
            mock.script([slow])
            async with (
                aiohttp.ClientSession() as s,
                s.ws_connect(_ws_url(server), headers={"User-Agent": ua}) as ws,
            ):
                turn = await _turn(ws, CREATE)
            keepalives = [m for m in turn if m.get("type") == "keepalive"]
            assert turn[-1]["type"] == "response.completed"
            assert bool(keepalives) is want, ua
            assert next(m for m in turn if m.get("type") != "keepalive")["type"] == (
                "response.created"
            )
    finally:
        await server.stop()
