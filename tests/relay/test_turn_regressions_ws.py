"""Real-socket regression tests for the turn defects of issue 9: the WebSocket transport.

One test per defect: a stall after the first frames is caught by idle_timeout_s, a
``response.cancel`` reaches the upstream at once and the next turn gets its own
events, a crash inside a turn closes the client with 1011, and a client that pauses
reading is not cut as a stall.  Each checks what a client or an operator can see (the
messages, when they arrive, what the hooks record), never the relay's internal
classes.  A test that waits for the relay gives up after a short cap and fails with
what it saw; nothing sleeps to wait for server state.  The upstreams the mock cannot
play (a WebSocket peer that hangs and never answers a close frame, one that honours
``response.cancel``) are small fakes defined here; the rest comes from
`relay.regressionfix`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from relay.regressionfix import CREATE, WS_TERMINALS, end_connections, relay_for, ws_turn, ws_url
from unbroken.mock import MockProvider, ws_messages_for

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
        await end_connections(self._writers, self._tasks, self.closing)

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
        async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(server)) as ws:
            t0 = time.monotonic()
            got, ended = await ws_turn(ws, CREATE, cap=idle + 3)
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
        async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(server)) as ws:
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
            second, _ = await ws_turn(ws, CREATE, cap=5)
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
    from unbroken.core.turn.ledger import Ledger

    def boom(self: Any, event: Any) -> bytes:
        raise RuntimeError("forced crash inside the turn")

    monkeypatch.setattr(Ledger, "feed", boom)
    async with relay_for(mock.url, stream={"idle_timeout_s": 1}) as (server, rec):
        async with aiohttp.ClientSession() as s, s.ws_connect(ws_url(server)) as ws:
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


# -- 14. WebSocket: a client that pauses reading is not cut as a stall -----------------------
async def test_ws_slow_reader_is_not_cut_as_a_stall(mock: MockProvider) -> None:
    # The HTTP transport stops the stall clock while it is blocked writing to a slow
    # client (test 5, in test_turn_regressions_http_timers.py); the WebSocket transport
    # waited for a full client buffer with the clock running, so a client that paused
    # reading for longer than idle_timeout_s had its healthy stream cut with the native
    # error.
    # (first_frame_timeout_s: the mock takes most of a second to render this reply)
    stream = {"idle_timeout_s": 0.5, "first_frame_timeout_s": 10}
    action = {"text": "x" * 12_000_000, "deltas": 12_000}  # far more than socket buffers
    async with relay_for(mock.url, stream=stream) as (server, rec):
        mock.script([action])
        # (max_msg_size=0: the final events carry the whole 12 MB text)
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(ws_url(server), max_msg_size=0) as ws,
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
