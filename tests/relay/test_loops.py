"""A request that comes back to the relay that forwarded it gets 508 at once (issue 25).

Each relay process adds ``Via: 1.1 unbroken-<id>`` (a random id per relay;
``--workers`` siblings share it) to what it forwards; a request that arrives
carrying its own id is answered ``508 Loop Detected`` before any body is read
or any upstream is opened.  Before, a route whose upstream was the relay itself
recursed until the request-line grew too long, holding ~372 file descriptors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from relay.test_health_relay import CHAT
from relayfix import Recorder, make_config, start_relay
from unbroken.config import parse_config
from unbroken.relay.server import RelayServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def looping_config(port: int, target_port: int, route: str = "loop") -> object:
    cfg = parse_config(
        {
            "retry": {"delay_ms": 5},
            "routes": {route: {"upstreams": [{"url": f"http://127.0.0.1:{target_port}/{route}"}]}},
        },
        env={},
    )
    return dataclasses.replace(cfg, port=port, grace_s=2.0)


class Seen:
    """A plain upstream that records each request's headers."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.url = ""


@pytest_asyncio.fixture
async def seen() -> AsyncIterator[Seen]:
    out = Seen()

    async def handler(request: web.Request) -> web.Response:
        out.headers.append(
            {k.lower(): ", ".join(request.headers.getall(k)) for k in request.headers}
        )
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    out.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield out
    finally:
        await runner.cleanup()


@pytest.mark.timeout(60)
async def test_a_route_to_itself_gets_508_at_once() -> None:
    port = free_port()
    rec = Recorder()
    server = RelayServer(looping_config(port, port), hooks=rec)  # type: ignore[arg-type]
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(10):
                async with http.post(f"{server.url}/loop/v1/chat/completions", json=CHAT) as r:
                    body = await r.json()
        assert r.status == 508, body
        assert body["error"]["code"] == "loop_detected"
        await rec.wait_turns(1)  # one turn: the returning request never became one
        assert len(rec.ended) == 1 and not server.relay.inflight
    finally:
        await server.stop()


@pytest.mark.timeout(60)
async def test_a_loop_through_two_relays_gets_508() -> None:
    pa, pb = free_port(), free_port()
    a = RelayServer(looping_config(pa, pb, "x"))  # type: ignore[arg-type]
    b = RelayServer(looping_config(pb, pa, "x"))  # type: ignore[arg-type]
    await a.start()
    await b.start()
    try:
        async with aiohttp.ClientSession() as http, asyncio.timeout(10):
            async with http.post(f"{a.url}/x/v1/chat/completions", json=CHAT) as r:
                body = await r.json()
        assert r.status == 508, body
        assert body["error"]["code"] == "loop_detected"
    finally:
        await a.stop()
        await b.stop()


async def test_via_is_added_and_kept(seen: Seen) -> None:
    server, _ = await start_relay(make_config([{"url": seen.url}]))
    try:
        async with aiohttp.ClientSession() as http:
            url = f"{server.url}/mock/v1/chat/completions"
            async with http.post(url, json=CHAT) as r:
                assert r.status == 200
            async with http.post(url, json=CHAT, headers={"Via": "1.1 corp-proxy"}) as r:
                assert r.status == 200
        via = server.relay.via
    finally:
        await server.stop()
    assert via.startswith("1.1 unbroken-")
    assert seen.headers[0]["via"] == via
    assert seen.headers[1]["via"] == f"1.1 corp-proxy, {via}"


async def test_another_relays_via_is_not_a_loop(seen: Seen) -> None:
    """Chaining relays (each with its own id) is allowed: only our own id is a loop."""
    server, _ = await start_relay(make_config([{"url": seen.url}]))
    via = server.relay.via
    try:
        async with aiohttp.ClientSession() as http:
            other = "1.1 unbroken-0123456789abcdef"
            async with http.post(
                f"{server.url}/mock/v1/chat/completions", json=CHAT, headers={"Via": other}
            ) as r:
                assert r.status == 200
            async with http.post(
                f"{server.url}/mock/v1/chat/completions", json=CHAT, headers={"Via": via}
            ) as r:
                assert r.status == 508
    finally:
        await server.stop()
    assert len(seen.headers) == 1 and seen.headers[0]["via"] == f"{other}, {via}"


async def test_two_relays_in_one_process_chain_without_a_loop(seen: Seen) -> None:
    """Each relay draws its own id: one process may chain two (the id was once drawn per
    process, and the second relay answered the first with 508)."""
    back, _ = await start_relay(make_config([{"url": seen.url}]))
    front, _ = await start_relay(make_config([{"url": f"{back.url}/mock"}]))
    try:
        assert front.relay.via != back.relay.via
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{front.url}/mock/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200, await r.text()
    finally:
        await front.stop()
        await back.stop()
    assert seen.headers[0]["via"] == f"{front.relay.via}, {back.relay.via}"
