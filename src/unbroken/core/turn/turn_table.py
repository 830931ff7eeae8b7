"""The turn machine's steps and the one table of its transitions.

h11's ``_state.py`` keeps every transition of HTTP/1.1 in one table that its code
runs; this is the turn machine's (`unbroken.core.turn.machine`, whose header is the theory
of operation).  Each row is a (step, event) pair: the actions that event may
return in that step, and what it means.  The machine runs the table:

* **legality**: an event is legal in a step only if the table has a row for the
  pair (or the event is one of `ANY_STEP`'s); anything else is a transport bug:
  `TurnError`, and the machine stays in ``ERROR``;
* **transitions**: the step after an event is the step its action enters
  (`ENTERS`: ``Open`` enters CONNECTING, ``Wait`` IDLE, ``End`` ENDED, ...); a
  feed that returns no action stays where it is.  An action the row does not list
  is refused like an illegal event (a bug in the machine, caught by the property
  test), so the table is complete by construction.

`markdown()` renders the table for ``docs/gate.md``; ``python -m
unbroken.core.turn.turn_table --markdown`` prints it, and a test fails when the doc
differs (`generated_part` finds it between `BEGIN` and `END`).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from unbroken.core.turn.continuation import Resume
from unbroken.core.turn.turn_types import (
    End,
    FinalInStream,
    GiveUp,
    Open,
    PassThrough,
    ReadErrorBody,
    Stream,
    Wait,
)

__all__ = [
    "ANSWER_KEPT",
    "ANY_STEP",
    "AS_SENT",
    "ENTERS",
    "FIRST_FRAME",
    "FREE",
    "HEADERS_SENT",
    "IDLE",
    "LEGAL",
    "NOTHING_KEPT",
    "NOTHING_SENT",
    "OVERFLOW_REPORTED",
    "PARKED",
    "PATCHED",
    "QUEUED",
    "ROWS",
    "STALLED",
    "SUBSTATES",
    "TERMINATED",
    "WATCHING",
    "WITHIN_BOUND",
    "Kept",
    "Overflow",
    "Pacing",
    "Reply",
    "Request",
    "Row",
    "Step",
    "SubState",
    "TurnEvent",
    "Watch",
    "allowed",
    "markdown",
]


class Step(enum.Enum):
    """The machine's own position: which events are legal."""

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

    #: identity, as equality is: a membership test costs no Python call (`Enum`'s
    #: own hashes the name in Python)
    __hash__ = object.__hash__


class Watch(enum.Enum):
    """The stall watch of the attempt being read (a sub-state of the reading steps)."""

    FIRST_FRAME = "first_frame"  # no frame yet: ``first_frame_timeout_s`` from the body's start
    IDLE = "idle"  # frames came: ``idle_timeout_s`` from the last byte
    STALLED = "stalled"  # aborted for upstream silence: its read failure is the stall
    QUEUED = "queued"  # aborted: a continuation made no progress within queued_s

    __hash__ = object.__hash__


#: the watches whose stall clock runs (while no write to the client blocks)
WATCHING = frozenset({Watch.FIRST_FRAME, Watch.IDLE})


class Reply(enum.Enum):
    """What the client has been sent (the client's side of the turn)."""

    NOTHING = "nothing"  # no status line yet: a failure can still be any answer
    HEADERS = "headers"  # status and headers are out: a final error is an in-stream event
    TERMINATED = "terminated"  # the protocol's done marker (``[DONE]``) is out too

    __hash__ = object.__hash__


class Request(enum.Enum):
    """How the current attempt's request went upstream."""

    AS_SENT = "as_sent"  # the client's request, as it sent it
    PATCHED = "patched"  # with its strategy's body patch (``after_commit = "continue"``)

    __hash__ = object.__hash__


class Kept(enum.Enum):
    """What the current attempt's failure left for a give-up to pass on."""

    NOTHING = "nothing"
    ANSWER = "answer"  # its retryable answer, status and body, kept by the transport

    __hash__ = object.__hash__


