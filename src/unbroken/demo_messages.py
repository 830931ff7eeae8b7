"""``unbroken demo --protocol anthropic``: the demo's agent over Anthropic Messages.

A plain Messages client (aiohttp, no retries of its own, like the demo's Gemini
client): ``POST /v1/messages`` streamed, each ``event:`` frame read as the anthropic
SDK reads it: an ``error`` event is an error, a stream that ends without
``message_stop`` is a cut.  The storms are the chat ones in Messages terms
(`messages_storms`); with ``--after-commit continue`` the drop after output is continued by
prefill and the client sees no error at all.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import aiohttp

from unbroken.mock import frames_for

__all__ = [
    "MESSAGES_TOOLS",
    "TEXT_REPLY",
    "TOOL_REPLY",
    "MessagesStreamError",
    "messages_agent_turn",
    "messages_storms",
]

MESSAGES_TOOLS = [
    {
        "name": "bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    }
]
#: the mock's reply to a demo turn's two steps, in every demo (`unbroken.demo`,
#: `unbroken.demo_gemini`): a tool call, then its answer
TOOL_REPLY = {"reply": "tool"}
TEXT_REPLY = {"reply": "text"}
#: the Messages demo's answer: longer than the mock's default, so a drop after output
#: leaves text to come
LONG_TEXT_REPLY = {"reply": "text", "text": "Hello from the shell: the command ran, all is well."}


def messages_storms(
    retry_after_s: float, stall_s: float
) -> list[tuple[str, tuple[dict[str, Any], ...]]]:
    """(name, script) of each kind of turn (Messages frames: 1 ``message_start``, 2 the
    block's start, 3 a ping, then the deltas)."""
    return [
        ("503 burst", ({"status": 503, "count": 6}, TOOL_REPLY, LONG_TEXT_REPLY)),
        (
            "429 + Retry-After",
            (
                {"status": 429, "headers": {"Retry-After": f"{retry_after_s:g}"}},
                TOOL_REPLY,
                LONG_TEXT_REPLY,
            ),
        ),
        (
            "resets before output",
            (
                {"fault": "reset", "after_frame": 1, "reply": "tool", "count": 2},
                TOOL_REPLY,
                LONG_TEXT_REPLY,
            ),
        ),
        (
            "reset mid-tool-args",
            ({"fault": "reset", "after_deltas": 2, "reply": "tool"}, TOOL_REPLY, LONG_TEXT_REPLY),
        ),
        (
            "drop after output",
            (TOOL_REPLY, {**LONG_TEXT_REPLY, "fault": "reset", "after_deltas": 3}, LONG_TEXT_REPLY),
        ),
        (
            "stall",
            (
                {"fault": "stall", "after_frame": 1, "seconds": stall_s, "reply": "tool"},
                TOOL_REPLY,
                LONG_TEXT_REPLY,
            ),
        ),
    ]


class DemoTurnLike(Protocol):
    number: int
    key: str
    step: int
    state: str
    errors: int
    last_error: str | None
    chunks: int
    duplicates: int
    corrupted: int
    completed: bool
    lost: bool


class MessagesStreamError(Exception):
    """An error status, an ``error`` event, or a stream cut before ``message_stop``."""


def _expected(shape: dict[str, Any], request: dict[str, Any]) -> tuple[str, str]:
    """(text, tool arguments) of the clean reply the mock sends."""
    text, args = "", ""
    for frame in frames_for("anthropic", shape, request):
        data = frame.split(b"data: ", 1)[1]
        obj = json.loads(data)
        if obj.get("type") == "content_block_delta":
            delta = obj["delta"]
            text += delta.get("text", "")
            args += delta.get("partial_json", "")
    return text, args


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    turn: DemoTurnLike,
) -> tuple[int, str, str, str]:
    """One streamed Messages call: (message_starts, text, tool arguments, tool id)."""
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise MessagesStreamError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        turn.state = "streaming"
        starts, text, args, tool_id, stopped = 0, "", "", "", False
        name: str | None = None
        async for raw in resp.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("event:"):
                name = line[6:].strip()
                continue
            if not line.startswith("data:"):
                continue
            obj = json.loads(line[5:])
            if name == "error":
                raise MessagesStreamError(f"error event: {obj.get('error')}")
            if name == "message_start":
                starts += 1
            elif name == "content_block_start":
                block = obj.get("content_block") or {}
                tool_id = tool_id or block.get("id", "")
            elif name == "content_block_delta":
                turn.chunks += 1
                delta = obj.get("delta") or {}
                text += delta.get("text", "")
                args += delta.get("partial_json", "")
            elif name == "message_stop":
                stopped = True
        if not stopped:
            raise MessagesStreamError("the stream ended without message_stop")
        return starts, text, args, tool_id


async def messages_agent_turn(
    session: aiohttp.ClientSession, base_url: str, turn: DemoTurnLike, model: str, retries: int
) -> None:
    """The demo's agent over Messages: a tool call, its result, the answer."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Task {turn.number}: say hello from the shell."}
    ]
    headers = {
        "x-mock-key": turn.key,
        "x-session-id": f"demo-session-{turn.number}",
        "anthropic-version": "2023-06-01",
        "x-api-key": "demo-no-key-needed",
    }
    url = f"{base_url}/v1/messages"
    for step, shape in enumerate((TOOL_REPLY, LONG_TEXT_REPLY)):
        turn.step = step
        request = {
            "model": model,
            "max_tokens": 1024,
            "system": "You are a coding agent. Use the bash tool.",
            "messages": messages,
            "tools": MESSAGES_TOOLS,
            "stream": True,
        }
        want_text, want_args = _expected(shape, request)
        for _try in range(1 + retries):
            turn.state = "requesting"
            try:
                starts, text, args, tool_id = await _stream(session, url, request, headers, turn)
            except (MessagesStreamError, aiohttp.ClientError, TimeoutError) as exc:
                turn.errors += 1
                turn.last_error = type(exc).__name__
                turn.state = "retrying"
                continue
            turn.duplicates += max(0, starts - 1) + (len(text) > len(want_text))
            if text != want_text or args != want_args:
                turn.corrupted += 1
            break
        else:
            turn.state = "LOST"
            turn.lost = True
            return
        if shape is TOOL_REPLY:
            call = {"type": "tool_use", "id": tool_id, "name": "bash", "input": json.loads(args)}
            result = {"type": "tool_result", "tool_use_id": tool_id, "content": "hello"}
            messages = [
                *messages,
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
            ]
    turn.step = 2
    turn.state = "done"
    turn.completed = True
