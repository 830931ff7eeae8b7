"""The commit ledger: transition tables and a fault-schedule property test.

Streams below are real-shaped (OpenAI Chat Completions, OpenAI Responses,
Anthropic Messages).  Every attempt of a turn is tagged (``A0Z``, ``A1Z``, ...)
in its ids and texts, so the bytes the client saw can be traced back to the
attempt they came from.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unbroken.core.ledger import Hold, Ledger, LedgerError, LedgerState, Verdict
from unbroken.core.protocols import ANTHROPIC, CHAT, GENERIC, RESPONSES, Kind, Protocol
from unbroken.core.sse import Event, SSESplitter

PROTOCOLS = {"chat": CHAT, "responses": RESPONSES, "anthropic": ANTHROPIC}


def state(ledger: Ledger) -> LedgerState:
    """``ledger.state``, read through a call: after a call that changed it, the type
    checker would still hold the value an earlier assert narrowed it to."""
    return ledger.state


def verdict(ledger: Ledger) -> Verdict:
    """``ledger.verdict``, read through a call (see `state`)."""
    return ledger.verdict


# ---------------------------------------------------------------------------
# Frame builders


def sse(name: str | None, payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    if name is None:
        return f"data: {data}\n\n".encode()
    return f"event: {name}\ndata: {data}\n\n".encode()


def to_event(frame: bytes) -> Event:
    splitter = SSESplitter()
    (event,) = splitter.feed(frame)
    assert splitter.pending == b""
    return event


def split_pieces(text: str, n: int) -> list[str]:
    n = max(1, min(n, len(text)))
    step = -(-len(text) // n)
    return [text[i : i + step] for i in range(0, len(text), step)]


def tool_args(call_id: str) -> str:
    return json.dumps({"command": f"echo {call_id}"})


@dataclass
class Shape:
    """What one attempt streams: reasoning deltas, text deltas, tool calls."""

    reasoning: int = 0
    text: int = 2
    tools: tuple[int, ...] = ()  # argument pieces per tool call
    interleave: bool = False  # chat: interleave parallel tool calls


def chat_frames(tag: str, shape: Shape) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(
            None,
            {
                "id": f"chatcmpl-{tag}",
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": "gpt-4o",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
            },
        )

    frames = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"reasoning_content": f"think {tag} {j}. "}) for j in range(shape.reasoning)]
    frames += [chunk({"content": f"text {tag} {j}. "}) for j in range(shape.text)]
    per_call: list[list[bytes]] = []
    for i, pieces in enumerate(shape.tools):
        call_id = f"call_{tag}_{i}"
        seq = [
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": "bash", "arguments": ""},
                        }
                    ]
                }
            )
        ]
        seq += [
            chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
            for p in split_pieces(tool_args(call_id), pieces)
        ]
        per_call.append(seq)
    if shape.interleave:
        while any(per_call):
            for seq in per_call:
                if seq:
                    frames.append(seq.pop(0))
    else:
        for seq in per_call:
            frames += seq
    frames.append(chunk({}, "tool_calls" if shape.tools else "stop"))
    frames.append(
        sse(
            None,
            {
                "id": f"chatcmpl-{tag}",
                "object": "chat.completion.chunk",
                "created": 1_700_000_000,
                "model": "gpt-4o",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
            },
        )
    )
    frames.append(b"data: [DONE]\n\n")
    return frames


def responses_frames(tag: str, shape: Shape, *, reasoning_item: bool = False) -> list[bytes]:
    seq = 0
    frames: list[bytes] = []

    def ev(name: str, **fields: Any) -> None:
        nonlocal seq
        frames.append(sse(name, {"type": name, "sequence_number": seq, **fields}))
        seq += 1

    def resp(status: str) -> dict[str, Any]:
        return {
            "id": f"resp_{tag}",
            "object": "response",
            "created_at": 1_700_000_000,
            "status": status,
            "model": "gpt-5",
            "output": [],
            "error": None,
            "incomplete_details": None,
            "tools": [],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "usage": None,
        }

    ev("response.created", response=resp("in_progress"))
    ev("response.in_progress", response=resp("in_progress"))
    idx = 0
    if shape.reasoning or reasoning_item:
        rs = {"id": f"rs_{tag}", "type": "reasoning", "summary": []}
        ev("response.output_item.added", output_index=idx, item=rs)
        if shape.reasoning:
            ev(
                "response.reasoning_summary_part.added",
                item_id=rs["id"],
                output_index=idx,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
            for j in range(shape.reasoning):
                ev(
                    "response.reasoning_summary_text.delta",
                    item_id=rs["id"],
                    output_index=idx,
                    summary_index=0,
                    delta=f"think {tag} {j}. ",
                )
            ev(
                "response.reasoning_summary_text.done",
                item_id=rs["id"],
                output_index=idx,
                summary_index=0,
                text="...",
            )
            ev(
                "response.reasoning_summary_part.done",
                item_id=rs["id"],
                output_index=idx,
                summary_index=0,
                part={"type": "summary_text", "text": "..."},
            )
        ev(
            "response.output_item.done",
            output_index=idx,
            item={**rs, "encrypted_content": "gAAAA" + tag},
        )
        idx += 1
    if shape.text:
        msg = {
            "id": f"msg_{tag}",
            "type": "message",
            "status": "in_progress",
            "content": [],
            "role": "assistant",
        }
        ev("response.output_item.added", output_index=idx, item=msg)
        ev(
            "response.content_part.added",
            item_id=msg["id"],
            output_index=idx,
            content_index=0,
            part={"type": "output_text", "annotations": [], "text": ""},
        )
        for j in range(shape.text):
            ev(
                "response.output_text.delta",
                item_id=msg["id"],
                output_index=idx,
                content_index=0,
                delta=f"text {tag} {j}. ",
                logprobs=[],
            )
        ev(
            "response.output_text.done",
            item_id=msg["id"],
            output_index=idx,
            content_index=0,
            text="...",
            logprobs=[],
        )
        ev(
            "response.content_part.done",
            item_id=msg["id"],
            output_index=idx,
            content_index=0,
            part={"type": "output_text", "annotations": [], "text": "..."},
        )
        ev("response.output_item.done", output_index=idx, item={**msg, "status": "completed"})
        idx += 1
    for i, pieces in enumerate(shape.tools):
        fc_id = f"fc_{tag}_{i}"
        args = tool_args(fc_id)
        item = {
            "id": fc_id,
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": f"call_{tag}_{i}",
            "name": "bash",
        }
        ev("response.output_item.added", output_index=idx, item=item)
        for p in split_pieces(args, pieces):
            ev("response.function_call_arguments.delta", item_id=fc_id, output_index=idx, delta=p)
        ev("response.function_call_arguments.done", item_id=fc_id, output_index=idx, arguments=args)
        ev(
            "response.output_item.done",
            output_index=idx,
            item={**item, "status": "completed", "arguments": args},
        )
        idx += 1
    ev("response.completed", response=resp("completed"))
    return frames


def anthropic_frames(tag: str, shape: Shape) -> list[bytes]:
    frames: list[bytes] = []

    def ev(name: str, **fields: Any) -> None:
        frames.append(sse(name, {"type": name, **fields}))

    ev(
        "message_start",
        message={
            "id": f"msg_{tag}",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 1},
        },
    )
    ev("ping")
    index = 0
    if shape.reasoning:
        ev(
            "content_block_start",
            index=index,
            content_block={"type": "thinking", "thinking": "", "signature": ""},
        )
        for j in range(shape.reasoning):
            ev(
                "content_block_delta",
                index=index,
                delta={"type": "thinking_delta", "thinking": f"think {tag} {j}. "},
            )
        ev(
            "content_block_delta",
            index=index,
            delta={"type": "signature_delta", "signature": "Eq" + tag},
        )
        ev("content_block_stop", index=index)
        index += 1
    if shape.text:
        ev("content_block_start", index=index, content_block={"type": "text", "text": ""})
        for j in range(shape.text):
            ev(
                "content_block_delta",
                index=index,
                delta={"type": "text_delta", "text": f"text {tag} {j}. "},
            )
        ev("content_block_stop", index=index)
        index += 1
    for i, pieces in enumerate(shape.tools):
        tid = f"toolu_{tag}_{i}"
        ev(
            "content_block_start",
            index=index,
            content_block={"type": "tool_use", "id": tid, "name": "bash", "input": {}},
        )
        ev(
            "content_block_delta",
            index=index,
            delta={"type": "input_json_delta", "partial_json": ""},
        )
        for p in split_pieces(tool_args(tid), pieces):
            ev(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": p},
            )
        ev("content_block_stop", index=index)
        index += 1
    ev(
        "message_delta",
        delta={"stop_reason": "tool_use" if shape.tools else "end_turn", "stop_sequence": None},
        usage={"output_tokens": 20},
    )
    ev("message_stop")
    return frames


BUILDERS: dict[str, Callable[[str, Shape], list[bytes]]] = {
    "chat": chat_frames,
    "responses": responses_frames,
    "anthropic": anthropic_frames,
}

RETRYABLE_ERROR = {
    "chat": sse(
        None,
        {
            "error": {
                "message": "The server had an error while processing your request.",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        },
    ),
    "responses": sse(
        "response.failed",
        {
            "type": "response.failed",
            "sequence_number": 99,
            "response": {
                "id": "resp_x",
                "object": "response",
                "status": "failed",
                "error": {"code": "server_error", "message": "An error occurred"},
                "output": [],
            },
        },
    ),
    "anthropic": sse(
        "error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    ),
}
FATAL_ERROR = {
    "chat": sse(
        None,
        {
            "error": {
                "message": "This model's maximum context length is 128000 tokens.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        },
    ),
    "responses": sse(
        "response.incomplete",
        {
            "type": "response.incomplete",
            "sequence_number": 99,
            "response": {
                "id": "resp_x",
                "object": "response",
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "output": [],
            },
        },
    ),
    "anthropic": sse(
        "error",
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "prompt is too long: 250000 tokens > 200000 maximum",
            },
        },
    ),
}
MALFORMED = {
    "chat": b'data: {"choices":[{"index":0,"delta":{"content":"tru\n\n',
    "responses": b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","delta":"x"\n\n',
    "anthropic": b"event: content_block_delta\n"
    b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_de\n\n',
}


def kinds_of(protocol: Protocol, frames: list[bytes]) -> list[int]:
    clf = protocol.new_classifier()
    return [clf.classify(to_event(f))[0] for f in frames]


def feed_all(ledger: Ledger, frames: list[bytes]) -> list[bytes]:
    return [ledger.feed_bytes(to_event(f)) for f in frames]


def first_index(kinds: list[int], mask: int) -> int:
    return next(i for i, k in enumerate(kinds) if k & mask)


# ---------------------------------------------------------------------------
# Reading what the client saw


def visible_events(out: bytes) -> list[Event]:
    splitter = SSESplitter()
    events = splitter.feed(out)
    assert splitter.pending == b"", "the client must never see a cut frame"
    return events


def success_terminals(proto: str, events: list[Event]) -> list[Event]:
    found = []
    for e in events:
        if proto == "chat":
            if e.data == "[DONE]":
                found.append(e)
                continue
            obj = loads(e.data)
            if isinstance(obj, dict) and any(
                c.get("finish_reason") is not None for c in obj.get("choices") or []
            ):
                found.append(e)
        elif proto == "responses" and e.name == "response.completed":
            found.append(e)
        elif proto == "anthropic" and e.name == "message_stop":
            found.append(e)
    return found


def loads(data: str | None) -> Any:
    """Parse a frame's JSON, or None (trailing frames after DONE pass through as-is)."""
    try:
        return json.loads(data or "null")
    except ValueError:
        return None


