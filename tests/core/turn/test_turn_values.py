"""The machine's actions and the splitter's events are values: msgspec Structs (a C
``__init__``), with what the frozen dataclasses they were gave their users."""

from __future__ import annotations

import pytest

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.turn.turn_types import (
    AbortUpstream,
    End,
    EndKind,
    FinalInStream,
    GiveUp,
    GiveUpKind,
    Keepalive,
    Open,
    PassThrough,
    ReadErrorBody,
    SendHeaders,
    Stream,
    Wait,
)
from unbroken.core.wire.sse import Event


def test_actions_are_frozen_values_with_defaults_equality_and_hash() -> None:
    assert End(EndKind.CLEAN) == End(EndKind.CLEAN, b"") == End(kind=EndKind.CLEAN)
    other: object = GiveUp(GiveUpKind.IN_STREAM)
    assert End(EndKind.CLEAN) != End(EndKind.ERROR) and End(EndKind.CLEAN) != other
    assert hash(Open(1, 2.0)) == hash(Open(1, 2.0, ()))
    assert Wait(1.5) == Wait(1.5, None, 0) and Stream() == Stream()
    assert repr(End(EndKind.ABORT)) == "End(kind=<EndKind.ABORT: 'abort'>, data=b'')"
    failure = Failure(FailureClass.STATUS, "503", 503)
    for action in (
        Open(0, 1.0, (("k", {"v": [1]}),)),
        Wait(1.0, "key", 2),
        Stream(),
        PassThrough(),
        ReadErrorBody(),
        FinalInStream(),
        SendHeaders(200),
        Keepalive(b": k\n\n"),
        AbortUpstream(failure),
        End(EndKind.CLEAN, b"x"),
        GiveUp(GiveUpKind.BAD_GATEWAY, b"{}"),
    ):
        field = next(iter(type(action).__struct_fields__), "x")
        with pytest.raises(AttributeError):
            setattr(action, field, None)


def _name(action: object) -> str:
    match action:
        case Open(upstream=upstream):
            return f"open {upstream}"
        case End(EndKind.ERROR, data):
            return f"error {data!r}"
        case End():
            return "end"
        case Stream() | PassThrough():
            return "read"
    return "other"


def test_actions_match_class_patterns_by_keyword_and_position() -> None:
    assert _name(Open(3, 1.0)) == "open 3"
    assert _name(End(EndKind.ERROR, b"e")) == "error b'e'"
    assert _name(End(EndKind.CLEAN)) == "end"
    assert _name(Stream()) == _name(PassThrough()) == "read"
    assert _name(Wait(1.0)) == "other"


def test_an_event_compares_and_shows_its_fields() -> None:
    event = Event(b"data: x\n\n", None, "x")
    assert event == Event(raw=b"data: x\n\n", name=None, data="x")
    assert event != Event(b"data: x\n\n", "message", "x")
    assert repr(event) == "Event(raw=b'data: x\\n\\n', name=None, data='x')"
    assert not event.is_comment and Event(b": c\n\n", None, None).is_comment
