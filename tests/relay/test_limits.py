"""Bounded connections (issue 10): header-read and keep-alive timeouts, the connection
cap, accept() exhaustion logged once, and a slowloris against a low fd limit."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayfix import make_config, start_relay
from servefix import serve_subprocess
from unbroken.mock import MockProvider
from unbroken.relay.connections import GuardedServer, install_accept_log_limiter
from unbroken.relay.server import RelayServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _limited(mock_url: str, **server: Any) -> Any:
    import dataclasses

    return dataclasses.replace(make_config([{"url": mock_url}]), **server)


def _guard(server: RelayServer) -> GuardedServer:
    conns = server.connections
    assert conns is not None
    return conns


async def _open(server: RelayServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


def _request(server: RelayServer, body: bytes = b"", close: bool = False) -> bytes:
    return (
        f"POST /mock/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    ).encode() + body


async def _eof_after(reader: asyncio.StreamReader, limit_s: float) -> float:
    """Seconds until the relay closed the connection (reading whatever it sent)."""
    t0 = time.monotonic()
    async with asyncio.timeout(limit_s):
        while await reader.read(65536):
            pass
    return time.monotonic() - t0


async def test_silent_connection_is_closed_after_header_read_timeout(mock: MockProvider) -> None:
    server, _ = await start_relay(_limited(mock.url, header_read_timeout_s=0.5))
    try:
        reader, writer = await _open(server)
        took = await _eof_after(reader, 10)  # before: never closed
        assert 0.4 <= took < 5
        assert _guard(server).stats.header_timeouts == 1
        writer.close()
    finally:
        await server.stop()


async def test_slowloris_dripping_headers_is_cut(mock: MockProvider) -> None:
    server, _ = await start_relay(_limited(mock.url, header_read_timeout_s=0.6))
    try:
        reader, writer = await _open(server)
        head = _request(server)[:-2]  # headers never finished
        t0 = time.monotonic()
        closed = False
        for i in range(len(head)):  # one byte every 50 ms: the attack's own pace
            writer.write(head[i : i + 1])
            try:
                await writer.drain()
            except ConnectionError:
                closed = True
                break
            if reader.at_eof() or time.monotonic() - t0 > 10:
                break
            await asyncio.sleep(0.05)
            if reader.at_eof():
                closed = True
                break
        if not closed:
            await _eof_after(reader, 10)
        assert time.monotonic() - t0 < 5
        writer.close()
    finally:
        await server.stop()


async def test_body_that_stops_arriving_gets_408(mock: MockProvider) -> None:
    server, _ = await start_relay(_limited(mock.url, header_read_timeout_s=0.5))
    try:
        reader, writer = await _open(server)
        body = json.dumps(CHAT).encode()
        writer.write(_request(server, body)[: -len(body) + 5])  # headers + 5 body bytes
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert mock.requests == []
        writer.close()
    finally:
        await server.stop()


async def test_idle_keepalive_connection_is_closed(mock: MockProvider) -> None:
    server, _ = await start_relay(_limited(mock.url, keepalive_timeout_s=0.5))
    try:
        reader, writer = await _open(server)
        writer.write(_request(server, json.dumps(CHAT).encode()))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        took = await _eof_after(reader, 10)  # before: kept for an hour (aiohttp's 3630 s)
        assert took < 5
        writer.close()
    finally:
        await server.stop()


async def test_connections_beyond_the_cap_get_503_at_once(mock: MockProvider) -> None:
    server, _ = await start_relay(_limited(mock.url, max_connections=3))
    guard = _guard(server)
    silent = []
    try:
        for _ in range(3):
            silent.append(await _open(server))
        await asyncio.wait_for(guard.wait_connections(lambda n: n == 3), 10)
        reader, writer = await _open(server)
        writer.write(_request(server, json.dumps(CHAT).encode()))
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 10)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"Retry-After: 1" in answer and b"too_many_connections" in answer
        await _eof_after(reader, 10)
        writer.close()
        assert guard.stats.refused_busy == 1
        # a slot frees: the next request is served
        silent.pop()[1].close()
        await asyncio.wait_for(guard.wait_connections(lambda n: n < 3), 10)
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/mock/v1/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 200
    finally:
        for _, w in silent:
            w.close()
        await server.stop()


async def test_accept_exhaustion_is_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    install_accept_log_limiter(loop)
    handler = loop.get_exception_handler()
    install_accept_log_limiter(loop)  # once per loop: read off the loop, no module state
    assert loop.get_exception_handler() is handler
    caplog.set_level(logging.DEBUG)
    for _ in range(500):
        loop.call_exception_handler(
            {
                "message": "socket.accept() out of system resource",
                "exception": OSError(errno.EMFILE, "Too many open files"),
            }
        )
    lines = [r for r in caplog.records if "accept()" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "Too many open files" in lines[0].getMessage()
    assert "Traceback" not in caplog.text


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))


async def test_slowloris_with_a_low_fd_limit_does_not_starve_clients(
    mock: MockProvider, tmp_path: Path
) -> None:
    """Review: with ulimit -n 128, 150 silent connections made legitimate requests hang,
    and the log filled with 4,841 accept() tracebacks in 6 s."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[server]\nheader_read_timeout_s = 1\n"
        f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}]\n'
    )
    env = {"XDG_STATE_HOME": str(tmp_path)}
    served = await serve_subprocess(cfg, env=env, preexec_fn=_low_fd_limit)
    port = served.port
    silent: list[asyncio.StreamWriter] = []
    try:
        for _ in range(150):
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            except (OSError, TimeoutError):
                break  # the backlog is full: the attack is at its limit
            silent.append(w)
        assert len(silent) >= 100
        url = f"http://127.0.0.1:{port}/mock/v1/chat/completions"
        statuses = []
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            # during the attack: an answer (served, or 503 at once), never a hang
            async with asyncio.timeout(15):
                async with s.post(url, json=CHAT) as r:
                    statuses.append(r.status)
                    await r.read()
            # silent connections are reaped after 1 s: clients are served again
            async with asyncio.timeout(20):
                while not statuses or statuses[-1] != 200:
                    async with s.post(url, json=CHAT) as r:
                        statuses.append(r.status)
                        await r.read()
                    if statuses[-1] != 200:
                        await asyncio.sleep(0.2)  # a client's own retry pace
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
        assert time.monotonic() - t0 < 30
    finally:
        for w in silent:
            w.close()
        _, text = await served.stop()
    assert "Traceback" not in text
    assert text.count("accept() failed") <= 1
    assert "max_connections lowered" in text  # the cap fits the fd limit


