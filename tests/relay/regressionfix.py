"""Clients, fake upstreams and readers for the relay's turn regression tests.

The tests (`relay/test_turn_regressions_*.py`) drive the relay over real loopback
sockets.  Clients that must see bytes exactly when the relay sends them (aiohttp's
own client hides header timing) use `RawHTTP`, a small HTTP/1.1 keep-alive client on
a plain socket.  Upstreams the mock provider cannot play (a comment-only stream, a
``101`` to a POST) are answered by `FakeUpstream` with the handlers here; the
WebSocket fakes live beside the WebSocket tests.  `relay_for` starts a relay in front
of an upstream with a short shutdown grace, so a failing test ends fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import WSMsgType

from relayfix import Recorder, make_config, start_relay
from unbroken.relay.server import RelayServer

CHAT_PATH = "v1/chat/completions"
CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}
CREATE: dict[str, Any] = {"type": "response.create", "model": "m", "input": "hi", "store": False}
# The mock's default chat stream: 1 role chunk (control), 2..9 text deltas (output),
# 10 the finish_reason chunk (the terminal frame), 11 ``data: [DONE]``.
FIRST_OUTPUT, FINISH = 2, 10
DONE = b"data: [DONE]\n\n"
WS_TERMINALS = ("response.completed", "response.failed", "response.incomplete")


@contextlib.asynccontextmanager
async def relay_for(
    url: str, *, stream: dict[str, Any] | None = None, retry: dict[str, Any] | None = None
) -> AsyncIterator[tuple[Any, Recorder]]:
    """A relay in front of ``url``, with a short shutdown grace (a failing test ends fast)."""
    cfg = dataclasses.replace(make_config([{"url": url}], stream=stream, retry=retry), grace_s=1.0)
    server, rec = await start_relay(cfg)
    try:
        yield server, rec
    finally:
        await server.stop()


def sse_frames(body: bytes) -> list[bytes]:
    """Complete SSE frames in ``body`` (each ending with a blank line)."""
    parts = body.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]]


def without_comments(body: bytes) -> bytes:
    """``body`` without comment-only SSE frames (keepalives the relay may add)."""
    return b"".join(f for f in sse_frames(body) if not f.startswith(b":"))


def has_frames(n: int) -> Callable[[bytes], bool]:
    return lambda body: body.count(b"\n\n") >= n


def contains(needle: bytes) -> Callable[[bytes], bool]:
    return lambda body: needle in body


class RawHTTP:
    """An HTTP/1.1 keep-alive client on a plain socket: sees each byte when it arrives."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body = bytearray()  # the de-chunked body received so far
        self.complete = False  # the body's end arrived (last chunk, or Content-Length)
        self.eof = False
        self._raw = bytearray()
        self._chunked = False
        self._length: int | None = None

    @classmethod
    async def post(
        cls,
        base: str,
        path: str,
        body: dict[str, Any],
        *,
        rcvbuf: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> RawHTTP:
        parts = urlsplit(base)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # a small window: the client's buffers fill fast
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock)
        data = json.dumps(body).encode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        writer.write(
            (
                f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(data)}\r\nConnection: keep-alive\r\n\r\n"
            ).encode()
            + data
        )
        await writer.drain()
        return cls(reader, writer)

    async def head(self, cap: float) -> float | None:
        """Read the status line and headers; their arrival time, or None after ``cap`` s."""
        try:
            async with asyncio.timeout(cap):
                block = await self.reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return None
        at = time.monotonic()
        lines = block.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                self.headers[name.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._length = int(length) if length is not None else None
        if self._length == 0:
            self.complete = True
        return at

    async def until(self, done: Callable[[bytes], bool], cap: float) -> float | None:
        """Read until ``done(body)`` holds: the time it first did, or None (cap, end, EOF)."""
        try:
            async with asyncio.timeout(cap):
                while not done(bytes(self.body)):
                    if self.complete or not await self._more():
                        return None
        except TimeoutError:
            return None
        return time.monotonic()

    async def read_all(self, cap: float) -> float | None:
        """Read to the body's end: the time it arrived, or None (cap or EOF first)."""
        try:
            async with asyncio.timeout(cap):
                while not self.complete:
                    if not await self._more():
                        return None
        except TimeoutError:
            return None
        return time.monotonic()

    async def _more(self) -> bool:
        data = await self.reader.read(1 << 16)
        if not data:
            self.eof = True
            return False
        self._raw += data
        self._decode()
        return True

    def _decode(self) -> None:
        raw = self._raw
        if not self._chunked:
            self.body += raw
            raw.clear()
            if self._length is not None and len(self.body) >= self._length:
                self.complete = True
            return
        pos = 0
        while not self.complete:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(bytes(raw[pos:eol]).split(b";")[0], 16)
            if size == 0:
                self.complete = True  # (no trailers from the relay)
                pos = eol + 2
                break
            end = eol + 2 + size
            if len(raw) < end + 2:
                break
            self.body += raw[eol + 2 : end]
            pos = end + 2
        del raw[:pos]

    def close(self) -> None:
        self.writer.close()


Handler = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def end_connections(
    writers: set[asyncio.StreamWriter], tasks: set[asyncio.Task[Any]], closing: asyncio.Event
) -> None:
    """Abort a fake server's connections and let their handlers return."""
    closing.set()
    for writer in list(writers):
        writer.transport.abort()
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=2)
        for task in pending:  # (a handler that ignored both: should not happen)
            task.cancel()