class Pacing(enum.Enum):
    """How the next attempt is reached: straight, or after waiting in its upstream's
    pacer line (reported as the attempt's choice, "parked")."""

    FREE = "free"
    PARKED = "parked"

    __hash__ = object.__hash__


class Overflow(enum.Enum):
    """The hold's byte bound (``max_hold_bytes``): whether the ledger's hold overflowed
    this turn (it then releases what it held) and observers were told, once."""

    WITHIN = "within"
    REPORTED = "reported"

    __hash__ = object.__hash__


# The sub-states' values as plain names, for the machine's hot path: on Python 3.11 an
# Enum member's lookup (``Reply.NOTHING``) costs about 80 ns, a module global's 7.
NOTHING_SENT, HEADERS_SENT, TERMINATED = Reply
AS_SENT, PATCHED = Request
NOTHING_KEPT, ANSWER_KEPT = Kept
FREE, PARKED = Pacing
WITHIN_BOUND, OVERFLOW_REPORTED = Overflow
FIRST_FRAME, IDLE, STALLED, QUEUED = Watch


@dataclass(frozen=True, slots=True)
class SubState:
    """One of the machine's sub-states: its field, the question it answers, and how
    each value is entered (`markdown` renders them for ``docs/gate.md``)."""

    field: str
    states: type[enum.Enum]
    entered: Mapping[str, str]


#: the machine's state besides its `Step`, one question each (no flag stands for one)
SUBSTATES: tuple[SubState, ...] = (
    SubState(
        "watch",
        Watch,
        {
            "FIRST_FRAME": (
                "the machine's creation; an answer's body begins to be read (`Stream`, "
                "`PassThrough`, ...); an attempt's failure (the next one starts afresh)"
            ),
            "IDLE": "a feed brought the attempt's first frame (an SSE comment is none)",
            "STALLED": "`tick`: the upstream was silent past its stall timer (`AbortUpstream`)",
            "QUEUED": "`tick`: a continuation made no progress within `queued_s`",
        },
    ),
    SubState(
        "reply",
        Reply,
        {
            "NOTHING": "the machine's creation",
            "HEADERS": "`headers_sent`, the first release, or early headers (`SendHeaders`)",
            "TERMINATED": "the done marker released, or added by the tail's ending",
        },
    ),
    SubState(
        "request",
        Request,
        {
            "AS_SENT": "an `Open` with no body patch; a refusal of the patch",
            "PATCHED": "an `Open` with its strategy's body patch",
        },
    ),
    SubState(
        "kept",
        Kept,
        {
            "NOTHING": "each attempt's start",
            "ANSWER": "`error_body`: the retryable answer was read and kept",
        },
    ),
    SubState(
        "pacing",
        Pacing,
        {
            "FREE": "the attempt after a park opens",
            "PARKED": "`start` or `next_attempt` parked in the pacer's line (`Wait`)",
        },
    ),
    SubState(
        "overflow",
        Overflow,
        {
            "WITHIN": "the machine's creation",
            "REPORTED": "a feed after the ledger's hold overflowed (observers told once)",
        },
    ),
)


class TurnEvent(enum.Enum):
    """The events, named as the machine's methods."""

    START = "start"
    NEXT_ATTEMPT = "next_attempt"
    OPEN_FAILED = "open_failed"
    ANSWERED = "answered"
    ERROR_BODY = "error_body"
    FINAL_BODY = "final_body"
    FEED_CHUNK = "feed_chunk"
    FEED_VERBATIM = "feed_verbatim"
    FEED_FRAME = "feed_frame"
    FEED_BODY = "feed_body"
    BODY_ENDED = "body_ended"
    TRANSPORT_FAILED = "transport_failed"

    __hash__ = object.__hash__


#: the step each action enters (the transition an event makes is its action's)
ENTERS: Mapping[type, Step] = {
    Open: Step.CONNECTING,
    Resume: Step.RESUMING,
    Wait: Step.IDLE,
    Stream: Step.STREAM,
    PassThrough: Step.PASS_THROUGH,
    ReadErrorBody: Step.ERROR_BODY,
    FinalInStream: Step.FINAL_BODY,
    End: Step.ENDED,
    GiveUp: Step.ENDED,
}

