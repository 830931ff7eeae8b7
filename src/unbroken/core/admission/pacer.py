"""Retry pacing per upstream (sans-IO): when a waiting retry may go.

Theory of operation
===================
Every turn that retries an upstream draws its attempt from that upstream's
`Pacer`, so the upstream sees a bounded rate of retries however many turns wait,
and a lone turn still retries at the simplest loop's speed.

* **A token bucket** (gRPC's retry throttling, Envoy's retry budget): a retry
  costs one token.  Tokens come back with time, ``floor_per_s`` a second (the
  *floor*: what a dead upstream gets, split across the relays of a fleet that
  have turns waiting on it), and with every answered attempt, ``ratio`` each
  (retries in proportion to successes: a busy upstream that fails 30 % of its
  attempts keeps up its retries with no queue).  The bucket holds at most
  ``burst`` tokens.  A lone turn retrying every ``delay_ms`` spends exactly what
  the floor refills (the floor defaults to ``1000 / delay_ms``), so it never
  waits on the pacer.
* **A queue.**  A retry that finds no token takes a ticket and waits in line,
  oldest first.  `pump` hands tokens to the head of the line as they come and
  says when the next is due; the transport wakes exactly the tickets it grants
  (nobody polls, nobody wakes on a timer drawn long ago).
* **The breaker is the slow mode.**  While the upstream's breaker is open or it
  cools off (``Retry-After``), `pump` grants nothing and is next due when that
  ends; a half-open breaker grants the head of the line alone: the probe.
* **Recovery ramps up.**  When the upstream is known good again (a probe or any
  turn got an answer, or a block ended) while tickets wait, the line is released
  on a ramp that doubles every ``ramp_s``: 2, 6, 14, 30, 62, 126, 254 tickets
  after 0.1 ... 0.7 s with the defaults, on top of the bucket's own tokens.  So the
  recovered provider does not get every parked turn in the same millisecond, and a
  line of hundreds is through within a second.  A failure ends the ramp.

Time is a monotonic ``now`` in seconds, passed in.  Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["GRANT_TTL_S", "RAMP_START", "PaceSettings", "Pacer"]

#: the ramp's first step (tickets), doubled every ``ramp_s``
RAMP_START = 2.0
#: a grant nobody claims within this long goes back to the bucket (its turn went away):
#: a pacer's, and a rate limiter's (`core.admission.ratelimit`), both claimed by `relay.pacing`
GRANT_TTL_S = 5.0
#: successes after this many failures in a row are a recovery (delay waits end early)
RECOVERY_STREAK = 3


@dataclass(frozen=True, slots=True)
class PaceSettings:
    """How an upstream's retries are paced (from ``[retry]``)."""

    #: retries per second a failing upstream gets (per relay; a fleet shares it)
    floor_per_s: float = 4.0
    #: tokens an answered attempt gives back (retries in proportion to successes)
    ratio: float = 1.0
    #: the bucket's size: retries that may go at once
    burst: float = 10.0
    #: the release ramp's doubling time after a recovery
    ramp_s: float = 0.1