def is_error_event(proto: str, e: Event) -> bool:
    if proto == "chat":
        obj = loads(e.data)
        return isinstance(obj, dict) and obj.get("error") is not None
    if proto == "responses":
        return e.name in ("error", "response.failed", "response.incomplete")
    return e.name == "error"


def check_tool_calls(proto: str, events: list[Event]) -> None:
    """Every visible tool call is complete, visible once, with its whole arguments."""
    args: dict[str, str] = {}
    closed: set[str] = set()
    order: list[str] = []
    if proto == "chat":
        by_index: dict[int, str] = {}
        for e in events:
            obj = loads(e.data)
            if not isinstance(obj, dict):
                continue
            for choice in obj.get("choices") or []:
                for call in (choice.get("delta") or {}).get("tool_calls") or []:
                    if call.get("id"):
                        assert call["id"] not in args, f"tool call {call['id']} visible twice"
                        by_index[call["index"]] = call["id"]
                        args[call["id"]] = ""
                        order.append(call["id"])
                    args[by_index[call["index"]]] += call["function"].get("arguments", "")
                if choice.get("finish_reason") is not None:
                    closed.update(by_index.values())
    elif proto == "responses":
        for e in events:
            obj = loads(e.data)
            if not isinstance(obj, dict):
                continue
            if e.name == "response.output_item.added" and obj["item"]["type"] == "function_call":
                fid = obj["item"]["id"]
                assert fid not in args, f"tool call {fid} visible twice"
                args[fid] = ""
                order.append(fid)
            elif e.name == "response.function_call_arguments.delta":
                args[obj["item_id"]] += obj["delta"]
            elif e.name == "response.output_item.done" and obj["item"]["type"] == "function_call":
                assert obj["item"]["arguments"] == args[obj["item"]["id"]]
                closed.add(obj["item"]["id"])
    else:
        by_block: dict[int, str] = {}
        for e in events:
            obj = loads(e.data)
            if not isinstance(obj, dict):
                continue
            if e.name == "content_block_start" and obj["content_block"]["type"] == "tool_use":
                tid = obj["content_block"]["id"]
                assert tid not in args, f"tool call {tid} visible twice"
                by_block[obj["index"]] = tid
                args[tid] = ""
                order.append(tid)
            elif e.name == "content_block_delta" and obj["index"] in by_block:
                args[by_block[obj["index"]]] += obj["delta"]["partial_json"]
            elif e.name == "content_block_stop" and obj["index"] in by_block:
                closed.add(by_block[obj["index"]])
    for call_id in order:
        assert call_id in closed, f"tool call {call_id} visible but never completed"
        assert json.loads(args[call_id]) == {"command": f"echo {call_id}"}, "partial arguments"


