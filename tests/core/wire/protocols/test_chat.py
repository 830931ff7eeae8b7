"""Chat Completions classifier: table tests over real-shaped chunk sequences."""

from __future__ import annotations

import json
from typing import Any

import pytest

from unbroken.core.wire.protocols import CHAT, GENERIC, Kind, kind_names, protocol_for_path
from unbroken.core.wire.protocols.chat import ChatClassifier, error_frame
from unbroken.core.wire.sse import Event, SSESplitter

C, OUT, R = Kind.CONTROL, Kind.OUTPUT, Kind.REASONING
TS, TD, TE = Kind.TOOL_START, Kind.TOOL_DELTA, Kind.TOOL_END
OK, ERR, RETRY = Kind.TERMINAL_OK, Kind.TERMINAL_ERROR, Kind.RETRYABLE
UNK, BAD = Kind.UNKNOWN, Kind.MALFORMED


def event(raw: bytes) -> Event:
    splitter = SSESplitter()
    (ev,) = splitter.feed(raw)
    assert splitter.pending == b""
    return ev


def data(payload: Any) -> Event:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return event(f"data: {text}\n\n".encode())


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> Event:
    """A real-shaped ``chat.completion.chunk`` (OpenAI)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_x",
        "choices": [
            {
                "index": 0,
                "delta": delta if delta is not None else {},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": None,
        **extra,
    }
    return data(body)


def tool_start(index: int, call_id: str, name: str) -> Event:
    return chunk(
        {
            "tool_calls": [
                {
                    "index": index,
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            ]
        }
    )


def tool_args(index: int, piece: str) -> Event:
    return chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})


USAGE = data(
    {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "gpt-4o",
        "choices": [],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }
)
DONE = event(b"data: [DONE]\n\n")
ROLE = chunk({"role": "assistant", "content": "", "refusal": None})


def run(events: list[Event]) -> list[tuple[int, int]]:
    clf = ChatClassifier()
    return [clf.classify(e) for e in events]


def assert_table(rows: list[tuple[Event, int, int]]) -> None:
    got = run([r[0] for r in rows])
    want = [(r[1], r[2]) for r in rows]

    def pretty(xs: list[tuple[int, int]]) -> list[tuple[str, int]]:
        return [(kind_names(k), n) for k, n in xs]

    assert pretty(got) == pretty(want)


def test_text_stream() -> None:
    assert_table(
        [
            (ROLE, C, 0),
            (event(b": OPENROUTER PROCESSING\n\n"), C, 0),
            (chunk({"content": "Hel"}), OUT, 0),
            (chunk({"content": "lo"}), OUT, 0),
            (chunk({"content": ""}), C, 0),  # empty content carries nothing
            (chunk({}, "stop"), OK, 0),
            (USAGE, C, 0),
            (DONE, OK, 0),
        ]
    )


def test_text_and_finish_in_one_chunk() -> None:
    assert_table([(ROLE, C, 0), (chunk({"content": "Hi"}, "stop"), OUT | OK, 0)])


def test_refusal_is_output() -> None:
    assert_table(
        [(ROLE, C, 0), (chunk({"refusal": "I can't"}), OUT, 0), (chunk({}, "stop"), OK, 0)]
    )


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_stream(field: str) -> None:
    assert_table(
        [
            (chunk({"role": "assistant", "content": None, field: ""}), C, 0),
            (chunk({"content": None, field: "Let me think"}), R, 0),
            (chunk({"content": None, field: " more"}), R, 0),
            (chunk({"content": "Answer", field: None}), OUT, 0),
            (chunk({}, "stop"), OK, 0),
        ]
    )


def test_single_tool_call() -> None:
    assert_table(
        [
            (chunk({"role": "assistant", "content": None}), C, 0),
            (tool_start(0, "call_1", "bash"), TS, 1),
            (tool_args(0, '{"comm'), TD, 1),
            (tool_args(0, 'and": "ls"}'), TD, 1),
            (chunk({}, "tool_calls"), TE | OK, 0),
            (USAGE, C, 0),
            (DONE, OK, 0),
        ]
    )


def test_parallel_tool_calls_interleaved() -> None:
    """Three calls (indices 0,1,2) whose argument deltas interleave."""
    assert_table(
        [
            (chunk({"role": "assistant", "content": None}), C, 0),
            (tool_start(0, "call_a", "bash"), TS, 1),
            (tool_args(0, '{"command":'), TD, 1),
            (tool_start(1, "call_b", "read"), TS, 2),
            (tool_args(0, ' "ls"}'), TD, 2),
            (tool_start(2, "call_c", "grep"), TS, 3),
            (tool_args(1, '{"path": "a"}'), TD, 3),
            (tool_args(2, '{"q":'), TD, 3),
            (tool_args(2, ' "x"}'), TD, 3),
            (chunk({}, "tool_calls"), TE | OK, 0),
            (USAGE, C, 0),
            (DONE, OK, 0),
        ]
    )


def test_several_tool_calls_in_one_chunk() -> None:
    both = chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "a", "arguments": "{}"},
                },
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "b", "arguments": ""},
                },
            ]
        }
    )
    assert_table(
        [(both, TS, 2), (tool_args(1, "{}"), TD, 2), (chunk({}, "tool_calls"), TE | OK, 0)]
    )


def test_text_then_tool_call() -> None:
    assert_table(
        [
            (ROLE, C, 0),
            (chunk({"content": "Running it."}), OUT, 0),
            (tool_start(0, "call_1", "bash"), TS, 1),
            (tool_args(0, "{}"), TD, 1),
            (chunk({}, "tool_calls"), TE | OK, 0),
        ]
    )


def test_tool_call_without_index_defaults_to_zero() -> None:
    start = chunk(
        {
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "x", "arguments": ""}}
            ]
        }
    )
    delta = chunk({"tool_calls": [{"function": {"arguments": "{}"}}]})
    assert_table([(start, TS, 1), (delta, TD, 1), (chunk({}, "stop"), TE | OK, 0)])


def test_finish_reason_length_closes_open_calls() -> None:
    assert_table(
        [
            (tool_start(0, "c", "x"), TS, 1),
            (tool_args(0, '{"a'), TD, 1),
            (chunk({}, "length"), TE | OK, 0),
        ]
    )


@pytest.mark.parametrize(
    ("payload", "kinds"),
    [
        # legacy function_call and audio deltas are not known: conservative UNKNOWN
        (
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"function_call": {"name": "f", "arguments": ""}},
                        "finish_reason": None,
                    }
                ]
            },
            UNK,
        ),
        (
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"audio": {"id": "a", "data": "AAAA"}},
                        "finish_reason": None,
                    }
                ]
            },
            UNK,
        ),
        ({"choices": {"0": {}}}, UNK),  # choices not a list
        ({"choices": ["nope"]}, UNK),  # choice not an object
        ({"choices": [{"index": 0, "delta": "text"}]}, UNK),  # delta not an object
        ({"choices": [{"index": 0, "delta": {"tool_calls": {"0": {}}}}]}, UNK),
        ({"choices": [{"index": 0, "delta": {"tool_calls": ["x"]}}]}, UNK),
        ({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": "0"}]}}]}, UNK),
        ({"choices": []}, C),  # empty choices, no usage
        ({"id": "x", "object": "chat.completion.chunk"}, C),  # no choices at all
        ({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}, C),
        ({"choices": [{"index": 0, "delta": {"content": None, "tool_calls": None}}]}, C),
        ({"choices": [{"index": 0}]}, C),  # no delta
        ({"error": None, "choices": [{"index": 0, "delta": {"content": "a"}}]}, OUT),
    ],
)
def test_unknown_and_inert_chunks(payload: dict[str, Any], kinds: int) -> None:
    assert kind_names(run([data(payload)])[0][0]) == kind_names(kinds)


@pytest.mark.parametrize(
    "text",
    ["{not json", '{"choices": [', "[1, 2]", '"a string"', "null", "42", "", "[DON"],
)
def test_malformed(text: str) -> None:
    assert run([data(text)]) == [(BAD, 0)]


def test_malformed_keeps_open_tool_count() -> None:
    clf = ChatClassifier()
    clf.classify(tool_start(0, "c", "x"))
    assert clf.classify(data("{oops")) == (BAD, 1)


@pytest.mark.parametrize(
    ("error", "retryable"),
    [
        (
            {
                "message": "The server had an error",
                "type": "server_error",
                "param": None,
                "code": None,
            },
            True,
        ),
        (
            {
                "message": "Rate limit reached",
                "type": "tokens",
                "param": None,
                "code": "rate_limit_exceeded",
            },
            True,
        ),
        ({"message": "Overloaded", "type": "overloaded_error"}, True),
        ({"message": "Provider returned error", "code": 502}, True),  # OpenRouter
        ({"message": "Too many requests", "code": 429}, True),
        ({"message": "unavailable", "code": "503"}, True),
        ({"message": "Service Unavailable", "status": "UNAVAILABLE"}, True),  # Gemini style
        (
            {"message": "bad", "type": "invalid_request_error", "param": "messages", "code": None},
            False,
        ),
        (
            {
                "message": "This model's maximum context length is 128000 tokens",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            },
            False,
        ),
        ({"message": "nope", "code": 400}, False),
        ({"message": "auth", "type": "authentication_error", "code": "invalid_api_key"}, False),
        ("plain string error", False),
    ],
)
def test_error_chunks(error: Any, retryable: bool) -> None:
    clf = ChatClassifier()
    clf.classify(tool_start(0, "c", "x"))
    kinds, open_tools = clf.classify(data({"error": error}))
    assert kinds == (ERR | RETRY if retryable else ERR)
    assert open_tools == 1


def test_done_clears_open_tools() -> None:
    clf = ChatClassifier()
    clf.classify(tool_start(0, "c", "x"))
    assert clf.classify(DONE) == (OK, 0)


def test_comment_keeps_open_tool_count() -> None:
    clf = ChatClassifier()
    clf.classify(tool_start(0, "c", "x"))
    clf.classify(tool_start(1, "d", "y"))
    assert clf.classify(event(b": ping\n\n")) == (C, 2)


def test_repeated_id_on_same_index_restarts_count_not_duplicate() -> None:
    """Some compatible servers repeat the id on every chunk: still one open call."""
    clf = ChatClassifier()
    clf.classify(tool_start(0, "call_1", "x"))
    kinds, n = clf.classify(
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"arguments": "{}"}}]})
    )
    assert n == 1
    assert kinds & (TS | TD)


def test_error_frame_shape() -> None:
    raw = error_frame("unbroken: cut")
    ev = event(raw)
    assert ev.raw == raw and ev.name is None
    body = json.loads(ev.data or "")
    assert set(body) == {"error"}
    assert body["error"]["message"] == "unbroken: cut"
    assert body["error"]["type"] == "server_error"
    # OpenCode retries a code that names an unavailable upstream (docs/protocols.md)
    assert isinstance(body["error"].get("code"), str)
    assert b"[DONE]" not in raw and b"finish_reason" not in raw
    # our own classifier reads it as a retryable in-stream error
    assert ChatClassifier().classify(ev)[0] == ERR | RETRY


def test_protocol_error_frame_and_body() -> None:
    clf = CHAT.new_classifier()
    assert CHAT.error_frame("m", clf, None, 1.0) == error_frame("m")
    body = json.loads(CHAT.error_body("all failed"))
    assert body == {
        "error": {"message": "all failed", "type": "server_error", "code": "upstream_unavailable"}
    }
    body = json.loads(CHAT.error_body("x", type_="rate_limited"))
    assert body["error"]["code"] == "rate_limited"
    assert CHAT.has_terminal and not GENERIC.has_terminal


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("v1/chat/completions", "chat"),
        ("/openai/v1/chat/completions", "chat"),
        ("chat/completions/", "chat"),
        ("v1/responses", "responses"),
        ("responses", "responses"),
        ("/api/v1/responses/", "responses"),
        ("v1/messages", "anthropic"),
        ("messages", "anthropic"),
        ("v1/messages/count_tokens", "generic"),
        ("v1/models", "generic"),
        ("v1/responses/resp_123", "generic"),
        ("v1/myresponses", "generic"),
        ("", "generic"),
    ],
)
def test_protocol_for_path(path: str, name: str) -> None:
    assert protocol_for_path(path).name == name


def test_generic_classifier() -> None:
    clf = GENERIC.new_classifier()
    assert clf.classify(event(b": hi\n\n")) == (C, 0)
    assert clf.classify(event(b"data: x\n\n")) == (UNK, 0)
    assert clf.classify(event(b"event: y\n\n")) == (UNK, 0)
    raw = GENERIC.error_frame("boom", clf, None, 1.0)
    ev = event(raw)
    assert ev.name == "error"
    assert json.loads(ev.data or "") == {"error": {"message": "boom"}}
