"""How attempts and turns end: an attempt's body ending or failing (`_body_ended`,
`_transport_failed`), the verdicts (replay, the end, the kept answer), the retry or
give-up after a failed attempt, and the end from outside (the client gone, a crash).
A part of `TurnMachine`: methods only, on `TurnFields`.
"""

from __future__ import annotations

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.profiles import CommitEnd
from unbroken.core.turn.ledger import Ledger, LedgerState, Verdict
from unbroken.core.turn.turn_clock import queued_failure, stall_failure
from unbroken.core.turn.turn_continue import strategy_splices
from unbroken.core.turn.turn_fields import TurnFields, is_testing
from unbroken.core.turn.turn_table import (
    ANSWER_KEPT,
    FIRST_FRAME,
    LEGAL,
    NOTHING_SENT,
    QUEUED,
    TERMINATED,
    WATCHING,
    Outside,
    Step,
    TurnEvent,
)
from unbroken.core.turn.turn_types import (
    Action,
    End,
    EndKind,
    GiveUp,
    GiveUpKind,
    Outcome,
    Phase,
    TurnState,
    Wait,
)
from unbroken.core.wire.protocols import BODY

__all__ = ["TurnEndings"]

#: where an attempt (or a continuation) waits for its answer
_OPENING = LEGAL[TurnEvent.ANSWERED]