# ---------------------------------------------------------------------------
# Transition tables


def test_hold_choices_validated() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Hold(["control", "bogus"])
    assert Hold().tools and not Hold().all
    assert Hold(["all"]).tools and Hold(["all"]).all
    assert not Hold(["control"]).tools


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_control_frames_held_then_released_in_order_with_first_output(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=2))
    kinds = kinds_of(protocol, frames)
    first_out = first_index(kinds, Kind.OUTPUT)
    assert first_out > 0 and all(k == Kind.CONTROL for k in kinds[:first_out])
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames)
    assert outs[:first_out] == [b""] * first_out
    assert outs[first_out] == b"".join(frames[: first_out + 1])
    assert b"".join(outs) == b"".join(frames)
    assert ledger.state is LedgerState.DONE and ledger.verdict is Verdict.DONE
    assert ledger.stats.released_bytes == len(b"".join(frames))
    assert ledger.released_frames == len(frames)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_state_commits_exactly_at_first_release(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1))
    ledger = Ledger(protocol)
    for f in frames:
        before = ledger.state
        out = ledger.feed_bytes(to_event(f))
        if before is LedgerState.PENDING and out and ledger.state is not LedgerState.DONE:
            assert ledger.state is LedgerState.COMMITTED
        if not out:
            assert ledger.state is before
    assert ledger.state is LedgerState.DONE


def test_without_control_hold_control_frames_commit() -> None:
    frames = responses_frames("A0Z", Shape(text=1))
    ledger = Ledger(RESPONSES, hold=Hold(["tool_calls"]))
    assert ledger.feed_bytes(to_event(frames[0])) == frames[0]  # response.created released at once
    assert ledger.state is LedgerState.COMMITTED
    assert ledger.failed("reset") != b""
    assert ledger.verdict is Verdict.FAIL


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_tool_call_held_until_end_then_released_whole(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=0, tools=(3,)))
    kinds = kinds_of(protocol, frames)
    end = first_index(kinds, Kind.TOOL_END)
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames)
    assert outs[:end] == [b""] * end
    assert ledger.state is LedgerState.DONE
    assert outs[end] == b"".join(frames[: end + 1])  # everything held, whole, in order
    assert b"".join(outs) == b"".join(frames)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_second_tool_call_held_after_commit(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(2, 2)))
    kinds = kinds_of(protocol, frames)
    starts = [i for i, k in enumerate(kinds) if k & Kind.TOOL_START]
    ends = [i for i, k in enumerate(kinds) if k & Kind.TOOL_END]
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames)
    assert b"".join(outs) == b"".join(frames)
    if proto == "chat":  # all calls close together at finish_reason
        assert outs[ends[0]] == b"".join(frames[starts[0] : ends[0] + 1])
    else:
        for s, e in zip(starts, ends, strict=True):
            assert outs[s:e] == [b""] * (e - s)
            assert outs[e] == b"".join(frames[s : e + 1])


