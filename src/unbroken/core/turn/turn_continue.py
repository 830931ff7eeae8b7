"""The turn machine's continuation hooks: where a cut after commit is continued in
place (`core.turn.continuation`), its answer read, its join checked, or the cut refused
(``Continuation after commit`` in `unbroken.core.turn.machine`'s header).  A part of
`TurnMachine`: methods only, on `TurnFields`.
"""

from __future__ import annotations

from collections.abc import Sequence

from unbroken.core.admission.policy import Failure, FailureClass, is_retryable_status
from unbroken.core.turn.continuation import Cancel, JoinBroken, Refusal, Resume, Strategy
from unbroken.core.turn.ledger import NOTHING, Ledger, LedgerState, Verdict
from unbroken.core.turn.turn_fast_path import joined
from unbroken.core.turn.turn_fields import TurnFields
from unbroken.core.turn.turn_table import (
    AS_SENT,
    FIRST_FRAME,
    NOTHING_SENT,
    QUEUED,
    Step,
)
from unbroken.core.turn.turn_types import (
    Action,
    End,
    EndKind,
    GiveUp,
    GiveUpKind,
    Outcome,
    Phase,
    Stream,
    TurnState,
)
from unbroken.core.wire.protocols.prefill import PrefillRefusal
from unbroken.core.wire.sse import Event, SSESplitter

__all__ = ["ContinuationHooks", "strategy_splices"]


