"""Real-socket regression tests for the turn defects of issue 9.

One test per defect.  Each one drives the relay over real loopback sockets and
checks behaviour a client or an operator can see: the bytes on the wire, when
they arrive, and what the hooks record (a failure's label and phase, the turn's
outcome).  Nothing here names the relay's internal classes, so the tests hold
across a rewrite of the turn.

Timing: times are measured with ``time.monotonic()`` around socket events.  A
test that waits for something the relay should do gives up after a short cap
and then fails with what it saw, so a regression costs seconds, not minutes.
Nothing sleeps to wait for server state; the only sleeps are a client that
pauses reading (the point of that test) and fake upstreams pacing their frames.

Clients that must see bytes exactly when the relay sends them (aiohttp's own
client hides header timing) use `RawHTTP`, a small HTTP/1.1 keep-alive client
on a plain socket.  Upstreams the mock provider cannot play (a comment-only
stream, a ``101`` to a POST, a WebSocket peer that hangs and never answers a
close frame, a WebSocket that honours ``response.cancel``) are small fakes
defined here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from relayfix import Recorder, make_config, start_relay
from unbroken.mock import MockProvider, frames_for, ws_messages_for
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


# -- helpers ---------------------------------------------------------------------------
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


def _frames(body: bytes) -> list[bytes]:
    """Complete SSE frames in ``body`` (each ending with a blank line)."""
    parts = body.split(b"\n\n")
    return [p + b"\n\n" for p in parts[:-1]]


def _without_comments(body: bytes) -> bytes:
    """``body`` without comment-only SSE frames (keepalives the relay may add)."""
    return b"".join(f for f in _frames(body) if not f.startswith(b":"))


def _has_frames(n: int) -> Callable[[bytes], bool]:
    return lambda body: body.count(b"\n\n") >= n


def _contains(needle: bytes) -> Callable[[bytes], bool]:
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


async def _end_connections(
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
        await _end_connections(self._writers, self._tasks, self.closing)

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


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse_answer(frames: list[bytes]) -> Handler:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + b"".join(_chunk(f) for f in frames) + b"0\r\n\r\n")
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
        writer.write(_chunk(b": ping\n\n"))
        await writer.drain()
        await asyncio.sleep(0.2)


async def switching_protocols(writer: asyncio.StreamWriter) -> None:
    """A ``101 Switching Protocols`` to a plain POST, then the connection closes."""
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    await writer.drain()


def _ws_url(server: RelayServer) -> str:
    return server.url.replace("http://", "ws://") + "/mock/v1/responses"


async def _ws_turn(
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


# -- 1. WebSocket: a stall after the first frames is caught by idle_timeout_s ---------------
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


async def _ws_accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a WebSocket upgrade request with 101 (server side of RFC 6455, by hand)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    key = next(
        line.split(":", 1)[1].strip()
        for line in head.split("\r\n")
        if line.lower().startswith("sec-websocket-key:")
    )
    accept = base64.b64encode(hashlib.sha1(key.encode() + _WS_GUID).digest()).decode()
    writer.write(
        (
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
        ).encode()
    )


async def _ws_read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One client frame (masked): its opcode and payload."""
    b0, b1 = await reader.readexactly(2)
    n = b1 & 0x7F
    if n == 126:
        n = int.from_bytes(await reader.readexactly(2), "big")
    elif n == 127:
        n = int.from_bytes(await reader.readexactly(8), "big")
    mask = await reader.readexactly(4) if b1 & 0x80 else b"\0\0\0\0"
    data = await reader.readexactly(n)
    return b0 & 0x0F, bytes(c ^ mask[i % 4] for i, c in enumerate(data))


def _ws_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    n = len(payload)
    if n < 126:
        size = bytes([n])
    elif n < 65536:
        size = bytes([126]) + n.to_bytes(2, "big")
    else:
        size = bytes([127]) + n.to_bytes(8, "big")
    return bytes([0x80 | opcode]) + size + payload