def test_chat_parallel_tool_calls_released_only_at_finish_reason() -> None:
    frames = chat_frames("A0Z", Shape(text=0, tools=(2, 3, 1), interleave=True))
    kinds = kinds_of(CHAT, frames)
    finish = first_index(kinds, Kind.TERMINAL_OK)
    ledger = Ledger(CHAT)
    outs = feed_all(ledger, frames)
    assert outs[:finish] == [b""] * finish
    assert outs[finish] == b"".join(frames[: finish + 1])
    check_tool_calls("chat", visible_events(b"".join(outs)))


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("how", ["reset", "end", "cut", "retryable", "malformed"])
def test_failure_while_pending_replays_and_releases_nothing(proto: str, how: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=0, tools=(3, 2)))
    kinds = kinds_of(protocol, frames)
    commit = first_index(kinds, Kind.TOOL_END)
    for k in range(commit + 1):  # fault after k frames, before the first release
        ledger = Ledger(protocol)
        assert b"".join(feed_all(ledger, frames[:k])) == b""
        if how == "reset":
            out = ledger.failed("connection reset")
        elif how == "end":
            out = ledger.ended(b"")
        elif how == "cut":
            out = ledger.ended(frames[k][:7])
        elif how == "retryable":
            out = ledger.feed_bytes(to_event(RETRYABLE_ERROR[proto]))
        else:
            out = ledger.feed_bytes(to_event(MALFORMED[proto]))
        assert out == b""
        assert ledger.verdict is Verdict.REPLAY
        assert ledger.state is LedgerState.PENDING and ledger.replayable
        assert ledger.stats.released_bytes == 0
        assert ledger.held_bytes == 0
        assert ledger.fail_reason


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_replay_then_clean_attempt_releases_exactly_that_attempt(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    shape = Shape(reasoning=0, text=0, tools=(3, 2))
    first = BUILDERS[proto]("A0Z", shape)
    second = BUILDERS[proto]("A1Z", shape)
    cut_at = first_index(kinds_of(protocol, first), Kind.TOOL_DELTA) + 1
    ledger = Ledger(protocol)
    out = b"".join(feed_all(ledger, first[:cut_at]))
    out += ledger.failed("reset")
    assert ledger.verdict is Verdict.REPLAY
    ledger.start_attempt()
    assert verdict(ledger) is Verdict.CONTINUE
    out += b"".join(feed_all(ledger, second))
    out += ledger.ended(b"")
    assert out == b"".join(second)
    assert b"A0Z" not in out
    assert state(ledger) is LedgerState.DONE and verdict(ledger) is Verdict.DONE


def _committed_prefix(proto: str) -> tuple[list[bytes], int]:
    frames = BUILDERS[proto]("A0Z", Shape(text=3, tools=(3,)))
    commit = first_index(kinds_of(PROTOCOLS[proto], frames), Kind.OUTPUT)
    return frames, commit


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("how", ["reset", "end", "cut", "retryable", "malformed"])
def test_failure_after_commit_ends_with_native_error(proto: str, how: str) -> None:
    protocol = PROTOCOLS[proto]
    frames, commit = _committed_prefix(proto)
    terminal = first_index(kinds_of(protocol, frames), Kind.TERMINAL_OK)
    for k in range(commit + 1, terminal):
        ledger = Ledger(protocol)
        out = b"".join(feed_all(ledger, frames[:k]))
        assert ledger.state is LedgerState.COMMITTED
        if how == "reset":
            tail = ledger.failed("connection reset")
        elif how == "end":
            tail = ledger.ended(b"")
        elif how == "cut":
            tail = ledger.ended(frames[k][:5])
        elif how == "retryable":
            tail = ledger.feed_bytes(to_event(RETRYABLE_ERROR[proto]))
        else:
            tail = ledger.feed_bytes(to_event(MALFORMED[proto]))
        assert ledger.verdict is Verdict.FAIL and state(ledger) is LedgerState.FAILED
        assert tail == ledger.error_bytes != b""
        assert RETRYABLE_ERROR[proto] not in tail  # ours, not the provider's frame
        client = visible_events(out + tail)
        assert not success_terminals(proto, client)
        assert is_error_event(proto, client[-1])
        check_tool_calls(proto, client)  # a cut tool call is never visible
        # nothing more after the error, whatever arrives
        assert ledger.feed_bytes(to_event(frames[k])) == b""
        assert ledger.failed("again") == b""
        assert ledger.ended(b"") == b""
        assert ledger.stats.released_bytes == len(out + tail)


def test_chat_native_error_shape() -> None:
    frames, commit = _committed_prefix("chat")
    ledger = Ledger(CHAT)
    feed_all(ledger, frames[: commit + 1])
    tail = ledger.failed("reset")
    (event,) = visible_events(tail)
    assert event.name is None
    body = json.loads(event.data or "")
    assert body["error"]["type"] == "server_error"
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert b"[DONE]" not in tail
    assert CHAT.new_classifier().classify(event)[0] == Kind.TERMINAL_ERROR | Kind.RETRYABLE


def test_responses_native_error_reuses_response_id() -> None:
    frames, commit = _committed_prefix("responses")
    ledger = Ledger(RESPONSES)
    feed_all(ledger, frames[: commit + 2])
    last_seq = json.loads(to_event(frames[commit + 1]).data or "")["sequence_number"]
    tail = ledger.failed("reset")
    events = visible_events(tail)
    assert events[-1].name == "response.failed"
    failed = json.loads(events[-1].data or "")
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["id"] == "resp_A0Z"
    assert failed["response"]["model"] == "gpt-5"
    seqs = [json.loads(e.data or "")["sequence_number"] for e in events]
    assert seqs == list(range(last_seq + 1, last_seq + 1 + len(events)))
    for e in events:
        assert e.name in ("error", "response.failed")
        kinds = RESPONSES.new_classifier().classify(e)[0]
        assert kinds == Kind.TERMINAL_ERROR | Kind.RETRYABLE
    assert b"response.completed" not in tail


def test_anthropic_native_error_is_overloaded() -> None:
    frames, commit = _committed_prefix("anthropic")
    ledger = Ledger(ANTHROPIC)
    feed_all(ledger, frames[: commit + 1])
    tail = ledger.failed("reset")
    (event,) = visible_events(tail)
    assert event.name == "error"
    body = json.loads(event.data or "")
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"
    assert b"message_stop" not in tail


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_cut_mid_tool_call_after_commit_drops_the_partial_call(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(4,)))
    kinds = kinds_of(protocol, frames)
    start = first_index(kinds, Kind.TOOL_START)
    end = first_index(kinds, Kind.TOOL_END)
    for k in range(start + 1, end):
        ledger = Ledger(protocol)
        out = b"".join(feed_all(ledger, frames[:k]))
        assert out == b"".join(frames[:start])
        assert ledger.open_tools == 1
        tail = ledger.failed("reset")
        assert ledger.verdict is Verdict.FAIL
        assert ledger.held_bytes == 0
        client = visible_events(out + tail)
        check_tool_calls(proto, client)
        assert b"call_" not in out and b"fc_" not in out and b"toolu_" not in out


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_clean_end_without_terminal(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=2))
    kinds = kinds_of(protocol, frames)
    terminal = first_index(kinds, Kind.TERMINAL_OK)
    pending = Ledger(protocol)
    feed_all(pending, frames[:1])
    assert pending.ended(b"") == b"" and pending.verdict is Verdict.REPLAY
    committed = Ledger(protocol)
    feed_all(committed, frames[:terminal])
    tail = committed.ended(b"")
    assert committed.verdict is Verdict.FAIL and tail == committed.error_bytes != b""
    assert committed.fail_reason
    done = Ledger(protocol)
    feed_all(done, frames[: terminal + 1])
    assert done.ended(b"") == b"" and done.verdict is Verdict.DONE


