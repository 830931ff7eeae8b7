"""The WebSocket session's decisions (`core.turn.ws_session`), with plain values."""

from __future__ import annotations

import json
from typing import Any

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.turn.ws_session import (
    WS_LIMIT_CODE,
    Fallback,
    History,
    SessionResponses,
    handshake_failure,
    is_warmup,
    refusal_is_verdict,
    warmup_messages,
)


def _resp(rid: str, text: str) -> dict[str, Any]:
    return {"id": rid, "output": [{"type": "message", "content": [{"text": text}]}]}


def test_history_rebuilds_a_chain_only_off_its_socket() -> None:
    h = History()
    h.record({"input": "a"}, _resp("r1", "A"), socket=1)
    h.record(
        {"input": [{"role": "user", "content": "b"}], "previous_response_id": "r1"},
        _resp("r2", "B"),
        socket=1,
    )
    nxt = {"type": "response.create", "input": "c", "previous_response_id": "r2", "store": False}
    assert h.request_for(nxt, socket=1) is nxt  # same socket: it still holds the state
    rebuilt = h.request_for(nxt, socket=2)
    assert "previous_response_id" not in rebuilt and rebuilt["store"] is False
    assert rebuilt["input"] == [
        {"role": "user", "content": "a"},
        *_resp("r1", "A")["output"],
        {"role": "user", "content": "b"},
        *_resp("r2", "B")["output"],
        {"role": "user", "content": "c"},
    ]
    assert h.request_for(nxt, socket=None) == rebuilt  # HTTP fallback: always self-contained
    unknown = {"input": "x", "previous_response_id": "elsewhere"}
    assert h.request_for(unknown, socket=2) is unknown


def test_history_is_bounded() -> None:
    h = History(limit=3)
    for i in range(5):
        prev = {"previous_response_id": f"r{i - 1}"} if i else {}
        h.record({"input": str(i), **prev}, _resp(f"r{i}", str(i)), socket=1)
    assert list(h.turns) == ["r2", "r3", "r4"]
    # the chain behind r4 is incomplete now: send as the client wrote it
    req = {"input": "z", "previous_response_id": "r4"}
    assert h.request_for(req, socket=2) is req


def _event(etype: str, rid: str) -> str:
    return json.dumps({"type": etype, "response": {"id": rid, "output": []}})


def test_late_events_of_a_finished_response_are_not_the_turns() -> None:
    session = SessionResponses()
    first = session.turn({"input": "a"})
    first.over_socket(1)
    created = _event("response.created", "r1")
    assert not first.is_other(created, created.encode())
    assert first.response_id == "r1"
    first.ended()
    turn = session.turn({"input": "b"})
    turn.over_socket(1)
    late = _event("response.cancelled", "r1")
    assert turn.is_other(late, late.encode())  # r1 ended on this connection
    assert turn.response_id is None
    delta = '{"type":"response.output_text.delta","delta":"x"}'
    assert not turn.is_other(delta, delta.encode())  # names no response
    # The turn's own response is the one its first response.created names, even if
    # the upstream reuses an id that ended before.
    again = _event("response.created", "r1")
    assert not turn.is_other(again, again.encode())
    other = _event("response.completed", "r9")
    assert turn.is_other(other, other.encode())


def test_a_replay_closes_the_failed_attempts_response() -> None:
    session = SessionResponses()
    turn = session.turn({"input": "a"})
    turn.over_socket(1)
    created = _event("response.created", "r1")
    turn.is_other(created, created.encode())
    turn.over_socket(2)  # the replay
    assert turn.response_id is None and "r1" in session.finished
    late = _event("response.in_progress", "r1")
    assert turn.is_other(late, late.encode())


