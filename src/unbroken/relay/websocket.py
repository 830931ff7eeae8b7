"""The WebSocket transport: the Responses API over a client socket that outlives upstreams.

The client opens ``ws://relay/<route>/v1/responses`` and sends ``response.create``
messages.  Each one starts a *turn*, driven by the same `TurnMachine` as an HTTP
request: every upstream text message is one frame; control frames and tool calls
are held; a failure while nothing was released is replayed on a fresh upstream
socket while the client's socket stays open; a failure after output ends the turn
with ``error`` + ``response.failed`` and the socket stays open for the next turn.

Every other client message (``response.cancel``, ...) is forwarded to the current
upstream socket at once, even mid-turn.  Upstream lifecycle events that name a
response this connection already finished are not the current turn's: they go to
the client as they are and never reach the turn's ledger.

A crash inside a turn is logged with its traceback; the client socket is closed
with 1011 and the turn is journaled as ``internal_error``.

Socket-local state: with ``store: false``, ``previous_response_id`` points at state
held only by the upstream socket that produced it.  `core.turn.ws_session.History`
records, per client connection, the input and output items of every completed turn,
so a turn replayed on a new socket (or over HTTP) is sent self-contained.

Every decision here is the core's: the turn's (`core.turn`: a socket's answer is
`TurnMachine.socket_answered`), the session's (`core.turn.ws_session`: the HTTP
fallback, the response history, which events are late, the handshake timeout, the
relay's own errors as messages), and what a message is redacted of
(`core.wire.redact.AnswerRedaction`).  This module carries them out.

WebSocket to HTTP fallback: an upstream that refuses the upgrade, or answers
``websocket_connection_limit_reached``, is served over ``POST /v1/responses`` with
``stream: true`` for ``[websocket] fallback_cooldown_s``, through the HTTP
transport's own `HttpAttempt`; its SSE frames go to the client as messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, assert_never

import aiohttp
from aiohttp import WSMsgType, web
from multidict import CIMultiDict

from unbroken.config import Route, Upstream
from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.turn.continuation import DEFAULT_QUEUED_S, Resume
from unbroken.core.turn.machine import (
    AbortUpstream,
    Action,
    End,
    FinalInStream,
    GiveUp,
    Keepalive,
    Open,
    Outcome,
    PassThrough,
    ReadErrorBody,
    SendHeaders,
    Stream,
    TimerAction,
    TurnError,
    TurnMachine,
    Wait,
)
from unbroken.core.turn.ws_session import (
    Fallback,
    SessionResponses,
    error_messages,
    handshake_failure,
    is_own_error,
    refusal_is_verdict,
)
from unbroken.core.wire.client_request import session_id_of, sticky_key
from unbroken.core.wire.protocols import RESPONSES, model_asked
from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.redact import AnswerRedaction, redacted_headers
from unbroken.core.wire.sse import Event, SSESplitter
from unbroken.observe.hooks import TurnRecord
from unbroken.observe.report import HooksObserver
from unbroken.relay.errors import classify_exception
from unbroken.relay.http_attempt import HttpAttempt
from unbroken.relay.relay_state import RelayState
from unbroken.relay.upstream import raw_query, request_headers, upstream_url
from unbroken.relay.watchdog import Watchdog
from unbroken.relay.wslinger import ClientSocket

__all__ = ["as_messages", "handle_websocket", "is_websocket_request"]

log = logging.getLogger("unbroken")

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
#: Upstream handshake response headers a client reads (Codex: its turn state, models
#: etag, reasoning flag and model; request id and rate limits), copied to the client's
#: handshake when the first upstream socket opens before the client is accepted.
HANDSHAKE_HEADERS = frozenset(
    {
        "x-codex-turn-state",
        "x-models-etag",
        "x-reasoning-included",
        "openai-model",
        "x-request-id",
        "request-id",
    }
)
HANDSHAKE_PREFIXES = ("x-ratelimit-", "x-codex-")
#: how long the client's handshake may wait for the first upstream socket (Codex gives
#: up on a WebSocket handshake after websocket_connect_timeout_ms, 15 s by default)
FIRST_SOCKET_WAIT_S = 10.0


def handshake_headers(
    ws: aiohttp.ClientWebSocketResponse[Any], secrets: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """The upstream handshake response headers worth copying to the client, with
    any of ``secrets`` (the relay's keys and token) they echo redacted
    (`core.wire.redact.redacted_headers`)."""
    response = getattr(ws, "_response", None)  # aiohttp keeps the handshake response here
    if response is None:
        return []
    kept = [
        (name, value)
        for name, value in response.headers.items()
        if name.lower() in HANDSHAKE_HEADERS or name.lower().startswith(HANDSHAKE_PREFIXES)
    ]
    return (redacted_headers(kept, secrets) or kept) if secrets else kept


def is_websocket_request(request: web.Request) -> bool:
    return request.headers.get("upgrade", "").lower() == "websocket"


class _Refused(Exception):
    """The upstream refused the WebSocket upgrade (answered ``status``)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def handle_websocket(
    relay: RelayState, request: web.Request, route: Route, rest: str
) -> web.StreamResponse:
    with relay.running():
        return await _Connection(relay, request, route, rest).run()


def abort_websocket(ws: aiohttp.ClientWebSocketResponse[Any]) -> None:
    """Abort an upstream socket's transport at once: a hung peer sends no close frame."""
    conn = getattr(ws, "_conn", None)
    transport = getattr(conn, "transport", None)
    if transport is not None:
        transport.abort()


def as_messages(events: Sequence[Event], *, sse: bool) -> list[bytes]:
    """What the machine released, as WebSocket text messages (boundaries kept)."""
    if sse:
        return [e.data.encode() for e in events if e.data is not None]
    return [e.raw for e in events]


class _Connection:
    """One client WebSocket and the upstream sockets behind it."""

    def __init__(self, relay: RelayState, request: web.Request, route: Route, rest: str) -> None:
        self.relay = relay
        self.cfg = relay.config
        self.request = request
        self.route = route
        self.rest = rest
        s = self.cfg.stream
        self.client = ClientSocket(
            autoping=True,
            heartbeat=s.keepalive_s,
            max_msg_size=max(int(self.cfg.max_body_bytes), 1),
            compress=False,
        )
        self.upstream: aiohttp.ClientWebSocketResponse[Any] | None = None
        self.upstream_idx = -1
        #: the upstream the last turn's last attempt went to: the next turn starts there
        #: (the socket opened before the first turn is not a choice: sticky order is)
        self.turn_upstream = -1
        self.socket_gen = 0  # increments with every new upstream socket
        #: when turns go over HTTP instead (`core.turn.ws_session.Fallback`)
        self.fallback = Fallback(self.cfg.websocket_fallback_cooldown_s)
        #: the responses this connection finished, and their history
        self.responses = SessionResponses()
        self.loop = asyncio.get_running_loop()
        self.pending: deque[tuple[dict[str, Any], str]] = deque()
        self._wake = asyncio.Event()
        self._out: list[bytes] = []  # encoded frames not yet written (see send)
        #: the latest ``x-codex-turn-state`` an upstream handshake answered with: sent
        #: on every later upstream socket of this connection, as Codex itself would
        self.turn_state: str | None = None
        #: the refusal of the socket `_open_first` tried (a verdict on the upgrade):
        #: `connect` answers it once
        self.first_refused: _Refused | None = None
        self._flush_scheduled = False
        #: permessage-deflate on the upstream hop when the client offered it (each hop
        #: negotiates its own; the client's, on loopback, stays uncompressed: the relay
        #: writes its frames itself)
        offer = request.headers.get("sec-websocket-extensions", "")
        self.deflate = 15 if "permessage-deflate" in offer.lower() else 0

    async def run(self) -> web.StreamResponse:
        await self._open_first()
        try:
            await self.client.prepare(self.request)
        except BaseException:
            await self.drop_upstream()
            raise
        worker = asyncio.ensure_future(self._worker())
        try:
            async for msg in self.client:
                if msg.type is WSMsgType.TEXT:
                    text = msg.data
                elif msg.type is WSMsgType.BINARY:
                    text = msg.data.decode("utf-8", "replace")
                else:
                    continue
                if not await self._from_client(text):
                    break
        except asyncio.CancelledError:
            # Shutdown after the grace period: tell the client to come back later.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.client.close(code=1001, message=b"relay shutting down"))
            raise
        finally:
            # The client is gone: stop the turn and every retry at once.
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
            await self.drop_upstream()
        await self.client.linger()  # after a 1009: until the client has read it
        return self.client

    async def _open_first(self) -> None:
        """Open the first upstream socket *before* accepting the client, and copy the
        handshake headers that matter (`HANDSHAKE_HEADERS`).  If the upstream cannot be
        reached in `FIRST_SOCKET_WAIT_S`, the client is accepted without them and the
        first turn connects as usual; a refused upgrade starts the HTTP fallback."""
        if not self.route.upstreams or self.fallback.active(self.loop.time()):
            return
        try:
            async with asyncio.timeout(FIRST_SOCKET_WAIT_S):
                ws = await self.connect(self.route.upstreams[0], 0)
        except _Refused as exc:
            if refusal_is_verdict(exc.status):
                self.first_refused = exc  # the first turn falls back to HTTP with it
                return
            self.fallback.refused(self.loop.time(), exc.status)  # one is no verdict
            log.info(
                "websocket route=%s: %s before the handshake (transient: the first "
                "turn tries again); accepting the client without its headers",
                self.route.name,
                exc,
            )
            return
        except Exception as exc:
            log.info(
                "websocket route=%s: first upstream socket not open before the "
                "handshake (%s); accepting the client without its headers",
                self.route.name,
                type(exc).__name__,
            )
            await self.drop_upstream()
            return
        for name, value in handshake_headers(ws, self.relay.secrets):
            self.client.headers[name] = value

    async def _from_client(self, text: str) -> bool:
        """One client message.  False when the connection must close."""
        obj = loads_object(text)
        if obj is not None and obj.get("type") == "response.create":
            # ``[websocket] max_queued_messages`` may wait behind the running turn; past
            # that the client is misbehaving: close with 1008 (policy violation).
            if len(self.pending) >= self.cfg.websocket_max_queued_messages:
                await self.client.close(code=1008, message=b"too many pending response.create")
                return False
            self.pending.append((obj, text))
            self._wake.set()
            return True
        # Anything else (response.cancel, ...) goes to the upstream now, mid-turn too.
        ws = self.upstream
        if ws is not None and not ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(text)
        return True

    async def _worker(self) -> None:
        while True:
            while not self.pending:
                self._wake.clear()
                await self._wake.wait()
            create, text = self.pending.popleft()
            if not await _WsTurn(self, create, text).run():
                return  # crashed: the client socket was closed with 1011

    # -- upstream sockets ---------------------------------------------------------------
    async def drop_upstream(self) -> None:
        """Forget the upstream socket, aborting its transport (no close handshake to wait
        for: a hung peer never answers one, and a wait here could swallow a cancel)."""
        ws, self.upstream = self.upstream, None
        if ws is not None and not ws.closed:
            abort_websocket(ws)

    def headers_for(self, up: Upstream) -> CIMultiDict[str]:
        headers = request_headers(
            self.request.headers, up, anthropic=False, token=self.relay.token, via=self.relay.via
        )
        for k in list(headers):
            if k.lower() in _WS_HOP:
                del headers[k]
        if "accept-encoding" not in self.request.headers:  # set for HTTP; not the client's
            headers.popall("Accept-Encoding", None)
        if self.turn_state is not None:
            headers["x-codex-turn-state"] = self.turn_state
        return headers

    async def connect(self, up: Upstream, idx: int) -> aiohttp.ClientWebSocketResponse[Any]:
        """Open a fresh upstream socket on ``up``."""
        await self.drop_upstream()
        refused, self.first_refused = self.first_refused, None
        if refused is not None:
            raise refused  # refused just before the client was accepted: no second try
        url = upstream_url(up, self.rest, raw_query(self.request))
        url = url.with_scheme("wss" if url.scheme == "https" else "ws")
        s = self.cfg.stream
        try:
            async with asyncio.timeout(s.connect_timeout_s + s.header_timeout_s):
                ws = await self.relay.client.session.ws_connect(
                    url,
                    headers=self.headers_for(up),
                    autoping=True,
                    heartbeat=s.keepalive_s,
                    max_msg_size=s.max_event_bytes,  # an oversized message fails the attempt
                    compress=self.deflate,  # the client offered it: so does its relay
                    decode_text=False,
                )
        except aiohttp.WSServerHandshakeError as exc:
            raise _Refused(f"upgrade refused: HTTP {exc.status}", exc.status) from exc
        self.fallback.opened()
        self.upstream = ws
        self.upstream_idx = idx
        self.socket_gen += 1
        for name, value in handshake_headers(ws):
            if name.lower() == "x-codex-turn-state":
                self.turn_state = value
        return ws

    def send(self, messages: Sequence[bytes]) -> None:
        """Queue text messages for the client; they leave together, in order."""
        if self.client.closed:
            raise ConnectionResetError("the client socket is closed")
        out = self._out
        for message in messages:
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

    async def drain(self, machine: TurnMachine) -> None:
        """Wait while a slow client's buffer is full (upstream reading pauses).  The
        turn's stall clock stands still meanwhile: the time blocked on the client is
        not upstream silence."""
        transport = self.request.transport
        if transport is not None and transport.get_write_buffer_size() > 1 << 20:
            self._flush()
            drain = getattr(self.request.protocol, "_drain_helper", None)
            if drain is not None:
                machine.write_started(self.loop.time())
                try:
                    await drain()
                finally:
                    machine.wrote(self.loop.time())

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._out:
            return
        data = b"".join(self._out)
        self._out.clear()
        transport = self.request.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)