#: what a failed attempt leads to: a retry now or after a wait, or giving up
_RETRY: tuple[type, ...] = (Open, Wait, GiveUp)
#: a cut continued in place (`core.turn.continuation`): its wait, its `Resume`, or giving up
_CONTINUE: tuple[type, ...] = (Wait, Resume, GiveUp)
#: a failure of the body: a replay, a continuation, or the end of the turn
_BODY_FAILED: tuple[type, ...] = (*_RETRY, Resume, End)
#: "no action": a feed that keeps the attempt reading
STAYS: None = None


@dataclass(frozen=True, slots=True)
class Row:
    """(step, event) -> the actions the event may return there (None: stays)."""

    step: Step
    event: TurnEvent
    actions: tuple[type | None, ...]
    note: str

    @property
    def next_steps(self) -> tuple[Step, ...]:
        steps = [self.step if a is None else ENTERS[a] for a in self.actions]
        return tuple(dict.fromkeys(steps))


_FEEDS_NOTE = (
    "the frames to release (`Fed.released`); a frame that ends the attempt decides "
    "it at once (`Fed.over`: a replay, the end, or a continuation)"
)
_READ_FAILED_NOTE = (
    "PENDING: a replay (phase `pending` or `stall`); COMMITTED: `End(ERROR, native "
    "error)` (phase `committed`), or `End(ABORT)` for a plain body or a profile whose "
    "`after_commit_end` is `reset`; DONE: `End(CLEAN, tail)` (phase `tail`)"
)

#: the table: one row per legal (step, event) pair
ROWS: tuple[Row, ...] = (
    Row(Step.NEW, TurnEvent.START, (Open, Wait, GiveUp), "as `next_attempt`"),
    Row(
        Step.IDLE,
        TurnEvent.NEXT_ATTEMPT,
        (Open, Resume, Wait, GiveUp),
        "after a `Wait`: `Open(upstream, timeout)`, the `Resume` a cut asked for, a "
        "`Wait` (parked), or `GiveUp` when `max_attempts` is spent",
    ),
    Row(
        Step.CONNECTING,
        TurnEvent.OPEN_FAILED,
        _RETRY,
        "`Wait(s)` / `Open` (reroute at once) / `GiveUp`; phase `connect` or `headers`",
    ),
    Row(
        Step.CONNECTING,
        TurnEvent.ANSWERED,
        (*_RETRY, ReadErrorBody, Stream, PassThrough, FinalInStream),
        "1xx: a failed attempt (phase `headers`); a retryable status (or a 4xx to a "
        "patched request): `ReadErrorBody`; 2xx SSE: `Stream`; any other: "
        "`PassThrough` (the first byte commits), or `FinalInStream` after early headers",
    ),
    Row(Step.CONNECTING, TurnEvent.TRANSPORT_FAILED, _RETRY, "as `open_failed`"),
    Row(
        Step.RESUMING,
        TurnEvent.OPEN_FAILED,
        (*_CONTINUE, Open, End),
        "another cut: another `Resume` (bounded by `max_splices`), else as "
        "`transport_failed` in STREAM",
    ),
    Row(
        Step.RESUMING,
        TurnEvent.ANSWERED,
        (Stream, *_CONTINUE, Open, End),
        "2xx SSE: `Stream`, its frames through the strategy's splicer (the join "
        "check), then the turn's ledger; a retryable status or 1xx: as `open_failed`; "
        "anything else refuses the join: COMMITTED `End(ERROR)`, PENDING a replay",
    ),
    Row(Step.RESUMING, TurnEvent.TRANSPORT_FAILED, (*_CONTINUE, Open, End), "as `open_failed`"),
    Row(
        Step.STREAM,
        TurnEvent.FEED_CHUNK,
        (STAYS, *_BODY_FAILED),
        _FEEDS_NOTE + "; the splitter keeps frame boundaries",
    ),
    Row(
        Step.STREAM,
        TurnEvent.FEED_VERBATIM,
        (STAYS, *_BODY_FAILED),
        "as `feed_chunk`, the frames' bytes; after commit a run of plain frames is "
        "released as it is (`Fed.released` None: the chunk, whole)",
    ),
    Row(
        Step.STREAM,
        TurnEvent.FEED_FRAME,
        (STAYS, *_BODY_FAILED),
        "one WebSocket message: " + _FEEDS_NOTE,
    ),
    Row(
        Step.STREAM,
        TurnEvent.BODY_ENDED,
        _BODY_FAILED,
        "`End(CLEAN)` after a terminal frame (with `data: [DONE]` if the upstream left "
        "it out); else a cut: continued, replayed, or the native error",
    ),
    Row(
        Step.STREAM,
        TurnEvent.TRANSPORT_FAILED,
        _BODY_FAILED,
        'a cut continued in place when a strategy can (`after_commit = "continue"`); '
        "else " + _READ_FAILED_NOTE,
    ),
    Row(
        Step.PASS_THROUGH,
        TurnEvent.FEED_BODY,
        (STAYS, *_RETRY, End),
        "the bytes to release (the first commits)",
    ),
    Row(Step.PASS_THROUGH, TurnEvent.BODY_ENDED, (*_RETRY, End), "`End(CLEAN)`"),
    Row(Step.PASS_THROUGH, TurnEvent.TRANSPORT_FAILED, (*_RETRY, End), _READ_FAILED_NOTE),
    Row(
        Step.ERROR_BODY,
        TurnEvent.ERROR_BODY,
        (*_RETRY, End),
        "`Wait`/`Open`/`GiveUp` (the kept answer passes through when it is the last); a "
        "refused patched request: again without the patch",
    ),
    Row(Step.ERROR_BODY, TurnEvent.TRANSPORT_FAILED, _RETRY, "a failed attempt"),
    Row(
        Step.FINAL_BODY,
        TurnEvent.FINAL_BODY,
        (End,),
        "`End(ERROR, the answer as an in-stream error)`",
    ),
    Row(Step.FINAL_BODY, TurnEvent.TRANSPORT_FAILED, _RETRY, "a failed attempt"),
)

