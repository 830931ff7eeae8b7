"""The HTTP transport: one client request, carried out as the turn machine decides.

This module only does I/O.  It opens the upstream request the machine asks for,
hands it the status and the body bytes, writes what the machine releases, runs
the one timer the machine's deadlines ask for, and ends the response the way the
machine says.  Every decision (retry, wait, give up, phase, stall, early headers,
keepalive, replay safety) is `unbroken.core.turn.TurnMachine`'s.

`Relay` is the state shared by every turn: config, outbound client, hooks,
cool-offs, and the running tasks (for a graceful shutdown).  The WebSocket
transport (`relay.websocket`) uses the same `Relay` and the same machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, assert_never
from typing import Protocol as TypingProtocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from unbroken.config import Config, Route, Upstream
from unbroken.core.background import BackgroundResume, background_patch_applies
from unbroken.core.continuation import AfterCommit, Cancel, ContinuationMemory, Resume, Strategy
from unbroken.core.health import Change, HealthBoard, upstream_key
from unbroken.core.ledger import Hold
from unbroken.core.policy import (
    Failure,
    FailureClass,
    RetryState,
    parse_retry_after,
)
from unbroken.core.prefill_continue import PrefillContinue, prefill_applies
from unbroken.core.profiles import Profile, identify, profile_named
from unbroken.core.protocols import (
    ANTHROPIC,
    CHAT,
    GEMINI,
    RESPONSES,
    Protocol,
    protocol_for_path,
)
from unbroken.core.protocols.base import loads_object
from unbroken.core.protocols.chat_prefix import ChatPrefix
from unbroken.core.protocols.gemini import is_stream_path
from unbroken.core.ratehead import parse_rate_headers
from unbroken.core.ratelimit import max_output_of
from unbroken.core.shared import SharedBounds
from unbroken.core.sse import Event
from unbroken.core.turn import (
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
from unbroken.observe.hooks import AttemptInfo, Hooks, MultiHooks, TurnInfo
from unbroken.observe.report import TurnReporter
from unbroken.relay.errors import classify_exception
from unbroken.relay.pacing import RateLimitIO, Waker
from unbroken.relay.store import HealthStore, make_store
from unbroken.relay.upstream import (
    Redactor,
    UpstreamClient,
    body_for,
    parse_body,
    patched_body,
    raw_query,
    redact,
    redacted_chunks,
    request_headers,
    response_headers,
    strip_key_param,
    upstream_url,
)

__all__ = [
    "ClientGone",
    "HttpAttempt",
    "Relay",
    "Sink",
    "Watchdog",
    "abort_response",
    "session_id_of",
    "sticky_key",
]

log = logging.getLogger("unbroken")

MAX_ERROR_BODY = 1024 * 1024  # bytes of a retryable error answer kept for pass-through
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


#: the request headers that name a client session, in order of preference
SESSION_HEADERS = ("x-session-id", "x-session-affinity", "session-id", "x-claude-code-session-id")


class ClientGone(Exception):
    """The client went away while we were writing to it."""


def session_id_of(headers: Any, body: dict[str, Any] | None = None) -> str | None:
    """The client's session key, for the journal: ``x-session-id``,
    ``x-session-affinity`` (OpenCode), ``session-id`` (Codex),
    ``x-claude-code-session-id`` (Claude Code), else the body's ``prompt_cache_key``."""
    return _session_key(headers, body, SESSION_HEADERS)


_STICKY_HEADERS = (*SESSION_HEADERS, "thread-id")  # Codex sends thread-id too


def sticky_key(headers: Any, body: dict[str, Any] | None = None) -> str | None:
    """A turn's session key for stickiness: a session header (or Codex's
    ``thread-id``), else the parsed body's ``prompt_cache_key``."""
    return _session_key(headers, body, _STICKY_HEADERS)


def _session_key(headers: Any, body: dict[str, Any] | None, names: tuple[str, ...]) -> str | None:
    """The first of the ``names`` headers set, else the body's ``prompt_cache_key``."""
    for name in names:
        value = headers.get(name)
        if value:
            return str(value)
    if body is not None:
        key = body.get("prompt_cache_key")
        if isinstance(key, str) and key:
            return key
    return None


