"""The mock provider's state: its scripted actions (FIFO queues, header actions, the
default), what it recorded, and the helpers its HTTP mode (`mock.http_mode`) and
WebSocket mode (`mock.ws_mode`) share."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict, MultiDict

from unbroken.mock.actions import (
    Action,
    ActionError,
    expand_actions,
    expand_upgrade_actions,
    parse_action,
)
from unbroken.mock.background_store import (
    BackgroundStore,
)
from unbroken.mock.limits import MockLimits
from unbroken.mock.wire.frames import ANTHROPIC_NAME

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


def _remember(store: dict[str, None], response_id: str) -> None:
    store.pop(response_id, None)
    store[response_id] = None
    if len(store) > _STORE_MAX:
        del store[next(iter(store))]


class MockState:
    """What both modes of `MockProvider` read and change: queues, records, stores."""

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
        #: Responses background mode: the stored streams (`mock.background_store`)
        self.background = BackgroundStore()
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None

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

    async def _h_websocket(self, request: web.Request) -> web.StreamResponse:
        """A WebSocket upgrade: `mock.ws_mode.WebSocketMode` answers it."""
        raise NotImplementedError


def _previous_id(request: Mapping[str, Any]) -> str | None:
    value = request.get("previous_response_id")
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value)


def _mock_error_body(protocol: str, message: str) -> bytes:
    if protocol == ANTHROPIC_NAME:
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
