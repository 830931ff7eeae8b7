"""The turn machine: events in, actions out, with a fake clock and no sockets."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnfix import Report, Timers
from unbroken.core.ledger import Hold, LedgerState
from unbroken.core.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.protocols import CHAT
from unbroken.core.sse import Event, SSESplitter
from unbroken.core.turn import (
    KEEPALIVE,
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
    TurnError,
    TurnMachine,
    Wait,
    set_testing,
)


def make(
    *,
    stream: bool = True,
    upstreams: int = 1,
    max_attempts: int = 0,
    delay_ms: int = 100,
    **timers: Any,
) -> tuple[TurnMachine, Report]:
    report = Report()
    retry = RetryState(
        RetryPolicy(delay_ms=delay_ms, backoff="fixed", max_attempts=max_attempts),
        upstreams,
        rng=random.Random(0),
    )
    m = TurnMachine(
        protocol=CHAT,
        hold=Hold(),
        timers=Timers(**timers),
        retry=retry,
        stream=stream,
        now=0.0,
        report=report,
    )
    return m, report


def chunk(delta: dict[str, Any], finish: str | None = None, id_: str = "c1") -> bytes:
    obj = {"id": id_, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = chunk({"role": "assistant"})
TEXT = chunk({"content": "hello"})
FINISH = chunk({}, "stop")
DONE = b"data: [DONE]\n\n"
RETRYABLE = b'data: {"error": {"type": "server_error", "message": "boom"}}\n\n'
RESET = Failure(FailureClass.RESET, "reset")
REFUSED = Failure(FailureClass.REFUSED, "refused")


def raw(fed: Any) -> bytes:
    """The bytes of what a feed released (its frames')."""
    events = fed.released if isinstance(fed, Fed) else fed
    return b"".join(e.raw for e in events)


def seen(fed: Fed[Any]) -> tuple[bytes, Action | None]:
    """A feed's released bytes and its ``over``."""
    return raw(fed), fed.over


def streaming(m: TurnMachine, now: float = 1.0) -> None:
    assert isinstance(m.start(0.0), Open)
    assert isinstance(m.answered(now, 200, sse=True), Stream)


# -- attempts, waits and giving up ---------------------------------------------------------
def test_start_opens_the_first_upstream_with_the_header_timeout() -> None:
    m, report = make()
    assert m.start(0.0) == Open(0, 120.0)
    assert report.of("started") == [("started", 1, 0)]


def test_a_non_streamed_turn_waits_the_first_frame_time_for_headers() -> None:
    m, _ = make(stream=False)
    assert m.start(0.0) == Open(0, 300.0)


def test_a_refused_upstream_reroutes_at_once() -> None:
    m, report = make(upstreams=2)
    m.start(0.0)
    assert m.open_failed(0.1, REFUSED) == Open(1, 120.0)
    assert report.of("failed") == [("failed", "connection_refused", Phase.CONNECT, 0.0)]


@pytest.mark.parametrize(
    ("failure", "phase"),
    [
        (REFUSED, Phase.CONNECT),
        (Failure(FailureClass.HEADER_TIMEOUT, "slow"), Phase.HEADERS),
    ],
)
def test_an_open_failure_waits_then_retries(failure: Failure, phase: Phase) -> None:
    m, report = make()
    m.start(0.0)
    assert m.open_failed(0.1, failure) == Wait(0.1)
    assert report.of("failed")[0][2] is phase
    assert m.next_attempt(0.2) == Open(0, 120.0)


def test_give_up_without_an_answer_is_a_502_in_the_protocols_shape() -> None:
    m, report = make(max_attempts=1)
    m.start(0.0)
    action = m.open_failed(0.1, REFUSED)
    assert isinstance(action, GiveUp) and action.kind is GiveUpKind.BAD_GATEWAY
    assert b"all upstream attempts failed" in action.data
    assert m.outcome is Outcome.PASSED_THROUGH_ERROR and m.ended
    assert report.of("failed")[-1][3] is None  # no wait follows


def test_a_retryable_status_is_read_kept_and_retried_then_passed_through() -> None:
    m, report = make(max_attempts=2)
    m.start(0.0)
    assert m.answered(0.1, 503, sse=False, retry_after_s=None) == ReadErrorBody()
    assert m.error_body(0.2) == Wait(0.1)
    assert report.of("failed")[0][1:3] == ("503", Phase.HEADERS)
    m.next_attempt(0.3)
    assert m.answered(0.4, 529, sse=False) == ReadErrorBody()
    assert m.error_body(0.5) == GiveUp(GiveUpKind.PASS_THROUGH)


def test_retry_after_is_honoured() -> None:
    m, _ = make()
    m.start(0.0)
    m.answered(0.0, 429, sse=False, retry_after_s=3.0)
    assert m.error_body(0.0) == Wait(3.0)


@pytest.mark.parametrize("status", [100, 101, 103])
def test_a_1xx_answer_is_a_failed_attempt_not_a_response(status: int) -> None:
    m, report = make()
    m.start(0.0)
    assert m.answered(0.1, status, sse=False) == Wait(0.1)
    assert report.of("failed")[0][1:3] == (str(status), Phase.HEADERS)


def test_a_plain_answer_passes_through_and_its_first_byte_commits() -> None:
    m, _ = make(stream=False)
    m.start(0.0)
    assert m.answered(0.1, 200, sse=False) == PassThrough()
    assert m.feed_body(0.2, b'{"ok":') == Fed(b'{"ok":', None)
    assert m.transport_failed(0.3, RESET) == End(EndKind.ABORT)
    assert m.outcome is Outcome.ENDED_WITH_ERROR


def test_a_plain_answer_cut_before_its_first_byte_is_retried() -> None:
    m, _ = make(stream=False)
    m.start(0.0)
    m.answered(0.1, 200, sse=False)
    assert m.transport_failed(0.2, RESET) == Wait(0.1)


def test_a_final_answer_after_early_headers_is_an_in_stream_error() -> None:
    m, _ = make(early_headers_s=1.0)
    m.start(0.0)
    assert m.open_failed(0.5, REFUSED) == Wait(0.1)
    assert m.tick(1.0) == SendHeaders(200)
    m.next_attempt(1.1)
    assert m.answered(1.2, 400, sse=False) == FinalInStream()
    action = m.final_body(1.3, 400, b'{"error": {"type": "invalid_request_error"}}')
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert b"invalid_request_error" in action.data
    assert m.outcome is Outcome.PASSED_THROUGH_ERROR


def test_give_up_after_early_headers_is_the_native_error_in_the_stream() -> None:
    m, _ = make(early_headers_s=1.0, max_attempts=2)
    m.start(0.0)
    m.open_failed(0.5, REFUSED)
    m.tick(1.0)
    m.next_attempt(1.1)
    action = m.open_failed(1.2, REFUSED)
    assert isinstance(action, GiveUp) and action.kind is GiveUpKind.IN_STREAM
    assert b"server_error" in action.data
    assert m.outcome is Outcome.ENDED_WITH_ERROR


def test_a_responses_give_up_after_early_headers_is_dated_by_the_wall_clock_passed_in() -> None:
    """No response.created came: the failed response's id and created_at are made up
    from the Unix time the transport passes in (the core reads no clock)."""
    from unbroken.core.protocols import RESPONSES

    m = TurnMachine(
        protocol=RESPONSES,
        hold=Hold(),
        timers=Timers(early_headers_s=1.0),
        retry=RetryState(RetryPolicy(max_attempts=1), 1, rng=random.Random(0)),
        stream=True,
        now=0.0,
        report=Report(),
        wall_clock=lambda: 1_800_000_000.5,
    )
    m.start(0.0)
    assert m.tick(1.0) == SendHeaders(200)
    action = m.open_failed(1.2, REFUSED)
    assert isinstance(action, GiveUp) and action.kind is GiveUpKind.IN_STREAM
    failed = json.loads(action.data.split(b"event: response.failed\ndata: ")[1])
    assert failed["response"]["created_at"] == 1_800_000_000
    assert failed["response"]["id"] == "resp_unbroken_1800000000500"


# -- streams -------------------------------------------------------------------------------
def test_control_frames_are_held_then_released_with_the_first_output() -> None:
    m, _ = make()
    streaming(m)
    assert raw(m.feed_chunk(1.1, ROLE)) == b""
    assert raw(m.feed_chunk(1.2, TEXT)) == ROLE + TEXT
    fed = m.feed_chunk(1.3, FINISH + DONE)
    assert raw(fed) == FINISH + DONE
    assert fed.over is None
    assert m.body_ended(1.4) == End(EndKind.CLEAN)
    assert m.outcome is Outcome.OK


def test_a_clean_end_after_finish_reason_without_done_gets_done() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT + FINISH)
    assert m.body_ended(1.2) == End(EndKind.CLEAN, DONE)