def abort_response(resp: aiohttp.ClientResponse) -> None:
    """Abort an upstream response's connection at once (no graceful close)."""
    conn = resp.connection
    transport = conn.transport if conn is not None else None
    if transport is not None:
        transport.abort()
    resp.close()


class Relay:
    """Shared state of the relay: config, outbound client, hooks, upstream health."""

    def __init__(
        self,
        config: Config,
        *,
        hooks: Hooks | None = None,
        client: UpstreamClient | None = None,
        rng: random.Random | None = None,
        clock: Any = time.monotonic,
        worker: int | None = None,
        channel_dir: str | None = None,
    ) -> None:
        self.config = config
        #: the keys and the token: redacted from any error answer that echoes them
        self.secrets = config.secrets()
        #: the relay's token: cut out of every header forwarded upstream
        self.token = config.token or config.key_token
        #: the health of every upstream (breakers, cool-offs), consulted by every turn
        self.board = HealthBoard(
            config.health, pace=config.retry.pace_settings(), rate=config.ratelimit
        )
        #: wakes the turns the upstreams' pacers let go (`relay.pacing`)
        self.waker = Waker(self.board)
        self.clock = clock
        #: shares the board with other processes: in-process, a workers' channel, or Redis
        self.store: HealthStore = make_store(
            self.board,
            config.health.store,
            channel_dir=channel_dir,
            worker=worker,
            bounds=SharedBounds.of(config.health, config.retry.max_retry_after_ms),
        )
        #: breaker transitions: (route, upstream, kind) -> count
        self.transitions: dict[tuple[str, str, str], int] = {}
        self.board.listeners.append(self._on_health_change)
        self._keys: dict[str, tuple[str, ...]] = {
            name: _route_keys(r) for name, r in config.routes.items()
        }
        for keys in self._keys.values():
            for key in keys:
                self.board.get(key)
        self.hooks: Hooks = MultiHooks(_HealthHook(self), hooks or Hooks())
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
        self._facts: dict[str, tuple[Route, tuple[str, ...], bool]] = {}
        self._profiles: dict[str, Profile] = {}
        self._intervals: dict[str, float] = {}
        #: each upstream's credential hash, and bad rate-limit headers logged once
        self.limits = RateLimitIO()
        #: upstreams that refused a continuation mechanism (background mode)
        self.continuations = ContinuationMemory()
        #: cancel requests on their way (kept referenced until they finish)
        self.side_tasks: set[asyncio.Task[None]] = set()

    def profile_for(self, headers: Any) -> Profile:
        """The client profile of a request, with the config's overrides (cached per client)."""
        name = identify(headers)
        profile = self._profiles.get(name)
        if profile is None:
            profile = self._profiles[name] = profile_named(name, self.config.clients)
        return profile

    def min_interval(self, machine: TurnMachine) -> float:
        """``machine.min_interval``, cached per client profile: every turn of this
        relay runs with the config's timers and its profile from `profile_for`."""
        interval = self._intervals.get(machine.profile.name)
        if interval is None:
            interval = self._intervals[machine.profile.name] = machine.min_interval
        return interval

    def route_facts(self, route: Route) -> tuple[tuple[str, ...], bool]:
        """A route's upstream names, and whether any upstream renames models (cached)."""
        known = self._facts.get(route.name)
        if known is not None and known[0] is route:
            return known[1], known[2]
        names = tuple(u.name for u in route.upstreams)
        renames = any(u.models for u in route.upstreams)
        self._facts[route.name] = (route, names, renames)
        return names, renames

    def retry_state(
        self,
        route: Route,
        sticky: str | None = None,
        *,
        prefer: int = -1,
        creds: tuple[str, ...] = (),
        body_bytes: int = 0,
        max_output: int = 0,
    ) -> RetryState:
        """A turn's retry bookkeeping; cool-offs, breakers and pacers are the route's.

        ``sticky``: the turn's session key (`sticky_key`), if it has one; ``prefer``:
        the upstream its first attempt goes to when it is usable; ``creds``,
        ``body_bytes``, ``max_output``: each upstream's credential hash and the
        request's size, for the rate limiters (`core.ratelimit`).
        """
        keys = self._keys.get(route.name)
        if keys is None or len(keys) != len(route.upstreams):
            keys = self._keys[route.name] = _route_keys(route)
        return RetryState(
            self.config.retry,
            len(route.upstreams),
            rng=self.rng,
            cooloff_until=self.cooloffs.setdefault(route.name, {}),
            board=self.board,
            keys=keys,
            sticky=sticky,
            quota_cooloff_s=self.config.health.quota_cooloff_s,
            prefer=prefer,
            park_check_s=self.config.health.park_check_s,
            creds=creds,
            body_bytes=body_bytes,
            max_output=max_output,
        )

    def continuation_for(
        self,
        route: Route,
        protocol: Protocol,
        rest: str,
        parsed: dict[str, Any] | None,
        headers: Any,
    ) -> Strategy | None:
        """The turn's continuation strategy (``after_commit = "continue"``), or None:
        OpenAI Responses over HTTP, a streamed plain-JSON request (`core.background`)."""
        stream = self.config.stream
        if stream.after_commit_for(route) != AfterCommit.CONTINUE:
            return None
        if protocol is ANTHROPIC or (protocol is CHAT and route.chat_prefix is not None):
            # A continuation by prefill: built from the parsed request (a gzip body is
            # sent decoded), so the parsed body is kept for the turn.
            mode = ChatPrefix(route.chat_prefix) if route.chat_prefix and protocol is CHAT else None
            if parsed is None or not prefill_applies(parsed, mode):
                return None
            return PrefillContinue(
                path=rest,
                request=parsed,
                keys=self._keys.get(route.name) or _route_keys(route),
                memory=self.continuations,
                max_splices=stream.max_splices,
                mode=mode,
            )
        if protocol is not RESPONSES or headers.get("content-encoding"):
            return None
        if not background_patch_applies(parsed):
            return None
        return self.background_resume(route, rest)

    def background_resume(self, route: Route, rest: str) -> BackgroundResume:
        """The Responses background-mode strategy of one turn on ``route``."""
        keys = self._keys.get(route.name) or _route_keys(route)
        return BackgroundResume(
            path=rest,
            keys=keys,
            memory=self.continuations,
            max_splices=self.config.stream.max_splices,
        )

    def send_cancels(
        self,
        route: Route,
        request: web.Request,
        cancels: Sequence[Cancel],
        headers_for: Callable[[Upstream], CIMultiDict[str]] | None = None,
    ) -> None:
        """Send each cancel (best effort, in the background: nobody waits for it).
        ``headers_for``: the upstream request headers (else the HTTP request's)."""
        for cancel in cancels:
            task = asyncio.ensure_future(self._cancel(route, request, cancel, headers_for))
            self.side_tasks.add(task)
            task.add_done_callback(self.side_tasks.discard)

    async def _cancel(
        self,
        route: Route,
        request: web.Request,
        cancel: Cancel,
        headers_for: Callable[[Upstream], CIMultiDict[str]] | None,
    ) -> None:
        up = route.upstreams[cancel.upstream]
        headers, query = continuation_headers(
            request, up, ("content-type", "content-encoding"), token=self.token
        )
        if headers_for is not None:
            headers = headers_for(up)
        url = upstream_url(up, cancel.path, query)
        status: int | str
        try:
            async with asyncio.timeout(10):
                resp = await self.client.request(cancel.method, url, headers, b"")
                status = resp.status
                resp.close()
        except Exception as exc:  # best effort: logged, never raised
            status = type(exc).__name__
        log.info(
            "continuation cancelled route=%s upstream=%s status=%s", route.name, up.name, status
        )

    def handle(
        self, request: web.Request, route: Route, rest: str, body: bytes
    ) -> Awaitable[web.StreamResponse]:
        """The turn of one HTTP request: its coroutine, for the caller to await (no
        frame of its own on every wake-up of the turn)."""
        return _HttpTurn(self, request, route, rest, body).run()

    def _on_health_change(self, change: Change) -> None:
        """Log every breaker transition once and count it (cool-offs are logged per retry)."""
        if not change.is_transition:
            return
        route, _, upstream = change.key.partition("|")
        k = (route, upstream, change.kind)
        self.transitions[k] = self.transitions.get(k, 0) + 1
        source = " (learned from another instance)" if change.remote else ""
        self.hooks.upstream_changed(
            route,
            upstream,
            change.kind,
            reason=change.reason,
            ttl_s=change.ttl_s,
            remote=change.remote,
        )
        if change.kind == "open":
            log.warning(
                "breaker open route=%s upstream=%s for_s=%g reason=%s%s",
                route,
                upstream,
                round(change.ttl_s, 3),
                change.reason,
                source,
            )
        else:
            log.info("breaker %s route=%s upstream=%s%s", change.kind, route, upstream, source)

    def health_view(self) -> list[dict[str, Any]]:
        """Each upstream's breaker, failure rate and cool-off, for /status and metrics."""
        now = self.clock()
        out = []
        for route, keys in self._keys.items():
            for key in keys:
                view = self.board.view(key, now)
                view["route"], view["upstream"] = route, key.partition("|")[2]
                out.append(view)
        return out

    def running(self) -> _Running:
        """Track the current task as a running client request (``with relay.running():``)."""
        return _Running(self)

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
        if self.side_tasks:
            await asyncio.gather(*list(self.side_tasks), return_exceptions=True)
        self.waker.close()
        await self.client.close()
        await self.store.close()


