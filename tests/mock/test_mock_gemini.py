"""The mock speaks the Gemini API: streamGenerateContent SSE (``\\r\\n\\r\\n``),
generateContent JSON, Google RPC errors and the faults, over real loopback sockets;
every streamed reply is read back through the core's own Gemini classifier."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from unbroken.core.turn.ledger import Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import GEMINI, Kind
from unbroken.core.wire.protocols.gemini import GeminiClassifier, retry_delay
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider
from unbroken.mock.testing import read_body
from unbroken.mock.wire import frames_for

STREAM = "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
PLAIN = "/v1beta/models/gemini-2.5-flash:generateContent"
BODY = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
VIEW = {**BODY, "model": "gemini-2.5-flash", "stream": True}


async def post(
    session: aiohttp.ClientSession, mock: MockProvider, path: str = STREAM, **kw: Any
) -> aiohttp.ClientResponse:
    return await session.post(mock.url + path, json=BODY, headers={"x-goog-api-key": "k"}, **kw)


def kinds_of(data: bytes) -> list[int]:
    splitter = SSESplitter()
    clf = GeminiClassifier()
    out = [clf.classify(e)[0] for e in splitter.feed(data)]
    assert splitter.pending == b""
    return out


async def test_a_streamed_text_reply(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    async with await post(session, mock) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        data, err = await read_body(resp)
    assert err is None
    assert data == b"".join(frames_for("gemini", None, VIEW))
    assert data.count(b"\r\n\r\n") == 8 and b"\n\n" not in data.replace(b"\r\n\r\n", b"")
    kinds = kinds_of(data)
    assert kinds[:-1] == [Kind.OUTPUT] * 7 and kinds[-1] == Kind.OUTPUT | Kind.TERMINAL_OK
    text = "".join(
        json.loads(line[6:])["candidates"][0]["content"]["parts"][0]["text"]
        for line in data.split(b"\r\n\r\n")
        if line
    )
    assert text == "Hello from the mock provider."
    [req] = mock.requests
    assert req.path == STREAM.split("?")[0] and req.query["alt"] == "sse"
    assert req.json() == BODY and req.headers["x-goog-api-key"] == "k"


async def test_a_tool_reply_sends_each_call_whole(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    action = {"reply": "tool", "tool_name": "run_shell_command", "tool_args": {"command": "ls"}}
    mock.script([action])
    async with await post(session, mock) as resp:
        data, _ = await read_body(resp)
    call = Kind.TOOL_START | Kind.TOOL_END
    assert kinds_of(data) == [call, Kind.TERMINAL_OK]
    first = json.loads(data.split(b"\r\n\r\n")[0][6:])
    assert first["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}}
    ]


async def test_generate_content_is_json(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    async with await post(session, mock, PLAIN) as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        got = await resp.json()
    cand = got["candidates"][0]
    assert cand["content"]["parts"] == [{"text": "Hello from the mock provider."}]
    assert cand["finishReason"] == "STOP" and got["modelVersion"] == "gemini-2.5-flash"


async def test_streaming_without_alt_sse_is_refused(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with await post(session, mock, STREAM.split("?")[0]) as resp:
        assert resp.status == 400
        assert "alt=sse" in (await resp.json())["error"]["message"]


async def test_statuses_are_google_rpc_errors(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    retry_info = json.dumps(
        {
            "error": {
                "code": 429,
                "message": "quota",
                "status": "RESOURCE_EXHAUSTED",
                "details": [
                    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "2s"}
                ],
            }
        }
    )
    mock.script([{"status": 503}, {"status": 429, "body": retry_info}])
    async with await post(session, mock) as resp:
        assert resp.status == 503
        assert await resp.json() == {
            "error": {
                "code": 503,
                "message": "The model is overloaded. Please try again later.",
                "status": "UNAVAILABLE",
            }
        }
    async with await post(session, mock) as resp:
        assert resp.status == 429
        assert retry_delay(await resp.read()) == 2.0


@pytest.mark.parametrize(
    ("error", "retryable"), [("overloaded", True), ("rate_limit", True), ("context_length", False)]
)
async def test_an_in_stream_error_after_output(
    mock: MockProvider, session: aiohttp.ClientSession, error: str, retryable: bool
) -> None:
    mock.script([{"fault": "error_event", "after_frame": 2, "error": error}])
    async with await post(session, mock) as resp:
        data, _ = await read_body(resp)
    ledger = Ledger(GEMINI)
    for event in SSESplitter().feed(data):
        ledger.feed(event)
    assert ledger.state is LedgerState.FAILED
    assert ledger.passed_through is not retryable
    assert data.endswith(b"}}\r\n\r\n")


async def test_a_reset_after_output_and_a_malformed_frame(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "reset", "after_frame": 2}, {"fault": "malformed", "after_frame": 1}])
    async with await post(session, mock) as resp:
        data, err = await read_body(resp)
    assert err is not None
    assert data == b"".join(frames_for("gemini", None, VIEW)[:2])

    async with await post(session, mock) as resp:
        data, _ = await read_body(resp)
    ledger = Ledger(GEMINI)
    for event in SSESplitter().feed(data):
        ledger.feed(event)
        if ledger.verdict is not Verdict.CONTINUE:
            break
    assert ledger.fail_reason == "malformed frame"
