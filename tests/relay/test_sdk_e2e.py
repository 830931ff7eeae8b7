"""End to end with the official SDKs as clients: faults are invisible before commit,
and a turn cut after commit raises in the SDK (never a silent, clean success)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
from anthropic.types import MessageParam
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from relayfix import Recorder, make_config, start_relay
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

STREAM = {"first_frame_timeout_s": 1, "idle_timeout_s": 1}
MSGS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
ANT_MSGS: list[MessageParam] = [{"role": "user", "content": "hi"}]
TOOLS_CHAT: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}},
    }
]


Relay = tuple[RelayServer, Recorder]


@pytest.fixture
async def relay(mock: MockProvider) -> AsyncIterator[Relay]:
    server, rec = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    yield server, rec
    await server.stop()


# The clients are closed on the test's loop: one left to the garbage collector closes its
# pool from a later test, on a loop that is gone, and that test's log gets the traceback
# (a clean-clone run: test_security's "no Traceback" check failed on it)
@pytest.fixture
async def oai(relay: Relay) -> AsyncIterator[openai.AsyncOpenAI]:
    server, _ = relay
    url = f"{server.url}/mock/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="sk-x", max_retries=0) as client:
        yield client


@pytest.fixture
async def ant(relay: Relay) -> AsyncIterator[anthropic.AsyncAnthropic]:
    server, _ = relay
    url = f"{server.url}/mock"
    async with anthropic.AsyncAnthropic(base_url=url, api_key="sk-x", max_retries=0) as client:
        yield client


# -- chat completions -------------------------------------------------------------
async def test_chat_stream_survives_faults_before_commit(
    mock: MockProvider, oai: openai.AsyncOpenAI
) -> None:
    mock.script(
        [
            {"status": 503},
            {"fault": "reset", "after_frame": 1},  # after the role chunk (held)
            {"fault": "error_event", "after_frame": 1, "error": "overloaded"},
            {"fault": "stall", "after_frame": 0, "seconds": 30},
        ]
    )
    stream = await oai.chat.completions.create(model="m", messages=MSGS, stream=True)
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the mock provider."
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"]  # the dead attempts' role chunks never arrived
    assert len(mock.requests) == 5


async def test_chat_tool_call_cut_mid_arguments_arrives_once_and_whole(
    mock: MockProvider, oai: openai.AsyncOpenAI
) -> None:
    mock.script([{"fault": "reset", "after_frame": 3, "reply": "tools"}, {"reply": "tools"}])
    stream = await oai.chat.completions.create(
        model="m", messages=MSGS, tools=TOOLS_CHAT, stream=True
    )
    calls: dict[int, dict[str, str]] = {}
    async for chunk in stream:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(tc.index, {"id": "", "args": ""})
            if tc.id:
                assert not entry["id"], "a tool call started twice"
                entry["id"] = tc.id
            entry["args"] += tc.function.arguments or "" if tc.function else ""
    assert len(calls) == 2
    for entry in calls.values():
        assert entry["id"] and entry["args"].startswith("{") and entry["args"].endswith("}")


async def test_chat_cut_after_output_raises(mock: MockProvider, oai: openai.AsyncOpenAI) -> None:
    mock.script([{"fault": "reset", "after_frame": 3}])
    stream = await oai.chat.completions.create(model="m", messages=MSGS, stream=True)
    seen = ""
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            if chunk.choices:
                assert chunk.choices[0].finish_reason is None
                seen += chunk.choices[0].delta.content or ""
    assert seen  # output had reached the client, so no replay was allowed
    assert "unbroken" in str(info.value)
    assert len(mock.requests) == 1


# -- responses -------------------------------------------------------------------
async def test_responses_stream_survives_faults_before_commit(
    mock: MockProvider, oai: openai.AsyncOpenAI
) -> None:
    mock.script(
        [
            {"fault": "close_before_headers"},
            {"fault": "reset", "after_frame": 2},  # after created + in_progress (held)
            {"fault": "end", "after_frame": 4},
        ]
    )
    created = 0
    text = ""
    final = None
    async with oai.responses.stream(model="m", input="hi") as stream:
        async for event in stream:
            if event.type == "response.created":
                created += 1
            elif event.type == "response.output_text.delta":
                text += event.delta
        final = await stream.get_final_response()
    assert created == 1
    assert text == "Hello from the mock provider." == final.output_text
    assert len(mock.requests) == 4


async def test_responses_cut_after_output_raises(
    mock: MockProvider, oai: openai.AsyncOpenAI
) -> None:
    mock.script([{"fault": "reset", "after_frame": 6}])
    got_text = False
    with pytest.raises(openai.APIError):
        async with oai.responses.stream(model="m", input="hi") as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    got_text = True
                assert event.type != "response.completed"
    assert got_text
    assert len(mock.requests) == 1


async def test_responses_function_call_cut_mid_arguments(
    mock: MockProvider, oai: openai.AsyncOpenAI
) -> None:
    mock.script([{"fault": "reset", "after_frame": 4, "reply": "tool"}, {"reply": "tool"}])
    final = None
    async with oai.responses.stream(model="m", input="hi") as stream:
        added = [e async for e in stream if e.type == "response.output_item.added"]
        final = await stream.get_final_response()
    assert len(added) == 1
    calls = [o for o in final.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].arguments.startswith("{")
    assert len(mock.requests) == 2


# -- anthropic -------------------------------------------------------------------
async def test_anthropic_stream_survives_faults_before_commit(
    mock: MockProvider, ant: anthropic.AsyncAnthropic
) -> None:
    mock.script(
        [
            {"status": 529},
            {"fault": "error_event", "after_frame": 2, "error": "overloaded"},
            {"fault": "reset", "after_frame": 3, "reply": "tool"},
            {"reply": "tool"},
        ]
    )
    async with ant.messages.stream(model="m", max_tokens=64, messages=ANT_MSGS) as stream:
        message = await stream.get_final_message()
    tools = [b for b in message.content if b.type == "tool_use"]
    assert len(tools) == 1 and tools[0].input
    assert message.stop_reason == "tool_use"
    assert len(mock.requests) == 4


async def test_anthropic_cut_after_output_raises(
    mock: MockProvider, ant: anthropic.AsyncAnthropic
) -> None:
    mock.script([{"fault": "end", "after_frame": 4}])
    with pytest.raises(anthropic.APIStatusError) as info:
        async with ant.messages.stream(model="m", max_tokens=64, messages=ANT_MSGS) as stream:
            async for _ in stream:
                pass
    assert "overloaded" in str(info.value).lower()
    assert len(mock.requests) == 1
