"""Client connections, bounded: header-read timeout, keep-alive, a connection cap.

aiohttp reads request headers with no deadline and keeps a silent connection
for an hour; a few hundred silent TCP connections (slowloris) then exhaust the
file descriptors, and every failed ``accept()`` logs a traceback.  Here:

* a request's headers must arrive within ``header_read_timeout_s`` of its first
  byte (of the connection's start, for the first request), else the
  connection is closed (by one sweep timer per server, at most a quarter of the
  timeout, and at most a second, late: a request arms no timer of its own);
* an idle keep-alive connection is closed after ``keepalive_timeout_s``
  (aiohttp's own timer, configured);
* at most ``max_connections`` client connections are served at once (the
  open-file soft limit is raised to fit them when the hard limit allows; fewer
  if it does not: each turn needs a client and an upstream socket); a
  connection beyond gets an immediate ``503`` and is closed;
* ``accept()`` running out of resources is logged once a minute, one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from unbroken.core.admission.shared import LOG_EVERY_S
from unbroken.relay.watchdog import loop_clock

__all__ = [
    "ConnectionStats",
    "GuardedHandler",
    "GuardedServer",
    "effective_max_connections",
    "install_accept_log_limiter",
]

log = logging.getLogger("unbroken")

#: File descriptors kept for everything but client turns (listeners, journal, epoll...).
FD_RESERVE = 64
_BUSY_BODY = (
    b'{"error": {"message": "unbroken: too many connections, retry shortly", '
    b'"type": "server_busy", "code": "too_many_connections"}}'
)
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY
)


@dataclass
class ConnectionStats:
    """Counters of one server, for /status and the tests."""

    max_connections: int = 0
    refused_busy: int = 0  # connections answered 503 because the cap was reached
    header_timeouts: int = 0  # connections closed: headers not complete in time
    _last_busy_log: float = float("-inf")


def effective_max_connections(configured: int) -> tuple[int, int | None]:
    """(the cap to use, the open-file soft limit when it lowered the cap, else None).

    Each client connection may need an upstream socket too, so the cap needs
    about two descriptors per connection plus `FD_RESERVE`.  A soft limit below
    that is first raised toward the hard limit (allowed without privileges;
    1024 is a common soft default); only what still does not fit lowers the cap.
    """
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - not on this platform
        return configured, None
    needed = 2 * configured + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
    if soft == resource.RLIM_INFINITY:
        return configured, None
    fit = max(1, (soft - FD_RESERVE) // 2)
    if fit < configured:
        return fit, soft
    return configured, None


class GuardedHandler(RequestHandler):
    """aiohttp's protocol, plus a deadline for a request's headers.

    The deadline is a timestamp; the server's one sweep timer enforces it (see
    `GuardedServer`), so a request costs no timer of its own.
    """

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        #: when this connection's pending headers are due (0.0: none pending)
        self.header_deadline = 0.0
        self._in_request = False

    def header_timeout(self) -> None:
        """The headers did not arrive in time: close the connection."""
        self.header_deadline = 0.0
        self._guard.stats.header_timeouts += 1
        transport = self.transport
        if transport is not None:
            transport.close()  # connection_lost follows: aiohttp tidies up

    def request_started(self) -> None:
        """The handler began: the headers were complete in time."""
        self._in_request = True
        self.header_deadline = 0.0

    def request_finished(self) -> None:
        self._in_request = False

    # -- protocol events --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.header_deadline = self._guard.header_due()

    def data_received(self, data: bytes) -> None:
        if not self._in_request and not self.header_deadline:
            # the first byte of the next request on a kept-alive connection
            self.header_deadline = self._guard.header_due()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.header_deadline = 0.0
        super().connection_lost(exc)


class _Busy(asyncio.Protocol):
    """A connection beyond the cap: a 503 at once, then close.

    It reads (and drops) what the client sends for a moment, so that closing
    does not reset the connection before the client has read the answer.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(BUSY_RESPONSE)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = self._loop.call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        if self._transport is not None:
            self._transport.close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class GuardedServer(web.Server):
    """aiohttp's low-level server with `GuardedHandler` connections and a cap."""

    def __init__(
        self,
        handler: Any,
        *,
        header_read_timeout_s: float,
        max_connections: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self.loop: asyncio.AbstractEventLoop = self._loop
        self._time = loop_clock(self.loop)  # ``loop.time``, without a Python call
        self.header_read_timeout_s = header_read_timeout_s
        #: how often the sweep looks for late headers: a connection is closed at most
        #: this long after its deadline
        self.sweep_s = min(1.0, header_read_timeout_s / 4)
        self.stats = ConnectionStats(max_connections=max_connections)
        self._changed = asyncio.Event()
        self._sweep: asyncio.TimerHandle | None = None

    # -- the header deadline: one timer per server, not one per request ------------------
    def header_due(self) -> float:
        """The deadline of headers starting now; makes sure the sweep runs."""
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.sweep_s, self._sweep_headers)
        return self._time() + self.header_read_timeout_s

    def _sweep_headers(self) -> None:
        """Close the connections whose headers are late; again while any are pending."""
        self._sweep = None
        now = self.loop.time()
        pending = False
        for handler in list(self._connections):
            if not isinstance(handler, GuardedHandler) or not handler.header_deadline:
                continue
            if now >= handler.header_deadline:
                handler.header_timeout()
            else:
                pending = True
        if pending:
            self._sweep = self.loop.call_later(self.sweep_s, self._sweep_headers)

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def wait_connections(self, predicate: Callable[[int], bool]) -> int:
        """Until ``predicate(connection count)`` holds (tests, leak checks); the count."""
        while not predicate(len(self._connections)):
            self._changed.clear()
            await self._changed.wait()
        return len(self._connections)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._changed.set()

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        # aiohttp forgets the connection once its handler task is done
        task = handler._task_handler
        if task is not None and not task.done():
            task.add_done_callback(lambda _: self._changed.set())
        else:
            self._changed.set()

    def __call__(self) -> Any:
        stats = self.stats
        if len(self._connections) >= stats.max_connections:
            stats.refused_busy += 1
            now = self.loop.time()
            if now - stats._last_busy_log >= LOG_EVERY_S:
                stats._last_busy_log = now
                log.warning(
                    "connection limit reached (%d open): new connections get 503 "
                    "([server] max_connections; %d refused so far)",
                    len(self._connections),
                    stats.refused_busy,
                )
            return _Busy(self.loop)
        return GuardedHandler(self, loop=self.loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server is a `GuardedServer`."""

    def __init__(
        self,
        app: web.Application,
        *,
        header_read_timeout_s: float,
        max_connections: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._guard_args = {
            "header_read_timeout_s": header_read_timeout_s,
            "max_connections": max_connections,
        }

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        return GuardedServer(
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **self._guard_args,  # type: ignore[arg-type]
            **plain._kwargs,
        )


class _AcceptLogLimiter:
    """The loop's exception handler: ``accept()`` failures once a minute, the rest to
    the handler it replaced."""

    def __init__(self, previous: Callable[..., object] | None) -> None:
        self.previous = previous
        self.last = float("-inf")
        self.since = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "accept()" in message and "out of system resource" in message:
            self.since += 1
            now = loop.time()
            if now - self.last >= LOG_EVERY_S:
                exc = context.get("exception")
                reason = getattr(exc, "strerror", None) or type(exc).__name__
                log.error(
                    "accept() failed: out of system resources (%s); new connections wait. "
                    "%d such failure(s) since the last report; reported once a minute",
                    reason,
                    self.since,
                )
                self.last, self.since = now, 0
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def install_accept_log_limiter(loop: asyncio.AbstractEventLoop) -> None:
    """Log ``accept()`` resource exhaustion once a minute, one line, no traceback.

    asyncio reports every failed ``accept()`` (EMFILE, ENFILE, ENOBUFS, ENOMEM)
    through the loop's exception handler, with a traceback; under a connection
    flood that is thousands of lines.  Other reports go to the previous handler.
    """
    previous = loop.get_exception_handler()
    if isinstance(previous, _AcceptLogLimiter):
        return  # installed on this loop already
    handler = _AcceptLogLimiter(previous)
    with contextlib.suppress(RuntimeError):
        loop.set_exception_handler(handler)
