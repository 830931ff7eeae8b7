"""Responses API over WebSocket: a client socket that outlives every upstream socket.

The client opens ``ws://relay/<route>/v1/responses`` and sends
``response.create`` messages.  Each one starts a *turn*, governed by the same
commit ledger as an HTTP stream: every upstream text message is one frame,
classified by the Responses table; control frames and tool calls are held;
a failure while PENDING is replayed on a fresh upstream socket (rerouting as
HTTP does) while the client's socket stays open; a failure after commit ends
the turn with ``error`` + ``response.failed`` and the socket stays open for the
next ``response.create``.

Socket-local state: with ``store: false``, ``previous_response_id`` points at
state held only by the upstream socket that produced it.  `History` records,
per client connection, the input and output items of every completed turn, so
a turn replayed on a new socket (or over HTTP) is sent self-contained.

WebSocket to HTTP fallback: an upstream that refuses the upgrade, or answers
``websocket_connection_limit_reached``, is served over ``POST /v1/responses``
with ``stream: true`` for ``[websocket] fallback_cooldown_s``; the SSE events
are forwarded to the client as WebSocket messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import WSMsgType, web
from multidict import CIMultiDict

from unbroken.config import Route, Upstream
from unbroken.core.ledger import Ledger, Verdict
from unbroken.core.policy import (
    Failure,
    FailureClass,
    RetryState,
    classify_exception,
    is_retryable_status,
)
from unbroken.core.protocols import RESPONSES
from unbroken.core.sse import Event, SSESplitter
from unbroken.observe.hooks import TurnInfo
from unbroken.relay.http import AttemptLog
from unbroken.relay.upstream import request_headers, upstream_url

__all__ = ["History", "handle_websocket", "is_websocket_request"]

# Handshake headers that belong to one hop of the WebSocket, never forwarded.
_WS_HOP = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-accept",
        "sec-websocket-protocol",
    }
)
_SEP = b"\x00"  # never inside a JSON text message: separates frames the ledger releases
_RETRYABLE_CLOSE = frozenset({1001, 1006, 1011, 1012, 1013, 1014})


def is_websocket_request(request: web.Request) -> bool:
    return request.headers.get("upgrade", "").lower() == "websocket"


def _as_items(value: Any) -> list[Any]:
    """Normalise a Responses ``input`` to a list of items."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    return [value]


@dataclass
class History:
    """Per client connection: what each completed response's state consists of.

    ``turns[rid]`` keeps the link to the previous response and this turn's own
    input and output items, so the full item list behind a response is the
    chain walked back to its start.  ``where[rid]`` says which upstream socket
    holds that response's state (``None``: none, e.g. an HTTP fallback turn).
    At most ``limit`` responses are kept (oldest dropped first).
    """

    limit: int = 512
    turns: dict[str, tuple[str | None, list[Any], list[Any]]] = field(default_factory=dict)
    where: dict[str, int | None] = field(default_factory=dict)

    def record(self, create: dict[str, Any], response: dict[str, Any], socket: int | None) -> None:
        rid = response.get("id")
        if not isinstance(rid, str):
            return
        prev = create.get("previous_response_id")
        output = response.get("output")
        self.turns[rid] = (
            prev if isinstance(prev, str) else None,
            _as_items(create.get("input")),
            list(output) if isinstance(output, list) else [],
        )
        self.where[rid] = socket
        while len(self.turns) > self.limit:
            oldest = next(iter(self.turns))
            del self.turns[oldest], self.where[oldest]

    def items(self, rid: str) -> list[Any] | None:
        """Every item of the conversation up to and including response ``rid``."""
        chain: list[tuple[list[Any], list[Any]]] = []
        cur: str | None = rid
        while cur is not None:
            entry = self.turns.get(cur)
            if entry is None:
                return None  # the chain starts somewhere we never saw
            prev, inputs, outputs = entry
            chain.append((inputs, outputs))
            cur = prev
        return [item for inputs, outputs in reversed(chain) for item in (*inputs, *outputs)]

    def request_for(self, create: dict[str, Any], socket: int | None) -> dict[str, Any]:
        """The request to send on ``socket``: as it is, or rebuilt self-contained."""
        prev = create.get("previous_response_id")
        if not isinstance(prev, str) or prev not in self.turns:
            return create
        if socket is not None and self.where.get(prev) == socket:
            return create  # that socket still holds the state
        items = self.items(prev)
        if items is None:
            return create
        rebuilt = {k: v for k, v in create.items() if k != "previous_response_id"}
        rebuilt["input"] = [*items, *_as_items(create.get("input"))]
        return rebuilt