async def test_fifty_megabyte_sse_line_fails_the_attempt_quickly(tmp_path: Path) -> None:
    """Review: one 50 MB SSE line cost 14.8 s of relay CPU and +97 MB RSS."""
    from aiohttp import web

    sent = {"bytes": 0, "attempts": 0}

    async def huge(request: web.Request) -> web.StreamResponse:
        sent["attempts"] += 1
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        piece = b"y" * 65536
        try:
            await resp.write(b"data: ")
            for _ in range(50 * 16):  # 50 MB in one line
                await resp.write(piece)
                sent["bytes"] += len(piece)
            await resp.write(b"\n\n")
        except (ConnectionError, RuntimeError):
            pass  # the relay hung up: what we want
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", huge)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up = f"http://127.0.0.1:{runner.addresses[0][1]}"
    cfg = make_config([{"url": up}], retry={"max_attempts": 2}, stream={"max_event_bytes": 4 << 20})
    server, rec = await start_relay(cfg)
    try:
        t0 = time.monotonic()
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/mock/v1/chat/completions", json={**CHAT, "stream": True}) as r,
        ):
            body = await r.read()
        took = time.monotonic() - t0
        assert took < 10, took
        assert sent["attempts"] == 2  # a failed attempt, retried, then given up
        assert sent["bytes"] < 2 * 12 * (1 << 20)  # the relay stopped reading early
        assert r.status == 502 or b"error" in body, (r.status, body[:200])
        assert len(rec.failures) == 2, rec.failures  # the relay labels it "malformed"
    finally:
        await server.stop()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("limits", "cap", "soft_after"),
    [((1024, 4096), 1024, 2112), ((1024, 1024), 480, 1024), ((128, 128), 32, 128)],
)
def test_the_cap_fits_the_open_file_limit(
    limits: tuple[int, int], cap: int, soft_after: int
) -> None:
    """The soft limit is raised toward the hard one to fit the cap; what does not fit
    lowers the cap (two fds a connection), so new connections get 503, not EMFILE."""
    import subprocess

    code = (
        "import resource\n"
        "from unbroken.relay.connections import effective_max_connections\n"
        "print(effective_max_connections(1024)[0], "
        "resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits),
    ).stdout.split()
    assert [int(x) for x in out] == [cap, soft_after]
