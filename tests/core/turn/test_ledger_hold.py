"""The commit ledger's holds: what it keeps back while a turn is pending and when it releases.

Control frames, tool calls (held until complete), reasoning, ``hold = all``, the
``max_hold_bytes`` overflow, an unknown frame (it commits), and the time spent holding.
Streams and checks come from `core.turn.ledgerfix`.
"""

from __future__ import annotations

import pytest

from core.turn.ledgerfix import (
    BUILDERS,
    PROTOCOLS,
    Shape,
    anthropic_frames,
    chat_frames,
    check_tool_calls,
    feed_all,
    first_index,
    kinds_of,
    responses_frames,
    sse,
    to_event,
    visible_events,
)
from unbroken.core.turn.ledger import Hold, Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, RESPONSES, Kind


def test_hold_choices_validated() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Hold(["control", "bogus"])
    assert Hold().tools and not Hold().all
    assert Hold(["all"]).tools and Hold(["all"]).all
    assert not Hold(["control"]).tools


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_control_frames_held_then_released_in_order_with_first_output(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=2))
    kinds = kinds_of(protocol, frames)
    first_out = first_index(kinds, Kind.OUTPUT)
    assert first_out > 0 and all(k == Kind.CONTROL for k in kinds[:first_out])
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames)
    assert outs[:first_out] == [b""] * first_out
    assert outs[first_out] == b"".join(frames[: first_out + 1])
    assert b"".join(outs) == b"".join(frames)
    assert ledger.state is LedgerState.DONE and ledger.verdict is Verdict.DONE
    assert ledger.stats.released_bytes == len(b"".join(frames))
    assert ledger.released_frames == len(frames)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_state_commits_exactly_at_first_release(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1))
    ledger = Ledger(protocol)
    for f in frames:
        before = ledger.state
        out = ledger.feed_bytes(to_event(f))
        if before is LedgerState.PENDING and out and ledger.state is not LedgerState.DONE:
            assert ledger.state is LedgerState.COMMITTED
        if not out:
            assert ledger.state is before
    assert ledger.state is LedgerState.DONE


def test_without_control_hold_control_frames_commit() -> None:
    frames = responses_frames("A0Z", Shape(text=1))
    ledger = Ledger(RESPONSES, hold=Hold(["tool_calls"]))
    assert ledger.feed_bytes(to_event(frames[0])) == frames[0]  # response.created released at once
    assert ledger.state is LedgerState.COMMITTED
    assert ledger.failed("reset") != b""
    assert ledger.verdict is Verdict.FAIL


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_tool_call_held_until_end_then_released_whole(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=0, tools=(3,)))
    kinds = kinds_of(protocol, frames)
    end = first_index(kinds, Kind.TOOL_END)
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames)
    assert outs[:end] == [b""] * end
    assert ledger.state is LedgerState.DONE
    assert outs[end] == b"".join(frames[: end + 1])  # everything held, whole, in order
    assert b"".join(outs) == b"".join(frames)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_second_tool_call_held_after_commit(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(2, 2)))
    kinds = kinds_of(protocol, frames)
    starts = [i for i, k in enumerate(kinds) if k & Kind.TOOL_START]
    ends = [i for i, k in enumerate(kinds) if k & Kind.TOOL_END]
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames)
    assert b"".join(outs) == b"".join(frames)
    if proto == "chat":  # all calls close together at finish_reason
        assert outs[ends[0]] == b"".join(frames[starts[0] : ends[0] + 1])
    else:
        for s, e in zip(starts, ends, strict=True):
            assert outs[s:e] == [b""] * (e - s)
            assert outs[e] == b"".join(frames[s : e + 1])


def test_chat_parallel_tool_calls_released_only_at_finish_reason() -> None:
    frames = chat_frames("A0Z", Shape(text=0, tools=(2, 3, 1), interleave=True))
    kinds = kinds_of(CHAT, frames)
    finish = first_index(kinds, Kind.TERMINAL_OK)
    ledger = Ledger(CHAT)
    outs = feed_all(ledger, frames)
    assert outs[:finish] == [b""] * finish
    assert outs[finish] == b"".join(frames[: finish + 1])
    check_tool_calls("chat", visible_events(b"".join(outs)))


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_hold_all_holds_everything_until_terminal(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(reasoning=1, text=3, tools=(2,)))
    kinds = kinds_of(protocol, frames)
    terminal = first_index(kinds, Kind.TERMINAL_OK)
    for k in range(terminal + 1):  # any failure before the terminal replays
        ledger = Ledger(protocol, hold=Hold(["all"]))
        assert b"".join(feed_all(ledger, frames[:k])) == b""
        ledger.failed("reset")
        assert ledger.verdict is Verdict.REPLAY
    ledger = Ledger(protocol, hold=Hold(["all"]))
    outs = feed_all(ledger, frames)
    assert outs[:terminal] == [b""] * terminal
    assert outs[terminal] == b"".join(frames[: terminal + 1])
    assert b"".join(outs) == b"".join(frames)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_hold_reasoning(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(reasoning=3, text=2))
    kinds = kinds_of(protocol, frames)
    first_r = first_index(kinds, Kind.REASONING)
    last_r = max(i for i, k in enumerate(kinds) if k & Kind.REASONING)
    # default: the first reasoning frame commits
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames[: first_r + 1])
    assert outs[-1] == b"".join(frames[: first_r + 1])
    ledger.failed("reset")
    assert ledger.verdict is Verdict.FAIL
    # with "reasoning": held while pending, a failure inside the thinking replays
    held = Ledger(protocol, hold=Hold(["control", "tool_calls", "reasoning"]))
    assert b"".join(feed_all(held, frames[: last_r + 1])) == b""
    held.failed("stall")
    assert held.verdict is Verdict.REPLAY