class _WsTurn:
    """One ``response.create``: its machine, and the I/O of its attempts."""

    def __init__(self, conn: _Connection, create: dict[str, Any], text: str) -> None:
        self.conn = conn
        self.relay = relay = conn.relay
        self.create = create
        self.text = text  # the client's message, forwarded as it is unless rebuilt
        profile = relay.profile_for(conn.request.headers)
        info = TurnRecord(
            route=conn.route.name,
            path=conn.rest,
            protocol="responses-ws",
            stream=True,
            session_id=session_id_of(conn.request.headers, create),
            client=profile.name,
            model=model_asked(create, ""),
        )
        self.report = HooksObserver(
            info, relay.hooks, relay.route_facts(conn.route)[0], relay.inflight
        )
        # The first attempt goes where the socket is (a turn, not a retry).
        retry = relay.retry_state(
            conn.route,
            sticky_key(conn.request.headers, create),
            prefer=conn.turn_upstream,
            creds=relay.limits.creds_for(conn.route, conn.request.headers),
        )
        now = conn.loop.time()
        stream = conn.cfg.stream
        # Background mode is not supported over WebSocket: with a continuation the turn
        # goes over HTTP (`_over_http`), resumed over HTTP after a cut, while the client
        # keeps its socket.
        strategy = relay.socket_continuation(conn.route, conn.rest)
        self.machine = TurnMachine(
            protocol=RESPONSES,
            hold=relay.hold_for(profile),
            timers=conn.cfg.stream,
            retry=retry,
            stream=False,  # the client socket is open already: no early headers
            now=now,
            report=self.report,
            clock=conn.loop.time,
            wall_clock=time.time,
            profile=profile,
            socket=True,  # keepalives, for a profile that wants them, are messages
            continuation=strategy,
            queued_s=stream.resume_queued_s if strategy is not None else DEFAULT_QUEUED_S,
        )
        # Whatever happens now reaches the client in-stream, as on an HTTP stream
        # whose headers went out.
        self.machine.headers_sent(now)
        info.held = self.machine.held_bytes
        self.watchdog = Watchdog(
            conn.loop,
            self.machine,
            self._on_timer,
            relay.min_interval(self.machine),
            relay.deadlines(conn.loop),
        )
        self.http = HttpAttempt(
            self.machine, retry, self.watchdog, relay.client, self, relay.secrets, relay
        )
        #: this turn's response: which upstream events are its own, its history entry
        self.responses = conn.responses.turn(create)
        self.reading_ws: aiohttp.ClientWebSocketResponse[Any] | None = None

    async def run(self) -> bool:
        """Serve the turn.  False when it crashed (the client socket is then closed)."""
        machine = self.machine
        self.report.open()
        try:
            await self._drive()
        except asyncio.CancelledError:
            machine.client_gone()
            raise
        except (ConnectionResetError, ConnectionError):
            machine.client_gone()  # writing to the client failed: it went away
        except Exception:
            machine.crashed()
            log.exception("internal error in a WebSocket turn route=%s", self.conn.route.name)
            with contextlib.suppress(Exception):
                await self.conn.client.close(code=1011, message=b"internal error")
            return False
        finally:
            if machine.has_cancels:
                self._send_cancels()
            self.watchdog.close()
            self.http.close()
            self.responses.ended()
            self.report.close(machine.outcome or Outcome.ABORTED_BY_CLIENT)
        return True

    async def _drive(self) -> None:
        machine, conn = self.machine, self.conn
        action: Action = machine.start(conn.loop.time())
        while True:
            if machine.has_cancels:
                self._send_cancels()
            match action:
                case Open():
                    action = await self._attempt(action)
                case Resume():
                    action = await self._resume(action)
                case Wait():
                    await conn.drop_upstream()
                    await self.relay.waker.wait(action)
                    action = machine.next_attempt(conn.loop.time())
                case End() | GiveUp():
                    if action.data:
                        conn.send(error_messages(action.data))
                    return
                case Stream() | PassThrough() | ReadErrorBody() | FinalInStream():
                    # (answers to `answered`, carried out by the attempt)
                    raise TurnError(f"unexpected action {action!r}")
                case _:
                    assert_never(action)

    async def _attempt(self, action: Open) -> Action:
        conn = self.conn
        conn.turn_upstream = action.upstream
        up = conn.route.upstreams[action.upstream]
        if conn.fallback.over_http(conn.loop.time(), bool(action.body_patch)):
            return await self._over_http(action, up)
        ws = conn.upstream
        if ws is None or ws.closed or conn.upstream_idx != action.upstream:
            try:
                ws = await conn.connect(up, action.upstream)
            except _Refused as exc:
                now = conn.loop.time()
                if not conn.fallback.refused(now, exc.status):
                    # One refusal is no verdict (a 503 now): a failed attempt, retried.
                    reason = f"upgrade refused: HTTP {exc.status}"
                    refused = Failure(FailureClass.STATUS, reason, status=exc.status)
                    return self.machine.open_failed(now, refused)
                # The upstream refuses WebSocket: serve this turn over HTTP now.
                self._log_fallback(str(exc))
                return await self._over_http(action, up)
            except Exception as exc:
                failure = classify_exception(exc)
                if failure is None:
                    raise
                failure = handshake_failure(failure, timed_out=isinstance(exc, TimeoutError))
                return self.machine.open_failed(conn.loop.time(), failure)
        return await self._over_websocket(ws, key=up.api_key)

    def _log_fallback(self, reason: str) -> None:
        conn = self.conn
        log.info(
            "websocket fallback route=%s: %s; HTTP for %gs",
            conn.route.name,
            reason,
            conn.cfg.websocket_fallback_cooldown_s,
        )

    def _on_timer(self, action: TimerAction) -> None:
        match action:
            case Keepalive():
                # A profile whose idle timer counts messages, not pings (Codex): the
                # keepalive event's data as a message, which its parser ignores.
                with contextlib.suppress(ConnectionError):
                    self.conn.send(as_messages(SSESplitter().feed(action.data), sse=True))
            case AbortUpstream():
                # A stall: abort the upstream at once.
                ws = self.reading_ws
                if ws is not None:
                    abort_websocket(ws)
                self.http.abort()
            case SendHeaders():
                pass  # (never: a WebSocket turn's headers are out from its start)
            case _:
                assert_never(action)

    # -- over a WebSocket ---------------------------------------------------------------
    async def _over_websocket(
        self, ws: aiohttp.ClientWebSocketResponse[Any], *, key: str | None = None
    ) -> Action:
        conn, machine = self.conn, self.machine
        request = self.responses.over_socket(conn.socket_gen)
        try:
            if request is self.create:
                await ws.send_str(self.text)
            else:
                await ws.send_str(json.dumps(request, separators=(",", ":")))
        except Exception as exc:
            failure = classify_exception(exc) or Failure(FailureClass.RESET, "send failed")
            return machine.open_failed(conn.loop.time(), failure)
        answer = machine.socket_answered(conn.loop.time())
        if type(answer) is not Stream:  # pragma: no cover - a socket's answer always streams
            return answer
        self.reading_ws = ws
        self.watchdog.arm()
        redacted = AnswerRedaction(self.relay.secrets, key).message
        loop_time = conn.loop.time
        rearm = True
        try:
            while True:
                msg = await ws.receive()
                if msg.type is not WSMsgType.TEXT and msg.type is not WSMsgType.BINARY:
                    code = ws.close_code
                    label = f"websocket closed ({code})" if code else "websocket error"
                    return machine.transport_failed(loop_time(), Failure(FailureClass.RESET, label))
                data: bytes = msg.data if isinstance(msg.data, bytes) else msg.data.encode()
                data = redacted(data)
                text = data.decode("utf-8", "replace")
                if self.responses.is_other(text, data):
                    # Another response's event (a late reply to a cancel, say): the
                    # client's, not this turn's.
                    with contextlib.suppress(ConnectionError):
                        conn.send([data])
                    continue
                released, over = machine.feed_frame(loop_time(), Event(data, None, text))
                if rearm:
                    rearm = False
                    self.watchdog.arm()  # the stall deadline moved to idle_timeout_s
                self._send(released, over, sse=False)
                if over is not None:
                    if conn.fallback.after_attempt(loop_time(), text, turn_ended=type(over) is End):
                        self._log_fallback("websocket connection limit reached")
                    return over
                if released:
                    await conn.drain(machine)
                if machine.answer_complete:
                    return machine.body_ended(loop_time())  # the terminal frame ends the turn
        finally:
            self.reading_ws = None

    def _send(self, released: Sequence[Event], over: Action | None, *, sse: bool) -> None:
        """Send what the machine released to the client, as messages."""
        if not released:
            return
        if is_own_error(over):
            self.conn.send(error_messages(b"".join([e.raw for e in released])))
            return
        self.conn.send(as_messages(released, sse=sse))
        if self.responses.completed:
            return
        if sse:
            self.responses.released([e.data for e in released if e.data is not None])
        else:
            self.responses.released([e.raw.decode("utf-8", "replace") for e in released])

    # -- over HTTP (the fallback) ---------------------------------------------------------
    async def _over_http(self, action: Open, up: Upstream) -> Action:
        """Serve this turn over ``POST /v1/responses`` SSE, with the HTTP transport's code."""
        conn = self.conn
        request = self.responses.over_http()
        local = self.responses.warmup_answer(f"resp_{secrets.token_hex(16)}", int(time.time()))
        if local is not None:
            return self._answer_warmup(local)
        body = {k: v for k, v in request.items() if k != "type"}
        body["stream"] = True
        if action.body_patch:  # background mode (`core.turn.continuation`)
            body.update(action.body_patch)
            conn.relay.stored_by_continue(conn.route)
        headers = conn.headers_for(up)
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        headers["Accept-Encoding"] = "identity"
        url = upstream_url(up, conn.rest, raw_query(conn.request))
        self.watchdog.arm()
        return await self.http.run(
            action, "POST", url, headers, json.dumps(body).encode(), key=up.api_key
        )

    def _answer_warmup(self, messages: Sequence[bytes]) -> Action:
        """A warm-up (``generate: false``) never goes over HTTP: the relay's own answer
        (`core.turn.ws_session.TurnResponses.warmup_answer`) goes through the turn's machine
        like an upstream's frames, so it is journaled and its response recorded in the
        history (the next turn chaining from it is sent whole)."""
        conn, machine = self.conn, self.machine
        now = conn.loop.time()
        answer = machine.socket_answered(now)
        if type(answer) is not Stream:  # pragma: no cover - a socket's answer always streams
            return answer
        for data in messages:
            text = data.decode()
            released, over = machine.feed_frame(now, Event(data, None, text))
            self._send(released, over, sse=False)
            if over is not None:
                return over
        return machine.body_ended(now)

    async def _resume(self, action: Resume) -> Action:
        """A continuation of the cut HTTP attempt, over HTTP: its frames go to the client
        as messages on the socket it keeps."""
        conn = self.conn
        up = conn.route.upstreams[action.upstream]
        headers = conn.headers_for(up)
        for name in action.drop_headers:
            headers.popall(name, None)
        for name, value in action.set_headers:
            headers[name] = value
        query = raw_query(conn.request)
        query = f"{action.query}&{query}" if query else action.query
        url = upstream_url(up, action.path, query)
        self.watchdog.arm()
        return await self.http.run(action, action.method, url, headers, action.body, key=up.api_key)

    def _send_cancels(self) -> None:
        conn = self.conn
        self.relay.send_cancels(
            conn.route, conn.request, self.machine.take_cancels(), headers_for=conn.headers_for
        )

    # -- Sink, for the HTTP fallback -------------------------------------------------------
    verbatim = False  # every SSE frame becomes a WebSocket message of its own

    def answer(self, status: int, headers: CIMultiDict[str]) -> None:
        """No HTTP status reaches a WebSocket client."""

    def keep_answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """A retryable answer is never passed through to a WebSocket client."""

    async def release(self, events: Sequence[Event], over: Action | None, now: float) -> None:
        self._send(events, over, sse=True)
        await self.conn.drain(self.machine)

    async def release_body(self, data: bytes, now: float) -> None:  # pragma: no cover
        raise TurnError("a WebSocket turn never passes a plain body through")
