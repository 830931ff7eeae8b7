"""One client turn: attempts over a route's upstreams, streamed through the ledger.

This is the I/O shell around the sans-IO core.  It opens upstream requests,
feeds every SSE frame to the `Ledger`, writes what the ledger releases, and
does what the ledger's verdict says (continue, replay, end with an error).  It
makes no replay decision of its own: `policy` says when and where to retry,
the ledger says whether a retry is still allowed.

Non-SSE bodies (JSON answers, files) are forwarded as they arrive: status and
headers go out with the first body byte, so a failure before it is retried; a
failure after it aborts the client connection, so it can never look like a
complete answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from unbroken.config import Config, Route, Upstream
from unbroken.core.ledger import MALFORMED, Hold, Ledger, State, Verdict
from unbroken.core.policy import (
    Failure,
    FailureClass,
    RetryState,
    classify_exception,
    is_retryable_status,
    parse_retry_after,
)
from unbroken.core.protocols import BODY, Protocol, protocol_for_path, usage_from
from unbroken.core.protocols.base import loads_object
from unbroken.core.sse import Event, SSESplitter
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnInfo
from unbroken.relay.upstream import (
    UpstreamClient,
    body_for,
    request_headers,
    response_headers,
    upstream_url,
)

__all__ = ["ClientGone", "Relay"]

KEEPALIVE = b": keepalive\n\n"
NO_HOLD = Hold(())
MAX_ERROR_BODY = 1024 * 1024  # bytes of a retryable error answer kept for pass-through
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class AttemptLog:
    """The attempt records of one turn (HTTP or WebSocket): begin, end, report."""

    __slots__ = ("_mark", "current", "hooks", "info")

    def __init__(self, info: TurnInfo, hooks: Hooks) -> None:
        self.info, self.hooks = info, hooks
        self.current: AttemptInfo | None = None
        self._mark = (0, 0, 0.0)  # the ledger's cumulative release counters at the start

    def begin(self, number: int, upstream: str, ledger: Ledger | None) -> None:
        self.current = AttemptInfo(number=number, upstream=upstream)
        self.info.attempt_log.append(self.current)
        if ledger is not None:
            self._mark = (ledger.released_frames, ledger.released_bytes, ledger.hold_seconds)
        self.hooks.attempt_started(self.info, upstream)

    def end(
        self,
        reason: str,
        phase: str,
        *,
        status: int | None,
        ledger: Ledger | None,
    ) -> None:
        """Fill in the current attempt's record from the ledger (if it streamed) and report."""
        a = self.current
        if a is None or a.ended is not None:
            return
        a.ended = time.time()
        a.reason, a.phase = reason, phase
        if status is not None:
            a.status = status
        if ledger is not None:
            frames0, bytes0, hold0 = self._mark
            a.frames_received, a.bytes_received = ledger.received_frames, ledger.received_bytes
            a.frames_released = ledger.released_frames - frames0
            a.bytes_released = ledger.released_bytes - bytes0
            a.hold_seconds = ledger.hold_seconds - hold0
            a.input_tokens, a.output_tokens = usage_from([ledger.first_raw, *ledger.recent])
            a.est_output_tokens = ledger.output_frames
        self.hooks.attempt_ended(self.info, a)

    def failed(
        self,
        failure: Failure,
        phase: str,
        retry: RetryState,
        now: float,
        *,
        status: int | None,
        ledger: Ledger | None,
    ) -> float | None:
        """An attempt failed before commit: record it; return the wait, or None to give up."""
        info = self.info
        upstream = self.current.upstream if self.current is not None else info.upstream
        self.end(failure.label, phase, status=status, ledger=ledger)
        info.last_failure = failure.label
        if retry.exhausted():
            self.hooks.attempt_failed(info, upstream, failure, phase=phase, wait_s=None)
            return None
        wait = retry.record_failure(failure, now)
        info.next_retry_at = time.time() + wait
        info.state = "waiting"
        self.hooks.attempt_failed(info, upstream, failure, phase=phase, wait_s=wait)
        return wait

    def open(self, inflight: set[TurnInfo]) -> None:
        """The turn starts: it is in flight."""
        inflight.add(self.info)
        self.hooks.turn_started(self.info)

    def close(
        self, inflight: set[TurnInfo], *, phase: str, status: int | None, ledger: Ledger | None
    ) -> None:
        """The turn ends: settle its outcome and its last attempt, and report it.

        ``phase`` labels a last attempt still open when the turn did not end ok.
        """
        info = self.info
        if info.outcome is None:
            info.outcome = "aborted_by_client"
        ok = info.outcome in ("ok", "recovered")
        self.end("ok" if ok else info.outcome, "" if ok else phase, status=status, ledger=ledger)
        inflight.discard(info)
        info.state = "done"
        info.ended = time.time()
        info.ledger = None
        self.hooks.turn_ended(info)


