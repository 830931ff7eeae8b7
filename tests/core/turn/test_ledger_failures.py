"""The commit ledger on a failed attempt: replay while pending, our native error after commit.

A reset, an early end, a cut frame, a retryable in-stream error or a malformed
frame replays while nothing was released and ends a committed turn with the
protocol's own retryable error (its shape per protocol is checked here), never
with a partial tool call; a new attempt starts only while pending, and giving up
sends only the error.  Streams and checks come from `core.turn.ledgerfix`.
"""

from __future__ import annotations

import json

import pytest

from core.turn.ledgerfix import (
    BUILDERS,
    MALFORMED,
    PROTOCOLS,
    RETRYABLE_ERROR,
    Shape,
    anthropic_frames,
    check_tool_calls,
    feed_all,
    first_index,
    is_error_event,
    kinds_of,
    state,
    success_terminals,
    to_event,
    verdict,
    visible_events,
)
from unbroken.core.turn.ledger import Ledger, LedgerError, LedgerState, Verdict
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, RESPONSES, Kind


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("how", ["reset", "end", "cut", "retryable", "malformed"])
def test_failure_while_pending_replays_and_releases_nothing(proto: str, how: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=0, tools=(3, 2)))
    kinds = kinds_of(protocol, frames)
    commit = first_index(kinds, Kind.TOOL_END)
    for k in range(commit + 1):  # fault after k frames, before the first release
        ledger = Ledger(protocol)
        assert b"".join(feed_all(ledger, frames[:k])) == b""
        if how == "reset":
            out = ledger.failed("connection reset")
        elif how == "end":
            out = ledger.ended(b"")
        elif how == "cut":
            out = ledger.ended(frames[k][:7])
        elif how == "retryable":
            out = ledger.feed_bytes(to_event(RETRYABLE_ERROR[proto]))
        else:
            out = ledger.feed_bytes(to_event(MALFORMED[proto]))
        assert out == b""
        assert ledger.verdict is Verdict.REPLAY
        assert ledger.state is LedgerState.PENDING and ledger.replayable
        assert ledger.stats.released_bytes == 0
        assert ledger.held_bytes == 0
        assert ledger.fail_reason


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_replay_then_clean_attempt_releases_exactly_that_attempt(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    shape = Shape(reasoning=0, text=0, tools=(3, 2))
    first = BUILDERS[proto]("A0Z", shape)
    second = BUILDERS[proto]("A1Z", shape)
    cut_at = first_index(kinds_of(protocol, first), Kind.TOOL_DELTA) + 1
    ledger = Ledger(protocol)
    out = b"".join(feed_all(ledger, first[:cut_at]))
    out += ledger.failed("reset")
    assert ledger.verdict is Verdict.REPLAY
    ledger.start_attempt()
    assert verdict(ledger) is Verdict.CONTINUE
    out += b"".join(feed_all(ledger, second))
    out += ledger.ended(b"")
    assert out == b"".join(second)
    assert b"A0Z" not in out
    assert state(ledger) is LedgerState.DONE and verdict(ledger) is Verdict.DONE


def _committed_prefix(proto: str) -> tuple[list[bytes], int]:
    frames = BUILDERS[proto]("A0Z", Shape(text=3, tools=(3,)))
    commit = first_index(kinds_of(PROTOCOLS[proto], frames), Kind.OUTPUT)
    return frames, commit


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("how", ["reset", "end", "cut", "retryable", "malformed"])
def test_failure_after_commit_ends_with_native_error(proto: str, how: str) -> None:
    protocol = PROTOCOLS[proto]
    frames, commit = _committed_prefix(proto)
    terminal = first_index(kinds_of(protocol, frames), Kind.TERMINAL_OK)
    for k in range(commit + 1, terminal):
        ledger = Ledger(protocol)
        out = b"".join(feed_all(ledger, frames[:k]))
        assert ledger.state is LedgerState.COMMITTED
        if how == "reset":
            tail = ledger.failed("connection reset")
        elif how == "end":
            tail = ledger.ended(b"")
        elif how == "cut":
            tail = ledger.ended(frames[k][:5])
        elif how == "retryable":
            tail = ledger.feed_bytes(to_event(RETRYABLE_ERROR[proto]))
        else:
            tail = ledger.feed_bytes(to_event(MALFORMED[proto]))
        assert ledger.verdict is Verdict.FAIL and state(ledger) is LedgerState.FAILED
        assert tail == ledger.error_bytes != b""
        assert RETRYABLE_ERROR[proto] not in tail  # ours, not the provider's frame
        client = visible_events(out + tail)
        assert not success_terminals(proto, client)
        assert is_error_event(proto, client[-1])
        check_tool_calls(proto, client)  # a cut tool call is never visible
        # nothing more after the error, whatever arrives
        assert ledger.feed_bytes(to_event(frames[k])) == b""
        assert ledger.failed("again") == b""
        assert ledger.ended(b"") == b""
        assert ledger.stats.released_bytes == len(out + tail)


def test_chat_native_error_shape() -> None:
    frames, commit = _committed_prefix("chat")
    ledger = Ledger(CHAT)
    feed_all(ledger, frames[: commit + 1])
    tail = ledger.failed("reset")
    (event,) = visible_events(tail)
    assert event.name is None
    body = json.loads(event.data or "")
    assert body["error"]["type"] == "server_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert b"[DONE]" not in tail
    assert CHAT.new_classifier().classify(event)[0] == Kind.TERMINAL_ERROR | Kind.RETRYABLE


def test_responses_native_error_reuses_response_id() -> None:
    frames, commit = _committed_prefix("responses")
    ledger = Ledger(RESPONSES)
    feed_all(ledger, frames[: commit + 2])
    last_seq = json.loads(to_event(frames[commit + 1]).data or "")["sequence_number"]
    tail = ledger.failed("reset")
    events = visible_events(tail)
    assert events[-1].name == "response.failed"
    failed = json.loads(events[-1].data or "")
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["id"] == "resp_A0Z"
    assert failed["response"]["model"] == "gpt-5"
    seqs = [json.loads(e.data or "")["sequence_number"] for e in events]
    assert seqs == list(range(last_seq + 1, last_seq + 1 + len(events)))
    for e in events:
        assert e.name in ("error", "response.failed")
        kinds = RESPONSES.new_classifier().classify(e)[0]
        assert kinds == Kind.TERMINAL_ERROR | Kind.RETRYABLE
    assert b"response.completed" not in tail


def test_anthropic_native_error_is_overloaded() -> None:
    frames, commit = _committed_prefix("anthropic")
    ledger = Ledger(ANTHROPIC)
    feed_all(ledger, frames[: commit + 1])
    tail = ledger.failed("reset")
    (event,) = visible_events(tail)
    assert event.name == "error"
    body = json.loads(event.data or "")
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert b"message_stop" not in tail


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_cut_mid_tool_call_after_commit_drops_the_partial_call(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(4,)))
    kinds = kinds_of(protocol, frames)
    start = first_index(kinds, Kind.TOOL_START)
    end = first_index(kinds, Kind.TOOL_END)
    for k in range(start + 1, end):
        ledger = Ledger(protocol)
        out = b"".join(feed_all(ledger, frames[:k]))
        assert out == b"".join(frames[:start])
        assert ledger.open_tools == 1
        tail = ledger.failed("reset")
        assert ledger.verdict is Verdict.FAIL
        assert ledger.held_bytes == 0
        client = visible_events(out + tail)
        check_tool_calls(proto, client)
        assert b"call_" not in out and b"fc_" not in out and b"toolu_" not in out


