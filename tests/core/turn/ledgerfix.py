"""Streams and checks for the commit ledger's tests (`core/test_ledger_*.py`).

Streams built here are real-shaped (OpenAI Chat Completions, OpenAI Responses,
Anthropic Messages).  Every attempt of a turn is tagged (``A0Z``, ``A1Z``, ...)
in its ids and texts, so the bytes the client saw can be traced back to the
attempt they came from.  The checks read what the client saw: its events, its
success terminals and errors, and its tool calls (each complete, visible once).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.core.turn.ledger import Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, RESPONSES, Protocol
from unbroken.core.wire.sse import Event, SSESplitter

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