class TurnEndings(TurnFields):
    """Verdicts, retries, giving up, and the end from outside."""

    __slots__ = ()

    # -- the guards of `transport_failed` and `body_ended` (`turn_guards.GUARDS`) --------
    # (`TurnMachine` runs each list in order; ``when`` holds, ``then`` decides or declines)
    def _opening(self) -> bool:
        return self.step in _OPENING

    def _unread(self) -> bool:
        return self.attempt_ledger is None

    def _terminal_out(self) -> bool:
        ledger = self.attempt_ledger
        return ledger is not None and ledger.state is _LEDGER_DONE

    def _continuable(self) -> bool:
        return self.continuation is not None and self.step is _STEP_STREAM

    def _read_failure(self, failure: Failure) -> Failure:
        """A read failure of an attempt aborted by the clock is named by its watch."""
        watch = self.watch
        if watch in WATCHING:
            return failure
        return queued_failure() if watch is QUEUED else stall_failure()

    def _unread_failed(self, now: float, failure: Failure) -> Action:
        failure = self._read_failure(failure)
        return self._attempt_failed(now, failure, self._replay_phase(failure))

    def _tail_cut(self, now: float, failure: Failure) -> Action:
        # The turn is complete: finish the protocol's ending, record the cut.
        self._record_tail_cut(self._read_failure(failure))
        return self._end(self._ok_outcome(), End(_END_CLEAN, self._tail_bytes()))

    def _continue_cut(self, now: float, failure: Failure) -> Action | None:
        return self._continue(now, self._read_failure(failure))

    def _cut(self, now: float, failure: Failure) -> Action:
        failure = self._read_failure(failure)
        ledger = self.attempt_ledger
        assert ledger is not None
        return self._verdict_action(now, failure, ledger.failed(failure.reason))

    def _unwatched(self) -> bool:
        return self.watch not in WATCHING

    def _plain_body(self) -> bool:
        ledger = self.attempt_ledger
        return ledger is not None and ledger.protocol is BODY

    def _terminal_missing(self) -> bool:
        ledger = self.attempt_ledger
        return self.continuation is not None and ledger is not None and ledger.protocol.has_terminal

    def _stalled_end(self, now: float) -> Action:
        return self._transport_failed(now, stall_failure())

    def _plain_end(self, now: float) -> Action:
        ledger = self.attempt_ledger
        assert ledger is not None
        ledger.ended()
        outcome = self._ok_outcome() if (self.status or 0) < 400 else _OUTCOME_PASSED_THROUGH_ERROR
        return self._end(outcome, End(_END_CLEAN))

    def _clean_end(self, now: float) -> Action:
        return self._end(self._ok_outcome(), End(_END_CLEAN, self._tail_bytes()))

    def _continue_truncated(self, now: float) -> Action | None:
        cut = Failure(_FAILURE_TRUNCATED, "stream ended without a terminal frame")
        return self._continue(now, cut)

    def _judged_end(self, now: float) -> Action:
        ledger = self.attempt_ledger
        assert ledger is not None
        pending = self._splitter.pending if self._splitter is not None else b""
        out = ledger.ended(pending)
        if ledger.verdict is _VERDICT_DONE:  # generic SSE: a clean end is its success
            return self._end(self._ok_outcome(), End(_END_CLEAN))
        failure = Failure(_FAILURE_TRUNCATED, "stream ended without a terminal frame")
        return self._verdict_action(now, failure, out)

    # -- verdicts -----------------------------------------------------------------------
    def _verdict_action(self, now: float, failure: Failure | None, out: bytes = b"") -> Action:
        ledger = self.attempt_ledger
        assert ledger is not None
        verdict = ledger.verdict
        if verdict is _VERDICT_REPLAY:
            if failure is None:
                cls = (
                    _FAILURE_MALFORMED
                    if ledger.fail_reason == "malformed frame"
                    else _FAILURE_STREAM_ERROR
                )
                failure = Failure(cls, ledger.fail_reason)
            if self.continuation is not None:
                self._abandon()  # the replay starts a new response: nobody reads this one
            return self._attempt_failed(now, failure, self._replay_phase(failure))
        if verdict is _VERDICT_DONE:
            return self._end(self._ok_outcome(), End(_END_CLEAN, self._tail_bytes()))
        # FAIL
        if ledger.passed_through:
            # The provider's own final error frame was released with the frames.
            return self._end(_OUTCOME_PASSED_THROUGH_ERROR, End(_END_CLEAN))
        if failure is None:
            failure = Failure(_FAILURE_STREAM_ERROR, ledger.fail_reason)
        self._committed_failure(failure)
        if ledger.protocol is BODY or self.abort_after_commit:
            # A plain body has no error event; a profile may ask for the abort too.
            return self._end(_OUTCOME_ENDED_WITH_ERROR, End(_END_ABORT))
        # ``out`` is the native error when it came from failed()/ended(); an in-stream
        # error frame's native error was already released by feed().
        return self._end(_OUTCOME_ENDED_WITH_ERROR, End(_END_ERROR, out))

    @property
    def abort_after_commit(self) -> bool:
        """A stream cut after commit ends by aborting the client connection, not with
        the native error event (the profile's ``after_commit_end``; HTTP only)."""
        return self._profile.after_commit_end is _COMMIT_END_RESET and not self.socket

    def _replay_phase(self, failure: Failure) -> Phase:
        if failure.cls is _FAILURE_STALL:
            return _PHASE_STALL
        if failure.status is not None:
            return _PHASE_HEADERS
        stats = self.stats
        if failure.cls.reroutes_at_once and (stats is None or stats.received_frames == 0):
            return _PHASE_CONNECT
        return _PHASE_PENDING

    def _attempt_failed(self, now: float, failure: Failure, phase: Phase) -> Action:
        """An attempt failed before commit: record it, then wait, retry or give up."""
        self.failure = failure
        self._set_watch(FIRST_FRAME)
        report = self.report
        report.attempt_ended(failure.label, phase, self.status, self.stats)
        retry = self.retry
        if retry.exhausted():
            report.attempt_failed(failure, phase, None)
            return self._give_up()
        wait = retry.record_failure(failure, now)
        if retry.quota_wall:
            # The quota is spent and no other upstream can take the turn: the
            # provider's answer goes to the client; never retry into a quota wall.
            report.attempt_failed(failure, phase, None)
            return self._give_up()
        report.attempt_failed(failure, phase, wait)
        report.state(_STATE_WAITING)
        return self._wait_or_next(now, wait)

    def _wait_or_next(self, now: float, wait: float) -> Action:
        """After a failed attempt (or a cut to continue): its `Wait`, or the next
        attempt at once (no wait, or testing mode)."""
        if wait > 0 and not is_testing():
            keys = self.retry.keys
            return Wait(wait, keys[self.retry.current] if keys else None)
        return self._next_attempt(now)

    def _committed_failure(self, failure: Failure) -> None:
        """The attempt failed after output reached the client: no replay, ever."""
        self.failure = failure
        self.report.attempt_ended(failure.label, _PHASE_COMMITTED, self.status, self.stats)
        self.report.attempt_failed(failure, _PHASE_COMMITTED, None)

    def _record_tail_cut(self, failure: Failure) -> None:
        self.report.attempt_ended(failure.label, _PHASE_TAIL, self.status, self.stats)
        self.report.attempt_failed(failure, _PHASE_TAIL, None)

    def _tail_bytes(self) -> bytes:
        """What the protocol's ending still lacks after its terminal frame."""
        if self.reply is TERMINATED or self.protocol.done_marker is None:
            return b""
        self._set_reply(TERMINATED)
        return self.protocol.done_marker

    def _give_up(self) -> GiveUp:
        failure = self.failure
        reason = failure.reason if failure else "retries exhausted"
        if self.continuation is not None:
            self._abandon()
        self.retry.close()
        if self.reply is not NOTHING_SENT:
            ledger = self.ledger or Ledger(
                self.protocol, hold=self.hold, wall_clock=self.wall_clock
            )
            data = ledger.give_up(f"retries exhausted ({reason})")
            self._outcome = _OUTCOME_ENDED_WITH_ERROR
            return GiveUp(_GIVE_UP_IN_STREAM, data)
        self._outcome = _OUTCOME_PASSED_THROUGH_ERROR
        if self.kept is ANSWER_KEPT and failure is not None and failure.status is not None:
            return GiveUp(_GIVE_UP_PASS_THROUGH)
        return GiveUp(
            _GIVE_UP_BAD_GATEWAY,
            self.protocol.error_body(f"unbroken: all upstream attempts failed ({reason})"),
        )

    def _end(self, outcome: Outcome, action: End) -> End:
        if self.continuation is not None and not outcome.is_ok:
            self._abandon()
        retry = self.retry
        if retry.admitted:  # the rate limiter learns what the request cost
            stats = self.stats
            retry.settle(self.last_rx, stats.usage()[0] if stats else None)
        retry.close()
        self._outcome = outcome
        if outcome.is_ok or outcome is _OUTCOME_PASSED_THROUGH_ERROR:
            ok = outcome.is_ok
            self.report.attempt_ended("ok" if ok else outcome.value, None, self.status, self.stats)
        self.report.state(_STATE_DONE)
        return action

    def _ok_outcome(self) -> Outcome:
        if self.continuation is not None and strategy_splices(self.continuation):
            return _OUTCOME_RESUMED
        return _OUTCOME_RECOVERED if self.retry.retries else _OUTCOME_OK

    # -- the end from outside -------------------------------------------------------------
    def client_gone(self) -> Outcome:
        """The client went away (or the turn was cancelled).  Returns the final outcome.

        A turn whose terminal frame was released is complete, even if the client
        closes a moment later: it stays ``ok``.
        """
        if self._outcome is None:
            ledger = self.ledger
            if ledger is not None and ledger.state is _LEDGER_DONE:
                self._outcome = self._ok_outcome()
                self.report.attempt_ended("ok", None, self.status, self.stats)
            else:
                self._outcome = _OUTCOME_ABORTED_BY_CLIENT
                if self.continuation is not None:
                    self._abandon()  # nobody reads the response any more
                committed = ledger is not None and ledger.state is not _LEDGER_PENDING
                self.report.attempt_ended(
                    _OUTCOME_ABORTED_BY_CLIENT.value,
                    _PHASE_COMMITTED if committed or self.reply is not NOTHING_SENT else None,
                    self.status,
                    self.stats,
                )
        self._moved(self.step, _OUTSIDE_CLIENT_GONE)
        self.retry.close()
        return self._outcome

    def crashed(self) -> Outcome:
        """A bug in the relay ended the turn."""
        if self._outcome is None or self.step is not _STEP_ENDED:
            self._outcome = _OUTCOME_INTERNAL_ERROR
            self.report.attempt_ended(_OUTCOME_INTERNAL_ERROR.value, None, self.status, self.stats)
        self._moved(self.step, _OUTSIDE_CRASHED)
        self.retry.close()
        return self._outcome

    def shutdown_error(self) -> bytes:
        """The relay shuts down mid-stream: the native error for a committed stream, or b""."""
        ledger = self.ledger
        if ledger is None or ledger.state is not _LEDGER_COMMITTED or self.reply is NOTHING_SENT:
            return b""
        return ledger.failed("the relay is shutting down")  # b"" for a reset profile


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_COMMIT_END_RESET = CommitEnd.RESET
_END_ABORT = EndKind.ABORT
_END_CLEAN = EndKind.CLEAN
_END_ERROR = EndKind.ERROR
_FAILURE_MALFORMED = FailureClass.MALFORMED
_FAILURE_STALL = FailureClass.STALL
_FAILURE_STREAM_ERROR = FailureClass.STREAM_ERROR
_FAILURE_TRUNCATED = FailureClass.TRUNCATED
_GIVE_UP_BAD_GATEWAY = GiveUpKind.BAD_GATEWAY
_GIVE_UP_IN_STREAM = GiveUpKind.IN_STREAM
_GIVE_UP_PASS_THROUGH = GiveUpKind.PASS_THROUGH
_LEDGER_COMMITTED = LedgerState.COMMITTED
_LEDGER_DONE = LedgerState.DONE
_LEDGER_PENDING = LedgerState.PENDING
_OUTCOME_ABORTED_BY_CLIENT = Outcome.ABORTED_BY_CLIENT
_OUTCOME_ENDED_WITH_ERROR = Outcome.ENDED_WITH_ERROR
_OUTCOME_INTERNAL_ERROR = Outcome.INTERNAL_ERROR
_OUTCOME_OK = Outcome.OK
_OUTCOME_PASSED_THROUGH_ERROR = Outcome.PASSED_THROUGH_ERROR
_OUTCOME_RECOVERED = Outcome.RECOVERED
_OUTCOME_RESUMED = Outcome.RESUMED
_OUTSIDE_CLIENT_GONE = Outside.CLIENT_GONE
_OUTSIDE_CRASHED = Outside.CRASHED
_PHASE_COMMITTED = Phase.COMMITTED
_PHASE_CONNECT = Phase.CONNECT
_PHASE_HEADERS = Phase.HEADERS
_PHASE_PENDING = Phase.PENDING
_PHASE_STALL = Phase.STALL
_PHASE_TAIL = Phase.TAIL
_STATE_DONE = TurnState.DONE
_STATE_WAITING = TurnState.WAITING
_STEP_ENDED = Step.ENDED
_STEP_STREAM = Step.STREAM
_VERDICT_DONE = Verdict.DONE
_VERDICT_REPLAY = Verdict.REPLAY
