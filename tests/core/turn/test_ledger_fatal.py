"""The commit ledger on a provider's non-retryable (final) error: it passes through.

Before or after commit, with what was held before it, but never with a tool call
that was still open.  Streams and checks come from `core.turn.ledgerfix`.
"""

from __future__ import annotations

import pytest

from core.turn.ledgerfix import (
    BUILDERS,
    FATAL_ERROR,
    PROTOCOLS,
    Shape,
    chat_frames,
    check_tool_calls,
    feed_all,
    first_index,
    kinds_of,
    sse,
    to_event,
    visible_events,
)
from unbroken.core.turn.ledger import Hold, Ledger, LedgerError, LedgerState, Verdict
from unbroken.core.wire.protocols import CHAT, Kind


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_non_retryable_error_while_pending_passes_through(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=2))
    ledger = Ledger(protocol)
    assert feed_all(ledger, frames[:1]) == [b""]
    out = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert out == frames[0] + FATAL_ERROR[proto]  # with what was held
    assert ledger.state is LedgerState.FAILED and ledger.verdict is Verdict.FAIL
    assert ledger.error_bytes == b""
    assert ledger.fail_reason
    assert ledger.failed("reset") == b""
    assert ledger.ended(b"") == b""
    with pytest.raises(LedgerError):
        ledger.start_attempt()


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_non_retryable_error_after_commit_passes_through_without_partial_call(
    proto: str,
) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(3,)))
    kinds = kinds_of(protocol, frames)
    start = first_index(kinds, Kind.TOOL_START)
    ledger = Ledger(protocol)
    out = b"".join(feed_all(ledger, frames[: start + 2]))
    assert out == b"".join(frames[:start])
    tail = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert tail == FATAL_ERROR[proto]
    assert ledger.verdict is Verdict.FAIL
    check_tool_calls(proto, visible_events(out + tail))


@pytest.mark.parametrize(
    ("proto", "hold"),
    [
        ("responses", ("control", "tool_calls")),
        ("anthropic", ("control", "tool_calls")),
        ("chat", ("all",)),
    ],
)
def test_non_retryable_error_keeps_held_frames_before_partial_call(
    proto: str, hold: tuple[str, ...]
) -> None:
    """Regression: a final error with an open tool call dropped *all* held frames."""
    protocol = PROTOCOLS[proto]
    shape = Shape(text=2 if hold == ("all",) else 0, tools=(3,))
    frames = BUILDERS[proto]("A0Z", shape)
    kinds = kinds_of(protocol, frames)
    start = first_index(kinds, Kind.TOOL_START)
    ledger = Ledger(protocol, hold=Hold(hold))
    assert b"".join(feed_all(ledger, frames[: start + 2])) == b""
    out = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert out == b"".join(frames[:start]) + FATAL_ERROR[proto]


@pytest.mark.parametrize("proto", ["responses", "anthropic"])
def test_non_retryable_error_keeps_a_complete_held_call_and_drops_the_partial_one(
    proto: str,
) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(2, 3)))
    kinds = kinds_of(protocol, frames)
    second = [i for i, k in enumerate(kinds) if k & Kind.TOOL_START][1]
    ledger = Ledger(protocol, hold=Hold(["all"]))
    assert b"".join(feed_all(ledger, frames[: second + 2])) == b""
    out = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert out == b"".join(frames[:second]) + FATAL_ERROR[proto]
    check_tool_calls(proto, visible_events(out)[:-1])


@pytest.mark.parametrize("hold", [("control", "tool_calls"), ("all",)])
def test_non_retryable_error_after_a_chunk_starting_two_calls(hold: tuple[str, ...]) -> None:
    text = 1 if hold == ("all",) else 0
    frames = chat_frames("A0Z", Shape(text=text))[: 1 + text]  # role (+ text)
    both = sse(
        None,
        {
            "id": "chatcmpl-A0Z",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": None,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_a",
                                "type": "function",
                                "function": {"name": "bash", "arguments": ""},
                            },
                            {
                                "index": 1,
                                "id": "call_b",
                                "type": "function",
                                "function": {"name": "bash", "arguments": ""},
                            },
                        ]
                    },
                }
            ],
        },
    )
    ledger = Ledger(CHAT, hold=Hold(hold))
    assert b"".join(feed_all(ledger, [*frames, both])) == b""
    assert ledger.open_tools == 2
    out = ledger.feed_bytes(to_event(FATAL_ERROR["chat"]))
    assert out == b"".join(frames) + FATAL_ERROR["chat"]