class FakeUpstream:
    """A raw HTTP upstream: connection *i* is answered by ``handlers[i]`` (the last repeats).

    Every answer says ``Connection: close``; the socket is closed after the handler.
    ``arrivals`` holds the monotonic arrival time of each request.
    """

    def __init__(self, *handlers: Handler) -> None:
        self.handlers = list(handlers)
        self.arrivals: list[float] = []
        self.closing = asyncio.Event()  # set when the fake stops: hung handlers return
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> FakeUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await end_connections(self._writers, self._tasks, self.closing)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = 0
            for line in head.split("\r\n"):
                if line.startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            await reader.readexactly(length)
            self.arrivals.append(time.monotonic())
            index = min(len(self.arrivals), len(self.handlers)) - 1
            await self.handlers[index](writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_answer(frames: list[bytes]) -> Handler:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + b"".join(http_chunk(f) for f in frames) + b"0\r\n\r\n")
        await writer.drain()

    return answer


def json_answer(body: bytes) -> Handler:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()

    return answer


async def comments_forever(writer: asyncio.StreamWriter) -> None:
    """A 200 SSE stream of ``: ping`` comments, five a second, and never a data frame."""
    writer.write(SSE_HEAD)
    while True:
        writer.write(http_chunk(b": ping\n\n"))
        await writer.drain()
        await asyncio.sleep(0.2)


async def switching_protocols(writer: asyncio.StreamWriter) -> None:
    """A ``101 Switching Protocols`` to a plain POST, then the connection closes."""
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    await writer.drain()


def ws_url(server: RelayServer) -> str:
    return server.url.replace("http://", "ws://") + "/mock/v1/responses"


async def ws_turn(
    ws: aiohttp.ClientWebSocketResponse, create: dict[str, Any], cap: float
) -> tuple[list[dict[str, Any]], float | None]:
    """Send one create; collect its messages up to a terminal event (or an error).

    Returns the messages and the monotonic time the turn ended (None: not within ``cap``).
    """
    await ws.send_str(json.dumps(create))
    got: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(cap):
            while True:
                msg = await ws.receive()
                if msg.type is not WSMsgType.TEXT:
                    return got, None
                event = json.loads(msg.data)
                got.append(event)
                if event["type"] in WS_TERMINALS or event["type"] == "error":
                    return got, time.monotonic()
    except TimeoutError:
        return got, None
