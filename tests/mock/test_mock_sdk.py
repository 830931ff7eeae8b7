"""The official SDKs parse the mock's replies: proof that the wire formats are real."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from unbroken.mock import MockProvider

TEXT = "Hello from the mock provider."
HELLO = {"command": "echo hello"}
WORLD = {"command": "echo world"}
MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]


def oai(mock: MockProvider) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mock.url + "/v1", api_key="x", max_retries=0)


def anth(mock: MockProvider) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=mock.url, api_key="x", max_retries=0)


# -- Chat Completions ---------------------------------------------------------


async def test_chat_stream_text(mock: MockProvider) -> None:
    mock.script([{"text": "The quick brown fox.", "deltas": 5}])
    async with oai(mock) as client:
        async with client.chat.completions.stream(
            model="gpt-test", messages=MESSAGES, stream_options={"include_usage": True}
        ) as stream:
            final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.message.content == "The quick brown fox."
    assert choice.finish_reason == "stop"
    assert final.model == "gpt-test"
    assert final.usage is not None and final.usage.completion_tokens == 5


async def test_chat_stream_raw_deltas(mock: MockProvider) -> None:
    async with oai(mock) as client:
        stream = await client.chat.completions.create(
            model="gpt-test", messages=MESSAGES, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == TEXT
    assert len(parts) == 1 + 8 + 1  # role chunk, 8 deltas, finish chunk


@pytest.mark.parametrize(("reply", "expected"), [("tool", [HELLO]), ("tools", [HELLO, WORLD])])
async def test_chat_stream_tools(mock: MockProvider, reply: str, expected: list[Any]) -> None:
    mock.script([{"reply": reply}])
    tools: Any = [
        {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}
    ]
    async with oai(mock) as client:
        async with client.chat.completions.stream(
            model="gpt-test", messages=MESSAGES, tools=tools
        ) as stream:
            final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == expected
    assert {c.function.name for c in calls} == {"shell"}
    assert len({c.id for c in calls}) == len(expected)


@pytest.mark.parametrize("reply", ["text", "tools"])
async def test_chat_non_stream(mock: MockProvider, reply: str) -> None:
    mock.script([{"reply": reply}])
    async with oai(mock) as client:
        result = await client.chat.completions.create(model="gpt-test", messages=MESSAGES)
    assert result.object == "chat.completion"
    message = result.choices[0].message
    if reply == "text":
        assert message.content == TEXT
        assert result.choices[0].finish_reason == "stop"
    else:
        assert message.content is None
        args = [json.loads(c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
        assert args == [HELLO, WORLD]
    assert result.usage is not None and result.usage.total_tokens > 0


async def test_chat_stream_error_event_raises(mock: MockProvider) -> None:
    mock.script([{"fault": "error_event", "after_frame": 2, "error": "server_error"}])
    async with oai(mock) as client:
        stream = await client.chat.completions.create(
            model="gpt-test", messages=MESSAGES, stream=True
        )
        with pytest.raises(openai.APIError, match="server had an error"):
            async for _ in stream:
                pass


# -- Responses ----------------------------------------------------------------


async def test_responses_stream_text(mock: MockProvider) -> None:
    mock.script([{"text": "Streaming via Responses.", "deltas": 6}])
    async with oai(mock) as client:
        stream = await client.responses.create(model="gpt-test", input="hi", stream=True)
        events = [e async for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Streaming via Responses."
    assert len(deltas) == 6
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == "Streaming via Responses."
    assert completed.response.usage is not None
    assert completed.response.usage.output_tokens == 6


async def test_responses_stream_helper(mock: MockProvider) -> None:
    async with oai(mock) as client:
        async with client.responses.stream(model="gpt-test", input="hi") as stream:
            final = await stream.get_final_response()
    assert final.output_text == TEXT
    assert final.status == "completed"


@pytest.mark.parametrize(("reply", "expected"), [("tool", [HELLO]), ("tools", [HELLO, WORLD])])
async def test_responses_stream_tools(mock: MockProvider, reply: str, expected: list[Any]) -> None:
    mock.script([{"reply": reply}])
    tools: Any = [{"type": "function", "name": "exec", "parameters": {"type": "object"}}]
    async with oai(mock) as client:
        async with client.responses.stream(model="gpt-test", input="hi", tools=tools) as stream:
            final = await stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == expected
    assert {c.name for c in calls} == {"exec"}
    assert all(c.call_id.startswith("call_") for c in calls)


@pytest.mark.parametrize("reply", ["text", "tool"])
async def test_responses_non_stream(mock: MockProvider, reply: str) -> None:
    mock.script([{"reply": reply}])
    async with oai(mock) as client:
        result = await client.responses.create(model="gpt-test", input="hi")
    assert result.object == "response" and result.status == "completed"
    if reply == "text":
        assert result.output_text == TEXT
    else:
        (call,) = result.output
        assert call.type == "function_call" and json.loads(call.arguments) == HELLO


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("server_error", "server_error"),
        ("overloaded", "server_is_overloaded"),
        ("rate_limit", "rate_limit_exceeded"),
        ("invalid_request", "invalid_prompt"),
        ("context_length", "context_length_exceeded"),
    ],
)
async def test_responses_failed_event(mock: MockProvider, error: str, code: str) -> None:
    mock.script([{"fault": "error_event", "after_frame": 5, "error": error}])
    async with oai(mock) as client:
        stream = await client.responses.create(model="gpt-test", input="hi", stream=True)
        events = [e async for e in stream]
    assert len(events) == 6
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.sequence_number == 5
    assert failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == code


async def test_responses_error_style_error_event(mock: MockProvider) -> None:
    mock.script(
        [{"fault": "error_event", "after_frame": 1, "error": "rate_limit", "error_style": "error"}]
    )
    async with oai(mock) as client:
        stream = await client.responses.create(model="gpt-test", input="hi", stream=True)
        events = [e async for e in stream]
    assert [e.type for e in events] == ["response.created", "error"]
    assert events[1].code == "rate_limit_exceeded"  # type: ignore[union-attr]


# -- Anthropic ----------------------------------------------------------------


async def test_anthropic_stream_text(mock: MockProvider) -> None:
    mock.script([{"text": "Claude-ish reply.", "deltas": 4}])
    async with anth(mock) as client:
        async with client.messages.stream(
            model="claude-test", max_tokens=100, messages=MESSAGES
        ) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
    assert texts == ["Clau", "de-i", "sh r", "eply."]
    assert final.content[0].type == "text" and final.content[0].text == "Claude-ish reply."
    assert final.stop_reason == "end_turn"
    assert final.model == "claude-test"
    assert final.usage.output_tokens == 4 and final.usage.input_tokens > 0


@pytest.mark.parametrize(("reply", "expected"), [("tool", [HELLO]), ("tools", [HELLO, WORLD])])
async def test_anthropic_stream_tools(mock: MockProvider, reply: str, expected: list[Any]) -> None:
    mock.script([{"reply": reply}])
    tools: Any = [{"name": "Bash", "input_schema": {"type": "object"}}]
    async with anth(mock) as client:
        async with client.messages.stream(
            model="claude-test", max_tokens=100, messages=MESSAGES, tools=tools
        ) as stream:
            final = await stream.get_final_message()
    assert final.stop_reason == "tool_use"
    blocks = [b for b in final.content if b.type == "tool_use"]
    assert [b.input for b in blocks] == expected
    assert {b.name for b in blocks} == {"Bash"}
    assert all(b.id.startswith("toolu_") for b in blocks)


async def test_anthropic_create_stream_true(mock: MockProvider) -> None:
    async with anth(mock) as client:
        stream = await client.messages.create(
            model="claude-test", max_tokens=100, messages=MESSAGES, stream=True
        )
        types = [e.type async for e in stream]
    assert types == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 8,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]  # ping is swallowed by the SDK


@pytest.mark.parametrize("reply", ["text", "tools"])
async def test_anthropic_non_stream(mock: MockProvider, reply: str) -> None:
    mock.script([{"reply": reply}])
    async with anth(mock) as client:
        message = await client.messages.create(
            model="claude-test", max_tokens=100, messages=MESSAGES
        )
    if reply == "text":
        assert [b.text for b in message.content if b.type == "text"] == [TEXT]
    else:
        assert [b.input for b in message.content if b.type == "tool_use"] == [HELLO, WORLD]
        assert message.stop_reason == "tool_use"


@pytest.mark.parametrize(
    ("error", "etype"),
    [
        ("overloaded", "overloaded_error"),
        ("server_error", "api_error"),
        ("rate_limit", "rate_limit_error"),
        ("invalid_request", "invalid_request_error"),
        ("context_length", "invalid_request_error"),
    ],
)
async def test_anthropic_stream_error_event(mock: MockProvider, error: str, etype: str) -> None:
    mock.script([{"fault": "error_event", "after_frame": 4, "error": error}])
    async with anth(mock) as client:
        with pytest.raises(anthropic.APIStatusError) as info:
            async with client.messages.stream(
                model="claude-test", max_tokens=100, messages=MESSAGES
            ) as stream:
                await stream.get_final_message()
    body: Any = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == etype


async def test_sdk_sees_status_and_retry_after(mock: MockProvider) -> None:
    mock.script([{"status": 429, "headers": {"Retry-After": "7"}}, {"status": 529}])
    async with anth(mock) as client:
        with pytest.raises(anthropic.RateLimitError) as rate:
            await client.messages.create(model="claude-test", max_tokens=10, messages=MESSAGES)
        assert rate.value.response.headers["retry-after"] == "7"
        with pytest.raises(anthropic.APIStatusError) as over:
            await client.messages.create(model="claude-test", max_tokens=10, messages=MESSAGES)
        assert over.value.status_code == 529
        body: Any = over.value.body
        assert body["error"]["type"] == "overloaded_error"
    mock.script([{"status": 503}])
    async with oai(mock) as oclient:
        with pytest.raises(openai.InternalServerError) as unavailable:
            await oclient.chat.completions.create(model="gpt-test", messages=MESSAGES)
        assert unavailable.value.status_code == 503
