"""Anthropic Messages classifier: table tests over real-shaped event sequences."""

from __future__ import annotations

import json
from typing import Any

import pytest

from unbroken.core.wire.protocols import ANTHROPIC, Kind, kind_names
from unbroken.core.wire.protocols.anthropic import AnthropicClassifier, error_frame
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


def ev(name: str, **fields: Any) -> Event:
    payload = {"type": name, **fields}
    (event,) = parse(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
    return event


MESSAGE_START = ev(
    "message_start",
    message={
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 25, "output_tokens": 1},
    },
)
PING = ev("ping")
MESSAGE_STOP = ev("message_stop")


def block_start(index: int, block: dict[str, Any]) -> Event:
    return ev("content_block_start", index=index, content_block=block)


def delta(index: int, d: dict[str, Any]) -> Event:
    return ev("content_block_delta", index=index, delta=d)


def block_stop(index: int) -> Event:
    return ev("content_block_stop", index=index)


def message_delta(stop_reason: str) -> Event:
    return ev(
        "message_delta",
        delta={"stop_reason": stop_reason, "stop_sequence": None},
        usage={"output_tokens": 15},
    )


def assert_table(rows: list[tuple[Event, int, int]]) -> None:
    clf = AnthropicClassifier()
    got = [(kind_names(k), n) for k, n in (clf.classify(r[0]) for r in rows)]
    assert got == [(kind_names(k), n) for _, k, n in rows]


def test_text_stream() -> None:
    assert_table(
        [
            (MESSAGE_START, C, 0),
            (block_start(0, {"type": "text", "text": ""}), C, 0),
            (PING, C, 0),
            (delta(0, {"type": "text_delta", "text": "Hello"}), OUT, 0),
            (delta(0, {"type": "text_delta", "text": "!"}), OUT, 0),
            (block_stop(0), C, 0),
            (message_delta("end_turn"), C, 0),
            (MESSAGE_STOP, OK, 0),
        ]
    )


def test_thinking_then_text() -> None:
    assert_table(
        [
            (MESSAGE_START, C, 0),
            (block_start(0, {"type": "thinking", "thinking": "", "signature": ""}), C, 0),
            (delta(0, {"type": "thinking_delta", "thinking": "Let me think"}), R, 0),
            (delta(0, {"type": "signature_delta", "signature": "EqQBCgIYAhIM"}), R, 0),
            (block_stop(0), C, 0),
            (block_start(1, {"type": "redacted_thinking", "data": "EmwKAhgBEgy3"}), R, 0),
            (block_stop(1), C, 0),
            (block_start(2, {"type": "text", "text": ""}), C, 0),
            (delta(2, {"type": "text_delta", "text": "Answer"}), OUT, 0),
            (block_stop(2), C, 0),
            (message_delta("end_turn"), C, 0),
            (MESSAGE_STOP, OK, 0),
        ]
    )


def test_two_tool_use_blocks() -> None:
    assert_table(
        [
            (MESSAGE_START, C, 0),
            (block_start(0, {"type": "text", "text": ""}), C, 0),
            (delta(0, {"type": "text_delta", "text": "Running two commands."}), OUT, 0),
            (block_stop(0), C, 0),
            (
                block_start(1, {"type": "tool_use", "id": "toolu_01", "name": "bash", "input": {}}),
                TS,
                1,
            ),
            (delta(1, {"type": "input_json_delta", "partial_json": ""}), TD, 1),
            (delta(1, {"type": "input_json_delta", "partial_json": '{"command": "ls"'}), TD, 1),
            (PING, C, 1),
            (delta(1, {"type": "input_json_delta", "partial_json": "}"}), TD, 1),
            (block_stop(1), TE, 0),
            (
                block_start(2, {"type": "tool_use", "id": "toolu_02", "name": "bash", "input": {}}),
                TS,
                1,
            ),
            (delta(2, {"type": "input_json_delta", "partial_json": '{"command": "pwd"}'}), TD, 1),
            (block_stop(2), TE, 0),
            (message_delta("tool_use"), C, 0),
            (MESSAGE_STOP, OK, 0),
        ]
    )


