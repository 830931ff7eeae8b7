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
    socket_answered()            a socket took the request (no status line): `answered`
                                 with a 200 stream
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
    Resume(upstream, method,     open a continuation of the cut attempt (`core.turn.continuation`)
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
  forward by the blocked time).  The attempt's stall watch is a sub-state,
  `turn_table.Watch`: FIRST_FRAME, then IDLE (the timer it runs), then STALLED
  (aborted for silence) or QUEUED (a continuation with no progress); the abort's
  read failure is named by it.

Continuation after commit (``[stream] after_commit = "continue"``, `core.turn.continuation`):
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
A turn continue mode cannot cover at all (its request enables thinking, forces a
tool, ...) has no strategy but a ``refusal``: the observer records it when the
machine is made (`TurnObserver.uncovered`), so that refusal is never silent.

Legality and transitions: one table, `turn_table.ROWS`, that the code runs (as h11's
``_state.py`` does).  Each row is a (step, event) pair and the actions the event may
return there; the step after an event is the step its action enters
(`turn_table.ENTERS`: ``Open`` CONNECTING, ``Wait`` IDLE, ``End`` ENDED, ...), and a
feed that ends no attempt stays.  An event with no row for the current step is a
transport bug (a chunk of a dead attempt read after its `Wait`, a feed after `End`):
it raises `TurnError` and the machine goes to ERROR, where every event raises again,
except the end from outside (``client_gone``, ``crashed``, so that the transport can
clean up) and the clock (``deadline``, ``tick``: None).  Nothing is released after an
illegal event, and the ledger is left as it was.  An action a row does not list is
refused the same way (a bug in the machine).  Only the table moves the step: one
method writes it (`TurnFields._moved`, the event's row, or a move no row makes:
`turn_table.Outside`, the creation, the end from outside, an illegal event); the inner
helpers return actions, and the machine stays in the event's step until the event
returns (a continuation that fails to open is decided in RESUMING, by its rows).
Sub-states are written only through checked setters (``_set_watch``, ``_set_reply``,
...), which refuse a value in a step the table says cannot enter it
(`turn_table.ENTERED_IN`) the same way.  The events that branch most (``answered``,
``transport_failed``, ``body_ended``) run ordered lists of (condition, outcome) guards
(`turn_guards.GUARDS`): the first guard that holds, and does not decline, decides.
``docs/gate.md``'s tables (rows, sub-states, guards) are generated from that data
(``python -m unbroken.core.turn.turn_table --markdown``); so is this one::

    step          entered by                         legal events
    NEW           the machine's creation             start
    IDLE          Wait                               next_attempt
    CONNECTING    Open                               open_failed, answered, transport_failed
    RESUMING      Resume                             open_failed, answered, transport_failed
    STREAM        Stream                             feed_chunk, feed_verbatim, feed_frame,
                                                     body_ended, transport_failed
    PASS_THROUGH  PassThrough                        feed_body, body_ended, transport_failed
    ERROR_BODY    ReadErrorBody                      error_body, transport_failed
    FINAL_BODY    FinalInStream                      final_body, transport_failed
    ENDED         End, GiveUp, the end from outside  (none)
    ERROR         an illegal event                   (none)

In every step: ``client_gone``, ``crashed``, ``deadline``, ``tick``, and, but in ERROR,
the write notifications ``headers_sent``, ``write_started``, ``wrote`` (``wrote`` only
after a ``write_started``).  On the hot path the check is an identity comparison (one
per chunk: a feed is legal in one step).

Every feed returns one shape, `Fed(released, over)`: what to write now, and the
action that ends the attempt (None: read on).  The frame that ends an attempt (a
replay, a failure after commit) decides it at once, in that feed; so the next feed
of that attempt is illegal.  A transport dispatches over actions with ``match`` and
``typing.assert_never``, so a new action cannot go unhandled.

