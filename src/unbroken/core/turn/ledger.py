"""The commit ledger: the only place that decides when a turn may be replayed.

Theory of operation
===================
A streamed turn can fail at any point: before any byte, after the provider's
``response.created``, in the middle of a tool call's arguments, after text has
streamed.  Replaying is safe exactly when the client has *received* nothing it
could act on, so the ledger keys every decision on what unbroken has
*released* to the client, never on what it received from upstream.  The proof
of safety is therefore in this module, not in any client's parser.

Each upstream frame is classified by the protocol's table (`protocols/`) and
fed here.  The ledger answers with the bytes to release now (possibly none)
and moves through four states::

    PENDING --(first release)--> COMMITTED --(terminal ok)--> DONE
       |  \\                         \\--(failure)--> FAILED  (native error sent)
       |   \\--(terminal ok)--> DONE
       \\--(failure)--> replay: held frames are dropped, a fresh attempt starts

Hold rules (``[stream] hold``):

* ``control``   CONTROL frames (``response.created``, ``message_start``, pings,
  role-only chunks) are held while PENDING and released, in order, just before
  the first release of output or of a complete tool call.  A dead attempt's
  ``response.created`` therefore never reaches the client.
* ``tool_calls`` a tool call is held from TOOL_START to its TOOL_END and then
  released whole (the dispatch gate): no client can have dispatched a call it
  never received, so a failure mid-arguments is replayable while PENDING.
  Frames arriving while a call is open are held behind it, to keep order.
* ``tool_tail`` (with ``tool_calls``; on by default for the clients whose profile
  says so: `core.profiles`) a complete tool call is held on, with the CONTROL
  frames and any further tool calls after it (``message_delta``), until the
  terminal frame or output, whichever comes first.  A cut between the call's end
  and ``message_stop`` / ``response.completed`` is then a replay while PENDING;
  after commit (text before the call) the held calls are dropped with the error,
  so a client that retries never holds a call the model is asked for again.  The
  calls reach the client that much later.
* ``reasoning`` REASONING frames are held too while PENDING.
* ``all``       everything is held until TERMINAL_OK: nothing streams, and
  every failure is replayable.

OUTPUT (and UNKNOWN, the conservative reading of any frame we do not know) is
released at once and commits.  Releasing *anything* commits: once a byte of
this attempt is visible, no other attempt's bytes may follow it.  If held
frames exceed ``max_hold_bytes`` they are released and the turn commits.

Failures (reset, stall, clean end without a terminal frame, a retryable
in-stream error, a malformed frame):

* PENDING   -> ``Verdict.REPLAY``: the shell retries the request; nothing held
  is ever sent.
* COMMITTED -> ``Verdict.FAIL``: never replay.  ``error_bytes`` holds the
  protocol-native, retryable error event; the stream then ends (for a client
  whose profile ends a cut stream by a reset, ``error_after_commit=False``: no
  event, and the shell aborts the client connection).  A truncated
  turn never ends with ``[DONE]``, ``finish_reason``, ``response.completed``,
  ``message_stop`` or a bare clean end of body.
* DONE      -> the turn completed; a failure afterwards (say before ``[DONE]``)
  only ends the stream.

A terminal error that is not retryable (invalid request, context too long) is
the provider's answer: it is released as it is, with whatever was held.

Non-SSE bodies (JSON answers, files) go through a ledger too, with protocol
``BODY`` and nothing held: each chunk is one UNKNOWN frame, so the first byte
forwarded commits; before it a failure replays, after it the native "error"
of a plain body is an aborted connection.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.wire.protocols import Protocol
from unbroken.core.wire.protocols.base import Classifier, Kind
from unbroken.core.wire.sse import Event

__all__ = [
    "HOLD_CHOICES",
    "MALFORMED",
    "NOTHING",
    "PASSED_THROUGH",
    "Hold",
    "Ledger",
    "LedgerError",
    "LedgerState",
    "Verdict",
]

#: what `Ledger.feed` returns when it releases nothing (shared, never mutated)
NOTHING: Sequence[Event] = ()


class LedgerError(RuntimeError):
    """An illegal transition was asked of the ledger (a bug in the caller)."""


class LedgerState(enum.Enum):
    """What one attempt has released (the replay gate); not the machine's `Step`, nor
    the `TurnState` that /status shows."""

    PENDING = "pending"  # nothing released; only held frames
    COMMITTED = "committed"  # something released; never replay
    DONE = "done"  # the success terminal was released
    FAILED = "failed"  # ended with an error event (ours or the provider's)


#: ``fail_reason`` of a frame the classifier could not parse
MALFORMED = "malformed frame"
#: ``fail_reason`` when the provider's own final error was released as it was
PASSED_THROUGH = "provider error (passed through)"


class Verdict(enum.Enum):
    CONTINUE = "continue"  # keep reading this attempt
    DONE = "done"  # terminal ok released; forward what follows, then end cleanly
    REPLAY = "replay"  # drop this attempt, nothing was released: retry the request
    FAIL = "fail"  # send error_bytes (if any) and end the stream; no replay
    #: a provider's retryable error event after commit, nothing released for it: the
    #: turn machine continues the turn, or calls `Ledger.error_failed` (``errors_cut``)
    CUT = "cut"


HOLD_CHOICES = frozenset({"control", "tool_calls", "tool_tail", "reasoning", "all"})


class Hold:
    """The parsed ``[stream] hold`` setting as kind masks."""

    __slots__ = ("all", "pending_mask", "tool_tail", "tools")

    def __init__(self, names: Iterable[str] = ("control", "tool_calls")) -> None:
        names = set(names)
        unknown = names - HOLD_CHOICES
        if unknown:
            raise ValueError(f"unknown hold choice(s): {sorted(unknown)}")
        self.all = "all" in names
        self.tools = self.all or "tool_calls" in names
        #: a complete tool call waits for the message's end (or for output, whichever
        #: comes first): a cut in that gap replays while PENDING, and drops the call
        #: after commit
        self.tool_tail = self.tools and "tool_tail" in names
        mask = 0
        if self.all or "control" in names:
            mask |= _KIND_CONTROL
        if self.all or "reasoning" in names:
            mask |= _KIND_REASONING
        #: kinds held while PENDING (a frame is held only if *all* its kinds are)
        self.pending_mask = mask


# What each failure does in each state: the decision table.
_ON_FAILURE: dict[LedgerState, Verdict] = {
    LedgerState.PENDING: Verdict.REPLAY,
    LedgerState.COMMITTED: Verdict.FAIL,
    LedgerState.DONE: Verdict.DONE,
    LedgerState.FAILED: Verdict.FAIL,
}


class Ledger:
    """Per-turn release/hold/replay decisions.  Feed frames, act on the answers."""

    __slots__ = (
        "_classifier",
        "_clock",
        "_error_after_commit",
        "_held",
        "_held_since",
        "_last_raw",
        "_tail",
        "_tool_mark",
        "_wall_clock",
        "error_bytes",
        "errors_cut",
        "fail_reason",
        "held_bytes",
        "hold",
        "hold_overflowed",
        "max_hold_bytes",
        "open_tools",
        "protocol",
        "released_frames",
        "state",
        "stats",
        "verdict",
    )

    def __init__(
        self,
        protocol: Protocol,
        *,
        hold: Hold | None = None,
        max_hold_bytes: int = 8 * 1024 * 1024,
        clock: Callable[[], float] | None = None,
        wall_clock: Callable[[], float] | None = None,
        error_after_commit: bool = True,
    ) -> None:
        self.protocol = protocol
        self.hold = hold or Hold()
        self.max_hold_bytes = max_hold_bytes
        self._clock = clock
        #: Unix time, for an error event that carries a date (passed in: no clock here)
        self._wall_clock = wall_clock
        #: False: a failure after commit emits no error event (the shell aborts the
        #: client connection instead; `TurnMachine.abort_after_commit`)
        self._error_after_commit = error_after_commit
        self.state = _LEDGER_PENDING
        self.verdict = _VERDICT_CONTINUE
        self.error_bytes = b""
        self.fail_reason = ""
        self.hold_overflowed = False
        self.released_frames = 0  # over the whole turn: what the client has seen
        #: a provider's retryable error event after commit is a cut the turn machine
        #: decides (a prefill continuation, `core.turn.continuation`): ``Verdict.CUT``
        self.errors_cut = False
        self.stats = AttemptStats()
        self.start_attempt()

    # -- attempts ---------------------------------------------------------------
    def start_attempt(self, stats: AttemptStats | None = None) -> None:
        """Begin a fresh upstream attempt.  Only legal before anything was released.

        ``stats`` receives this attempt's counters (a fresh record when omitted).
        """
        if self.state is not _LEDGER_PENDING:
            raise LedgerError(f"cannot start a new attempt in state {self.state.value}")
        self._classifier: Classifier = self.protocol.new_classifier()
        self._held: list[Event] = []
        self._held_since: float | None = None
        self._last_raw: bytes | None = None
        self._tool_mark = 0
        self._tail = False
        self.held_bytes = 0
        self.open_tools = 0
        if stats is not None:
            self.stats = stats
        elif self.stats.received_frames or self.stats.released_frames:
            self.stats = AttemptStats()
        self.verdict = _VERDICT_CONTINUE

    def resume_attempt(self, stats: AttemptStats | None = None) -> None:
        """A continuation of the cut attempt begins (`core.turn.continuation`): the same
        stream goes on, so the classifier, the held frames and the open tool calls
        stay as they were; only the attempt's counters start afresh.  Legal while
        PENDING or COMMITTED, before the cut was turned into a verdict."""
        if self.state is not _LEDGER_PENDING and self.state is not _LEDGER_COMMITTED:
            raise LedgerError(f"cannot resume an attempt in state {self.state.value}")
        if self.verdict is not _VERDICT_CONTINUE:
            raise LedgerError(f"cannot resume an attempt after a {self.verdict.value} verdict")
        self.stats = stats if stats is not None else AttemptStats()

    def rewind(self, released: Sequence[Event]) -> None:
        """A continuation restarts from what the client has (a prefill), not from
        what was received: what is held (a tool call cut mid-arguments) is dropped,
        never to be released, and a fresh classifier reads the ``released`` frames
        back, so it knows the stream as the client does.  Only while COMMITTED."""
        if self.state is not _LEDGER_COMMITTED or self.verdict is not _VERDICT_CONTINUE:
            raise LedgerError(f"cannot rewind an attempt in state {self.state.value}")
        self._drop_held()
        classifier = self.protocol.new_classifier()
        open_tools = 0
        for event in released:
            _, open_tools = classifier.classify(event)
        self._classifier = classifier
        self.open_tools = open_tools

    @property
    def classifier(self) -> Classifier:
        """The protocol classifier of the current stream (read only: what it learned)."""
        return self._classifier

    @property
    def replayable(self) -> bool:
        return self.state is _LEDGER_PENDING

    @property
    def passed_through(self) -> bool:
        """The turn ended with the provider's own final error, released as it was."""
        return self.fail_reason == PASSED_THROUGH

    # -- frames -----------------------------------------------------------------
    def feed_bytes(self, event: Event) -> bytes:
        """`feed`, with the released frames joined (for tests and plain callers)."""
        return b"".join([e.raw for e in self.feed(event)])

    def feed(self, event: Event) -> Sequence[Event]:
        """Classify one upstream frame; return the frames to release now, in order.

        Frames keep their boundaries (a WebSocket sends each as one message).
        After the call, ``verdict`` says what the shell must do next.
        """
        raw = event.raw
        stats = self.stats
        stats.received_frames += 1
        stats.received_bytes += len(raw)
        self._last_raw = raw
        if stats.received_frames == 1:
            stats.first_raw = raw
        recent = stats.recent
        recent.append(raw)
        if len(recent) > 4:
            del recent[0]
        state = self.state
        if state is _LEDGER_DONE:  # trailing frames after the terminal (usage, [DONE])
            return self._emit([event])
        if state is _LEDGER_FAILED:
            return NOTHING
        tools_before = self.open_tools
        kinds, self.open_tools = self._classifier.classify(event)
        if kinds & _KIND_COMMITTING:
            stats.output_frames += 1

        if kinds & _KIND_MALFORMED:
            self.fail_reason = MALFORMED
            return self._fail("malformed frame from upstream")
        if kinds & _KIND_TERMINAL_ERROR:
            if kinds & _KIND_RETRYABLE:
                if self.errors_cut and state is _LEDGER_COMMITTED:
                    self.verdict = _VERDICT_CUT
                    return NOTHING
                return self.error_failed()
            # The provider's final answer: pass it through with what was held,
            # except a partial tool call, which no client may see.
            if self.open_tools:
                del self._held[self._tool_mark :]
            out = self._release_held(event)
            self.state = _LEDGER_FAILED
            self.verdict = _VERDICT_FAIL
            self.fail_reason = PASSED_THROUGH
            return out
        if kinds & _KIND_TERMINAL_OK:
            out = self._release_held(event)
            self.state = _LEDGER_DONE
            self.verdict = _VERDICT_DONE
            return out

        hold = self.hold
        if self.open_tools and not tools_before:
            # where the open tool calls begin (complete ones held by tool_tail before)
            self._tool_mark = len(self._held)
        if hold.tool_tail:
            if tools_before and not self.open_tools:
                # tool_tail: the call is complete; it waits for the message's end, even
                # after commit (a cut then drops it, never to be released), and so does
                # a parallel call after it: a client that starts each call at its end
                # must not see one the retry asks the model for again.
                self._tail = True
                return self._hold(event)
            if self._tail and not kinds & ~_KIND_CONTROL:
                return self._hold(event)  # e.g. message_delta between the call and the end
        if (
            hold.all
            or (self.open_tools and hold.tools)
            or (state is _LEDGER_PENDING and not kinds & ~hold.pending_mask)
        ):
            return self._hold(event)
        return self._release_held(event)

    def release_run(self, chunk: bytes, start: int = 0) -> int:
        """Release a run of complete frames from ``chunk[start:]`` verbatim, if provably
        plain output; return where the run ends (``start``: nothing was released).

        Only while COMMITTED with nothing held and no tool call open, and only the
        frames the classifier's `plain_prefix` proves would each be released as they
        are by `feed` (no tool call, no terminal, no error, no malformed frame).
        Then the decision is the same as frame by frame, and the counters are
        updated as `feed` would.  The caller feeds what follows the run one by one.
        """
        if self.state is not _LEDGER_COMMITTED or self.open_tools or self._held or self.hold.all:
            return start
        frames, end = self._classifier.plain_prefix(chunk, start)
        if not frames:
            return start
        size = end - start
        stats = self.stats
        stats.received_frames += frames
        stats.received_bytes += size
        stats.output_frames += frames
        stats.released_frames += frames
        stats.released_bytes += size
        self.released_frames += frames
        if frames > 1:
            last = chunk[chunk.rfind(b"\n\n", start, end - 2) + 2 : end]
        else:
            last = chunk if size == len(chunk) else chunk[start:end]
        self._last_raw = last
        recent = stats.recent
        recent.append(last)
        if len(recent) > 4:
            del recent[0]
        return end

    def _hold(self, event: Event) -> Sequence[Event]:
        if not self._held and self._clock is not None:
            self._held_since = self._clock()
        self._held.append(event)
        self.held_bytes += len(event.raw)
        if self.held_bytes > self.max_hold_bytes:
            self.hold_overflowed = True
            return self._release_held(None)
        return NOTHING

    def _release_held(self, event: Event | None) -> Sequence[Event]:
        held = self._held
        if not held:
            return NOTHING if event is None else self._emit([event])
        if self._held_since is not None and self._clock is not None:
            self.stats.hold_seconds += self._clock() - self._held_since
        if event is not None:
            held.append(event)
        self._drop_held()
        return self._emit(held)

    def _emit(self, events: list[Event]) -> Sequence[Event]:
        stats = self.stats
        n = len(events)
        stats.released_frames += n
        self.released_frames += n
        stats.released_bytes += sum([len(e.raw) for e in events]) if n > 1 else len(events[0].raw)
        if self.state is _LEDGER_PENDING:
            self.state = _LEDGER_COMMITTED
        return events

    # -- failures -----------------------------------------------------------------
    def _fail(self, message: str) -> Sequence[Event]:
        self.verdict = _ON_FAILURE[self.state]
        if self.verdict is _VERDICT_REPLAY:
            self._drop_held()
            return NOTHING
        if self.verdict is _VERDICT_FAIL:
            if not self._error_after_commit:
                self._drop_held()
                self.state = _LEDGER_FAILED
                return NOTHING
            out = self._end_with_error(message)
            return [Event(out, None, None)] if out else NOTHING
        return NOTHING

    def _drop_held(self) -> None:
        self._held = []
        self.held_bytes = 0
        self._held_since = None
        self._tool_mark = 0
        self._tail = False

    def _end_with_error(self, message: str) -> bytes:
        """Committed: drop anything held (a partial tool call) and emit the native error."""
        self._drop_held()
        if self.state is _LEDGER_FAILED:
            return b""
        self.state = _LEDGER_FAILED
        self.error_bytes = self.protocol.error_frame(
            f"unbroken: {message}; the turn was cut after output reached the client. "
            "Retry the request (server_error, upstream terminated).",
            self._classifier,
            self._last_raw,
            self._wall_clock() if self._wall_clock is not None else 0.0,
        )
        self.stats.released_bytes += len(self.error_bytes)
        return self.error_bytes

    def error_failed(self) -> Sequence[Event]:
        """A provider's retryable error event ends the attempt: a replay while PENDING,
        else the native error (the frames to release)."""
        if self.verdict is _VERDICT_CUT:
            self.verdict = _VERDICT_CONTINUE
        self.fail_reason = "in-stream error"
        return self._fail("upstream sent an error in the stream")

    def failed(self, reason: str) -> bytes:
        """The upstream attempt broke (reset, stall, payload error, truncation).

        Returns the bytes to send now.  Afterwards ``verdict`` is ``REPLAY``
        (PENDING: nothing was released), ``FAIL`` (COMMITTED: the returned bytes
        are the native error event; end the stream after them) or ``DONE`` (the
        turn had already completed; just end the stream).
        """
        if self.state is _LEDGER_PENDING or self.state is _LEDGER_COMMITTED:
            self.fail_reason = reason
        return b"".join([e.raw for e in self._fail(reason)])

    def ended(self, leftover: bytes = b"") -> bytes:
        """The upstream body ended cleanly; ``leftover`` is an unfinished event's bytes."""
        if self.state is _LEDGER_DONE or self.state is _LEDGER_FAILED:
            return b""
        if not self.protocol.has_terminal and not leftover:
            # Generic SSE has no terminal frame: its clean end is its success.
            self._drop_held()
            self.state = _LEDGER_DONE
            self.verdict = _VERDICT_DONE
            return b""
        return self.failed("stream ended without a terminal frame")

    def give_up(self, reason: str) -> bytes:
        """Retries are exhausted while PENDING: drop held frames, emit the native error."""
        self.fail_reason = reason
        self.verdict = _VERDICT_FAIL
        return self._end_with_error(reason)


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_LEDGER_COMMITTED = LedgerState.COMMITTED
_LEDGER_DONE = LedgerState.DONE
_LEDGER_FAILED = LedgerState.FAILED
_LEDGER_PENDING = LedgerState.PENDING
_VERDICT_CONTINUE = Verdict.CONTINUE
_VERDICT_CUT = Verdict.CUT
_VERDICT_DONE = Verdict.DONE
_VERDICT_FAIL = Verdict.FAIL
_VERDICT_REPLAY = Verdict.REPLAY


# The frame kinds the functions above test, as module constants: an attribute of a
# class (``Kind.OUTPUT``) is a generic lookup on Python 3.11 (about 200 instructions),
# a global about 40.
_KIND_COMMITTING = Kind.COMMITTING
_KIND_CONTROL = Kind.CONTROL
_KIND_MALFORMED = Kind.MALFORMED
_KIND_REASONING = Kind.REASONING
_KIND_RETRYABLE = Kind.RETRYABLE
_KIND_TERMINAL_ERROR = Kind.TERMINAL_ERROR
_KIND_TERMINAL_OK = Kind.TERMINAL_OK