def test_a_cut_after_the_terminal_frame_completes_the_ending_and_is_recorded() -> None:
    m, report = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT + FINISH)
    assert m.transport_failed(1.2, RESET) == End(EndKind.CLEAN, DONE)
    assert m.outcome is Outcome.OK
    assert ("failed", "connection_reset", Phase.TAIL, None) in report.calls
    assert ("ended", "connection_reset", Phase.TAIL) in report.calls


def test_a_cut_before_output_is_replayed_and_releases_nothing() -> None:
    m, report = make()
    streaming(m)
    assert raw(m.feed_chunk(1.1, ROLE)) == b""
    assert m.transport_failed(1.2, RESET) == Wait(0.1)
    assert report.of("failed")[0][2] is Phase.PENDING


def test_a_cut_after_output_ends_with_the_native_error() -> None:
    m, report = make()
    streaming(m)
    m.feed_chunk(1.1, ROLE + TEXT)
    action = m.transport_failed(1.2, RESET)
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert b"server_error" in action.data
    assert m.outcome is Outcome.ENDED_WITH_ERROR
    assert ("failed", "connection_reset", Phase.COMMITTED, None) in report.calls


def test_a_truncated_stream_never_ends_clean() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT)
    action = m.body_ended(1.2)
    assert isinstance(action, End) and action.kind is EndKind.ERROR and action.data


