"""The upstream WebSocket handshake carries what the client sent (issue 25).

The relay dropped the client's ``permessage-deflate`` offer and added headers
the client never sent (``Accept: */*``, ``Accept-Encoding``).  Now the headers
that reach the upstream are the client's own, by name, plus the relay's
``Via``; a compression offer goes upstream when the client made one, and the
upstream hop is then compressed (each hop negotiates its own: the relay ends
both).  The client is the ``websockets`` library, which the OpenAI SDK uses.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import connect

from relayfix import make_config, start_relay
from unbroken.mock import MockProvider

CREATE: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", "store": False}
EXTRA = {"Authorization": "Bearer sk-client", "OpenAI-Beta": "responses_websockets=2026-02-06"}


async def _one_turn(url: str, compression: str | None) -> str:
    async with connect(url, additional_headers=EXTRA, compression=compression) as ws:
        await ws.send(json.dumps(CREATE))
        text = ""
        while True:
            event = json.loads(await ws.recv())
            if event["type"] == "response.output_text.delta":
                text += event["delta"]
            if event["type"] in ("response.completed", "response.failed", "error"):
                assert event["type"] == "response.completed", event
                return text


@pytest.mark.parametrize("compression", ["deflate", None])
async def test_upstream_handshake_has_the_clients_headers_and_offer(
    mock: MockProvider, compression: str | None
) -> None:
    direct = mock.url.replace("http://", "ws://") + "/v1/responses"
    assert await _one_turn(direct, compression) == "Hello from the mock provider."
    sent = mock.upgrades[-1].headers  # what this client sends, straight to the provider
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    try:
        relayed = server.url.replace("http://", "ws://") + "/mock/v1/responses"
        assert await _one_turn(relayed, compression) == "Hello from the mock provider."
    finally:
        await server.stop()
    seen = mock.upgrades[-1].headers
    names = {k.lower() for k in seen}
    assert names == {k.lower() for k in sent} | {"via"}, (sorted(names), sorted(sent))
    assert "accept" not in names and "accept-encoding" not in names
    offer = seen.get("Sec-WebSocket-Extensions", "")
    if compression:
        assert "permessage-deflate" in offer
    else:
        assert "sec-websocket-extensions" not in names
