"""OpenAI Responses classifier: table tests over real-shaped event sequences."""

from __future__ import annotations

import json
from typing import Any

import pytest

from unbroken.core.turn.ledger import Ledger
from unbroken.core.wire.protocols import RESPONSES, Kind, kind_names
from unbroken.core.wire.protocols.responses import (
    CLIENT_TOOL_ITEMS,
    ResponsesClassifier,
    error_frame,
    next_sequence_number,
)
from unbroken.core.wire.sse import Event, SSESplitter

C, OUT, R = Kind.CONTROL, Kind.OUTPUT, Kind.REASONING
TS, TD, TE = Kind.TOOL_START, Kind.TOOL_DELTA, Kind.TOOL_END
OK, ERR, RETRY = Kind.TERMINAL_OK, Kind.TERMINAL_ERROR, Kind.RETRYABLE
UNK, BAD = Kind.UNKNOWN, Kind.MALFORMED


def parse(raw: bytes) -> list[Event]:
    splitter = SSESplitter()
    events = splitter.feed(raw)
    assert splitter.pending == b""
    return events


class Stream:
    """Builds real-shaped Responses SSE events with increasing sequence numbers."""

    def __init__(self) -> None:
        self.seq = 0

    def ev(self, name: str, **fields: Any) -> Event:
        payload = {"type": name, "sequence_number": self.seq, **fields}
        self.seq += 1
        (event,) = parse(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
        return event


def response_obj(status: str = "in_progress", **extra: Any) -> dict[str, Any]:
    return {
        "id": "resp_abc123",
        "object": "response",
        "created_at": 1_700_000_000,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "model": "gpt-5",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": None,
        **extra,
    }


def message_item(status: str = "in_progress", text: str | None = None) -> dict[str, Any]:
    content = (
        []
        if text is None
        else [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}]
    )
    return {
        "id": "msg_1",
        "type": "message",
        "status": status,
        "content": content,
        "role": "assistant",
    }


def fc_item(n: int, status: str = "in_progress", args: str = "") -> dict[str, Any]:
    return {
        "id": f"fc_{n}",
        "type": "function_call",
        "status": status,
        "arguments": args,
        "call_id": f"call_{n}",
        "name": "shell",
    }


def classify_all(events: list[Event]) -> list[tuple[str, int]]:
    clf = ResponsesClassifier()
    return [(kind_names(k), n) for k, n in (clf.classify(e) for e in events)]


def assert_table(rows: list[tuple[Event, int, int]]) -> None:
    assert classify_all([r[0] for r in rows]) == [(kind_names(k), n) for _, k, n in rows]


def test_text_stream() -> None:
    s = Stream()
    assert_table(
        [
            (s.ev("response.created", response=response_obj()), C, 0),
            (s.ev("response.in_progress", response=response_obj()), C, 0),
            (s.ev("response.output_item.added", output_index=0, item=message_item()), C, 0),
            (
                s.ev(
                    "response.content_part.added",
                    item_id="msg_1",
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "annotations": [], "text": ""},
                ),
                C,
                0,
            ),
            (
                s.ev(
                    "response.output_text.delta",
                    item_id="msg_1",
                    output_index=0,
                    content_index=0,
                    delta="Hel",
                    logprobs=[],
                ),
                OUT,
                0,
            ),
            (
                s.ev(
                    "response.output_text.delta",
                    item_id="msg_1",
                    output_index=0,
                    content_index=0,
                    delta="lo",
                    logprobs=[],
                ),
                OUT,
                0,
            ),
            (
                s.ev(
                    "response.output_text.done",
                    item_id="msg_1",
                    output_index=0,
                    content_index=0,
                    text="Hello",
                    logprobs=[],
                ),
                OUT,
                0,
            ),
            (
                s.ev(
                    "response.content_part.done",
                    item_id="msg_1",
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "annotations": [], "text": "Hello"},
                ),
                OUT,
                0,
            ),
            (
                s.ev(
                    "response.output_item.done",
                    output_index=0,
                    item=message_item("completed", "Hello"),
                ),
                OUT,
                0,
            ),
            (s.ev("response.completed", response=response_obj("completed")), OK, 0),
        ]
    )