Where the parts live (one class, `TurnMachine`, its fields in `turn_fields`)::

    turn            this header; the events (attempts, answers, feeds), their legality
    turn_endings    an attempt's body ending or failing, verdicts (replay, end, the kept
                    answer), retry or give up, the end from outside (client gone, crash)
    turn_types      the actions, `Fed`, `Outcome`, `Phase`, the `TurnObserver` protocol
    turn_table      the steps (`Step`), the sub-states (`SUBSTATES`), the events
                    (`TurnEvent`), the table the code runs
    turn_guards     the ordered guards of ``answered``, ``transport_failed``,
                    ``body_ended`` (the methods they name live in the parts)
    turn_feeds      the body's feeds (`feed_chunk`, `feed_frame`, `feed_body`): frames
                    through the ledger, what is released, the decision a frame makes
    turn_fast_path  `feed_verbatim`: runs of plain frames after commit, in one piece
    turn_continue   the continuation hooks (`core.turn.continuation`): plan, answer, join
    turn_clock      `deadline`, `tick`, the write notifications, the stall timers
    turn_fields     the fields every part shares, the table's checks (the one writer
                    of the step, the sub-states' checked setters); `set_testing`

State enums, one question each.  The machine's state is its `Step` and its
sub-states, no flags (`turn_table.SUBSTATES` lists them and what enters each value;
``docs/gate.md`` shows that table, generated): `Watch` (the read attempt's stall
watch), `Reply` (what the client has been sent: nothing, headers, the done marker),
`Request` (the attempt's request as sent or patched), `Kept` (the answer a give-up
passes on), `Pacing` (the next attempt waited in a pacer's line), `Overflow` (the
hold's bound, reported once).  Beside the machine: `LedgerState` (what the attempt
released: the replay gate), `TurnState` (what /status shows, told to observers).

The four invariants (checked by a property test over random event sequences, illegal
events among them): nothing is released after a replay decision; a truncated turn
never ends cleanly; no frame is released twice; every turn ends.

Nothing here does I/O: no aiohttp, asyncio or ssl.  Time comes in as ``now``,
randomness through the `RetryState`'s injected ``random.Random``.  Observers are
told through the `TurnObserver` protocol, which the I/O layer implements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from unbroken.core.admission.policy import (
    Failure,
    FailureClass,
    Park,
    RetryState,
    is_retryable_status,
)
from unbroken.core.admission.ratehead import RateHeaders
from unbroken.core.profiles import DEFAULT as DEFAULT_PROFILE
from unbroken.core.profiles import KeepaliveForm, Profile
from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.turn.continuation import (
    DEFAULT_QUEUED_S,
    Cancel,
    Resume,
    Splicer,
    Strategy,
)
from unbroken.core.turn.continuation import Refusal as Refusal
from unbroken.core.turn.ledger import Hold, Ledger, LedgerState
from unbroken.core.turn.turn_clock import TurnClock, stall_timers
from unbroken.core.turn.turn_continue import ContinuationHooks, strategy_splices
from unbroken.core.turn.turn_endings import TurnEndings
from unbroken.core.turn.turn_fast_path import PEEL_FRAMES, FastPath
from unbroken.core.turn.turn_feeds import TurnFeeds
from unbroken.core.turn.turn_fields import is_testing, set_testing
from unbroken.core.turn.turn_guards import guards_of
from unbroken.core.turn.turn_table import (
    ANSWER_KEPT,
    AS_SENT,
    FIRST_FRAME,
    FREE,
    LEGAL,
    NOTHING_KEPT,
    NOTHING_SENT,
    PARKED,
    PATCHED,
    WITHIN_BOUND,
    Outside,
    Step,
    TurnEvent,
)
from unbroken.core.turn.turn_types import (
    KEEPALIVE,
    NOT_FAILURES,
    NOT_UPSTREAM,
    OK_OUTCOMES,
    OUTCOME_NAMES,
    OUTCOMES,
    UPSTREAM_ANSWERED,
    AbortUpstream,
    Action,
    End,
    EndKind,
    Fed,
    FinalInStream,
    GiveUp,
    GiveUpKind,
    Keepalive,
    Open,
    Outcome,
    PassThrough,
    Phase,
    ReadErrorBody,
    SendHeaders,
    Stream,
    TimerAction,
    Timers,
    TurnError,
    TurnObserver,
    TurnState,
    Wait,
)
from unbroken.core.wire.protocols import BODY, Protocol
from unbroken.core.wire.protocols.prefill import PrefillRefusal
from unbroken.core.wire.sse import SSESplitter

