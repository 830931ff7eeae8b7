"""OpenAI Responses: the streamed events and the plain body of a reply."""

from __future__ import annotations

from typing import Any

from unbroken.mock.wire.frames import (
    _SEQ,
    _VAL,
    CREATED,
    _Item,
    _Run,
)
from unbroken.mock.wire.reply import MockReply


def _responses_usage(r: MockReply) -> dict[str, Any]:
    return {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": r.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.total_tokens,
    }


def _response_object(
    r: MockReply,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    req = r.request
    return {
        "id": r.response_id,
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "background": req.get("background") is True,
        "completed_at": CREATED + 1 if status == "completed" else None,
        "error": error,
        "incomplete_details": None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "model": r.model,
        "output": output,
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": req.get("reasoning") or {"effort": None, "summary": None},
        "store": req.get("store", True),
        "temperature": req.get("temperature", 1.0),
        "text": req.get("text") or {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": req.get("tools") or [],
        "top_p": req.get("top_p", 1.0),
        "truncation": req.get("truncation", "disabled"),
        "usage": usage,
        "user": req.get("user"),
        "metadata": req.get("metadata") or {},
    }


def _responses_items(r: MockReply) -> list[_Item]:
    items: list[_Item] = []
    seq = 0

    def ev(name: str, **fields: Any) -> None:
        nonlocal seq
        items.append((name, {"type": name, "sequence_number": seq, **fields}))
        seq += 1

    def run(name: str, values: tuple[str, ...], **fields: Any) -> None:
        nonlocal seq
        template = {"type": name, "sequence_number": _SEQ, **fields}
        items.append(_Run(name, template, values, seq))
        seq += len(values)

    started = _response_object(r, "in_progress", [], None)
    if r.request.get("background") is True:
        # Background mode (`mock.background_store`): created and announced queued first.
        queued = _response_object(r, "queued", [], None)
        ev("response.created", response=queued)
        ev("response.queued", response=queued)
    else:
        ev("response.created", response=started)
    ev("response.in_progress", response=started)
    output: list[dict[str, Any]] = []
    if r.calls:
        for call in r.calls:
            i = call.index
            added = {
                "id": call.item_id,
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": call.call_id,
                "name": call.name,
            }
            ev("response.output_item.added", output_index=i, item=added)
            run(
                "response.function_call_arguments.delta",
                call.pieces,
                item_id=call.item_id,
                output_index=i,
                delta=_VAL,
            )
            ev(
                "response.function_call_arguments.done",
                item_id=call.item_id,
                output_index=i,
                arguments=call.arguments,
            )
            done = {**added, "status": "completed", "arguments": call.arguments}
            ev("response.output_item.done", output_index=i, item=done)
            output.append(done)
    else:
        mid = r.message_id
        ev(
            "response.output_item.added",
            output_index=0,
            item={
                "id": mid,
                "type": "message",
                "status": "in_progress",
                "content": [],
                "role": "assistant",
            },
        )
        empty_part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        ev(
            "response.content_part.added",
            item_id=mid,
            output_index=0,
            content_index=0,
            part=empty_part,
        )
        run(
            "response.output_text.delta",
            r.pieces,
            item_id=mid,
            output_index=0,
            content_index=0,
            delta=_VAL,
            logprobs=[],
        )
        ev(
            "response.output_text.done",
            item_id=mid,
            output_index=0,
            content_index=0,
            text=r.text,
            logprobs=[],
        )
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": r.text}
        ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
        item = {
            "id": mid,
            "type": "message",
            "status": "completed",
            "content": [part],
            "role": "assistant",
        }
        ev("response.output_item.done", output_index=0, item=item)
        output.append(item)
    ev("response.completed", response=_response_object(r, "completed", output, _responses_usage(r)))
    return items


def _responses_body(r: MockReply) -> dict[str, Any]:
    completed = _responses_items(r)[-1]
    assert isinstance(completed, tuple)
    body: dict[str, Any] = completed[1]["response"]
    return body