def test_chat_end_after_finish_reason_before_done_is_complete() -> None:
    frames = chat_frames("A0Z", Shape(text=2))
    ledger = Ledger(CHAT)
    out = b"".join(feed_all(ledger, frames[:-2]))  # up to finish_reason, no usage, no [DONE]
    assert ledger.state is LedgerState.DONE
    assert ledger.failed("reset") == b""
    assert ledger.verdict is Verdict.DONE
    assert ledger.ended(b"") == b""
    assert out == b"".join(frames[:-2])


def test_trailing_frames_after_terminal_ok_are_released() -> None:
    frames = chat_frames("A0Z", Shape(text=1))
    ledger = Ledger(CHAT)
    feed_all(ledger, frames[:-2])
    assert ledger.verdict is Verdict.DONE
    assert ledger.feed_bytes(to_event(frames[-2])) == frames[-2]  # usage chunk
    assert ledger.feed_bytes(to_event(frames[-1])) == frames[-1]  # [DONE]
    assert ledger.feed_bytes(to_event(b": trailing\n\n")) == b": trailing\n\n"
    assert ledger.verdict is Verdict.DONE and ledger.state is LedgerState.DONE


def test_generic_protocol() -> None:
    ledger = Ledger(GENERIC)
    assert ledger.feed_bytes(to_event(b": hello\n\n")) == b""  # CONTROL held while pending
    assert ledger.feed_bytes(to_event(b"data: 1\n\n")) == b": hello\n\ndata: 1\n\n"
    assert ledger.state is LedgerState.COMMITTED
    assert ledger.ended(b"") == b""
    assert state(ledger) is LedgerState.DONE and ledger.verdict is Verdict.DONE

    cut = Ledger(GENERIC)
    cut.feed(to_event(b"data: 1\n\n"))
    tail = cut.ended(b"data: partial")
    assert cut.verdict is Verdict.FAIL and tail
    (event,) = visible_events(tail)
    assert event.name == "error"

    empty = Ledger(GENERIC)
    assert empty.ended(b"") == b"" and empty.verdict is Verdict.DONE


def test_generic_stream_with_trailing_blank_line_completes() -> None:
    """Regression (splitter + ledger, as the relay wires them): not a truncation."""
    stream = b"data: 1\n\ndata: 2\n\n\n"
    for i in range(len(stream) + 1):
        splitter = SSESplitter()
        ledger = Ledger(GENERIC)
        out = b""
        for chunk in (stream[:i], stream[i:]):
            for event in splitter.feed(chunk):
                out += ledger.feed_bytes(event)
        out += ledger.ended(splitter.pending)
        assert ledger.state is LedgerState.DONE, i
        assert out == stream


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_byte_level_truncation_at_every_offset(proto: str) -> None:
    """The connection dies after any byte: the client never sees a cut frame."""
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(reasoning=1, text=2, tools=(2,)))
    stream = b"".join(frames)
    boundaries = {sum(len(f) for f in frames[:k]) for k in range(len(frames) + 1)}
    for i in range(len(stream) + 1):
        splitter = SSESplitter()
        ledger = Ledger(protocol)
        out = b"".join(ledger.feed_bytes(e) for e in splitter.feed(stream[:i]))
        out += ledger.ended(splitter.pending)
        if ledger.state is LedgerState.DONE:
            assert len(out) in boundaries and stream.startswith(out)
            assert success_terminals(proto, visible_events(out))
        elif ledger.verdict is Verdict.REPLAY:
            assert out == b""
        else:
            assert ledger.verdict is Verdict.FAIL
            body = out[: len(out) - len(ledger.error_bytes)]
            assert out.endswith(ledger.error_bytes) and ledger.error_bytes
            assert len(body) in boundaries and stream.startswith(body)
            client = visible_events(out)
            assert not success_terminals(proto, client)
            check_tool_calls(proto, client)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_hold_all_holds_everything_until_terminal(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(reasoning=1, text=3, tools=(2,)))
    kinds = kinds_of(protocol, frames)
    terminal = first_index(kinds, Kind.TERMINAL_OK)
    for k in range(terminal + 1):  # any failure before the terminal replays
        ledger = Ledger(protocol, hold=Hold(["all"]))
        assert b"".join(feed_all(ledger, frames[:k])) == b""
        ledger.failed("reset")
        assert ledger.verdict is Verdict.REPLAY
    ledger = Ledger(protocol, hold=Hold(["all"]))
    outs = feed_all(ledger, frames)
    assert outs[:terminal] == [b""] * terminal
    assert outs[terminal] == b"".join(frames[: terminal + 1])
    assert b"".join(outs) == b"".join(frames)


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_hold_reasoning(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(reasoning=3, text=2))
    kinds = kinds_of(protocol, frames)
    first_r = first_index(kinds, Kind.REASONING)
    last_r = max(i for i, k in enumerate(kinds) if k & Kind.REASONING)
    # default: the first reasoning frame commits
    ledger = Ledger(protocol)
    outs = feed_all(ledger, frames[: first_r + 1])
    assert outs[-1] == b"".join(frames[: first_r + 1])
    ledger.failed("reset")
    assert ledger.verdict is Verdict.FAIL
    # with "reasoning": held while pending, a failure inside the thinking replays
    held = Ledger(protocol, hold=Hold(["control", "tool_calls", "reasoning"]))
    assert b"".join(feed_all(held, frames[: last_r + 1])) == b""
    held.failed("stall")
    assert held.verdict is Verdict.REPLAY


