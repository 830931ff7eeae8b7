"""Unit tests of the mock's action parsing and wire formats (no sockets)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from unbroken.mock import (
    ActionError,
    encode_sse,
    events_for,
    expand_actions,
    frames_for,
    parse_action,
    responses_events,
)
from unbroken.mock.testing import parse_sse, parse_sse_json, split_sse
from unbroken.mock.wire import split_exact

CHAT_REQ: dict[str, Any] = {
    "model": "gpt-test",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
}
RESP_REQ: dict[str, Any] = {"model": "gpt-test", "stream": True, "input": "hi"}
ANTH_REQ: dict[str, Any] = {
    "model": "claude-test",
    "stream": True,
    "max_tokens": 100,
    "messages": [{"role": "user", "content": "hi"}],
}
REQS = {"chat": CHAT_REQ, "responses": RESP_REQ, "anthropic": ANTH_REQ}


# -- splitting -------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 8, 29, 30, 200, 1000])
def test_split_exact_gives_n_nonempty_pieces(n: int) -> None:
    text = "Hello from the mock provider."
    pieces = split_exact(text, n)
    assert len(pieces) == n
    assert all(pieces)
    joined = "".join(pieces)
    if n <= len(text):
        assert joined == text
    else:
        assert joined.startswith(text) and len(joined) >= n
        assert set(joined.split(text)) == {""}  # whole repetitions only
    assert split_exact(text, n) == pieces  # deterministic


def test_split_exact_pads_empty_text() -> None:
    assert split_exact("", 3) == [" ", " ", " "]


# -- action validation -----------------------------------------------------


@pytest.mark.parametrize(
    ("action", "bad_key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"fault": "explode"}, "fault"),
        ({"reply": "poem"}, "reply"),
        ({"deltas": 0}, "deltas"),
        ({"deltas": "3"}, "deltas"),
        ({"status": 99}, "status"),
        ({"headers": ["x"]}, "headers"),
        ({"after_frame": 2}, "after_frame"),
        ({"fault": "reset", "after_frame": -1}, "after_frame"),
        ({"fault": "error_event", "error": "nope"}, "error"),
        ({"fault": "stall", "seconds": -1}, "seconds"),
        ({"fault": "reset", "seconds": 1}, "seconds"),
        ({"tool_args": "x"}, "tool_args"),
        ({"chunk_delay_ms": "fast"}, "chunk_delay_ms"),
        ({"body": "x"}, "body"),
        ({"count": 0}, "count"),
        ({"fault": "error_event", "status": 500}, "fault"),
    ],
)
def test_invalid_actions_name_the_key(action: dict[str, Any], bad_key: str) -> None:
    with pytest.raises(ActionError) as info:
        parse_action(action)
    assert bad_key in str(info.value)


def test_expand_actions_count_and_comments() -> None:
    actions = expand_actions([{"status": 503, "count": 3, "_comment": "x"}, {}])
    assert [a.status for a in actions] == [503, 503, 503, None]
    with pytest.raises(ActionError, match=r"actions\[1\]\.fault"):
        expand_actions([{}, {"fault": "nope"}])


# -- frame sequences --------------------------------------------------------


def _names(frames: list[bytes]) -> list[str | None]:
    return [parse_sse(f)[0] for f in frames]


def test_chat_text_frames() -> None:
    frames = frames_for("chat", {"deltas": 3}, CHAT_REQ)
    assert len(frames) == 1 + 3 + 1 + 1
    chunks = [parse_sse_json(f)[1] for f in frames[:-1]]
    assert frames[-1] == b"data: [DONE]\n\n"
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:4]) == (
        "Hello from the mock provider."
    )
    assert chunks[4]["choices"][0]["finish_reason"] == "stop"
    assert all(c["model"] == "gpt-test" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" not in c for c in chunks)


def test_chat_usage_chunk() -> None:
    req = {**CHAT_REQ, "stream_options": {"include_usage": True}}
    frames = frames_for("chat", {"deltas": 2}, req)
    chunks = [parse_sse_json(f)[1] for f in frames[:-1]]
    assert len(frames) == 1 + 2 + 1 + 1 + 1
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 2
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_tools_frames() -> None:
    frames = frames_for("chat", {"reply": "tools", "deltas": 4}, CHAT_REQ)
    chunks = [parse_sse_json(f)[1] for f in frames[:-1]]
    # role, (first fragment + 4 argument fragments) x 2, finish, [DONE]
    assert len(frames) == 1 + 2 * (1 + 4) + 1 + 1
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks[1:-1]:
        (tc,) = chunk["choices"][0]["delta"]["tool_calls"]
        entry = calls.setdefault(tc["index"], {"arguments": ""})
        if "id" in tc:
            assert tc["type"] == "function"
            entry["id"] = tc["id"]
            entry["name"] = tc["function"]["name"]
        entry["arguments"] += tc["function"]["arguments"]
    assert json.loads(calls[0]["arguments"]) == {"command": "echo hello"}
    assert json.loads(calls[1]["arguments"]) == {"command": "echo world"}
    assert calls[0]["name"] == calls[1]["name"] == "bash"
    assert calls[0]["id"] != calls[1]["id"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_name_from_request_and_overrides() -> None:
    req = {**CHAT_REQ, "tools": [{"type": "function", "function": {"name": "shell"}}]}
    frames = frames_for("chat", {"reply": "tool"}, req)
    assert (
        parse_sse_json(frames[1])[1]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"]
        == "shell"
    )
    events = events_for(
        "anthropic",
        {"reply": "tool", "tool_args": {"path": "a.txt"}},
        {**ANTH_REQ, "tools": [{"name": "read", "input_schema": {}}]},
    )
    start = events[1][1]
    assert start["content_block"]["name"] == "read"
    partial = "".join(p["delta"]["partial_json"] for n, p in events if n == "content_block_delta")
    assert json.loads(partial) == {"path": "a.txt"}


def test_responses_text_sequence() -> None:
    events = responses_events({"deltas": 3}, RESP_REQ)
    names = [n for n, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert all(p["type"] == n for n, p in events)
    done = events[-1][1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello from the mock provider."
    assert done["usage"]["output_tokens"] == 3


def test_responses_tool_sequence() -> None:
    events = responses_events({"reply": "tools", "deltas": 2}, RESP_REQ)
    per_call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        *per_call,
        *per_call,
        "response.completed",
    ]
    added = events[2][1]["item"]
    assert added["type"] == "function_call" and added["arguments"] == ""
    assert added["id"].startswith("fc_") and added["call_id"].startswith("call_")
    output = events[-1][1]["response"]["output"]
    assert [o["output_index"] for o in (events[2][1], events[7][1])] == [0, 1]
    assert [json.loads(o["arguments"]) for o in output] == [
        {"command": "echo hello"},
        {"command": "echo world"},
    ]


def test_anthropic_text_sequence() -> None:
    frames = frames_for("anthropic", {"deltas": 2}, ANTH_REQ)
    assert _names(frames) == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = parse_sse_json(frames[0])[1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert parse_sse_json(frames[6])[1]["delta"]["stop_reason"] == "end_turn"


def test_anthropic_tools_sequence() -> None:
    frames = frames_for("anthropic", {"reply": "tools", "deltas": 2}, ANTH_REQ)
    assert _names(frames) == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert parse_sse_json(frames[6])[1]["index"] == 1
    assert parse_sse_json(frames[-2])[1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
@pytest.mark.parametrize("reply", ["text", "tool", "tools"])
def test_events_encode_to_frames(protocol: str, reply: str) -> None:
    """The dict path (events_for) and the fast byte path agree byte for byte."""
    action = {"reply": reply, "deltas": 5, "text": 'quote " and \\ and \n newline and é'}
    req = {**REQS[protocol], "stream_options": {"include_usage": True}}
    frames = frames_for(protocol, action, req)
    assert [encode_sse(n, p) for n, p in events_for(protocol, action, req)] == frames


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_deltas_200_exact_count(protocol: str) -> None:
    base = len(frames_for(protocol, {"deltas": 1}, REQS[protocol]))
    frames = frames_for(protocol, {"deltas": 200, "text": "abc"}, REQS[protocol])
    assert len(frames) == base + 199


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_determinism_and_ids(protocol: str) -> None:
    req = REQS[protocol]
    a = frames_for(protocol, {}, req)
    b = frames_for(protocol, {}, json.loads(json.dumps(req)))
    assert a == b
    # fault keys do not change the reply bytes; shape keys and the request do
    assert frames_for(protocol, {"fault": "reset", "after_frame": 2}, req) == a
    assert frames_for(protocol, {"deltas": 8, "reply": "text", "chunk_delay_ms": 5}, req) == a
    assert frames_for(protocol, {"seed": 1}, req) != a
    assert frames_for(protocol, {}, {**req, "extra": 1}) != a


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_non_stream_body_halves(protocol: str) -> None:
    req = {**REQS[protocol], "stream": False}
    frames = frames_for(protocol, {}, req)
    assert len(frames) == 2
    body = json.loads(b"".join(frames))
    assert body["model"] == req["model"]


def test_split_sse_helper() -> None:
    frames, rest = split_sse(b"data: 1\n\nevent: x\ndata: 2\n\ndata: 3")
    assert frames == [b"data: 1\n\n", b"event: x\ndata: 2\n\n"]
    assert rest == b"data: 3"


# -- the render memos ------------------------------------------------------


def test_identical_requests_share_the_rendered_bytes_and_the_memos_are_bounded() -> None:
    """A reply is rendered once per digest (identical requests share the bytes, a
    non-streamed twin is its own), and each memo keeps at most 256 replies."""
    from unbroken.mock.wire import make_reply, render_reply, ws_messages
    from unbroken.mock.wire.render import _render_memo
    from unbroken.mock.wire.ws_replies import _ws_messages_memo

    first = render_reply(make_reply("chat", None, dict(CHAT_REQ)))
    assert render_reply(make_reply("chat", None, dict(CHAT_REQ))) is first
    plain = render_reply(make_reply("chat", None, {**CHAT_REQ, "stream": False}))
    assert plain is not first and not plain.stream and first.stream
    socket = ws_messages(make_reply("responses", None, dict(RESP_REQ)))
    assert ws_messages(make_reply("responses", None, dict(RESP_REQ))) is socket
    for n in range(300):
        ws_messages(make_reply("responses", None, {**RESP_REQ, "input": f"hi {n}"}))
    for memo in (_render_memo, _ws_messages_memo):
        info = memo.cache_info()
        assert info.maxsize == 256 and info.currsize == 256, info