def test_server_tool_use_and_result() -> None:
    assert_table(
        [
            (MESSAGE_START, C, 0),
            (
                block_start(
                    0,
                    {
                        "type": "server_tool_use",
                        "id": "srvtoolu_01",
                        "name": "web_search",
                        "input": {},
                    },
                ),
                TS,
                1,
            ),
            (delta(0, {"type": "input_json_delta", "partial_json": '{"query": "x"}'}), TD, 1),
            (block_stop(0), TE, 0),
            (
                block_start(
                    1,
                    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01", "content": []},
                ),
                UNK,
                0,
            ),
            (block_stop(1), UNK, 0),
            (block_start(2, {"type": "text", "text": ""}), C, 0),
            (
                delta(
                    2,
                    {"type": "citations_delta", "citation": {"type": "web_search_result_location"}},
                ),
                OUT,
                0,
            ),
        ]
    )


def test_mcp_tool_use_is_gated() -> None:
    assert_table(
        [
            (
                block_start(
                    0,
                    {
                        "type": "mcp_tool_use",
                        "id": "mcptoolu_1",
                        "name": "x",
                        "server_name": "s",
                        "input": {},
                    },
                ),
                TS,
                1,
            ),
            (block_stop(0), TE, 0),
        ]
    )


@pytest.mark.parametrize(
    "event",
    [
        ev("some_future_event", foo=1),
        delta(0, {"type": "text_delta", "text": "orphan"}),  # no open block
        block_stop(0),  # no open block
        block_start(0, {"type": "image"}),  # unknown block type
        block_start(0, {"no": "type"}),
        ev("content_block_start", index=0),  # no content_block at all
    ],
)
def test_unknown(event: Event) -> None:
    kinds, _ = AnthropicClassifier().classify(event)
    assert kinds == UNK


def test_nameless_data_is_unknown_and_comment_is_control() -> None:
    clf = AnthropicClassifier()
    (nameless,) = parse(b'data: {"type": "ping"}\n\n')
    (comment,) = parse(b": keepalive\n\n")
    assert clf.classify(nameless) == (UNK, 0)
    assert clf.classify(comment) == (C, 0)


def test_unknown_block_deltas_are_unknown() -> None:
    assert_table(
        [
            (block_start(0, {"type": "compaction"}), UNK, 0),
            (delta(0, {"type": "compaction_delta", "content": "x"}), UNK, 0),
            (block_stop(0), UNK, 0),
        ]
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"event: content_block_start\ndata: {not json}\n\n",
        b'event: content_block_start\ndata: {"type":"content_block_start","index":0,\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"te\n\n',
        b"event: message_stop\ndata: \n\n",
    ],
)
def test_malformed(raw: bytes) -> None:
    (e,) = parse(raw)
    kinds, _ = AnthropicClassifier().classify(e)
    assert kinds & BAD


@pytest.mark.parametrize(
    ("error_type", "retryable"),
    [
        ("overloaded_error", True),
        ("api_error", True),
        ("rate_limit_error", True),
        ("timeout_error", True),
        ("invalid_request_error", False),
        ("authentication_error", False),
        ("permission_error", False),
        ("not_found_error", False),
        ("billing_error", False),
        ("request_too_large", False),
    ],
)
def test_error_events(error_type: str, retryable: bool) -> None:
    clf = AnthropicClassifier()
    clf.classify(block_start(0, {"type": "tool_use", "id": "t", "name": "x", "input": {}}))
    e = ev("error", error={"type": error_type, "message": "m"})
    kinds, open_tools = clf.classify(e)
    assert kinds == (ERR | RETRY if retryable else ERR)
    assert open_tools == 1


def test_context_too_long_is_final() -> None:
    e = ev(
        "error",
        error={
            "type": "invalid_request_error",
            "message": "prompt is too long: 250000 tokens > 200000 maximum",
        },
    )
    assert AnthropicClassifier().classify(e) == (ERR, 0)


def test_error_frame_shape() -> None:
    raw = error_frame("cut after output")
    (e,) = parse(raw)
    assert e.name == "error"
    body = json.loads(e.data or "")
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert isinstance(body["error"]["message"], str)
    assert AnthropicClassifier().classify(e) == (ERR | RETRY, 0)
    assert b"message_stop" not in raw
    clf = ANTHROPIC.new_classifier()
    assert ANTHROPIC.error_frame("x", clf, None, 1.0) == error_frame("x")


def test_error_body_is_anthropic_style() -> None:
    body = json.loads(ANTHROPIC.error_body("all upstreams failed"))
    assert body["type"] == "error"
    assert body["error"]["message"] == "all upstreams failed"
    assert body["error"]["type"] in ("api_error", "overloaded_error")
