"""Issue 33 item 7: the relay's secrets never come back in an upstream's response headers.

An upstream that echoes the key the relay injected, or the relay's token, in a
``Location``, ``Set-Cookie``, ``WWW-Authenticate`` or ``x-*`` header had it reach
the client verbatim (bodies were redacted, headers were not), for a 200, a 400 and
a 401, streamed or not, and in the WebSocket handshake the relay copies.
`core.wire.redact.redacted_headers` decides, the transports apply it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDictProxy

from relayfix import KEY_AUTH, KEY_TOKEN, make_config, start_relay
from unbroken.core.wire.redact import REDACTED_PART

KEY = "sk-injected-key-0123456789abcdef"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SSE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)
COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
}
ECHOED = ("Location", "Set-Cookie", "WWW-Authenticate", "x-echo", "x-ratelimit-note")


def _echo_headers(key: str) -> dict[str, str]:
    """Response headers that carry the key the upstream was sent and the relay's token."""
    return {
        "Location": f"https://up.example/next?key={key}&t={KEY_TOKEN}",
        "Set-Cookie": f"sess={key}; Path=/",
        "WWW-Authenticate": f'Bearer realm="{KEY_TOKEN}", error="invalid_token {key}"',
        "x-echo": f"{key} {KEY_TOKEN}",
        "x-ratelimit-note": f"key={key}",
        "x-request-id": "req-plain",
    }


class _Upstream:
    """Answers ``status`` with every secret it knows in its headers."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        body = await request.json()
        headers = _echo_headers(key)
        if self.status != 200:
            err = {"error": {"message": "no", "type": "invalid_request_error"}}
            return web.json_response(err, status=self.status, headers=headers)
        if not body.get("stream"):
            return web.json_response(COMPLETION, headers=headers)
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE)
        await resp.write_eof()
        return resp

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        ws = web.WebSocketResponse()
        ws.headers["x-codex-turn-state"] = f"state-{key}"
        ws.headers["x-ratelimit-note"] = KEY_TOKEN
        ws.headers["x-models-etag"] = "etag-plain"
        await ws.prepare(request)
        async for _ in ws:
            break
        await ws.close()
        return ws

    async def __aenter__(self) -> _Upstream:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.websocket)
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[_Upstream]:
    async with _Upstream(getattr(request, "param", 200)) as u:
        yield u


def _assert_clean(headers: CIMultiDictProxy[str]) -> None:
    for name in ECHOED:
        value = headers.get(name)
        assert value is not None, name  # the header is kept, its secrets are not
        assert KEY not in value and KEY_TOKEN not in value, (name, value)
        assert REDACTED_PART in value, (name, value)
    assert headers["x-request-id"] == "req-plain"


@pytest.mark.parametrize("upstream", [200, 400, 401], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
async def test_secrets_echoed_in_response_headers_are_redacted(
    upstream: _Upstream, stream: bool
) -> None:
    """Review (issue 33, 7): the injected key and the token came back verbatim in
    ``Location``, ``Set-Cookie``, ``WWW-Authenticate`` and ``x-*`` for 200, 400, 401."""
    config = make_config([{"url": upstream.url, "api_key_env": "K"}], env={"K": KEY})
    server, _ = await start_relay(config)
    try:
        async with (
            aiohttp.ClientSession(headers=KEY_AUTH) as s,
            s.post(f"{server.url}/mock/v1/chat/completions", json={**CHAT, "stream": stream}) as r,
        ):
            body = await r.read()
            assert r.status == upstream.status
            _assert_clean(r.headers)
    finally:
        await server.stop()
    if upstream.status == 200 and stream:
        assert body == SSE  # the body itself goes through as it came
    elif upstream.status == 200:
        assert json.loads(body) == COMPLETION


async def test_secrets_in_the_websocket_handshake_headers_are_redacted(
    upstream: _Upstream,
) -> None:
    """The handshake headers the relay copies from the upstream's (Codex reads
    ``x-codex-turn-state``, ``x-ratelimit-*``...) are redacted too."""
    config = make_config([{"url": upstream.url, "api_key_env": "K"}], env={"K": KEY})
    server, _ = await start_relay(config)
    url = server.url.replace("http://", "ws://") + "/mock/v1/responses"
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(url, headers=KEY_AUTH) as ws,
        ):
            got = ws._response.headers
            await ws.close()
    finally:
        await server.stop()
    assert got["x-codex-turn-state"] == f"state-{REDACTED_PART}"
    assert got["x-ratelimit-note"] == REDACTED_PART
    assert got["x-models-etag"] == "etag-plain"


def test_the_header_decision_keeps_names_order_and_clean_headers() -> None:
    from unbroken.core.wire.redact import redacted_headers

    pairs = [("A", "x"), ("Set-Cookie", f"a={KEY}"), ("Set-Cookie", "b=1"), ("B", KEY[:7])]
    assert redacted_headers(pairs, (KEY, KEY_TOKEN)) == [
        ("A", "x"),
        ("Set-Cookie", f"a={REDACTED_PART}"),
        ("Set-Cookie", "b=1"),
        ("B", KEY[:7]),  # a part of a secret is not the secret
    ]
    assert redacted_headers(pairs[:1], (KEY,)) is None  # nothing to change: keep them
    assert redacted_headers(pairs, ()) is None
    assert redacted_headers([("x", "short1")], ("short1",)) is None  # below MIN_SECRET