class ClientGone(Exception):
    """The client went away while we were writing to it."""


class Relay:
    """Shared state of the relay: config, outbound client, hooks."""

    def __init__(
        self,
        config: Config,
        *,
        hooks: Hooks | None = None,
        client: UpstreamClient | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.hooks = hooks or Hooks()
        self.client = client or UpstreamClient(connect_timeout_s=config.stream.connect_timeout_s)
        self.rng = rng or random.Random()
        self.hold = Hold(config.stream.hold)
        self.inflight: set[TurnInfo] = set()
        #: the tasks running client requests (turns, WebSocket connections): cancelled
        #: when the grace period of a shutdown runs out
        self.tasks: set[asyncio.Task[Any]] = set()
        self.idle = asyncio.Event()  # set while no request is running
        self.idle.set()
        #: route -> upstream index -> monotonic time until which it asked to be left alone
        self.cooloffs: dict[str, dict[int, float]] = {}

    async def handle(
        self, request: web.Request, route: Route, rest: str, body: bytes
    ) -> web.StreamResponse:
        with self.running():
            return await _Turn(self, request, route, rest, body).run()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Track the current task as a running client request."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self.tasks.add(task)
        self.idle.clear()
        try:
            yield
        finally:
            self.tasks.discard(task)
            if not self.tasks:
                self.idle.set()

    async def drain(self, grace_s: float) -> int:
        """Wait up to ``grace_s`` for running requests; cancel the rest.  Returns that count."""
        try:
            await asyncio.wait_for(self.idle.wait(), grace_s)
            return 0
        except TimeoutError:
            pass
        left = list(self.tasks)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return len(left)

    async def close(self) -> None:
        await self.client.close()


class _Turn:
    """The attempts of one client request."""

    __slots__ = (
        "_bodies",
        "_closed",
        "_prepare_lock",
        "_side_task",
        "_timer",
        "attempt_ledger",
        "attempts",
        "body",
        "cfg",
        "failure",
        "info",
        "last_answer",
        "last_rx",
        "last_tx",
        "ledger",
        "loop",
        "parsed",
        "pending_headers",
        "protocol",
        "reading",
        "relay",
        "request",
        "response",
        "rest",
        "retry",
        "route",
        "rx_started",
        "stalled",
        "status",
        "stream",
        "t0",
    )

    def __init__(
        self, relay: Relay, request: web.Request, route: Route, rest: str, body: bytes
    ) -> None:
        self.relay = relay
        self.cfg = relay.config
        self.request = request
        self.route = route
        self.rest = rest
        self.body = body
        self.protocol: Protocol = protocol_for_path(rest)
        ctype = request.headers.get("content-type", "")
        parsed = loads_object(body) if "json" in ctype else None
        if parsed is not None:
            self.stream = parsed.get("stream") is True
        else:
            self.stream = "text/event-stream" in request.headers.get("accept", "")
        # Keep the parsed body only if an upstream renames models: a late-session
        # agent body is hundreds of KiB, and its parsed form is larger still.
        self.parsed = parsed if any(u.models for u in route.upstreams) else None
        self.info = TurnInfo(
            route=route.name,
            path=rest,
            protocol=self.protocol.name,
            stream=self.stream,
            session_id=request.headers.get("x-session-id")
            or request.headers.get("x-session-affinity"),
        )
        self.retry = RetryState(
            relay.config.retry,
            len(route.upstreams),
            rng=relay.rng,
            cooloff_until=relay.cooloffs.setdefault(route.name, {}),  # shared by all turns
        )
        self.ledger: Ledger | None = None
        self.response: web.StreamResponse | None = None  # the client response, once prepared
        self._prepare_lock = asyncio.Lock()
        self.pending_headers: tuple[int, CIMultiDict[str]] | None = None
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.last_tx = self.t0
        self.last_rx = self.t0
        self.rx_started = False  # a body byte of the current attempt arrived
        self.reading: aiohttp.ClientResponse | None = None  # attempt being read (for stalls)
        self.stalled = False
        self.failure: Failure | None = None
        self.last_answer: tuple[int, CIMultiDict[str], bytes] | None = None
        self._bodies: dict[int, bytes] = {}
        self.attempts = AttemptLog(self.info, relay.hooks)
        self.status: int | None = None  # the current attempt's upstream status
        self.attempt_ledger: Ledger | None = None  # the ledger this attempt's body went through
        self._timer: asyncio.TimerHandle | None = None
        self._side_task: asyncio.Future[Any] | None = None  # an early-headers/keepalive write
        self._closed = False

    # -- the loop ------------------------------------------------------------------
    async def run(self) -> web.StreamResponse:
        self.attempts.open(self.relay.inflight)
        self._tick()
        try:
            return await self._attempts()
        except asyncio.CancelledError:
            self.info.outcome = "aborted_by_client"
            await self._cancelled()
            raise
        except ClientGone:
            self.info.outcome = "aborted_by_client"
            raise
        finally:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._side_task is not None:
                self._side_task.cancel()
            self.attempts.close(
                self.relay.inflight,
                phase="committed",
                status=self.status,
                ledger=self.attempt_ledger,
            )

    async def _attempts(self) -> web.StreamResponse:
        route, retry = self.route, self.retry
        while True:
            if retry.exhausted():
                return await self._give_up()
            idx = retry.next_upstream(self.loop.time())
            up = route.upstreams[idx]
            self.info.attempts = retry.attempts
            self.info.upstream = up.name
            self.info.next_retry_at = None
            self.info.state = "waiting"
            self._begin_attempt(up)
            self.failure = None
            self.status = None
            try:
                resp = await self._open(up)
            except Exception as exc:
                failure = self._classify(exc, header_phase=True)
                phase = "headers" if failure.cls is FailureClass.HEADER_TIMEOUT else "connect"
                await self._after_failure(failure, phase)
                continue
            try:
                result = await self._answer(resp)
            finally:
                self.reading = None
                resp.close()
            if result is not None:
                return result
            assert self.failure is not None
            phase = "stall" if self.failure.cls is FailureClass.STALL else (
                "headers" if self.failure.cls is FailureClass.STATUS else "pending"
            )
            await self._after_failure(self.failure, phase)

    async def _open(self, up: Upstream) -> aiohttp.ClientResponse:
        req = self.request
        body = self._bodies.get(id(up))
        if body is None:
            body = self._bodies[id(up)] = body_for(self.body, self.parsed, up)
        headers = request_headers(
            req.headers, up, anthropic=self.protocol.anthropic_errors
        )
        url = upstream_url(up, self.rest, req.query_string)
        s = self.cfg.stream
        # A non-streamed answer arrives only once generated: allow it the first-frame time.
        timeout = s.header_timeout_s if self.stream else max(
            s.header_timeout_s, s.first_frame_timeout_s
        )
        async with asyncio.timeout(timeout):
            return await self.relay.client.request(req.method, url, headers, body)

    def _classify(self, exc: BaseException, *, header_phase: bool = False) -> Failure:
        if self.stalled:
            self.stalled = False
            return Failure(FailureClass.STALL, "stall: no bytes within the timeout")
        if header_phase and isinstance(exc, TimeoutError) and not isinstance(
            exc, aiohttp.ServerTimeoutError
        ):
            return Failure(FailureClass.HEADER_TIMEOUT, "no response headers within the timeout")
        failure = classify_exception(exc)
        if failure is None:
            raise exc
        return failure

    def _begin_attempt(self, up: Upstream) -> None:
        self.attempt_ledger = None
        self.attempts.begin(self.retry.attempts, up.name, self.ledger)

    def _end_attempt(self, reason: str, phase: str) -> None:
        self.attempts.end(
            reason,
            phase,
            status=self.status,
            ledger=self.attempt_ledger,
        )

    async def _after_failure(self, failure: Failure, phase: str) -> None:
        self.failure = failure
        wait = self.attempts.failed(
            failure,
            phase,
            self.retry,
            self.loop.time(),
            status=self.status,
            ledger=self.attempt_ledger,
        )
        if wait:
            await asyncio.sleep(wait)

    async def _give_up(self) -> web.StreamResponse:
        failure = self.failure
        reason = failure.reason if failure else "retries exhausted"
        if self.response is not None:
            # Headers are out (early headers): the client gets the native error event.
            ledger = self.ledger or Ledger(self.protocol, hold=self.relay.hold)
            out = ledger.give_up(f"retries exhausted ({reason})")
            await self._write(out)
            self.info.outcome = "ended_with_error"
            return await self._finish()
        if self.last_answer is not None and failure is not None and failure.status is not None:
            status, headers, body = self.last_answer
            self.info.outcome = "passed_through_error"
            return web.Response(status=status, headers=headers, body=body)
        self.info.outcome = "passed_through_error"
        return web.Response(
            status=502,
            body=self.protocol.error_body(f"unbroken: all upstream attempts failed ({reason})"),
            content_type="application/json",
        )

    # -- one answer ----------------------------------------------------------------
    async def _answer(self, resp: aiohttp.ClientResponse) -> web.StreamResponse | None:
        """Handle one upstream response.  None means: failed, ``self.failure`` says why."""
        status = self.status = resp.status
        if is_retryable_status(status):
            try:
                body = await self._read_error_body(resp)
            except Exception as exc:
                self.failure = self._classify(exc)
                return None
            self.last_answer = (status, response_headers(resp.headers, keep_length=False), body)
            self.failure = Failure(
                FailureClass.STATUS,
                f"HTTP {status}",
                status=status,
                retry_after_s=parse_retry_after(resp.headers, now_wall=time.time()),
            )
            return None
        ctype = resp.headers.get("content-type", "")
        if status < 300 and ctype.startswith("text/event-stream"):
            return await self._stream_sse(resp)
        if self.response is not None:
            # Early SSE headers are out: a final error must be an in-stream event.
            return await self._error_after_early_headers(resp)
        return await self._pass_through(resp)

    async def _read_error_body(self, resp: aiohttp.ClientResponse) -> bytes:
        self._start_reading(resp)
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_any():
            self.last_rx = self.loop.time()
            if size < MAX_ERROR_BODY:
                chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)[:MAX_ERROR_BODY]

    def _start_reading(self, resp: aiohttp.ClientResponse) -> None:
        self.reading = resp
        self.rx_started = False
        self.last_rx = self.loop.time()
        self._rearm()

    async def _pass_through(self, resp: aiohttp.ClientResponse) -> web.StreamResponse | None:
        """Forward a non-SSE body as it arrives; the ledger gates replay on the first byte."""
        self._start_reading(resp)
        keep_length = "content-length" in resp.headers
        headers = response_headers(resp.headers, keep_length=keep_length)
        self.pending_headers = (resp.status, headers)
        # Every chunk is one frame, released at once: the first byte out commits.
        ledger = self.attempt_ledger = Ledger(BODY, hold=NO_HOLD)
        failure: Failure | None = None
        try:
            async for chunk in resp.content.iter_any():
                self.last_rx = self.loop.time()
                self.rx_started = True
                await self._write(ledger.feed(Event(chunk, None, "")))
                self.info.state = "streaming"
        except ClientGone:
            raise
        except Exception as exc:
            failure = self._classify(exc)
        if failure is None and self.stalled:
            failure = self._classify(TimeoutError())
        if failure is None:
            ledger.ended()
            self.info.outcome = self._ok_outcome() if resp.status < 400 else "passed_through_error"
            return await self._finish()
        ledger.failed(failure.reason)
        if ledger.verdict is Verdict.REPLAY:
            self.failure = failure
            return None
        # Bytes are out: never let a cut body look complete.
        self._committed_failure(failure)
        return self._abort_client()

    async def _error_after_early_headers(self, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        body = await self._read_error_body(resp)
        await self._write(self.protocol.final_error_frame(resp.status, body))
        self.info.outcome = "passed_through_error"
        return await self._finish()

    async def _stream_sse(self, resp: aiohttp.ClientResponse) -> web.StreamResponse | None:
        ledger = self.ledger
        if ledger is None:
            ledger = self.ledger = Ledger(
                self.protocol,
                hold=self.relay.hold,
                max_hold_bytes=self.cfg.stream.max_hold_bytes,
                clock=self.loop.time,
            )
        else:
            ledger.start_attempt()
        self.pending_headers = (resp.status, response_headers(resp.headers, keep_length=False))
        self._start_reading(resp)
        self.attempt_ledger = ledger
        info = self.info
        info.ledger = ledger
        info.state = "holding" if ledger.state is State.PENDING else "streaming"
        splitter = SSESplitter()
        feed = ledger.feed
        loop_time = self.loop.time
        overflow_reported = False
        try:
            async for chunk in resp.content.iter_any():
                self.last_rx = loop_time()
                self.rx_started = True
                events = splitter.feed(chunk)
                if not events:
                    continue
                out: list[bytes] = []
                for event in events:
                    released = feed(event)
                    if released:
                        out.append(released)
                    if ledger.verdict is Verdict.REPLAY or ledger.verdict is Verdict.FAIL:
                        break
                if out:
                    await self._write(b"".join(out) if len(out) > 1 else out[0])
                    info.state = "streaming"
                if ledger.hold_overflowed and not overflow_reported:
                    overflow_reported = True
                    self.relay.hooks.hold_overflow(info, ledger.max_hold_bytes)
                verdict = ledger.verdict
                if verdict is Verdict.REPLAY:
                    self.failure = Failure(
                        FailureClass.MALFORMED
                        if ledger.fail_reason == MALFORMED
                        else FailureClass.STREAM_ERROR,
                        ledger.fail_reason,
                    )
                    return None
                if verdict is Verdict.FAIL:
                    return await self._ended_with_error(ledger)
        except ClientGone:
            raise
        except Exception as exc:
            failure = self._classify(exc)
            out_bytes = ledger.failed(failure.reason)
            return await self._after_stream_failure(ledger, failure, out_bytes)
        if self.stalled:
            failure = self._classify(TimeoutError())
            out_bytes = ledger.failed(failure.reason)
            return await self._after_stream_failure(ledger, failure, out_bytes)
        out_bytes = ledger.ended(splitter.pending)
        if ledger.verdict is Verdict.DONE:
            info.outcome = self._ok_outcome()
            return await self._finish()
        failure = Failure(FailureClass.TRUNCATED, "stream ended without a terminal frame")
        return await self._after_stream_failure(ledger, failure, out_bytes)

    async def _after_stream_failure(
        self, ledger: Ledger, failure: Failure, out: bytes
    ) -> web.StreamResponse | None:
        verdict = ledger.verdict
        if verdict is Verdict.REPLAY:
            self.failure = failure
            return None
        if verdict is Verdict.DONE:
            self.info.outcome = self._ok_outcome()
            return await self._finish()
        self._committed_failure(failure)
        if out:
            await self._write(out)
        return await self._finish()

    async def _ended_with_error(self, ledger: Ledger) -> web.StreamResponse:
        """FAIL verdict from a frame: the error bytes were already written with the frame."""
        if ledger.passed_through:
            self.info.outcome = "passed_through_error"
        else:
            self._committed_failure(Failure(FailureClass.STREAM_ERROR, ledger.fail_reason))
        return await self._finish()

    def _committed_failure(self, failure: Failure) -> None:
        """The attempt failed after output reached the client: no replay, ever."""
        self.info.outcome = "ended_with_error"
        self.info.last_failure = failure.label
        self._end_attempt(failure.label, "committed")
        self.relay.hooks.attempt_failed(
            self.info, self.info.upstream, failure, phase="committed", wait_s=None
        )

    async def _cancelled(self) -> None:
        """Cancelled (client gone, or shutdown past its grace period).

        If the client is still there and saw output, end its stream with the
        native error, as for any failure after commit, rather than just vanish.
        """
        ledger, response = self.ledger, self.response
        if ledger is None or response is None or ledger.state is not State.COMMITTED:
            return
        transport = self.request.transport
        if transport is None or transport.is_closing():
            return
        out = ledger.failed("the relay is shutting down")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1):
                await response.write(out)
                await response.write_eof()

    def _ok_outcome(self) -> str:
        return "recovered" if self.retry.retries else "ok"

    # -- client side ------------------------------------------------------------------
    async def _prepare(self, status: int, headers: CIMultiDict[str] | dict[str, str]) -> None:
        async with self._prepare_lock:
            if self.response is not None:
                return
            resp = web.StreamResponse(status=status, headers=headers)
            try:
                await resp.prepare(self.request)
            except (ConnectionError, aiohttp.ClientConnectionError) as exc:
                raise ClientGone() from exc
            self.response = resp
            self.info.first_byte_at = time.time()

    async def _write(self, data: bytes) -> None:
        if self.response is None:
            status, headers = self.pending_headers or (200, CIMultiDict(SSE_HEADERS))
            await self._prepare(status, headers)
            assert self.response is not None
        try:
            await self.response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        self.last_tx = self.loop.time()

    async def _finish(self) -> web.StreamResponse:
        if self.response is None:
            status, headers = self.pending_headers or (200, CIMultiDict())
            await self._prepare(status, headers)
            assert self.response is not None
        try:
            await self.response.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError):
            pass
        return self.response

    def _abort_client(self) -> web.StreamResponse:
        """Kill the client connection so a cut body cannot pass for a complete one."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        assert self.response is not None
        return self.response

    # -- timers: early headers, keepalive, stalls ------------------------------------
    def _tick(self) -> None:
        """Timer callback: early headers, keepalives, stalls.  Re-arms itself lazily.

        Activity only stores timestamps; the timer checks them when it fires, so
        a busy stream costs no timer churn.  Writing needs a task, spawned only
        when there is something to write.
        """
        self._timer = None
        if self._closed or self._side_task is not None:
            return
        s = self.cfg.stream
        now = self.loop.time()
        deadlines: list[float] = []
        if self.stream:
            if self.response is None:
                due = self.t0 + s.early_headers_s
                if now >= due and (self.ledger is None or self.ledger.state is State.PENDING):
                    # Retries or held frames have lasted long: send SSE headers now so
                    # the client's header timer does not fire; keepalives follow.
                    self._spawn(self._prepare(200, CIMultiDict(SSE_HEADERS)))
                    return
                deadlines.append(due)
            else:
                due = self.last_tx + s.keepalive_s
                if now >= due:
                    self._spawn(self._write(KEEPALIVE))
                    return
                deadlines.append(due)
        reading = self.reading
        if reading is not None and not self.stalled:
            limit = s.idle_timeout_s if self.rx_started else s.first_frame_timeout_s
            due = self.last_rx + limit
            if now >= due:
                self.stalled = True
                reading.close()  # the reader sees the connection end: a stall
            else:
                deadlines.append(due)
        if deadlines:
            self._timer = self.loop.call_at(min(deadlines), self._tick)

    def _rearm(self) -> None:
        """Re-check the timers now (a new phase began)."""
        if self._timer is not None:
            self._timer.cancel()
        self._tick()

    def _spawn(self, coro: Any) -> None:
        task = self._side_task = asyncio.ensure_future(coro)

        def done(t: asyncio.Future[Any]) -> None:
            self._side_task = None
            if not t.cancelled() and t.exception() is None:
                self.last_tx = self.loop.time()
                self._rearm()

        task.add_done_callback(done)