@pytest.mark.parametrize(
    ("hold", "reasoning"),
    [(("control", "tool_calls"), 0), (("control", "tool_calls", "reasoning"), 2)],
    ids=["default-hold-no-summary", "hold-reasoning-with-summary"],
)
def test_responses_reasoning_item_does_not_commit(hold: tuple[str, ...], reasoning: int) -> None:
    """Regression: a reasoning item's output_item.done committed the turn.

    Then a cut inside the following function call was FAIL instead of REPLAY.
    """
    frames = responses_frames(
        "A0Z", Shape(reasoning=reasoning, text=0, tools=(3,)), reasoning_item=True
    )
    kinds = kinds_of(RESPONSES, frames)
    cut_at = first_index(kinds, Kind.TOOL_DELTA) + 1
    ledger = Ledger(RESPONSES, hold=Hold(hold))
    out = b"".join(feed_all(ledger, frames[:cut_at]))
    ledger.failed("reset")
    assert out == b""
    assert ledger.verdict is Verdict.REPLAY


def test_max_hold_bytes_overflow_releases_and_commits() -> None:
    frames = chat_frames("A0Z", Shape(text=6))
    limit = sum(len(f) for f in frames[:3])
    ledger = Ledger(CHAT, hold=Hold(["all"]), max_hold_bytes=limit)
    outs = feed_all(ledger, frames[:4])
    assert outs[:3] == [b"", b"", b""]
    assert outs[3] == b"".join(frames[:4])  # the frame that crossed the limit releases all
    assert ledger.hold_overflowed
    assert ledger.state is LedgerState.COMMITTED
    assert ledger.held_bytes == 0
    tail = ledger.failed("reset")
    assert ledger.verdict is Verdict.FAIL and tail == ledger.error_bytes


def test_max_hold_bytes_overflow_of_a_huge_tool_call() -> None:
    frames = anthropic_frames("A0Z", Shape(text=0, tools=(40,)))
    ledger = Ledger(ANTHROPIC, max_hold_bytes=1000)
    out = b"".join(feed_all(ledger, frames))
    assert ledger.hold_overflowed
    assert out == b"".join(frames)  # nothing lost, nothing reordered
    assert ledger.state is LedgerState.DONE


def test_unknown_frame_commits_with_held_control() -> None:
    frames = responses_frames("A0Z", Shape(text=1))
    ledger = Ledger(RESPONSES)
    feed_all(ledger, frames[:2])
    unknown = sse(
        "response.brand_new_event", {"type": "response.brand_new_event", "sequence_number": 2}
    )
    assert ledger.feed_bytes(to_event(unknown)) == frames[0] + frames[1] + unknown
    assert ledger.state is LedgerState.COMMITTED


def test_hold_seconds_with_fake_clock() -> None:
    now = [100.0]
    ledger = Ledger(CHAT, clock=lambda: now[0])
    frames = chat_frames("A0Z", Shape(text=1, tools=(2,)))
    kinds = kinds_of(CHAT, frames)
    ledger.feed_bytes(to_event(frames[0]))  # role chunk held at t=100
    now[0] = 102.5
    assert ledger.feed_bytes(to_event(frames[1]))  # text: released
    assert ledger.stats.hold_seconds == pytest.approx(2.5)
    now[0] = 200.0
    start = first_index(kinds, Kind.TOOL_START)
    assert ledger.feed_bytes(to_event(frames[start])) == b""  # tool call held at t=200
    now[0] = 203.0
    for f in frames[start + 1 : -3]:
        assert ledger.feed_bytes(to_event(f)) == b""
    now[0] = 201.0 + 3.0
    assert ledger.feed_bytes(to_event(frames[-3]))  # finish_reason releases the call at t=204
    assert ledger.stats.hold_seconds == pytest.approx(6.5)


def test_hold_seconds_without_clock_stays_zero() -> None:
    ledger = Ledger(CHAT)
    feed_all(ledger, chat_frames("A0Z", Shape(text=1)))
    assert ledger.stats.hold_seconds == 0.0
