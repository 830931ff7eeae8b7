"""The state every turn shares: `RelayState` (config, outbound client, hooks, upstream
health and cool-offs, the running tasks for a graceful shutdown).

Both transports (`relay.http`, `relay.websocket`) run their turns against one
`RelayState`.  Each attempt's end reaches the health accounting
(`core.admission.health.AttemptAccounting`) through `_HealthHook`; the shared store hears the
fleet count it decides.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from unbroken.config import Config, Route, Upstream
from unbroken.core.admission.health import AttemptAccounting, Change, HealthBoard, upstream_key
from unbroken.core.admission.policy import RetryState
from unbroken.core.admission.shared import SharedBounds
from unbroken.core.profiles import Profile, identify_by, identity_headers, profile_named
from unbroken.core.turn.background import (
    STORE_OVERRIDE,
    BackgroundResume,
    store_override_note,
    store_override_routes,
)
from unbroken.core.turn.continuation import (
    AfterCommit,
    Cancel,
    ContinuationMemory,
    Refusal,
    Strategy,
)
from unbroken.core.turn.continuation_choice import continuation_for, continuation_over_socket
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import TurnMachine
from unbroken.core.wire.protocols import Protocol
from unbroken.core.wire.protocols.prefill import PrefillRefusal
from unbroken.observe.hooks import AttemptInfo, Hooks, MultiHooks, TurnRecord
from unbroken.relay.pacing import RateLimitIO, Waker
from unbroken.relay.store import HealthStore, make_store
from unbroken.relay.upstream import (
    UpstreamClient,
    raw_query,
    request_headers,
    strip_key_param,
    upstream_url,
    via_entry,
)
from unbroken.relay.watchdog import LoopDeadlines

__all__ = ["RelayState", "continuation_headers"]

log = logging.getLogger("unbroken")

#: `RelayState.profile_for` remembers at most this many client identities
_MAX_IDENTITIES = 256


class RelayState:
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
        #: this relay's entry in the ``Via`` of what it forwards (one id for workers)
        self.via = via_entry(channel_dir)
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
        #: the routes whose store: true (continue mode) the log has said
        self._stored_noted: set[str] = set()
        self.hooks: Hooks = MultiHooks(_HealthHook(self), hooks or Hooks())
        self.client = client or UpstreamClient(connect_timeout_s=config.stream.connect_timeout_s)
        self.rng = rng or random.Random()
        #: the hold rules per client profile (``[stream] hold``, with the profile's
        #: ``tool_tail``), built once per profile
        self._holds: dict[str, Hold] = {}
        self.inflight: set[TurnRecord] = set()
        #: the tasks running client requests (turns, WebSocket connections): cancelled
        #: when the grace period of a shutdown runs out
        self.tasks: set[asyncio.Task[Any]] = set()
        self.idle = asyncio.Event()  # set while no request is running
        self.idle.set()
        self._deadlines: LoopDeadlines | None = None
        #: set to cut a drain's grace period short (a second signal)
        self.cut = asyncio.Event()
        #: route -> upstream index -> monotonic time until which it asked to be left alone
        self.cooloffs: dict[str, dict[int, float]] = {}
        self._facts: dict[str, tuple[Route, tuple[str, ...], bool]] = {}
        self._profiles: dict[str, Profile] = {}
        #: `identity_headers` -> the profile name `identify_by` gives (user agents repeat)
        self._identified: dict[tuple[str | None, str | None, bool], str] = {}
        self._intervals: dict[str, float] = {}
        #: each upstream's credential hash, and bad rate-limit headers logged once
        self.limits = RateLimitIO()
        #: upstreams that refused a continuation mechanism (background mode)
        self.continuations = ContinuationMemory()
        #: cancel requests on their way (kept referenced until they finish)
        self.side_tasks: set[asyncio.Task[None]] = set()

    def profile_for(self, headers: Any) -> Profile:
        """The client profile of a request, with the config's overrides (cached per client)."""
        key = identity_headers(headers)
        name = self._identified.get(key)
        if name is None:
            if len(self._identified) >= _MAX_IDENTITIES:
                self._identified.clear()  # (ever new user agents: a bounded memo)
            name = self._identified[key] = identify_by(*key)
        profile = self._profiles.get(name)
        if profile is None:
            profile = self._profiles[name] = profile_named(name, self.config.clients)
        return profile

    def hold_for(self, profile: Profile) -> Hold:
        """The hold rules for a turn of this client (`Profile.hold_names`)."""
        hold = self._holds.get(profile.name)
        if hold is None:
            hold = self._holds[profile.name] = Hold(profile.hold_names(self.config.stream.hold))
        return hold

    def min_interval(self, machine: TurnMachine) -> float:
        """``machine.min_interval``, cached per client profile: every turn of this
        relay runs with the config's timers and its profile from `profile_for`."""
        interval = self._intervals.get(machine.profile.name)
        if interval is None:
            interval = self._intervals[machine.profile.name] = machine.min_interval
        return interval

    def deadlines(self, loop: asyncio.AbstractEventLoop) -> LoopDeadlines:
        """The turns' deadlines on ``loop`` (`LoopDeadlines`: one loop timer for all)."""
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not loop:
            deadlines = self._deadlines = LoopDeadlines(loop)
        return deadlines

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
        request's size, for the rate limiters (`core.admission.ratelimit`).
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
        *,
        streamed: bool,
    ) -> Strategy | Refusal | PrefillRefusal | None:
        """An HTTP turn's continuation strategy, or why none, or None
        (`core.turn.continuation_choice.continuation_for` decides), with the
        route's settings and this relay's memory of refusals."""
        return continuation_for(
            self.config.stream.after_commit_for(route),
            protocol,
            rest,
            parsed,
            streamed=streamed,
            content_encoding=headers.get("content-encoding"),
            chat_prefix=route.chat_prefix,
            anthropic_continue=route.anthropic_continue,
            keys=self._keys.get(route.name) or _route_keys(route),
            memory=self.continuations,
            max_splices=self.config.stream.max_splices,
        )

    def socket_continuation(self, route: Route, rest: str) -> BackgroundResume | None:
        """A WebSocket turn's continuation strategy, or None
        (`core.turn.continuation_choice.continuation_over_socket` decides)."""
        return continuation_over_socket(
            self.config.stream.after_commit_for(route),
            rest,
            keys=self._keys.get(route.name) or _route_keys(route),
            memory=self.continuations,
            max_splices=self.config.stream.max_splices,
        )

    def store_override_warning(self) -> str | None:
        """The start-up warning for the routes whose continue mode may store a client's
        Responses at the provider (`core.turn.background.store_override_routes`), or None."""
        stream = self.config.stream
        continued = {
            name: [u.url for u in r.upstreams]
            for name, r in self.config.routes.items()
            if stream.after_commit_for(r) == AfterCommit.CONTINUE
        }
        names = store_override_routes(continued)
        if not names:
            return None
        return f"after_commit = continue on route(s) {', '.join(names)}: {STORE_OVERRIDE}"

    def stored_by_continue(self, route: Route) -> None:
        """A turn on ``route`` goes in background mode (``store: true``): said in the
        log the first time per route (`core.turn.background.store_override_note`)."""
        if route.name not in self._stored_noted:
            self._stored_noted.add(route.name)
            log.warning("%s", store_override_note(route.name))

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
            request, up, ("content-type", "content-encoding"), token=self.token, via=self.via
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
        """Wait up to ``grace_s`` (or until `cut` is set) for running requests; cancel
        the rest, and wait for them to end (their ends are reported: the journal
        records them).  Returns that count."""
        waits = [asyncio.ensure_future(self.idle.wait()), asyncio.ensure_future(self.cut.wait())]
        try:
            await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if self.idle.is_set():
            return 0
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
    """`RelayState.running`: a plain context manager, not a generator one (every request)."""

    __slots__ = ("relay", "task")

    def __init__(self, relay: RelayState) -> None:
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
    via: str,
) -> tuple[CIMultiDict[str], str]:
    """The headers (credentials as for the turn's attempts, ``drop`` removed) and the
    client's query (``api-version`` on Azure, a Gemini key stripped) for a
    continuation's or a cancel's request (``anthropic``: a Messages turn, whose
    injected key goes in ``x-api-key``, as for its attempts)."""
    query = raw_query(request)
    if up.api_key is not None:
        query, _ = strip_key_param(query)
    headers = request_headers(request.headers, up, anthropic=anthropic, token=token, via=via)
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
    """Hands each attempt's end to the health accounting (`core.admission.health.AttemptAccounting`)
    and sends the fleet count it decides to the shared store."""

    def __init__(self, relay: RelayState) -> None:
        self.relay = relay
        self.accounting = AttemptAccounting(relay.board)

    def turn_ended(self, turn: TurnRecord) -> None:
        self.accounting.turn_ended(turn.id)

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        relay = self.relay
        key = upstream_key(turn.route, attempt.upstream)
        failed = self.accounting.attempt_ended(
            relay.clock(),
            turn.id,
            key,
            reason=attempt.reason,
            phase=attempt.phase,
            status=attempt.status,
        )
        if failed is not None:
            relay.store.count(key, failed)