def test_reasoning_summary_stream() -> None:
    s = Stream()
    rs = {"id": "rs_1", "type": "reasoning", "summary": []}
    rows = [
        (s.ev("response.created", response=response_obj()), C, 0),
        (s.ev("response.output_item.added", output_index=0, item=rs), C, 0),
        (
            s.ev(
                "response.reasoning_summary_part.added",
                item_id="rs_1",
                output_index=0,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            ),
            C,
            0,
        ),
        (
            s.ev(
                "response.reasoning_summary_text.delta",
                item_id="rs_1",
                output_index=0,
                summary_index=0,
                delta="**Plan**",
            ),
            R,
            0,
        ),
        (
            s.ev(
                "response.reasoning_summary_text.done",
                item_id="rs_1",
                output_index=0,
                summary_index=0,
                text="**Plan**",
            ),
            R,
            0,
        ),
        (
            s.ev(
                "response.reasoning_summary_part.done",
                item_id="rs_1",
                output_index=0,
                summary_index=0,
                part={"type": "summary_text", "text": "**Plan**"},
            ),
            R,
            0,
        ),
        (
            s.ev(
                "response.reasoning_text.delta",
                item_id="rs_1",
                output_index=0,
                content_index=0,
                delta="raw",
            ),
            R,
            0,
        ),
    ]
    assert_table(rows)


@pytest.mark.parametrize(
    ("done_item", "kind"),
    [
        (
            {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "gAAAAB..."},
            "CONTROL",
        ),
        (
            {
                "id": "rs_1",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "**Plan** look at files"}],
            },
            "REASONING",
        ),
        (
            {
                "id": "rs_1",
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "raw thoughts"}],
            },
            "REASONING",
        ),
    ],
    ids=["encrypted-only", "with-summary", "with-content"],
)
def test_reasoning_item_done_is_not_output(done_item: dict[str, Any], kind: str) -> None:
    """Regression: a reasoning item's .done was OUTPUT, committing the turn early."""
    s = Stream()
    kinds = classify_all(
        [
            s.ev(
                "response.output_item.added",
                output_index=0,
                item={"id": "rs_1", "type": "reasoning", "summary": []},
            ),
            s.ev("response.output_item.done", output_index=0, item=done_item),
        ]
    )
    assert kinds == [("CONTROL", 0), (kind, 0)]


def test_two_function_calls() -> None:
    s = Stream()
    args1, args2 = '{"command":"ls"}', '{"command":"pwd"}'
    assert_table(
        [
            (s.ev("response.created", response=response_obj()), C, 0),
            (s.ev("response.in_progress", response=response_obj()), C, 0),
            (s.ev("response.output_item.added", output_index=0, item=fc_item(1)), TS, 1),
            (
                s.ev(
                    "response.function_call_arguments.delta",
                    item_id="fc_1",
                    output_index=0,
                    delta='{"command"',
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.function_call_arguments.delta",
                    item_id="fc_1",
                    output_index=0,
                    delta=':"ls"}',
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.function_call_arguments.done",
                    item_id="fc_1",
                    output_index=0,
                    arguments=args1,
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.output_item.done", output_index=0, item=fc_item(1, "completed", args1)
                ),
                TE,
                0,
            ),
            (s.ev("response.output_item.added", output_index=1, item=fc_item(2)), TS, 1),
            (
                s.ev(
                    "response.function_call_arguments.delta",
                    item_id="fc_2",
                    output_index=1,
                    delta=args2,
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.function_call_arguments.done",
                    item_id="fc_2",
                    output_index=1,
                    arguments=args2,
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.output_item.done", output_index=1, item=fc_item(2, "completed", args2)
                ),
                TE,
                0,
            ),
            (s.ev("response.completed", response=response_obj("completed")), OK, 0),
        ]
    )


def test_text_then_function_call() -> None:
    s = Stream()
    assert_table(
        [
            (s.ev("response.output_item.added", output_index=0, item=message_item()), C, 0),
            (
                s.ev(
                    "response.output_text.delta",
                    item_id="msg_1",
                    output_index=0,
                    content_index=0,
                    delta="Let me look.",
                    logprobs=[],
                ),
                OUT,
                0,
            ),
            (
                s.ev(
                    "response.output_item.done",
                    output_index=0,
                    item=message_item("completed", "Let me look."),
                ),
                OUT,
                0,
            ),
            (s.ev("response.output_item.added", output_index=1, item=fc_item(1)), TS, 1),
            (
                s.ev(
                    "response.output_item.done", output_index=1, item=fc_item(1, "completed", "{}")
                ),
                TE,
                0,
            ),
        ]
    )


