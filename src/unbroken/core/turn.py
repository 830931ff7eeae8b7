"""The turn machine: every decision about one client turn, as events in and actions out.

Theory of operation
===================
A *turn* is one client request (an HTTP request, or one ``response.create`` on a
WebSocket).  It is served by one or more *attempts*, each on one upstream.  The
transports (`unbroken.relay.http`, `unbroken.relay.websocket`) do the I/O; this
module decides everything else, the way h11's ``_state.py`` does for HTTP:

* which upstream the next attempt goes to, how long to wait first, and when to
  give up (with `policy.RetryState`);
* what each upstream answer means (stream it, pass it through, retry it);
* what is released to the client and whether a replay is still safe (with the
  `ledger.Ledger`, which stays the only judge of replay safety);
* the phase of each failure, for the journal and the logs;
* the deadlines: early headers, keepalives, and stalls.

Events in (method calls, each given ``now``, a monotonic time in seconds)::

    start()                      the turn begins
    next_attempt()               a `Wait` is over (opens the next attempt, or the
                                 continuation a cut asked for)
    open_failed(failure)         connecting or waiting for headers failed
    answered(status, sse, ...)   the upstream's status line and headers arrived
    error_body(body)             a retryable answer's (bounded) body was read
    final_body(status, body)     a final non-SSE answer after early headers was read
    feed_chunk(chunk)            body bytes of a streamed answer (SSE), frame by frame
    feed_verbatim(chunk)         the same, for a transport that writes bytes: the same
                                 decisions, but after commit a run of frames the
                                 classifier proves plain passes as it is, in one piece
    feed_frame(event)            one frame (a WebSocket message)
    feed_body(chunk)             body bytes of a plain answer
    body_ended()                 the upstream body ended cleanly
    transport_failed(failure)    reading the upstream failed (reset, stall abort, ...)
    tick()                       the clock: early headers, keepalives, stalls
    headers_sent()               the transport sent the response headers
    write_started() / wrote()    a write to the client began / ended (blocked time is
                                 not upstream silence; a write is never upstream activity)
    client_gone() / crashed()    the turn ends from outside

Actions out (frozen values; the transport carries each one out)::

    Open(upstream, timeout_s,    open an attempt on upstream i (``body_patch``: top-level
      body_patch)                JSON keys to set, only with ``after_commit = "continue"``)
    Resume(upstream, method,     open a continuation of the cut attempt (`core.continuation`)
      path, query, body, ...)
    Wait(seconds, key, ticket)   wait, then call ``next_attempt()``; the wait ends early
                                 when the upstream's pacer lets the turn go
    Stream / PassThrough /       read the answer's body this way
      ReadErrorBody / FinalInStream
    SendHeaders(status)          send the SSE status line and headers now
    Keepalive(data)              write these bytes (the client profile's form: an SSE
                                 comment, a ping event, or a keepalive event)
    AbortUpstream(failure)       the attempt stalled: abort its transport, no handshake
    End(kind, data)              end the turn: clean (after ``data``), with the native
                                 error ``data``, or by aborting the client connection
    GiveUp(kind, data)           retries are exhausted: the in-stream error ``data``, the
                                 kept upstream answer, or a 502 with ``data`` as its body

Phases of a failed attempt (`Phase`)::

    connect    the upstream could not be reached
    headers    no headers in time, a retryable status, or a 1xx
    pending    the body failed while nothing had been released (replayed)
    stall      the body went silent while nothing had been released (replayed)
    committed  the body failed after output reached the client (never replayed;
               continued in place when a strategy can, see below)
    tail       the body failed after the turn's terminal frame (the turn is complete;
               the machine finishes the protocol's ending itself, e.g. ``[DONE]``)

Deadlines (`deadline()` says when `tick()` is next due):

* **early headers**: a streamed turn that has released nothing ``early_headers_s``
  after it began gets ``SendHeaders``, so the client's own header timer does not fire
  during a long retry storm (unless its profile says no early headers, as Codex's and
  Claude Code's do).  After that a final error is an in-stream event.
* **keepalive**: once headers are out, ``keepalive_s`` without a write gives
  ``Keepalive``.
* **stall**: measured on *upstream silence only*.  Before an attempt's first frame
  the deadline is ``first_frame_timeout_s`` after the attempt's body began (comments
  do not count as a frame); after it, ``idle_timeout_s`` after the last byte.  A
  write to the client never restarts it (the relay's own keepalives least of all:
  they would hide the very stall they wait through).  While the transport is
  blocked writing to a slow client the stall clock stands still, and it goes on
  from where it stood when the write completes (`wrote` moves the last byte's time
  forward by the blocked time).

Continuation after commit (``[stream] after_commit = "continue"``, `core.continuation`):
where a cut would end the turn (a reset, a stall, a body ended without its terminal;
never a malformed frame, and a provider's retryable error event only for a strategy
that ``continues_errors``: the ledger's ``Verdict.CUT``), the machine asks the turn's
`Strategy`.  A `Resume` is paced like any retry (`RetryState.next_resume`: the same
upstream, its pacer's go) and its frames pass the strategy's splicer (the join
check; it may absorb a frame or make several of one) before the same ledger
(`Ledger.resume_attempt`: classifier and held frames kept; a strategy that restarts
from what the client has, a prefill, has the ledger `rewind` to the released frames
instead), so the client sees one stream.  A strategy that ``wants_released`` is
told every byte released (`Strategy.released`).  A `Refusal` (typed), or a join
that breaks, ends the turn exactly as without a strategy (before commit: a replay).
At most ``max_splices`` continuations a turn; a continuation with no progress within
``queued_s`` is given up.  Responses nobody will read are named in ``cancels``.

Legality: as h11 does, the machine refuses an event its step does not accept.  That
is a transport bug (a chunk of a dead attempt read after its `Wait`, a feed after
`End`): the event raises `TurnError` and the machine goes to ERROR, where every event
raises again, except the end from outside (``client_gone``, ``crashed``, so that the
transport can clean up) and the clock (``deadline``, ``tick``: None).  Nothing is
released after an illegal event, and the ledger is left as it was.  The feed whose
frame ends an attempt (a replay, a failure after commit) decides it at once; so the
next feed of that attempt is illegal even before the transport asks `attempt_over`.
The steps, and the events each one accepts::

    step          entered by                     legal events
    NEW           the machine's creation         start
    IDLE          start, a Wait, a cut continued next_attempt
    CONNECTING    Open                           open_failed, answered, transport_failed
    RESUMING      Resume                         open_failed, answered, transport_failed
    STREAM        Stream                         feed_chunk, feed_verbatim, feed_frame,
                                                 body_ended, transport_failed
    PASS_THROUGH  PassThrough                    feed_body, body_ended, transport_failed
    ERROR_BODY    ReadErrorBody                  error_body, transport_failed
    FINAL_BODY    FinalInStream                  final_body, transport_failed
    ENDED         End, GiveUp, the end from      (none)
                  outside
    ERROR         an illegal event               (none)

In every step: ``client_gone``, ``crashed``, ``deadline``, ``tick``, and, but in ERROR,
the write notifications ``headers_sent``, ``write_started``, ``wrote`` (``wrote`` only
after a ``write_started``).  The checks are identity comparisons (one per chunk on the
hot path).

The four invariants (checked by a property test over random event sequences, illegal
events among them): nothing is released after a replay decision; a truncated turn
never ends cleanly; no frame is released twice; every turn ends.

Nothing here does I/O: no aiohttp, asyncio or ssl.  Time comes in as ``now``,
randomness through the `RetryState`'s injected ``random.Random``.  Observers are
told through the `TurnReport` protocol, which the I/O layer implements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn
from typing import Protocol as TypingProtocol

from unbroken.core.attempt import AttemptStats
from unbroken.core.continuation import (
    DEFAULT_QUEUED_S,
    Cancel,
    JoinBroken,
    Refusal,
    Resume,
    Splicer,
    Strategy,
)
from unbroken.core.ledger import NOTHING, Hold, Ledger, State, Verdict
from unbroken.core.policy import (
    Failure,
    FailureClass,
    Park,
    RetryState,
    is_retryable_status,
)
from unbroken.core.profiles import DEFAULT as DEFAULT_PROFILE
from unbroken.core.profiles import CommitEnd, KeepaliveForm, Profile
from unbroken.core.protocols import BODY, Protocol, usage_from
from unbroken.core.protocols.prefill import Refusal as PrefillRefusal
from unbroken.core.ratehead import RateHeaders
from unbroken.core.sse import CR, Event, EventTooLarge, SSESplitter

__all__ = [
    "KEEPALIVE",
    "NOT_FAILURES",
    "NOT_UPSTREAM",
    "OUTCOMES",
    "UPSTREAM_ANSWERED",
    "AbortUpstream",
    "Action",
    "End",
    "EndKind",
    "FinalInStream",
    "GiveUp",
    "GiveUpKind",
    "Keepalive",
    "Open",
    "Outcome",
    "PassThrough",
    "Phase",
    "ReadErrorBody",
    "Resume",
    "SendHeaders",
    "Stream",
    "Timers",
    "TurnError",
    "TurnMachine",
    "TurnReport",
    "TurnState",
    "Wait",
    "set_testing",
]

KEEPALIVE = b": keepalive\n\n"

_testing = False


def set_testing(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Testing mode: retry waits are switched off (as stamina's ``set_testing`` does).

    The machine still computes and reports every wait (logs, journal, /status say
    what would have happened); only the `Wait` it returns is zero, so tests of
    retry storms and Retry-After run without real waits.  It takes effect at once;
    used as a context manager (``with set_testing():``), the previous mode is back
    on exit, as in stamina.
    """
    global _testing
    previous, _testing = _testing, enabled
    return _Restore(previous)


