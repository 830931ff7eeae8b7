"""`TurnMachine.socket_answered`: a socket took the request (no status line); the
machine, not the transport, says that is a 200 stream."""

from __future__ import annotations

import pytest

from turnfix import FINISH, ROLE, TEXT, make, raw
from unbroken.core.turn.machine import End, EndKind, Open, Outcome, Stream, TurnError


def test_a_socket_that_took_the_request_streams_as_a_200_sse_answer() -> None:
    by_socket, heard = make()
    by_status, told = make()
    for m in (by_socket, by_status):
        assert isinstance(m.start(0.0), Open)
    assert isinstance(by_socket.socket_answered(1.0), Stream)
    assert isinstance(by_status.answered(1.0, 200, sse=True), Stream)
    assert heard.calls == told.calls  # the same answer, reported the same way
    for m in (by_socket, by_status):
        assert raw(m.feed_chunk(1.1, ROLE)) == b""  # held, as on any stream
        assert raw(m.feed_chunk(1.2, TEXT + FINISH)) == ROLE + TEXT + FINISH
        assert m.body_ended(1.3) == End(EndKind.CLEAN, b"data: [DONE]\n\n")
        assert m.outcome is Outcome.OK


def test_a_socket_answer_is_legal_only_where_an_answer_is() -> None:
    early, _ = make()
    with pytest.raises(TurnError):
        early.socket_answered(0.5)  # no attempt is open
    m, _ = make()
    assert isinstance(m.start(0.0), Open)
    assert isinstance(m.socket_answered(1.0), Stream)
    with pytest.raises(TurnError):
        m.socket_answered(1.1)  # answered already