@pytest.mark.parametrize("itype", sorted(CLIENT_TOOL_ITEMS))
def test_every_client_tool_item_is_gated(itype: str) -> None:
    s = Stream()
    item = {"id": "it_1", "type": itype, "status": "in_progress"}
    assert_table(
        [
            (s.ev("response.output_item.added", output_index=0, item=item), TS, 1),
            (
                s.ev(
                    "response.output_item.done",
                    output_index=0,
                    item={**item, "status": "completed"},
                ),
                TE,
                0,
            ),
        ]
    )


def test_custom_tool_call_input() -> None:
    s = Stream()
    item = {
        "id": "ctc_1",
        "type": "custom_tool_call",
        "call_id": "call_1",
        "name": "apply",
        "input": "",
    }
    assert_table(
        [
            (s.ev("response.output_item.added", output_index=0, item=item), TS, 1),
            (
                s.ev(
                    "response.custom_tool_call_input.delta",
                    item_id="ctc_1",
                    output_index=0,
                    delta="*** Begin",
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.custom_tool_call_input.done",
                    item_id="ctc_1",
                    output_index=0,
                    input="*** Begin",
                ),
                TD,
                1,
            ),
            (
                s.ev(
                    "response.output_item.done", output_index=0, item={**item, "input": "*** Begin"}
                ),
                TE,
                0,
            ),
        ]
    )


def test_item_without_id_is_keyed_by_output_index() -> None:
    s = Stream()
    item = {"type": "function_call", "call_id": "call_1", "name": "x", "arguments": ""}
    assert_table(
        [
            (s.ev("response.output_item.added", output_index=3, item=item), TS, 1),
            (s.ev("response.output_item.done", output_index=3, item=item), TE, 0),
        ]
    )


def test_server_side_tool_items_commit() -> None:
    """web_search / code_interpreter run on the server: conservative, they commit."""
    s = Stream()
    ws = {"id": "ws_1", "type": "web_search_call", "status": "in_progress"}
    events = [
        s.ev("response.output_item.added", output_index=0, item=ws),
        s.ev("response.web_search_call.in_progress", item_id="ws_1", output_index=0),
        s.ev("response.web_search_call.searching", item_id="ws_1", output_index=0),
        s.ev("response.web_search_call.completed", item_id="ws_1", output_index=0),
        s.ev("response.output_item.done", output_index=0, item={**ws, "status": "completed"}),
        s.ev(
            "response.output_item.added",
            output_index=1,
            item={
                "id": "ci_1",
                "type": "code_interpreter_call",
                "status": "in_progress",
                "code": "",
                "container_id": "c",
            },
        ),
    ]
    clf = ResponsesClassifier()
    for e in events:
        kinds, open_tools = clf.classify(e)
        assert kinds & Kind.COMMITTING, (e.name, kind_names(kinds))
        assert not kinds & (TS | TD | TE)
        assert open_tools == 0


@pytest.mark.parametrize(
    "name",
    ["response.future_event", "response.audio.delta.v2", "something", "response.done"],
)
def test_unknown_event_names(name: str) -> None:
    (e,) = parse(f'event: {name}\ndata: {{"type": "{name}"}}\n\n'.encode())
    assert classify_all([e]) == [("UNKNOWN", 0)]


def test_item_events_with_odd_payloads() -> None:
    (no_item,) = parse(b'event: response.output_item.added\ndata: {"output_index": 0}\n\n')
    (done_without_added,) = parse(
        b"event: response.output_item.done\n"
        b'data: {"output_index":0,"item":{"id":"fc_9","type":"function_call"}}\n\n'
    )
    assert classify_all([no_item, done_without_added]) == [("UNKNOWN", 0), ("UNKNOWN", 0)]