def test_a_retryable_in_stream_error_before_output_replays() -> None:
    m, _ = make()
    streaming(m)
    assert seen(m.feed_chunk(1.1, ROLE + RETRYABLE + TEXT)) == (b"", Wait(0.1))


def test_a_retryable_in_stream_error_after_output_releases_the_native_error() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT)
    fed = m.feed_chunk(1.2, RETRYABLE)
    assert b"server_error" in raw(fed)
    assert fed.over == End(EndKind.ERROR)


def test_frames_keep_their_boundaries() -> None:
    m, _ = make()
    streaming(m)
    released, _ = m.feed_chunk(1.1, ROLE + TEXT)
    assert [e.raw for e in released] == [ROLE, TEXT]
    m2, _ = make()
    streaming(m2)
    frames, _ = m2.feed_frame(1.1, Event(TEXT, None, TEXT[6:-2].decode()))
    assert [e.raw for e in frames] == [TEXT]


# -- deadlines -----------------------------------------------------------------------------
def test_early_headers_are_due_at_early_headers_s_while_retrying() -> None:
    m, report = make(early_headers_s=20.0, keepalive_s=15.0)
    m.start(0.0)
    m.open_failed(0.1, REFUSED)
    assert m.deadline() == 20.0
    assert m.tick(19.9) is None
    assert m.tick(20.0) == SendHeaders(200)
    assert report.of("headers") == [("headers",)]
    assert m.deadline() == 35.0  # the first keepalive, keepalive_s after the headers
    assert m.tick(34.9) is None
    assert m.tick(35.0) == Keepalive(KEEPALIVE)
    assert m.deadline() == 50.0


def test_min_interval_bounds_every_deadline_an_event_sets() -> None:
    # The watchdog's rule (relay.watchdog.Watchdog): armed no later than min_interval from
    # now, it is never late for a deadline a later event sets, because each deadline
    # counts from the event that sets it.
    m, _ = make(
        early_headers_s=20.0, keepalive_s=15.0, idle_timeout_s=8.0, first_frame_timeout_s=10.0
    )
    assert m.min_interval == 8.0
    assert isinstance(m.start(0.0), Open)
    assert m.deadline() == 20.0  # from the start
    assert isinstance(m.answered(9.0, 200, sse=True), Stream)
    assert m.deadline() == 19.0  # the first frame: from the answer, not the attempt's start
    m.feed_chunk(9.5, TEXT)  # output: headers go out, the stall clock is idle_timeout_s
    m.headers_sent(9.5)
    assert m.deadline() == 17.5  # the stall, from the last frame
    m.write_started(9.5)
    assert m.deadline() is None  # nothing runs while the relay writes
    m.wrote(12.0)
    assert m.deadline() == 20.0  # the stall, from the end of the write


def test_no_early_headers_for_a_non_streamed_turn() -> None:
    m, _ = make(stream=False)
    m.start(0.0)
    m.open_failed(0.1, REFUSED)
    assert m.deadline() is None
    assert m.tick(1000.0) is None


