"""The turn machine's vocabulary: the actions it returns, what a feed returns, how a
turn and an attempt end, and the protocols it reads and reports through.

Read `unbroken.core.turn.machine`'s header first (the theory of operation); the steps and
the events each accepts are `unbroken.core.turn.turn_table`.
"""

from __future__ import annotations

import enum
from typing import Generic, NamedTuple, TypeVar
from typing import Protocol as TypingProtocol

import msgspec

from unbroken.core.admission.policy import Failure
from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.turn.continuation import Resume

#: the keepalive a protocol without its own (`Protocol.keepalive_event`) gets: an SSE
#: comment, which SSE parsers ignore (Gemini's is `protocols.gemini.BLANK_LINE_KEEPALIVE`)
KEEPALIVE = b": keepalive\n\n"


class Phase(enum.StrEnum):
    """Where in an attempt a failure happened."""

    CONNECT = "connect"
    HEADERS = "headers"
    PENDING = "pending"
    STALL = "stall"
    COMMITTED = "committed"
    TAIL = "tail"


class Outcome(enum.StrEnum):
    """How a turn ended."""

    OK = "ok"
    RECOVERED = "recovered"  # ok, after at least one failed attempt
    ENDED_WITH_ERROR = "ended_with_error"  # cut after output: the native error was sent
    PASSED_THROUGH_ERROR = "passed_through_error"  # the provider's final answer
    ABORTED_BY_CLIENT = "aborted_by_client"
    RESUMED = "resumed"  # ok, finished in place after a cut (`core.turn.continuation`)
    INTERNAL_ERROR = "internal_error"  # a bug in the relay

    @property
    def is_ok(self) -> bool:
        return self in OK_OUTCOMES


#: the outcomes that are a success (`Outcome.is_ok`, which reads it: an Enum class's
#: attribute costs a lookup through ``EnumType.__getattr__`` on Python 3.11, and a hot
#: caller tests ``outcome in OK_OUTCOMES`` itself: no property call)
OK_OUTCOMES = frozenset({Outcome.OK, Outcome.RECOVERED, Outcome.RESUMED})

#: the outcomes reports list even at zero, in order (``internal_error``, a relay bug,
#: is listed only when it happened)
OUTCOMES: tuple[Outcome, ...] = tuple(o for o in Outcome if o is not Outcome.INTERNAL_ERROR)
#: their names, as reports, stats and the journal spell them
OUTCOME_NAMES: tuple[str, ...] = tuple(o.value for o in OUTCOMES)
#: attempt reasons that say nothing about the upstream's health
NOT_UPSTREAM: frozenset[str] = frozenset({Outcome.ABORTED_BY_CLIENT, Outcome.INTERNAL_ERROR})
#: attempt reasons that mean the upstream answered
UPSTREAM_ANSWERED: frozenset[str] = frozenset({Outcome.OK, Outcome.PASSED_THROUGH_ERROR})
#: attempt reasons that are not upstream failures
NOT_FAILURES: frozenset[str] = NOT_UPSTREAM | UPSTREAM_ANSWERED


class TurnState(enum.StrEnum):
    """What a live turn is doing (for /status)."""

    WAITING = "waiting"  # connecting, or waiting before a retry
    PARKED = "parked"  # waiting in an upstream's line: its pacer, breaker or cool-off
    HOLDING = "holding"  # reading; nothing released yet
    STREAMING = "streaming"  # output is reaching the client
    DONE = "done"


class TurnError(RuntimeError):
    """An event arrived that is illegal in the machine's current step (a transport bug)."""


class EndKind(enum.Enum):
    CLEAN = "clean"  # write ``data`` (possibly empty), then end the body normally
    ERROR = "error"  # write ``data`` (the native error event), then end the body
    ABORT = "abort"  # abort the client connection: a cut plain body must not look whole


class GiveUpKind(enum.Enum):
    IN_STREAM = "in_stream"  # headers are out: write ``data`` (native error), end
    PASS_THROUGH = "pass_through"  # send the last upstream answer as it was
    BAD_GATEWAY = "bad_gateway"  # answer 502 with ``data`` as the JSON body


# The actions are frozen msgspec Structs, not frozen dataclasses: the same fields,
# positional or keyword, equality, hash, repr and class patterns (``case End():``), but
# made by a C ``__init__``; a frozen dataclass's sets each field through
# ``object.__setattr__`` in Python (about 4,400 instructions for an `End`, 750 as a
# Struct), and a turn makes an `Open`, a `Stream` and an `End`.  ``gc=False`` where no
# field can hold a container (a Struct the collector never needs to visit).
class Open(msgspec.Struct, frozen=True):
    upstream: int
    timeout_s: float  # for connecting and the response headers
    #: top-level JSON keys to set in the request body (``after_commit = "continue"``
    #: only, `core.turn.continuation`); empty: the client's bytes go as they are
    body_patch: tuple[tuple[str, object], ...] = ()