class HungWSUpstream:
    """A Responses WebSocket upstream whose first socket hangs after ``response.created``.

    The hung socket never reads again, so it never answers a close frame either:
    only an abort gets rid of it.  Later sockets answer every create with the
    mock's clean reply and answer a close frame.
    """

    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages
        self.sockets = 0
        self.closing = asyncio.Event()  # set when the fake stops: the hung socket returns
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def __aenter__(self) -> HungWSUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await _end_connections(self._writers, self._tasks, self.closing)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        self.sockets += 1
        hung = self.sockets == 1
        try:
            await _ws_accept(reader, writer)
            while True:
                opcode, data = await _ws_read_frame(reader)
                if opcode == 0x8:  # close: answer it and end
                    writer.write(_ws_frame(data[:2], 0x8))
                    await writer.drain()
                    return
                if opcode == 0x9:  # ping
                    writer.write(_ws_frame(data, 0xA))
                elif opcode == 0x1 and hung:
                    writer.write(_ws_frame(self.messages[0]))  # response.created
                    await writer.drain()
                    await self.closing.wait()  # silence; never reads again
                    return
                elif opcode == 0x1:
                    writer.write(b"".join(_ws_frame(m) for m in self.messages))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()


async def test_ws_stall_after_first_frames_is_replayed_within_idle_timeout() -> None:
    idle = 1.0
    messages = ws_messages_for({}, CREATE)
    async with (
        HungWSUpstream(messages) as up,
        relay_for(up.url, stream={"idle_timeout_s": idle}) as (server, rec),
    ):
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            t0 = time.monotonic()
            got, ended = await _ws_turn(ws, CREATE, cap=idle + 3)
            elapsed = None if ended is None else round(ended - t0, 2)
            assert ended is not None and elapsed is not None and elapsed <= idle + 1, (
                f"stalled WebSocket turn not replayed within idle_timeout_s + 1 s "
                f"(ended after {elapsed} s; {len(got)} messages; "
                f"upstream sockets: {up.sockets})"
            )
            assert got == [json.loads(m) for m in messages]
        turns = await rec.wait_turns(1)
    assert [f[0] for f in rec.failures] == ["stall"]
    assert turns[0].outcome == "recovered"
    assert turns[0].attempt_log[0].reason == "stall"


