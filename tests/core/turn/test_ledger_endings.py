"""How a stream's end reads to the commit ledger: complete, truncated, or replayable.

A clean end without the terminal frame, frames after the terminal, the generic
(protocol-less) stream, and the connection dying after any byte: the client never
sees a cut frame nor a truncated turn that ends clean.  Streams and checks come from
`core.turn.ledgerfix`.
"""

from __future__ import annotations

import pytest

from core.turn.ledgerfix import (
    BUILDERS,
    PROTOCOLS,
    Shape,
    chat_frames,
    check_tool_calls,
    feed_all,
    first_index,
    kinds_of,
    state,
    success_terminals,
    to_event,
    visible_events,
)
from unbroken.core.turn.ledger import Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import CHAT, GENERIC, Kind
from unbroken.core.wire.sse import SSESplitter


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_clean_end_without_terminal(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=2))
    kinds = kinds_of(protocol, frames)
    terminal = first_index(kinds, Kind.TERMINAL_OK)
    pending = Ledger(protocol)
    feed_all(pending, frames[:1])
    assert pending.ended(b"") == b"" and pending.verdict is Verdict.REPLAY
    committed = Ledger(protocol)
    feed_all(committed, frames[:terminal])
    tail = committed.ended(b"")
    assert committed.verdict is Verdict.FAIL and tail == committed.error_bytes != b""
    assert committed.fail_reason
    done = Ledger(protocol)
    feed_all(done, frames[: terminal + 1])
    assert done.ended(b"") == b"" and done.verdict is Verdict.DONE


def test_chat_end_after_finish_reason_before_done_is_complete() -> None:
    frames = chat_frames("A0Z", Shape(text=2))
    ledger = Ledger(CHAT)
    out = b"".join(feed_all(ledger, frames[:-2]))  # up to finish_reason, no usage, no [DONE]
    assert ledger.state is LedgerState.DONE
    assert ledger.failed("reset") == b""
    assert ledger.verdict is Verdict.DONE
    assert ledger.ended(b"") == b""
    assert out == b"".join(frames[:-2])


def test_trailing_frames_after_terminal_ok_are_released() -> None:
    frames = chat_frames("A0Z", Shape(text=1))
    ledger = Ledger(CHAT)
    feed_all(ledger, frames[:-2])
    assert ledger.verdict is Verdict.DONE
    assert ledger.feed_bytes(to_event(frames[-2])) == frames[-2]  # usage chunk
    assert ledger.feed_bytes(to_event(frames[-1])) == frames[-1]  # [DONE]
    assert ledger.feed_bytes(to_event(b": trailing\n\n")) == b": trailing\n\n"
    assert ledger.verdict is Verdict.DONE and ledger.state is LedgerState.DONE


def test_generic_protocol() -> None:
    ledger = Ledger(GENERIC)
    assert ledger.feed_bytes(to_event(b": hello\n\n")) == b""  # CONTROL held while pending
    assert ledger.feed_bytes(to_event(b"data: 1\n\n")) == b": hello\n\ndata: 1\n\n"
    assert ledger.state is LedgerState.COMMITTED
    assert ledger.ended(b"") == b""
    assert state(ledger) is LedgerState.DONE and ledger.verdict is Verdict.DONE

    cut = Ledger(GENERIC)
    cut.feed(to_event(b"data: 1\n\n"))
    tail = cut.ended(b"data: partial")
    assert cut.verdict is Verdict.FAIL and tail
    (event,) = visible_events(tail)
    assert event.name == "error"

    empty = Ledger(GENERIC)
    assert empty.ended(b"") == b"" and empty.verdict is Verdict.DONE


def test_generic_stream_with_trailing_blank_line_completes() -> None:
    """Regression (splitter + ledger, as the relay wires them): not a truncation."""
    stream = b"data: 1\n\ndata: 2\n\n\n"
    for i in range(len(stream) + 1):
        splitter = SSESplitter()
        ledger = Ledger(GENERIC)
        out = b""
        for chunk in (stream[:i], stream[i:]):
            for event in splitter.feed(chunk):
                out += ledger.feed_bytes(event)
        out += ledger.ended(splitter.pending)
        assert ledger.state is LedgerState.DONE, i
        assert out == stream


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_byte_level_truncation_at_every_offset(proto: str) -> None:
    """The connection dies after any byte: the client never sees a cut frame."""
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(reasoning=1, text=2, tools=(2,)))
    stream = b"".join(frames)
    boundaries = {sum(len(f) for f in frames[:k]) for k in range(len(frames) + 1)}
    for i in range(len(stream) + 1):
        splitter = SSESplitter()
        ledger = Ledger(protocol)
        out = b"".join(ledger.feed_bytes(e) for e in splitter.feed(stream[:i]))
        out += ledger.ended(splitter.pending)
        if ledger.state is LedgerState.DONE:
            assert len(out) in boundaries and stream.startswith(out)
            assert success_terminals(proto, visible_events(out))
        elif ledger.verdict is Verdict.REPLAY:
            assert out == b""
        else:
            assert ledger.verdict is Verdict.FAIL
            body = out[: len(out) - len(ledger.error_bytes)]
            assert out.endswith(ledger.error_bytes) and ledger.error_bytes
            assert len(body) in boundaries and stream.startswith(body)
            client = visible_events(out)
            assert not success_terminals(proto, client)
            check_tool_calls(proto, client)