@pytest.mark.parametrize("itype", ["[]", "{}", '["function_call"]', "7", "null"])
@pytest.mark.parametrize("event", ["response.output_item.added", "response.output_item.done"])
def test_an_item_type_that_is_not_a_string_is_unknown(event: str, itype: str) -> None:
    # Found by the fuzz test: a list or object "type" was looked up in a set and raised
    # TypeError (unhashable), which crashed the turn instead of classifying the frame.
    (e,) = parse(
        f'event: {event}\ndata: {{"type":"{event}","output_index":0,'
        f'"item":{{"id":"fc_1","type":{itype}}}}}\n\n'.encode()
    )
    assert classify_all([e]) == [("UNKNOWN", 0)]


@pytest.mark.parametrize(
    "raw",
    [
        b"event: response.output_item.added\ndata: {not json\n\n",
        b"event: response.output_item.done\ndata: [1]\n\n",
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","del\n\n',
        b"data: {garbage\n\n",  # nameless and unparseable
    ],
)
def test_malformed(raw: bytes) -> None:
    (e,) = parse(raw)
    assert classify_all([e])[0][0] == "MALFORMED"


def test_malformed_error_event_is_malformed_terminal() -> None:
    (e,) = parse(b"event: response.failed\ndata: {oops\n\n")
    kinds, _ = ResponsesClassifier().classify(e)
    assert kinds & BAD and kinds & ERR


def test_nameless_events_classified_by_type() -> None:
    """WebSocket messages and nameless SSE events carry their type in the JSON."""
    s = Stream()
    created = s.ev("response.created", response=response_obj())
    nameless = [
        Event(e.raw, None, e.data)
        for e in [
            created,
            s.ev("response.output_item.added", output_index=0, item=fc_item(1)),
            s.ev(
                "response.function_call_arguments.delta", item_id="fc_1", output_index=0, delta="{}"
            ),
            s.ev("response.output_item.done", output_index=0, item=fc_item(1, "completed", "{}")),
            s.ev(
                "response.output_text.delta",
                item_id="m",
                output_index=1,
                content_index=0,
                delta="x",
            ),
            s.ev("response.completed", response=response_obj("completed")),
        ]
    ]
    assert classify_all(nameless) == [
        ("CONTROL", 0),
        ("TOOL_START", 1),
        ("TOOL_DELTA", 1),
        ("TOOL_END", 0),
        ("OUTPUT", 0),
        ("TERMINAL_OK", 0),
    ]
    # "type" not first, or nested first: falls back to a real parse
    late_type = Event(
        b"", None, '{"sequence_number": 1, "type": "response.output_text.delta", "delta": "x"}'
    )
    nested_first = Event(b"", None, '{"response": {"type": "x"}, "type": "response.completed"}')
    no_type = Event(b"", None, '{"sequence_number": 1}')
    assert classify_all([late_type, nested_first, no_type]) == [
        ("OUTPUT", 0),
        ("TERMINAL_OK", 0),
        ("UNKNOWN", 0),
    ]


def test_comment_keepalive_keeps_open_count() -> None:
    s = Stream()
    clf = ResponsesClassifier()
    clf.classify(s.ev("response.output_item.added", output_index=0, item=fc_item(1)))
    (comment,) = parse(b": keepalive\n\n")
    assert clf.classify(comment) == (C, 1)


@pytest.mark.parametrize(
    ("code", "retryable"),
    [
        ("server_error", True),
        ("rate_limit_exceeded", True),
        ("vector_store_timeout", True),
        ("invalid_prompt", False),
        ("context_length_exceeded", False),
        ("bio_policy", False),
        ("image_too_large", False),
    ],
)
def test_response_failed(code: str, retryable: bool) -> None:
    s = Stream()
    e = s.ev(
        "response.failed", response=response_obj("failed", error={"code": code, "message": "m"})
    )
    assert ResponsesClassifier().classify(e) == (ERR | RETRY if retryable else ERR, 0)