__all__ = [
    "KEEPALIVE",
    "NOT_FAILURES",
    "NOT_UPSTREAM",
    "OK_OUTCOMES",
    "OUTCOMES",
    "OUTCOME_NAMES",
    "PEEL_FRAMES",
    "UPSTREAM_ANSWERED",
    "AbortUpstream",
    "Action",
    "End",
    "EndKind",
    "Fed",
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
    "Step",
    "Stream",
    "TimerAction",
    "Timers",
    "TurnError",
    "TurnEvent",
    "TurnMachine",
    "TurnObserver",
    "TurnState",
    "Wait",
    "set_testing",
    "strategy_splices",
]

_NO_HOLD = Hold(())
#: where an attempt (or a continuation) waits for its answer
_OPENING = LEGAL[TurnEvent.ANSWERED]
#: where each event is legal (the table's `LEGAL`, one name each for the checks)
_START_IN = LEGAL[TurnEvent.START]
_NEXT_ATTEMPT_IN = LEGAL[TurnEvent.NEXT_ATTEMPT]
_OPEN_FAILED_IN = LEGAL[TurnEvent.OPEN_FAILED]
_ANSWERED_IN = LEGAL[TurnEvent.ANSWERED]
_ERROR_BODY_IN = LEGAL[TurnEvent.ERROR_BODY]
_FINAL_BODY_IN = LEGAL[TurnEvent.FINAL_BODY]
_BODY_ENDED_IN = LEGAL[TurnEvent.BODY_ENDED]
_TRANSPORT_FAILED_IN = LEGAL[TurnEvent.TRANSPORT_FAILED]