def test_a_completed_response_is_recorded_with_its_socket() -> None:
    session = SessionResponses()
    turn = session.turn({"input": "a"})
    turn.over_socket(3)
    done = json.dumps(
        {"type": "response.completed", "response": {"id": "r1", "output": [{"x": 1}]}}
    )
    turn.released(["", '{"type":"response.output_text.delta"}', done])
    assert turn.completed and turn.response_id == "r1"
    assert session.history.where == {"r1": 3}
    nxt = {"input": "b", "previous_response_id": "r1"}
    assert turn.session.history.request_for(nxt, 3) is nxt
    http = session.turn(nxt)
    assert http.over_http()["input"] == [
        {"role": "user", "content": "a"},
        {"x": 1},
        {"role": "user", "content": "b"},
    ]


def test_the_fallback_starts_on_a_refusal_or_the_connection_limit() -> None:
    fallback = Fallback(cooldown_s=60.0)
    assert not fallback.active(0.0) and not fallback.over_http(0.0, body_patch=False)
    assert fallback.over_http(0.0, body_patch=True)  # background mode: HTTP only
    limit = json.dumps({"type": "error", "error": {"code": WS_LIMIT_CODE}})
    # the limit answered as the turn ends (a clean end): no fallback
    assert not fallback.after_attempt(10.0, limit, turn_ended=True)
    assert not fallback.after_attempt(10.0, '{"type":"error"}', turn_ended=False)
    assert not fallback.active(10.0)
    assert fallback.after_attempt(10.0, limit, turn_ended=False)
    assert fallback.active(69.9) and not fallback.active(70.0)
    fallback.start(100.0)  # a refused upgrade
    assert fallback.over_http(159.0, body_patch=False)
    assert not fallback.over_http(160.0, body_patch=False)


def test_a_handshake_with_no_answer_in_time_is_a_header_timeout() -> None:
    reset = Failure(FailureClass.RESET, "connection reset")
    assert handshake_failure(reset, timed_out=False) is reset
    timed = handshake_failure(reset, timed_out=True)
    assert timed.cls is FailureClass.HEADER_TIMEOUT


def test_one_transient_refusal_is_no_verdict() -> None:
    """Issue 33: a 503 on the upgrade is a failed attempt; three in a row, or one
    verdict (404, 426, a 200 without the upgrade), start the fallback."""
    fallback = Fallback(cooldown_s=60.0)
    assert not fallback.refused(0.0, 503) and not fallback.active(0.0)
    fallback.opened()  # a socket opened: the count starts again
    assert not fallback.refused(1.0, 503) and not fallback.refused(1.0, 429)
    assert fallback.refused(1.0, 502) and fallback.active(2.0)
    fallback = Fallback(cooldown_s=60.0)
    assert fallback.refused(0.0, 426) and fallback.active(1.0)
    for status in (404, 405, 400, 200, 501):
        assert refusal_is_verdict(status)
    for status in (408, 429, 500, 502, 503, 504):
        assert not refusal_is_verdict(status)


def test_warmup_answer_names_one_response_with_no_output() -> None:
    create = {"type": "response.create", "model": "m", "input": "hi", "generate": False}
    assert is_warmup(create) and not is_warmup({**create, "generate": True})
    assert not is_warmup({"type": "response.create", "model": "m"})
    created, completed = (json.loads(m) for m in warmup_messages(create, "resp_x", 7))
    assert created["type"] == "response.created"
    assert created["response"]["id"] == completed["response"]["id"] == "resp_x"
    assert completed["type"] == "response.completed"
    assert completed["response"]["status"] == "completed"
    assert completed["response"]["output"] == []
    assert completed["response"]["usage"]["total_tokens"] == 0
    # recorded, the warm-up is what the next turn chaining from it is rebuilt from
    session = SessionResponses()
    session.history.record(create, completed["response"], None)
    nxt = {"type": "response.create", "model": "m", "input": [], "previous_response_id": "resp_x"}
    rebuilt = session.history.request_for(nxt, None)
    assert "previous_response_id" not in rebuilt
    assert rebuilt["input"] == [{"role": "user", "content": "hi"}]
