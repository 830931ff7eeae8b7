"""The guards of the turn machine's events that branch most (`answered`,
`transport_failed`, `body_ended`): each an ordered list of (condition, outcome) that
the machine runs (`unbroken.core.turn.machine`) and ``docs/gate.md`` shows (rendered
with the table, `turn_table.markdown`).

A guard names two of the machine's methods: ``when`` (does it hold?) and ``then``
(the decision: an action, or None when it declines, so that the next guard decides).
The event runs its list in order; the first guard that holds and does not decline
decides.  Edit the order here and both the code and the doc follow.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALWAYS", "GUARDS", "Guard", "Guards", "guards_of"]


@dataclass(frozen=True, slots=True)
class Guard:
    """One guard of an event's ordered list (`GUARDS`): when the machine's method
    ``when`` holds, its method ``then`` decides: an action, or None (it declined: the
    next guard decides).  The last guard of a list holds always (`ALWAYS`) and never
    declines."""

    when: str
    then: str
    condition: str
    outcome: str


@dataclass(frozen=True, slots=True)
class Guards:
    """An event's guards, in the order the machine runs them (after ``first``, what
    the event always does before them)."""

    event: str  # the event (`turn_table.TurnEvent`), by its method's name
    first: str
    guards: tuple[Guard, ...]


#: the last guard's condition: it holds always
ALWAYS = "_always"

_KNOWN_GOOD = "the answer is known good (`RetryState.record_answer`), then "

#: the decisions of the events that branch most, as the machine runs them: the first
#: guard that holds (and does not decline) decides the event's action
GUARDS: tuple[Guards, ...] = (
    Guards(
        "answered",
        "the status is kept, and the rate-limit headers recorded",
        (
            Guard(
                "_resuming",
                "_resume_answered",
                "RESUMING: the answer to a continuation",
                "2xx SSE: `Stream` through the join check; a retryable status or 1xx: "
                "another cut (as `open_failed`); anything else refuses the join",
            ),
            Guard(
                "_informational",
                "_answer_1xx",
                "a 1xx status (a 101 to a plain request: no answer for the client)",
                "a failed attempt, phase `headers`",
            ),
            Guard(
                "_retryable_answer",
                "_read_retryable",
                "a retryable status (`is_retryable_status`)",
                "`ReadErrorBody`: the failure kept, with its Retry-After",
            ),
            Guard(
                "_patched_4xx",
                "_read_refusal",
                "a 4xx to a patched request (`Request.PATCHED`)",
                _KNOWN_GOOD + "`ReadErrorBody`: maybe the strategy's refusal",
            ),
            Guard(
                "_sse_2xx",
                "_stream_answer",
                "a 2xx SSE answer",
                _KNOWN_GOOD + "`Stream`, through the turn's ledger (made at the first)",
            ),
            Guard(
                "_early_headers_out",
                "_final_in_stream",
                "the client has headers (early headers)",
                _KNOWN_GOOD + "`FinalInStream`: the answer becomes an in-stream error",
            ),
            Guard(
                ALWAYS,
                "_pass_through",
                "otherwise",
                _KNOWN_GOOD + "`PassThrough` (the first byte commits)",
            ),
        ),
    ),
    Guards(
        "transport_failed",
        "",
        (
            Guard(
                "_opening",
                "_open_failed",
                "CONNECTING or RESUMING: no answer yet",
                "as `open_failed`",
            ),
            Guard(
                "_unread",
                "_unread_failed",
                "no ledger read the attempt (ERROR_BODY, FINAL_BODY)",
                "a failed attempt: a replay",
            ),
            Guard(
                "_terminal_out",
                "_tail_cut",
                "the attempt's ledger is DONE: the turn is complete",
                "`End(CLEAN, tail)`: the protocol's ending finished, the cut recorded "
                "(phase `tail`)",
            ),
            Guard(
                "_continuable",
                "_continue_cut",
                'STREAM, with a strategy (`after_commit = "continue"`)',
                "the cut continued in place (its `Wait` or `Resume`), or declined",
            ),
            Guard(
                ALWAYS,
                "_cut",
                "otherwise",
                "the ledger's verdict on the cut (`Ledger.failed`): a replay, "
                "`End(ERROR, native error)` or `End(ABORT)`",
            ),
        ),
    ),
    Guards(
        "body_ended",
        "",
        (
            Guard(
                "_unwatched",
                "_stalled_end",
                "the watch is STALLED or QUEUED: the attempt was aborted",
                "as `transport_failed` with the stall",
            ),
            Guard(
                "_plain_body",
                "_plain_end",
                "a plain body (PASS_THROUGH)",
                "`End(CLEAN)`: outcome `ok`, or `passed_through_error` for a status >= 400",
            ),
            Guard(
                "_terminal_out",
                "_clean_end",
                "the attempt's ledger is DONE: the terminal frame came",
                "`End(CLEAN, tail)` (with `data: [DONE]` if the upstream left it out)",
            ),
            Guard(
                "_terminal_missing",
                "_continue_truncated",
                "a strategy, and the protocol has a terminal frame",
                "the truncated stream continued in place, or declined",
            ),
            Guard(
                ALWAYS,
                "_judged_end",
                "otherwise",
                "the ledger's verdict on the end (`Ledger.ended`): `End(CLEAN)` for a "
                "generic SSE stream, else as a cut",
            ),
        ),
    ),
)


def guards_of(event: str) -> Guards:
    """The guard list of ``event`` (a `turn_table.TurnEvent` value)."""
    for guards in GUARDS:
        if guards.event == event:
            return guards
    raise KeyError(event)
