"""The turn machine on a streamed answer: what it releases, replays, and how the turn ends.

Held control frames, cuts and in-stream errors before and after output, frame
boundaries, oversized events, and the ends from outside (the client leaves, a
crash).  The machine and its frames come from `turnfix`.
"""

from __future__ import annotations

from turnfix import DONE, FINISH, RESET, RETRYABLE, ROLE, TEXT, make, raw, seen, streaming
from unbroken.core.turn.machine import End, EndKind, Outcome, Phase, Wait
from unbroken.core.wire.sse import Event


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