@pytest.mark.parametrize(
    ("payload", "retryable"),
    [
        # flat SDK shape
        ({"code": "server_error", "message": "m", "param": None}, True),
        ({"code": "rate_limit_exceeded", "message": "m", "param": None}, True),
        ({"code": "context_length_exceeded", "message": "m", "param": None}, False),
        ({"code": None, "message": "m", "param": None}, False),
        # nested shape seen from the live API
        ({"error": {"type": "server_error", "code": "server_error", "message": "m"}}, True),
        (
            {
                "error": {
                    "type": "invalid_request_error",
                    "code": "context_length_exceeded",
                    "message": "Your input exceeds the context window",
                }
            },
            False,
        ),
        # WebSocket shape with a status
        ({"status": 503, "error": {"type": "service_unavailable", "message": "m"}}, True),
        (
            {
                "status": 400,
                "error": {"type": "invalid_request_error", "code": "previous_response_not_found"},
            },
            False,
        ),
        (
            {
                "error": {
                    "type": "invalid_request_error",
                    "code": "websocket_connection_limit_reached",
                }
            },
            True,
        ),
    ],
)
def test_error_event(payload: dict[str, Any], retryable: bool) -> None:
    s = Stream()
    clf = ResponsesClassifier()
    clf.classify(s.ev("response.output_item.added", output_index=0, item=fc_item(1)))
    kinds, open_tools = clf.classify(s.ev("error", **payload))
    assert kinds == (ERR | RETRY if retryable else ERR)
    assert open_tools == 1


def test_response_incomplete_is_a_final_error() -> None:
    s = Stream()
    e = s.ev(
        "response.incomplete",
        response=response_obj("incomplete", incomplete_details={"reason": "max_output_tokens"}),
    )
    kinds, _ = ResponsesClassifier().classify(e)
    assert kinds == ERR  # final: not retryable, not a success


def test_created_snapshot_is_remembered() -> None:
    s = Stream()
    clf = ResponsesClassifier()
    clf.classify(s.ev("response.created", response=response_obj()))
    clf.classify(s.ev("response.in_progress", response=response_obj(id="resp_other")))
    raw = RESPONSES.error_frame("cut", clf, b'data: {"sequence_number": 41}\n\n', 1.0)
    events = parse(raw)
    assert [e.name for e in events] == ["error", "response.failed"]
    error, failed = (json.loads(e.data or "") for e in events)
    assert error["type"] == "error"
    assert error["sequence_number"] == 42
    assert error["error"]["type"] == "server_error"
    assert isinstance(error["code"], str) and isinstance(error["message"], str)
    assert failed["type"] == "response.failed"
    assert failed["sequence_number"] == 43
    resp = failed["response"]
    assert resp["id"] == "resp_abc123"  # from response.created, not a later snapshot
    assert resp["model"] == "gpt-5"
    assert resp["status"] == "failed"
    assert resp["error"]["code"] == "server_error"
    assert resp["output"] == []
    # a fresh classifier of ours reads both frames as retryable errors
    for e in events:
        assert ResponsesClassifier().classify(e)[0] == ERR | RETRY
    assert b"response.completed" not in raw


def test_error_frame_without_created_makes_up_an_id() -> None:
    events = parse(error_frame("cut", now=1_700_000_000.25))
    failed = json.loads(events[-1].data or "")
    assert failed["response"]["id"] == "resp_unbroken_1700000000250"
    assert failed["response"]["created_at"] == 1_700_000_000  # the time passed in
    assert failed["response"]["status"] == "failed"


def test_a_ledger_dates_its_error_with_the_wall_clock_it_was_given() -> None:
    """The core reads no clock: a Responses turn cut after output, before any
    ``response.created``, is dated by the clock the transport passes in."""
    s = Stream()
    ledger = Ledger(RESPONSES, wall_clock=lambda: 1_234_567.0)
    released = ledger.feed_bytes(s.ev("response.output_text.delta", delta="hi"))
    assert released  # output reached the client: committed
    failed = json.loads(parse(ledger.failed("upstream cut"))[-1].data or "")
    assert failed["response"]["created_at"] == 1_234_567
    assert failed["response"]["id"] == "resp_unbroken_1234567000"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        (b"", None),
        (b": keepalive\n\n", None),
        (b'event: x\ndata: {"type":"x","sequence_number":7}\n\n', 8),
        (b'data: {"sequence_number": 3, "response": {"sequence_number": 9}}\n\n', 10),
    ],
)
def test_next_sequence_number(raw: bytes | None, expected: int | None) -> None:
    assert next_sequence_number(raw) == expected


def test_error_body_is_openai_style() -> None:
    body = json.loads(RESPONSES.error_body("all upstreams failed"))
    assert body["error"]["type"] == "server_error"
    assert body["error"]["message"] == "all upstreams failed"