#: (step, event) -> the action types the event may return there (None: no action)
ALLOWED: Mapping[tuple[Step, TurnEvent], frozenset[type | None]] = {
    (r.step, r.event): frozenset(r.actions) for r in ROWS
}
#: event -> the steps where it is legal
LEGAL: Mapping[TurnEvent, frozenset[Step]] = {
    e: frozenset(r.step for r in ROWS if r.event is e) for e in TurnEvent
}

#: the steps that read an answer's body (the stall clock runs in them)
READING: frozenset[Step] = frozenset(
    {Step.STREAM, Step.PASS_THROUGH, Step.ERROR_BODY, Step.FINAL_BODY}
)
#: where the clock has nothing to say
OVER: frozenset[Step] = frozenset({Step.ENDED, Step.ERROR})

#: the events legal in every step (the end from outside, the clock) and, but in
#: ERROR, the write notifications; none of them moves the machine but to ENDED
ANY_STEP: tuple[tuple[str, str, str], ...] = (
    (
        "`tick(now)`",
        "`SendHeaders` (early headers), `Keepalive`, or `AbortUpstream` "
        "(a stall, or a continuation with no progress within `resume_queued_s`); "
        "nothing in ENDED or ERROR",
        "same",
    ),
    (
        "`headers_sent` / `write_started` / `wrote`",
        "none: the keepalive clock, and "
        "the stall clock's pause while a write blocks (illegal in ERROR; `wrote` only "
        "after a `write_started`)",
        "same",
    ),
    (
        "`client_gone`",
        "outcome `ok` if the terminal frame was released, else `aborted_by_client`",
        "ENDED",
    ),
    (
        "`crashed`",
        "outcome `internal_error` (a bug in the relay; a WebSocket client is closed with 1011)",
        "ENDED",
    ),
    (
        "an event with no row for the step (a late chunk after a `Wait` or an `End`, ...)",
        "raises `TurnError`: a transport bug; nothing is released, every later event "
        "raises too (but `client_gone`, `crashed`, `tick`, `deadline`)",
        "ERROR",
    ),
)


