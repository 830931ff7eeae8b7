"""``unbroken demo --protocol anthropic``: the demo's agent over Anthropic Messages.

A plain Messages client (aiohttp, no retries of its own, like the demo's Gemini
client): ``POST /v1/messages`` streamed, each ``event:`` frame read as the anthropic
SDK reads it: an ``error`` event is an error, a stream that ends without
``message_stop`` is a cut.  The storms are the chat ones in Messages terms
(`messages_storms`); with ``--after-commit continue`` the drop after output is continued by
prefill and the client sees no error at all.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from unbroken.demo.agent_loop import (
    BASH_DESCRIPTION,
    BASH_SCHEMA,
    BASH_TOOL,
    MODEL,
    SYSTEM_PROMPT,
    TOOL_REPLY,
    Agent,
    DemoProtocol,
    DemoTurn,
    StepReply,
    Storm,
    demo_session,
    task_prompt,
)
from unbroken.mock import frames_for

__all__ = [
    "LONG_TEXT_REPLY",
    "MESSAGES_DEMO",
    "MESSAGES_TOOLS",
    "MessagesAgent",
    "MessagesStreamError",
    "messages_storms",
]

MESSAGES_TOOLS = [{"name": BASH_TOOL, "description": BASH_DESCRIPTION, "input_schema": BASH_SCHEMA}]
#: the Messages demo's answer: longer than the mock's default, so a drop after output
#: leaves text to come
LONG_TEXT_REPLY = {"reply": "text", "text": "Hello from the shell: the command ran, all is well."}


def messages_storms(retry_after_s: float, stall_s: float) -> list[Storm]:
    """The storm of each kind of turn (Messages frames: 1 ``message_start``, 2 the
    block's start, 3 a ping, then the deltas)."""
    return [
        Storm("503 burst", ({"status": 503, "count": 6}, TOOL_REPLY, LONG_TEXT_REPLY)),
        Storm(
            "429 + Retry-After",
            (
                {"status": 429, "headers": {"Retry-After": f"{retry_after_s:g}"}},
                TOOL_REPLY,
                LONG_TEXT_REPLY,
            ),
        ),
        Storm(
            "resets before output",
            (
                {"fault": "reset", "after_frame": 1, "reply": "tool", "count": 2},
                TOOL_REPLY,
                LONG_TEXT_REPLY,
            ),
        ),
        Storm(
            "reset mid-tool-args",
            ({"fault": "reset", "after_deltas": 2, "reply": "tool"}, TOOL_REPLY, LONG_TEXT_REPLY),
        ),
        Storm(
            "drop after output",
            (TOOL_REPLY, {**LONG_TEXT_REPLY, "fault": "reset", "after_deltas": 3}, LONG_TEXT_REPLY),
        ),
        Storm(
            "stall",
            (
                {"fault": "stall", "after_frame": 1, "seconds": stall_s, "reply": "tool"},
                TOOL_REPLY,
                LONG_TEXT_REPLY,
            ),
        ),
    ]


class MessagesStreamError(Exception):
    """An error status, an ``error`` event, or a stream cut before ``message_stop``."""


class MessagesAgent:
    """One turn's agent over Messages: ``POST /v1/messages``, streamed."""

    shapes = (TOOL_REPLY, LONG_TEXT_REPLY)
    failures: tuple[type[BaseException], ...] = (
        MessagesStreamError,
        aiohttp.ClientError,
        TimeoutError,
    )

    def __init__(self, session: aiohttp.ClientSession, base_url: str, turn: DemoTurn) -> None:
        self.session = session
        self.url = f"{base_url}/v1/messages"
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": task_prompt(turn)}]
        self.headers = {
            "x-mock-key": turn.key,
            "x-session-id": turn.session,
            "anthropic-version": "2023-06-01",
            "x-api-key": "demo-no-key-needed",
        }

    def request(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "max_tokens": 1024,
            "system": SYSTEM_PROMPT,
            "messages": self.messages,
            "tools": MESSAGES_TOOLS,
            "stream": True,
        }

    def expected(self, shape: dict[str, Any], request: dict[str, Any]) -> StepReply:
        text, args = "", ""
        for frame in frames_for("anthropic", shape, request):
            data = frame.split(b"data: ", 1)[1]
            obj = json.loads(data)
            if obj.get("type") == "content_block_delta":
                delta = obj["delta"]
                text += delta.get("text", "")
                args += delta.get("partial_json", "")
        return StepReply(1, text, args)  # one message_start

    async def stream(self, request: dict[str, Any], turn: DemoTurn) -> StepReply:
        async with self.session.post(self.url, json=request, headers=self.headers) as resp:
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
            return StepReply(starts, text, args, tool_id)

    def duplicates(self, got: StepReply, want: StepReply) -> int:
        """A second ``message_start``, or text beyond the reply's."""
        return max(0, got.frames - want.frames) + (len(got.text) > len(want.text))

    def took_tool(self, got: StepReply) -> None:
        call_id = got.call_id
        call = {"type": "tool_use", "id": call_id, "name": BASH_TOOL, "input": json.loads(got.args)}
        result = {"type": "tool_result", "tool_use_id": call_id, "content": "hello"}
        self.messages = [
            *self.messages,
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]


@contextlib.asynccontextmanager
async def messages_agents(
    base_url: str, timeout_s: float
) -> AsyncIterator[Callable[[DemoTurn], Agent]]:
    async with demo_session(timeout_s) as session:
        yield lambda turn: MessagesAgent(session, base_url, turn)


MESSAGES_DEMO = DemoProtocol(
    name="anthropic",
    storms=messages_storms,
    agents=messages_agents,
    over=" over Anthropic Messages",
    client=(
        "Client: a Messages client (POST /v1/messages, streamed) with no retries of its "
        "own and a short read timeout"
    ),
    continue_route={"after_commit": "continue"},  # by prefill
)
