"""``unbroken demo`` (``--protocol chat``, the default): the agent on the openai SDK.

The official ``openai`` SDK with its defaults (two retries of its own) and a short read
timeout, over Chat Completions: a streamed tool call, then the answer.  The SDK is the
``demo`` extra (``pip install 'unbroken[demo]'``); without it this protocol says so
(`openai_missing`) and the other two, plain aiohttp clients, still run.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from unbroken.demo.agent_loop import (
    BASH_DESCRIPTION,
    BASH_SCHEMA,
    BASH_TOOL,
    MODEL,
    SYSTEM_PROMPT,
    TEXT_REPLY,
    TOOL_REPLY,
    Agent,
    DemoProtocol,
    DemoTurn,
    StepReply,
    Storm,
    task_prompt,
)
from unbroken.mock import frames_for

__all__ = ["CHAT_DEMO", "CHAT_TOOLS", "NEEDS_OPENAI", "ChatAgent", "chat_storms", "openai_missing"]

CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": BASH_TOOL,
            "description": BASH_DESCRIPTION,
            "parameters": BASH_SCHEMA,
        },
    }
]
NEEDS_OPENAI = (
    "the openai SDK is not installed (the chat demo's agents use it): "
    "pip install 'unbroken[demo]' (in unbroken's clone: pip install -e '.[demo]'), "
    "or run --protocol anthropic or gemini, which need no SDK"
)


def openai_missing() -> str | None:
    """`NEEDS_OPENAI` when ``import openai`` fails, else None."""
    try:
        import openai  # noqa: F401
    except ImportError:
        return NEEDS_OPENAI
    return None


def chat_storms(retry_after_s: float, stall_s: float) -> list[Storm]:
    """The storm of each kind of turn (chat frames: 1 role, 2 tool start, 3-10 arguments;
    text: 8 pieces)."""
    return [
        Storm("503 burst", ({"status": 503, "count": 6}, TOOL_REPLY, TEXT_REPLY)),
        Storm(
            "429 + Retry-After",
            (
                {"status": 429, "headers": {"Retry-After": f"{retry_after_s:g}"}},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        Storm(
            "resets before output",
            (
                {"fault": "reset", "after_frame": 1, "reply": "tool", "count": 2},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        Storm(
            "reset mid-tool-args",
            ({"fault": "reset", "after_frame": 5, "reply": "tool"}, TOOL_REPLY, TEXT_REPLY),
        ),
        Storm(
            "drop after output",
            (TOOL_REPLY, {"fault": "reset", "after_frame": 4, "reply": "text"}, TEXT_REPLY),
        ),
        Storm(
            "stall",
            (
                {"fault": "stall", "after_frame": 1, "seconds": stall_s, "reply": "tool"},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
    ]


class ChatAgent:
    """One turn's agent on the openai SDK's ``AsyncOpenAI`` (Chat Completions, streamed)."""

    shapes = (TOOL_REPLY, TEXT_REPLY)
    failures: tuple[type[BaseException], ...] = (Exception,)  # SDK errors, timeouts, resets

    def __init__(self, client: Any, turn: DemoTurn) -> None:
        self.client = client
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task_prompt(turn)},
        ]
        self.headers = {"x-mock-key": turn.key, "x-session-id": turn.session}

    def request(self) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": self.messages,
            "tools": CHAT_TOOLS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def expected(self, shape: dict[str, Any], request: dict[str, Any]) -> StepReply:
        chunks, text, args = 0, "", ""
        for frame in frames_for("chat", shape, request):
            data = frame.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            chunks += 1
            obj = json.loads(data)
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                text += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    args += (tc.get("function") or {}).get("arguments") or ""
        return StepReply(chunks, text, args)

    async def stream(self, request: dict[str, Any], turn: DemoTurn) -> StepReply:
        chunks, text, args, call_id = 0, "", "", ""
        stream = await self.client.chat.completions.create(**request, extra_headers=self.headers)
        turn.state = "streaming"
        async for chunk in stream:
            chunks += 1
            turn.chunks += 1
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    call_id = call_id or tc.id or ""
                    if tc.function is not None:
                        args += tc.function.arguments or ""
        return StepReply(chunks, text, args, call_id)

    def duplicates(self, got: StepReply, want: StepReply) -> int:
        return max(0, got.frames - want.frames)

    def took_tool(self, got: StepReply) -> None:
        call_id = got.call_id or "call_0"
        call = {"name": BASH_TOOL, "arguments": got.args}
        self.messages = [
            *self.messages,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "hello"},
        ]


@contextlib.asynccontextmanager
async def chat_agents(
    base_url: str, timeout_s: float
) -> AsyncIterator[Callable[[DemoTurn], Agent]]:
    """One ``AsyncOpenAI`` client for every turn, closed at the end."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="demo-no-key-needed", timeout=timeout_s
    )
    try:
        yield lambda turn: ChatAgent(client, turn)
    finally:
        await client.close()


CHAT_DEMO = DemoProtocol(
    name="chat",
    storms=chat_storms,
    agents=chat_agents,
    over="",
    client="Client: openai SDK defaults (2 retries) and a short read timeout",
    # the mock continues a prefix: true message
    continue_route={"after_commit": "continue", "chat_prefix": "prefix"},
    missing=openai_missing,
)