class _Refused(Exception):
    """The upstream refused the WebSocket upgrade."""


async def handle_websocket(
    relay: Any, request: web.Request, route: Route, rest: str
) -> web.StreamResponse:
    with relay.running():
        return await _Connection(relay, request, route, rest).run()


class _Connection:
    """One client WebSocket and the upstream sockets behind it."""

    def __init__(self, relay: Any, request: web.Request, route: Route, rest: str) -> None:
        self.relay = relay
        self.cfg = relay.config
        self.request = request
        self.route = route
        self.rest = rest
        s = self.cfg.stream
        self.client = web.WebSocketResponse(
            autoping=True, heartbeat=s.keepalive_s, max_msg_size=0, compress=False
        )
        self.upstream: aiohttp.ClientWebSocketResponse | None = None
        self.upstream_idx = -1
        self.socket_gen = 0  # increments with every new upstream socket
        self.http_until = 0.0  # monotonic time until which turns go over HTTP
        self.history = History()
        self.loop = asyncio.get_running_loop()
        self._out: list[bytes] = []  # encoded frames not yet written (see send_to_client)
        self._flush_scheduled = False

    async def run(self) -> web.StreamResponse:
        await self.client.prepare(self.request)
        queue: asyncio.Queue[str] = asyncio.Queue()
        worker = asyncio.ensure_future(self._worker(queue))
        try:
            async for msg in self.client:
                if msg.type is WSMsgType.TEXT:
                    queue.put_nowait(msg.data)
                elif msg.type is WSMsgType.BINARY:
                    queue.put_nowait(msg.data.decode("utf-8", "replace"))
        except asyncio.CancelledError:
            # Shutdown after the grace period: tell the client to come back later.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.client.close(code=1001, message=b"relay shutting down"))
            raise
        finally:
            # The client is gone: stop the turn and every retry at once.
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await worker
            await self._drop_upstream()
        return self.client

    async def _worker(self, queue: asyncio.Queue[str]) -> None:
        while True:
            text = await queue.get()
            try:
                obj = orjson.loads(text)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and obj.get("type") == "response.create":
                await _Turn(self, obj, text).run()
            elif self.upstream is not None and not self.upstream.closed:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await self.upstream.send_str(text)

    # -- upstream sockets ---------------------------------------------------------------
    async def _drop_upstream(self) -> None:
        ws, self.upstream = self.upstream, None
        if ws is not None and not ws.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 2)

    async def connect(self, up: Upstream, idx: int) -> aiohttp.ClientWebSocketResponse:
        """Open a fresh upstream socket on ``up``."""
        await self._drop_upstream()
        headers = request_headers(self.request.headers, up, anthropic=False)
        for k in list(headers):
            if k.lower() in _WS_HOP:
                del headers[k]
        url = upstream_url(up, self.rest, self.request.query_string)
        url = url.with_scheme("wss" if url.scheme == "https" else "ws")
        s = self.cfg.stream
        try:
            async with asyncio.timeout(s.connect_timeout_s + s.header_timeout_s):
                ws = await self.relay.client.session.ws_connect(
                    url,
                    headers=headers,
                    autoping=True,
                    heartbeat=s.keepalive_s,
                    max_msg_size=0,
                    compress=0,
                    decode_text=False,
                )
        except aiohttp.WSServerHandshakeError as exc:
            raise _Refused(f"upgrade refused: HTTP {exc.status}") from exc
        self.upstream = ws
        self.upstream_idx = idx
        self.socket_gen += 1
        return ws

    async def send_to_client(self, released: bytes, *, sse: bool) -> None:
        """Queue text messages for the client; they leave together, in order."""
        if self.client.closed:
            raise ConnectionResetError("the client socket is closed")
        out = self._out
        for message in _messages(released, sse=sse):
            n = len(message)
            if n < 126:
                out.append(bytes((0x81, n)))
            elif n < 65536:
                out.append(b"\x81\x7e" + n.to_bytes(2, "big"))
            else:
                out.append(b"\x81\x7f" + n.to_bytes(8, "big"))
            out.append(message)
        if out and not self._flush_scheduled:
            # Frames released while upstream messages are already buffered go out
            # in one write, after this burst: one syscall instead of one each.
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)
        transport = self.request.transport
        if transport is not None and transport.get_write_buffer_size() > 1 << 20:
            # A slow client: stop reading upstream until its buffer drains.
            self._flush()
            drain = getattr(self.request.protocol, "_drain_helper", None)
            if drain is not None:
                await drain()

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._out:
            return
        data = b"".join(self._out)
        self._out.clear()
        transport = self.request.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)


