"""The turn machine's clock: early headers, keepalives, stalls, and the pause of the
stall clock while a write to the client blocks (``Deadlines`` in `unbroken.core.turn.machine`'s
header).  A part of `TurnMachine`: methods only, on `TurnFields`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.profiles import Profile
from unbroken.core.turn.ledger import LedgerState
from unbroken.core.turn.turn_fields import TurnFields
from unbroken.core.turn.turn_table import (
    HEADERS_SENT,
    IDLE,
    NOTHING_SENT,
    OVER,
    QUEUED,
    READING,
    STALLED,
    WATCHING,
    Step,
)
from unbroken.core.turn.turn_types import (
    KEEPALIVE,
    AbortUpstream,
    Keepalive,
    SendHeaders,
    TimerAction,
    Timers,
)

__all__ = ["TurnClock", "queued_failure", "stall_failure", "stall_timers"]


class TurnClock(TurnFields):
    """The clock's events (`headers_sent`, `write_started`, `wrote`, `tick`) and
    `deadline`."""

    __slots__ = ()

    @property
    def keepalive_bytes(self) -> bytes:
        """What a keepalive write sends: the profile's or protocol's event, or a comment."""
        return self.keepalive_event if self.keepalive_event is not None else KEEPALIVE

    def headers_sent(self, now: float) -> None:
        """The transport sent the response headers (early, or with the first bytes)."""
        if self.step is _STEP_ERROR:
            self._illegal("headers_sent")
        if self.reply is NOTHING_SENT:
            self._set_reply(HEADERS_SENT)
            self.report.headers_sent()
        self.last_tx = now

    def write_started(self, now: float) -> None:
        """A write to the client begins: the stall clock stops until it completes."""
        if self.step is _STEP_ERROR:
            self._illegal("write_started")
        if not self.writing:
            self._write_t0 = now
        self.writing += 1

    def wrote(self, now: float) -> None:
        """A write to the client completed (or failed).

        A write is never upstream activity: a keepalive, or output, says nothing
        about whether the upstream is still sending.  But time the transport spent
        blocked on a slow client is not upstream silence either (it read nothing
        meanwhile), so the stall clock stood still while writes were in progress:
        the last byte's time (and the attempt's first-frame clock) move forward by
        the blocked time, not to ``now``.  A byte that arrived during the write
        counts from the write's end.
        """
        if self.step is _STEP_ERROR or not self.writing:
            self._illegal("wrote")
        self.last_tx = now
        self.writing -= 1
        if self.writing:
            return
        t0 = self._write_t0
        blocked = now - t0
        if blocked > 0:
            rx = self.last_rx
            self.last_rx = (rx if rx < t0 else t0) + blocked
            a0 = self._attempt_t0
            self._attempt_t0 = (a0 if a0 < t0 else t0) + blocked

    @property
    def min_interval(self) -> float:
        """The shortest interval from an event to the deadline it sets (early headers
        from the start, a stall from the answer or the last frame, a keepalive from
        the last write).  A timer armed no later than this from now is never late for
        a deadline that a later event sets (see `relay.watchdog.Watchdog`)."""
        t, p = self.timers, self._profile
        intervals = (
            p.early_headers_s or t.early_headers_s,
            p.keepalive_s or t.keepalive_s,
            t.idle_timeout_s,
            t.first_frame_timeout_s,
        )
        return min([i for i in intervals if i > 0], default=60.0)

    def deadline(self) -> float | None:
        """When `tick` is next due, or None when nothing is timed."""
        if self.step in OVER:
            return None
        t = self.timers
        p = self._profile
        due: float | None = None
        if self.stream or self.socket:
            if self.reply is NOTHING_SENT:
                if p.early_headers and (
                    self.ledger is None or self.ledger.state is _LEDGER_PENDING
                ):
                    due = self.t0 + (p.early_headers_s or t.early_headers_s)
            elif not self.writing and (self.keepalive_event is not None or not self.socket):
                due = self.last_tx + (p.keepalive_s or t.keepalive_s)
        watch = self.watch
        if self.step in READING and not self.writing and watch in WATCHING:
            stall = (
                self.last_rx + t.idle_timeout_s
                if watch is IDLE
                else self._attempt_t0 + t.first_frame_timeout_s
            )
            splice = self._splice
            if splice is not None and not splice.progressed:
                queued = self._resume_t0 + self.queued_s
                if queued < stall:
                    stall = queued
            if due is None or stall < due:
                due = stall
        return due

    def tick(self, now: float) -> TimerAction | None:
        """The clock: returns what is due now (at most one thing), or None."""
        if self.step in OVER:
            return None
        t = self.timers
        watch = self.watch
        if self.step in READING and not self.writing and watch in WATCHING:
            due = (
                self.last_rx + t.idle_timeout_s
                if watch is IDLE
                else self._attempt_t0 + t.first_frame_timeout_s
            )
            splice = self._splice
            queued = (
                self._resume_t0 + self.queued_s
                if splice is not None and not splice.progressed
                else math.inf
            )
            # Both may be due at a late tick (a loaded machine): the earlier deadline is
            # what happened (a continuation stuck in ``queued`` then read as a stall was
            # resumed again instead of given up and replayed).
            if now >= queued and queued <= due:
                # The continuation shows no progress (a response stuck in ``queued``):
                # give it up (it is cancelled); replayed if nothing was released.
                self._set_watch(QUEUED)
                return AbortUpstream(queued_failure())
            if now >= due:
                self._set_watch(STALLED)
                return AbortUpstream(stall_failure())
        p = self._profile
        if self.stream or self.socket:
            if self.reply is NOTHING_SENT:
                ledger = self.ledger
                early = self.t0 + (p.early_headers_s or t.early_headers_s)
                if (
                    p.early_headers
                    and now >= early
                    and (ledger is None or ledger.state is _LEDGER_PENDING)
                ):
                    # Retries or held frames have lasted long: send SSE headers now so
                    # the client's header timer does not fire; keepalives follow.
                    self._set_reply(HEADERS_SENT)
                    self.last_tx = now
                    self.report.headers_sent()
                    return SendHeaders(200)
            elif (
                not self.writing
                and (self.keepalive_event is not None or not self.socket)
                and now >= self.last_tx + (p.keepalive_s or t.keepalive_s)
            ):
                self.last_tx = now
                if self.keepalive_event is not None:
                    return Keepalive(self.keepalive_event)  # the client's timer ignores comments
                return Keepalive(KEEPALIVE)
        return None


@dataclass(frozen=True, slots=True)
class _ProfileTimers:
    """`Timers` with a client profile's stall timers in place of ``[stream]``'s."""

    header_timeout_s: float
    first_frame_timeout_s: float
    idle_timeout_s: float
    keepalive_s: float
    early_headers_s: float
    max_hold_bytes: int
    max_event_bytes: int


def stall_timers(timers: Timers, profile: Profile) -> Timers:
    """``timers``, with the profile's stall timers (`Profile.stall_timeouts`)."""
    first_frame, idle = profile.stall_timeouts(timers.first_frame_timeout_s, timers.idle_timeout_s)
    if first_frame == timers.first_frame_timeout_s and idle == timers.idle_timeout_s:
        return timers
    return _ProfileTimers(
        timers.header_timeout_s,
        first_frame,
        idle,
        timers.keepalive_s,
        timers.early_headers_s,
        timers.max_hold_bytes,
        timers.max_event_bytes,
    )


def stall_failure() -> Failure:
    return Failure(_FAILURE_STALL, "stall: the upstream went silent past its timeout")


def queued_failure() -> Failure:
    return Failure(_FAILURE_STALL, "stall: the continuation made no progress (queued)")


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_FAILURE_STALL = FailureClass.STALL
_LEDGER_PENDING = LedgerState.PENDING
_STEP_ERROR = Step.ERROR
