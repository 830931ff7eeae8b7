"""The turn machine's fields, in one place: the base of `unbroken.core.turn.machine.TurnMachine`
and of the parts it is made of (`turn_clock`, `turn_fast_path`, `turn_continue`).

One ``__slots__`` layout for all of them; the parts add methods only.  The methods
one part calls on another are declared here for the type checker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, NoReturn, TypeVar, overload

from unbroken.core.admission.policy import Failure, RetryState
from unbroken.core.profiles import Profile
from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.turn.continuation import Cancel, Refusal, Resume, Splicer, Strategy
from unbroken.core.turn.ledger import Hold, Ledger
from unbroken.core.turn.turn_table import (
    ALLOWED,
    ENTERED_IN,
    ENTERS,
    IDLE,
    NOTHING_SENT,
    OUTSIDE,
    Kept,
    Outside,
    Overflow,
    Pacing,
    Reply,
    Request,
    Step,
    TurnEvent,
    Watch,
)
from unbroken.core.turn.turn_types import (
    Action,
    End,
    GiveUp,
    Outcome,
    Phase,
    Timers,
    TurnError,
    TurnObserver,
)
from unbroken.core.wire.protocols import Protocol
from unbroken.core.wire.protocols.prefill import PrefillRefusal
from unbroken.core.wire.sse import Event, SSESplitter

__all__ = ["TESTING", "TurnFields", "is_testing", "set_testing"]

_A = TypeVar("_A", bound=Action)
_ERROR = Step.ERROR

#: testing mode (`set_testing`): a context variable, not a module global, so a
#: switch reaches the context that made it (a test, and the tasks it starts from
#: there) and is undone by the token it returns
TESTING: ContextVar[bool] = ContextVar("unbroken_testing", default=False)


def set_testing(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Testing mode: retry waits are switched off (as stamina's ``set_testing`` does).

    The machine still computes and reports every wait (logs, journal, /status say
    what would have happened); only the `Wait` it returns is zero, so tests of
    retry storms and Retry-After run without real waits.  It takes effect at once,
    in the current context and the tasks started from it; used as a context manager
    (``with set_testing():``), the previous mode is back on exit, as in stamina.
    """
    return _Restore(TESTING.set(enabled))


class _Restore(contextlib.AbstractContextManager[None]):
    def __init__(self, token: Token[bool]) -> None:
        self.token = token

    def __exit__(self, *exc: object) -> None:
        TESTING.reset(self.token)


def is_testing() -> bool:
    return TESTING.get()


