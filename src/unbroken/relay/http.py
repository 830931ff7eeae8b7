"""The HTTP transport: one client request, carried out as the turn machine decides.

This module only does I/O.  It opens the upstream request the machine asks for,
hands it the status and the body bytes, writes what the machine releases, runs
the one timer the machine's deadlines ask for, and ends the response the way the
machine says.  Every decision (retry, wait, give up, phase, stall, early headers,
keepalive, replay safety) is `unbroken.core.turn.machine.TurnMachine`'s.

The pieces it runs: `relay.relay_state` (`RelayState`, the state every turn shares),
`relay.http_attempt` (one upstream attempt, shared with the WebSocket transport's
HTTP fallback) and `relay.watchdog` (the turn's one timer)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, assert_never

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from unbroken.config import Route
from unbroken.core.admission.ratelimit import max_output_of
from unbroken.core.turn.continuation import DEFAULT_QUEUED_S, Resume
from unbroken.core.turn.machine import (
    AbortUpstream,
    Action,
    End,
    EndKind,
    FinalInStream,
    GiveUp,
    GiveUpKind,
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
from unbroken.core.wire.client_request import is_streamed, session_keys
from unbroken.core.wire.protocols import GEMINI, Protocol, model_asked, protocol_for_path
from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.sse import Event
from unbroken.observe.hooks import TurnRecord
from unbroken.observe.report import HooksObserver
from unbroken.relay.http_attempt import ClientGone, HttpAttempt
from unbroken.relay.relay_state import RelayState, continuation_headers
from unbroken.relay.upstream import (
    body_for,
    parse_body,
    patched_body,
    raw_query,
    request_headers,
    strip_key_param,
    upstream_url,
)
from unbroken.relay.watchdog import Watchdog

__all__ = ["CleanStream", "handle_http"]

log = logging.getLogger("unbroken")


SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class CleanStream(web.StreamResponse):
    """A streamed answer whose headers hold no ``Access-Control-*`` header: built by
    `response_headers` (which drops the upstream's) or by the relay itself.  The
    server's CORS step trusts that (``clean_of_cors``) and skips its scan of the headers."""

    clean_of_cors = True


class _WithFirstWrite(CleanStream):
    """A streamed response whose status line and headers leave with its first bytes.

    aiohttp sends a `StreamResponse`'s headers at ``prepare()`` in a segment of
    their own; the relay prepares only when it has bytes to write (early headers
    aside), so one send carries both (aiohttp's own `web.Response` does the same).
    """

    _send_headers_immediately = False


class _HttpTurn:
    """The I/O of one client request."""

    verbatim = True  # a Sink that writes released SSE bytes as they are

    __slots__ = (
        "_bodies",
        "_prepared",
        "_preparing",
        "_side_task",
        "body",
        "cfg",
        "last_answer",
        "loop",
        "machine",
        "parsed",
        "pending",
        "profile",
        "protocol",
        "relay",
        "report",
        "request",
        "response",
        "rest",
        "route",
        "time",
        "upstream",
        "watchdog",
    )

    def __init__(
        self,
        relay: RelayState,
        request: web.Request,
        route: Route,
        rest: str,
        body: bytes,
    ) -> None:
        self.relay = relay
        self.cfg = relay.config
        self.request = request
        self.route = route
        self.rest = rest
        self.body = body
        self.protocol: Protocol = protocol_for_path(rest)
        # A gzip body (Claude Code can send one) is decoded as a copy to read it; the
        # bytes forwarded stay the ones received.
        parsed = parse_body(body, request.headers, self.cfg.max_body_bytes)
        query = raw_query(request)
        stream = is_streamed(self.protocol, rest, query, parsed, request.headers)
        names, renames = relay.route_facts(route)
        # Keep the parsed body only if an upstream renames models: a late-session
        # agent body is hundreds of KiB, and its parsed form is larger still.
        self.parsed = parsed if renames else None
        self.profile = relay.profile_for(request.headers)
        session, sticky = session_keys(request.headers, parsed)
        # (by position, in the fields' order: a class called with keywords packs them
        # into a dict, then out again)
        info = TurnRecord(
            route.name,  # route
            rest,  # path
            self.protocol.name,  # protocol
            stream,  # stream
            session,  # session_id
            self.profile.name,  # client
            model_asked(parsed, rest),  # model
        )
        self.report = HooksObserver(info, relay.hooks, names, relay.inflight)
        self.loop = asyncio.get_running_loop()
        deadlines = relay.deadlines(self.loop)
        self.time = clock = deadlines.time  # the loop's clock (`loop_clock`)
        retry = relay.retry_state(
            route,
            sticky,
            creds=relay.limits.creds_for(route, request.headers, query),
            body_bytes=len(body),
            max_output=max_output_of(parsed),
        )
        strategy = relay.continuation_for(
            route, self.protocol, rest, parsed, request.headers, streamed=stream
        )
        self.machine = TurnMachine(
            protocol=self.protocol,
            hold=relay.hold_for(self.profile),
            timers=self.cfg.stream,
            retry=retry,
            stream=stream,
            now=clock(),
            report=self.report,
            clock=clock,
            wall_clock=time.time,
            profile=self.profile,
            continuation=None if isinstance(strategy, enum.Enum) else strategy,
            refusal=strategy if isinstance(strategy, enum.Enum) else None,
            queued_s=self.cfg.stream.resume_queued_s if stream else DEFAULT_QUEUED_S,
        )
        info.held = self.machine.held_bytes
        self.response: web.StreamResponse | None = None  # the client response, once prepared
        # `_prepare`'s lock, without an `asyncio.Lock` per turn: a flag while one call is
        # inside, and a future only for a second call that must wait (early headers)
        self._preparing = False
        self._prepared: asyncio.Future[None] | None = None
        #: the client response the attempt that answered would send, built ahead
        self.pending: CleanStream | None = None
        self.last_answer: tuple[int, CIMultiDict[str], bytes] | None = None
        self._bodies: dict[int, bytes] = {}
        self._side_task: asyncio.Future[Any] | None = None  # an early-headers/keepalive write
        self.watchdog = Watchdog(
            self.loop,
            self.machine,
            self._on_timer,
            relay.min_interval(self.machine),
            deadlines,
        )
        self.upstream = HttpAttempt(
            self.machine, retry, self.watchdog, relay.client, self, relay.secrets, relay
        )

    def _sent(self) -> None:
        self.report.flush()
        self.watchdog.arm()

    # -- the loop ------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        machine = self.machine
        # The observers hear of the turn, and its timer is armed, once its first request
        # is on its way: the task first yields inside that request, after writing it
        # (pooled connection), so neither is on the path to the provider.  Nothing the
        # timer serves is due that soon (early headers count from the turn's start).
        self.report.open(defer=True)
        self.loop.call_soon(self._sent)
        with self.relay.running():
            try:
                action: Action = machine.start(self.time())
                while True:
                    if machine.has_cancels:
                        self._send_cancels()
                    match action:
                        case Open():
                            action = await self._attempt(action)
                        case Resume():
                            action = await self._resume(action)
                        case Wait():
                            self.watchdog.arm()  # keepalives, early headers go on meanwhile
                            await self.relay.waker.wait(action)
                            action = machine.next_attempt(self.time())
                        case End():
                            return await self._end(action)
                        case GiveUp():
                            return await self._give_up(action)
                        case Stream() | PassThrough() | ReadErrorBody() | FinalInStream():
                            # (answers to `answered`, carried out by the attempt)
                            raise TurnError(f"unexpected action {action!r}")
                        case _:
                            assert_never(action)
            except asyncio.CancelledError:
                machine.client_gone()
                await self._cancelled()
                raise
            except ClientGone:
                machine.client_gone()
                log.info("client went away route=%s turn=%d", self.route.name, self.report.info.id)
                return self.response or web.Response(status=499)
            except Exception:
                machine.crashed()
                log.exception("internal error in a turn route=%s", self.route.name)
                if self.response is not None:
                    transport = self.request.transport
                    if transport is not None:
                        transport.abort()
                    return self.response
                return web.Response(
                    status=500,
                    body=self.protocol.error_body(
                        "unbroken: internal error", type_="internal_error"
                    ),
                    content_type="application/json",
                )
            finally:
                if machine.has_cancels:
                    self._send_cancels()
                self.watchdog.close()
                self.upstream.close()
                if self._side_task is not None:
                    self._side_task.cancel()
                self.report.close(machine.outcome or _OUTCOME_ABORTED_BY_CLIENT)

    def _attempt(self, action: Open) -> Awaitable[Action]:
        """The attempt's coroutine (awaited by `run`: no frame of its own)."""
        up = self.route.upstreams[action.upstream]
        req = self.request
        body = self._bodies.get(action.upstream)
        if body is None:
            body = self._bodies[action.upstream] = body_for(
                self.body,
                self.parsed,
                up,
                content_encoding=req.headers.get("content-encoding"),
            )
        query = raw_query(req)
        keyed = False
        if up.api_key is not None:  # the route's key replaces the client's, ?key= too
            query, keyed = strip_key_param(query)
        headers = request_headers(
            req.headers,
            up,
            anthropic=self.protocol.anthropic_errors,
            gemini=keyed or self.protocol is GEMINI,
            token=self.relay.token,
            via=self.relay.via,
        )
        url = upstream_url(up, self.rest, query)
        if action.body_patch:
            body = patched_body(body, action.body_patch)
            self.relay.stored_by_continue(self.route)
        return self.upstream.run(action, req.method, url, headers, body, key=up.api_key)

    def _resume(self, action: Resume) -> Awaitable[Action]:
        """A continuation's request: the machine's method, path and body, with the
        turn's headers (credentials as for any attempt) changed as it says."""
        up = self.route.upstreams[action.upstream]
        headers, query = continuation_headers(
            self.request,
            up,
            action.drop_headers,
            anthropic=self.protocol.anthropic_errors,
            token=self.relay.token,
            via=self.relay.via,
        )
        for name, value in action.set_headers:
            headers[name] = value
        query = "&".join(q for q in (action.query, query) if q)
        url = upstream_url(up, action.path, query)
        body = action.body
        if up.models and body:  # a prefill continuation's body names the client's model
            body = body_for(body, loads_object(body), up)
        return self.upstream.run(action, action.method, url, headers, body, key=up.api_key)

    def _send_cancels(self) -> None:
        self.relay.send_cancels(self.route, self.request, self.machine.take_cancels())

    # -- Sink: where the attempt's output goes ---------------------------------------------
    def answer(self, status: int, headers: CIMultiDict[str]) -> None:
        # Built now, while the first output is awaited, not on its way to the client;
        # it is sent only if this attempt releases something.
        self.pending = _WithFirstWrite(status=status, headers=headers)

    def keep_answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self.last_answer = (status, headers, body)

    def release(self, events: Sequence[Event], over: Action | None, now: float) -> Awaitable[None]:
        # The write's own coroutine, awaited by the caller: no frame of its own per chunk.
        # It follows the read that fed the machine at once: that read's time (``now``)
        # is when the write starts (no second clock read per chunk).
        if len(events) == 1:
            return self._write(events[0].raw, now)
        return self._write(b"".join([e.raw for e in events]), now)

    def release_body(self, data: bytes, now: float) -> Awaitable[None]:
        return self._write(data, now)

    async def _end(self, action: End) -> web.StreamResponse:
        if action.kind is _END_ABORT:
            return self._abort_client()
        if action.data:
            await self._write(action.data)
        return await self._finish()

    async def _give_up(self, action: GiveUp) -> web.StreamResponse:
        if action.kind is _GIVE_UP_IN_STREAM:
            if action.data:
                await self._write(action.data)
            return await self._finish()
        # The relay's own final answer: the SDKs must not add a retry layer on top.
        if action.kind is _GIVE_UP_PASS_THROUGH and self.last_answer is not None:
            status, headers, body = self.last_answer
            headers = CIMultiDict(headers)
            headers["x-should-retry"] = "false"
            return web.Response(status=status, headers=headers, body=body)
        return web.Response(
            status=502,
            body=action.data,
            content_type="application/json",
            headers={"x-should-retry": "false"},
        )

    async def _cancelled(self) -> None:
        """Cancelled (client gone, or shutdown past its grace period).

        If the client is still there and saw output, end its stream with the
        native error, as for any failure after commit, rather than just vanish.
        """
        response = self.response
        if response is None:
            return
        out = self.machine.shutdown_error()
        transport = self.request.transport
        if not out or transport is None or transport.is_closing():
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1):
                await response.write(out)
                await response.write_eof()

    # -- client side ------------------------------------------------------------------
    async def _prepare(self, resp: CleanStream) -> bool:
        """Send ``resp``'s status line and headers, unless a response went out already.
        True when this call sent them.

        A `_WithFirstWrite` response's leave with the bytes written next, in one
        segment; any other's at once (early headers).
        """
        while self._preparing:  # the other one (the turn, or its early headers) is inside
            done = self._prepared
            if done is None:
                done = self._prepared = self.loop.create_future()
            await asyncio.shield(done)  # (a cancelled waiter leaves it to the others)
        if self.response is not None:
            return False
        self._preparing = True
        try:
            await resp.prepare(self.request)
        except (ConnectionError, aiohttp.ClientConnectionError) as exc:
            raise ClientGone() from exc
        finally:
            self._preparing = False
            done = self._prepared
            if done is not None:
                self._prepared = None
                done.set_result(None)
        self.response = resp
        self.machine.headers_sent(self.time())
        self.watchdog.arm()  # keepalives are now due from here
        return True

    async def _write(self, data: bytes, t0: float | None = None) -> None:
        """Write ``data`` to the client.  ``t0``: when the write began, if the caller
        knows (the read it follows); else the clock says."""
        response = self.response
        if response is None:
            await self._prepare(self.pending or _WithFirstWrite(headers=SSE_HEADERS))
            response = self.response
            assert response is not None
        machine = self.machine
        machine.write_started(self.time() if t0 is None else t0)
        try:
            await response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        finally:
            # Also when the write failed: a keepalive's failure (a side task) must not
            # leave the stall clock stopped while the turn still reads the upstream.
            machine.wrote(self.time())
        # A timer that fired during the write found no deadline (none runs while the
        # relay writes) and is not armed: arm it again (free when it is).
        self.watchdog.arm()

    async def _finish(self) -> web.StreamResponse:
        if self.response is None:
            await self._prepare(self.pending or _WithFirstWrite())
            assert self.response is not None
        try:  # (not contextlib.suppress: three calls fewer a turn)
            await self.response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError):
            pass
        return self.response

    def _abort_client(self) -> web.StreamResponse:
        """Kill the client connection so a cut body cannot pass for a complete one."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        return self.response or web.Response(status=502)

    # -- the timer's actions -------------------------------------------------------------
    def _on_timer(self, action: TimerAction) -> None:
        match action:
            case AbortUpstream():
                self.upstream.abort()  # the reader sees the connection end: a stall
            case SendHeaders():
                if self._side_task is None:
                    self._spawn(self._early_headers(action.status))
            case Keepalive():
                if self._side_task is None:
                    self._spawn(self._write(action.data))
            case _:
                assert_never(action)

    async def _early_headers(self, status: int) -> None:
        if await self._prepare(CleanStream(status=status, headers=SSE_HEADERS)):
            # The first keepalive (the client's form: a Gemini client must not get an
            # SSE comment)
            await self._write(self.machine.keepalive_bytes)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._side_task = asyncio.ensure_future(coro)

        def done(t: asyncio.Future[Any]) -> None:
            self._side_task = None
            if not t.cancelled():
                t.exception()  # retrieved: a client gone shows in the main loop
            self.watchdog.arm()

        task.add_done_callback(done)


def handle_http(
    relay: RelayState, request: web.Request, route: Route, rest: str, body: bytes
) -> Awaitable[web.StreamResponse]:
    """The turn of one HTTP request: its coroutine, for the caller to await (no frame of
    its own on every wake-up of the turn)."""
    return _HttpTurn(relay, request, route, rest, body).run()


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_END_ABORT = EndKind.ABORT
_GIVE_UP_IN_STREAM = GiveUpKind.IN_STREAM
_GIVE_UP_PASS_THROUGH = GiveUpKind.PASS_THROUGH
_OUTCOME_ABORTED_BY_CLIENT = Outcome.ABORTED_BY_CLIENT
