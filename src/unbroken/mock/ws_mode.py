"""The mock provider's Responses WebSocket mode: upgrades answered as scripted, and
each ``response.create`` on an accepted socket answered as its action says."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Final

from aiohttp import WSMsgType, web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict, MultiDict

from unbroken.mock.actions import (
    WS_DEFAULT_CLOSE_CODE,
    WS_LIMIT_CLOSE_CODE,
    Action,
    ActionError,
    parse_action,
)
from unbroken.mock.state import (
    _WS_MAX_MSG_SIZE,
    ACTION_HEADER,
    JSON_CONTENT_TYPE,
    KEY_HEADER,
    MockState,
    RecordedRequest,
    RecordedUpgrade,
    _abort,
    _flush,
    _mock_error_body,
    _previous_id,
    _remember,
)
from unbroken.mock.wire.error_replies import status_error_body
from unbroken.mock.wire.frames import RESPONSES_NAME
from unbroken.mock.wire.render import cut_after
from unbroken.mock.wire.reply import MockReply, canonical_json
from unbroken.mock.wire.ws_replies import (
    WS_GARBAGE,
    ws_connection_limit,
    ws_error,
    ws_error_kind,
    ws_failed_event,
    ws_messages,
    ws_previous_not_found,
    ws_request,
    ws_status_error,
)

__all__ = ["WebSocketMode"]


class _Socket:
    """State of one accepted Responses WebSocket."""

    __slots__ = ("closed", "completed", "header_action", "key", "number", "request", "ws")

    def __init__(
        self,
        number: int,
        request: web.Request,
        ws: web.WebSocketResponse,
        key: str | None,
        header_action: Action | None,
    ) -> None:
        self.number = number
        self.request = request
        self.ws = ws
        self.key = key
        self.header_action = header_action
        #: Set once the socket is closed (by either side) or lost.
        self.closed = asyncio.Event()
        #: Response ids completed on this socket (for ``previous_response_id``).
        self.completed: dict[str, None] = {}


class WebSocketMode(MockState):
    """Provider requests over a Responses WebSocket."""

    def _next_upgrade(self, key: str | None) -> Action:
        queue = self._upgrade_queues.get(key)
        if queue:
            return queue.popleft()
        return _ACCEPT

    async def _h_websocket(self, request: web.Request) -> web.StreamResponse:
        """A WebSocket upgrade on ``.../v1/responses``: pop an upgrade action, then serve."""
        key = request.headers.get(KEY_HEADER)
        upgrade = self._next_upgrade(key)

        def note(status: int | None, number: int | None = None) -> None:
            self.upgrades.append(
                RecordedUpgrade(
                    path=request.path,
                    query=MultiDict(request.query),
                    headers=CIMultiDict(request.headers),
                    status=status,
                    socket=number,
                    key=key,
                    action=upgrade.raw,
                )
            )

        if upgrade.delay:
            await asyncio.sleep(upgrade.delay)
        if upgrade.fault == "close_before_headers":
            note(None)
            _abort(request, upgrade.rst)
            return web.Response()
        if upgrade.status is not None:
            note(upgrade.status)
            headers: CIMultiDict[str] = CIMultiDict()
            if upgrade.body is not None:
                payload = upgrade.body.encode()
                headers["Content-Type"] = (
                    JSON_CONTENT_TYPE
                    if upgrade.body.lstrip()[:1] in ("{", "[")
                    else "text/plain; charset=utf-8"
                )
            else:
                payload = status_error_body(RESPONSES_NAME, upgrade.status)
                headers["Content-Type"] = JSON_CONTENT_TYPE
            for name, value in upgrade.headers:
                headers[name] = value
            return web.Response(status=upgrade.status, body=payload, headers=headers)

        header_action: Action | None = None
        raw_action = request.headers.get(ACTION_HEADER)
        if raw_action is not None:
            try:
                header_action = self._header_action(raw_action)
            except ActionError as exc:
                note(400)
                return web.Response(
                    status=400,
                    body=_mock_error_body(RESPONSES_NAME, str(exc)),
                    content_type=JSON_CONTENT_TYPE,
                )
        ws = web.WebSocketResponse(
            heartbeat=None, autoping=True, max_msg_size=_WS_MAX_MSG_SIZE, decode_text=False
        )
        for name, value in upgrade.headers:
            ws.headers[name] = value
        transport = request.transport
        if not ws.can_prepare(request).ok or transport is None:
            note(400)
            return web.Response(
                status=400,
                body=_mock_error_body(RESPONSES_NAME, "invalid WebSocket handshake"),
                content_type=JSON_CONTENT_TYPE,
            )
        self.sockets_accepted += 1
        sock = _Socket(self.sockets_accepted, request, ws, key, header_action)
        # Recorded before the 101 goes out, so a client that sees the socket open
        # also sees the record.
        note(101, sock.number)
        self._active.add(transport)
        inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        responder: asyncio.Task[None] | None = None
        try:
            writer = await ws.prepare(request)
            responder = asyncio.create_task(self._ws_responder(sock, writer, inbox))
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    inbox.put_nowait(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    break
        except ConnectionError:
            pass
        finally:
            sock.closed.set()
            inbox.put_nowait(None)
            self._active.discard(transport)
            if responder is not None:
                await responder
        return ws if ws.prepared else web.Response()

    async def _ws_responder(
        self, sock: _Socket, writer: AbstractStreamWriter, inbox: asyncio.Queue[bytes | None]
    ) -> None:
        """Answer the socket's messages one at a time, in order.

        Messages the client sent before it closed the socket are still recorded
        (they consume their actions); after the mock itself killed the socket
        (``reset``, ``close``, ``stall``, ``connection_limit``) the rest are dropped.
        """
        while True:
            data = await inbox.get()
            if data is None:
                return
            if not await self._ws_message(sock, writer, data):
                return

    async def _ws_message(self, sock: _Socket, writer: AbstractStreamWriter, data: bytes) -> bool:
        """Handle one client message; False when the mock has closed the socket."""
        body = bytes(data)
        problem: str | None = None
        message: Any = None
        try:
            message = json.loads(body)
            if not isinstance(message, dict):
                problem = "message must be a JSON object"
            elif message.get("type") != "response.create":
                problem = (
                    f"unsupported message type {message.get('type')!r} "
                    "(the mock only serves 'response.create')"
                )
        except ValueError as exc:
            problem = f"message is not valid JSON: {exc}"
        action: Action | None = None
        previous: str | None = None
        found: bool | None = None
        if problem is None:
            action = sock.header_action or self._next_action(sock.key)
            previous = _previous_id(message)
            if previous is not None:
                found = previous in sock.completed or previous in self._stored
        if self.record:
            request = sock.request
            self._record(
                RecordedRequest(
                    method="WS",
                    path=request.path,
                    query=MultiDict(request.query),
                    headers=CIMultiDict(request.headers),
                    body=body,
                    key=sock.key,
                    protocol=RESPONSES_NAME,
                    action=action.raw if action is not None else None,
                    socket=sock.number,
                    previous_response_id=previous,
                    previous_response_found=found,
                    at=asyncio.get_running_loop().time(),
                )
            )
        if action is None:
            error = ws_error(400, "invalid_request_error", None, f"mock: {problem}")
            await _ws_send(sock, error)
            return True
        return await self._ws_reply(
            sock, writer, action, message, previous if found is False else None
        )

    async def _ws_reply(
        self,
        sock: _Socket,
        writer: AbstractStreamWriter,
        action: Action,
        message: dict[str, Any],
        unknown_previous: str | None,
    ) -> bool:
        if action.delay and not await _ws_wait(sock, action.delay):
            return True
        fault = action.fault
        if fault in ("close_before_headers", "reset_after_headers"):
            await _ws_kill(sock, writer, action.rst)
            return False
        if fault == "connection_limit":
            await _ws_send(sock, ws_connection_limit())
            await _ws_close(sock, action.code or WS_LIMIT_CLOSE_CODE)
            return False
        if action.body is not None:
            await _ws_send(sock, action.body.encode())
            return True
        if action.is_error_status:
            assert action.status is not None
            await _ws_send(sock, ws_status_error(action.status))
            return True
        if unknown_previous is not None:
            await _ws_send(sock, ws_previous_not_found(unknown_previous))
            return True

        request_json = ws_request(message)
        reply = MockReply(RESPONSES_NAME, action, request_json, canonical_json(request_json))
        events = ws_messages(reply)
        total = len(events)
        k = total if fault is None else cut_after(reply, action, total)
        seq = list(events[:k])
        if fault == "error_event":
            if action.raw.get("error_style") == "failed":
                seq.append(ws_failed_event(reply, action.error, k))
            else:
                seq.append(ws_error_kind(action.error, k))
        elif fault == "malformed":
            seq.append(WS_GARBAGE)
            seq.extend(events[k:])
        # Index in ``seq`` of the terminal response.completed event, if it goes out.
        last = len(seq) - 1 if fault == "malformed" else (k - 1 if k == total else -1)
        stored = message.get("store") is True
        for index, payload in enumerate(seq):
            if index and action.chunk_delay and not await _ws_wait(sock, action.chunk_delay):
                return True
            if index == last:
                # Remember the id before the client can see the completion.
                _remember(sock.completed, reply.response_id)
                if stored:
                    _remember(self._stored, reply.response_id)
            if not await _ws_send(sock, payload):
                return True

        if fault == "reset":
            await _ws_kill(sock, writer, action.rst)
            return False
        if fault == "close":
            await _ws_close(sock, action.code or WS_DEFAULT_CLOSE_CODE)
            return False
        if fault == "stall":
            await _flush(sock.request, writer)
            if await _ws_wait(sock, action.seconds):
                _abort(sock.request, action.rst)
            return False
        return True


_ACCEPT: Final = parse_action({})


async def _ws_send(sock: _Socket, payload: bytes) -> bool:
    """Send one TEXT message; False if the socket is gone."""
    ws = sock.ws
    if ws.closed or sock.closed.is_set():
        return False
    try:
        await ws.send_frame(payload, WSMsgType.TEXT)
    except (ConnectionError, RuntimeError):
        return False
    return True


async def _ws_wait(sock: _Socket, seconds: float) -> bool:
    """Sleep ``seconds``; False (early) if the socket closes meanwhile."""
    if sock.closed.is_set():
        return False
    try:
        async with asyncio.timeout(seconds):
            await sock.closed.wait()
    except TimeoutError:
        return True
    return False


async def _ws_close(sock: _Socket, code: int) -> None:
    """Send a close frame with ``code`` and close the connection."""
    if sock.ws.closed or sock.closed.is_set():
        return
    try:
        await sock.ws.close(code=code, message=b"mock: close fault")
    except (ConnectionError, RuntimeError):
        pass


async def _ws_kill(sock: _Socket, writer: AbstractStreamWriter, rst: bool) -> None:
    """Flush what was sent, then abort the TCP connection (no close frame: 1006)."""
    await _flush(sock.request, writer)
    _abort(sock.request, rst)
