"""A turn's records are msgspec Structs (a C ``__init__``) with the semantics of the
dataclasses they were: defaults, fresh ids and lists, a `TurnRecord` equal only to
itself (a member of the relay's set of turns in flight), an `AttemptInfo` a value."""

from __future__ import annotations

import time

from unbroken.observe.hooks import AttemptInfo, TurnRecord


def test_a_turn_record_is_itself_only_and_gets_fresh_defaults() -> None:
    before = time.time()
    a = TurnRecord("r", "v1/chat/completions", "chat", True)
    b = TurnRecord("r", "v1/chat/completions", "chat", True)
    assert a != b and a == a and len({a, b}) == 2 and {a: 1}[a] == 1
    assert b.id == a.id + 1 and before <= a.started <= time.time()
    assert a.attempt_log == [] and a.attempt_log is not b.attempt_log
    assert (a.session_id, a.client, a.state, a.outcome, a.held) == (None, "", "waiting", None, None)
    a.outcome, a.ended = "ok", 1.0  # mutable, as the reporter updates it
    assert (a.outcome, a.ended) == ("ok", 1.0)
    c = TurnRecord(route="r", path="p", protocol="chat", stream=False, session_id="s")
    assert (c.route, c.stream, c.session_id) == ("r", False, "s")


def test_an_attempt_info_is_a_value_with_the_same_defaults() -> None:
    a = AttemptInfo(1, "u", 5.0)
    assert a == AttemptInfo(number=1, upstream="u", started=5.0)
    assert a != AttemptInfo(2, "u", 5.0)
    assert (a.ended, a.status, a.reason, a.phase, a.choice, a.wait_s) == (
        None,
        None,
        "",
        "",
        "",
        None,
    )
    assert abs(AttemptInfo(1, "u").started - time.time()) < 60
