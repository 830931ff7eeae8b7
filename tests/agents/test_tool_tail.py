"""hold = [..., "tool_tail"]: a complete tool call waits for the end of its message while
nothing was released, so a cut in that gap is replayed, not an error after commit."""

from __future__ import annotations

from typing import Any

from unbroken.core.ledger import Hold, Ledger, LedgerState, Verdict
from unbroken.core.protocols import ANTHROPIC, RESPONSES, Protocol
from unbroken.core.sse import Event, SSESplitter
from unbroken.mock.wire import frames_for

TAIL = Hold(("control", "tool_calls", "tool_tail"))
BODY = {
    "model": "m",
    "stream": True,
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


def _events(protocol: str, action: dict[str, Any]) -> list[Event]:
    return SSESplitter().feed(b"".join(frames_for(protocol, action, BODY)))


def _feed(ledger: Ledger, events: list[Event]) -> list[list[bytes]]:
    return [[e.raw for e in ledger.feed(ev)] for ev in events]


def _name(ev: Event) -> str:
    return ev.name or ""


def test_anthropic_call_waits_for_message_stop_and_a_cut_in_the_gap_replays() -> None:
    events = _events("anthropic", {"reply": "tool"})
    stop = max(i for i, e in enumerate(events) if _name(e) == "content_block_stop")
    assert [_name(e) for e in events[stop + 1 :]] == ["message_delta", "message_stop"]
    # without tool_tail the call is released at its content_block_stop: a cut after it
    # is a failure after commit
    plain = Ledger(ANTHROPIC)
    out = _feed(plain, events[: stop + 1])
    assert out[stop] and plain.state is LedgerState.COMMITTED
    # with it, nothing is released yet, and the cut replays
    ledger = Ledger(ANTHROPIC, hold=TAIL)
    assert not any(_feed(ledger, events[: stop + 2]))
    ledger.failed("reset")
    assert ledger.verdict is Verdict.REPLAY
    # the replay's message_stop releases everything, in order
    ledger.start_attempt()
    out = _feed(ledger, events)
    assert [raw for frames in out for raw in frames] == [e.raw for e in events]
    assert ledger.state is LedgerState.DONE


def test_responses_call_waits_for_response_completed() -> None:
    events = _events("responses", {"reply": "tool"})
    done = max(i for i, e in enumerate(events) if _name(e) == "response.output_item.done")
    ledger = Ledger(RESPONSES, hold=TAIL)
    out = _feed(ledger, events)
    assert not any(out[: len(events) - 1])
    assert [raw for raw in out[-1]] == [e.raw for e in events]
    assert done == len(events) - 2


def _parallel(protocol: Protocol, name: str, start_name: str, end_name: str) -> None:
    events = _events(name, {"reply": "tools"})
    starts = [i for i, e in enumerate(events) if _name(e) == start_name]
    ends = [i for i, e in enumerate(events) if _name(e) == end_name]
    ledger = Ledger(protocol, hold=TAIL)
    out = _feed(ledger, events)
    released_at = [i for i, frames in enumerate(out) if frames]
    # the first call goes out when the second begins (it waited only for that); the
    # turn is committed then, and the second call goes out at its end, as without
    # tool_tail
    assert released_at[:2] == [starts[-1], ends[-1]]
    assert ledger.state is LedgerState.DONE
    assert [raw for frames in out for raw in frames] == [e.raw for e in events]


def test_parallel_calls_are_not_held_for_each_other() -> None:
    _parallel(ANTHROPIC, "anthropic", "content_block_start", "content_block_stop")
    _parallel(RESPONSES, "responses", "response.output_item.added", "response.output_item.done")


def test_text_before_the_call_commits_as_before() -> None:
    """Once output reached the client, tool_tail changes nothing (no replay is possible)."""
    events = _events("anthropic", {"reply": "tool"})
    start = next(i for i, e in enumerate(events) if _name(e) == "content_block_start")
    [text] = SSESplitter().feed(
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"hi"}}\n\n'
    )
    ledger = Ledger(ANTHROPIC, hold=TAIL)
    assert _feed(ledger, events[:start]) == [[]] * start  # message_start: held
    # the text commits the turn, releasing what was held before it with it
    assert [e.raw for e in ledger.feed(text)] == [e.raw for e in events[:start]] + [text.raw]
    assert [ledger.state] == [LedgerState.COMMITTED]  # (a list: mypy keeps it unnarrowed)
    stop = max(i for i, e in enumerate(events) if _name(e) == "content_block_stop")
    call = events[start : stop + 1]
    # the call is released whole at its end, as without tool_tail: not held for the tail
    assert _feed(ledger, call) == [[]] * (len(call) - 1) + [[e.raw for e in call]]
    # and the tail after it goes out frame by frame
    tail = events[stop + 1 :]
    assert _feed(ledger, tail) == [[e.raw] for e in tail]
    assert ledger.state is LedgerState.DONE
    # frame for frame what a ledger without tool_tail releases
    plain = Ledger(ANTHROPIC, hold=Hold(("control", "tool_calls")))
    sequence = [*events[:start], text, *call, *tail]
    assert _feed(plain, sequence) == _feed(Ledger(ANTHROPIC, hold=TAIL), sequence)


def test_config_accepts_tool_tail() -> None:
    from unbroken.config import parse_config

    cfg = parse_config({"stream": {"hold": ["control", "tool_calls", "tool_tail"]}}, env={})
    assert Hold(cfg.stream.hold).tool_tail
    assert not Hold(("control", "tool_tail")).tool_tail  # needs tool_calls
