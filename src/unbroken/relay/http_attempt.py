"""One upstream HTTP attempt (`HttpAttempt`): open it, tell the machine, read the
body its way, and hand what the machine releases to a `Sink` (the HTTP turn's
client response, or a client WebSocket for the WebSocket transport's fallback)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Protocol as TypingProtocol
from typing import assert_never

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from unbroken.core.admission.policy import Failure, FailureClass, RetryState, parse_retry_after
from unbroken.core.admission.ratehead import parse_rate_headers
from unbroken.core.turn.continuation import Resume
from unbroken.core.turn.machine import (
    Action,
    End,
    FinalInStream,
    GiveUp,
    Open,
    PassThrough,
    ReadErrorBody,
    Stream,
    TurnMachine,
    Wait,
)
from unbroken.core.wire.redact import AnswerRedaction, Redactor, redact
from unbroken.core.wire.sse import Event
from unbroken.relay.errors import classify_exception
from unbroken.relay.relay_state import RelayState
from unbroken.relay.upstream import UpstreamClient, redacted_chunks, response_headers
from unbroken.relay.watchdog import Watchdog

__all__ = ["MAX_ERROR_BODY", "ClientGone", "HttpAttempt", "Sink", "abort_response"]

MAX_ERROR_BODY = 1024 * 1024  # bytes of a retryable error answer kept for pass-through


class ClientGone(Exception):
    """The client went away while we were writing to it."""


def abort_response(resp: aiohttp.ClientResponse) -> None:
    """Abort an upstream response's connection at once (no graceful close).

    The read it cuts fails with an exception of its own, made here: `resp.close()`
    alone hands the waiting read aiohttp's one module-level ``Connection closed``
    instance, and every raise of that one instance prepends its frames to the same
    ``__traceback__``, so each stalled attempt's frames (its turn, request and
    buffers with them) stayed reachable for the life of the process (issue 36)."""
    conn = resp.connection
    transport = conn.transport if conn is not None else None
    if transport is not None:
        transport.abort()
    if resp.content.exception() is None:
        resp.content.set_exception(aiohttp.ClientConnectionError("Connection closed"))
    resp.close()


class Sink(TypingProtocol):
    """Where an HTTP attempt's answer goes: an HTTP response, or a client WebSocket."""

    #: True: released SSE frames are written as bytes, so a run of them may go out in
    #: one piece (`TurnMachine.feed_verbatim`); False: each frame on its own (a WebSocket)
    verbatim: bool

    def answer(self, status: int, headers: CIMultiDict[str]) -> None:
        """The status and headers a streamed or plain answer would be sent with."""

    def keep_answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """A retryable answer, kept in case it is the last one (passed through then)."""

    def release(self, events: Sequence[Event], over: Action | None, now: float) -> Awaitable[None]:
        """SSE frames the machine released at ``now`` (an ``async def`` will do);
        ``over``: the action that ends the attempt, decided by the same feed
        (`core.turn.Fed`)."""

    def release_body(self, data: bytes, now: float) -> Awaitable[None]:
        """Plain body bytes the machine released at ``now``, or SSE bytes (`verbatim`
        sinks)."""