# -- 2. WebSocket: response.cancel is forwarded at once, and turns keep their own replies ---
class CancellableWSUpstream:
    """A Responses WebSocket upstream that honours ``response.cancel``.

    A ``response.create`` gets the control events and one text delta, then the
    upstream waits (up to ``pause`` s) for a cancel before it finishes.  A cancel
    that arrives while a response runs ends it with ``response.incomplete``; a
    cancel with no response running gets an ``error`` message, as a real upstream
    answers a message it cannot serve.
    """

    def __init__(self, pause: float = 2.0) -> None:
        self.pause = pause
        self.cancel_arrivals: list[float] = []
        self.count = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> CancellableWSUpstream:
        app = web.Application()
        app.router.add_get("/v1/responses", self._socket)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def _socket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        running: dict[str, Any] = {}  # the response in progress: its id and cancel event
        tasks: set[asyncio.Task[None]] = set()
        try:
            async for msg in ws:
                if msg.type is not WSMsgType.TEXT:
                    continue
                kind = json.loads(msg.data).get("type")
                if kind == "response.create":
                    self.count += 1
                    rid = f"resp_{self.count}"
                    cancelled = asyncio.Event()
                    running.clear()
                    running.update(id=rid, cancelled=cancelled)
                    task = asyncio.create_task(self._respond(ws, rid, cancelled, running))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif kind == "response.cancel":
                    self.cancel_arrivals.append(time.monotonic())
                    if running:
                        running["cancelled"].set()
                    else:
                        await ws.send_str(
                            json.dumps(
                                {
                                    "type": "error",
                                    "status": 400,
                                    "error": {
                                        "type": "invalid_request_error",
                                        "code": "no_active_response",
                                        "message": "no response in progress to cancel",
                                    },
                                }
                            )
                        )
        finally:
            for task in tasks:
                task.cancel()
        return ws

    async def _respond(
        self, ws: web.WebSocketResponse, rid: str, cancelled: asyncio.Event, running: dict[str, Any]
    ) -> None:
        seq = 0

        async def send(kind: str, **fields: Any) -> None:
            nonlocal seq
            await ws.send_str(json.dumps({"type": kind, "sequence_number": seq, **fields}))
            seq += 1

        response = {"id": rid, "object": "response", "status": "in_progress", "output": []}
        item = {"id": f"msg_{rid}", "type": "message", "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        await send("response.created", response=response)
        await send("response.in_progress", response=response)
        await send("response.output_item.added", output_index=0, item=item)
        await send(
            "response.content_part.added",
            item_id=item["id"],
            output_index=0,
            content_index=0,
            part=part,
        )
        await send(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=0,
            content_index=0,
            delta="Hello",
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.pause):
                await cancelled.wait()
        running.clear()
        if cancelled.is_set():
            await send(
                "response.incomplete",
                response={
                    **response,
                    "status": "incomplete",
                    "incomplete_details": {"reason": "cancelled"},
                },
            )
            return
        text = {**part, "text": "Hello"}
        await send(
            "response.output_text.done",
            item_id=item["id"],
            output_index=0,
            content_index=0,
            text="Hello",
        )
        await send(
            "response.content_part.done",
            item_id=item["id"],
            output_index=0,
            content_index=0,
            part=text,
        )
        done_item = {**item, "status": "completed", "content": [text]}
        await send("response.output_item.done", output_index=0, item=done_item)
        await send(
            "response.completed",
            response={**response, "status": "completed", "output": [done_item]},
        )


async def test_ws_cancel_reaches_upstream_at_once_and_next_turn_gets_its_own_events() -> None:
    async with CancellableWSUpstream(pause=2.0) as up, relay_for(up.url) as (server, _):
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            await ws.send_str(json.dumps(CREATE))
            async with asyncio.timeout(5):
                while True:  # mid-turn: the first output has reached the client
                    msg = await ws.receive()
                    assert msg.type is WSMsgType.TEXT, msg
                    if json.loads(msg.data)["type"] == "response.output_text.delta":
                        break
            sent = time.monotonic()
            await ws.send_str(json.dumps({"type": "response.cancel", "response_id": "resp_1"}))
            async with asyncio.timeout(5):  # the first turn ends, one way or the other
                while True:
                    msg = await ws.receive()
                    assert msg.type is WSMsgType.TEXT, msg
                    if json.loads(msg.data)["type"] in (*WS_TERMINALS, "error"):
                        break
            delay = round(up.cancel_arrivals[0] - sent, 3) if up.cancel_arrivals else None
            second, _ = await _ws_turn(ws, CREATE, cap=5)
    types = [e["type"] for e in second]
    assert delay is not None and delay <= 0.1, (
        f"response.cancel reached the upstream {delay} s after the client sent it "
        f"(expected within 100 ms); the next turn then got: {types}"
    )
    assert types and types[0] == "response.created" and types[-1] == "response.completed", (
        f"the second turn read someone else's events: {types}"
    )
    assert second[0]["response"]["id"] == second[-1]["response"]["id"] == "resp_2"
    assert "error" not in types


# -- 3. WebSocket: a crash inside a turn closes the client with 1011 ------------------------
async def test_ws_crash_inside_a_turn_closes_client_with_1011_and_journals_internal_error(
    mock: MockProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unbroken.core.ledger import Ledger

    def boom(self: Any, event: Any) -> bytes:
        raise RuntimeError("forced crash inside the turn")

    monkeypatch.setattr(Ledger, "feed", boom)
    async with relay_for(mock.url, stream={"idle_timeout_s": 1}) as (server, rec):
        async with aiohttp.ClientSession() as s, s.ws_connect(_ws_url(server)) as ws:
            await ws.send_str(json.dumps(CREATE))
            seen: list[Any] = []
            code: int | None = None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(3):
                    while True:
                        msg = await ws.receive()
                        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                            code = ws.close_code
                            break
                        seen.append(msg.type)
        turns = await rec.wait_turns(1)
    outcome = turns[0].outcome
    assert (code, outcome) == (1011, "internal_error"), (
        f"after a crash in the turn: client close code {code} (expected 1011), "
        f"outcome {outcome!r} (expected 'internal_error'); messages seen: {seen}"
    )


# -- 4. HTTP: early headers reach a raw client at early_headers_s ---------------------------
async def test_http_early_headers_reach_a_raw_client_on_time(mock: MockProvider) -> None:
    # A guard more than a reproduction: with the aiohttp installed here (3.14),
    # StreamResponse.prepare() sends the headers at once (only web.Response buffers
    # them until the body), so the pre-rewrite relay already passes this.  A relay
    # that buffered the headers until its first body write would fail it.
    early = 1.0
    stream = {"early_headers_s": early, "keepalive_s": 30}
    async with relay_for(mock.url, stream=stream, retry={"delay_ms": 100}) as (server, _):
        mock.script([{"status": 503, "count": 1000}])
        t0 = time.monotonic()
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            at = await client.head(cap=early + 2)
        finally:
            client.close()
    elapsed = None if at is None else round(at - t0, 2)
    assert at is not None and elapsed is not None and elapsed <= early + 0.5, (
        f"early headers reached the client after {elapsed} s "
        f"(early_headers_s={early}; None: not within {early + 2} s)"
    )
    assert client.status == 200
    assert client.headers["content-type"].startswith("text/event-stream")


# -- 5. HTTP: a client that pauses reading is not cut as a stall ----------------------------
async def _paused_reader(
    mock: Any, action: dict[str, Any], read_cap: float
) -> tuple[RawHTTP, Any, list[Any], float | None]:
    """A reader that pauses for four idle timeouts after the first output, then reads
    the rest within ``read_cap``: (client, recorder, turns, when the body ended)."""
    stream = {
        "idle_timeout_s": 0.5,
        "first_frame_timeout_s": 0.5,
        "keepalive_s": 30,
        "early_headers_s": 30,
    }
    async with relay_for(mock.url, stream=stream) as (server, rec):
        mock.script([action])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT, rcvbuf=16384)
        try:
            assert await client.head(cap=5) is not None
            assert await client.until(_has_frames(FIRST_OUTPUT), cap=5) is not None
            await asyncio.sleep(2.0)  # the reader pauses: four idle timeouts long
            at = await client.read_all(cap=read_cap)
        finally:
            client.close()
        turns = await rec.wait_turns(1)
    return client, rec, turns, at


async def test_http_slow_reader_is_not_cut_as_a_stall(mock: MockProvider) -> None:
    # ~16 MB of text deltas: far more than the loopback socket buffers hold
    action = {"text": "x" * 12_000_000, "deltas": 12_000}
    expected = b"".join(frames_for("chat", action, CHAT))
    client, rec, turns, _ = await _paused_reader(mock, action, read_cap=20)
    body = bytes(client.body)
    assert body.endswith(DONE), f"stream did not end with [DONE]: ...{body[-300:]!r}"
    assert body == expected
    assert turns[0].outcome == "ok", (turns[0].outcome, rec.failures)
    assert rec.failures == []


async def test_http_stall_after_a_slow_reader_resumes_is_still_caught(mock: MockProvider) -> None:
    # The turn's timer fires while the relay is blocked writing to the paused reader;
    # no deadline runs during a write, so it found none.  Found in review: nothing
    # armed it again after the write, so a stall that followed was never caught (the
    # turn hung until the upstream gave up).
    action = {
        "text": "x" * 12_000_000,
        "deltas": 12_000,
        "fault": "stall",
        "after_frame": 11_000,
        "seconds": 30,
    }
    _, rec, turns, at = await _paused_reader(mock, action, read_cap=10)
    assert at is not None, (
        "the upstream stalled after the reader resumed, and the stream had not ended "
        f"within 10 s (idle_timeout_s=0.5); failures: {rec.failures}"
    )
    assert [f[:2] for f in rec.failures] == [("stall", "committed")]
    assert turns[0].outcome == "ended_with_error"


# -- 6. HTTP: a comment-only stream trips first_frame_timeout_s ----------------------------
async def test_http_comment_only_stream_trips_first_frame_timeout() -> None:
    first = 1.0
    clean = frames_for("chat", {}, CHAT)
    async with (
        FakeUpstream(comments_forever, sse_answer(clean)) as up,
        relay_for(up.url, stream={"first_frame_timeout_s": first}) as (server, rec),
    ):
        t0 = time.monotonic()
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            at = None
            if await client.head(cap=first + 3) is not None:
                at = await client.read_all(cap=first + 3)
        finally:
            client.close()
        elapsed = None if at is None else round(at - t0, 2)
        assert at is not None and elapsed is not None and elapsed <= first + 1, (
            f"comment-only stream not replayed within first_frame_timeout_s + 1 s "
            f"(upstream requests: {len(up.arrivals)}; finished after {elapsed} s)"
        )
        turns = await rec.wait_turns(1)
    assert client.status == 200 and _without_comments(bytes(client.body)) == b"".join(clean)
    assert len(up.arrivals) == 2
    assert [f[0] for f in rec.failures] == ["stall"]
    assert turns[0].outcome == "recovered"


# -- 7. HTTP: an upstream 101 to a plain POST is retried -----------------------------------
async def test_http_upstream_101_is_retried() -> None:
    plain = {k: v for k, v in CHAT.items() if k != "stream"}
    answer = b"".join(frames_for("chat", {}, plain))
    async with (
        FakeUpstream(switching_protocols, json_answer(answer)) as up,
        relay_for(up.url) as (server, rec),
    ):
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", plain)
        try:
            head = await client.head(cap=4)
            if head is not None and client.status == 200:
                await client.read_all(cap=4)
        finally:
            client.close()
        assert client.status == 200, (
            f"the client got status {client.status} (None: no answer within 4 s); "
            f"upstream requests: {len(up.arrivals)}"
        )
        turns = await rec.wait_turns(1)
    assert bytes(client.body) == answer
    assert len(up.arrivals) == 2
    assert turns[0].outcome == "recovered"


# -- 8. HTTP: a turn completed, then closed by the client, journals ok ---------------------
async def test_http_turn_completed_then_closed_by_client_is_ok(mock: MockProvider) -> None:
    async with relay_for(mock.url) as (server, rec):
        # frames 150 ms apart: the client closes between the terminal frame and [DONE]
        mock.script([{"chunk_delay_ms": 150}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            got = await client.until(_has_frames(FINISH), cap=5)
            assert got is not None
            assert b'"finish_reason":"stop"' in _frames(bytes(client.body))[FINISH - 1]
        finally:
            client.close()  # like Codex: gone right after the terminal frame
        turns = await rec.wait_turns(1)
    assert turns[0].outcome == "ok"


# -- 9. HTTP: idle_timeout_s below early_headers_s and keepalive_s is enforced ---------------
async def test_http_idle_timeout_shorter_than_early_headers_and_keepalive_is_enforced(
    mock: MockProvider,
) -> None:
    idle = 1.0
    async with relay_for(mock.url, stream={"idle_timeout_s": idle}) as (server, rec):
        # (a) after the first released output frame: the client gets the native error
        mock.script([{"fault": "stall", "after_frame": FIRST_OUTPUT, "seconds": 30}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            first = await client.until(_has_frames(FIRST_OUTPUT), cap=5)
            assert first is not None
            ended = await client.read_all(cap=idle + 2)
        finally:
            client.close()
        elapsed = None if ended is None else round(ended - first, 2)
        assert ended is not None and elapsed is not None and elapsed <= idle + 0.5, (
            f"stall after output not caught within idle_timeout_s + 0.5 s "
            f"(stream ended {elapsed} s after the last frame; None: not within {idle + 2} s)"
        )
        error = _frames(bytes(client.body))[-1]
        assert b'"error"' in error and DONE not in bytes(client.body)
        await rec.wait_turns(1)
        assert rec.failures == [("stall", "committed", None)]

        # (b) before any output: replayed, the client sees one clean stream
        mock.script([{"fault": "stall", "after_frame": 1, "seconds": 30}, {}])
        t0 = time.monotonic()
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            ended = None
            if await client.head(cap=idle + 2) is not None:
                ended = await client.read_all(cap=idle + 2)
        finally:
            client.close()
        elapsed = None if ended is None else round(ended - t0, 2)
        assert ended is not None and elapsed is not None and elapsed <= idle + 0.5, (
            f"stall before output not replayed within idle_timeout_s + 0.5 s ({elapsed} s)"
        )
        turns = await rec.wait_turns(2)
    assert bytes(client.body) == b"".join(frames_for("chat", {}, CHAT))
    assert rec.failures[1][0] == "stall"
    assert turns[1].outcome == "recovered"


# -- 10. HTTP: the first keepalive goes out keepalive_s after the last write -----------------
async def test_http_first_keepalive_at_keepalive_s(mock: MockProvider) -> None:
    keepalive, early = 1.0, 5.0
    stream = {"keepalive_s": keepalive, "early_headers_s": early, "idle_timeout_s": 60}
    async with relay_for(mock.url, stream=stream) as (server, _):
        mock.script([{"fault": "stall", "after_frame": FIRST_OUTPUT, "seconds": 30}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            last = await client.until(_has_frames(FIRST_OUTPUT), cap=5)
            assert last is not None
            at = await client.until(_contains(b": keepalive\n\n"), cap=early + 1)
        finally:
            client.close()
    elapsed = None if at is None else round(at - last, 2)
    assert at is not None and elapsed is not None and elapsed <= keepalive + 0.5, (
        f"first keepalive {elapsed} s after the last write (keepalive_s={keepalive}, "
        f"early_headers_s={early}; None: not within {early + 1} s)"
    )


# -- 11. HTTP: a cut after finish_reason still ends with [DONE], and is recorded -------------
async def test_http_cut_after_finish_reason_gets_done_and_is_recorded(mock: MockProvider) -> None:
    async with relay_for(mock.url) as (server, rec):
        mock.script([{"fault": "reset", "after_frame": FINISH}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            await client.read_all(cap=5)
        finally:
            client.close()
        turns = await rec.wait_turns(1)
    body = bytes(client.body)
    clean = frames_for("chat", {}, CHAT)
    assert body.startswith(b"".join(clean[:FINISH]))
    assert body.endswith(DONE), f"the stream ended without [DONE]: ...{body[-120:]!r}"
    assert turns[0].outcome == "ok"
    cut = [a.reason for a in turns[0].attempt_log if a.reason not in ("", "ok")]
    assert cut or rec.failures, (
        "the cut after the terminal frame was not recorded on the attempt "
        f"(attempts: {[(a.reason, a.phase) for a in turns[0].attempt_log]})"
    )


# -- 12. HTTP: keepalives to the client do not hide an upstream stall (issue 22) -------------
RESPONSES_PATH = "v1/responses"
RESPONSES: dict[str, Any] = {"model": "m", "input": "hi", "stream": True}
CODEX_UA = {"User-Agent": "codex_exec/0.169.0"}
RESPONSES_KEEPALIVE = b'event: keepalive\ndata: {"type":"keepalive"}\n\n'


async def _stall_behind_keepalives(
    mock: Any, path: str, body: dict[str, Any], headers: dict[str, str], keepalive: bytes
) -> None:
    """The upstream sends its first output, then hangs for 30 s while the relay writes
    a keepalive to the client every 0.1 s: the stall must still end the turn within
    idle_timeout_s of the last upstream byte (committed: the native error)."""
    idle = 0.5
    stream = {
        "idle_timeout_s": idle,
        "first_frame_timeout_s": idle,
        "keepalive_s": 0.1,
        "early_headers_s": 30,
    }
    proto = "responses" if path == RESPONSES_PATH else "chat"
    frames = frames_for(proto, {}, body)
    k = next(i for i, f in enumerate(frames, 1) if b"delta" in f and b"role" not in f)
    async with relay_for(mock.url, stream=stream) as (server, rec):
        mock.script([{"fault": "stall", "after_frame": k, "seconds": 30}])
        client = await RawHTTP.post(server.url, f"/mock/{path}", body, headers=headers)
        try:
            assert await client.head(cap=5) is not None
            last = await client.until(_contains(frames[k - 1]), cap=5)
            assert last is not None, bytes(client.body)
            ended = await client.read_all(cap=idle + 3)
        finally:
            client.close()
        got = bytes(client.body)
        elapsed = None if ended is None else round(ended - last, 2)
        assert ended is not None and elapsed is not None and elapsed <= idle + 0.5, (
            f"an upstream stall behind keepalives was not caught within idle_timeout_s + "
            f"0.5 s (ended {elapsed} s after the last upstream frame; None: not within "
            f"{idle + 3} s; {got.count(keepalive)} keepalives written)"
        )
        turns = await rec.wait_turns(1)
    assert got.count(keepalive) >= 2  # the keepalives did flow meanwhile
    assert got.startswith(b"".join(frames[:k]))
    assert b"error" in _frames(got)[-1]
    assert rec.failures == [("stall", "committed", None)]
    assert turns[0].outcome == "ended_with_error"


async def test_http_stall_behind_comment_keepalives_is_caught(mock: MockProvider) -> None:
    await _stall_behind_keepalives(mock, CHAT_PATH, CHAT, {}, b": keepalive\n\n")


async def test_http_stall_behind_codex_keepalive_events_is_caught(mock: MockProvider) -> None:
    # Codex measured: a 20 s idle timer took 200 s through the relay (20 s direct),
    # because the relay's own keepalive writes kept resetting its stall clock.
    await _stall_behind_keepalives(mock, RESPONSES_PATH, RESPONSES, CODEX_UA, RESPONSES_KEEPALIVE)


# -- 13. HTTP: a replay decided by a frame, retried at once, serves the next attempt ---------
async def test_http_in_stream_error_replayed_with_no_delay_is_served(mock: MockProvider) -> None:
    # Found with the turn machine's legality checks (issue 22): with no wait before the
    # retry (delay_ms = 0, or a reroute), a replay decided by an in-stream error left
    # its decision behind, and the next attempt's first chunk "ended" that attempt
    # with it: the relay opened a third request mid-stream and the turn crashed (500).
    async with relay_for(mock.url, retry={"delay_ms": 0}) as (server, rec):
        mock.script([{"fault": "error_event", "after_frame": 1, "error": "overloaded"}, {}])
        client = await RawHTTP.post(server.url, f"/mock/{CHAT_PATH}", CHAT)
        try:
            assert await client.head(cap=5) is not None
            await client.read_all(cap=5)
        finally:
            client.close()
        turns = await rec.wait_turns(1)
    assert client.status == 200, bytes(client.body)
    assert bytes(client.body) == b"".join(frames_for("chat", {}, CHAT))
    assert len(mock.requests) == 2
    assert [f[:2] for f in rec.failures] == [("stream_error", "pending")]
    assert turns[0].outcome == "recovered"


# -- 14. WebSocket: a client that pauses reading is not cut as a stall -----------------------
async def test_ws_slow_reader_is_not_cut_as_a_stall(mock: MockProvider) -> None:
    # The HTTP transport stops the stall clock while it is blocked writing to a slow
    # client (test 5); the WebSocket transport waited for a full client buffer with
    # the clock running, so a client that paused reading for longer than
    # idle_timeout_s had its healthy stream cut with the native error.
    # (first_frame_timeout_s: the mock takes most of a second to render this reply)
    stream = {"idle_timeout_s": 0.5, "first_frame_timeout_s": 10}
    action = {"text": "x" * 12_000_000, "deltas": 12_000}  # far more than socket buffers
    async with relay_for(mock.url, stream=stream) as (server, rec):
        mock.script([action])
        # (max_msg_size=0: the final events carry the whole 12 MB text)
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(_ws_url(server), max_msg_size=0) as ws,
        ):
            await ws.send_str(json.dumps(CREATE))
            types: list[str] = []
            async with asyncio.timeout(5):
                while "response.output_text.delta" not in types:
                    types.append(json.loads((await ws.receive()).data)["type"])
            await asyncio.sleep(2.0)  # the reader pauses: four idle timeouts long
            ended = None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(20):
                    while types[-1] not in (*WS_TERMINALS, "error"):
                        msg = await ws.receive()
                        assert msg.type is WSMsgType.TEXT, msg
                        types.append(json.loads(msg.data)["type"])
                    ended = time.monotonic()
        turns = await rec.wait_turns(1)
    assert ended is not None, f"the turn did not end within 20 s: ...{types[-3:]}"
    assert types[-1] == "response.completed", (types[-3:], rec.failures)
    assert rec.failures == []
    assert turns[0].outcome == "ok"