@pytest.mark.parametrize(
    ("hold", "reasoning"),
    [(("control", "tool_calls"), 0), (("control", "tool_calls", "reasoning"), 2)],
    ids=["default-hold-no-summary", "hold-reasoning-with-summary"],
)
def test_responses_reasoning_item_does_not_commit(hold: tuple[str, ...], reasoning: int) -> None:
    """Regression: a reasoning item's output_item.done committed the turn.

    Then a cut inside the following function call was FAIL instead of REPLAY.
    """
    frames = responses_frames(
        "A0Z", Shape(reasoning=reasoning, text=0, tools=(3,)), reasoning_item=True
    )
    kinds = kinds_of(RESPONSES, frames)
    cut_at = first_index(kinds, Kind.TOOL_DELTA) + 1
    ledger = Ledger(RESPONSES, hold=Hold(hold))
    out = b"".join(feed_all(ledger, frames[:cut_at]))
    ledger.failed("reset")
    assert out == b""
    assert ledger.verdict is Verdict.REPLAY


def test_max_hold_bytes_overflow_releases_and_commits() -> None:
    frames = chat_frames("A0Z", Shape(text=6))
    limit = sum(len(f) for f in frames[:3])
    ledger = Ledger(CHAT, hold=Hold(["all"]), max_hold_bytes=limit)
    outs = feed_all(ledger, frames[:4])
    assert outs[:3] == [b"", b"", b""]
    assert outs[3] == b"".join(frames[:4])  # the frame that crossed the limit releases all
    assert ledger.hold_overflowed
    assert ledger.state is LedgerState.COMMITTED
    assert ledger.held_bytes == 0
    tail = ledger.failed("reset")
    assert ledger.verdict is Verdict.FAIL and tail == ledger.error_bytes


def test_max_hold_bytes_overflow_of_a_huge_tool_call() -> None:
    frames = anthropic_frames("A0Z", Shape(text=0, tools=(40,)))
    ledger = Ledger(ANTHROPIC, max_hold_bytes=1000)
    out = b"".join(feed_all(ledger, frames))
    assert ledger.hold_overflowed
    assert out == b"".join(frames)  # nothing lost, nothing reordered
    assert ledger.state is LedgerState.DONE


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_non_retryable_error_while_pending_passes_through(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=2))
    ledger = Ledger(protocol)
    assert feed_all(ledger, frames[:1]) == [b""]
    out = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert out == frames[0] + FATAL_ERROR[proto]  # with what was held
    assert ledger.state is LedgerState.FAILED and ledger.verdict is Verdict.FAIL
    assert ledger.error_bytes == b""
    assert ledger.fail_reason
    assert ledger.failed("reset") == b""
    assert ledger.ended(b"") == b""
    with pytest.raises(LedgerError):
        ledger.start_attempt()


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_non_retryable_error_after_commit_passes_through_without_partial_call(
    proto: str,
) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(3,)))
    kinds = kinds_of(protocol, frames)
    start = first_index(kinds, Kind.TOOL_START)
    ledger = Ledger(protocol)
    out = b"".join(feed_all(ledger, frames[: start + 2]))
    assert out == b"".join(frames[:start])
    tail = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert tail == FATAL_ERROR[proto]
    assert ledger.verdict is Verdict.FAIL
    check_tool_calls(proto, visible_events(out + tail))


@pytest.mark.parametrize(
    ("proto", "hold"),
    [
        ("responses", ("control", "tool_calls")),
        ("anthropic", ("control", "tool_calls")),
        ("chat", ("all",)),
    ],
)
def test_non_retryable_error_keeps_held_frames_before_partial_call(
    proto: str, hold: tuple[str, ...]
) -> None:
    """Regression: a final error with an open tool call dropped *all* held frames."""
    protocol = PROTOCOLS[proto]
    shape = Shape(text=2 if hold == ("all",) else 0, tools=(3,))
    frames = BUILDERS[proto]("A0Z", shape)
    kinds = kinds_of(protocol, frames)
    start = first_index(kinds, Kind.TOOL_START)
    ledger = Ledger(protocol, hold=Hold(hold))
    assert b"".join(feed_all(ledger, frames[: start + 2])) == b""
    out = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert out == b"".join(frames[:start]) + FATAL_ERROR[proto]


@pytest.mark.parametrize("proto", ["responses", "anthropic"])
def test_non_retryable_error_keeps_a_complete_held_call_and_drops_the_partial_one(
    proto: str,
) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1, tools=(2, 3)))
    kinds = kinds_of(protocol, frames)
    second = [i for i, k in enumerate(kinds) if k & Kind.TOOL_START][1]
    ledger = Ledger(protocol, hold=Hold(["all"]))
    assert b"".join(feed_all(ledger, frames[: second + 2])) == b""
    out = ledger.feed_bytes(to_event(FATAL_ERROR[proto]))
    assert out == b"".join(frames[:second]) + FATAL_ERROR[proto]
    check_tool_calls(proto, visible_events(out)[:-1])


