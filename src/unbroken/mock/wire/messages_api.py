"""Anthropic Messages: the streamed events and the plain body of a reply."""

from __future__ import annotations

import json
from typing import Any

from unbroken.mock.wire.frames import (
    _VAL,
    _Item,
    _Run,
)
from unbroken.mock.wire.reply import MockReply


def _anthropic_start_usage(r: MockReply, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": r.prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _anthropic_items(r: MockReply) -> list[_Item]:
    message: dict[str, Any] = {
        "id": r.message_id,
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _anthropic_start_usage(r, 1),
    }
    items: list[_Item] = [("message_start", {"type": "message_start", "message": message})]
    blocks: list[tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = []
    if r.pieces or not r.calls:  # text (text_tool: the text, then the call)
        blocks.append(
            ({"type": "text", "text": ""}, {"type": "text_delta", "text": _VAL}, r.pieces)
        )
    for call in r.calls:
        block = {"type": "tool_use", "id": call.call_id, "name": call.name, "input": {}}
        blocks.append((block, {"type": "input_json_delta", "partial_json": _VAL}, call.pieces))
    stop_reason = "tool_use" if r.calls else "end_turn"
    for index, (block, delta, values) in enumerate(blocks):
        items.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        if index == 0:
            items.append(("ping", {"type": "ping"}))
        items.append(
            _Run(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
                values,
            )
        )
        items.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    items.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": r.completion_tokens},
            },
        )
    )
    items.append(("message_stop", {"type": "message_stop"}))
    return items


def _anthropic_body(r: MockReply) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if r.pieces or not r.calls:
        content.append({"type": "text", "text": r.text})
    content += [
        {"type": "tool_use", "id": c.call_id, "name": c.name, "input": json.loads(c.arguments)}
        for c in r.calls
    ]
    return {
        "id": r.message_id,
        "type": "message",
        "role": "assistant",
        "model": r.model,
        "content": content,
        "stop_reason": "tool_use" if r.calls else "end_turn",
        "stop_sequence": None,
        "usage": _anthropic_start_usage(r, r.completion_tokens),
    }