class TurnMachine(TurnFeeds, FastPath, ContinuationHooks, TurnEndings, TurnClock):
    """One turn's decisions.  Feed it events; carry out the actions it returns."""

    __slots__ = ()

    def __init__(
        self,
        *,
        protocol: Protocol,
        hold: Hold,
        timers: Timers,
        retry: RetryState,
        stream: bool,
        now: float,
        report: TurnObserver,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] | None = None,
        profile: Profile | None = None,
        socket: bool = False,
        continuation: Strategy | None = None,
        queued_s: float = DEFAULT_QUEUED_S,
        refusal: Refusal | PrefillRefusal | None = None,
    ) -> None:
        self.protocol = protocol
        #: ``after_commit = "continue"``: the protocol's way to finish a cut turn in
        #: place (`core.turn.continuation`); None: a cut after commit ends as always
        self.continuation = continuation
        #: a continuation with no progress this long is given up (stuck in ``queued``)
        self.queued_s = queued_s
        #: requests that free what nobody will read (the transport sends them)
        self._cancels: list[Cancel] = []
        #: why the last cut was not continued (None: it was, or none was asked); given:
        #: continue mode is on but cannot cover this turn (no ``continuation``)
        self.refusal: Refusal | PrefillRefusal | None = refusal
        if refusal is not None:
            report.uncovered(f"refused_{refusal.value}")
        #: the client's profile (`core.profiles`): early headers, keepalive form and
        #: interval, the non-streamed wait
        self._profile = profile = profile or DEFAULT_PROFILE
        #: the keepalive the profile asks for, when the protocol has one (else comments)
        self.keepalive_event = (
            protocol.keepalive_event
            if profile.keepalive is _KEEPALIVE_EVENT or not protocol.comment_keepalive
            else None
        )
        #: the client is a WebSocket: its keepalive is a message (the event's data), sent
        #: only for a profile that asks for events (pings keep the socket alive otherwise)
        self.socket = socket
        self.hold = hold
        self.timers = stall_timers(timers, profile)
        self.retry = retry
        self.stream = stream
        self.report = report
        self.clock = clock  # for the ledger's hold time only
        self.wall_clock = wall_clock  # Unix time, for the ledger's dated error events
        self.t0 = now
        self._moved(_STEP_NEW, _OUTSIDE_CREATED)  # (the one writer of the step)
        self._outcome: Outcome | None = None
        self.failure: Failure | None = None
        self.status: int | None = None  # the current attempt's upstream status
        self.ledger: Ledger | None = None  # the SSE ledger: one per turn, across attempts
        self.attempt_ledger: Ledger | None = None  # the ledger this attempt's body went through
        self.stats: AttemptStats | None = None
        #: the sub-states besides the step (`turn_table.SUBSTATES`: one question each),
        #: each written through its checked setter
        self._set_reply(NOTHING_SENT)  # what the client has been sent
        self.writing = 0  # writes to the client in progress (a keepalive may overlap one)
        self._write_t0 = now  # when the writes in progress began
        self._set_watch(FIRST_FRAME)  # the read attempt's stall watch
        self.last_rx = now
        self.last_tx = now
        self._attempt_t0 = now
        self._set_kept(NOTHING_KEPT)  # what the attempt's failure left for a give-up
        self._set_overflow(WITHIN_BOUND)  # the hold's bound, and its one report
        self._set_pacing(FREE)  # whether the next attempt waited in a pacer's line
        self._set_request(AS_SENT)  # how the attempt's request went upstream
        self._over: Action | None = None
        self._splitter: SSESplitter | None = None
        self._resume: Resume | None = None  # the continuation the next attempt opens
        self._splice: Splicer | None = None  # the current continuation's join check
        self._resume_t0 = now

    # -- attempts ----------------------------------------------------------------------
    def start(self, now: float) -> Action:
        before = self.step
        if before not in _START_IN:  # the table's legality (inline: no call)
            self._illegal("start")
        return self._moved(before, _EVENT_START, self._next_attempt(now))

    def next_attempt(self, now: float) -> Action:
        """After `start` or a `Wait`: open the next attempt, or give up."""
        before = self.step
        if before not in _NEXT_ATTEMPT_IN:  # the table's legality (inline: no call)
            self._illegal("next_attempt")
        return self._moved(before, _EVENT_NEXT_ATTEMPT, self._next_attempt(now))

    def _next_attempt(self, now: float) -> Action:
        retry = self.retry
        if retry.exhausted():
            return self._give_up()
        resume = self._resume
        testing = is_testing()
        if resume is not None:
            idx = retry.next_resume(now, pace=not testing)
        else:
            idx = retry.next_upstream(now, pace=not testing)
        if type(idx) is Park and testing:
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
            self.report.state(_STATE_PARKED)
            self._set_pacing(PARKED)
            wait = min(max(idx.until - now, 0.001), retry.park_check_s)
            return Wait(wait, idx.key, retry.ticket)
        assert isinstance(idx, int)
        self.status = None
        self.failure = None
        self._set_kept(NOTHING_KEPT)
        self._over = None
        self.stats = AttemptStats()
        if self.pacing is PARKED:
            choice = "parked"
            self._set_pacing(FREE)
        else:
            choice = retry.why or "first"
        self.report.attempt_started(retry.attempts, idx, choice)
        self.report.state(_STATE_WAITING)
        if resume is not None:
            # The continuation of the cut attempt: the turn's ledger goes on with it.
            self._resume = None
            self.attempt_ledger = self.ledger
            self._resume_t0 = now
            return resume
        self.attempt_ledger = None
        self._splice = None
        t = self.timers
        # Headers as long as the client itself waits for them (when known); a
        # non-streamed answer arrives only once generated: allow it as long as the
        # client waits for it (when known), else the first-frame time.
        if self.stream:
            timeout = self._profile.header_timeout(t.header_timeout_s)
        else:
            timeout = self._profile.nonstream_wait(t.header_timeout_s, t.first_frame_timeout_s)
        strategy = self.continuation
        if strategy is not None:  # (the transports give one to streamed turns only)
            patch = strategy.body_patch(idx)
            self._set_request(PATCHED if patch else AS_SENT)
            return Open(idx, timeout, patch)
        return Open(idx, timeout)

    def open_failed(self, now: float, failure: Failure) -> Action:
        """Connecting, sending, or waiting for the headers failed."""
        before = self.step
        if before not in _OPEN_FAILED_IN:  # the table's legality (inline: no call)
            self._illegal("open_failed")
        return self._moved(before, _EVENT_OPEN_FAILED, self._open_failed(now, failure))

    def _open_failed(self, now: float, failure: Failure) -> Action:
        if self.step is _STEP_RESUMING:
            return self._continuation_failed(now, failure)
        phase = _PHASE_HEADERS if failure.cls is _FAILURE_HEADER_TIMEOUT else _PHASE_CONNECT
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
        the key's rate limits, `core.admission.ratehead`)."""
        before = self.step
        if before not in _ANSWERED_IN:  # the table's legality (inline: no call)
            self._illegal("answered")
        action = self._answered(now, status, sse, retry_after_s, rate)
        return self._moved(before, _EVENT_ANSWERED, action)

    def socket_answered(self, now: float) -> Action:
        """A socket took the request: a WebSocket upstream's (its messages follow), or
        the relay's own answer to a warm-up.  A socket has no status line: its answer
        is a stream's, as a 200 ``text/event-stream`` is (`answered`)."""
        return self.answered(now, 200, sse=True)

    def _answered(
        self,
        now: float,
        status: int,
        sse: bool,
        retry_after_s: float | None,
        rate: RateHeaders | None,
    ) -> Action:
        self.status = status
        if rate is not None:
            self.retry.record_rate(rate, now)
        for when, then in _ANSWERED:  # `turn_guards.GUARDS`, in order
            if when(self, status, sse):
                action = then(self, now, status, sse, retry_after_s)
                if action is not None:
                    return action
        raise AssertionError("answered(): no guard decided")  # pragma: no cover - ALWAYS

    # -- `answered`'s guards (`turn_guards.GUARDS`: their order, and what each means) ----
    def _resuming(self, status: int, sse: bool) -> bool:
        return self.step is _STEP_RESUMING

    def _informational(self, status: int, sse: bool) -> bool:
        return status < 200

    def _retryable_answer(self, status: int, sse: bool) -> bool:
        return is_retryable_status(status)

    def _patched_4xx(self, status: int, sse: bool) -> bool:
        # Maybe a refusal of the patched request (`Strategy.refused`): read it.
        return self.request is PATCHED and 400 <= status < 500

    def _sse_2xx(self, status: int, sse: bool) -> bool:
        return status < 300 and sse

    def _early_headers_out(self, status: int, sse: bool) -> bool:
        # Early SSE headers are out: a final answer must be an in-stream event.
        return self.reply is not NOTHING_SENT

    def _answer_1xx(
        self, now: float, status: int, sse: bool, retry_after_s: float | None
    ) -> Action:
        # 1xx (a 101 to a plain request, say) is no answer for the client.
        return self._attempt_failed(
            now, Failure(_FAILURE_STATUS, f"HTTP {status}", status=status), _PHASE_HEADERS
        )

    def _read_retryable(
        self, now: float, status: int, sse: bool, retry_after_s: float | None
    ) -> Action:
        self.failure = Failure(
            _FAILURE_STATUS, f"HTTP {status}", status=status, retry_after_s=retry_after_s
        )
        self._reading(now)
        return ReadErrorBody()

    def _known_good(self, now: float, status: int) -> None:
        """A final answer (no retry): its pacer's line may move, and a strategy hears
        that its unpatched request was answered (a refusal, confirmed)."""
        self.retry.record_answer(now)
        strategy = self.continuation
        if strategy is not None and status < 300 and self.request is AS_SENT:
            strategy.answered(self.retry.current, status)

    def _read_refusal(
        self, now: float, status: int, sse: bool, retry_after_s: float | None
    ) -> Action:
        self._known_good(now, status)
        self.failure = Failure(_FAILURE_STATUS, f"HTTP {status}", status=status)
        self._reading(now)
        return ReadErrorBody()

    def _stream_answer(
        self, now: float, status: int, sse: bool, retry_after_s: float | None
    ) -> Action:
        self._known_good(now, status)
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
        ledger.errors_cut = strategy is not None and strategy.continues_errors and not self.socket
        self.attempt_ledger = ledger
        self._splitter = SSESplitter(self.timers.max_event_bytes)
        self._reading(now)
        self.report.state(_STATE_HOLDING if ledger.state is _LEDGER_PENDING else _STATE_STREAMING)
        return Stream()

    def _final_in_stream(
        self, now: float, status: int, sse: bool, retry_after_s: float | None
    ) -> Action:
        self._known_good(now, status)
        self._reading(now)
        return FinalInStream()

    def _pass_through(
        self, now: float, status: int, sse: bool, retry_after_s: float | None
    ) -> Action:
        self._known_good(now, status)
        self._reading(now)
        ledger = self.attempt_ledger = Ledger(BODY, hold=_NO_HOLD)
        ledger.stats = self.stats or AttemptStats()
        return PassThrough()

    def error_body(self, now: float, body: bytes = b"") -> Action:
        """A retryable answer's body was read and kept by the transport."""
        before = self.step
        if before not in _ERROR_BODY_IN:  # the table's legality (inline: no call)
            self._illegal("error_body")
        return self._moved(before, _EVENT_ERROR_BODY, self._error_body(now, body))

    def _error_body(self, now: float, body: bytes) -> Action:
        self._set_kept(ANSWER_KEPT)
        failure = self.failure
        if failure is None:  # pragma: no cover - set by answered()
            raise TurnError("error_body() without a retryable answer")
        if (
            self.request is PATCHED
            and failure.status is not None
            and not is_retryable_status(failure.status)
        ):
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
        return self._attempt_failed(now, failure, _PHASE_HEADERS)

    def final_body(
        self, now: float, status: int, body: bytes, request_id: str | None = None
    ) -> Action:
        """A final non-SSE answer after early headers: re-sent as the in-stream error,
        in the protocol's final terms, with the provider's request id when known."""
        before = self.step
        if before not in _FINAL_BODY_IN:  # the table's legality (inline: no call)
            self._illegal("final_body")
        return self._moved(
            before,
            _EVENT_FINAL_BODY,
            self._end(
                _OUTCOME_PASSED_THROUGH_ERROR,
                End(_END_ERROR, self.protocol.final_error_frame(status, body, request_id)),
            ),
        )

    def body_ended(self, now: float) -> Action:
        """The upstream body ended cleanly (EOF)."""
        before = self.step
        if before not in _BODY_ENDED_IN:  # the table's legality (inline: no call)
            self._illegal("body_ended")
        return self._moved(before, _EVENT_BODY_ENDED, self._body_ended(now))

    def transport_failed(self, now: float, failure: Failure) -> Action:
        """Reading the upstream failed (or the connection was aborted for a stall)."""
        before = self.step
        if before not in _TRANSPORT_FAILED_IN:  # the table's legality (inline: no call)
            self._illegal("transport_failed")
        action = self._transport_failed(now, failure)
        return self._moved(before, _EVENT_TRANSPORT_FAILED, action)

    def _transport_failed(self, now: float, failure: Failure) -> Action:
        for when, then in _TRANSPORT_FAILED:  # `turn_guards.GUARDS`, in order
            if when(self):
                action = then(self, now, failure)
                if action is not None:
                    return action
        raise AssertionError("transport_failed(): no guard decided")  # pragma: no cover

    def _body_ended(self, now: float) -> Action:
        assert self.attempt_ledger is not None
        for when, then in _BODY_ENDED:  # `turn_guards.GUARDS`, in order
            if when(self):
                action = then(self, now)
                if action is not None:
                    return action
        raise AssertionError("body_ended(): no guard decided")  # pragma: no cover

    def _reading(self, now: float) -> None:
        """An answer's body begins to be read (the event's action names how)."""
        self._set_watch(FIRST_FRAME)
        self._over = None  # this attempt's own decision, once a feed makes one
        self._attempt_t0 = now
        self.last_rx = now

    @property
    def ended(self) -> bool:
        return self.step is _STEP_ENDED

    def held_bytes(self) -> int:
        """Bytes the current attempt's ledger holds back from the client (for /status)."""
        ledger = self.attempt_ledger
        return ledger.held_bytes if ledger is not None else 0

    @property
    def answer_complete(self) -> bool:
        """The current attempt's answer reached its terminal frame.  A socket has no
        end of body: its transport then calls `body_ended` itself."""
        ledger = self.attempt_ledger
        return ledger is not None and ledger.state is _LEDGER_DONE