def test_the_first_keepalive_comes_keepalive_s_after_the_last_write() -> None:
    m, _ = make(early_headers_s=20.0, keepalive_s=15.0, idle_timeout_s=1000.0)
    streaming(m)
    m.feed_chunk(2.0, TEXT)
    m.headers_sent(2.0)
    m.write_started(2.0)
    m.wrote(2.0)
    assert m.deadline() == 17.0
    assert m.tick(17.0) == Keepalive(KEEPALIVE)


def test_an_idle_stall_after_the_first_frame_is_due_at_idle_timeout_s() -> None:
    m, report = make(idle_timeout_s=2.0, early_headers_s=20.0, keepalive_s=15.0)
    streaming(m, now=1.0)
    assert m.deadline() == 20.0  # early headers before the first-frame deadline (301)
    m.feed_chunk(3.0, ROLE)
    assert m.deadline() == 5.0  # idle_timeout_s after the last byte, not 20 or 301
    assert m.tick(5.0) == AbortUpstream(
        Failure(FailureClass.STALL, "stall: the upstream went silent past its timeout")
    )
    assert m.transport_failed(5.0, RESET) == Wait(0.1)
    assert report.of("failed")[0][1:3] == ("stall", Phase.STALL)


def test_a_comment_only_stream_trips_the_first_frame_timeout() -> None:
    m, _ = make(first_frame_timeout_s=5.0, idle_timeout_s=1.0, early_headers_s=100.0)
    streaming(m, now=1.0)
    for t in (2.0, 3.0, 4.0, 5.5):
        m.feed_chunk(t, b": ping\n\n")
        assert m.deadline() == 6.0  # comments are not a first frame
    assert isinstance(m.tick(6.0), AbortUpstream)
    assert m.body_ended(6.1) == Wait(0.1)


def test_time_blocked_writing_to_the_client_is_not_upstream_silence() -> None:
    m, _ = make(idle_timeout_s=2.0, early_headers_s=100.0, keepalive_s=100.0)
    streaming(m)
    m.feed_chunk(1.0, TEXT)
    m.write_started(1.0)
    assert m.tick(50.0) is None  # blocked on the client: no stall, no keepalive
    m.wrote(50.0)
    assert m.deadline() == 52.0
    assert isinstance(m.tick(52.0), AbortUpstream)


def _keepalives_until_the_stall(
    m: TurnMachine, write_s: float, limit: float = 1000.0
) -> tuple[float | None, int]:
    """Drive the clock from deadline to deadline, writing each keepalive (each write
    blocked ``write_s``), until the machine aborts the upstream: (when, keepalives)."""
    keepalives = 0
    while True:
        due = m.deadline()
        assert due is not None
        if due > limit:
            return None, keepalives
        action = m.tick(due)
        if isinstance(action, AbortUpstream):
            return due, keepalives
        if isinstance(action, Keepalive):
            keepalives += 1
            m.write_started(due)
            m.wrote(due + write_s)


def test_keepalive_writes_never_reset_the_stall_clock() -> None:
    # Issue 22: wrote() set the stall clock to now after every write, keepalives
    # included, so a stream that hung after output was never caught while the
    # relay's own keepalives flowed (Codex, 20 s idle: 200 s through the relay).
    m, report = make(idle_timeout_s=20.0, keepalive_s=5.0, early_headers_s=100.0)
    streaming(m, now=1.0)
    assert raw(m.feed_chunk(2.0, ROLE + TEXT))  # committed
    m.headers_sent(2.0)
    m.write_started(2.0)
    m.wrote(2.0)
    stalled_at, keepalives = _keepalives_until_the_stall(m, write_s=0.0)
    # keepalives at 7, 12 and 17; the stall at the last upstream byte + idle_timeout_s
    assert (stalled_at, keepalives) == (22.0, 3)
    action = m.transport_failed(22.0, RESET)
    assert isinstance(action, End) and action.kind is EndKind.ERROR
    assert report.of("failed") == [("failed", "stall", Phase.COMMITTED, None)]


def test_a_blocked_keepalive_write_pauses_the_stall_clock_by_its_blocked_time() -> None:
    m, _ = make(idle_timeout_s=20.0, keepalive_s=5.0, early_headers_s=100.0)
    streaming(m, now=1.0)
    m.feed_chunk(2.0, ROLE + TEXT)
    m.headers_sent(2.0)
    # each keepalive write blocks 1 s on a slow client (at 7, 13 and 19): the stall
    # clock stood still 3 s of the 23 s since the last upstream byte
    stalled_at, keepalives = _keepalives_until_the_stall(m, write_s=1.0)
    assert (stalled_at, keepalives) == (25.0, 3)