class _Running:
    """`Relay.running`: a plain context manager, not a generator one (every request)."""

    __slots__ = ("relay", "task")

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.task = asyncio.current_task()

    def __enter__(self) -> None:
        if self.task is not None:
            self.relay.tasks.add(self.task)
            self.relay.idle.clear()

    def __exit__(self, *exc: object) -> None:
        if self.task is not None:
            tasks = self.relay.tasks
            tasks.discard(self.task)
            if not tasks:
                self.relay.idle.set()


def continuation_headers(
    request: web.Request,
    up: Any,
    drop: Sequence[str],
    *,
    anthropic: bool = False,
    token: str | None = None,
) -> tuple[CIMultiDict[str], str]:
    """The headers (credentials as for the turn's attempts, ``drop`` removed) and the
    client's query (``api-version`` on Azure, a Gemini key stripped) for a
    continuation's or a cancel's request (``anthropic``: a Messages turn, whose
    injected key goes in ``x-api-key``, as for its attempts)."""
    query = raw_query(request)
    if up.api_key is not None:
        query, _ = strip_key_param(query)
    headers = request_headers(request.headers, up, anthropic=anthropic, token=token)
    for name in drop:
        headers.popall(name, None)
    return headers, query


def _route_keys(route: Route) -> tuple[str, ...]:
    """The health key of each upstream (a URL listed twice, with two keys, is two upstreams)."""
    keys: list[str] = []
    for u in route.upstreams:
        key = upstream_key(route.name, u.name)
        n = 2
        while key in keys:
            key, n = f"{upstream_key(route.name, u.name)}#{n}", n + 1
        keys.append(key)
    return tuple(keys)


