"""A rate limiter's line (sans-IO): the turns waiting for a provider's budget, served
fairly.

Round robin across sessions (a turn's session key), first come first served within a
session, so one busy agent cannot starve the others (`unbroken.core.admission.ratelimit`
pumps it).  Each ticket remembers what it asks for, its place (when its turn came) and
since when it waits: no turn waits in a line longer than ``max_wait_s``
(`FairLine.overdue`), one back in line after a cool-off held it out included (it comes
back with the time it first waited).  A turn back in line to retry a request the
provider's rate limit refused (a 429) takes its place by when its turn came, not behind
the turns that came since; its wait bound counts from when it began to wait again.
Nothing here reads a clock: ``now`` is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

__all__ = ["FairLine"]


class FairLine:
    """Waiting tickets: round robin across sessions, first come first served within one."""

    __slots__ = ("_sessions", "costs", "since", "waits", "where")

    def __init__(self) -> None:
        #: session -> its tickets, oldest first; the dict's order is the rotation
        self._sessions: dict[str, deque[int]] = {}
        #: ticket -> its session
        self.where: dict[int, str] = {}
        #: ticket -> the tokens it asks for
        self.costs: dict[int, float] = {}
        #: ticket -> its place: when it began to wait, or when its turn came for a
        #: retry, in the order of those times (`add` keeps it: one back in line goes in
        #: its place)
        self.since: dict[int, float] = {}
        #: ticket -> when it began to wait (no wait is longer than ``max_wait_s``), in
        #: the order of those times (for all but a retry, its place)
        self.waits: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, ticket: object) -> bool:
        return ticket in self.where

    def __iter__(self) -> Iterator[int]:
        """The tickets in the order they would be granted (for views and tests)."""
        queues = {s: list(q) for s, q in self._sessions.items()}
        while queues:
            for s in list(queues):
                q = queues[s]
                yield q.pop(0)
                if not q:
                    del queues[s]

    def add(
        self, ticket: int, session: str, cost: float, now: float = 0.0, place: float | None = None
    ) -> None:
        """``ticket`` waits from ``now`` (its wait bound's start) in its place:
        ``place`` when earlier (a retry's: when its turn came), else ``now``."""
        if ticket in self.where:
            return
        self.where[ticket] = session
        self.costs[ticket] = cost
        _in_order(self.waits, ticket, now)
        if place is not None and place < now:
            now = place
        since = self.since
        if since and now < next(reversed(since.values())):
            # One back in line (a cool-off held it out; a 429'd retry) keeps its time,
            # its wait bound, and its place: ``since`` stays in order, and so do its
            # session's tickets and the rotation (before, it went to the back behind
            # newer turns: after a 429's cool-off, turns that came during it were
            # served first)
            _in_order(since, ticket, now)
            self._back_in_place(ticket, session)
            return
        since[ticket] = now
        q = self._sessions.get(session)
        if q is None:
            q = self._sessions[session] = deque()
        q.append(ticket)

    def _back_in_place(self, ticket: int, session: str) -> None:
        """Put ``ticket`` (its ``since`` set) in its place: in its session's tickets by
        their times, and a session not in line before the first whose head came later
        (one waiting ticket a session, as agents have: the rotation is the line's
        order by time).  O(n): only a ticket back from a cool-off takes this path."""
        since = self.since
        at = since[ticket]
        q = self._sessions.get(session)
        if q is not None:
            k = next((i for i, t in enumerate(q) if since.get(t, at) > at), len(q))
            q.insert(k, ticket)
            return
        order = list(self._sessions.items())
        k = next((i for i, (_, sq) in enumerate(order) if since.get(sq[0], at) > at), len(order))
        order.insert(k, (session, deque((ticket,))))
        self._sessions.clear()
        self._sessions.update(order)

    def head(self) -> int | None:
        for q in self._sessions.values():
            return q[0]
        return None

    def pop_head(self) -> int:
        session, q = next(iter(self._sessions.items()))
        ticket = q.popleft()
        del self._sessions[session]
        if q:
            self._sessions[session] = q  # to the end of the rotation
        del self.where[ticket]
        self.costs.pop(ticket, None)
        self.since.pop(ticket, None)
        self.waits.pop(ticket, None)
        return ticket

    def remove(self, ticket: int) -> None:
        session = self.where.pop(ticket, None)
        if session is None:
            return
        self.costs.pop(ticket, None)
        self.since.pop(ticket, None)
        self.waits.pop(ticket, None)
        q = self._sessions[session]
        q.remove(ticket)
        if not q:
            del self._sessions[session]

    def sessions(self) -> int:
        return len(self._sessions)

    def oldest(self) -> tuple[int, float] | None:
        """The first ticket by place and its place's time (``since`` is in time order)."""
        for item in self.since.items():
            return item
        return None

    def waited(self, now: float) -> float:
        """How long ago the first ticket's place began (0 with nobody in line): what a
        fleet's line orders the relays by (`core.admission.leasemath.LineMark`)."""
        first = self.oldest()
        return now - first[1] if first is not None else 0.0

    def deadline(self) -> tuple[int, float] | None:
        """The ticket whose wait began first and since when (``waits`` is in time order)."""
        for item in self.waits.items():
            return item
        return None

    def overdue(self, now: float, max_wait_s: float) -> int | None:
        """The ticket that has waited ``max_wait_s`` first, once one has, else None."""
        first = self.deadline()
        # the same sum `Limiter.pump` wakes at (``now - since >= max_wait_s`` can be
        # false at that instant by a rounding: a wake at the same time, again and again)
        return first[0] if first is not None and now >= first[1] + max_wait_s else None


def _in_order(times: dict[int, float], ticket: int, at: float) -> None:
    """``times[ticket] = at``, ``times`` kept in the order of its values: appended when
    ``at`` is the latest (nearly always), else sorted in (O(n): one back in line)."""
    if times and at < next(reversed(times.values())):
        items = sorted([*times.items(), (ticket, at)], key=lambda item: item[1])
        times.clear()
        times.update(items)
    else:
        times[ticket] = at