def test_the_first_frame_clock_pauses_while_a_write_blocks() -> None:
    m, _ = make(first_frame_timeout_s=10.0, idle_timeout_s=2.0, early_headers_s=1.0)
    m.start(0.0)
    assert m.tick(1.0) == SendHeaders(200)
    m.write_started(1.0)  # the early headers' first bytes, blocked on the client
    assert m.answered(2.0, 200, sse=True) == Stream()  # the answer comes meanwhile
    m.wrote(4.0)
    assert m.deadline() == 14.0  # the first-frame clock started at the write's end
    m.write_started(5.0)
    m.wrote(6.0)
    assert m.deadline() == 15.0
    m.feed_chunk(7.0, b": still thinking\n\n")  # a comment is no first frame
    assert m.deadline() == 15.0


def test_a_frame_during_a_blocked_write_counts_from_the_writes_end() -> None:
    m, _ = make(idle_timeout_s=2.0, early_headers_s=100.0, keepalive_s=1.0)
    streaming(m)
    m.feed_chunk(1.0, TEXT)
    m.headers_sent(1.0)
    assert m.tick(2.0) == Keepalive(KEEPALIVE)
    m.write_started(2.0)  # the keepalive blocks...
    m.feed_chunk(2.5, TEXT)  # ...while the upstream sends on
    m.write_started(2.5)  # and that output's write blocks too
    m.wrote(3.0)
    assert m.deadline() is None  # one write still blocked
    m.wrote(9.0)
    assert m.deadline() == 10.0  # keepalive_s after the last write; the stall is at 11
    assert m.tick(10.0) == Keepalive(KEEPALIVE)
    assert isinstance(m.tick(11.0), AbortUpstream)


def test_a_turn_completed_then_left_by_the_client_is_ok() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.0, TEXT + FINISH)
    assert m.client_gone() is Outcome.OK


def test_a_turn_left_mid_stream_is_aborted_by_the_client() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.0, TEXT)
    assert m.client_gone() is Outcome.ABORTED_BY_CLIENT


def test_a_crash_is_an_internal_error() -> None:
    m, _ = make()
    streaming(m)
    assert m.crashed() is Outcome.INTERNAL_ERROR


def test_illegal_events_raise_the_machines_own_error() -> None:
    m, _ = make()
    with pytest.raises(TurnError):
        m.answered(0.0, 200, sse=True)
    m, _ = make()
    m.start(0.0)
    with pytest.raises(TurnError):
        m.start(0.0)
    m, _ = make()
    m.start(0.0)
    with pytest.raises(TurnError):
        m.next_attempt(0.0)


# -- legality: the machine refuses an event its step does not accept (as h11 does) ---------
#: every event, with plausible arguments
EVENTS: dict[str, Callable[[TurnMachine, float], object]] = {
    "start": lambda m, t: m.start(t),
    "next_attempt": lambda m, t: m.next_attempt(t),
    "open_failed": lambda m, t: m.open_failed(t, REFUSED),
    "answered": lambda m, t: m.answered(t, 200, sse=True),
    "error_body": lambda m, t: m.error_body(t, b""),
    "final_body": lambda m, t: m.final_body(t, 400, b"{}"),
    "feed_chunk": lambda m, t: m.feed_chunk(t, TEXT),
    "feed_verbatim": lambda m, t: m.feed_verbatim(t, TEXT),
    "feed_frame": lambda m, t: m.feed_frame(t, Event(TEXT, None, TEXT[6:-2].decode())),
    "feed_body": lambda m, t: m.feed_body(t, b"{}"),
    "body_ended": lambda m, t: m.body_ended(t),
    "transport_failed": lambda m, t: m.transport_failed(t, RESET),
}
#: the write notifications: legal in every step but ERROR
WRITES: dict[str, Callable[[TurnMachine, float], object]] = {
    "headers_sent": lambda m, t: m.headers_sent(t),
    "write_started": lambda m, t: m.write_started(t),
    "wrote": lambda m, t: m.wrote(t),
}
#: the header's legality table, as data: the events each step accepts
LEGAL: dict[str, frozenset[str]] = {
    "new": frozenset({"start"}),
    "idle": frozenset({"next_attempt"}),
    "connecting": frozenset({"open_failed", "answered", "transport_failed"}),
    "stream": frozenset(
        {"feed_chunk", "feed_verbatim", "feed_frame", "body_ended", "transport_failed"}
    ),
    "pass_through": frozenset({"feed_body", "body_ended", "transport_failed"}),
    "error_body": frozenset({"error_body", "transport_failed"}),
    "final_body": frozenset({"final_body", "transport_failed"}),
    "ended": frozenset(),
}


