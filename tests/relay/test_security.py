"""Issue 10 over real sockets: who may use the relay, and requests go upstream as sent.

Each test reproduces a finding of the hostile-input review against a relay
started in-process in front of the mock provider (or, where the exact bytes
that reach the provider matter, a capture server that records the raw
request-target, headers and body as received, undecoded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from relayfix import KEY_AUTH, make_config, start_relay
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOKEN = "tok-0123456789abcdef-test"
KEY = "sk-injected-key-0123456789abcdef"


@dataclasses.dataclass
class Seen:
    method: str
    raw_path: str
    headers: dict[str, str]
    body: bytes


class Capture:
    """A provider stand-in that records requests exactly as they arrive."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.reply: tuple[int, dict[str, str], bytes] = (
            200,
            {"Content-Type": "application/json"},
            b'{"ok": true}',
        )
        self._runner: web.ServerRunner | None = None
        self.url = ""

    async def _handle(self, request: web.BaseRequest) -> web.Response:
        body = await request.read()  # auto_decompress is off: the bytes as sent
        self.seen.append(Seen(request.method, request.raw_path, dict(request.headers), body))
        status, headers, payload = self.reply
        return web.Response(status=status, headers=headers, body=payload)

    async def __aenter__(self) -> Capture:
        server = web.Server(self._handle, auto_decompress=False)
        self._runner = web.ServerRunner(server)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def capture() -> AsyncIterator[Capture]:
    async with Capture() as c:
        yield c


async def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send raw bytes; return (status, whole answer).  For targets no client would send."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(65536), 10)
    writer.close()
    await writer.wait_closed()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data


def _req(path: str, host: str, extra: str = "", body: bytes = b"") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


def _hostport(server: RelayServer) -> str:
    return f"127.0.0.1:{server.port}"


# -- a web page must not reach the key -----------------------------------------------------