class _Restore(contextlib.AbstractContextManager[None]):
    def __init__(self, previous: bool) -> None:
        self.previous = previous

    def __exit__(self, *exc: object) -> None:
        global _testing
        _testing = self.previous


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
    RESUMED = "resumed"  # ok, finished in place after a cut (`core.continuation`)
    INTERNAL_ERROR = "internal_error"  # a bug in the relay

    @property
    def is_ok(self) -> bool:
        return self is Outcome.OK or self is Outcome.RECOVERED or self is Outcome.RESUMED


#: the outcomes reports list even at zero, in order (``internal_error``, a relay bug,
#: is listed only when it happened)
OUTCOMES: tuple[Outcome, ...] = tuple(o for o in Outcome if o is not Outcome.INTERNAL_ERROR)
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


class _Step(enum.Enum):
    """The machine's own position: which events are legal (the module's header)."""

    NEW = "new"  # before start
    IDLE = "idle"  # between attempts (waiting)
    CONNECTING = "connecting"
    RESUMING = "resuming"  # a continuation is opening (`Resume`)
    STREAM = "stream"  # reading an SSE body, or WebSocket frames (`Stream`)
    PASS_THROUGH = "pass_through"  # reading a plain body (`PassThrough`)
    ERROR_BODY = "error_body"  # reading a retryable answer's body (`ReadErrorBody`)
    FINAL_BODY = "final_body"  # reading a final answer's body (`FinalInStream`)
    ENDED = "ended"
    ERROR = "error"  # an illegal event arrived (a transport bug): every event raises


#: the steps that read an answer's body (the stall clock runs in them)
_READING = frozenset({_Step.STREAM, _Step.PASS_THROUGH, _Step.ERROR_BODY, _Step.FINAL_BODY})
#: where `TurnMachine.body_ended` is legal (an answer's body is read whole otherwise)
_BODY_ENDS = frozenset({_Step.STREAM, _Step.PASS_THROUGH})
#: where the clock has nothing to say
_OVER = frozenset({_Step.ENDED, _Step.ERROR})
#: where an attempt (or a continuation) waits for its answer
_OPENING = frozenset({_Step.CONNECTING, _Step.RESUMING})


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


#: `TurnMachine.feed_verbatim`: frames fed to the splitter one at a time before commit,
#: at most this many a chunk (a turn commits on its first output, within a frame or
#: two; the rest of a chunk that holds more goes to the splitter at once)
PEEL_FRAMES = 8


def _joined(events: Sequence[Event]) -> bytes:
    if not events:
        return b""
    if len(events) == 1:
        return events[0].raw
    return b"".join([e.raw for e in events])