def _in_step(step: str) -> TurnMachine:
    """A machine brought to ``step`` by legal events."""
    m, _ = make(stream=step != "pass_through", early_headers_s=1.0)
    if step == "new":
        return m
    assert isinstance(m.start(0.0), Open)
    if step == "connecting":
        return m
    if step in ("idle", "final_body"):
        assert m.open_failed(0.5, REFUSED) == Wait(0.1)
        if step == "idle":
            return m
        assert m.tick(1.0) == SendHeaders(200)
        assert isinstance(m.next_attempt(1.1), Open)
        assert m.answered(1.2, 400, sse=False) == FinalInStream()
        return m
    if step == "error_body":
        assert m.answered(0.1, 503, sse=False) == ReadErrorBody()
        return m
    if step == "pass_through":
        assert m.answered(0.1, 200, sse=False) == PassThrough()
        return m
    assert m.answered(0.1, 200, sse=True) == Stream()
    if step == "ended":
        m.feed_chunk(0.2, TEXT + FINISH + DONE)
        assert m.body_ended(0.3) == End(EndKind.CLEAN)
    return m


def _assert_refused(m: TurnMachine, event: str, now: float) -> None:
    """``event`` raises, and leaves the machine refusing everything but the end from
    outside: nothing is released, and the ledger is as it was."""
    ledger = m.ledger
    before = (ledger.state, ledger.released_frames) if ledger is not None else None
    headers = m.headers_out
    with pytest.raises(TurnError):
        (EVENTS | WRITES)[event](m, now)
    for call in (EVENTS | WRITES).values():
        with pytest.raises(TurnError):
            call(m, now)
    assert m.deadline() is None and m.tick(now + 10_000.0) is None
    after = (ledger.state, ledger.released_frames) if ledger is not None else None
    assert after == before and m.headers_out == headers
    assert not m.ended
    assert m.crashed() is Outcome.INTERNAL_ERROR and m.ended  # the transport cleans up


ILLEGAL = [(step, e) for step, legal in LEGAL.items() for e in EVENTS if e not in legal]
LEGAL_CASES = [(step, e) for step, legal in LEGAL.items() for e in sorted(legal)]


@pytest.mark.parametrize(("step", "event"), ILLEGAL)
def test_an_event_illegal_in_its_step_raises_and_the_machine_refuses_all_after(
    step: str, event: str
) -> None:
    m = _in_step(step)
    assert m.step.value == step
    _assert_refused(m, event, 5.0)


@pytest.mark.parametrize(("step", "event"), LEGAL_CASES)
def test_an_event_legal_in_its_step_is_accepted(step: str, event: str) -> None:
    m = _in_step(step)
    EVENTS[event](m, 5.0)
    assert m.step.value != "error"


@pytest.mark.parametrize("step", list(LEGAL))
def test_the_write_notifications_are_legal_in_every_step_but_error(step: str) -> None:
    m = _in_step(step)
    m.headers_sent(5.0)
    m.write_started(5.0)
    m.wrote(5.1)
    assert m.step.value == step


def test_wrote_without_a_write_started_is_illegal() -> None:
    m, _ = make()
    streaming(m)
    _assert_refused(m, "wrote", 2.0)


def test_the_end_from_outside_works_after_an_illegal_event() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT)
    with pytest.raises(TurnError):
        m.feed_body(1.2, b"x")
    assert m.client_gone() is Outcome.ABORTED_BY_CLIENT and m.ended


@pytest.mark.parametrize("feed", ["feed_chunk", "feed_verbatim", "feed_frame"])
def test_a_late_chunk_after_a_failed_attempts_wait_raises_and_releases_nothing(
    feed: str,
) -> None:
    # Found in review (issue 22): after transport_failed -> Wait, a late chunk of the
    # dead attempt was released, committing the ledger: its bytes would have reached
    # the client ahead of the replay's.
    m, report = make()
    streaming(m)
    assert raw(m.feed_chunk(1.1, ROLE)) == b""  # held
    assert m.transport_failed(1.2, RESET) == Wait(0.1)
    _assert_refused(m, feed, 1.3)
    assert m.ledger is not None and m.ledger.state is LedgerState.PENDING
    assert m.ledger.released_frames == 0 and not report.of("headers")


