"""The turn machine's fields, in one place: the base of `unbroken.core.turn.TurnMachine`
and of the parts it is made of (`turn_clock`, `turn_fast_path`, `turn_continue`).

One ``__slots__`` layout for all of them; the parts add methods only.  The methods
one part calls on another are declared here for the type checker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from unbroken.core.attempt import AttemptStats
from unbroken.core.continuation import Cancel, Refusal, Resume, Splicer, Strategy
from unbroken.core.ledger import Hold, Ledger
from unbroken.core.policy import Failure, RetryState
from unbroken.core.profiles import Profile
from unbroken.core.protocols import Protocol
from unbroken.core.protocols.prefill import Refusal as PrefillRefusal
from unbroken.core.sse import Event, SSESplitter
from unbroken.core.turn_table import ALLOWED, ENTERS, Step, TurnEvent, Watch
from unbroken.core.turn_types import (
    Action,
    End,
    GiveUp,
    Outcome,
    Phase,
    Timers,
    TurnError,
    TurnObserver,
)

__all__ = ["TurnFields", "is_testing", "set_testing", "testing"]

#: testing mode (`set_testing`); the parts read it as ``turn_fields.testing``
testing = False


def set_testing(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Testing mode: retry waits are switched off (as stamina's ``set_testing`` does).

    The machine still computes and reports every wait (logs, journal, /status say
    what would have happened); only the `Wait` it returns is zero, so tests of
    retry storms and Retry-After run without real waits.  It takes effect at once;
    used as a context manager (``with set_testing():``), the previous mode is back
    on exit, as in stamina.
    """
    global testing
    previous, testing = testing, enabled
    return _Restore(previous)


class _Restore(contextlib.AbstractContextManager[None]):
    def __init__(self, previous: bool) -> None:
        self.previous = previous

    def __exit__(self, *exc: object) -> None:
        global testing
        testing = self.previous


def is_testing() -> bool:
    return testing


class TurnFields:
    """What one turn's machine knows (see `TurnMachine.__init__` for each field)."""

    __slots__ = (
        "_answer_kept",
        "_attempt_t0",
        "_done_seen",
        "_over",
        "_overflow_reported",
        "_parked",
        "_patched",
        "_resume",
        "_resume_t0",
        "_splice",
        "_splitter",
        "_write_t0",
        "attempt_ledger",
        "cancels",
        "clock",
        "continuation",
        "failure",
        "first_frame",
        "headers_out",
        "hold",
        "keepalive_event",
        "last_rx",
        "last_tx",
        "ledger",
        "outcome",
        "profile",
        "protocol",
        "queued_s",
        "refusal",
        "report",
        "retry",
        "socket",
        "stats",
        "status",
        "step",
        "stream",
        "t0",
        "timers",
        "wall_clock",
        "watch",
        "writing",
    )

    _answer_kept: bool
    _attempt_t0: float
    _done_seen: bool
    _over: Action | None
    _overflow_reported: bool
    _parked: bool
    _patched: bool
    _resume: Resume | None
    _resume_t0: float
    _splice: Splicer | None
    _splitter: SSESplitter | None
    _write_t0: float
    attempt_ledger: Ledger | None
    cancels: list[Cancel]
    clock: Callable[[], float] | None
    wall_clock: Callable[[], float] | None
    continuation: Strategy | None
    failure: Failure | None
    first_frame: bool
    headers_out: bool
    hold: Hold
    keepalive_event: bytes | None
    last_rx: float
    last_tx: float
    ledger: Ledger | None
    outcome: Outcome | None
    profile: Profile
    protocol: Protocol
    queued_s: float
    refusal: Refusal | PrefillRefusal | None
    report: TurnObserver
    retry: RetryState
    socket: bool
    stats: AttemptStats | None
    status: int | None
    step: Step
    stream: bool
    t0: float
    timers: Timers
    writing: int
    watch: Watch

    @property
    def stalled(self) -> bool:
        """The attempt was aborted for a stall (its read failure is the stall)."""
        return self.watch is not Watch.WATCHING

    # -- the table, run (`turn_table`) ---------------------------------------------------
    def _moved(self, before: Step, event: TurnEvent, action: Action) -> Action:
        """The table's transition: the step ``action`` enters (`ENTERS`).  An action
        the table does not list for (``before``, ``event``) is a bug in the machine:
        refused, like an illegal event."""
        kind = type(action)
        if kind not in ALLOWED[before, event]:
            self.step = Step.ERROR
            raise TurnError(
                f"{event.value}() in step {before.value} gave {kind.__name__}: not in the table"
            )
        self.step = ENTERS[kind]
        return action

    def _illegal(self, event: str) -> NoReturn:
        """Refuse an event the current step does not accept: a transport bug.  The
        machine goes to ERROR, where every event but the end from outside raises."""
        step = self.step
        self.step = Step.ERROR
        if step is Step.ERROR:
            raise TurnError(f"{event}() after an illegal event")
        raise TurnError(f"{event}() is illegal in step {step.value}")

    if TYPE_CHECKING:  # one part's calls on another (defined in `turn.TurnMachine`)

        def _feed_chunk(self, now: float, chunk: bytes) -> Sequence[Event]: ...
        def _feed_events(self, now: float, events: list[Event]) -> Sequence[Event]: ...
        def _next_attempt(self, now: float) -> Action: ...
        def _open_failed(self, now: float, failure: Failure) -> Action: ...
        def _continue(self, now: float, failure: Failure) -> Action | None: ...
        def _verdict_action(
            self, now: float, failure: Failure | None, out: bytes = b""
        ) -> Action: ...
        def _attempt_failed(self, now: float, failure: Failure, phase: Phase) -> Action: ...
        def _replay_phase(self, failure: Failure) -> Phase: ...
        def _reading(self, now: float, step: Step) -> None: ...
        def _end(self, outcome: Outcome, action: End) -> End: ...
        def _released(self) -> None: ...
        def _abandon(self) -> None: ...
        def _give_up(self) -> GiveUp: ...
        def _ok_outcome(self) -> Outcome: ...
        def _record(self, data: bytes) -> None: ...
        @property
        def ended(self) -> bool: ...