@pytest.mark.parametrize("hold", [("control", "tool_calls"), ("all",)])
def test_non_retryable_error_after_a_chunk_starting_two_calls(hold: tuple[str, ...]) -> None:
    text = 1 if hold == ("all",) else 0
    frames = chat_frames("A0Z", Shape(text=text))[: 1 + text]  # role (+ text)
    both = sse(
        None,
        {
            "id": "chatcmpl-A0Z",
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": None,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_a",
                                "type": "function",
                                "function": {"name": "bash", "arguments": ""},
                            },
                            {
                                "index": 1,
                                "id": "call_b",
                                "type": "function",
                                "function": {"name": "bash", "arguments": ""},
                            },
                        ]
                    },
                }
            ],
        },
    )
    ledger = Ledger(CHAT, hold=Hold(hold))
    assert b"".join(feed_all(ledger, [*frames, both])) == b""
    assert ledger.open_tools == 2
    out = ledger.feed_bytes(to_event(FATAL_ERROR["chat"]))
    assert out == b"".join(frames) + FATAL_ERROR["chat"]


def test_retryable_error_after_commit_is_replaced_by_ours() -> None:
    frames = anthropic_frames("A0Z", Shape(text=2))
    commit = first_index(kinds_of(ANTHROPIC, frames), Kind.OUTPUT)
    ledger = Ledger(ANTHROPIC)
    feed_all(ledger, frames[: commit + 1])
    tail = ledger.feed_bytes(to_event(RETRYABLE_ERROR["anthropic"]))
    assert tail == ledger.error_bytes
    assert tail != RETRYABLE_ERROR["anthropic"]
    assert ledger.fail_reason


def test_unknown_frame_commits_with_held_control() -> None:
    frames = responses_frames("A0Z", Shape(text=1))
    ledger = Ledger(RESPONSES)
    feed_all(ledger, frames[:2])
    unknown = sse(
        "response.brand_new_event", {"type": "response.brand_new_event", "sequence_number": 2}
    )
    assert ledger.feed_bytes(to_event(unknown)) == frames[0] + frames[1] + unknown
    assert ledger.state is LedgerState.COMMITTED


def test_hold_seconds_with_fake_clock() -> None:
    now = [100.0]
    ledger = Ledger(CHAT, clock=lambda: now[0])
    frames = chat_frames("A0Z", Shape(text=1, tools=(2,)))
    kinds = kinds_of(CHAT, frames)
    ledger.feed_bytes(to_event(frames[0]))  # role chunk held at t=100
    now[0] = 102.5
    assert ledger.feed_bytes(to_event(frames[1]))  # text: released
    assert ledger.stats.hold_seconds == pytest.approx(2.5)
    now[0] = 200.0
    start = first_index(kinds, Kind.TOOL_START)
    assert ledger.feed_bytes(to_event(frames[start])) == b""  # tool call held at t=200
    now[0] = 203.0
    for f in frames[start + 1 : -3]:
        assert ledger.feed_bytes(to_event(f)) == b""
    now[0] = 201.0 + 3.0
    assert ledger.feed_bytes(to_event(frames[-3]))  # finish_reason releases the call at t=204
    assert ledger.stats.hold_seconds == pytest.approx(6.5)


def test_hold_seconds_without_clock_stays_zero() -> None:
    ledger = Ledger(CHAT)
    feed_all(ledger, chat_frames("A0Z", Shape(text=1)))
    assert ledger.stats.hold_seconds == 0.0


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_start_attempt_only_while_pending(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1))
    commit = first_index(kinds_of(protocol, frames), Kind.OUTPUT)
    ledger = Ledger(protocol)
    feed_all(ledger, frames[:commit])
    ledger.start_attempt()  # still pending: fine (and drops nothing visible)
    feed_all(ledger, frames[: commit + 1])
    with pytest.raises(LedgerError, match="committed"):
        ledger.start_attempt()
    feed_all(ledger, frames[commit + 1 :])
    with pytest.raises(LedgerError, match="done"):
        ledger.start_attempt()
    failed = Ledger(protocol)
    failed.give_up("exhausted")
    with pytest.raises(LedgerError, match="failed"):
        failed.start_attempt()


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_give_up_while_pending_sends_only_the_native_error(proto: str) -> None:
    protocol = PROTOCOLS[proto]
    frames = BUILDERS[proto]("A0Z", Shape(text=1))
    ledger = Ledger(protocol)
    feed_all(ledger, frames[:1])
    tail = ledger.give_up("retries exhausted")
    assert tail == ledger.error_bytes != b""
    assert frames[0] not in tail
    assert ledger.state is LedgerState.FAILED and ledger.verdict is Verdict.FAIL
    assert ledger.fail_reason == "retries exhausted"
    client = visible_events(tail)
    assert is_error_event(proto, client[-1])
    assert not success_terminals(proto, client)
    assert ledger.feed_bytes(to_event(frames[1])) == b""


# ---------------------------------------------------------------------------
# Property: random fault schedules over random successful streams

FAULTS = ("none", "reset", "end", "cut", "retryable", "malformed", "fatal")
HOLDS = (
    ("control", "tool_calls"),
    ("tool_calls",),
    ("control", "tool_calls", "reasoning"),
    ("all",),
)


@dataclass
class Attempt:
    frames: list[bytes]
    fault: str
    pos: int
    received: list[bytes] = field(default_factory=list)


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    n_tools = draw(st.integers(0, 3))
    text = draw(st.integers(0 if n_tools else 1, 3))
    return Shape(
        reasoning=draw(st.integers(0, 2)),
        text=text,
        tools=tuple(draw(st.integers(1, 3)) for _ in range(n_tools)),
        interleave=draw(st.booleans()),
    )


