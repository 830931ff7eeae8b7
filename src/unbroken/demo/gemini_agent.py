"""``unbroken demo --protocol gemini``: the demo's agent over the Gemini API.

A plain Gemini API client (aiohttp, ``:streamGenerateContent?alt=sse``) with no retries
of its own, in the demo's agent loop, and the Gemini API's own storms: a 429 names its
wait in ``RetryInfo.retryDelay``, an ``error`` object arrives inside the stream, and
since a ``functionCall`` arrives whole there is no "mid-tool-args": the cuts before
output come before the call's event.  The Gemini API documents no model-role
continuation, so a drop after output always ends in an error here.
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
    TEXT_REPLY,
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
    "GEMINI_DEMO",
    "GEMINI_TOOLS",
    "GeminiAgent",
    "GeminiStreamError",
    "gemini_storms",
    "retry_info_429",
]

#: the same tool, declared as the Gemini API declares it
GEMINI_TOOLS = [
    {
        "functionDeclarations": [
            {"name": BASH_TOOL, "description": BASH_DESCRIPTION, "parameters": BASH_SCHEMA}
        ]
    }
]


def retry_info_429(retry_after_s: float) -> str:
    """A Gemini API 429 body whose ``RetryInfo`` names the wait (a per-minute quota)."""
    return json.dumps(
        {
            "error": {
                "code": 429,
                "message": "You exceeded your current quota, please check your plan and "
                f"billing details. Please retry in {retry_after_s:g}s.",
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {
                        "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                        "violations": [{"quotaId": "GenerateRequestsPerMinutePerProjectPerModel"}],
                    },
                    {
                        "@type": "type.googleapis.com/google.rpc.RetryInfo",
                        "retryDelay": f"{retry_after_s:g}s",
                    },
                ],
            }
        }
    )


def gemini_storms(retry_after_s: float, stall_s: float) -> list[Storm]:
    """The Gemini API's storms: the same kinds, in its own terms.  A ``functionCall``
    arrives whole in one event (released at once: it commits), so the cuts before
    output come before it: after the ``200``, with no event yet (Gemini frames: 1 the
    whole ``functionCall``, 2 the finish; text: 8 pieces)."""
    return [
        Storm("503 burst", ({"status": 503, "count": 6}, TOOL_REPLY, TEXT_REPLY)),
        Storm(
            "429 + RetryInfo",
            ({"status": 429, "body": retry_info_429(retry_after_s)}, TOOL_REPLY, TEXT_REPLY),
        ),
        Storm(
            "resets before output",
            (
                {"fault": "reset", "after_frame": 0, "reply": "tool", "count": 2},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        Storm(
            "in-stream 503",
            (
                {"fault": "error_event", "after_frame": 0, "error": "overloaded", "reply": "tool"},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        Storm(
            "drop after output",
            (TOOL_REPLY, {"fault": "reset", "after_frame": 4, "reply": "text"}, TEXT_REPLY),
        ),
        Storm(
            "stall",
            (
                {"fault": "stall", "after_frame": 0, "seconds": stall_s, "reply": "tool"},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
    ]


class GeminiStreamError(Exception):
    """What the demo's Gemini client raises: an error status, an ``error`` object in the
    stream, or a stream that ended without a ``finishReason`` (a cut turn)."""


def _gemini_parts(obj: dict[str, Any]) -> tuple[str, list[dict[str, Any]], bool]:
    """(text, function calls, finished) of one ``GenerateContentResponse``."""
    text = ""
    calls: list[dict[str, Any]] = []
    finished = False
    for candidate in obj.get("candidates") or []:
        finished = finished or bool(candidate.get("finishReason"))
        for part in (candidate.get("content") or {}).get("parts") or []:
            if isinstance(part.get("text"), str) and not part.get("thought"):
                text += part["text"]
            call = part.get("functionCall")
            if isinstance(call, dict):
                calls.append(call)
    return text, calls, finished


def _call_text(calls: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(c.get("args") or {}, sort_keys=True) for c in calls)


class GeminiAgent:
    """One turn's agent over the Gemini API's ``:streamGenerateContent?alt=sse``."""

    shapes = (TOOL_REPLY, TEXT_REPLY)
    failures: tuple[type[BaseException], ...] = (Exception,)  # errors, read timeouts, resets

    def __init__(self, session: aiohttp.ClientSession, base_url: str, turn: DemoTurn) -> None:
        self.session = session
        self.url = f"{base_url}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse"
        self.contents: list[dict[str, Any]] = [
            {"role": "user", "parts": [{"text": task_prompt(turn)}]}
        ]
        self.headers = {
            "x-goog-api-key": "demo-no-key-needed",
            "x-mock-key": turn.key,
            "x-session-id": turn.session,
        }

    def request(self) -> dict[str, Any]:
        return {
            "contents": self.contents,
            "systemInstruction": {"parts": [{"text": SYSTEM_PROMPT}]},
            "tools": GEMINI_TOOLS,
        }

    def expected(self, shape: dict[str, Any], request: dict[str, Any]) -> StepReply:
        # the mock renders a Gemini call as its body with the path's model and method
        chunks, text, calls = 0, "", []
        for frame in frames_for("gemini", shape, {**request, "model": MODEL, "stream": True}):
            chunks += 1
            piece, got, _ = _gemini_parts(json.loads(frame.decode().removeprefix("data: ")))
            text += piece
            calls += got
        return StepReply(chunks, text, _call_text(calls))

    async def stream(self, request: dict[str, Any], turn: DemoTurn) -> StepReply:
        """One call, read as a Gemini client reads it: one JSON object per ``data:``
        event (events end with a blank line; blank lines alone are keepalives), an
        ``error`` object is an error, and no ``finishReason`` is a cut."""
        async with self.session.post(self.url, json=request, headers=self.headers) as resp:
            if resp.status != 200:
                raise GeminiStreamError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            turn.state = "streaming"
            chunks, text, calls, finished = 0, "", [], False
            data: list[str] = []
            async for raw in resp.content:
                line = raw.decode().rstrip("\r\n")
                if line:
                    if line.startswith("data:"):
                        data.append(line[5:].removeprefix(" "))
                    continue
                if not data:
                    continue  # a keepalive
                obj = json.loads("\n".join(data))
                data = []
                if not isinstance(obj, dict):
                    raise GeminiStreamError("an event that is not an object")
                if "error" in obj:
                    raise GeminiStreamError(f"in-stream error: {obj['error']}")
                chunks += 1
                turn.chunks += 1
                piece, got, done = _gemini_parts(obj)
                text += piece
                calls += got
                finished = finished or done
            if not finished:
                raise GeminiStreamError("the stream ended without a finishReason")
            return StepReply(chunks, text, _call_text(calls), calls=tuple(calls))

    def duplicates(self, got: StepReply, want: StepReply) -> int:
        return max(0, got.frames - want.frames)

    def took_tool(self, got: StepReply) -> None:
        calls = list(got.calls)
        name = str(calls[0].get("name")) if calls else BASH_TOOL
        response = {"functionResponse": {"name": name, "response": {"output": "hello"}}}
        self.contents = [
            *self.contents,
            {"role": "model", "parts": [{"functionCall": c} for c in calls]},
            {"role": "user", "parts": [response]},
        ]


@contextlib.asynccontextmanager
async def gemini_agents(
    base_url: str, timeout_s: float
) -> AsyncIterator[Callable[[DemoTurn], Agent]]:
    async with demo_session(timeout_s) as session:
        yield lambda turn: GeminiAgent(session, base_url, turn)


GEMINI_DEMO = DemoProtocol(
    name="gemini",
    storms=gemini_storms,
    agents=gemini_agents,
    over=" over the Gemini API",
    client=(
        "Client: a Gemini API client (streamGenerateContent?alt=sse) with no retries of "
        "its own and a short read timeout"
    ),
    continue_route=None,  # the Gemini API documents no continuation of a cut answer
)
