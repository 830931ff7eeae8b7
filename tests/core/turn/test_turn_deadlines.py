"""The turn machine's deadlines: early headers, keepalives, stalls, and blocked writes.

When each timer is due, that time spent blocked writing to the client is not upstream
silence, and that an ended machine has no deadline.  The machine and its frames come
from `turnfix`.
"""

from __future__ import annotations

from turnfix import DONE, FINISH, REFUSED, RESET, ROLE, TEXT, make, raw, streaming
from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.turn.machine import (
    KEEPALIVE,
    AbortUpstream,
    End,
    EndKind,
    Keepalive,
    Open,
    Phase,
    SendHeaders,
    Stream,
    TurnMachine,
    Wait,
)


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


def test_ended_machine_has_no_deadline() -> None:
    m, _ = make()
    streaming(m)
    m.feed_chunk(1.0, TEXT + FINISH + DONE)
    m.body_ended(1.1)
    assert m.deadline() is None and m.tick(10_000.0) is None