def _messages(released: bytes, *, sse: bool) -> Iterator[bytes]:
    """Split what the ledger released into WebSocket text messages."""
    if not sse:
        for part in released.split(_SEP):
            if part:
                yield part
        return
    for event in SSESplitter().feed(released):
        if event.data is not None:
            yield event.data.encode()


def _ws_error_frames(error_bytes: bytes) -> bytes:
    """The ledger's native SSE error events, re-shaped as WebSocket messages."""
    out: list[bytes] = []
    for event in SSESplitter().feed(error_bytes):
        if event.data is None:
            continue
        obj = json.loads(event.data)
        if obj.get("type") == "error":
            obj["status"] = 500  # the WebSocket error shape carries the status
        out.append(json.dumps(obj, separators=(",", ":")).encode())
    return _SEP.join(out)


class _StallTimer:
    """Closes the upstream socket when it goes quiet past the phase's timeout.

    ``alive()`` only stores a timestamp (cheap, per message); the timer re-arms
    itself lazily when it fires, so a busy socket costs no timer churn.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, ws: Any, s: Any) -> None:
        self.loop, self.ws = loop, ws
        self.first, self.idle = s.first_frame_timeout_s, s.idle_timeout_s
        self.last: float | None = None  # time of the last message; None: none yet
        self.started = loop.time()
        self.stalled = False
        self.handle = loop.call_at(self.started + self.first, self._check)
        self._closing: asyncio.Future[Any] | None = None

    def alive(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        due = self.started + self.first if self.last is None else self.last + self.idle
        if self.loop.time() < due:
            self.handle = self.loop.call_at(due, self._check)
            return
        self.stalled = True
        self._closing = asyncio.ensure_future(self.ws.close(code=1001))

    def __enter__(self) -> _StallTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.cancel()


class _Turn:
    """One ``response.create``: attempts over upstream sockets, one ledger."""

    def __init__(self, conn: _Connection, create: dict[str, Any], text: str) -> None:
        self.conn = conn
        self.relay = conn.relay
        self.create = create
        self.text = text  # the client's message, forwarded as it is unless rebuilt
        self.ledger = Ledger(
            RESPONSES,
            hold=self.relay.hold,
            max_hold_bytes=conn.cfg.stream.max_hold_bytes,
            clock=conn.loop.time,
        )
        self.retry = RetryState(
            conn.cfg.retry,
            len(conn.route.upstreams),
            rng=self.relay.rng,
            cooloff_until=self.relay.cooloffs.setdefault(conn.route.name, {}),
        )
        self.retry.current = conn.upstream_idx - 1 if conn.upstream_idx >= 0 else -1
        self.info = TurnInfo(
            route=conn.route.name,
            path=conn.rest,
            protocol="responses-ws",
            stream=True,
            session_id=conn.request.headers.get("x-session-id"),
        )
        self.failure: Failure | None = None
        self.completed: dict[str, Any] | None = None
        self.fallback_reason = ""
        self.attempts = AttemptLog(self.info, self.relay.hooks)
        self.socket: int | None = None  # the upstream socket of this attempt (None: HTTP)

    async def run(self) -> None:
        info = self.info
        self.attempts.open(self.relay.inflight)
        try:
            await self._attempts()
        except asyncio.CancelledError:
            info.outcome = "aborted_by_client"
            raise
        except (ConnectionError, RuntimeError):
            info.outcome = "aborted_by_client"  # writing to the client failed
        finally:
            status = self.failure.status if self.failure is not None else None
            self.attempts.close(self.relay.inflight, phase="", status=status, ledger=self.ledger)

    def _begin_attempt(self, up: Upstream) -> None:
        self.attempts.begin(self.retry.attempts, up.name, self.ledger)

    def _end_attempt(self, reason: str, phase: str) -> None:
        status = self.failure.status if self.failure is not None else None
        self.attempts.end(reason, phase, status=status, ledger=self.ledger)

    async def _attempts(self) -> None:
        conn, retry, info = self.conn, self.retry, self.info
        while True:
            if retry.exhausted():
                reason = self.failure.reason if self.failure else "retries exhausted"
                out = self.ledger.give_up(f"retries exhausted ({reason})")
                await conn.send_to_client(_ws_error_frames(out), sse=False)
                info.outcome = "ended_with_error"
                return
            idx = retry.next_upstream(conn.loop.time())
            up = conn.route.upstreams[idx]
            info.attempts, info.upstream, info.state = retry.attempts, up.name, "waiting"
            info.ledger = self.ledger
            if retry.attempts > 1:
                self.ledger.start_attempt()
            self._begin_attempt(up)
            self.failure = None
            self.socket = None
            try:
                if conn.loop.time() < conn.http_until:
                    verdict = await self._over_http(up)
                else:
                    try:
                        verdict = await self._over_websocket(up, idx)
                    except _Refused as exc:
                        # The upstream refuses WebSocket: serve this turn over HTTP now.
                        self._start_fallback(str(exc))
                        verdict = await self._over_http(up)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if conn.client.closed:
                    return  # the client went away; run() stops everything
                failure = classify_exception(exc)
                if failure is None:
                    raise
                self.failure = failure
                verdict = await self._transport_failed()
            if verdict is Verdict.DONE:
                info.outcome = "recovered" if retry.retries else "ok"
                return
            if verdict is Verdict.FAIL:
                return
            # REPLAY: nothing of this attempt reached the client.
            await conn._drop_upstream()
            failure = self.failure or Failure(FailureClass.STREAM_ERROR, self.ledger.fail_reason)
            if failure.cls is FailureClass.STALL:
                phase = "stall"
            elif failure.status is not None:
                phase = "headers"
            elif self.ledger.received_frames == 0 and failure.cls.reroutes_at_once:
                phase = "connect"
            else:
                phase = "pending"
            status = failure.status
            wait = self.attempts.failed(
                failure, phase, retry, conn.loop.time(), status=status, ledger=self.ledger
            )
            if wait:
                await asyncio.sleep(wait)

    def _start_fallback(self, reason: str) -> None:
        cooldown = self.conn.cfg.websocket_fallback_cooldown_s
        self.conn.http_until = self.conn.loop.time() + cooldown
        self.fallback_reason = reason

    async def _end_with_error(self, out: bytes, failure: Failure) -> None:
        self.info.outcome = "ended_with_error"
        self.failure = failure
        self._end_attempt(failure.label, "committed")
        self.relay.hooks.attempt_failed(
            self.info, self.info.upstream, failure, phase="committed", wait_s=None
        )
        if out:
            await self.conn.send_to_client(_ws_error_frames(out), sse=False)
        self.info.outcome = "ended_with_error"

    async def _feed(self, event: Event, *, sse: bool) -> Verdict:
        """Feed one frame; send what the ledger releases; return its verdict."""
        ledger = self.ledger
        released = ledger.feed(event)
        verdict = ledger.verdict
        if verdict is Verdict.FAIL and not ledger.passed_through:
            # our own native error (a retryable failure after commit), not the provider's
            await self._end_with_error(released, Failure(FailureClass.STREAM_ERROR,
                                                         ledger.fail_reason))
            return verdict
        if released:
            self.info.state = "streaming"
            await self.conn.send_to_client(released, sse=sse)
        if verdict is Verdict.FAIL:
            self.info.outcome = "passed_through_error"
        elif verdict is Verdict.REPLAY:
            self.failure = Failure(FailureClass.STREAM_ERROR, ledger.fail_reason)
            text = event.data or ""
            if "websocket_connection_limit_reached" in text:
                self._start_fallback("websocket connection limit reached")
        elif verdict is Verdict.DONE and self.completed is None:
            self._remember(event.data)
        return verdict

    def _remember(self, data: str | None) -> None:
        try:
            obj = json.loads(data or "")
        except ValueError:
            return
        response = obj.get("response") if isinstance(obj, dict) else None
        if isinstance(response, dict) and obj.get("type") == "response.completed":
            self.completed = response
            self.conn.history.record(self.create, response, self.socket)

    async def _over_websocket(self, up: Upstream, idx: int) -> Verdict:
        conn = self.conn
        ws = conn.upstream
        if ws is None or ws.closed or conn.upstream_idx != idx:
            ws = await conn.connect(up, idx)
        self.socket = conn.socket_gen
        request = conn.history.request_for(self.create, self.socket)
        if request is self.create:
            await ws.send_str(self.text)
        else:
            await ws.send_str(json.dumps(request, separators=(",", ":")))
        self.info.state = "holding"
        with _StallTimer(conn.loop, ws, conn.cfg.stream) as timer:
            while True:
                msg = await ws.receive()
                if msg.type is WSMsgType.TEXT or msg.type is WSMsgType.BINARY:
                    timer.alive()
                    data: bytes = msg.data if isinstance(msg.data, bytes) else msg.data.encode()
                    verdict = await self._feed(
                        Event(data + _SEP, None, data.decode("utf-8", "replace")), sse=False
                    )
                    if verdict is Verdict.CONTINUE:
                        continue
                    return verdict
                # closed or errored: a transport failure of this attempt
                if timer.stalled:
                    self.failure = Failure(
                        FailureClass.STALL, "stall: no message within the timeout"
                    )
                else:
                    code = ws.close_code
                    label = f"websocket closed ({code})" if code else "websocket error"
                    self.failure = Failure(FailureClass.RESET, label)
                return await self._transport_failed()

    async def _transport_failed(self) -> Verdict:
        assert self.failure is not None
        out = self.ledger.failed(self.failure.reason)
        verdict = self.ledger.verdict
        if verdict is Verdict.FAIL:
            await self._end_with_error(out, self.failure)
        return verdict

    async def _over_http(self, up: Upstream) -> Verdict:
        """Serve this turn over ``POST /v1/responses`` SSE (the WebSocket fallback)."""
        conn = self.conn
        request = conn.history.request_for(self.create, None)
        body = {k: v for k, v in request.items() if k != "type"}
        body["stream"] = True
        headers: CIMultiDict[str] = request_headers(conn.request.headers, up, anthropic=False)
        for k in list(headers):
            if k.lower() in _WS_HOP:
                del headers[k]
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        url = upstream_url(up, conn.rest, conn.request.query_string)
        s = conn.cfg.stream
        async with asyncio.timeout(s.connect_timeout_s + s.header_timeout_s):
            resp = await self.relay.client.request(
                "POST", url, headers, json.dumps(body).encode()
            )
        try:
            if resp.status >= 300 or not resp.headers.get("content-type", "").startswith(
                "text/event-stream"
            ):
                text = (await resp.read())[:4096].decode("utf-8", "replace")
                self.failure = Failure(FailureClass.STATUS, f"HTTP {resp.status}",
                                       status=resp.status)
                if not is_retryable_status(resp.status):
                    # A final answer: pass it on as the WebSocket error event.
                    err = {"type": "error", "status": resp.status,
                           "error": {"type": "invalid_request_error", "message": text}}
                    await conn.send_to_client(json.dumps(err).encode(), sse=False)
                    self.info.outcome = "passed_through_error"
                    return Verdict.FAIL
                return Verdict.REPLAY
            splitter = SSESplitter()
            idle = s.first_frame_timeout_s
            while True:
                try:
                    async with asyncio.timeout(idle):
                        chunk = await resp.content.readany()
                except TimeoutError:
                    self.failure = Failure(FailureClass.STALL, "stall: no bytes within the timeout")
                    return await self._transport_failed()
                idle = s.idle_timeout_s
                if not chunk:
                    out = self.ledger.ended(splitter.pending)
                    verdict = self.ledger.verdict
                    if verdict is Verdict.FAIL:
                        await self._end_with_error(
                            out, Failure(FailureClass.TRUNCATED, "stream ended early")
                        )
                    elif verdict is Verdict.REPLAY:
                        self.failure = Failure(FailureClass.TRUNCATED, "stream ended early")
                    return verdict
                for event in splitter.feed(chunk):
                    verdict = await self._feed(event, sse=True)
                    if verdict is not Verdict.CONTINUE:
                        if verdict is Verdict.DONE:
                            continue
                        return verdict
                if self.ledger.verdict is Verdict.DONE and resp.content.at_eof():
                    return Verdict.DONE
        finally:
            resp.close()
