"""The client recipes of docs/configuration.md: each base URL, with the path its
client appends, works through the relay.  The routes ``openai`` and ``anthropic``
point at the mock here, exactly as the built-in ones point at
https://api.openai.com and https://api.anthropic.com, so every URL shape is the
one the docs give."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from unbroken.config import parse_config
from unbroken.mock.testing import parse_sse_json, read_body, split_sse
from unbroken.relay.server import RelayServer

TEXT = "Hello from the mock provider."
#: Each request first meets a fault the relay must absorb.
FAULTS = [{"status": 503}, {"fault": "reset", "after_frame": 0}]


@pytest.fixture
async def relay(mock: Any) -> AsyncIterator[str]:
    config = parse_config(
        {
            "retry": {"delay_ms": 5},
            "routes": {
                "openai": {"upstreams": [mock.url]},
                "anthropic": {"upstreams": [mock.url]},
            },
        },
        env={},
    )
    server = RelayServer(dataclasses.replace(config, port=0, grace_s=1.0))
    await server.start()
    yield server.url
    await server.stop()


def sse_json(body: bytes) -> list[Any]:
    frames, _ = split_sse(body)
    out = []
    for frame in frames:
        if b"[DONE]" in frame or frame.startswith(b":"):
            continue
        out.append(parse_sse_json(frame)[1])
    return out


# -- raw SDK use --------------------------------------------------------------------------


async def test_openai_sdk_recipe(mock: Any, relay: str) -> None:
    # docs/configuration.md: OpenAI(base_url="http://127.0.0.1:4780/openai/v1")
    url = f"{relay}/openai/v1"
    async with openai.AsyncOpenAI(base_url=url, api_key="sk-user", max_retries=0) as client:
        mock.script(FAULTS)
        stream = await client.chat.completions.create(
            model="gpt-x", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == TEXT
        mock.script(FAULTS)
        response = await client.responses.create(model="gpt-x", input="hi")
    assert response.output_text == TEXT
    assert [r.path for r in mock.requests] == ["/v1/chat/completions"] * 3 + ["/v1/responses"] * 3
    assert mock.requests[-1].headers["authorization"] == "Bearer sk-user"


async def test_anthropic_sdk_recipe(mock: Any, relay: str) -> None:
    # docs/configuration.md: Anthropic(base_url="http://127.0.0.1:4780/anthropic")
    mock.script(FAULTS)
    async with (
        anthropic.AsyncAnthropic(
            base_url=f"{relay}/anthropic", api_key="sk-ant-user", max_retries=0
        ) as client,
        client.messages.stream(
            model="claude-x", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        text = "".join([t async for t in stream.text_stream])
    assert text == TEXT
    assert [r.path for r in mock.requests] == ["/v1/messages"] * 3
    headers = mock.requests[-1].headers
    assert "sk-ant-user" in (headers.get("x-api-key"), headers.get("authorization", "")[7:])


# -- clients that are not installed here: the exact URL and path they call -------------------


async def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as r:
        data, err = await read_body(r)
        assert err is None
        return r.status, data


async def test_claude_code_recipe(mock: Any, relay: str) -> None:
    # docs/configuration.md: ANTHROPIC_BASE_URL=http://127.0.0.1:4780/anthropic claude
    # Claude Code posts to $ANTHROPIC_BASE_URL/v1/messages?beta=true, streamed.
    base = f"{relay}/anthropic"
    mock.script(FAULTS)
    status, body = await _post(
        f"{base}/v1/messages?beta=true",
        {
            "model": "claude-x",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
        {
            "x-api-key": "sk-ant-user",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "interleaved-thinking-2025-05-14",
        },
    )
    assert status == 200
    events = sse_json(body)
    text = "".join(
        e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta"
    )
    assert text == TEXT and events[-1]["type"] == "message_stop"
    assert mock.requests[-1].path == "/v1/messages"
    assert mock.requests[-1].query.get("beta") == "true"
    assert mock.requests[-1].headers["anthropic-beta"] == "interleaved-thinking-2025-05-14"


async def test_codex_cli_recipe(mock: Any, relay: str) -> None:
    # docs/configuration.md: [model_providers.unbroken] base_url = "http://127.0.0.1:4780/openai/v1",
    # wire_api = "responses": Codex posts to {base_url}/responses, streamed.
    base = f"{relay}/openai/v1"
    mock.script(FAULTS)
    status, body = await _post(
        f"{base}/responses",
        {"model": "gpt-x", "stream": True, "store": False, "input": "hi"},
        {"authorization": "Bearer sk-user", "originator": "codex_cli_rs"},
    )
    assert status == 200
    events = sse_json(body)
    assert events[-1]["type"] == "response.completed"
    assert (
        "".join(e.get("delta", "") for e in events if e.get("type") == "response.output_text.delta")
        == TEXT
    )
    assert mock.requests[-1].path == "/v1/responses"


@pytest.mark.parametrize("stream", [True, False])
async def test_aider_and_litellm_recipe(mock: Any, relay: str, stream: bool) -> None:
    # docs/configuration.md: aider --openai-api-base http://127.0.0.1:4780/openai/v1
    # (OPENAI_API_BASE), and
    # litellm.completion(..., api_base="http://127.0.0.1:4780/openai/v1") post to
    # {api_base}/chat/completions
    base = f"{relay}/openai/v1"
    mock.script(FAULTS)
    status, body = await _post(
        f"{base}/chat/completions",
        {"model": "gpt-x", "stream": stream, "messages": [{"role": "user", "content": "hi"}]},
        {"authorization": "Bearer sk-user"},
    )
    assert status == 200
    if stream:
        chunks = sse_json(body)
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
        )
    else:
        text = json.loads(body)["choices"][0]["message"]["content"]
    assert text == TEXT
    assert mock.requests[-1].path == "/v1/chat/completions"


async def test_litellm_anthropic_recipe(mock: Any, relay: str) -> None:
    # docs/configuration.md: litellm.completion(model="anthropic/...", api_base="http://127.0.0.1:4780/anthropic")
    # LiteLLM appends /v1/messages to an Anthropic api_base.
    mock.script(FAULTS)
    status, body = await _post(
        f"{relay}/anthropic/v1/messages",
        {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        {"x-api-key": "sk-ant-user", "anthropic-version": "2023-06-01"},
    )
    assert status == 200
    assert json.loads(body)["content"][0]["text"] == TEXT