class TurnFields:
    """What one turn's machine knows (see `TurnMachine.__init__` for each field)."""

    __slots__ = (
        "_attempt_t0",
        "_cancels",
        "_outcome",
        "_over",
        "_profile",
        "_resume",
        "_resume_t0",
        "_splice",
        "_splitter",
        "_write_t0",
        "attempt_ledger",
        "clock",
        "continuation",
        "failure",
        "hold",
        "keepalive_event",
        "kept",
        "last_rx",
        "last_tx",
        "ledger",
        "overflow",
        "pacing",
        "protocol",
        "queued_s",
        "refusal",
        "reply",
        "report",
        "request",
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

    _attempt_t0: float
    _cancels: list[Cancel]
    _outcome: Outcome | None
    _profile: Profile
    _over: Action | None
    _resume: Resume | None
    _resume_t0: float
    _splice: Splicer | None
    _splitter: SSESplitter | None
    _write_t0: float
    attempt_ledger: Ledger | None
    clock: Callable[[], float] | None
    wall_clock: Callable[[], float] | None
    continuation: Strategy | None
    failure: Failure | None
    hold: Hold
    keepalive_event: bytes | None
    kept: Kept
    last_rx: float
    last_tx: float
    ledger: Ledger | None
    overflow: Overflow
    pacing: Pacing
    protocol: Protocol
    queued_s: float
    refusal: Refusal | PrefillRefusal | None
    reply: Reply
    report: TurnObserver
    request: Request
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

    # -- what the machine publishes, read-only -------------------------------------------
    @property
    def outcome(self) -> Outcome | None:
        """The turn's outcome, once it ended (None before)."""
        return self._outcome

    @property
    def first_frame(self) -> bool:
        """The current attempt's first (non-comment) frame arrived, and its stall
        watch is on the idle timer (`Watch.IDLE`)."""
        return self.watch is IDLE

    @property
    def profile(self) -> Profile:
        """The client's profile (`core.profiles`): its timers and habits."""
        return self._profile

    @property
    def has_cancels(self) -> bool:
        """Cancel requests are waiting to be sent (`take_cancels`)."""
        return bool(self._cancels)

    @property
    def headers_out(self) -> bool:
        """The client has the status line and headers (`Reply`)."""
        return self.reply is not NOTHING_SENT

    # -- the table, run (`turn_table`) ---------------------------------------------------
    @overload
    def _moved(self, before: Step, event: TurnEvent, action: _A) -> _A: ...
    @overload
    def _moved(self, before: Step, event: Outside, action: None = None) -> None: ...
    def _moved(
        self, before: Step, event: TurnEvent | Outside, action: Action | None = None
    ) -> Action | None:
        """The table's transition, and the one place that writes `step`.

        An event's action moves the machine by its row: to the step the action
        enters (`ENTERS`).  An action the table does not list for (``before``,
        ``event``) is a bug in the machine: refused, like an illegal event (ERROR,
        and `TurnError`).  A move no row makes (`Outside`: the machine's creation,
        the end from outside, an illegal event) enters the step `OUTSIDE` names.
        Inner helpers never move the step: they return the action, and the event
        brings it here."""
        if isinstance(event, Outside):
            step = OUTSIDE[event]
        else:
            kind = type(action)
            step = ENTERS[kind] if kind in ALLOWED[before, event] else _ERROR
        self.step = step
        if step is _ERROR and action is not None:
            raise TurnError(
                f"{event.value}() in step {before.value} gave {type(action).__name__}: "
                "not in the table"
            )
        return action

    def _illegal(self, event: str) -> NoReturn:
        """Refuse an event the current step does not accept: a transport bug.  The
        machine goes to ERROR, where every event but the end from outside raises."""
        step = self.step
        self._moved(step, _OUTSIDE_ILLEGAL)
        if step is _STEP_ERROR:
            raise TurnError(f"{event}() after an illegal event")
        raise TurnError(f"{event}() is illegal in step {step.value}")

    # -- the sub-states' checked setters (`turn_table.ENTERED_IN`) ------------------------
    def _set_watch(self, value: Watch) -> None:
        if self.step not in ENTERED_IN[value]:
            self._refuse("watch", value)
        self.watch = value

    def _set_reply(self, value: Reply) -> None:
        if self.step not in ENTERED_IN[value]:
            self._refuse("reply", value)
        self.reply = value

    def _set_request(self, value: Request) -> None:
        if self.step not in ENTERED_IN[value]:
            self._refuse("request", value)
        self.request = value

    def _set_kept(self, value: Kept) -> None:
        if self.step not in ENTERED_IN[value]:
            self._refuse("kept", value)
        self.kept = value

    def _set_pacing(self, value: Pacing) -> None:
        if self.step not in ENTERED_IN[value]:
            self._refuse("pacing", value)
        self.pacing = value

    def _set_overflow(self, value: Overflow) -> None:
        if self.step not in ENTERED_IN[value]:
            self._refuse("overflow", value)
        self.overflow = value

    def _refuse(
        self, field: str, value: Watch | Reply | Request | Kept | Pacing | Overflow
    ) -> NoReturn:
        """A sub-state value the table says cannot be entered in the current step (its
        `SubState.by`): a bug in the machine, refused like an action its row does not
        list (ERROR, and `TurnError`)."""
        step = self.step
        self._moved(step, _OUTSIDE_ILLEGAL)
        raise TurnError(f"{field} {value.name} entered in step {step.value}: not in the table")

    def _always(self, *_: object) -> bool:
        """The last guard's condition (`turn_guards.ALWAYS`): it holds always."""
        return True

    if TYPE_CHECKING:  # one part's calls on another (defined in `turn.TurnMachine`)

        def _feed_chunk(self, now: float, chunk: bytes) -> Sequence[Event]: ...
        def _feed_events(self, now: float, events: list[Event]) -> Sequence[Event]: ...
        def _feed_spliced(self, now: float, events: list[Event]) -> Sequence[Event]: ...
        def _record_events(self, events: Sequence[Event]) -> None: ...
        def _cut_by_error(self, now: float, ledger: Ledger) -> Sequence[Event]: ...
        def _join_broken(self, now: float, reason: str) -> Action: ...
        def _transport_failed(self, now: float, failure: Failure) -> Action: ...
        def _next_attempt(self, now: float) -> Action: ...
        def _wait_or_next(self, now: float, wait: float) -> Action: ...
        def _open_failed(self, now: float, failure: Failure) -> Action: ...
        def _continue(self, now: float, failure: Failure) -> Action | None: ...
        def _verdict_action(
            self, now: float, failure: Failure | None, out: bytes = b""
        ) -> Action: ...
        def _attempt_failed(self, now: float, failure: Failure, phase: Phase) -> Action: ...
        def _replay_phase(self, failure: Failure) -> Phase: ...
        def _reading(self, now: float) -> None: ...
        def _end(self, outcome: Outcome, action: End) -> End: ...
        def _released(self) -> None: ...
        def _abandon(self) -> None: ...
        def _give_up(self) -> GiveUp: ...
        def _ok_outcome(self) -> Outcome: ...
        def _record(self, data: bytes) -> None: ...
        @property
        def ended(self) -> bool: ...


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_OUTSIDE_ILLEGAL = Outside.ILLEGAL
_STEP_ERROR = Step.ERROR
