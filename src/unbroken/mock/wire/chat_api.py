"""Chat Completions: the streamed chunks and the plain body of a reply."""

from __future__ import annotations

from typing import Any

from unbroken.mock.wire.frames import (
    _VAL,
    CREATED,
    SYSTEM_FINGERPRINT,
    _Item,
    _Run,
)
from unbroken.mock.wire.reply import MockReply


def _chat_usage(r: MockReply) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.total_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _chat_items(r: MockReply) -> list[_Item]:
    base = {
        "id": r.message_id,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": r.model,
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        payload = dict(base)
        payload["choices"] = [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ]
        if r.include_usage:
            payload["usage"] = None
        return payload

    items: list[_Item] = [(None, chunk({"role": "assistant", "content": ""}))]
    if r.pieces and r.calls:  # text_tool: the text, then the call
        items.append(_Run(None, chunk({"content": _VAL}), r.pieces))
    if r.calls:
        for call in r.calls:
            first = {
                "index": call.index,
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            items.append((None, chunk({"tool_calls": [first]})))
            frag = {"index": call.index, "function": {"arguments": _VAL}}
            items.append(_Run(None, chunk({"tool_calls": [frag]}), call.pieces))
        finish = "tool_calls"
    else:
        items.append(_Run(None, chunk({"content": _VAL}), r.pieces))
        finish = "stop"
    items.append((None, chunk({}, finish)))
    if r.include_usage:
        final = dict(base)
        final["choices"] = []
        final["usage"] = _chat_usage(r)
        items.append((None, final))
    items.append((None, "[DONE]"))
    return items


def _chat_body(r: MockReply) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": None if r.calls and not r.pieces else r.text,
        "refusal": None,
        "annotations": [],
    }
    if r.calls:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in r.calls
        ]
    return {
        "id": r.message_id,
        "object": "chat.completion",
        "created": CREATED,
        "model": r.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if r.calls else "stop",
            }
        ],
        "usage": _chat_usage(r),
        "service_tier": "default",
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