@dataclass(frozen=True, slots=True)
class Open:
    upstream: int
    timeout_s: float  # for connecting and the response headers
    #: top-level JSON keys to set in the request body (``after_commit = "continue"``
    #: only, `core.continuation`); empty: the client's bytes go as they are
    body_patch: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait, then call ``next_attempt()``.  The wait ends early when the upstream
    ``key`` lets the turn go: its pacer grants ``ticket`` (a turn in its line), or, with
    no ticket (a retry's delay), it is known good again (`core.pacer`)."""

    seconds: float
    key: str | None = None
    ticket: int = 0


@dataclass(frozen=True, slots=True)
class Stream:
    """Read the SSE body with `TurnMachine.feed_chunk`."""


@dataclass(frozen=True, slots=True)
class PassThrough:
    """Forward the plain body with `TurnMachine.feed_body`; status and headers go with it."""


@dataclass(frozen=True, slots=True)
class ReadErrorBody:
    """Read a retryable answer's body (bounded), keep it, then call `error_body`."""


@dataclass(frozen=True, slots=True)
class FinalInStream:
    """A final non-SSE answer after early headers: read its body, call `final_body`."""


@dataclass(frozen=True, slots=True)
class SendHeaders:
    status: int


@dataclass(frozen=True, slots=True)
class Keepalive:
    data: bytes


@dataclass(frozen=True, slots=True)
class AbortUpstream:
    failure: Failure


@dataclass(frozen=True, slots=True)
class End:
    kind: EndKind
    data: bytes = b""


@dataclass(frozen=True, slots=True)
class GiveUp:
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


class TurnReport(TypingProtocol):
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


class TurnMachine:
    """One turn's decisions.  Feed it events; carry out the actions it returns."""

    __slots__ = (
        "_answer_kept",
        "_attempt_t0",
        "_done_seen",
        "_over",
        "_overflow_reported",
        "_parked",
        "_patched",
        "_queued",
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
        "stalled",
        "stats",
        "status",
        "step",
        "stream",
        "t0",
        "timers",
        "wall_clock",
        "writing",
    )

    def __init__(
        self,
        *,
        protocol: Protocol,
        hold: Hold,
        timers: Timers,
        retry: RetryState,
        stream: bool,
        now: float,
        report: TurnReport,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] | None = None,
        profile: Profile | None = None,
        socket: bool = False,
        continuation: Strategy | None = None,
        queued_s: float = DEFAULT_QUEUED_S,
    ) -> None:
        self.protocol = protocol
        #: ``after_commit = "continue"``: the protocol's way to finish a cut turn in
        #: place (`core.continuation`); None: a cut after commit ends as always
        self.continuation = continuation
        #: a continuation with no progress this long is given up (stuck in ``queued``)
        self.queued_s = queued_s
        #: requests that free what nobody will read (the transport sends them)
        self.cancels: list[Cancel] = []
        #: why the last cut was not continued (None: it was, or none was asked)
        self.refusal: Refusal | PrefillRefusal | None = None
        #: the client's profile (`core.profiles`): early headers, keepalive form and
        #: interval, the non-streamed wait
        self.profile = profile or DEFAULT_PROFILE
        #: the keepalive the profile asks for, when the protocol has one (else comments)
        self.keepalive_event = (
            protocol.keepalive_event
            if self.profile.keepalive is KeepaliveForm.EVENT or not protocol.comment_keepalive
            else None
        )
        #: the client is a WebSocket: its keepalive is a message (the event's data), sent
        #: only for a profile that asks for events (pings keep the socket alive otherwise)
        self.socket = socket
        self.hold = hold
        self.timers = _stall_timers(timers, self.profile)
        self.retry = retry
        self.stream = stream
        self.report = report
        self.clock = clock  # for the ledger's hold time only
        self.wall_clock = wall_clock  # Unix time, for the ledger's dated error events
        self.t0 = now
        self.step = _Step.NEW
        self.outcome: Outcome | None = None
        self.failure: Failure | None = None
        self.status: int | None = None  # the current attempt's upstream status
        self.ledger: Ledger | None = None  # the SSE ledger: one per turn, across attempts
        self.attempt_ledger: Ledger | None = None  # the ledger this attempt's body went through
        self.stats: AttemptStats | None = None
        self.headers_out = False
        self.writing = 0  # writes to the client in progress (a keepalive may overlap one)
        self._write_t0 = now  # when the writes in progress began
        self.stalled = False
        self.first_frame = False  # the current attempt's first (non-comment) frame arrived
        self.last_rx = now
        self.last_tx = now
        self._attempt_t0 = now
        self._answer_kept = False
        self._done_seen = False
        self._overflow_reported = False
        self._over: Action | None = None
        self._parked = False  # the next attempt follows a park
        self._splitter: SSESplitter | None = None
        self._patched = False  # the current attempt's request body was patched
        self._resume: Resume | None = None  # the continuation the next attempt opens
        self._splice: Splicer | None = None  # the current continuation's join check
        self._resume_t0 = now
        self._queued = False  # the continuation made no progress within queued_s

    # -- attempts ----------------------------------------------------------------------
    def start(self, now: float) -> Action:
        if self.step is not _Step.NEW:
            self._illegal("start")
        self.step = _Step.IDLE
        return self.next_attempt(now)

    def next_attempt(self, now: float) -> Action:
        """After `start` or a `Wait`: open the next attempt, or give up."""
        if self.step is not _Step.IDLE:
            self._illegal("next_attempt")
        retry = self.retry
        if retry.exhausted():
            return self._give_up()
        resume = self._resume
        if resume is not None:
            idx = retry.next_resume(now, pace=not _testing)
        else:
            idx = retry.next_upstream(now, pace=not _testing)
        if type(idx) is Park and _testing:
            # testing mode: no real waits, parks neither
            if resume is not None:
                idx = retry.next_resume(idx.until, pace=False)
            else:
                idx = retry.next_upstream(idx.until, pace=False)
        if type(idx) is Park:
            # Parked in an upstream's line: the transport wakes the turn when the pacer
            # grants it a go (or at ``until``); its timer keeps the client alive
            # (early headers, keepalives) meanwhile.
            self.report.parked(idx.why)
            self.report.state(TurnState.PARKED)
            self._parked = True
            wait = min(max(idx.until - now, 0.001), retry.park_check_s)
            return Wait(wait, idx.key, retry.ticket)
        assert isinstance(idx, int)
        self.status = None
        self.failure = None
        self._answer_kept = False
        self._over = None
        self.stats = AttemptStats()
        choice = "parked" if self._parked else (retry.why or "first")
        self._parked = False
        self.report.attempt_started(retry.attempts, idx, choice)
        self.report.state(TurnState.WAITING)
        if resume is not None:
            # The continuation of the cut attempt: the turn's ledger goes on with it.
            self._resume = None
            self.step = _Step.RESUMING
            self.attempt_ledger = self.ledger
            self._resume_t0 = now
            return resume
        self.step = _Step.CONNECTING
        self.attempt_ledger = None
        self._splice = None
        self._queued = False  # a new response: the last one's queue is behind
        t = self.timers
        # A non-streamed answer arrives only once generated: allow it as long as the
        # client waits for it (when known), else the first-frame time.
        if self.stream:
            timeout = t.header_timeout_s
        else:
            timeout = self.profile.nonstream_wait(t.header_timeout_s, t.first_frame_timeout_s)
        strategy = self.continuation
        if strategy is not None:  # (the transports give one to streamed turns only)
            patch = strategy.body_patch(idx)
            self._patched = bool(patch)
            return Open(idx, timeout, patch)
        return Open(idx, timeout)

    def open_failed(self, now: float, failure: Failure) -> Action:
        """Connecting, sending, or waiting for the headers failed."""
        if self.step not in _OPENING:
            self._illegal("open_failed")
        if self.step is _Step.RESUMING:
            return self._continuation_failed(now, failure)
        phase = Phase.HEADERS if failure.cls is FailureClass.HEADER_TIMEOUT else Phase.CONNECT
        return self._attempt_failed(now, failure, phase)

    def answered(
        self,
        now: float,
        status: int,
        *,
        sse: bool,
        retry_after_s: float | None = None,
        rate: RateHeaders | None = None,
    ) -> Action:
        """The upstream's status line and headers arrived (``rate``: what they say of
        the key's rate limits, `core.ratehead`)."""
        if self.step not in _OPENING:
            self._illegal("answered")
        self.status = status
        if rate is not None:
            self.retry.record_rate(rate, now)
        if self.step is _Step.RESUMING:
            return self._resume_answered(now, status, sse=sse, retry_after_s=retry_after_s)
        if status < 200:
            # 1xx (a 101 to a plain request, say) is no answer for the client.
            return self._attempt_failed(
                now,
                Failure(FailureClass.STATUS, f"HTTP {status}", status=status),
                Phase.HEADERS,
            )
        if is_retryable_status(status):
            self.failure = Failure(
                FailureClass.STATUS, f"HTTP {status}", status=status, retry_after_s=retry_after_s
            )
            self._reading(now, _Step.ERROR_BODY)
            return ReadErrorBody()
        self.retry.record_answer(now)  # known good: its pacer's line may move
        if self._patched and 400 <= status < 500:
            # Maybe a refusal of the patched request (`Strategy.refused`): read it.
            self.failure = Failure(FailureClass.STATUS, f"HTTP {status}", status=status)
            self._reading(now, _Step.ERROR_BODY)
            return ReadErrorBody()
        if status < 300 and sse:
            ledger = self.ledger
            if ledger is None:
                ledger = self.ledger = Ledger(
                    self.protocol,
                    hold=self.hold,
                    max_hold_bytes=self.timers.max_hold_bytes,
                    clock=self.clock,
                    wall_clock=self.wall_clock,
                    error_after_commit=not self.abort_after_commit,
                )
                ledger.stats = self.stats or AttemptStats()
            else:
                ledger.start_attempt(self.stats)
            strategy = self.continuation
            # (HTTP only: a socket's frames are fed one by one, with no such check)
            ledger.errors_cut = (
                strategy is not None and strategy.continues_errors and not self.socket
            )
            self.attempt_ledger = ledger
            self._splitter = SSESplitter(self.timers.max_event_bytes)
            self._reading(now, _Step.STREAM)
            self.report.state(
                TurnState.HOLDING if ledger.state is State.PENDING else TurnState.STREAMING
            )
            return Stream()
        if self.headers_out:
            # Early SSE headers are out: a final answer must be an in-stream event.
            self._reading(now, _Step.FINAL_BODY)
            return FinalInStream()
        self._reading(now, _Step.PASS_THROUGH)
        ledger = self.attempt_ledger = Ledger(BODY, hold=_NO_HOLD)
        ledger.stats = self.stats or AttemptStats()
        return PassThrough()

    def error_body(self, now: float, body: bytes = b"") -> Action:
        """A retryable answer's body was read and kept by the transport."""
        self._expect(_Step.ERROR_BODY, "error_body")
        self._answer_kept = True
        failure = self.failure
        if failure is None:  # pragma: no cover - set by answered()
            raise TurnError("error_body() without a retryable answer")
        if self._patched and failure.status is not None and not is_retryable_status(failure.status):
            return self._patched_refused(now, failure.status, body)
        if body and failure.retry_after_s is None:
            # A wait the body names (Gemini's RetryInfo), obeyed like Retry-After.
            hint = self.protocol.retry_delay(body)
            if hint is not None:
                failure = self.failure = dataclasses.replace(failure, retry_after_s=hint)
        if body and self.protocol.quota_body(body):  # insufficient_quota...: a quota wall
            failure = self.failure = Failure(
                failure.cls, f"quota: {failure.reason}", failure.status, failure.retry_after_s
            )
        return self._attempt_failed(now, failure, Phase.HEADERS)

    def final_body(
        self, now: float, status: int, body: bytes, request_id: str | None = None
    ) -> Action:
        """A final non-SSE answer after early headers: re-sent as the in-stream error,
        in the protocol's final terms, with the provider's request id when known."""
        self._expect(_Step.FINAL_BODY, "final_body")
        return self._end(
            Outcome.PASSED_THROUGH_ERROR,
            End(EndKind.ERROR, self.protocol.final_error_frame(status, body, request_id)),
        )

    # -- body ------------------------------------------------------------------------
    def feed_chunk(self, now: float, chunk: bytes) -> Sequence[Event]:
        """SSE body bytes, through the splitter and the ledger frame by frame.  Returns
        the frames to write now (boundaries kept); then check `attempt_over`."""
        if self.step is not _Step.STREAM:
            self._illegal("feed_chunk")
        self.last_rx = now
        splitter = self._splitter
        assert splitter is not None
        too_large: EventTooLarge | None = None
        try:
            events = splitter.feed(chunk)
        except EventTooLarge as exc:
            # The complete events before it still count; then the attempt has failed.
            events, too_large = exc.events, exc
        if too_large is not None:
            out = self._feed_events(now, events)
            if self._over is None and not self.ended:
                self._over = self.transport_failed(
                    now, Failure(FailureClass.MALFORMED, str(too_large))
                )
            return out
        if not events:
            return NOTHING
        return self._feed_events(now, events)

    def feed_verbatim(self, now: float, chunk: bytes) -> bytes | None:
        """`feed_chunk` for a sink that writes bytes (`verbatim`).  Returns None when
        ``chunk`` is released whole, as it is (write it; a run of plain frames never
        ends the attempt, so there is no need to ask `attempt_over`), else the bytes to
        write now (maybe none); then check `attempt_over`.

        The decisions are `feed_chunk`'s, frame by frame; only the work differs.  Once
        the ledger has committed, with nothing held and no tool call open, a run of
        frames the classifier proves plain is released as it is, in one piece, with
        no `Event` each (`Ledger.release_run`): a paced stream's chunk of one text
        delta passes whole.  Before commit, and to finish a frame an earlier chunk
        began, frames go to the splitter one at a time (at most `PEEL_FRAMES` a
        chunk), so a turn that arrives in one chunk (a fast model, a burst after a
        pause, a busy relay) takes the run from its first output on.  What no run
        covers goes to `feed_chunk`.  The splitter gets every byte, in order, in
        pieces; it splits any cut of a stream the same way, so it finds exactly the
        frames it would find in the whole chunk.  A run starts only where the
        splitter is `idle`, and a chunk holding a CR takes no run at all (a CR can
        end a line).
        """
        if self.step is not _Step.STREAM:
            self._illegal("feed_verbatim")
        splitter = self._splitter
        ledger = self.attempt_ledger
        assert splitter is not None and ledger is not None
        if CR in chunk or not chunk or self._splice is not None:
            # (a continuation's frames each pass its join check: no runs)
            return _joined(self.feed_chunk(now, chunk))
        self.last_rx = now
        size = len(chunk)
        pos = ledger.release_run(chunk) if splitter.idle else 0
        if pos == size:
            if self.continuation is not None:
                self._record(chunk)
            return None  # the whole chunk: plain output after commit
        out: list[bytes] = [chunk[:pos]] if pos else []
        if pos and self.continuation is not None:
            self._record(chunk[:pos])
        peeled = 0
        while True:
            if peeled < PEEL_FRAMES and (ledger.state is State.PENDING or not splitter.idle):
                peeled += 1
                end = chunk.find(b"\n\n", pos)
                end = size if end < 0 else end + 2
            else:
                end = size
            released = self.feed_chunk(now, chunk[pos:end] if pos or end < size else chunk)
            if released:
                out.extend([e.raw for e in released])
            pos = end
            if pos == size or self.attempt_over is not None:
                break
            if splitter.idle:
                end = ledger.release_run(chunk, pos)
                if end > pos:
                    out.append(chunk[pos:end])
                    if self.continuation is not None:
                        self._record(chunk[pos:end])
                    pos = end
                    if pos == size:
                        break
        return out[0] if len(out) == 1 else b"".join(out)

    def _feed_events(self, now: float, events: list[Event]) -> Sequence[Event]:
        if not events:
            return NOTHING
        if self._splice is not None:
            return self._feed_spliced(now, events)
        ledger = self.attempt_ledger
        assert ledger is not None
        if not self.first_frame:
            for event in events:
                if not event.is_comment:
                    self.first_frame = True
                    break
        feed = ledger.feed
        out: list[Event] = []
        for event in events:
            released = feed(event)
            if released:
                out.extend(released)
            verdict = ledger.verdict
            if verdict is not Verdict.CONTINUE:
                if verdict is Verdict.DONE:
                    if event.data == "[DONE]":
                        self._done_seen = True
                    continue
                break
        if ledger.hold_overflowed and not self._overflow_reported:
            self._overflow_reported = True
            self.report.hold_overflow(ledger.max_hold_bytes)
        if out:
            self._released()
            if self.continuation is not None:
                self._record_events(out)
        if ledger.verdict is Verdict.CUT:  # after the frames before it were recorded
            out.extend(self._cut_by_error(now, ledger))
        verdict = ledger.verdict
        if verdict is Verdict.REPLAY or verdict is Verdict.FAIL:
            self._decide(now)
        return out

    def _cut_by_error(self, now: float, ledger: Ledger) -> Sequence[Event]:
        """A provider's retryable error event after commit, with a strategy that may
        continue it (`Strategy.continues_errors`): a cut like a reset.  Continued, the
        attempt is over (`attempt_over`); else the native error, as always."""
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
            strategy.released(_joined(events))

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

    def feed_frame(self, now: float, event: Event) -> Sequence[Event]:
        """One frame (a WebSocket message).  Returns the frames to send; then `attempt_over`."""
        if self.step is not _Step.STREAM:
            self._illegal("feed_frame")
        self.last_rx = now
        if not self.first_frame:
            self.first_frame = True
        splice = self._splice
        if splice is not None:
            try:
                spliced = splice.splice(event)
            except JoinBroken as exc:
                self._over = self._join_broken(now, str(exc))
                return NOTHING
            if spliced is None:
                return NOTHING
            if not isinstance(spliced, Event):
                return self._feed_frames(now, spliced)
            event = spliced
        ledger = self.attempt_ledger
        assert ledger is not None
        released = ledger.feed(event)
        if ledger.hold_overflowed and not self._overflow_reported:
            self._overflow_reported = True
            self.report.hold_overflow(ledger.max_hold_bytes)
        if released:
            self._released()
            if self.continuation is not None:
                self._record_events(released)
        verdict = ledger.verdict
        if verdict is Verdict.REPLAY or verdict is Verdict.FAIL:
            self._decide(now)
        return released

    def _feed_frames(self, now: float, events: Sequence[Event]) -> Sequence[Event]:
        """`feed_frame` for the frames a splicer made of one message, in order."""
        ledger = self.attempt_ledger
        assert ledger is not None
        out: list[Event] = []
        for event in events:
            out.extend(ledger.feed(event))
            if ledger.verdict is Verdict.REPLAY or ledger.verdict is Verdict.FAIL:
                break
        if out:
            self._released()
            self._record_events(out)
        if ledger.verdict is Verdict.REPLAY or ledger.verdict is Verdict.FAIL:
            self._decide(now)
        return out

    def feed_body(self, now: float, chunk: bytes) -> bytes:
        """Plain body bytes: each chunk is released at once (the first byte commits)."""
        if self.step is not _Step.PASS_THROUGH:
            self._illegal("feed_body")
        self.last_rx = now
        if not self.first_frame:
            self.first_frame = True
        ledger = self.attempt_ledger
        assert ledger is not None
        released = ledger.feed(Event(chunk, None, ""))
        if released:
            self._released()
        return chunk if released else b""

    def _released(self) -> None:
        if not self.headers_out:
            self.headers_out = True
            self.report.headers_sent()
            self.report.state(TurnState.STREAMING)

    def _decide(self, now: float) -> None:
        """A frame ended the attempt (a replay, or a failure after commit): decided
        now, by the feed that brought it, so no later event of this attempt is legal."""
        self._over = self._verdict_action(now, None)

    @property
    def attempt_over(self) -> Action | None:
        """After a feed: the action that ends this attempt, or None to keep reading.

        The feed that ended the attempt decided it (the machine is past the attempt
        already); asking again returns the same action.
        """
        return self._over

    def body_ended(self, now: float) -> Action:
        """The upstream body ended cleanly (EOF)."""
        if self.step not in _BODY_ENDS:
            self._illegal("body_ended")
        ledger = self.attempt_ledger
        assert ledger is not None
        if self.stalled:
            return self.transport_failed(now, _stall_failure())
        if ledger.protocol is BODY:
            ledger.ended()
            outcome = (
                self._ok_outcome() if (self.status or 0) < 400 else (Outcome.PASSED_THROUGH_ERROR)
            )
            return self._end(outcome, End(EndKind.CLEAN))
        if ledger.state is State.DONE:
            return self._end(self._ok_outcome(), End(EndKind.CLEAN, self._tail_bytes()))
        if self.continuation is not None and ledger.protocol.has_terminal:
            cut = Failure(FailureClass.TRUNCATED, "stream ended without a terminal frame")
            action = self._continue(now, cut)
            if action is not None:
                return action
        pending = self._splitter.pending if self._splitter is not None else b""
        out = ledger.ended(pending)
        if ledger.verdict is Verdict.DONE:  # generic SSE: a clean end is its success
            return self._end(self._ok_outcome(), End(EndKind.CLEAN))
        failure = Failure(FailureClass.TRUNCATED, "stream ended without a terminal frame")
        return self._verdict_action(now, failure, out)

    def transport_failed(self, now: float, failure: Failure) -> Action:
        """Reading the upstream failed (or the connection was aborted for a stall)."""
        if self.step in _OPENING:
            return self.open_failed(now, failure)
        if self.step not in _READING:
            self._illegal("transport_failed")
        if self.stalled:
            failure = _queued_failure() if self._queued else _stall_failure()
        ledger = self.attempt_ledger
        if ledger is None:
            return self._attempt_failed(now, failure, self._replay_phase(failure))
        if ledger.state is State.DONE:
            # The turn is complete: finish the protocol's ending, record the cut.
            self._record_tail_cut(failure)
            return self._end(self._ok_outcome(), End(EndKind.CLEAN, self._tail_bytes()))
        if self.continuation is not None and self.step is _Step.STREAM:
            action = self._continue(now, failure)
            if action is not None:
                return action
        out = ledger.failed(failure.reason)
        return self._verdict_action(now, failure, out)

    # -- verdicts -----------------------------------------------------------------------
    def _verdict_action(self, now: float, failure: Failure | None, out: bytes = b"") -> Action:
        ledger = self.attempt_ledger
        assert ledger is not None
        verdict = ledger.verdict
        if verdict is Verdict.REPLAY:
            if failure is None:
                cls = (
                    FailureClass.MALFORMED
                    if ledger.fail_reason == "malformed frame"
                    else FailureClass.STREAM_ERROR
                )
                failure = Failure(cls, ledger.fail_reason)
            if self.continuation is not None:
                self._abandon()  # the replay starts a new response: nobody reads this one
            return self._attempt_failed(now, failure, self._replay_phase(failure))
        if verdict is Verdict.DONE:
            return self._end(self._ok_outcome(), End(EndKind.CLEAN, self._tail_bytes()))
        # FAIL
        if ledger.passed_through:
            # The provider's own final error frame was released with the frames.
            return self._end(Outcome.PASSED_THROUGH_ERROR, End(EndKind.CLEAN))
        if failure is None:
            failure = Failure(FailureClass.STREAM_ERROR, ledger.fail_reason)
        self._committed_failure(failure)
        if ledger.protocol is BODY or self.abort_after_commit:
            # A plain body has no error event; a profile may ask for the abort too.
            return self._end(Outcome.ENDED_WITH_ERROR, End(EndKind.ABORT))
        # ``out`` is the native error when it came from failed()/ended(); an in-stream
        # error frame's native error was already released by feed().
        return self._end(Outcome.ENDED_WITH_ERROR, End(EndKind.ERROR, out))

    # -- continuation (`core.continuation`) ----------------------------------------------
    def _continue(self, now: float, failure: Failure) -> Action | None:
        """A cut where the turn would end (or replay): continue it in place if the
        strategy can (the next attempt is its `Resume`, paced like any retry), else
        None: the caller ends the turn exactly as without a strategy."""
        strategy = self.continuation
        ledger = self.ledger
        if strategy is None or ledger is None or self.attempt_ledger is not ledger:
            return None
        if ledger.verdict is not Verdict.CONTINUE or (
            ledger.state is not State.PENDING and ledger.state is not State.COMMITTED
        ):
            return None
        committed = ledger.state is State.COMMITTED
        if self._queued:
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
        self.stalled = False
        self._splice = None
        self.step = _Step.IDLE
        self._resume = plan
        report = self.report
        report.attempt_ended(failure.label, phase, self.status, self.stats)
        report.continuation("spliced", strategy_splices(strategy), strategy.saved_frames)
        retry = self.retry
        wait = retry.resume_delay(failure)
        report.attempt_failed(failure, phase, wait)
        report.state(TurnState.WAITING)
        if wait > 0 and not _testing:
            keys = retry.keys
            return Wait(wait, keys[retry.current] if keys else None)
        return self.next_attempt(now)

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
            self._reading(now, _Step.STREAM)
            self._resume_t0 = now
            self.report.state(
                TurnState.HOLDING if ledger.state is State.PENDING else TurnState.STREAMING
            )
            return Stream()
        failure = Failure(
            FailureClass.STATUS, f"HTTP {status}", status=status, retry_after_s=retry_after_s
        )
        if status < 200 or is_retryable_status(status):
            return self._continuation_failed(now, failure)
        # A final answer to the continuation (a model that refuses prefill answers 400):
        # the strategy may remember it for the upstream; the turn ends as without it.
        strategy.refused(self.retry.current, status, b"")
        return self._join_broken(now, f"the continuation was answered HTTP {status}")

    def _continuation_failed(self, now: float, failure: Failure) -> Action:
        """Opening a continuation failed (connect, headers, a retryable status): the
        response still runs, so another continuation may follow (bounded)."""
        self.step = _Step.STREAM  # the cut attempt's ledger decides, as for any cut
        action = self._continue(now, failure)
        if action is not None:
            return action
        ledger = self.ledger
        assert ledger is not None
        self.attempt_ledger = ledger
        return self._verdict_action(now, failure, ledger.failed(failure.reason))

    def _join_broken(self, now: float, reason: str) -> Action:
        """The continuation does not continue what the client saw: never splice it.
        Committed, the turn ends with the native error; else it is replayed."""
        self._splice = None
        self._refused(Refusal.JOIN)
        failure = Failure(FailureClass.STREAM_ERROR, f"continuation refused: {reason}")
        ledger = self.ledger
        assert ledger is not None
        self.attempt_ledger = ledger
        if self.step is _Step.RESUMING:
            self.step = _Step.STREAM
        return self._verdict_action(now, failure, ledger.failed(failure.reason))

    def _patched_refused(self, now: float, status: int, body: bytes) -> Action:
        """A final 4xx to a patched request: a refusal of the mechanism is remembered
        and the attempt made again with the client's request (nothing was released);
        any other is the provider's final answer, as always."""
        strategy = self.continuation
        assert strategy is not None
        failure = self.failure
        if strategy.refused(self.retry.current, status, body):
            self._patched = False
            self.report.attempt_ended("continuation_refused", Phase.HEADERS, status, self.stats)
            self._refused(Refusal.NOT_RESUMABLE)
            self.step = _Step.IDLE
            return self.next_attempt(now)
        if self.headers_out:
            return self._end(
                Outcome.PASSED_THROUGH_ERROR,
                End(EndKind.ERROR, self.protocol.final_error_frame(status, body, None)),
            )
        self.failure = failure
        self.step = _Step.ENDED
        self.retry.close()
        self.outcome = Outcome.PASSED_THROUGH_ERROR
        self.report.attempt_ended(Outcome.PASSED_THROUGH_ERROR.value, None, status, self.stats)
        self.report.state(TurnState.DONE)
        return GiveUp(GiveUpKind.PASS_THROUGH)

    def _abandon(self) -> None:
        """The current response will not be read on: name what frees it."""
        strategy = self.continuation
        ledger = self.ledger
        if strategy is not None and ledger is not None and self.retry.current >= 0:
            self.cancels.extend(strategy.abandon(self.retry.current, ledger))

    def take_cancels(self) -> list[Cancel]:
        """The cancel requests named since the last call (the transport sends them)."""
        out = self.cancels
        if out:
            self.cancels = []
        return out

    @property
    def splices(self) -> int:
        """Continuations this turn made."""
        strategy = self.continuation
        return strategy_splices(strategy) if strategy is not None else 0

    @property
    def abort_after_commit(self) -> bool:
        """A stream cut after commit ends by aborting the client connection, not with
        the native error event (the profile's ``after_commit_end``; HTTP only)."""
        return self.profile.after_commit_end is CommitEnd.RESET and not self.socket

    def _replay_phase(self, failure: Failure) -> Phase:
        if failure.cls is FailureClass.STALL:
            return Phase.STALL
        if failure.status is not None:
            return Phase.HEADERS
        stats = self.stats
        if failure.cls.reroutes_at_once and (stats is None or stats.received_frames == 0):
            return Phase.CONNECT
        return Phase.PENDING

    def _attempt_failed(self, now: float, failure: Failure, phase: Phase) -> Action:
        """An attempt failed before commit: record it, then wait, retry or give up."""
        self.failure = failure
        self.stalled = False
        self.step = _Step.IDLE
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
        report.state(TurnState.WAITING)
        if wait > 0 and not _testing:
            keys = retry.keys
            return Wait(wait, keys[retry.current] if keys else None)
        return self.next_attempt(now)

    def _committed_failure(self, failure: Failure) -> None:
        """The attempt failed after output reached the client: no replay, ever."""
        self.failure = failure
        self.report.attempt_ended(failure.label, Phase.COMMITTED, self.status, self.stats)
        self.report.attempt_failed(failure, Phase.COMMITTED, None)

    def _record_tail_cut(self, failure: Failure) -> None:
        self.report.attempt_ended(failure.label, Phase.TAIL, self.status, self.stats)
        self.report.attempt_failed(failure, Phase.TAIL, None)

    def _tail_bytes(self) -> bytes:
        """What the protocol's ending still lacks after its terminal frame."""
        if self._done_seen or self.protocol.done_marker is None:
            return b""
        self._done_seen = True
        return self.protocol.done_marker

    def _give_up(self) -> GiveUp:
        failure = self.failure
        reason = failure.reason if failure else "retries exhausted"
        if self.continuation is not None:
            self._abandon()
        self.step = _Step.ENDED
        self.retry.close()
        if self.headers_out:
            ledger = self.ledger or Ledger(
                self.protocol, hold=self.hold, wall_clock=self.wall_clock
            )
            data = ledger.give_up(f"retries exhausted ({reason})")
            self.outcome = Outcome.ENDED_WITH_ERROR
            return GiveUp(GiveUpKind.IN_STREAM, data)
        self.outcome = Outcome.PASSED_THROUGH_ERROR
        if self._answer_kept and failure is not None and failure.status is not None:
            return GiveUp(GiveUpKind.PASS_THROUGH)
        return GiveUp(
            GiveUpKind.BAD_GATEWAY,
            self.protocol.error_body(f"unbroken: all upstream attempts failed ({reason})"),
        )

    def _end(self, outcome: Outcome, action: End) -> End:
        if self.continuation is not None and not outcome.is_ok:
            self._abandon()
        self.step = _Step.ENDED
        retry = self.retry
        if retry.admitted:  # the rate limiter learns what the request cost
            stats = self.stats
            retry.settle(self.last_rx, usage_from(stats.usage_frames())[0] if stats else None)
        retry.close()
        self.outcome = outcome
        if outcome.is_ok or outcome is Outcome.PASSED_THROUGH_ERROR:
            ok = outcome.is_ok
            self.report.attempt_ended("ok" if ok else outcome.value, None, self.status, self.stats)
        self.report.state(TurnState.DONE)
        return action

    def _ok_outcome(self) -> Outcome:
        if self.continuation is not None and strategy_splices(self.continuation):
            return Outcome.RESUMED
        return Outcome.RECOVERED if self.retry.retries else Outcome.OK

    def _reading(self, now: float, step: _Step) -> None:
        self.step = step
        self.first_frame = False
        self.stalled = False
        self._over = None  # this attempt's own decision, once a feed makes one
        self._attempt_t0 = now
        self.last_rx = now

    def _expect(self, step: _Step, event: str) -> None:
        if self.step is not step:
            self._illegal(event)

    def _illegal(self, event: str) -> NoReturn:
        """Refuse an event the current step does not accept: a transport bug.  The
        machine goes to ERROR, where every event but the end from outside raises."""
        step = self.step
        self.step = _Step.ERROR
        if step is _Step.ERROR:
            raise TurnError(f"{event}() after an illegal event")
        raise TurnError(f"{event}() is illegal in step {step.value}")

    # -- the end from outside -------------------------------------------------------------
    def client_gone(self) -> Outcome:
        """The client went away (or the turn was cancelled).  Returns the final outcome.

        A turn whose terminal frame was released is complete, even if the client
        closes a moment later: it stays ``ok``.
        """
        if self.outcome is None:
            ledger = self.ledger
            if ledger is not None and ledger.state is State.DONE:
                self.outcome = self._ok_outcome()
                self.report.attempt_ended("ok", None, self.status, self.stats)
            else:
                self.outcome = Outcome.ABORTED_BY_CLIENT
                if self.continuation is not None:
                    self._abandon()  # nobody reads the response any more
                committed = ledger is not None and ledger.state is not State.PENDING
                self.report.attempt_ended(
                    Outcome.ABORTED_BY_CLIENT.value,
                    Phase.COMMITTED if committed or self.headers_out else None,
                    self.status,
                    self.stats,
                )
        self.step = _Step.ENDED
        self.retry.close()
        return self.outcome

    def crashed(self) -> Outcome:
        """A bug in the relay ended the turn."""
        if self.outcome is None or self.step is not _Step.ENDED:
            self.outcome = Outcome.INTERNAL_ERROR
            self.report.attempt_ended(Outcome.INTERNAL_ERROR.value, None, self.status, self.stats)
        self.step = _Step.ENDED
        self.retry.close()
        return self.outcome

    def shutdown_error(self) -> bytes:
        """The relay shuts down mid-stream: the native error for a committed stream, or b""."""
        ledger = self.ledger
        if ledger is None or ledger.state is not State.COMMITTED or not self.headers_out:
            return b""
        return ledger.failed("the relay is shutting down")  # b"" for a reset profile

    @property
    def keepalive_bytes(self) -> bytes:
        """What a keepalive write sends: the profile's or protocol's event, or a comment."""
        return self.keepalive_event if self.keepalive_event is not None else KEEPALIVE

    @property
    def ended(self) -> bool:
        return self.step is _Step.ENDED

    # -- the clock ----------------------------------------------------------------------
    def headers_sent(self, now: float) -> None:
        """The transport sent the response headers (early, or with the first bytes)."""
        if self.step is _Step.ERROR:
            self._illegal("headers_sent")
        if not self.headers_out:
            self.headers_out = True
            self.report.headers_sent()
        self.last_tx = now

    def write_started(self, now: float) -> None:
        """A write to the client begins: the stall clock stops until it completes."""
        if self.step is _Step.ERROR:
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
        if self.step is _Step.ERROR or not self.writing:
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
        a deadline that a later event sets (see `relay.http.Watchdog`)."""
        t, p = self.timers, self.profile
        intervals = (
            p.early_headers_s or t.early_headers_s,
            p.keepalive_s or t.keepalive_s,
            t.idle_timeout_s,
            t.first_frame_timeout_s,
        )
        return min([i for i in intervals if i > 0], default=60.0)

    def deadline(self) -> float | None:
        """When `tick` is next due, or None when nothing is timed."""
        if self.step in _OVER:
            return None
        t = self.timers
        p = self.profile
        due: float | None = None
        if self.stream or self.socket:
            if not self.headers_out:
                if p.early_headers and (self.ledger is None or self.ledger.state is State.PENDING):
                    due = self.t0 + (p.early_headers_s or t.early_headers_s)
            elif not self.writing and (self.keepalive_event is not None or not self.socket):
                due = self.last_tx + (p.keepalive_s or t.keepalive_s)
        if self.step in _READING and not self.writing and not self.stalled:
            stall = (
                self.last_rx + t.idle_timeout_s
                if self.first_frame
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
        if self.step in _OVER:
            return None
        t = self.timers
        if self.step in _READING and not self.writing and not self.stalled:
            due = (
                self.last_rx + t.idle_timeout_s
                if self.first_frame
                else self._attempt_t0 + t.first_frame_timeout_s
            )
            if now >= due:
                self.stalled = True
                return AbortUpstream(_stall_failure())
            splice = self._splice
            if (
                splice is not None
                and not splice.progressed
                and now >= self._resume_t0 + self.queued_s
            ):
                # The continuation shows no progress (a response stuck in ``queued``):
                # give it up (it is cancelled); replayed if nothing was released.
                self.stalled = True
                self._queued = True
                return AbortUpstream(_queued_failure())
        p = self.profile
        if self.stream or self.socket:
            if not self.headers_out:
                ledger = self.ledger
                early = self.t0 + (p.early_headers_s or t.early_headers_s)
                if (
                    p.early_headers
                    and now >= early
                    and (ledger is None or ledger.state is State.PENDING)
                ):
                    # Retries or held frames have lasted long: send SSE headers now so
                    # the client's header timer does not fire; keepalives follow.
                    self.headers_out = True
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


_NO_HOLD = Hold(())


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


def _stall_timers(timers: Timers, profile: Profile) -> Timers:
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


def _stall_failure() -> Failure:
    return Failure(FailureClass.STALL, "stall: the upstream went silent past its timeout")


def _queued_failure() -> Failure:
    return Failure(FailureClass.STALL, "stall: the continuation made no progress (queued)")


def strategy_splices(strategy: Strategy) -> int:
    """The continuations a strategy made."""
    return strategy.splices