class _HealthHook(Hooks):
    """Feeds attempt outcomes the machine does not record itself to the health board.

    The machine records failures before commit (they decide the next wait) and
    answers as they arrive (they release the pacer's line); this counts each
    attempt's end (the failure window), failures after commit, and the fleet's
    counters.
    """

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        #: turn id -> the upstreams it failed on (the fleet counts one failure per turn)
        self._failed: dict[int, set[str]] = {}
        #: turn id -> the upstreams it was cut on after commit (counted once a turn)
        self._cut: dict[int, set[str]] = {}

    def turn_ended(self, turn: TurnInfo) -> None:
        self._failed.pop(turn.id, None)
        self._cut.pop(turn.id, None)

    def attempt_ended(self, turn: TurnInfo, attempt: AttemptInfo) -> None:
        relay = self.relay
        reason = attempt.reason
        if reason == "aborted_by_client":
            return
        key = upstream_key(turn.route, attempt.upstream)
        answered = reason in ("ok", "passed_through_error")
        if answered:
            relay.board.success(key, relay.clock())
        elif attempt.phase == "committed" and (attempt.status or 0) < 400:
            # Once per turn: a turn continued in place after cuts (`core.continuation`)
            # has several committed attempts; the breaker counts the turn's failure.
            cut = self._cut.setdefault(turn.id, set())
            if key not in cut:
                cut.add(key)
                relay.board.failure(key, relay.clock(), reason)
        if answered:
            relay.store.count(key, False)
        elif (attempt.status or 500) >= 500:
            seen = self._failed.setdefault(turn.id, set())
            if key not in seen:  # like the local breaker: one failure per turn
                seen.add(key)
                relay.store.count(key, True)


