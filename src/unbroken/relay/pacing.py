"""Carries out the pacers' and rate limiters' grants: the turns an upstream lets go
are woken at once.

The decisions (who may go, when the next token is due, the ramp after a recovery)
are the core's (`unbroken.core.admission.pacer`, through `HealthBoard.pump`).  This module
only does what they say: a turn's `Wait` ends when its ticket is granted, when the
upstream it waits out a delay for is known good again, or at the wait's end; and the
board is pumped again when it says the next grant is due.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from unbroken.config import Route
from unbroken.core.admission.health import HealthBoard
from unbroken.core.admission.ratelimit import credential_hash
from unbroken.core.turn.machine import Wait
from unbroken.core.wire.client_request import client_credential, credentials_of

__all__ = ["RateLimitIO", "Waker"]

log = logging.getLogger("unbroken")


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Waker:
    """One relay's waits on its upstreams' pacers (see the module docstring)."""

    __slots__ = ("_delays", "_lines", "_loop", "_scheduled", "_tickets", "_timers", "board")

    def __init__(self, board: HealthBoard) -> None:
        self.board = board
        board.pace_listener = self._poke
        self._loop: asyncio.AbstractEventLoop | None = None
        #: ticket -> the future its turn waits on
        self._tickets: dict[int, asyncio.Future[None]] = {}
        #: key -> the futures of turns waiting out a retry's delay for it
        self._delays: dict[str, set[asyncio.Future[None]]] = {}
        #: key -> the timer of its next pump
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._scheduled: set[str] = set()
        #: key -> (when its line formed, grants since): logged when it forms and clears
        self._lines: dict[str, tuple[float, int]] = {}

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    async def wait(self, action: Wait) -> None:
        """Carry out ``action``: wait until the pacer lets the turn go, or its end."""
        key = action.key
        if key is None:
            await asyncio.sleep(action.seconds)
            return
        loop = self._get_loop()
        fut: asyncio.Future[None] = loop.create_future()
        ticket = action.ticket
        delays: set[asyncio.Future[None]] | None = None
        if ticket:
            self._tickets[ticket] = fut
            self._poke(key, False)  # it may be granted already
        else:
            delays = self._delays.setdefault(key, set())
            delays.add(fut)
        handle = loop.call_later(action.seconds, _wake, fut)
        try:
            await fut
        finally:
            handle.cancel()
            if ticket:
                if self._tickets.get(ticket) is fut:
                    del self._tickets[ticket]
            elif delays is not None:
                delays.discard(fut)
                if not delays and self._delays.get(key) is delays:
                    del self._delays[key]

    def _poke(self, key: str, recovered: bool) -> None:
        """The board says ``key``'s line may move (``recovered``: it answered again)."""
        if recovered:
            for fut in self._delays.pop(key, ()):
                _wake(fut)
        if key in self._scheduled:
            return
        try:
            loop = self._get_loop()
        except RuntimeError:  # no loop (a board used outside the relay): nothing waits
            return
        self._scheduled.add(key)
        loop.call_soon(self._pump, key)

    def _pump(self, key: str) -> None:
        self._scheduled.discard(key)
        loop = self._get_loop()
        now = loop.time()
        granted, due = self.board.pump(key, now)
        self._log_line(key, now, len(granted))
        tickets = self._tickets
        for ticket in granted:
            fut = tickets.get(ticket)
            if fut is not None:
                _wake(fut)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if due is not None:
            self._timers[key] = loop.call_at(due, self._pump, key)

    def _log_line(self, key: str, now: float, granted: int) -> None:
        """One line when an upstream's line forms, one when it clears (not per turn)."""
        waiting = self.board.in_line(key)
        line = self._lines.get(key)
        route, _, upstream = key.partition("|")
        if line is None:
            if waiting:
                self._lines[key] = (now, granted)
                log.warning(
                    "pacing route=%s upstream=%s: %d turn(s) wait in line (%s)",
                    route,
                    upstream,
                    waiting,
                    self.board.wait_reason(key, now),
                )
        elif waiting:
            self._lines[key] = (line[0], line[1] + granted)
        else:
            del self._lines[key]
            log.info(
                "pacing route=%s upstream=%s: line cleared after %.2fs, %d turn(s) let go",
                route,
                upstream,
                now - line[0],
                line[1] + granted,
            )

    def view(self) -> dict[str, Any]:
        return {"waiting": len(self._tickets), "delays": sum(map(len, self._delays.values()))}

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


class RateLimitIO:
    """The rate limiters' inputs from requests: each upstream's credential as a hash
    (`core.admission.ratelimit.credential_hash`; the key itself is never kept), and each bad
    rate-limit header logged once per upstream."""

    __slots__ = ("_clients", "_hashes", "_routes", "warned")

    def __init__(self) -> None:
        self._hashes: dict[str, str] = {}
        #: route -> its hashes, when every upstream injects its own key
        self._routes: dict[str, tuple[str, ...]] = {}
        #: (route name, the client's credential) -> (the route, its hashes): per request
        #: only a lookup (bounded like ``_hashes``)
        self._clients: dict[tuple[str, str], tuple[Route, tuple[str, ...]]] = {}
        #: (upstream key, header) already logged
        self.warned: set[tuple[str, str]] = set()

    def creds_for(self, route: Route, headers: Any, query: str = "") -> tuple[str, ...]:
        """Each upstream's credential (`core.wire.client_request.credentials_of`), as
        its hash; cached for a route whose every upstream injects its own key."""
        known = self._routes.get(route.name)
        if known is not None and len(known) == len(route.upstreams):
            return known
        client = client_credential(headers, query)
        seen = self._clients.get((route.name, client))
        if seen is not None and seen[0] is route:
            return seen[1]
        injected = [u.api_key for u in route.upstreams]
        out = tuple(map(self._hash, credentials_of(injected, headers, query)))
        if all(injected):
            self._routes[route.name] = out
        else:
            if len(self._clients) >= 4096:
                self._clients.clear()
            self._clients[(route.name, client)] = (route, out)
        return out

    def _hash(self, value: str) -> str:
        h = self._hashes.get(value)
        if h is None:
            if len(self._hashes) >= 4096:
                self._hashes.clear()
            h = self._hashes[value] = credential_hash(value)
        return h

    def problems(self, key: str, problems: Sequence[str]) -> None:
        """Log each upstream's bad rate-limit header once (its first bad value)."""
        for problem in problems:
            header = problem.partition("=")[0]
            if (key, header) in self.warned or len(self.warned) >= 10_000:
                continue
            self.warned.add((key, header))
            route, _, upstream = key.partition("|")
            log.warning(
                "rate-limit header route=%s upstream=%s: %s (logged once)",
                route,
                upstream,
                problem,
            )
