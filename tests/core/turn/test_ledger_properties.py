"""The commit ledger's invariants over fault schedules: random (hypothesis) and exhaustive.

A minimal relay shell drives the ledger through attempts that each fail in one of
the ways a provider fails (or not at all); whatever the schedule, the client sees a
frame-aligned prefix of one attempt only, every tool call whole, and a turn that did
not complete ends with an error event.  Streams and checks come from `core.turn.ledgerfix`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.turn.ledgerfix import (
    BUILDERS,
    FATAL_ERROR,
    MALFORMED,
    PROTOCOLS,
    RETRYABLE_ERROR,
    Shape,
    check_tool_calls,
    is_error_event,
    success_terminals,
    to_event,
    visible_events,
)
from unbroken.core.turn.ledger import Hold, Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import Kind

# ---------------------------------------------------------------------------
# Property: random fault schedules over random successful streams

FAULTS = ("none", "reset", "end", "cut", "retryable", "malformed", "fatal")
HOLDS = (
    ("control", "tool_calls"),
    ("tool_calls",),
    ("control", "tool_calls", "reasoning"),
    ("all",),
)


@dataclass
class Attempt:
    frames: list[bytes]
    fault: str
    pos: int
    received: list[bytes] = field(default_factory=list)


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    n_tools = draw(st.integers(0, 3))
    text = draw(st.integers(0 if n_tools else 1, 3))
    return Shape(
        reasoning=draw(st.integers(0, 2)),
        text=text,
        tools=tuple(draw(st.integers(1, 3)) for _ in range(n_tools)),
        interleave=draw(st.booleans()),
    )


@st.composite
def scenarios(draw: st.DrawFn, proto: str) -> tuple[tuple[str, ...], list[Attempt]]:
    hold = draw(st.sampled_from(HOLDS))
    attempts = []
    for a in range(draw(st.integers(1, 4))):
        frames = BUILDERS[proto](f"A{a}Z", draw(shapes()))
        fault = draw(st.sampled_from(FAULTS))
        pos = draw(st.integers(0, len(frames)))
        attempts.append(Attempt(frames, fault, pos))
    return hold, attempts


def drive(proto: str, hold: tuple[str, ...], attempts: list[Attempt]) -> tuple[Ledger, bytes, int]:
    """A minimal relay shell over the ledger: returns (ledger, client bytes, last attempt)."""
    protocol = PROTOCOLS[proto]
    ledger = Ledger(protocol, hold=Hold(hold))
    out = bytearray()
    last = 0
    for i, att in enumerate(attempts):
        if i > 0:
            # (c) a new attempt only ever follows a REPLAY, i.e. nothing was released
            assert ledger.verdict is Verdict.REPLAY
            assert ledger.state is LedgerState.PENDING and not out
            ledger.start_attempt()
        last = i
        stop = len(att.frames) if att.fault == "none" else att.pos
        for frame in att.frames[:stop]:
            att.received.append(frame)
            out += ledger.feed_bytes(to_event(frame))
            assert ledger.verdict is not Verdict.REPLAY
        if att.fault in ("none", "end"):
            out += ledger.ended(b"")
        elif att.fault == "reset":
            out += ledger.failed("connection reset")
        elif att.fault == "cut":
            leftover = (
                att.frames[stop][: len(att.frames[stop]) // 2] if stop < len(att.frames) else b""
            )
            out += ledger.ended(leftover)
        else:
            frame = {"retryable": RETRYABLE_ERROR, "malformed": MALFORMED, "fatal": FATAL_ERROR}[
                att.fault
            ][proto]
            att.received.append(frame)
            out += ledger.feed_bytes(to_event(frame))
            if ledger.verdict in (Verdict.CONTINUE, Verdict.DONE):
                out += ledger.ended(b"")  # the upstream closes after its error
        if ledger.state is not LedgerState.PENDING:
            assert ledger.verdict is not Verdict.REPLAY
        if ledger.verdict is not Verdict.REPLAY:
            break
    if ledger.verdict is Verdict.REPLAY:  # attempts exhausted while pending
        out += ledger.give_up("retries exhausted")
    return ledger, bytes(out), last


def check_invariants(proto: str, hold: tuple[str, ...], attempts: list[Attempt]) -> None:
    ledger, out, last = drive(proto, hold, attempts)
    att = attempts[last]
    assert ledger.verdict in (Verdict.DONE, Verdict.FAIL)
    assert ledger.stats.released_bytes == len(out)
    # no byte of a dead attempt is visible
    for d in range(len(attempts)):
        if d != last:
            assert f"A{d}Z".encode() not in out
    prefixes = {b"".join(att.received[:k]): k for k in range(len(att.received) + 1)}
    client = visible_events(out)
    check_tool_calls(proto, [e for e in client if not is_error_event(proto, e)])
    if ledger.state is LedgerState.DONE:
        # (a) the client saw a frame-aligned prefix of exactly one attempt, the last,
        # that includes its success terminal; all of it when that attempt was clean
        assert out in prefixes
        assert success_terminals(proto, client)
        if att.fault == "none":
            assert out == b"".join(att.frames)
    else:
        # (d) a turn that did not complete ends with an error event, ours or the
        # provider's final one, never with a success terminal or a bare end
        assert ledger.state is LedgerState.FAILED and ledger.verdict is Verdict.FAIL
        assert client, "a failed turn must not end with a bare end of body"
        assert is_error_event(proto, client[-1])
        assert not success_terminals(proto, client)
        if ledger.error_bytes:
            assert out.endswith(ledger.error_bytes)
            assert out[: len(out) - len(ledger.error_bytes)] in prefixes
            for e in visible_events(ledger.error_bytes):
                kinds = PROTOCOLS[proto].new_classifier().classify(e)[0]
                assert kinds & Kind.TERMINAL_ERROR and kinds & Kind.RETRYABLE
        else:
            assert att.fault == "fatal"
            fatal = FATAL_ERROR[proto]
            assert out.endswith(fatal)
            assert out[: len(out) - len(fatal)] in prefixes or out in prefixes
    # hold "all": every failure before the terminal frame was replayable
    if hold == ("all",) and ledger.state is LedgerState.FAILED and not ledger.hold_overflowed:
        assert out == ledger.error_bytes or att.fault == "fatal"


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_property_fault_schedules(proto: str) -> None:
    @settings(
        max_examples=250,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenario=scenarios(proto))
    def run(scenario: tuple[tuple[str, ...], list[Attempt]]) -> None:
        hold, attempts = scenario
        check_invariants(proto, hold, attempts)

    run()


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("hold", HOLDS, ids=["-".join(h) for h in HOLDS])
def test_exhaustive_single_fault_then_clean_attempt(proto: str, hold: tuple[str, ...]) -> None:
    """Every fault at every position of a mixed stream, followed by a clean attempt."""
    shape = Shape(reasoning=1, text=2, tools=(2, 2), interleave=True)
    n = len(BUILDERS[proto]("A0Z", shape))
    for fault in FAULTS[1:]:
        for pos in range(n + 1):
            attempts = [
                Attempt(BUILDERS[proto]("A0Z", shape), fault, pos),
                Attempt(BUILDERS[proto]("A1Z", shape), "none", 0),
            ]
            check_invariants(proto, hold, attempts)