@pytest.mark.parametrize("feed", ["feed_chunk", "feed_verbatim", "feed_frame"])
def test_a_chunk_after_end_raises(feed: str) -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.1, TEXT + FINISH + DONE)
    assert m.body_ended(1.2) == End(EndKind.CLEAN)
    _assert_refused(m, feed, 1.3)


def test_a_feed_after_the_frame_that_ended_the_attempt_raises_even_unasked() -> None:
    # The frame that ends an attempt decides it at once: a transport that feeds on
    # without carrying out the feed's ``over`` gets an error, not the dead attempt's
    # frames released (this TEXT would have committed the ledger).
    m, _ = make()
    streaming(m)
    assert seen(m.feed_chunk(1.1, ROLE + RETRYABLE)) == (b"", Wait(0.1))
    _assert_refused(m, "feed_chunk", 1.2)
    assert m.ledger is not None and m.ledger.state is LedgerState.PENDING


def test_a_replay_decided_by_a_frame_does_not_end_the_next_attempt() -> None:
    # Found with the legality checks: a replay decided by a frame, followed at once by
    # the next attempt (no wait: testing mode, or a zero delay), left its decision
    # behind, so the next attempt's first feed "ended" it again with the old Open
    # (over real sockets, the turn then crashed with a 500).
    m, _ = make(upstreams=2)
    streaming(m)
    with set_testing(True):
        assert seen(m.feed_chunk(1.1, ROLE + RETRYABLE)) == (b"", Open(1, 120.0))
        assert m.answered(1.2, 200, sse=True) == Stream()
        fed = m.feed_chunk(1.3, ROLE + TEXT)
        assert raw(fed) == ROLE + TEXT
        assert fed.over is None
        assert raw(m.feed_chunk(1.4, FINISH + DONE)) == FINISH + DONE
        assert m.body_ended(1.5) == End(EndKind.CLEAN)
    assert m.outcome is Outcome.RECOVERED


def test_ended_machine_has_no_deadline() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.0, TEXT + FINISH + DONE)
    m.body_ended(1.1)
    assert m.deadline() is None and m.tick(10_000.0) is None


# -- the four invariants, over random event sequences -------------------------------------
def _frame(tag: str, kind: str) -> bytes:
    if kind == "role":
        return chunk({"role": "assistant"}, id_=tag)
    if kind == "text":
        return chunk({"content": tag})
    if kind == "finish":
        return chunk({"content": tag}, "stop")
    if kind == "error":
        return RETRYABLE
    if kind == "comment":
        return f": {tag}\n\n".encode()
    return b"data: {broken " + tag.encode() + b"\n\n"


KINDS = st.sampled_from(["role", "text", "text", "finish", "error", "comment", "malformed"])
ENDINGS = st.sampled_from(["eof", "reset", "stall"])
ATTEMPT = st.tuples(st.lists(KINDS, max_size=6), ENDINGS, st.integers(1, 3))


#: an illegal event: after how many events, and which (the first illegal one from it on,
#: in `EVENTS`' order)
ILLEGAL_EVENT = st.none() | st.tuples(st.integers(0, 30), st.sampled_from(sorted(EVENTS)))