class Watchdog:
    """The one timer of a turn: fires at the machine's deadline and carries out `tick`.

    Activity only moves timestamps inside the machine; the timer is not re-armed for
    it.  What makes that safe: every deadline counts from the event that sets it
    (early headers from the turn's start, a stall from the answer or the last frame,
    a keepalive from the last write), at least ``min_interval`` later, and the timer
    is always armed no later than ``min_interval`` from the moment it is armed.  So
    a deadline any later event sets falls after the timer, which re-arms exactly
    when it fires.  A short turn arms one timer and never moves it; a long one wakes
    once per ``min_interval`` (15 s by default).  ``on_action`` carries out what
    `tick` returns.
    """

    __slots__ = ("_handle", "_interval", "closed", "loop", "machine", "on_action")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        machine: TurnMachine,
        on_action: Any,
        interval: float,
    ) -> None:
        """``interval``: the machine's ``min_interval`` (`Relay.min_interval` caches it)."""
        self.loop, self.machine, self.on_action = loop, machine, on_action
        self._handle: asyncio.TimerHandle | None = None
        self._interval = interval
        self.closed = False

    def arm(self) -> None:
        """Make sure the timer runs while anything is timed (free when it does)."""
        if self.closed or self._handle is not None:
            return
        due = self.machine.deadline()
        if due is None:
            return
        cap = self.loop.time() + self._interval
        self._handle = self.loop.call_at(due if due < cap else cap, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self.closed:
            return
        action = self.machine.tick(self.loop.time())
        if action is not None:
            self.on_action(action)
        self.arm()

    def close(self) -> None:
        self.closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Drop the reference back to the transport (its bound method): a turn's
        # objects are then freed by reference counting as soon as it ends, not left
        # to the cyclic garbage collector (which costs every turn CPU).
        self.on_action = _ignore


def _ignore(action: Action) -> None:
    pass


class Sink(TypingProtocol):
    """Where an HTTP attempt's answer goes: an HTTP response, or a client WebSocket."""

    #: True: released SSE frames are written as bytes, so a run of them may go out in
    #: one piece (`TurnMachine.feed_verbatim`); False: each frame on its own (a WebSocket)
    verbatim: bool

    def answer(self, status: int, headers: CIMultiDict[str]) -> None:
        """The status and headers a streamed or plain answer would be sent with."""

    def keep_answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        """A retryable answer, kept in case it is the last one (passed through then)."""

    def release(self, events: Sequence[Event], over: Action | None) -> Awaitable[None]:
        """SSE frames the machine released (an ``async def`` will do); ``over``: the
        action that ends the attempt, decided by the same feed (`core.turn.Fed`)."""

    def release_body(self, data: bytes) -> Awaitable[None]:
        """Plain body bytes the machine released, or SSE bytes (`verbatim` sinks)."""


class HttpAttempt:
    """One upstream HTTP attempt: open it, tell the machine, read the body its way.

    Shared by the HTTP transport and the WebSocket transport's HTTP fallback; only
    the `Sink` differs.
    """

    __slots__ = (
        "client",
        "loop",
        "machine",
        "rate_max_wait_s",
        "reading",
        "relay",
        "secrets",
        "sink",
        "watchdog",
    )

    def __init__(
        self,
        machine: TurnMachine,
        watchdog: Watchdog,
        client: UpstreamClient,
        sink: Sink,
        secrets: tuple[str, ...] = (),
        relay: Relay | None = None,
    ) -> None:
        self.machine, self.watchdog, self.client, self.sink = machine, watchdog, client, sink
        self.loop = watchdog.loop
        self.reading: aiohttp.ClientResponse | None = None
        #: the keys and token the relay knows: an error answer that echoes one is redacted
        self.secrets = secrets
        self.relay = relay
        self.rate_max_wait_s = relay.config.ratelimit.max_wait_s if relay is not None else 60.0

    def on_rate_problems(self, problems: Sequence[str]) -> None:
        retry = self.machine.retry
        if self.relay is not None and retry.keys and retry.current >= 0:
            self.relay.limits.problems(retry.keys[retry.current], problems)

    def abort(self) -> None:
        if self.reading is not None:
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
        try:
            async with asyncio.timeout(action.timeout_s):
                resp = await self.client.request(method, url, headers, body)
        except Exception as exc:
            return machine.open_failed(self.loop.time(), _classify(exc, header_phase=True))
        self.reading = resp
        try:
            status = resp.status
            retry_after = (
                parse_retry_after(resp.headers, now_wall=time.time()) if status >= 400 else None
            )
            sse = resp.headers.get("content-type", "").startswith("text/event-stream")
            rate = None
            if machine.retry.admitted:  # the provider's rate-limit headers, checked
                rate = parse_rate_headers(
                    resp.headers, now_wall=time.time(), max_wait_s=self.rate_max_wait_s
                )
                if rate.problems:
                    self.on_rate_problems(rate.problems)
            answer = machine.answered(
                self.loop.time(), status, sse=sse, retry_after_s=retry_after, rate=rate
            )
            self.watchdog.arm()
            match answer:
                case Stream():
                    return await self._stream(resp, key)
                case PassThrough():
                    return await self._pass_through(resp, key)
                case ReadErrorBody():
                    return await self._error_body(resp, final=False)
                case FinalInStream():
                    return await self._error_body(resp, final=True)
                case Open() | Resume() | Wait() | End() | GiveUp():
                    return answer  # a 1xx: the machine already decided what follows
                case _:
                    assert_never(answer)
        finally:
            self.reading = None
            resp.close()

    async def _error_body(self, resp: aiohttp.ClientResponse, *, final: bool) -> Action:
        """A retryable answer's body (kept, in case it is the last answer), or a final
        answer's after early headers (re-sent in the stream)."""
        machine = self.machine
        try:
            data = await self._read_bounded(resp)
        except Exception as exc:
            return machine.transport_failed(self.loop.time(), _classify(exc))
        if final:
            rid = resp.headers.get("request-id") or resp.headers.get("x-request-id")
            return machine.final_body(self.loop.time(), resp.status, data, rid)
        self.sink.keep_answer(resp.status, response_headers(resp.headers, keep_length=False), data)
        return machine.error_body(self.loop.time(), data)

    async def _read_bounded(self, resp: aiohttp.ClientResponse) -> bytes:
        chunks: list[bytes] = []
        size = 0
        machine = self.machine
        # (The stall clock of an answer's body is the first-frame one: the whole
        # body within first_frame_timeout_s of the answer.)
        async for chunk in resp.content.iter_any():
            if size < MAX_ERROR_BODY:
                chunks.append(chunk)
            size += len(chunk)
        if machine.stalled:
            raise TimeoutError("stalled")
        data = b"".join(chunks)[:MAX_ERROR_BODY]
        return redact(data, self.secrets) if self.secrets else data

    async def _stream(self, resp: aiohttp.ClientResponse, key: str | None) -> Action:
        """Read an SSE body through the machine; release what it releases.  ``key``: the
        relay's key went with the request: echoed anywhere in the stream, it is
        redacted before the machine sees it (across chunk boundaries)."""
        machine = self.machine
        sink = self.sink
        sink.answer(resp.status, response_headers(resp.headers, keep_length=False))
        verbatim = sink.verbatim
        feed_verbatim, feed = machine.feed_verbatim, machine.feed_chunk
        loop_time = self.loop.time
        release, write = sink.release, sink.release_body
        rearm_on_first_frame = True
        chunks: AsyncIterator[bytes] = resp.content.iter_any()
        if key is not None:
            chunks = redacted_chunks(chunks, Redactor((key,)))
        try:
            async for chunk in chunks:
                now = loop_time()
                if verbatim:
                    data, over = feed_verbatim(now, chunk)
                    if data is None:  # released whole: plain output, the attempt goes on
                        await write(chunk)
                        continue
                    pending = write(data) if data else None
                else:
                    out, over = feed(now, chunk)
                    pending = release(out, over) if out else None
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

    async def _pass_through(self, resp: aiohttp.ClientResponse, key: str | None) -> Action:
        """Forward a non-SSE body as it arrives; the first byte out commits."""
        machine = self.machine
        # An error answer may echo a secret, and any answer to a request that carried the
        # relay's key may echo that key: it is redacted on its way through (the length
        # may change, so it goes out chunked).  Other bodies pass as they are.
        # (The upstream knows only the key it was sent: a success is searched for that
        # one, an error for every secret, as before.)
        if self.secrets and resp.status >= 400:
            redactor: Redactor | None = Redactor(self.secrets)
        else:
            redactor = Redactor((key,)) if key is not None else None
        keep_length = "content-length" in resp.headers and redactor is None
        self.sink.answer(resp.status, response_headers(resp.headers, keep_length=keep_length))
        loop_time = self.loop.time
        try:
            async for chunk in resp.content.iter_any():
                if redactor is not None:
                    chunk = redactor.feed(chunk)
                    if not chunk:
                        continue
                out, over = machine.feed_body(loop_time(), chunk)
                if out:
                    await self.sink.release_body(out)
                if over is not None:
                    return over
            if redactor is not None:
                tail = redactor.flush()
                if tail and machine.feed_body(loop_time(), tail).released:
                    await self.sink.release_body(tail)
        except ClientGone:
            raise
        except Exception as exc:
            return machine.transport_failed(loop_time(), _classify(exc))
        return machine.body_ended(loop_time())


class CleanStream(web.StreamResponse):
    """A streamed answer whose headers hold no ``Access-Control-*`` header: built by
    `response_headers` (which drops the upstream's) or by the relay itself.  The
    server's CORS step trusts that and skips its scan of the headers."""


class _WithFirstWrite(CleanStream):
    """A streamed response whose status line and headers leave with its first bytes.

    aiohttp sends a `StreamResponse`'s headers at ``prepare()`` in a segment of
    their own; the relay prepares only when it has bytes to write (early headers
    aside), so one send carries both (aiohttp's own `web.Response` does the same).
    """

    _send_headers_immediately = False


class _Gone:
    """The sink of a closed attempt: nothing goes anywhere."""

    verbatim = True

    def answer(self, status: int, headers: CIMultiDict[str]) -> None:
        pass

    def keep_answer(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        pass

    async def release(self, events: Sequence[Event], over: Action | None) -> None:
        pass

    async def release_body(self, data: bytes) -> None:
        pass


_GONE = _Gone()


class _HttpTurn:
    """The I/O of one client request."""

    verbatim = True  # a Sink that writes released SSE bytes as they are

    __slots__ = (
        "_bodies",
        "_prepare_lock",
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
        "upstream",
        "watchdog",
    )

    def __init__(
        self,
        relay: Relay,
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
        if self.protocol is GEMINI:
            # The method says it (``:streamGenerateContent``); the answer is SSE only
            # with ``alt=sse`` (else a JSON array, relayed as a plain body).
            stream = is_stream_path(rest) and "alt=sse" in raw_query(request).split("&")
        elif parsed is not None:
            stream = parsed.get("stream") is True
        else:
            stream = "text/event-stream" in request.headers.get("accept", "")
        names, renames = relay.route_facts(route)
        # Keep the parsed body only if an upstream renames models: a late-session
        # agent body is hundreds of KiB, and its parsed form is larger still.
        self.parsed = parsed if renames else None
        self.profile = relay.profile_for(request.headers)
        info = TurnInfo(
            route=route.name,
            path=rest,
            protocol=self.protocol.name,
            stream=stream,
            session_id=session_id_of(request.headers, parsed),
            client=self.profile.name,
        )
        self.report = TurnReporter(info, relay.hooks, names, relay.inflight)
        self.loop = asyncio.get_running_loop()
        self.machine = TurnMachine(
            protocol=self.protocol,
            hold=relay.hold,
            timers=self.cfg.stream,
            retry=relay.retry_state(
                route,
                sticky_key(request.headers, parsed),
                creds=relay.limits.creds_for(route, request.headers, raw_query(request)),
                body_bytes=len(body),
                max_output=max_output_of(parsed),
            ),
            stream=stream,
            now=self.loop.time(),
            report=self.report,
            clock=self.loop.time,
            wall_clock=time.time,
            profile=self.profile,
        )
        info.held = self._held
        if stream:
            self.machine.continuation = relay.continuation_for(
                route, self.protocol, rest, parsed, request.headers
            )
            self.machine.queued_s = self.cfg.stream.resume_queued_s
        self.response: web.StreamResponse | None = None  # the client response, once prepared
        self._prepare_lock = asyncio.Lock()
        #: the client response the attempt that answered would send, built ahead
        self.pending: CleanStream | None = None
        self.last_answer: tuple[int, CIMultiDict[str], bytes] | None = None
        self._bodies: dict[int, bytes] = {}
        self._side_task: asyncio.Future[Any] | None = None  # an early-headers/keepalive write
        self.watchdog = Watchdog(
            self.loop, self.machine, self._on_timer, relay.min_interval(self.machine)
        )
        self.upstream = HttpAttempt(
            self.machine, self.watchdog, relay.client, self, relay.secrets, relay
        )

    def _sent(self) -> None:
        self.report.flush()
        self.watchdog.arm()

    def _held(self) -> int:
        ledger = self.machine.attempt_ledger
        return ledger.held_bytes if ledger is not None else 0

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
                action: Action = machine.start(self.loop.time())
                while True:
                    if machine.cancels:
                        self._send_cancels()
                    match action:
                        case Open():
                            action = await self._attempt(action)
                        case Resume():
                            action = await self._resume(action)
                        case Wait():
                            self.watchdog.arm()  # keepalives, early headers go on meanwhile
                            await self.relay.waker.wait(action)
                            action = machine.next_attempt(self.loop.time())
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
                if machine.cancels:
                    self._send_cancels()
                self.watchdog.close()
                self.upstream.close()
                if self._side_task is not None:
                    self._side_task.cancel()
                self.report.close(machine.outcome or Outcome.ABORTED_BY_CLIENT)

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
        )
        url = upstream_url(up, self.rest, query)
        if action.body_patch:
            body = patched_body(body, action.body_patch)
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

    def release(self, events: Sequence[Event], over: Action | None) -> Awaitable[None]:
        # The write's own coroutine, awaited by the caller: no frame of its own per chunk.
        # It follows the read that fed the machine at once: that read's time is when the
        # write starts (no second clock read per chunk).
        t0 = self.machine.last_rx
        if len(events) == 1:
            return self._write(events[0].raw, t0)
        return self._write(b"".join([e.raw for e in events]), t0)

    def release_body(self, data: bytes) -> Awaitable[None]:
        return self._write(data, self.machine.last_rx)

    async def _end(self, action: End) -> web.StreamResponse:
        if action.kind is EndKind.ABORT:
            return self._abort_client()
        if action.data:
            await self._write(action.data)
        return await self._finish()

    async def _give_up(self, action: GiveUp) -> web.StreamResponse:
        if action.kind is GiveUpKind.IN_STREAM:
            if action.data:
                await self._write(action.data)
            return await self._finish()
        # The relay's own final answer: the SDKs must not add a retry layer on top.
        if action.kind is GiveUpKind.PASS_THROUGH and self.last_answer is not None:
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
        async with self._prepare_lock:
            if self.response is not None:
                return False
            try:
                await resp.prepare(self.request)
            except (ConnectionError, aiohttp.ClientConnectionError) as exc:
                raise ClientGone() from exc
            self.response = resp
            self.machine.headers_sent(self.loop.time())
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
        machine.write_started(self.loop.time() if t0 is None else t0)
        try:
            await response.write(data)
        except (ConnectionError, aiohttp.ClientConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        finally:
            # Also when the write failed: a keepalive's failure (a side task) must not
            # leave the stall clock stopped while the turn still reads the upstream.
            machine.wrote(self.loop.time())
        # A timer that fired during the write found no deadline (none runs while the
        # relay writes) and is not armed: arm it again (free when it is).
        self.watchdog.arm()

    async def _finish(self) -> web.StreamResponse:
        if self.response is None:
            await self._prepare(self.pending or _WithFirstWrite())
            assert self.response is not None
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionError, RuntimeError):
            await self.response.write_eof()
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


def _classify(exc: BaseException, *, header_phase: bool = False) -> Failure:
    if (
        header_phase
        and isinstance(exc, TimeoutError)
        and not isinstance(exc, aiohttp.ServerTimeoutError)
    ):
        return Failure(FailureClass.HEADER_TIMEOUT, "no response headers within the timeout")
    failure = classify_exception(exc)
    if failure is None:
        raise exc
    return failure
