"""The mock provider: an aiohttp server with a FIFO of per-request actions."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self

from aiohttp import WSMsgType, web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict, MultiDict

from unbroken.mock.actions import (
    WS_DEFAULT_CLOSE_CODE,
    WS_LIMIT_CLOSE_CODE,
    Action,
    ActionError,
    expand_actions,
    expand_upgrade_actions,
    parse_action,
)
from unbroken.mock.background import (
    BackgroundStore,
    background_refused_body,
    cancelled_body,
    not_found_body,
    resume_frames,
    resume_target,
    store_required_body,
)
from unbroken.mock.gemini import parse_path as parse_gemini_path
from unbroken.mock.gemini import request_view as gemini_request_view
from unbroken.mock.limits import MockLimits
from unbroken.mock.wire import (
    ANTHROPIC,
    GEMINI,
    RESPONSES,
    WS_GARBAGE,
    Reply,
    canonical_json,
    connection_limit_body,
    cut_after,
    error_body,
    error_frame,
    garbage_frame,
    halves,
    previous_not_found_body,
    protocol_name_for_path,
    render,
    status_error_body,
    ws_connection_limit,
    ws_error,
    ws_error_kind,
    ws_failed_event,
    ws_messages,
    ws_previous_not_found,
    ws_request,
    ws_status_error,
)

__all__ = ["MockProvider", "RecordedRequest", "RecordedUpgrade"]

KEY_HEADER: Final = "x-mock-key"
ACTION_HEADER: Final = "x-mock-action"
SSE_CONTENT_TYPE: Final = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE: Final = "application/json"

_HEADER_CACHE_MAX: Final = 128
_FRAME_FAULTS: Final = frozenset({"reset", "stall", "end", "error_event", "close"})
#: At most this many response ids are remembered (globally, and per socket) for
#: ``previous_response_id``; the oldest are forgotten first.
_STORE_MAX: Final = 65_536
_WS_MAX_MSG_SIZE: Final = 1 << 30


_RATE_HEADERS: Final = web.RequestKey("unbroken_mock_rate_headers", list)


async def _add_rate_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The budgets left, on every answer the limits let through (any action's)."""
    extra = request.get(_RATE_HEADERS)
    if extra:
        for name, value in extra:
            response.headers[name] = value


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One provider request as the mock received it."""

    method: str
    path: str
    query: MultiDict[str]
    headers: CIMultiDict[str]
    body: bytes
    key: str | None = None
    protocol: str | None = None
    action: Mapping[str, Any] | None = None
    #: WebSocket messages (method ``"WS"``): the 1-based number of the socket.
    socket: int | None = None
    #: The request's ``previous_response_id`` (Responses only; None if absent).
    previous_response_id: str | None = None
    #: Whether that id was known (None when there was no ``previous_response_id``).
    previous_response_found: bool | None = None
    #: When it arrived (the event loop's monotonic clock, seconds).
    at: float = 0.0

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form used by ``GET /_mock/requests``."""
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        out: dict[str, Any] = {
            "method": self.method,
            "path": self.path,
            "query": {
                k: self.query.getall(k) if len(self.query.getall(k)) > 1 else v
                for k, v in self.query.items()
            },
            "headers": headers,
            "key": self.key,
            "protocol": self.protocol,
            "action": dict(self.action) if self.action is not None else None,
            "socket": self.socket,
            "previous_response_id": self.previous_response_id,
            "previous_response_found": self.previous_response_found,
            "at": self.at,
        }
        try:
            out["body"] = self.body.decode("utf-8")
        except UnicodeDecodeError:
            out["body"] = None
            out["body_b64"] = base64.b64encode(self.body).decode("ascii")
        return out