@settings(max_examples=400, deadline=None)
@given(st.lists(ATTEMPT, min_size=1, max_size=8), st.booleans(), ILLEGAL_EVENT)
def test_random_event_sequences_keep_the_four_invariants(
    attempts: list[tuple[list[str], str, int]], early: bool, illegal: tuple[int, str] | None
) -> None:
    m, _ = make(max_attempts=6, early_headers_s=0.5 if early else 1000.0)
    now = 0.0
    client = bytearray()
    released_frames: list[bytes] = []
    events = 0
    was_refused = False
    ended_as: Outcome | None = None  # the outcome when the illegal event came

    def refused() -> bool:
        """At the chosen point, an event illegal in the machine's step (a late chunk
        after a replay decision or an End, a feed before the answer, ...): it raises,
        and nothing is released after it."""
        nonlocal events, was_refused, ended_as
        events += 1
        if illegal is None or events != illegal[0] + 1:
            return False
        names = list(EVENTS)
        first = names.index(illegal[1])
        legal = LEGAL[m.step.value]
        name = next(n for n in names[first:] + names[:first] if n not in legal)
        was_refused, ended_as = True, m.outcome
        _assert_refused(m, name, now)
        return True

    action: Any = m.start(now)
    steps = 0
    attempt_no = 0
    while not isinstance(action, (End, GiveUp)):
        if refused():
            break
        steps += 1
        assert steps < 100, "the turn never ends"
        now += 1.0
        if isinstance(action, Wait):
            timer = m.tick(now)
            if isinstance(timer, SendHeaders):
                client += b""  # headers carry nothing a client can act on
            action = m.next_attempt(now)
            continue
        assert isinstance(action, Open)
        kinds, ending, chunks = attempts[attempt_no % len(attempts)]
        tag = f"a{attempt_no}"
        attempt_no += 1
        action = m.answered(now, 200, sse=True)
        assert isinstance(action, Stream)
        body = b"".join(_frame(f"{tag}f{i}", k) for i, k in enumerate(kinds))
        over = None
        before = len(client)
        step = max(1, len(body) // chunks)
        for i in range(0, len(body), step):
            if refused():
                break
            out, over = m.feed_chunk(now, body[i : i + step])
            released_frames += [e.raw for e in out]
            client += raw(out)
            if over is not None:
                break
        if was_refused:
            break  # mid-body
        if refused():  # the attempt may be over: a late event of it
            break
        if over is None:
            if ending == "eof":
                over = m.body_ended(now)
            else:
                if ending == "stall":
                    m.tick(now + 10_000.0)
                over = m.transport_failed(now, RESET)
        if isinstance(over, (Wait, Open)):
            # 1. nothing is released after (or by) an attempt that was replayed
            assert len(client) == before
        if isinstance(over, (End, GiveUp)) and over.data:
            client += over.data
        action = over
    else:
        refused()  # after the end: a late event of the ended turn
    # A turn refused mid-way (ended_as None) ends as an internal error: the transport
    # aborts the client connection, which no client takes for a clean end.
    outcome = ended_as if was_refused else m.outcome
    frames = SSESplitter().feed(bytes(client))
    finished = any(e.data and '"finish_reason": "stop"' in e.data for e in frames)
    # 2. a truncated turn never ends cleanly
    if isinstance(action, End) and action.kind is EndKind.CLEAN and outcome is not None:
        if outcome.is_ok:
            assert finished
    if not finished and client and outcome is not None:
        assert b"server_error" in client or outcome is Outcome.PASSED_THROUGH_ERROR
    # 3. no frame is released twice
    data_frames = [f for f in released_frames if f.startswith(b'data: {"id"')]
    assert len(data_frames) == len(set(data_frames))
    # 4. every turn ends, with an outcome
    assert m.ended and m.outcome is not None


def test_an_oversized_event_fails_the_attempt_and_is_replayed_before_output() -> None:
    m, report = make(max_event_bytes=1024)
    streaming(m)
    fed = m.feed_chunk(1.0, ROLE + b"data: " + b"x" * 2000)
    assert raw(fed) == b"" and fed.over == Wait(0.1)
    assert report.of("failed")[0][1] == "malformed"


def test_an_oversized_event_after_output_ends_with_the_native_error() -> None:
    m, _ = make(max_event_bytes=1024)
    streaming(m)
    fed = m.feed_chunk(1.0, TEXT + b"data: " + b"x" * 2000)
    assert raw(fed) == TEXT
    over = fed.over
    assert isinstance(over, End) and over.kind is EndKind.ERROR and b"server_error" in over.data


def test_testing_mode_switches_waits_off_but_still_reports_them() -> None:
    m, report = make(delay_ms=30_000)
    m.start(0.0)
    with set_testing(True):
        assert m.open_failed(0.1, REFUSED) == Open(0, 120.0)  # no Wait: straight on
    assert report.of("failed")[0][3] == 30.0  # the wait that would have been


def test_set_testing_is_a_restoring_context_manager() -> None:
    """As stamina's: it takes effect at once, and a ``with`` puts the previous mode
    back, also when nested and when the block raises."""

    def waits() -> bool:
        m, _ = make(delay_ms=30_000)
        m.start(0.0)
        return isinstance(m.open_failed(0.1, REFUSED), Wait)

    assert waits()
    with set_testing(True):
        assert not waits()
        with set_testing(False):
            assert waits()
        assert not waits()  # the outer mode is back, not "off"
        with pytest.raises(ZeroDivisionError), set_testing(False):
            1 / 0  # noqa: B018
        assert not waits()
    assert waits()
    set_testing(True)  # a plain call still switches it, for good
    try:
        assert not waits()
    finally:
        set_testing(False)