class Wait(msgspec.Struct, frozen=True, gc=False):
    """Wait, then call ``next_attempt()``.  The wait ends early when the upstream
    ``key`` lets the turn go: its pacer grants ``ticket`` (a turn in its line), or, with
    no ticket (a retry's delay), it is known good again (`core.admission.pacer`)."""

    seconds: float
    key: str | None = None
    ticket: int = 0


class Stream(msgspec.Struct, frozen=True, gc=False):
    """Read the SSE body with `TurnMachine.feed_chunk`."""


class PassThrough(msgspec.Struct, frozen=True, gc=False):
    """Forward the plain body with `TurnMachine.feed_body`; status and headers go with it."""


class ReadErrorBody(msgspec.Struct, frozen=True, gc=False):
    """Read a retryable answer's body (bounded), keep it, then call `error_body`."""


class FinalInStream(msgspec.Struct, frozen=True, gc=False):
    """A final non-SSE answer after early headers: read its body, call `final_body`."""


class SendHeaders(msgspec.Struct, frozen=True, gc=False):
    status: int


class Keepalive(msgspec.Struct, frozen=True, gc=False):
    data: bytes


class AbortUpstream(msgspec.Struct, frozen=True):
    failure: Failure


class End(msgspec.Struct, frozen=True, gc=False):
    kind: EndKind
    data: bytes = b""


class GiveUp(msgspec.Struct, frozen=True, gc=False):
    kind: GiveUpKind
    data: bytes = b""


Action = Open | Resume | Wait | Stream | PassThrough | ReadErrorBody | FinalInStream | End | GiveUp
TimerAction = SendHeaders | Keepalive | AbortUpstream


class Timers(TypingProtocol):
    """The ``[stream]`` settings the machine reads (`config.StreamSettings`)."""

    @property
    def header_timeout_s(self) -> float: ...
    @property
    def first_frame_timeout_s(self) -> float: ...
    @property
    def idle_timeout_s(self) -> float: ...
    @property
    def keepalive_s(self) -> float: ...
    @property
    def early_headers_s(self) -> float: ...
    @property
    def max_hold_bytes(self) -> int: ...
    @property
    def max_event_bytes(self) -> int: ...


class TurnObserver(TypingProtocol):
    """What the machine tells observers.  The I/O layer implements it (`relay.report`)."""

    def attempt_started(self, number: int, upstream: int, choice: str) -> None:
        """``choice``: how the upstream was chosen (first, sticky, rotated, breaker_skip,
        or parked when the turn waited in an upstream's line first)."""

    def attempt_ended(
        self, reason: str, phase: Phase | None, status: int | None, stats: AttemptStats | None
    ) -> None: ...
    def attempt_failed(self, failure: Failure, phase: Phase, wait_s: float | None) -> None: ...
    def state(self, state: TurnState) -> None: ...
    def hold_overflow(self, held_bytes: int) -> None: ...
    def parked(self, why: str) -> None:
        """The turn waits in an upstream's line: for its ``pacer``, an open ``breaker``,
        a ``cooloff`` (Retry-After, quota) or a ``probe`` that is out."""

    def headers_sent(self) -> None: ...
    def continuation(self, result: str, splices: int, saved_frames: int) -> None:
        """A cut turn was continued in place (``result`` ``spliced``), or could not be
        (``refused_<reason>``, `Refusal`); ``saved_frames``: output frames a redo would
        have sampled again so far."""

    def uncovered(self, result: str) -> None:
        """Continue mode is on, but cannot cover this turn (``refused_<reason>``: the
        request enables thinking, forces a tool, ...): recorded on the turn, which a
        cut after commit ends as without continue mode."""


#: what a feed releases: frames (`feed_chunk`, `feed_frame`) or bytes
R = TypeVar("R")


class Fed(NamedTuple, Generic[R]):
    """What every feed returns (`feed_chunk`, `feed_verbatim`, `feed_frame`, `feed_body`).

    ``released``: what to write now, in the feed's own form (frames for `feed_chunk`
    and `feed_frame`, bytes for `feed_verbatim` and `feed_body`; `feed_verbatim`'s
    None: the chunk fed, whole, as it is).  ``over``: the action that ends the
    attempt, decided by the frame that ended it (write ``released`` first, then carry
    it out), or None to keep reading.  A tuple: unpack it, ``released, over = fed``.
    """

    released: R
    over: Action | None


#: ``new_fed(Fed, (released, over))``: a `Fed` without the NamedTuple's ``__new__``, a
#: Python call (the feeds' hot path; the same value)
new_fed = tuple.__new__