@dataclass(frozen=True, slots=True)
class RecordedUpgrade:
    """One WebSocket upgrade attempt (``GET .../v1/responses`` with ``Upgrade: websocket``).

    ``status`` is 101 when accepted, the HTTP status when refused, None when the
    connection was dropped (``close_before_headers``); ``socket`` is the 1-based
    socket number of an accepted upgrade (None otherwise).
    """

    path: str
    query: MultiDict[str]
    headers: CIMultiDict[str]
    status: int | None
    socket: int | None
    key: str | None = None
    action: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form used by ``GET /_mock/upgrades``."""
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        return {
            "path": self.path,
            "query": {
                k: self.query.getall(k) if len(self.query.getall(k)) > 1 else v
                for k, v in self.query.items()
            },
            "headers": headers,
            "status": self.status,
            "socket": self.socket,
            "key": self.key,
            "action": dict(self.action) if self.action is not None else None,
        }


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


def _remember(store: dict[str, None], response_id: str) -> None:
    store.pop(response_id, None)
    store[response_id] = None
    if len(store) > _STORE_MAX:
        del store[next(iter(store))]


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class MockProvider:
    """A deterministic, fault-injecting fake LLM provider.

    ``async with MockProvider() as mock:`` starts it on ``127.0.0.1`` on an
    ephemeral port; ``mock.url`` is its base URL.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        default: Mapping[str, Any] | Action | None = None,
        *,
        record: bool = True,
        limits: MockLimits | None = None,
    ) -> None:
        """``record=False`` skips request recording (flat memory for long benchmarks;
        ``requests`` stays empty and ``wait_for_requests`` cannot be used)."""
        self.host = host
        self.record = record
        #: RPM/TPM enforced per key, reported in the providers' headers (`mock.limits`)
        self.limits = limits
        self.port = port
        self._initial_default = parse_action(default, where="default")
        self._default = self._initial_default
        self._queues: dict[str | None, deque[Action]] = {}
        self._upgrade_queues: dict[str | None, deque[Action]] = {}
        self.requests: list[RecordedRequest] = []
        #: WebSocket upgrade attempts, accepted or not.
        self.upgrades: list[RecordedUpgrade] = []
        #: Number of WebSocket upgrades accepted so far (never reset).
        self.sockets_accepted = 0
        #: Response ids stored globally (HTTP replies unless ``store: false``;
        #: socket replies created with ``store: true``).
        self._stored: dict[str, None] = {}
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._header_actions: dict[str, Action] = {}
        self._active: set[asyncio.Transport] = set()
        #: Responses background mode: the stored streams (`mock.background`)
        self.background = BackgroundStore()
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None

    # -- lifecycle -----------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (valid once started)."""
        return f"http://{_format_host(self.host)}:{self.port}"

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/_mock/health", self._h_health)
        app.router.add_get("/_mock/requests", self._h_requests)
        app.router.add_get("/_mock/upgrades", self._h_upgrades)
        app.router.add_post("/_mock/reset", self._h_reset)
        app.router.add_post("/_mock/script", self._h_script)
        app.router.add_post("/_mock/default", self._h_default)
        app.router.add_post("/_mock/limits", self._h_limits)
        app.router.add_get("/_mock/limits", self._h_limits_get)
        app.on_response_prepare.append(_add_rate_headers)
        app.router.add_route("*", "/{tail:.*}", self._h_provider)
        return app

    async def start(self) -> None:
        if self._runner is not None:
            return
        self._stopping = asyncio.Event()
        runner = web.AppRunner(
            self.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                self.port = int(address[1])
                break

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        if self._stopping is not None:
            self._stopping.set()
        for transport in list(self._active):
            transport.abort()
        self._active.clear()
        await runner.cleanup()
        for _, fut in self._waiters:
            if not fut.done():
                fut.cancel()
        self._waiters.clear()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- scripting -----------------------------------------------------------

    def script(self, actions: Iterable[Mapping[str, Any] | Action], key: str | None = None) -> None:
        """Append actions to the queue (the named queue ``key`` if given).

        Validates all actions first: on :class:`ActionError` nothing is queued.
        """
        parsed = expand_actions(actions)
        self._queues.setdefault(key, deque()).extend(parsed)

    def script_upgrades(
        self, actions: Iterable[Mapping[str, Any] | Action], key: str | None = None
    ) -> None:
        """Append WebSocket upgrade actions to the upgrade queue (``key``: the named one).

        Each upgrade attempt pops one: ``{}`` accepts, ``{"status": N}`` refuses with
        HTTP N and a JSON error body (``headers`` / ``body`` optional),
        ``{"fault": "close_before_headers"}`` drops the connection. An empty queue
        accepts. Validates all first: on :class:`ActionError` nothing is queued.
        """
        parsed = expand_upgrade_actions(actions)
        self._upgrade_queues.setdefault(key, deque()).extend(parsed)

    def pending_upgrades(self, key: str | None = None) -> int:
        """Number of queued, not yet consumed upgrade actions in queue ``key``."""
        queue = self._upgrade_queues.get(key)
        return len(queue) if queue else 0

    def set_default(self, action: Mapping[str, Any] | Action | None) -> None:
        """Action used when a request's queue is empty."""
        self._default = parse_action(action, where="default")

    def pending(self, key: str | None = None) -> int:
        """Number of queued, not yet consumed actions in queue ``key``."""
        queue = self._queues.get(key)
        return len(queue) if queue else 0

    def reset(self) -> None:
        """Clear all queues, recorded requests and upgrades and the global response
        store; restore the initial default action. (``sockets_accepted`` keeps
        counting; open sockets keep their own response ids.)"""
        self._queues.clear()
        self._upgrade_queues.clear()
        self.requests.clear()
        self.upgrades.clear()
        self._stored.clear()
        self.background.clear()
        self._default = self._initial_default

    async def wait_for_requests(
        self,
        n: int,
        timeout: float = 10.0,  # noqa: ASYNC109 - part of the public API
    ) -> list[RecordedRequest]:
        """Wait until at least ``n`` provider requests have been recorded."""
        if not self.record:
            raise RuntimeError("wait_for_requests() needs MockProvider(record=True)")
        if len(self.requests) >= n:
            return list(self.requests)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except TimeoutError:
            raise TimeoutError(
                f"only {len(self.requests)} of {n} requests arrived within {timeout}s"
            ) from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
        return list(self.requests)

    def _next_action(self, key: str | None) -> Action:
        queue = self._queues.get(key)
        if queue:
            return queue.popleft()
        return self._default

    def _record(self, rec: RecordedRequest) -> None:
        self.requests.append(rec)
        if self._waiters:
            count = len(self.requests)
            for n, fut in self._waiters:
                if n <= count and not fut.done():
                    fut.set_result(None)

    def _header_action(self, raw: str) -> Action:
        action = self._header_actions.get(raw)
        if action is None:
            try:
                data = json.loads(raw)
            except ValueError as exc:
                raise ActionError(f"{ACTION_HEADER}: invalid JSON: {exc}") from None
            action = parse_action(data, where=ACTION_HEADER)
            if len(self._header_actions) >= _HEADER_CACHE_MAX:
                self._header_actions.clear()
            self._header_actions[raw] = action
        return action

    # -- control API ---------------------------------------------------------

    async def _h_health(self, request: web.Request) -> web.Response:
        pending = {("" if k is None else k): len(q) for k, q in self._queues.items() if q}
        upgrades = {("" if k is None else k): len(q) for k, q in self._upgrade_queues.items() if q}
        return web.json_response(
            {
                "ok": True,
                "url": self.url,
                "requests": len(self.requests),
                "pending": pending,
                "upgrades": len(self.upgrades),
                "pending_upgrades": upgrades,
                "sockets": self.sockets_accepted,
            }
        )

    async def _h_requests(self, request: web.Request) -> web.Response:
        return web.json_response([r.to_dict() for r in self.requests])

    async def _h_upgrades(self, request: web.Request) -> web.Response:
        return web.json_response([u.to_dict() for u in self.upgrades])

    async def _h_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _read_json(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read() or b"null")
        except ValueError as exc:
            raise ActionError(f"invalid JSON body: {exc}") from None

    async def _h_script(self, request: web.Request) -> web.Response:
        try:
            data = await self._read_json(request)
            if isinstance(data, list):
                data = {"actions": data}
            if not isinstance(data, dict):
                raise ActionError('expected {"actions": [...], "upgrades": [...], "key": optional}')
            unknown = set(data) - {"actions", "upgrades", "key"}
            if unknown:
                raise ActionError(
                    f"{sorted(unknown)[0]}: unknown key (expected actions, upgrades, key)"
                )
            key = data.get("key")
            if key is not None and not isinstance(key, str):
                raise ActionError("key: expected a string")
            actions = data.get("actions") or []
            upgrades = data.get("upgrades") or []
            expand_actions(actions)  # validate both before queuing either
            expand_upgrade_actions(upgrades)
            self.script(actions, key=key)
            self.script_upgrades(upgrades, key=key)
        except ActionError as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response(
            {
                "ok": True,
                "pending": self.pending(key),
                "pending_upgrades": self.pending_upgrades(key),
            }
        )

    async def _h_limits(self, request: web.Request) -> web.Response:
        """``{"rpm": 60, "tpm": 0, "style": "openai"}`` sets the limits; ``null`` lifts them."""
        try:
            data = await self._read_json(request)
            self.limits = None if data is None else MockLimits.from_dict(data)
        except (ActionError, ValueError) as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    async def _h_limits_get(self, request: web.Request) -> web.Response:
        """The limits, what they answered, and every request's (time, status)."""
        limits = self.limits
        if limits is None:
            return web.json_response(None)
        return web.json_response({**limits.view(), "log": [[t, s] for t, _, s in limits.log]})

    async def _h_default(self, request: web.Request) -> web.Response:
        try:
            self.set_default(await self._read_json(request))
        except ActionError as exc:
            return web.json_response({"ok": False, "error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    # -- provider endpoints --------------------------------------------------

    async def _h_provider(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if "/v1/responses/" in path and not path.startswith("/_mock/"):
            target = resume_target(path)
            if target is not None and (request.method == "GET") != target[1]:
                return await self._h_background(request, *target)
        protocol = protocol_name_for_path(path)
        if protocol is None or path.startswith("/_mock/"):
            return web.json_response(
                {"error": {"message": f"mock: no route for {path}", "type": "not_found"}},
                status=404,
            )
        if (
            protocol == RESPONSES
            and request.method == "GET"
            and request.headers.get("Upgrade", "").lower() == "websocket"
        ):
            return await self._h_websocket(request)
        if request.method != "POST":
            return web.Response(
                status=405,
                body=status_error_body(protocol, 405),
                content_type=JSON_CONTENT_TYPE,
                headers={"Allow": "POST"},
            )
        body = await request.read()
        key = request.headers.get(KEY_HEADER)
        action: Action | None = None
        problem: str | None = None
        req_json: Any = None
        try:
            req_json = json.loads(body)
            if not isinstance(req_json, dict):
                problem = "request body must be a JSON object"
        except ValueError as exc:
            problem = f"request body is not valid JSON: {exc}"
        gemini_call = parse_gemini_path(path) if protocol == GEMINI else None
        if problem is None and gemini_call is not None and isinstance(req_json, dict):
            model, streamed = gemini_call
            if streamed and request.query.get("alt") != "sse":
                problem = "mock: streamGenerateContent is served with alt=sse only"
            req_json = gemini_request_view(req_json, model, streamed)
        if problem is None:
            raw_action = request.headers.get(ACTION_HEADER)
            try:
                action = (
                    self._header_action(raw_action)
                    if raw_action is not None
                    else self._next_action(key)
                )
            except ActionError as exc:
                problem = str(exc)
        previous: str | None = None
        found: bool | None = None
        if protocol == RESPONSES and isinstance(req_json, dict):
            previous = _previous_id(req_json)
            found = None if previous is None else previous in self._stored
        if self.record:
            self._record(
                RecordedRequest(
                    method=request.method,
                    path=path,
                    query=MultiDict(request.query),
                    headers=CIMultiDict(request.headers),
                    body=body,
                    key=key,
                    protocol=protocol,
                    action=action.raw if action is not None else None,
                    previous_response_id=previous,
                    previous_response_found=found,
                    at=asyncio.get_running_loop().time(),
                )
            )
        if action is None:
            return web.Response(
                status=400,
                body=_mock_error_body(protocol, problem or "invalid request"),
                content_type=JSON_CONTENT_TYPE,
            )
        limits = self.limits
        if limits is not None:
            max_tokens = req_json.get("max_tokens")
            status, rate_headers = limits.charge(
                request.headers,
                max(1, len(canonical_json(req_json)) // 4),
                max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0,
                asyncio.get_running_loop().time(),
            )
            if status == 429:
                return web.Response(
                    status=429,
                    body=status_error_body(protocol, 429),
                    content_type=JSON_CONTENT_TYPE,
                    headers=rate_headers,
                )
            request[_RATE_HEADERS] = rate_headers
        transport = request.transport
        if transport is None:
            return web.Response()
        self._active.add(transport)
        try:
            return await self._respond(
                request, protocol, action, req_json, None if found is not False else previous
            )
        except ConnectionError:
            # The client went away mid-reply; aiohttp handles this quietly.
            return web.Response()
        finally:
            self._active.discard(transport)

    async def _respond(
        self,
        request: web.Request,
        protocol: str,
        action: Action,
        req_json: dict[str, Any],
        unknown_previous: str | None = None,
    ) -> web.StreamResponse:
        if action.delay:
            await asyncio.sleep(action.delay)
        fault = action.fault
        if fault == "close_before_headers":
            _abort(request, action.rst)
            return web.Response()

        reply = Reply(protocol, action, req_json, canonical_json(req_json))
        request_id_header = "request-id" if protocol == ANTHROPIC else "x-request-id"
        headers: CIMultiDict[str] = CIMultiDict()
        error_kind = action.error if fault == "error_event" else None

        if (
            action.body is not None
            or action.is_error_status
            or (error_kind is not None and not reply.stream)
            or fault == "connection_limit"
        ):
            # A complete (usually non-2xx) JSON response.
            if action.body is not None:
                status = action.status or 200
                payload = action.body.encode()
                ctype = (
                    JSON_CONTENT_TYPE
                    if action.body.lstrip()[:1] in ("{", "[")
                    else "text/plain; charset=utf-8"
                )
            elif error_kind is not None:
                status, payload = error_body(protocol, error_kind)
                ctype = JSON_CONTENT_TYPE
            elif fault == "connection_limit":
                status, payload = 400, connection_limit_body(protocol)
                ctype = JSON_CONTENT_TYPE
            else:
                status = action.status or 500
                payload = status_error_body(protocol, status)
                ctype = JSON_CONTENT_TYPE
            headers["Content-Type"] = ctype
            headers[request_id_header] = reply.request_id
            for name, value in action.headers:
                headers[name] = value
            if fault in (None, "error_event", "connection_limit"):
                return web.Response(status=status, body=payload, headers=headers)
            return await self._send_frames(
                request, action, status, headers, halves(payload), stream=False, reply=reply
            )

        if unknown_previous is not None:
            headers["Content-Type"] = JSON_CONTENT_TYPE
            headers[request_id_header] = reply.request_id
            for name, value in action.headers:
                headers[name] = value
            return web.Response(
                status=400, body=previous_not_found_body(unknown_previous), headers=headers
            )

        background = protocol == RESPONSES and req_json.get("background") is True
        if background and (action.refuse_background or req_json.get("store") is False):
            headers["Content-Type"] = JSON_CONTENT_TYPE
            headers[request_id_header] = reply.request_id
            refused = action.refuse_background
            return web.Response(
                status=400,
                body=background_refused_body() if refused else store_required_body(),
                headers=headers,
            )
        rendered = render(reply)
        if background and rendered.stream:
            # It runs on whatever happens to this connection: stored whole first.
            self.background.put(reply.response_id, reply, rendered.frames)
        status = action.status or 200
        if (
            protocol == RESPONSES
            and req_json.get("store") is not False
            and (
                fault in (None, "malformed")
                or (
                    fault in _FRAME_FAULTS
                    and cut_after(reply, action, len(rendered.frames)) >= len(rendered.frames)
                )
            )
        ):
            # The whole reply goes out: remember its id before the client can see it.
            _remember(self._stored, reply.response_id)
        if rendered.stream:
            headers["Content-Type"] = SSE_CONTENT_TYPE
            headers["Cache-Control"] = "no-cache"
        else:
            headers["Content-Type"] = JSON_CONTENT_TYPE
        headers[request_id_header] = rendered.request_id
        for name, value in action.headers:
            headers[name] = value
        if fault is None and not rendered.stream:
            return web.Response(status=status, body=rendered.body, headers=headers)
        return await self._send_frames(
            request,
            action,
            status,
            headers,
            rendered.frames,
            stream=rendered.stream,
            reply=reply,
            chunked_frames=rendered.chunked,
        )

    async def _send_frames(
        self,
        request: web.Request,
        action: Action,
        status: int,
        headers: CIMultiDict[str],
        frames: tuple[bytes, ...],
        *,
        stream: bool,
        reply: Reply,
        chunked_frames: tuple[bytes, ...] | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=status, headers=headers)
        chunked = request.version >= (1, 1)
        if chunked:
            resp.enable_chunked_encoding()
        writer = await resp.prepare(request)  # sends the headers
        transport = request.transport
        assert writer is not None
        if transport is None:
            return resp
        fault = action.fault
        if fault == "reset_after_headers":
            await _flush(request, writer)
            _abort(request, action.rst)
            return resp

        k = len(frames) if fault is None else cut_after(reply, action, len(frames))
        if fault is None and chunked and chunked_frames is not None:
            wire = chunked_frames
        else:
            seq = list(frames[:k])
            if fault == "error_event":
                seq.append(error_frame(reply, action.error, k, action.error_style))
            elif fault == "malformed":
                seq.append(garbage_frame(reply.protocol, stream))
                seq.extend(frames[k:])
            wire = tuple(_chunk(f) for f in seq) if chunked else tuple(seq)
        await _pump(transport, wire, action.chunk_delay)

        if fault in ("reset", "stall"):
            await _flush(request, writer)
            if fault == "stall":
                stopping = self._stopping
                if stopping is not None and not stopping.is_set():
                    try:
                        async with asyncio.timeout(action.seconds):
                            await stopping.wait()
                    except TimeoutError:
                        pass
            _abort(request, action.rst)
            return resp
        await resp.write_eof()
        return resp

    # -- Responses background mode (`mock.background`) ----------------------------

    async def _h_background(
        self, request: web.Request, response_id: str, cancel: bool
    ) -> web.StreamResponse:
        """A background response's resume (``GET``) or cancel (``POST .../cancel``)."""
        key = request.headers.get(KEY_HEADER)
        body = await request.read()
        try:
            raw_action = request.headers.get(ACTION_HEADER)
            if raw_action is not None:
                action = self._header_action(raw_action)
            elif cancel:
                action = parse_action(None)  # a cancel takes no action from the queues
            else:
                action = self._next_action(key)
        except ActionError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        if self.record:
            self._record(
                RecordedRequest(
                    method=request.method,
                    path=request.path,
                    query=MultiDict(request.query),
                    headers=CIMultiDict(request.headers),
                    body=body,
                    key=key,
                    protocol=RESPONSES,
                    action=action.raw,
                    at=asyncio.get_running_loop().time(),
                )
            )
        stored = self.background.get(response_id)
        json_headers = {"Content-Type": JSON_CONTENT_TYPE}
        if cancel:
            self.background.cancels.append(response_id)
            if stored is None:
                return web.Response(
                    status=404, body=not_found_body(response_id), headers=json_headers
                )
            stored.cancelled = True
            return web.Response(status=200, body=cancelled_body(response_id), headers=json_headers)
        if stored is None or action.resume == "not_found":
            return web.Response(status=404, body=not_found_body(response_id), headers=json_headers)
        if action.resume == "bad_request" or request.query.get("stream") != "true":
            return web.Response(
                status=400,
                body=_mock_error_body(RESPONSES, "mock: resume with stream=true only"),
                headers=json_headers,
            )
        try:
            after = int(request.query.get("starting_after", "-1"))
        except ValueError:
            after = -1
        stored.resumes.append(after)
        headers: CIMultiDict[str] = CIMultiDict(
            {"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache"}
        )
        if action.resume == "queued":
            resp = web.StreamResponse(status=200, headers=headers)
            await resp.prepare(request)
            stopping = self._stopping
            if stopping is not None and not stopping.is_set():
                try:
                    async with asyncio.timeout(action.seconds):
                        await stopping.wait()
                except TimeoutError:
                    pass
            _abort(request, action.rst)
            return resp
        frames = resume_frames(stored, after, action)
        transport = request.transport
        if transport is None:
            return web.Response()
        self._active.add(transport)
        try:
            return await self._send_frames(
                request, action, 200, headers, frames, stream=True, reply=stored.reply
            )
        except ConnectionError:
            return web.Response()
        finally:
            self._active.discard(transport)

    # -- Responses WebSocket mode ----------------------------------------------

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
                payload = status_error_body(RESPONSES, upgrade.status)
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
                    body=_mock_error_body(RESPONSES, str(exc)),
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
                body=_mock_error_body(RESPONSES, "invalid WebSocket handshake"),
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
                    protocol=RESPONSES,
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
        reply = Reply(RESPONSES, action, request_json, canonical_json(request_json))
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


def _previous_id(request: Mapping[str, Any]) -> str | None:
    value = request.get("previous_response_id")
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value)


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


def _mock_error_body(protocol: str, message: str) -> bytes:
    if protocol == ANTHROPIC:
        payload: dict[str, Any] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": f"mock: {message}"},
        }
    else:
        payload = {
            "error": {
                "message": f"mock: {message}",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
    return json.dumps(payload, separators=(",", ":")).encode()


def _chunk(frame: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(frame), frame)


async def _pump(transport: asyncio.Transport, frames: tuple[bytes, ...], delay: float) -> None:
    """Write each frame with its own ``transport.write``, ``delay`` seconds apart.

    The delayed case runs as a chain of ``call_later`` callbacks instead of one
    task wake-up per frame, which keeps the per-frame cost low when thousands of
    slow streams run at once. There is no back-pressure: replies are finite and
    already in memory, so at worst the whole rest of a reply sits in the
    transport buffer.
    """
    if not frames:
        return
    if not delay:
        for frame in frames:
            if transport.is_closing():
                raise ConnectionResetError("mock: client went away")
            transport.write(frame)
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    total = len(frames)
    index = 0
    handle: asyncio.TimerHandle | None = None

    def step() -> None:
        nonlocal index, handle
        handle = None
        if done.done():
            return
        if transport.is_closing():
            done.set_exception(ConnectionResetError("mock: client went away"))
            return
        transport.write(frames[index])
        index += 1
        if index < total:
            handle = loop.call_later(delay, step)
        else:
            done.set_result(None)

    step()
    try:
        await done
    finally:
        if handle is not None:
            handle.cancel()
        if not done.done():
            done.cancel()


async def _flush(request: web.Request, writer: AbstractStreamWriter) -> None:
    """Wait until everything written so far has left the user-space buffer."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return
    if transport.get_write_buffer_size():
        # With a zero high-water mark the protocol pauses while anything is
        # buffered, so drain() returns only once the buffer is empty.
        transport.set_write_buffer_limits(high=0, low=0)
        await writer.drain()


def _abort(request: web.Request, rst: bool) -> None:
    """Abort the connection: no more bytes, no chunked terminator."""
    transport = request.transport
    if transport is None:
        return
    if rst:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
    transport.abort()
