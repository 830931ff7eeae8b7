"""``anthropic_continue = "user_message"`` over real sockets (issue 33 item 5).

Claude 4.6 and later answer a prefill with 400, so continue mode could never finish
their cut turns.  The mock models such a model (``refuse_prefill``: a request ending
with an assistant message gets that 400; a user message that quotes the end of the
interrupted turn is answered from there, the quoted end first).  On a route that opts
in, the cut turn is finished in place with the exact text; any answer that is not a
clean continuation is refused with the native error, never shown.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import aiohttp
import pytest

from relayfix import Recorder, make_config, start_relay
from unbroken.config import ConfigError, parse_config
from unbroken.core.wire.protocols.anthropic_continue import ANCHOR_TAG, anchor_of
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

TEXT = "The quick brown fox jumps over the lazy dog, and then naps.  Twice over!"
STREAM = {"first_frame_timeout_s": 2, "idle_timeout_s": 2, "keepalive_s": 30}
BODY: dict[str, Any] = {
    "model": "claude-mock-4-6",
    "max_tokens": 256,
    "stream": True,
    "messages": [{"role": "user", "content": "tell me"}],
}
CUT = {"text": TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3}
#: the model that refuses prefill, answering the continuation
MODEL = {"text": TEXT, "deltas": 12, "refuse_prefill": True}


async def _relay(mock: MockProvider, asks: str | None) -> tuple[RelayServer, Recorder]:
    cfg = make_config([{"url": mock.url}], stream={**STREAM, "after_commit": "continue"})
    if asks is not None:
        routes = {n: dataclasses.replace(r, anthropic_continue=asks) for n, r in cfg.routes.items()}
        cfg = dataclasses.replace(cfg, routes=routes)
    return await start_relay(cfg)


async def _post(url: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.read()
        return await r.read()


def _frames(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    return [(e.name, json.loads(e.data)) for e in SSESplitter().feed(raw) if e.data]


def _text(raw: bytes) -> str:
    return "".join(
        obj["delta"].get("text", "") for name, obj in _frames(raw) if name == "content_block_delta"
    )


async def test_a_model_that_refuses_prefill_is_continued_by_a_user_message(
    mock: MockProvider,
) -> None:
    """The cut turn completes with the exact text, one ``message_start``, one
    ``message_stop``, no error; the continuation request ends with the interrupted
    turn and a user message quoting its end; nothing ends with an assistant message."""
    server, rec = await _relay(mock, "user_message")
    try:
        mock.script([CUT, MODEL])
        raw = await _post(f"{server.url}/mock/v1/messages", BODY)
        names = [name for name, _ in _frames(raw)]
        assert _text(raw) == TEXT
        assert names.count("message_start") == 1 and names.count("message_stop") == 1
        assert "error" not in names and names[-1] == "message_stop"
        first, cont = mock.requests
        assert first.json() == BODY
        messages = cont.json()["messages"]
        assert messages[:-2] == BODY["messages"]
        interrupted = messages[-2]
        assert interrupted["role"] == "assistant" and TEXT.startswith(interrupted["content"])
        assert messages[-1]["role"] == "user"
        quoted = anchor_of(interrupted["content"])
        assert f"<{ANCHOR_TAG}>\n{quoted}\n</{ANCHOR_TAG}>" in messages[-1]["content"]
        turn = (await rec.wait_turns(1))[0]
        assert turn.outcome == "resumed" and turn.continuation == "spliced"
    finally:
        await server.stop()


async def test_the_same_model_on_a_prefill_route_ends_with_the_native_error(
    mock: MockProvider,
) -> None:
    """Guard: the mock's model refuses a prefill with Anthropic's 400 (the default
    route asks by prefill): the turn ends as without continue mode."""
    server, rec = await _relay(mock, None)
    try:
        mock.script([CUT, MODEL])
        raw = await _post(f"{server.url}/mock/v1/messages", BODY)
        assert _frames(raw)[-1][0] == "error" and TEXT.startswith(_text(raw))
        assert mock.requests[1].json()["messages"][-1]["role"] == "assistant"
        turn = (await rec.wait_turns(1))[0]
        assert turn.continuation == "refused_not_resumable"
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "answer",
    [{"preamble": "Sure! Continuing: "}, {"echo_tail": 9}, {"text": "Another answer."}],
    ids=["preamble", "repeats_the_end", "another_answer"],
)
async def test_a_continuation_that_is_not_clean_is_refused(
    mock: MockProvider, answer: dict[str, Any]
) -> None:
    """The model comments first, repeats the end of what the client has after the
    quoted end, or answers something else: never shown; the client has a prefix of
    the text, once, then Anthropic's native retryable error."""
    server, rec = await _relay(mock, "user_message")
    try:
        mock.script([CUT, {**MODEL, **answer}])
        raw = await _post(f"{server.url}/mock/v1/messages", BODY)
        shown = _text(raw)
        assert shown and TEXT.startswith(shown)
        assert "Sure" not in shown and "Another" not in shown
        names = [name for name, _ in _frames(raw)]
        assert names[-1] == "error" and "message_stop" not in names
        turn = (await rec.wait_turns(1))[0]
        assert turn.outcome == "ended_with_error" and turn.continuation == "refused_join"
    finally:
        await server.stop()


async def test_thinking_is_still_refused_on_a_user_message_route(mock: MockProvider) -> None:
    server, rec = await _relay(mock, "user_message")
    try:
        mock.script([CUT])
        body = {**BODY, "thinking": {"type": "adaptive"}}
        raw = await _post(f"{server.url}/mock/v1/messages", body)
        assert _frames(raw)[-1][0] == "error" and len(mock.requests) == 1
        turn = (await rec.wait_turns(1))[0]
        assert turn.continuation == "refused_thinking_enabled"
    finally:
        await server.stop()


def test_the_route_key_is_checked() -> None:
    def route(**extra: Any) -> dict[str, Any]:
        return {"routes": {"r": {"upstreams": [{"url": "http://a.test"}], **extra}}}

    cfg = parse_config(route(anthropic_continue="user_message"), env={})
    assert cfg.routes["r"].anthropic_continue == "user_message"
    assert parse_config(route(), env={}).routes["r"].anthropic_continue is None
    with pytest.raises(ConfigError, match=r"anthropic_continue.*'prefill' or 'user_message'"):
        parse_config(route(anthropic_continue="user"), env={})
