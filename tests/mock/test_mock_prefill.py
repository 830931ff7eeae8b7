"""The mock's prefill continuation and its ``after_deltas`` cut, over real sockets."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from unbroken.mock import MockProvider
from unbroken.mock.actions import ActionError, parse_action
from unbroken.mock.testing import parse_sse_json, read_body, split_sse

TEXT = "Hello there, general Kenobi."


def texts(protocol: str, data: bytes) -> list[str]:
    frames, _ = split_sse(data)
    out: list[str] = []
    for frame in frames:
        if frame.endswith(b"[DONE]\n\n"):
            continue
        _, obj = parse_sse_json(frame)
        if not isinstance(obj, dict):
            continue
        if protocol == "anthropic" and obj.get("type") == "content_block_delta":
            if obj["delta"]["type"] == "text_delta":
                out.append(obj["delta"]["text"])
        if protocol == "chat":
            for choice in obj.get("choices") or []:
                if choice["delta"].get("content"):
                    out.append(choice["delta"]["content"])
    return out


async def ask(
    session: aiohttp.ClientSession, mock: MockProvider, protocol: str, messages: list[Any]
) -> tuple[bytes, BaseException | None]:
    path = "/v1/messages" if protocol == "anthropic" else "/v1/chat/completions"
    body = {"model": "m", "stream": True, "max_tokens": 64, "messages": messages}
    async with session.post(mock.url + path, json=body) as resp:
        assert resp.status == 200
        return await read_body(resp)


@pytest.mark.parametrize(
    ("protocol", "prefix_message"),
    [
        ("anthropic", {"role": "assistant", "content": "Hello there,"}),
        ("anthropic", {"role": "assistant", "content": [{"type": "text", "text": "Hello there,"}]}),
        ("chat", {"role": "assistant", "content": "Hello there,", "prefix": True}),
        ("chat", {"role": "assistant", "content": "Hello there,", "partial": True}),
    ],
)
async def test_a_prefix_continues_the_scripted_text(
    mock: MockProvider,
    session: aiohttp.ClientSession,
    protocol: str,
    prefix_message: dict[str, Any],
) -> None:
    mock.set_default({"text": TEXT, "deltas": 6})
    user = {"role": "user", "content": "q"}
    full, _ = await ask(session, mock, protocol, [user])
    assert "".join(texts(protocol, full)) == TEXT
    cont, error = await ask(session, mock, protocol, [user, prefix_message])
    assert error is None
    # The rest of the text after the prefix, cut where the full reply's deltas are cut.
    assert texts(protocol, cont) == [" g", "ener", "al Ke", "nobi."]


async def test_chat_without_the_flag_and_an_unrelated_prefix_answer_the_whole_text(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.set_default({"text": TEXT, "deltas": 6})
    user = {"role": "user", "content": "q"}
    plain, _ = await ask(session, mock, "chat", [user, {"role": "assistant", "content": "Hello"}])
    assert "".join(texts("chat", plain)) == TEXT
    other, _ = await ask(
        session, mock, "anthropic", [user, {"role": "assistant", "content": "Bye"}]
    )
    assert "".join(texts("anthropic", other)) == TEXT


@pytest.mark.parametrize("protocol", ["anthropic", "chat"])
async def test_after_deltas_cuts_after_that_many_text_deltas(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str
) -> None:
    mock.set_default({"text": TEXT, "deltas": 6})
    mock.script([{"text": TEXT, "deltas": 6, "fault": "reset", "after_deltas": 2}])
    data, error = await ask(session, mock, protocol, [{"role": "user", "content": "q"}])
    assert isinstance(error, aiohttp.ClientPayloadError)
    assert texts(protocol, data) == ["Hell", "o the"]


def test_after_deltas_needs_a_frame_fault_and_not_after_frame() -> None:
    assert parse_action({"fault": "end", "after_deltas": 3}).after_deltas == 3
    with pytest.raises(ActionError, match="after_deltas"):
        parse_action({"after_deltas": 3})
    with pytest.raises(ActionError, match="after_deltas"):
        parse_action({"fault": "reset", "after_frame": 1, "after_deltas": 3})


@pytest.mark.parametrize("protocol", ["anthropic", "chat"])
async def test_text_tool_is_the_text_then_one_call_and_a_prefix_continues_it(
    mock: MockProvider, session: aiohttp.ClientSession, protocol: str
) -> None:
    shape = {"reply": "text_tool", "text": TEXT, "deltas": 6, "tool_name": "Bash"}
    mock.set_default(shape)
    user = {"role": "user", "content": "q"}
    full, _ = await ask(session, mock, protocol, [user])
    assert "".join(texts(protocol, full)) == TEXT
    assert b'"Bash"' in full and full.find(b"Kenobi") < full.find(b'"Bash"')
    assert (b'"stop_reason":"tool_use"' if protocol == "anthropic" else b'"tool_calls"') in full
    prefix: dict[str, Any] = {"role": "assistant", "content": "Hello there,"}
    if protocol == "chat":
        prefix["prefix"] = True
    cont, _ = await ask(session, mock, protocol, [user, prefix])
    assert texts(protocol, cont) == [" g", "ener", "al Ke", "nobi."]
    assert b'"Bash"' in cont