async def test_websocket_from_a_web_page_is_refused(
    mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a page opened ws://127.0.0.1:4780/<keyed route>/v1/responses with a foreign
    Origin and got response.completed, with the key injected upstream."""
    cfg = make_config([{"url": mock.url, "api_key_env": "K"}], env={"K": KEY})
    server, _ = await start_relay(cfg)
    url = server.url.replace("http://", "ws://") + "/mock/v1/responses"
    try:
        async with aiohttp.ClientSession(headers=KEY_AUTH) as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await s.ws_connect(url, origin="https://evil.example")
            assert info.value.status == 403
            assert mock.upgrades == [] and mock.requests == []
            # the same socket without an Origin (an agent, an SDK) works
            async with s.ws_connect(url) as ws:
                await ws.send_str(
                    json.dumps(
                        {"type": "response.create", "model": "m", "input": "hi", "store": False}
                    )
                )
                kinds: list[str] = []
                while not kinds or kinds[-1] != "response.completed":
                    kinds.append(json.loads((await ws.receive(timeout=10)).data)["type"])
            assert mock.upgrades[0].headers["Authorization"] == f"Bearer {KEY}"
    finally:
        await server.stop()
    assert KEY not in caplog.text


async def test_dns_rebinding_host_and_foreign_origin_are_refused(mock: MockProvider) -> None:
    """Review: Host: attacker-rebind.example:4780 with a foreign Origin got 200, with the
    upstream's Access-Control-Allow-Origin: * passed back."""
    cfg = make_config([{"url": mock.url, "api_key_env": "K"}], env={"K": KEY})
    server, _ = await start_relay(cfg)
    try:
        mock.set_default(
            {
                "headers": {
                    "Access-Control-Allow-Origin": "*",
                    "Access-Control-Allow-Credentials": "true",
                }
            }
        )
        body = json.dumps(CHAT).encode()
        port = server.port
        status, answer = await _raw(
            server.url,
            _req(
                "/mock/v1/chat/completions",
                f"attacker-rebind.example:{port}",
                "Origin: http://attacker-rebind.example:4780\r\n",
                body,
            ),
        )
        assert status == 421 and b"access-control" not in answer.lower()
        status, answer = await _raw(
            server.url,
            _req(
                "/mock/v1/chat/completions",
                _hostport(server),
                "Origin: https://evil.example\r\n",
                body,
            ),
        )
        assert status == 403 and b"access-control" not in answer.lower()
        assert mock.requests == []  # nothing reached the provider, no key was spent
        # an agent (no Origin, a local Host) gets the answer, without the CORS headers
        async with (
            aiohttp.ClientSession(headers=KEY_AUTH) as s,
            s.post(f"{server.url}/mock/v1/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 200
            assert not [h for h in r.headers if h.lower().startswith("access-control-")]
            await r.read()
        assert len(mock.requests) == 1
    finally:
        await server.stop()


async def test_allowed_origin_gets_cors_from_the_relay_only(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}])
    cfg = dataclasses.replace(cfg, allowed_origins=("https://app.example.com",))
    server, _ = await start_relay(cfg)
    try:
        mock.set_default({"headers": {"Access-Control-Allow-Origin": "*"}})
        async with aiohttp.ClientSession() as s:
            async with s.options(
                f"{server.url}/mock/v1/chat/completions",
                headers={
                    "Origin": "https://app.example.com",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "content-type, authorization",
                },
            ) as r:
                assert r.status == 204
                assert r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
                assert "authorization" in r.headers["Access-Control-Allow-Headers"]
            async with s.post(
                f"{server.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={"Origin": "https://app.example.com"},
            ) as r:
                assert r.status == 200
                assert r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
                await r.read()
    finally:
        await server.stop()


# -- the token -----------------------------------------------------------------------------


async def test_token_on_every_request_healthz_open(mock: MockProvider) -> None:
    cfg = dataclasses.replace(make_config([{"url": mock.url}]), token=TOKEN)
    server, _ = await start_relay(cfg)
    try:
        async with aiohttp.ClientSession() as s:

            async def status(method: str, path: str, **kw: Any) -> int:
                async with s.request(method, f"{server.url}{path}", **kw) as r:
                    await r.read()
                    return r.status

            assert await status("POST", "/mock/v1/chat/completions", json=CHAT) == 401
            assert await status("GET", "/status") == 401
            assert await status("GET", "/metrics") == 401
            assert await status("GET", "/nowhere") == 401  # no route list for strangers
            assert await status("GET", "/healthz") == 200
            ok = {"x-unbroken-token": TOKEN}
            assert await status("POST", "/mock/v1/chat/completions", json=CHAT, headers=ok) == 200
            assert await status("GET", "/status", headers=ok) == 200
            assert await status("GET", "/metrics", headers=ok) == 200
            assert await status("POST", f"/t/{TOKEN}/mock/v1/chat/completions", json=CHAT) == 200
            assert (
                await status(
                    "POST",
                    "/mock/v1/chat/completions",
                    json=CHAT,
                    headers={"x-unbroken-token": TOKEN[:-1] + "X"},
                )
                == 401
            )
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await s.ws_connect(server.url.replace("http", "ws") + "/mock/v1/responses")
            assert info.value.status == 401
            async with s.ws_connect(
                server.url.replace("http", "ws") + "/mock/v1/responses", headers=ok
            ):
                pass
        # the token never goes upstream
        assert all("x-unbroken-token" not in r.headers for r in mock.requests)
        assert all(TOKEN not in r.path for r in mock.requests)
        assert len(mock.requests) == 2
    finally:
        await server.stop()


async def test_non_loopback_bind_without_token_refuses_to_start() -> None:
    for host in ("0.0.0.0", "::"):
        cfg = dataclasses.replace(make_config([{"url": "http://127.0.0.1:9"}]), host=host)
        with pytest.raises(ValueError, match="UNBROKEN_TOKEN"):
            await RelayServer(cfg).start()
    # an empty host is loopback, never every interface
    server = RelayServer(dataclasses.replace(make_config([{"url": "http://127.0.0.1:9"}]), host=""))
    await server.start()
    try:
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        await server.stop()


async def test_keyed_route_forwards_no_client_key(mock: MockProvider) -> None:
    """Review: the client's api-key and x-goog-api-key went upstream beside the key."""
    cfg = make_config([{"url": mock.url, "api_key_env": "K"}], env={"K": KEY})
    server, _ = await start_relay(cfg)
    try:
        async with (
            aiohttp.ClientSession(headers=KEY_AUTH) as s,
            s.post(
                f"{server.url}/mock/v1/chat/completions",
                json=CHAT,
                headers={
                    "Authorization": "Bearer sk-client-a",
                    "api-key": "sk-client-b",
                    "x-goog-api-key": "sk-client-c",
                    "x-api-key": "sk-client-d",
                },
            ) as r,
        ):
            assert r.status == 200
        sent = mock.requests[0].headers
        assert sent["Authorization"] == f"Bearer {KEY}"
        assert not [v for v in sent.values() if "sk-client" in v]
    finally:
        await server.stop()


# -- the request goes upstream as sent -----------------------------------------------------


@pytest.mark.parametrize(
    ("path", "upstream_path"),
    [
        ("/cap/v1/a%23b", "/base/v1/a%23b"),  # %23 cut off the path and the query
        ("/cap/v1/a%20b", "/base/v1/a%20b"),  # %20 put a space into the request line
        ("/cap/v1/a%2Fb", "/base/v1/a%2Fb"),  # %2F became /
        ("/cap/v1/caf%C3%A9", "/base/v1/caf%C3%A9"),
        ("/cap/v1//double", "/base/v1//double"),
        ("/cap/v1/x?plain=1&b=2", "/base/v1/x?plain=1&b=2"),
        ("/cap/v1/x?x=%23y&z=1%262", "/base/v1/x?x=%23y&z=1%262"),
        ("/cap/v1/x?q=c%20d", "/base/v1/x?q=c%20d"),
        ("/cap/v1/x?x=%E2%82%AC", "/base/v1/x?x=%E2%82%AC"),
    ],
)
async def test_path_and_query_go_upstream_still_encoded(
    capture: Capture, path: str, upstream_path: str
) -> None:
    server, _ = await start_relay(make_config([{"url": capture.url + "/base"}], route="cap"))
    try:
        status, _ = await _raw(server.url, _req(path, _hostport(server)))
        assert status == 200
        assert capture.seen[0].raw_path == upstream_path
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "path",
    [
        "/cap/..%2f..%2fadmin",  # escaped the upstream's base path, key attached
        "/cap/v1/%2e%2e/%2e%2e/admin",
        "/cap/../admin",
        "/cap/..;/..;/admin",  # path-parameter traversal (Tomcat, Spring)
        "/cap/v1/..%3B/admin",
        "/cap/v1/chat%00",  # a 500 and a traceback
        "/cap/v1/%0d%0aX-Evil:%201",
        "/cap/v1/%7f",
    ],
)
async def test_bad_request_targets_get_400_and_never_reach_upstream(
    capture: Capture, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = make_config(
        [{"url": capture.url + "/base", "api_key_env": "K"}], env={"K": KEY}, route="cap"
    )
    server, _ = await start_relay(cfg)
    try:
        status, answer = await _raw(server.url, _req(path, _hostport(server)))
        assert status == 400, answer
        assert capture.seen == []
    finally:
        await server.stop()
    assert "Traceback" not in caplog.text


async def test_a_gzip_body_is_read_as_a_copy_for_streaming_and_model_renames(
    mock: MockProvider,
) -> None:
    """The relay reads a gzip JSON body to see ``stream`` and to rename the model; the
    renamed body goes upstream gzip-encoded again, as its header says."""
    cfg = make_config([{"url": mock.url, "models": {"alias": "m-real"}}])
    server, rec = await start_relay(cfg)
    gz = gzip.compress(json.dumps({**CHAT, "model": "alias", "stream": True}).encode())
    try:
        async with (
            aiohttp.ClientSession(auto_decompress=False) as s,
            s.post(
                f"{server.url}/mock/v1/chat/completions",
                data=gz,
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            ) as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
        [turn] = await rec.wait_turns(1)
        assert turn.stream is True
        sent = mock.requests[0]  # the mock's server decodes the gzip it receives
        assert sent.headers.get("Content-Encoding") == "gzip"
        body = sent.body if isinstance(sent.body, dict) else json.loads(sent.body)
        assert body["model"] == "m-real"
    finally:
        await server.stop()


async def test_gzip_request_body_arrives_byte_identical(capture: Capture) -> None:
    """Review: a gzip body was decompressed by the server and forwarded still labelled
    Content-Encoding: gzip (Claude Code's CLAUDE_CODE_GZIP_REQUEST_BODIES)."""
    cfg = make_config([{"url": capture.url}], retry={"max_body_mb": 0.01}, route="cap")
    server, _ = await start_relay(cfg)
    payload = json.dumps({**CHAT, "pad": "x" * 60_000}).encode()  # 60 KB > max_body_mb
    gz = gzip.compress(payload, mtime=1)
    assert len(gz) < 10_000
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.post(
                f"{server.url}/cap/v1/chat/completions",
                data=gz,
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            ) as r:
                assert r.status == 200
            # max_body_mb counts the bytes received, not what they would decompress to
            assert capture.seen[0].body == gz
            assert capture.seen[0].headers["Content-Encoding"] == "gzip"
            async with s.post(
                f"{server.url}/cap/v1/chat/completions",
                data=payload,
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 413
        assert len(capture.seen) == 1
    finally:
        await server.stop()


# -- an upstream error that echoes the key -------------------------------------------------


async def test_key_echoed_in_a_final_error_answer_is_redacted(
    capture: Capture, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    cfg = make_config(
        [{"url": capture.url, "api_key_env": "K"}],
        env={"K": KEY},
        retry={"max_attempts": 2},
        route="cap",
    )
    server, _ = await start_relay(cfg)
    echo = json.dumps({"error": {"message": f"Rate limited for key {KEY}."}}).encode()
    capture.reply = (
        429,
        {"Content-Type": "application/json", "Content-Length": str(len(echo))},
        echo,
    )
    try:
        async with (
            aiohttp.ClientSession(headers=KEY_AUTH) as s,
            s.post(f"{server.url}/cap/v1/chat/completions", json=CHAT) as r,
        ):
            got = await r.read()
            assert r.status == 429
        assert KEY.encode() not in got and "sk-…REDACTED".encode() in got
        assert len(capture.seen) == 2  # retried, then passed through
    finally:
        await server.stop()
    assert KEY not in caplog.text


async def test_key_echoed_in_a_passed_through_401_is_redacted(capture: Capture) -> None:
    cfg = make_config([{"url": capture.url, "api_key_env": "K"}], env={"K": KEY}, route="cap")
    server, _ = await start_relay(cfg)
    echo = json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}).encode()
    capture.reply = (401, {"Content-Type": "application/json"}, echo)
    try:
        async with (
            aiohttp.ClientSession(headers=KEY_AUTH) as s,
            s.post(f"{server.url}/cap/v1/chat/completions", json=CHAT) as r,
        ):
            got = await r.read()
            assert r.status == 401
        assert KEY.encode() not in got
    finally:
        await server.stop()


async def test_an_upstream_cookie_never_goes_back_upstream(capture: Capture) -> None:
    """The relay keeps no cookie jar: what a provider sets (Cloudflare's ``__cf_bm`` on
    api.openai.com, say) reaches the client that got it and is never added to another
    request, this client's or anyone else's.  Upstream by host name: aiohttp's jar
    ignores cookies from an IP address, so 127.0.0.1 would hide the leak."""
    capture.reply = (
        200,
        {"Content-Type": "application/json", "Set-Cookie": "__cf_bm=upstream-set; Path=/"},
        b'{"ok": true}',
    )
    port = capture.url.rsplit(":", 1)[1]
    server, _ = await start_relay(make_config([{"url": f"http://localhost:{port}"}], route="cap"))
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            for sent in (None, "mine=1", None):
                headers = {} if sent is None else {"Cookie": sent}
                async with http.post(
                    f"{server.url}/cap/v1/chat/completions", json=CHAT, headers=headers
                ) as resp:
                    assert resp.status == 200
                    # the client that got it still sees what the provider set
                    assert "__cf_bm=upstream-set" in resp.headers.get("Set-Cookie", "")
        assert [s.headers.get("Cookie") for s in capture.seen] == [None, "mine=1", None]
    finally:
        await server.stop()