class Pacer:
    """One upstream's retry pacing (see the module docstring)."""

    __slots__ = (
        "_ramp_t0",
        "_ramp_used",
        "_was_blocked",
        "fail_streak",
        "granted",
        "granted_total",
        "key",
        "queue",
        "settings",
        "share",
        "t",
        "tokens",
        "waited_total",
    )

    def __init__(self, key: str, settings: PaceSettings, now: float = 0.0) -> None:
        self.key = key
        self.settings = settings
        self.tokens = settings.burst
        self.t = now
        #: tickets waiting for a token, oldest first
        self.queue: deque[int] = deque()
        #: tickets granted a token and not yet claimed: ticket -> when granted
        self.granted: dict[int, float] = {}
        self.fail_streak = 0
        #: relays of the fleet with turns waiting here (the floor is split among them)
        self.share = 1
        self.waited_total = 0  # retries that had to wait in line
        self.granted_total = 0
        self._ramp_t0: float | None = None
        self._ramp_used = 0
        self._was_blocked = False

    # -- the bucket -------------------------------------------------------------------
    @property
    def floor(self) -> float:
        return self.settings.floor_per_s / max(1, self.share)

    def _refill(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            self.tokens = min(self.settings.burst, self.tokens + dt * self.floor)
            self.t = now

    def _ramp_allowance(self, now: float) -> float:
        t0 = self._ramp_t0
        if t0 is None:
            return 0.0
        steps = min((now - t0) / self.settings.ramp_s, 40.0)
        return float(RAMP_START * (2.0**steps - 1.0) - self._ramp_used)

    def _ramp_next(self) -> float:
        """When the ramp allows one more ticket (the ramp is on)."""
        assert self._ramp_t0 is not None
        need = (self._ramp_used + 1) / RAMP_START + 1.0
        return self._ramp_t0 + self.settings.ramp_s * math.log2(need)

    @property
    def ramping(self) -> bool:
        return self._ramp_t0 is not None

    def start_ramp(self, now: float) -> None:
        """The upstream is known good again: release the line on the ramp."""
        if self._ramp_t0 is None and self.queue:
            self._ramp_t0 = now
            self._ramp_used = 0

    def _take(self, now: float) -> bool:
        """Spend a token (or a step of the ramp) if one is there."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        if self._ramp_allowance(now) >= 1.0:
            self._ramp_used += 1
            return True
        return False

    # -- a turn's questions -------------------------------------------------------------
    def admit(self, ticket: int, now: float) -> bool:
        """May retry ``ticket`` go now?  True spends a token (or claims a grant).

        False: it waits in line (it keeps its place when it asks again).
        """
        if self.granted.pop(ticket, None) is not None:
            return True
        queue = self.queue
        if (not queue or queue[0] == ticket) and self._take(now):
            if queue:
                queue.popleft()
            return True
        if ticket not in queue:
            queue.append(ticket)
            self.waited_total += 1
        return False

    def peek(self, ticket: int, now: float) -> bool:
        """Would `admit` say yes (nothing is spent, nobody is queued)?"""
        if ticket in self.granted:
            return True
        queue = self.queue
        if queue and queue[0] != ticket:
            return False
        self._refill(now)
        return self.tokens >= 1.0 or self._ramp_allowance(now) >= 1.0

    def withdraw(self, ticket: int) -> None:
        """The turn no longer waits here (it went elsewhere, ended, or went away)."""
        if self.granted.pop(ticket, None) is not None:
            self._refund()
        try:
            self.queue.remove(ticket)
        except ValueError:
            pass

    def requeue(self, ticket: int) -> None:
        """A retry granted the probe could not send it (another instance probes): it
        waits at the head of the line again."""
        self.granted.pop(ticket, None)
        if ticket not in self.queue:
            self.queue.appendleft(ticket)

    def _refund(self) -> None:
        self.tokens = min(self.settings.burst, self.tokens + 1.0)

    # -- outcomes ---------------------------------------------------------------------
    def success(self, now: float) -> bool:
        """An attempt got an answer.  True: a recovery (the upstream had been failing)."""
        self._refill(now)
        self.tokens = min(self.settings.burst, self.tokens + self.settings.ratio)
        recovered = self.fail_streak >= RECOVERY_STREAK
        self.fail_streak = 0
        self.start_ramp(now)
        return recovered

    def failure(self, now: float) -> None:
        """An attempt failed (any failure that counts against the upstream)."""
        self.fail_streak += 1
        self._ramp_t0 = None

    # -- granting ----------------------------------------------------------------------
    def pump(
        self, now: float, *, blocked_until: float = 0.0, probe: bool | None = None
    ) -> tuple[list[int], float | None]:
        """Grant what can go now: (the tickets granted, when to pump next or None).

        ``blocked_until``: the breaker is open or the upstream cools off until then.
        ``probe``: the breaker is half-open: True when its probe slot is free (the head
        alone is granted), False when a probe is out (nothing is, until it reports).
        """
        for ticket, when in list(self.granted.items()):
            if now - when > GRANT_TTL_S:
                del self.granted[ticket]
                self._refund()
        queue = self.queue
        if not queue:
            self._ramp_t0 = None
            return [], None
        if blocked_until > now:
            self._was_blocked = True
            return [], blocked_until
        if probe is not None:
            self._was_blocked = True
            if probe and not self.granted:
                return [self._grant(now)], None
            return [], None
        if self._was_blocked:
            self._was_blocked = False
            self.start_ramp(now)  # the block ended: release on the ramp
        out: list[int] = []
        while queue and self._take(now):
            out.append(self._grant(now))
        if not queue:
            return out, None
        due = self.t + (1.0 - self.tokens) / self.floor if self.floor > 0 else math.inf
        if self._ramp_t0 is not None:
            due = min(due, self._ramp_next())
        return out, max(due, now + 0.001)

    def _grant(self, now: float) -> int:
        ticket = self.queue.popleft()
        self.granted[ticket] = now
        self.granted_total += 1
        return ticket

    def view(self, now: float) -> dict[str, Any]:
        """For /status and metrics."""
        self._refill(now)
        return {
            "tokens": round(self.tokens, 2),
            "waiting": len(self.queue),
            "ramping": self.ramping,
            "floor_per_s": round(self.floor, 3),
            "fleet_share": self.share,
            "waited_total": self.waited_total,
        }
