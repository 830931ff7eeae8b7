"""The bridge from the turn machine to the observers.

`HooksObserver` implements `unbroken.core.turn.machine.TurnObserver`: the machine says what
happened (an attempt started, ended or failed; the turn's state changed), and the
reporter keeps the turn's log-safe record (`TurnRecord`, `AttemptInfo`) and calls the
hooks.  Every transport uses it, so the bookkeeping is written once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from unbroken.core.admission.policy import Failure
from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.turn.machine import OK_OUTCOMES, Outcome, Phase, TurnState
from unbroken.core.wire.protocols import model_answered
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord

__all__ = ["HooksObserver"]

#: each enum member's value, read once (``member.value`` is a descriptor call, per event)
_VALUE: dict[Outcome | Phase | TurnState, str] = {
    m: m.value for e in (Outcome, Phase, TurnState) for m in e
}


_DONE, _WAITING = TurnState.DONE.value, TurnState.WAITING.value


class HooksObserver:
    """One turn's record and its hook calls."""

    __slots__ = (
        "_deferred",
        "_parked",
        "_queued_at",
        "_waiting",
        "current",
        "hooks",
        "inflight",
        "info",
        "upstreams",
        "wall",
    )

    def __init__(
        self,
        info: TurnRecord,
        hooks: Hooks,
        upstreams: Sequence[str],
        inflight: set[TurnRecord],
        *,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.info, self.hooks, self.upstreams, self.inflight = info, hooks, upstreams, inflight
        self.wall = wall
        self.current: AttemptInfo | None = None
        self._deferred = False
        self._parked: str | None = None  # why the turn waits in line for its next attempt
        self._queued_at: float | None = None  # parked for the rate limit since then
        self._waiting: tuple[float, float] | None = None  # (since, planned) of a retry wait

    # -- the turn ------------------------------------------------------------------------
    def open(self, *, defer: bool = False) -> None:
        """The turn started (it is in flight from now).

        ``defer``: hold back the ``turn_started`` and first ``attempt_started`` hook
        calls until `flush` (the HTTP transport runs it once its upstream request is
        on its way, so the observers' work is not on the path to the provider).  Any
        other report flushes first: the observers see the same calls in the same order.
        """
        self.inflight.add(self.info)
        if defer:
            self._deferred = True
        else:
            self.hooks.turn_started(self.info)

    def flush(self) -> None:
        """Make the hook calls that `open` held back (free when there are none)."""
        if not self._deferred:
            return
        self._deferred = False
        self.hooks.turn_started(self.info)
        if self.current is not None:
            self.hooks.attempt_started(self.info, self.current.upstream)

    def close(self, outcome: Outcome) -> None:
        """The turn ended: settle its outcome and report it (once)."""
        info = self.info
        if info.ended is not None:
            return
        self.flush()
        info.outcome = _VALUE[outcome]
        if self.current is not None and self.current.ended is None:
            self.attempt_ended(
                "ok" if outcome in OK_OUTCOMES else _VALUE[outcome],
                None if outcome in OK_OUTCOMES else _PHASE_COMMITTED,
                None,
                None,
            )
        self.inflight.discard(info)
        self._end_queue()
        self._end_wait()
        info.state = _DONE
        info.ended = self.wall()
        info.held = None
        self.hooks.turn_ended(info)

    # -- TurnObserver ----------------------------------------------------------------------
    def attempt_started(self, number: int, upstream: int, choice: str = "") -> None:
        if self._deferred and self.current is not None:
            self.flush()  # only the first attempt's call is held back
        info = self.info
        name = self.upstreams[upstream]
        info.attempts, info.upstream, info.next_retry_at = number, name, None
        queued = info.queued_s
        if self._queued_at is not None:
            self._end_queue()
        if self._waiting is not None:
            self._end_wait()
        # (by position: a class called with keywords packs them into a dict, then out)
        self.current = AttemptInfo(number, name, self.wall(), None, None, "", "", choice)
        if self._parked is not None:
            self.current.parked_for, self._parked = self._parked, None
            self.current.queued_s = info.queued_s - queued
        info.attempt_log.append(self.current)
        if not self._deferred:
            self.hooks.attempt_started(info, name)

    def attempt_ended(
        self, reason: str, phase: Phase | None, status: int | None, stats: AttemptStats | None
    ) -> None:
        a = self.current
        if a is None or a.ended is not None:
            return
        self.flush()
        a.ended = self.wall()
        a.reason, a.phase = reason, _VALUE[phase] if phase is not None else ""
        if status is not None:
            a.status = status
        if stats is not None:
            a.frames_received, a.bytes_received = stats.received_frames, stats.received_bytes
            a.frames_released, a.bytes_released = stats.released_frames, stats.released_bytes
            a.hold_seconds = stats.hold_seconds
            a.input_tokens, a.output_tokens = stats.usage()
            a.est_output_tokens = stats.output_frames
            if stats.first_raw:
                a.response_model = model_answered(stats.first_raw)
        self.hooks.attempt_ended(self.info, a)

    def attempt_failed(self, failure: Failure, phase: Phase, wait_s: float | None) -> None:
        self.flush()
        info = self.info
        info.last_failure = failure.label
        if wait_s is not None:
            now = self.wall()
            info.next_retry_at = now + wait_s
            info.state = _WAITING
            self._waiting = (now, wait_s)
            if self.current is not None:
                self.current.wait_s = wait_s
        upstream = self.current.upstream if self.current is not None else info.upstream
        self.hooks.attempt_failed(info, upstream, failure, phase=_VALUE[phase], wait_s=wait_s)

    def state(self, state: TurnState) -> None:
        self.info.state = _VALUE[state]

    def parked(self, why: str) -> None:
        self.info.parked_for = self._parked = why
        if why == "ratelimit":
            if self._queued_at is None:
                self._queued_at = self.wall()
        else:
            self._end_queue()

    def _end_queue(self) -> None:
        """A wait for the rate limit ended: count it in ``queued_s``."""
        at = self._queued_at
        if at is not None:
            self._queued_at = None
            self.info.queued_s += max(0.0, self.wall() - at)

    def _end_wait(self) -> None:
        """A retry wait ended (the next attempt starts, or the turn ends during it):
        count the time it really took, at most the wait planned, in ``waited_s``."""
        waiting = self._waiting
        if waiting is not None:
            self._waiting = None
            since, planned = waiting
            self.info.waited_s += min(planned, max(0.0, self.wall() - since))

    def hold_overflow(self, held_bytes: int) -> None:
        self.flush()
        self.hooks.hold_overflow(self.info, held_bytes)

    def continuation(self, result: str, splices: int, saved_frames: int) -> None:
        self.flush()
        info = self.info
        info.splices, info.saved_tokens, info.continuation = splices, saved_frames, result
        self.hooks.continuation(info, result)

    def uncovered(self, result: str) -> None:
        self.info.continuation = result  # (no hook call: the turn's end carries it)

    def headers_sent(self) -> None:
        if self.info.first_byte_at is None:
            self.info.first_byte_at = self.wall()


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_PHASE_COMMITTED = Phase.COMMITTED