class HttpAttempt:
    """One upstream HTTP attempt: open it, tell the machine, read the body its way.

    Shared by the HTTP transport and the WebSocket transport's HTTP fallback; only
    the `Sink` differs.
    """

    __slots__ = (
        "aborted",
        "client",
        "loop",
        "machine",
        "rate_max_wait_s",
        "reading",
        "relay",
        "retry",
        "secrets",
        "sink",
        "time",
        "watchdog",
    )

    def __init__(
        self,
        machine: TurnMachine,
        retry: RetryState,
        watchdog: Watchdog,
        client: UpstreamClient,
        sink: Sink,
        secrets: tuple[str, ...] = (),
        relay: RelayState | None = None,
    ) -> None:
        self.machine, self.watchdog, self.client, self.sink = machine, watchdog, client, sink
        #: the turn's retry state (the machine's): which upstream and limiter admission
        self.retry = retry
        self.loop = watchdog.loop
        self.time = watchdog.deadlines.time  # the loop's clock (`loop_clock`)
        self.reading: aiohttp.ClientResponse | None = None
        #: the machine had the answer being read aborted (a stall)
        self.aborted = False
        #: the keys and token the relay knows: an error answer that echoes one is redacted
        self.secrets = secrets
        self.relay = relay
        self.rate_max_wait_s = relay.config.ratelimit.max_wait_s if relay is not None else 60.0

    def on_rate_problems(self, problems: Sequence[str]) -> None:
        key = self.retry.current_key()
        if self.relay is not None and key is not None:
            self.relay.limits.problems(key, problems)

    def abort(self) -> None:
        """The machine's `AbortUpstream`: cut the answer being read."""
        if self.reading is not None:
            self.aborted = True
            abort_response(self.reading)

    def close(self) -> None:
        """The turn is over: let go of its sink (no reference cycle outlives the turn)."""
        self.sink = _GONE

    async def run(
        self,
        action: Open | Resume,
        method: str,
        url: URL,
        headers: CIMultiDict[str],
        body: bytes,
        *,
        key: str | None = None,
    ) -> Action:
        """The attempt, up to the machine's next action.  The caller has armed the
        watchdog for whatever is timed while it connects (early headers, keepalives).
        ``key``: the relay's key the request carries, if any: any body the upstream
        answers is redacted of it on its way through (an error's, of every secret)."""
        machine = self.machine
        loop = self.loop
        # The header deadline: what ``asyncio.timeout`` does (cancel the task when it
        # passes; that cancellation, and only it, becomes a TimeoutError), without its
        # context manager's two coroutines and object per attempt, on the loop's shared
        # deadlines (`LoopDeadlines`: no TimerHandle of its own).
        task = asyncio.current_task(loop)
        assert task is not None
        cancelling = task.cancelling()
        deadline = _Deadline(task)
        timers = self.watchdog.deadlines
        timer = timers.call_at(self.time() + action.timeout_s, deadline)
        try:
            resp = await self.client.request(method, url, headers, body)
        except asyncio.CancelledError:
            if deadline.fired and task.uncancel() <= cancelling:
                return machine.open_failed(
                    self.time(), _classify(TimeoutError(), header_phase=True)
                )
            raise
        except Exception as exc:
            if deadline.fired:
                task.uncancel()
            return machine.open_failed(self.time(), _classify(exc, header_phase=True))
        finally:
            timers.cancel(timer)
        if deadline.fired:  # it fired, but the answer came anyway
            task.uncancel()
        self.reading = resp
        self.aborted = False
        try:
            status = resp.status
            retry_after = (
                parse_retry_after(resp.headers, now_wall=time.time()) if status >= 400 else None
            )
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            rate = None
            if self.retry.admitted:  # the provider's rate-limit headers, checked
                rate = parse_rate_headers(
                    resp.headers, now_wall=time.time(), max_wait_s=self.rate_max_wait_s
                )
                if rate.problems:
                    self.on_rate_problems(rate.problems)
            answer = machine.answered(
                self.time(), status, sse=sse, retry_after_s=retry_after, rate=rate
            )
            self.watchdog.arm()
            match answer:
                case Stream():
                    return await self._stream(resp, AnswerRedaction(self.secrets, key))
                case PassThrough():
                    return await self._pass_through(resp, AnswerRedaction(self.secrets, key))
                case ReadErrorBody():
                    return await self._error_body(resp, AnswerRedaction(self.secrets, key))
                case FinalInStream():
                    return await self._error_body(
                        resp, AnswerRedaction(self.secrets, key), final=True
                    )
                case Open() | Resume() | Wait() | End() | GiveUp():
                    return answer  # a 1xx: the machine already decided what follows
                case _:
                    assert_never(answer)
        finally:
            self.reading = None
            resp.close()

    async def _error_body(
        self, resp: aiohttp.ClientResponse, secrets: AnswerRedaction, *, final: bool = False
    ) -> Action:
        """A retryable answer's body (kept, in case it is the last answer), or a final
        answer's after early headers (re-sent in the stream)."""
        machine = self.machine
        try:
            data = await self._read_bounded(resp, secrets.whole)
        except Exception as exc:
            return machine.transport_failed(self.time(), _classify(exc))
        if final:
            rid = resp.headers.get("request-id") or resp.headers.get("x-request-id")
            return machine.final_body(self.time(), resp.status, data, rid)
        headers = response_headers(resp.headers, keep_length=False, secrets=secrets.headers)
        self.sink.keep_answer(resp.status, headers, data)
        return machine.error_body(self.time(), data)

    async def _read_bounded(self, resp: aiohttp.ClientResponse, secrets: tuple[str, ...]) -> bytes:
        chunks: list[bytes] = []
        size = 0
        # (The stall clock of an answer's body is the first-frame one: the whole
        # body within first_frame_timeout_s of the answer.)
        async for chunk in resp.content.iter_any():
            if size < MAX_ERROR_BODY:
                chunks.append(chunk)
            size += len(chunk)
        if self.aborted:  # cut by the machine's stall deadline, not ended by the upstream
            raise TimeoutError("stalled")
        data = b"".join(chunks)[:MAX_ERROR_BODY]
        return redact(data, secrets) if secrets else data

    async def _stream(self, resp: aiohttp.ClientResponse, secrets: AnswerRedaction) -> Action:
        """Read an SSE body through the machine; release what it releases.  What
        ``secrets`` says the body is redacted of (the relay's key the request carried)
        is redacted before the machine sees it (across chunk boundaries)."""
        machine = self.machine
        sink = self.sink
        headers = response_headers(resp.headers, keep_length=False, secrets=secrets.headers)
        sink.answer(resp.status, headers)
        verbatim = sink.verbatim
        feed_verbatim, feed = machine.feed_verbatim, machine.feed_chunk
        loop_time = self.time
        release, write = sink.release, sink.release_body
        rearm_on_first_frame = True
        chunks: AsyncIterator[bytes] = resp.content.iter_any()
        redacted = secrets.body(resp.status)
        if redacted:
            chunks = redacted_chunks(chunks, Redactor(redacted))
        try:
            async for chunk in chunks:
                now = loop_time()
                if verbatim:
                    data, over = feed_verbatim(now, chunk)
                    if data is None:  # released whole: plain output, the attempt goes on
                        await write(chunk, now)
                        continue
                    pending = write(data, now) if data else None
                else:
                    out, over = feed(now, chunk)
                    pending = release(out, over, now) if out else None
                if rearm_on_first_frame and machine.first_frame:
                    rearm_on_first_frame = False
                    self.watchdog.arm()  # the stall deadline moved to idle_timeout_s
                if pending is not None:
                    await pending
                if over is not None:
                    return over
        except ClientGone:
            raise
        except Exception as exc:
            return machine.transport_failed(loop_time(), _classify(exc))
        return machine.body_ended(loop_time())

    async def _pass_through(self, resp: aiohttp.ClientResponse, secrets: AnswerRedaction) -> Action:
        """Forward a non-SSE body as it arrives; the first byte out commits."""
        machine = self.machine
        # A body ``secrets`` says may echo a secret is redacted on its way through (the
        # length may change, so it goes out chunked).  Other bodies pass as they are.
        redacted = secrets.body(resp.status)
        redactor = Redactor(redacted) if redacted else None
        keep_length = "content-length" in resp.headers and redactor is None
        headers = response_headers(resp.headers, keep_length=keep_length, secrets=secrets.headers)
        self.sink.answer(resp.status, headers)
        loop_time = self.time
        try:
            async for chunk in resp.content.iter_any():
                if redactor is not None:
                    chunk = redactor.feed(chunk)
                    if not chunk:
                        continue
                now = loop_time()
                out, over = machine.feed_body(now, chunk)
                if out:
                    await self.sink.release_body(out, now)
                if over is not None:
                    return over
            if redactor is not None:
                tail = redactor.flush()
                now = loop_time()
                if tail and machine.feed_body(now, tail).released:
                    await self.sink.release_body(tail, now)
        except ClientGone:
            raise
        except Exception as exc:
            return machine.transport_failed(loop_time(), _classify(exc))
        return machine.body_ended(loop_time())


class _Deadline:
    """The header deadline's timer callback: cancels the attempt's task, and says so."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel()


class _Gone:
    """The sink of a closed attempt: nothing goes anywhere."""

    verbatim = True

    def answer(self, status: int, headers: CIMultiDict[str]) -> None:
        pass

    def keep_answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        pass

    async def release(self, events: Sequence[Event], over: Action | None, now: float) -> None:
        pass

    async def release_body(self, data: bytes, now: float) -> None:
        pass


_GONE = _Gone()


def _classify(exc: BaseException, *, header_phase: bool = False) -> Failure:
    if (
        header_phase
        and isinstance(exc, TimeoutError)
        and not isinstance(exc, aiohttp.ServerTimeoutError)
    ):
        return Failure(_FAILURE_HEADER_TIMEOUT, "no response headers within the timeout")
    failure = classify_exception(exc)
    if failure is None:
        raise exc
    return failure


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_FAILURE_HEADER_TIMEOUT = FailureClass.HEADER_TIMEOUT