@st.composite
def scenarios(draw: st.DrawFn, proto: str) -> tuple[tuple[str, ...], list[Attempt]]:
    hold = draw(st.sampled_from(HOLDS))
    attempts = []
    for a in range(draw(st.integers(1, 4))):
        frames = BUILDERS[proto](f"A{a}Z", draw(shapes()))
        fault = draw(st.sampled_from(FAULTS))
        pos = draw(st.integers(0, len(frames)))
        attempts.append(Attempt(frames, fault, pos))
    return hold, attempts


def drive(proto: str, hold: tuple[str, ...], attempts: list[Attempt]) -> tuple[Ledger, bytes, int]:
    """A minimal relay shell over the ledger: returns (ledger, client bytes, last attempt)."""
    protocol = PROTOCOLS[proto]
    ledger = Ledger(protocol, hold=Hold(hold))
    out = bytearray()
    last = 0
    for i, att in enumerate(attempts):
        if i > 0:
            # (c) a new attempt only ever follows a REPLAY, i.e. nothing was released
            assert ledger.verdict is Verdict.REPLAY
            assert ledger.state is LedgerState.PENDING and not out
            ledger.start_attempt()
        last = i
        stop = len(att.frames) if att.fault == "none" else att.pos
        for frame in att.frames[:stop]:
            att.received.append(frame)
            out += ledger.feed_bytes(to_event(frame))
            assert ledger.verdict is not Verdict.REPLAY
        if att.fault in ("none", "end"):
            out += ledger.ended(b"")
        elif att.fault == "reset":
            out += ledger.failed("connection reset")
        elif att.fault == "cut":
            leftover = (
                att.frames[stop][: len(att.frames[stop]) // 2] if stop < len(att.frames) else b""
            )
            out += ledger.ended(leftover)
        else:
            frame = {"retryable": RETRYABLE_ERROR, "malformed": MALFORMED, "fatal": FATAL_ERROR}[
                att.fault
            ][proto]
            att.received.append(frame)
            out += ledger.feed_bytes(to_event(frame))
            if ledger.verdict in (Verdict.CONTINUE, Verdict.DONE):
                out += ledger.ended(b"")  # the upstream closes after its error
        if ledger.state is not LedgerState.PENDING:
            assert ledger.verdict is not Verdict.REPLAY
        if ledger.verdict is not Verdict.REPLAY:
            break
    if ledger.verdict is Verdict.REPLAY:  # attempts exhausted while pending
        out += ledger.give_up("retries exhausted")
    return ledger, bytes(out), last


def check_invariants(proto: str, hold: tuple[str, ...], attempts: list[Attempt]) -> None:
    ledger, out, last = drive(proto, hold, attempts)
    att = attempts[last]
    assert ledger.verdict in (Verdict.DONE, Verdict.FAIL)
    assert ledger.stats.released_bytes == len(out)
    # no byte of a dead attempt is visible
    for d in range(len(attempts)):
        if d != last:
            assert f"A{d}Z".encode() not in out
    prefixes = {b"".join(att.received[:k]): k for k in range(len(att.received) + 1)}
    client = visible_events(out)
    check_tool_calls(proto, [e for e in client if not is_error_event(proto, e)])
    if ledger.state is LedgerState.DONE:
        # (a) the client saw a frame-aligned prefix of exactly one attempt, the last,
        # that includes its success terminal; all of it when that attempt was clean
        assert out in prefixes
        assert success_terminals(proto, client)
        if att.fault == "none":
            assert out == b"".join(att.frames)
    else:
        # (d) a turn that did not complete ends with an error event, ours or the
        # provider's final one, never with a success terminal or a bare end
        assert ledger.state is LedgerState.FAILED and ledger.verdict is Verdict.FAIL
        assert client, "a failed turn must not end with a bare end of body"
        assert is_error_event(proto, client[-1])
        assert not success_terminals(proto, client)
        if ledger.error_bytes:
            assert out.endswith(ledger.error_bytes)
            assert out[: len(out) - len(ledger.error_bytes)] in prefixes
            for e in visible_events(ledger.error_bytes):
                kinds = PROTOCOLS[proto].new_classifier().classify(e)[0]
                assert kinds & Kind.TERMINAL_ERROR and kinds & Kind.RETRYABLE
        else:
            assert att.fault == "fatal"
            fatal = FATAL_ERROR[proto]
            assert out.endswith(fatal)
            assert out[: len(out) - len(fatal)] in prefixes or out in prefixes
    # hold "all": every failure before the terminal frame was replayable
    if hold == ("all",) and ledger.state is LedgerState.FAILED and not ledger.hold_overflowed:
        assert out == ledger.error_bytes or att.fault == "fatal"


@pytest.mark.parametrize("proto", PROTOCOLS)
def test_property_fault_schedules(proto: str) -> None:
    @settings(
        max_examples=250,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenario=scenarios(proto))
    def run(scenario: tuple[tuple[str, ...], list[Attempt]]) -> None:
        hold, attempts = scenario
        check_invariants(proto, hold, attempts)

    run()


@pytest.mark.parametrize("proto", PROTOCOLS)
@pytest.mark.parametrize("hold", HOLDS, ids=["-".join(h) for h in HOLDS])
def test_exhaustive_single_fault_then_clean_attempt(proto: str, hold: tuple[str, ...]) -> None:
    """Every fault at every position of a mixed stream, followed by a clean attempt."""
    shape = Shape(reasoning=1, text=2, tools=(2, 2), interleave=True)
    n = len(BUILDERS[proto]("A0Z", shape))
    for fault in FAULTS[1:]:
        for pos in range(n + 1):
            attempts = [
                Attempt(BUILDERS[proto]("A0Z", shape), fault, pos),
                Attempt(BUILDERS[proto]("A1Z", shape), "none", 0),
            ]
            check_invariants(proto, hold, attempts)