def test_retryable_error_after_commit_is_replaced_by_ours() -> None:
    frames = anthropic_frames("A0Z", Shape(text=2))
    commit = first_index(kinds_of(ANTHROPIC, frames), Kind.OUTPUT)
    ledger = Ledger(ANTHROPIC)
    feed_all(ledger, frames[: commit + 1])
    tail = ledger.feed_bytes(to_event(RETRYABLE_ERROR["anthropic"]))
    assert tail == ledger.error_bytes
    assert tail != RETRYABLE_ERROR["anthropic"]
    assert ledger.fail_reason


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_start_attempt_only_while_pending(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1))
    commit = first_index(kinds_of(protocol, frames), Kind.OUTPUT)
    ledger = Ledger(protocol)
    feed_all(ledger, frames[:commit])
    ledger.start_attempt()  # still pending: fine (and drops nothing visible)
    feed_all(ledger, frames[: commit + 1])
    with pytest.raises(LedgerError, match="committed"):
        ledger.start_attempt()
    feed_all(ledger, frames[commit + 1 :])
    with pytest.raises(LedgerError, match="done"):
        ledger.start_attempt()
    failed = Ledger(protocol)
    failed.give_up("exhausted")
    with pytest.raises(LedgerError, match="failed"):
        failed.start_attempt()


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_give_up_while_pending_sends_only_the_native_error(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1))
    ledger = Ledger(protocol)
    feed_all(ledger, frames[:1])
    tail = ledger.give_up("retries exhausted")
    assert tail == ledger.error_bytes != b""
    assert frames[0] not in tail
    assert ledger.state is LedgerState.FAILED and ledger.verdict is Verdict.FAIL
    assert ledger.fail_reason == "retries exhausted"
    client = visible_events(tail)
    assert is_error_event(proto, client[-1])
    assert not success_terminals(proto, client)
    assert ledger.feed_bytes(to_event(frames[1])) == b""
