"""The demo's Gemini API agent (``unbroken demo --protocol gemini``).

A plain Gemini API client (aiohttp, ``:streamGenerateContent?alt=sse``) with no retries
of its own, in the demo's agent loop, and the Gemini API's own storms: a 429 names its
wait in ``RetryInfo.retryDelay``, an ``error`` object arrives inside the stream, and
since a ``functionCall`` arrives whole the cuts before output come before it.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from unbroken.demo_messages import TEXT_REPLY, TOOL_REPLY, DemoTurnLike
from unbroken.mock import frames_for

__all__ = [
    "GEMINI_TOOLS",
    "GeminiStreamError",
    "gemini_agent_turn",
    "gemini_storms",
    "retry_info_429",
]

#: the same tool, declared as the Gemini API declares it
GEMINI_TOOLS = [
    {
        "functionDeclarations": [
            {
                "name": "bash",
                "description": "Run a shell command.",
                "parameters": {
                    "type": "object",
                    "properties": {"command": {"type": "string"}},
                    "required": ["command"],
                },
            }
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


def gemini_storms(
    retry_after_s: float, stall_s: float
) -> list[tuple[str, tuple[dict[str, Any], ...]]]:
    """The Gemini API's storms: the same kinds, in its own terms.  A ``functionCall``
    arrives whole in one event (released at once: it commits), so the cuts before
    output come before it: after the ``200``, with no event yet."""
    return [
        ("503 burst", ({"status": 503, "count": 6}, TOOL_REPLY, TEXT_REPLY)),
        (
            "429 + RetryInfo",
            ({"status": 429, "body": retry_info_429(retry_after_s)}, TOOL_REPLY, TEXT_REPLY),
        ),
        (
            "resets before output",
            (
                {"fault": "reset", "after_frame": 0, "reply": "tool", "count": 2},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        (
            "in-stream 503",
            (
                {"fault": "error_event", "after_frame": 0, "error": "overloaded", "reply": "tool"},
                TOOL_REPLY,
                TEXT_REPLY,
            ),
        ),
        (
            "drop after output",
            (TOOL_REPLY, {"fault": "reset", "after_frame": 4, "reply": "text"}, TEXT_REPLY),
        ),
        (
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


def _gemini_expected(shape: dict[str, Any], request: dict[str, Any]) -> tuple[int, str, str]:
    """(events, text, function calls' arguments) of the clean reply the mock sends."""
    chunks, text, calls = 0, "", []
    for frame in frames_for("gemini", shape, request):
        chunks += 1
        piece, got, _ = _gemini_parts(json.loads(frame.decode().removeprefix("data: ")))
        text += piece
        calls += got
    return chunks, text, _call_text(calls)


async def _gemini_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    turn: DemoTurnLike,
) -> tuple[int, str, list[dict[str, Any]]]:
    """One ``:streamGenerateContent?alt=sse`` call, read as a Gemini client reads it: one
    JSON object per ``data:`` event (events end with a blank line; blank lines alone are
    keepalives), an ``error`` object is an error, and no ``finishReason`` is a cut."""
    async with session.post(url, json=body, headers=headers) as resp:
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
        return chunks, text, calls


async def gemini_agent_turn(
    session: aiohttp.ClientSession, base_url: str, turn: DemoTurnLike, model: str, retries: int
) -> None:
    """The demo's agent over the Gemini API: the tool call, its result, the answer."""
    contents: list[dict[str, Any]] = [
        {"role": "user", "parts": [{"text": f"Task {turn.number}: say hello from the shell."}]}
    ]
    headers = {
        "x-goog-api-key": "demo-no-key-needed",
        "x-mock-key": turn.key,
        "x-session-id": f"demo-session-{turn.number}",
    }
    url = f"{base_url}/v1beta/models/{model}:streamGenerateContent?alt=sse"
    for step, shape in enumerate((TOOL_REPLY, TEXT_REPLY)):
        turn.step = step
        body = {
            "contents": contents,
            "systemInstruction": {
                "parts": [{"text": "You are a coding agent. Use the bash tool."}]
            },
            "tools": GEMINI_TOOLS,
        }
        # the mock renders a Gemini call as its body with the path's model and method
        want_chunks, want_text, want_args = _gemini_expected(
            shape, {**body, "model": model, "stream": True}
        )
        calls: list[dict[str, Any]] = []
        for _try in range(1 + retries):
            turn.state = "requesting"
            try:
                chunks, text, calls = await _gemini_stream(session, url, body, headers, turn)
            except Exception as exc:  # what an agent sees: errors, read timeouts, resets
                turn.errors += 1
                turn.last_error = type(exc).__name__
                turn.state = "retrying"
                continue
            turn.duplicates += max(0, chunks - want_chunks)
            if text != want_text or _call_text(calls) != want_args:
                turn.corrupted += 1
            break
        else:
            turn.state = "LOST"
            turn.lost = True
            return
        if shape is TOOL_REPLY:
            name = str(calls[0].get("name")) if calls else "bash"
            contents = [
                *contents,
                {"role": "model", "parts": [{"functionCall": c} for c in calls]},
                {
                    "role": "user",
                    "parts": [
                        {"functionResponse": {"name": name, "response": {"output": "hello"}}}
                    ],
                },
            ]
    turn.step = 2
    turn.state = "done"
    turn.completed = True