def _run(event: TurnEvent) -> tuple[tuple[Callable[..., bool], Callable[..., Action | None]], ...]:
    """``event``'s guards (`turn_guards.GUARDS`) as the machine runs them: each guard's
    two methods, in order."""
    return tuple(
        (getattr(TurnMachine, g.when), getattr(TurnMachine, g.then))
        for g in guards_of(event.value).guards
    )


_ANSWERED = _run(TurnEvent.ANSWERED)
_TRANSPORT_FAILED = _run(TurnEvent.TRANSPORT_FAILED)
_BODY_ENDED = _run(TurnEvent.BODY_ENDED)


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_END_ERROR = EndKind.ERROR
_EVENT_ANSWERED = TurnEvent.ANSWERED
_EVENT_BODY_ENDED = TurnEvent.BODY_ENDED
_EVENT_ERROR_BODY = TurnEvent.ERROR_BODY
_EVENT_FINAL_BODY = TurnEvent.FINAL_BODY
_EVENT_NEXT_ATTEMPT = TurnEvent.NEXT_ATTEMPT
_EVENT_OPEN_FAILED = TurnEvent.OPEN_FAILED
_EVENT_START = TurnEvent.START
_EVENT_TRANSPORT_FAILED = TurnEvent.TRANSPORT_FAILED
_FAILURE_HEADER_TIMEOUT = FailureClass.HEADER_TIMEOUT
_FAILURE_STATUS = FailureClass.STATUS
_KEEPALIVE_EVENT = KeepaliveForm.EVENT
_LEDGER_DONE = LedgerState.DONE
_LEDGER_PENDING = LedgerState.PENDING
_OUTCOME_PASSED_THROUGH_ERROR = Outcome.PASSED_THROUGH_ERROR
_OUTSIDE_CREATED = Outside.CREATED
_PHASE_CONNECT = Phase.CONNECT
_PHASE_HEADERS = Phase.HEADERS
_STATE_HOLDING = TurnState.HOLDING
_STATE_PARKED = TurnState.PARKED
_STATE_STREAMING = TurnState.STREAMING
_STATE_WAITING = TurnState.WAITING
_STEP_ENDED = Step.ENDED
_STEP_NEW = Step.NEW
_STEP_RESUMING = Step.RESUMING