class ContinuationHooks(TurnFields):
    """The machine's side of `core.turn.continuation`."""

    __slots__ = ()

    def _cut_by_error(self, now: float, ledger: Ledger) -> Sequence[Event]:
        """A provider's retryable error event after commit, with a strategy that may
        continue it (`Strategy.continues_errors`): a cut like a reset.  Continued, the
        attempt is over (`Fed.over`); else the native error, as always."""
        ledger.verdict = Verdict.CONTINUE  # the cut, decided here
        action = self._continue(now, Failure(FailureClass.STREAM_ERROR, "in-stream error"))
        if action is not None:
            self._over = action
            return NOTHING
        return ledger.error_failed()

    def _record(self, data: bytes) -> None:
        """What was released, for a strategy that reads it back (a prefill
        continuation: `Strategy.wants_released`).  Only with a strategy."""
        strategy = self.continuation
        if strategy is not None and strategy.wants_released:
            strategy.released(data)

    def _record_events(self, events: Sequence[Event]) -> None:
        strategy = self.continuation
        if strategy is not None and strategy.wants_released:
            strategy.released(joined(events))

    def _feed_spliced(self, now: float, events: list[Event]) -> Sequence[Event]:
        """A continuation's frames: each through its join check, then the ledger."""
        splice = self._splice
        assert splice is not None
        joined: list[Event] = []
        broken: str | None = None
        for event in events:
            try:
                out = splice.splice(event)
            except JoinBroken as exc:
                broken = str(exc)
                break
            if out is None:
                continue
            if isinstance(out, Event):
                joined.append(out)
            else:
                joined.extend(out)  # a splicer may absorb one frame and add another
        splice_off, self._splice = self._splice, None  # _feed_events: the plain path
        try:
            released = self._feed_events(now, joined) if joined else NOTHING
        finally:
            if self._over is None and not self.ended:
                self._splice = splice_off
        if broken is not None and self._over is None and not self.ended:
            self._over = self._join_broken(now, broken)
        return released

    def _continue(self, now: float, failure: Failure) -> Action | None:
        """A cut where the turn would end (or replay): continue it in place if the
        strategy can (the next attempt is its `Resume`, paced like any retry), else
        None: the caller ends the turn exactly as without a strategy."""
        strategy = self.continuation
        ledger = self.ledger
        if strategy is None or ledger is None or self.attempt_ledger is not ledger:
            return None
        if ledger.verdict is not Verdict.CONTINUE or (
            ledger.state is not LedgerState.PENDING and ledger.state is not LedgerState.COMMITTED
        ):
            return None
        committed = ledger.state is LedgerState.COMMITTED
        if self.watch is QUEUED:
            self._refused(Refusal.QUEUED)  # given up (and cancelled); PENDING: replayed
            return None
        if failure.cls is FailureClass.MALFORMED:
            if committed:
                self._refused(Refusal.NOT_A_CUT)
            return None
        plan = strategy.plan(self.retry.current, ledger, self.timers.header_timeout_s)
        if not isinstance(plan, Resume):
            if committed:  # (PENDING: nothing was released, a replay as always)
                self._refused(plan)
            return None
        phase = Phase.COMMITTED if committed else self._replay_phase(failure)
        self.failure = failure
        self.watch = FIRST_FRAME
        self._splice = None
        self.step = Step.IDLE
        self._resume = plan
        report = self.report
        report.attempt_ended(failure.label, phase, self.status, self.stats)
        report.continuation("spliced", strategy_splices(strategy), strategy.saved_frames)
        wait = self.retry.resume_delay(failure)
        report.attempt_failed(failure, phase, wait)
        report.state(TurnState.WAITING)
        return self._wait_or_next(now, wait)

    def _refused(self, refusal: Refusal | PrefillRefusal) -> None:
        """The cut is not continued: the turn goes on as without a strategy."""
        self.refusal = refusal
        strategy = self.continuation
        if strategy is not None:
            self.report.continuation(
                f"refused_{refusal.value}", strategy_splices(strategy), strategy.saved_frames
            )

    def _resume_answered(
        self, now: float, status: int, *, sse: bool, retry_after_s: float | None
    ) -> Action:
        """The continuation's answer: its stream goes on through the join check into
        the turn's ledger; a retryable status is another cut; any other answer (404,
        400, a JSON body) does not continue the turn."""
        ledger = self.ledger
        strategy = self.continuation
        assert ledger is not None and strategy is not None
        if 200 <= status < 300 and sse:
            self.retry.record_answer(now)
            ledger.resume_attempt(self.stats)
            released = strategy.rewind()
            if released is not None:
                ledger.rewind(released)
            self.attempt_ledger = ledger
            self._splice = strategy.splicer()
            self._splitter = SSESplitter(self.timers.max_event_bytes)
            self._reading(now, Step.STREAM)
            self._resume_t0 = now
            self.report.state(
                TurnState.HOLDING if ledger.state is LedgerState.PENDING else TurnState.STREAMING
            )
            return Stream()
        failure = Failure(
            FailureClass.STATUS, f"HTTP {status}", status=status, retry_after_s=retry_after_s
        )
        if status < 200 or is_retryable_status(status):
            return self._continuation_failed(now, failure)
        # A final answer to the continuation (a model that refuses prefill answers 400):
        # the strategy may remember it for the upstream (the mechanism is refused:
        # ``not_resumable``); the turn ends as without it.
        mechanism = strategy.refused(self.retry.current, status, b"")
        return self._join_broken(
            now,
            f"the continuation was answered HTTP {status}",
            Refusal.NOT_RESUMABLE if mechanism else Refusal.JOIN,
        )

    def _continuation_failed(self, now: float, failure: Failure) -> Action:
        """Opening a continuation failed (connect, headers, a retryable status): the
        response still runs, so another continuation may follow (bounded)."""
        self.step = Step.STREAM  # the cut attempt's ledger decides, as for any cut
        action = self._continue(now, failure)
        if action is not None:
            return action
        ledger = self.ledger
        assert ledger is not None
        self.attempt_ledger = ledger
        return self._verdict_action(now, failure, ledger.failed(failure.reason))

    def _join_broken(self, now: float, reason: str, refusal: Refusal = Refusal.JOIN) -> Action:
        """The continuation does not continue what the client saw: never splice it.
        Committed, the turn ends with the native error; else it is replayed."""
        self._splice = None
        self._refused(refusal)
        failure = Failure(FailureClass.STREAM_ERROR, f"continuation refused: {reason}")
        ledger = self.ledger
        assert ledger is not None
        self.attempt_ledger = ledger
        if self.step is Step.RESUMING:
            self.step = Step.STREAM
        return self._verdict_action(now, failure, ledger.failed(failure.reason))

    def _patched_refused(self, now: float, status: int, body: bytes) -> Action:
        """A final 4xx to a patched request: a refusal of the mechanism is remembered
        and the attempt made again with the client's request (nothing was released);
        any other is the provider's final answer, as always."""
        strategy = self.continuation
        assert strategy is not None
        failure = self.failure
        if strategy.refused(self.retry.current, status, body):
            self.request = AS_SENT
            self.report.attempt_ended("continuation_refused", Phase.HEADERS, status, self.stats)
            self._refused(Refusal.NOT_RESUMABLE)
            self.step = Step.IDLE
            return self._next_attempt(now)
        if self.reply is not NOTHING_SENT:
            return self._end(
                Outcome.PASSED_THROUGH_ERROR,
                End(EndKind.ERROR, self.protocol.final_error_frame(status, body, None)),
            )
        self.failure = failure
        self.step = Step.ENDED
        self.retry.close()
        self._outcome = Outcome.PASSED_THROUGH_ERROR
        self.report.attempt_ended(Outcome.PASSED_THROUGH_ERROR.value, None, status, self.stats)
        self.report.state(TurnState.DONE)
        return GiveUp(GiveUpKind.PASS_THROUGH)

    def _abandon(self) -> None:
        """The current response will not be read on: name what frees it."""
        strategy = self.continuation
        ledger = self.ledger
        if strategy is not None and ledger is not None and self.retry.current >= 0:
            self._cancels.extend(strategy.abandon(self.retry.current, ledger))

    def take_cancels(self) -> list[Cancel]:
        """The cancel requests named since the last call (the transport sends them)."""
        out = self._cancels
        if out:
            self._cancels = []
        return out

    @property
    def splices(self) -> int:
        """Continuations this turn made."""
        strategy = self.continuation
        return strategy_splices(strategy) if strategy is not None else 0


def strategy_splices(strategy: Strategy) -> int:
    """The continuations a strategy made."""
    return strategy.splices