def allowed(step: Step, event: TurnEvent) -> frozenset[type | None] | None:
    """The actions ``event`` may return in ``step``, or None: illegal there."""
    return ALLOWED.get((step, event))


def only_step(event: TurnEvent) -> Step:
    """The one step where ``event`` is legal (the hot path's check is an identity)."""
    (step,) = LEGAL[event]
    return step


def _action_names(row: Row) -> str:
    names = ["(none: reading on)" if a is None else f"`{a.__name__}`" for a in row.actions]
    return ", ".join(names)


def markdown() -> str:
    """The table as ``docs/gate.md`` shows it (generated: edit `ROWS`, not the doc)."""
    lines = [
        "| step | event | actions out | next step | what |",
        "|---|---|---|---|---|",
    ]
    for r in ROWS:
        nxt = " / ".join(s.name for s in r.next_steps)
        lines.append(
            f"| {r.step.name} | `{r.event.value}` | {_action_names(r)} | {nxt} | {r.note} |"
        )
    for event, what, nxt in ANY_STEP:
        lines.append(f"| any | {event} | {what} | {nxt} | |")
    lines.append("")
    lines.append("| action | enters |")
    lines.append("|---|---|")
    for action, step in ENTERS.items():
        lines.append(f"| `{action.__name__}` | {step.name} |")
    lines.append("")
    lines.append("| sub-state | question | value | entered by |")
    lines.append("|---|---|---|---|")
    for sub in SUBSTATES:
        question = (sub.states.__doc__ or "").split("\n\n")[0]
        question = " ".join(question.split())
        for i, value in enumerate(sub.states):
            head = f"`{sub.field}`: `{sub.states.__name__}`" if i == 0 else ""
            what = question if i == 0 else ""
            lines.append(f"| {head} | {what} | {value.name} | {sub.entered[value.name]} |")
    return "\n".join(lines) + "\n"


#: what enters the steps no action enters
_ENTERED_ALSO: Mapping[Step, str] = {
    Step.NEW: "the machine's creation",
    Step.IDLE: "start, a cut continued",
    Step.ENDED: "the end from outside",
    Step.ERROR: "an illegal event",
}


def header_table() -> str:
    """The steps, what enters each and the events each accepts, as
    `unbroken.core.turn.machine`'s header shows them (a test keeps the two the same)."""
    rows = [("step", "entered by", "legal events")]
    for step in Step:
        entered = [a.__name__ for a, s in ENTERS.items() if s is step]
        if step in _ENTERED_ALSO:
            entered.append(_ENTERED_ALSO[step])
        events = [r.event.value for r in ROWS if r.step is step] or ["(none)"]
        rows.append((step.name, ", ".join(entered), ", ".join(events)))
    lines: list[str] = []
    for name, by, legal in rows:
        first = True
        while legal or first:
            cut = len(legal) if len(legal) <= 40 else legal.rfind(", ", 0, 40) + 1
            part, legal = legal[:cut].strip(), legal[cut:].strip()
            lines.append(f"    {name if first else '':<14}{by if first else '':<35}{part}")
            first = False
    return "\n".join(line.rstrip() for line in lines) + "\n"


BEGIN = "<!-- turn_table: generated by `python -m unbroken.core.turn.turn_table --markdown` -->\n"
END = "<!-- /turn_table -->\n"


def generated_part(doc: str) -> str | None:
    """The generated part of a document (between `BEGIN` and `END`), or None."""
    start = doc.find(BEGIN)
    stop = doc.find(END)
    if start < 0 or stop < start:
        return None
    return doc[start + len(BEGIN) : stop]


def main(argv: list[str]) -> int:
    """``--markdown``: print the generated table (the test compares it with the doc)."""
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    sys.stderr.write("usage: python -m unbroken.core.turn.turn_table --markdown\n")
    return 2


if __name__ == "__main__":  # pragma: no cover - the command line
    raise SystemExit(main(sys.argv[1:]))
