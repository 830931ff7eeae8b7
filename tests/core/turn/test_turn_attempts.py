"""The turn machine's attempts: opening, waiting, retrying, giving up (fake clock, no sockets).

What a refused or failed open, a retryable status, ``Retry-After``, a ``1xx`` or a
plain (non-streamed) answer lead to; how a give-up reads before and after early
headers; and the testing mode that switches the waits off.  The machine and its
frames come from `turnfix`.
"""

from __future__ import annotations

import json
import random

import pytest

from turnfix import REFUSED, RESET, Report, Timers, make
from unbroken.core.admission.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import (
    End,
    EndKind,
    Fed,
    FinalInStream,
    GiveUp,
    GiveUpKind,
    Open,
    Outcome,
    PassThrough,
    Phase,
    ReadErrorBody,
    SendHeaders,
    TurnMachine,
    Wait,
    set_testing,
)


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
    from unbroken.core.wire.protocols import RESPONSES

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
