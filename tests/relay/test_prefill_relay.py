"""after_commit = "continue" by prefill, over real sockets with the mock (issue 23).

Anthropic Messages: a text turn cut after output is continued with the committed text
as an assistant prefill and spliced into the client's stream; Chat Completions the same
with a route's documented ``chat_prefix`` mode.  Each behaviour test fails on the code
before (the cut ended the turn with the native error); the refusals end as today.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from relayfix import KEY_TOKEN, Recorder, make_config, start_relay
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider, frames_for
from unbroken.mock.wire import make_reply
from unbroken.relay.server import RelayServer

TEXT = "The quick brown fox jumps over the lazy dog, and then naps.  Twice over!"
STREAM = {"first_frame_timeout_s": 2, "idle_timeout_s": 2, "keepalive_s": 30}
MESSAGES = "v1/messages"
CHAT = "v1/chat/completions"

Relay = tuple[RelayServer, Recorder]
BODY: dict[str, Any] = {
    "model": "claude-mock",
    "max_tokens": 256,
    "stream": True,
    "messages": [{"role": "user", "content": "tell me"}],
}
CHAT_BODY: dict[str, Any] = {
    "model": "deepseek-mock",
    "stream": True,
    "messages": [{"role": "user", "content": "tell me"}],
}


async def _relay(mock: MockProvider, **route: Any) -> Relay:
    cfg = make_config([{"url": mock.url}], stream={**STREAM, "after_commit": "continue"})
    if route:
        import dataclasses

        routes = {n: dataclasses.replace(r, **route) for n, r in cfg.routes.items()}
        cfg = dataclasses.replace(cfg, routes=routes)
    return await start_relay(cfg)


@pytest.fixture
async def relay(mock: MockProvider) -> AsyncIterator[Relay]:
    server, rec = await _relay(mock)
    yield server, rec
    await server.stop()


async def _post(url: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.read()
        return await r.read()


def _frames(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    out = []
    for e in SSESplitter().feed(raw):
        if e.data and e.data != "[DONE]":
            out.append((e.name, json.loads(e.data)))
    return out


def _anthropic_text(raw: bytes) -> str:
    """The client's text, with the framing checked: one start, one delta, one stop,
    block indexes in order, every delta in its open block, no error."""
    names = []
    text = []
    open_index = None
    next_index = 0
    for name, obj in _frames(raw):
        names.append(name)
        assert name != "error", obj
        if name == "content_block_start":
            assert open_index is None and obj["index"] == next_index
            open_index, next_index = obj["index"], next_index + 1
            text.append(obj["content_block"].get("text", ""))
        elif name == "content_block_delta":
            assert obj["index"] == open_index
            text.append(obj["delta"].get("text", ""))
        elif name == "content_block_stop":
            assert obj["index"] == open_index
            open_index = None
    assert names[0] == "message_start" and names.count("message_start") == 1
    assert names.count("message_delta") == 1
    assert names[-1] == "message_stop" and names.count("message_stop") == 1
    return "".join(text)


async def test_a_text_cut_after_output_completes_with_the_exact_text(
    mock: MockProvider, relay: Relay
) -> None:
    server, rec = relay
    mock.script(
        [
            {"text": TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3},
            {"text": TEXT, "deltas": 12},
        ]
    )
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    assert _anthropic_text(got) == TEXT
    first, cont = mock.requests
    assert first.body == json.dumps(BODY).encode()  # the first request as the client sent it
    messages = cont.json()["messages"]
    assert messages[:-1] == BODY["messages"]
    committed = "".join(TEXT[i * len(TEXT) // 12 : (i + 1) * len(TEXT) // 12] for i in range(3))
    assert messages[-1] == {"role": "assistant", "content": committed.rstrip()}
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed" and turn.splices == 1
    assert turn.continuation == "spliced"


async def test_five_cuts_after_text_and_whitespace_at_the_joins(
    mock: MockProvider, relay: Relay
) -> None:
    server, rec = relay
    # 24 pieces of a text with double spaces: some cuts fall right after whitespace.
    shape = {"text": TEXT, "deltas": 24}
    mock.script([{**shape, "fault": "reset", "after_deltas": 2} for _ in range(5)] + [shape])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    assert _anthropic_text(got) == TEXT
    assert len(mock.requests) == 6
    prefills = [r.json()["messages"][-1]["content"] for r in mock.requests[1:]]
    assert all(p and not p[-1].isspace() and TEXT.startswith(p) for p in prefills)
    usage = next(obj for name, obj in _frames(got) if name == "message_delta")["usage"]
    # output: the last continuation's, plus what the cuts had produced (its prompt less
    # the original's); input: the original's
    first = make_reply("anthropic", shape, mock.requests[0].json())
    last = make_reply("anthropic", shape, mock.requests[-1].json())
    assert (
        usage["output_tokens"] == last.prompt_tokens - first.prompt_tokens + last.completion_tokens
    )
    assert usage["output_tokens"] > last.completion_tokens
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed" and turn.splices == 5


async def test_text_then_a_tool_call_after_the_cut_is_renumbered_and_held_whole(
    mock: MockProvider, relay: Relay
) -> None:
    """The continuation goes on with a block the client has not seen (a tool call after
    the text): it gets the client's next index, and the ledger releases it whole."""
    server, _ = relay
    text_shape = {"text": TEXT, "deltas": 8}
    mock.script([{**text_shape, "fault": "reset", "after_deltas": 8}, {"reply": "tool"}])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    frames = _frames(got)
    starts = [o for n, o in frames if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    stops = [o["index"] for n, o in frames if n == "content_block_stop"]
    assert stops == [0, 1]  # the client's text block closed before the call


async def test_default_setting_changes_nothing(mock: MockProvider) -> None:
    """Regression: without the setting the request goes as it is and a cut after text
    ends with the native error, byte for byte as before."""
    server, rec = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    try:
        body = json.dumps(BODY).encode()
        shape = {"text": TEXT, "deltas": 12}
        mock.script([{**shape, "fault": "reset", "after_deltas": 3}])
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{server.url}/mock/{MESSAGES}",
                data=body,
                headers={"content-type": "application/json"},
            ) as r,
        ):
            got = await r.read()
        [req] = mock.requests
        assert req.body == body
        sent = b"".join(frames_for("anthropic", shape, BODY)[:6])  # start, block, ping, 3
        assert got.startswith(sent)
        error = got[len(sent) :]
        assert error.startswith(b"event: error\n") and b"overloaded_error" in error
        assert [n for n, _ in _frames(error)] == ["error"]  # and nothing after it
        turn = (await rec.wait_turns(1))[0]
        assert turn.outcome == "ended_with_error" and turn.splices == 0
    finally:
        await server.stop()


def _ends_with_native_error(got: bytes) -> None:
    name, obj = _frames(got)[-1]
    assert name == "error" and obj["error"]["type"] == "overloaded_error"
    assert b"message_stop" not in got


async def test_a_tool_call_committed_is_refused(mock: MockProvider, relay: Relay) -> None:
    """Two parallel calls: the first is released whole, then the cut: a refusal, the
    native error, no continuation request."""
    server, rec = relay
    tools = {"reply": "tools", "deltas": 4}
    frames = frames_for("anthropic", tools, BODY)
    first_stop = next(i for i, f in enumerate(frames) if b"content_block_stop" in f)
    mock.script([{**tools, "fault": "reset", "after_frame": first_stop + 2}])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    assert b'"tool_use"' in got
    _ends_with_native_error(got)
    assert len(mock.requests) == 1
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "ended_with_error" and turn.continuation == "refused_tool_call"


async def test_thinking_enabled_is_refused(mock: MockProvider, relay: Relay) -> None:
    server, rec = relay
    body = {**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    mock.script([{"text": TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3}])
    got = await _post(f"{server.url}/mock/{MESSAGES}", body)
    _ends_with_native_error(got)
    assert len(mock.requests) == 1
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "ended_with_error" and turn.splices == 0


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


async def test_a_thinking_block_released_is_refused(
    relay_for_thinking: tuple[RelayServer, Recorder, list[int]],
) -> None:
    """An upstream that streams a thinking block, then text, then dies: refused."""
    server, rec, requests = relay_for_thinking
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    assert b"thinking_delta" in got
    _ends_with_native_error(got)
    assert requests == [1]  # no continuation request
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "ended_with_error" and turn.continuation == "refused_thinking"


@pytest.fixture
async def relay_for_thinking() -> AsyncIterator[tuple[RelayServer, Recorder, list[int]]]:
    requests: list[int] = []

    async def messages(request: web.Request) -> web.StreamResponse:
        requests.append(1)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        start = {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 3}}}
        await resp.write(_sse("message_start", start))
        block = {"type": "thinking", "thinking": ""}
        await resp.write(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        )
        delta = {"type": "thinking_delta", "thinking": "hmm"}
        await resp.write(
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        )
        await resp.write(_sse("content_block_stop", {"type": "content_block_stop", "index": 0}))
        text = {"type": "text", "text": ""}
        await resp.write(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": 1, "content_block": text},
            )
        )
        delta = {"type": "text_delta", "text": "Hello"}
        await resp.write(
            _sse("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": delta})
        )
        assert request.transport is not None
        request.transport.abort()  # the upstream dies after output
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = make_config(
        [{"url": f"http://127.0.0.1:{port}"}], stream={**STREAM, "after_commit": "continue"}
    )
    server, rec = await start_relay(cfg)
    try:
        yield server, rec, requests
    finally:
        await server.stop()
        await runner.cleanup()


async def test_a_model_that_refuses_prefill_ends_with_the_native_error_and_is_remembered(
    mock: MockProvider, relay: Relay
) -> None:
    """Claude 4.6 models answer a prefill with 400: the client never sees that 400, the
    turn ends as today, and the next cut to that upstream and model asks no more."""
    server, rec = relay
    cut = {"text": TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3}
    mock.script([cut, {"status": 400}])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    _ends_with_native_error(got)
    assert len(mock.requests) == 2
    mock.script([cut])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    _ends_with_native_error(got)
    assert len(mock.requests) == 3  # no second continuation request
    turns = await rec.wait_turns(2)
    assert turns[0].continuation == "refused_not_resumable"  # (the 400 refused prefill)
    assert turns[1].continuation == "refused_not_resumable"


@pytest.mark.parametrize("mode", ["prefix", "partial", "prefix_echo"])
async def test_chat_prefix_route_continues_a_chat_turn(mock: MockProvider, mode: str) -> None:
    """``prefix_echo``: the mock answers with the prefix first (as Mistral's does); the
    splicer checks it and drops it."""
    server, rec = await _relay(mock, chat_prefix=mode)
    try:
        shape: dict[str, Any] = {"text": TEXT, "deltas": 10}
        if mode == "prefix_echo":
            shape["prefix_echo"] = True
        mock.script([{**shape, "fault": "reset", "after_deltas": 4}, shape])
        body = {**CHAT_BODY, "stream_options": {"include_usage": True}}
        got = await _post(f"{server.url}/mock/{CHAT}", body)
        chunks = _frames(got)
        text = "".join(
            (c["delta"].get("content") or "") for _, o in chunks for c in o.get("choices") or []
        )
        assert text == TEXT
        assert got.endswith(b"data: [DONE]\n\n") and got.count(b"[DONE]") == 1
        assert len({o["id"] for _, o in chunks}) == 1  # the client's chunk id throughout
        cont = mock.requests[1].json()["messages"][-1]
        flag = "prefix" if mode == "prefix_echo" else mode
        assert cont[flag] is True and TEXT.startswith(cont["content"])
        turn = (await rec.wait_turns(1))[0]
        assert turn.outcome == "resumed"
    finally:
        await server.stop()


async def test_chat_without_a_prefix_mode_ends_as_today(mock: MockProvider, relay: Relay) -> None:
    server, rec = relay
    mock.script([{"text": TEXT, "deltas": 10, "fault": "reset", "after_deltas": 4}])
    got = await _post(f"{server.url}/mock/{CHAT}", CHAT_BODY)
    assert b'"server_error"' in got and b"[DONE]" not in got
    assert len(mock.requests) == 1
    await asyncio.wait_for(rec.wait_turns(1), 10)


async def test_a_cut_in_a_held_tool_call_after_text_is_continued_from_the_text(
    mock: MockProvider, relay: Relay
) -> None:
    """Text, then a tool call whose arguments are cut midway: the call was held (never
    released), so the client has the text only.  The continuation starts from that text;
    the partial call the ledger held is dropped, never released beside the new one."""
    server, rec = relay
    shape = {"reply": "text_tool", "text": TEXT, "deltas": 6, "tool_name": "bash"}
    frames = frames_for("anthropic", shape, BODY)
    tool_start = next(i for i, f in enumerate(frames) if b'"tool_use"' in f)
    mock.script([{**shape, "fault": "reset", "after_frame": tool_start + 3}, shape])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    assert _anthropic_text(got) == TEXT
    starts = [o for n, o in _frames(got) if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [
        (0, "text"),
        (1, "tool_use"),
    ]
    args = "".join(
        o["delta"]["partial_json"]
        for n, o in _frames(got)
        if n == "content_block_delta" and o["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(args) == {"command": "echo hello"}
    assert mock.requests[1].json()["messages"][-1] == {"role": "assistant", "content": TEXT}
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed"


async def test_chat_a_cut_in_a_held_tool_call_after_text_is_continued_from_the_text(
    mock: MockProvider,
) -> None:
    server, _ = await _relay(mock, chat_prefix="prefix")
    try:
        shape = {"reply": "text_tool", "text": TEXT, "deltas": 6, "tool_name": "bash"}
        frames = frames_for("chat", shape, CHAT_BODY)
        first_call = next(i for i, f in enumerate(frames) if b'"tool_calls"' in f)
        mock.script([{**shape, "fault": "reset", "after_frame": first_call + 2}, shape])
        got = await _post(f"{server.url}/mock/{CHAT}", CHAT_BODY)
        text, calls, args = "", [], ""
        for _, obj in _frames(got):
            for choice in obj.get("choices") or []:
                text += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or []:
                    if call.get("id"):
                        calls.append(call["id"])
                    args += call["function"].get("arguments") or ""
        assert text == TEXT
        assert len(calls) == 1 and json.loads(args) == {"command": "echo hello"}
    finally:
        await server.stop()


async def test_an_overloaded_error_event_after_text_is_continued(
    mock: MockProvider, relay: Relay
) -> None:
    """Anthropic's own ``overloaded_error`` event mid-stream, after text: a cut like a
    reset for the prefill continuation (the next request is a new message): the client
    sees no error and the exact text."""
    server, rec = relay
    shape = {"text": TEXT, "deltas": 12}
    overloaded = {"fault": "error_event", "error": "overloaded", "after_deltas": 4}
    mock.script([{**shape, **overloaded}, {**shape, **overloaded, "after_deltas": 2}, shape])
    got = await _post(f"{server.url}/mock/{MESSAGES}", BODY)
    assert _anthropic_text(got) == TEXT
    assert len(mock.requests) == 3
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed" and turn.splices == 2


async def test_an_overloaded_error_event_refused_ends_as_before(mock: MockProvider) -> None:
    """The same error event with the default setting, and with the setting on a turn a
    refusal applies to (thinking on): the client gets the same bytes."""
    shape = {"text": TEXT, "deltas": 12}
    overloaded = {**shape, "fault": "error_event", "error": "overloaded", "after_deltas": 4}
    body = {**BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    got = []
    for stream in (STREAM, {**STREAM, "after_commit": "continue"}):
        server, _ = await start_relay(make_config([{"url": mock.url}], stream=stream))
        try:
            mock.script([overloaded])
            got.append(await _post(f"{server.url}/mock/{MESSAGES}", body))
        finally:
            await server.stop()
    assert got[0] == got[1]
    _ends_with_native_error(got[0])
    assert len(mock.requests) == 2  # one each: no continuation request


async def test_a_continuation_carries_the_routes_key_as_its_attempts_do(mock: MockProvider) -> None:
    """A route with its own key for an Anthropic upstream: the continuation request
    sends it in ``x-api-key``, as the turn's first attempt did (never a bearer token)."""
    cfg = make_config(
        [{"url": mock.url, "api_key_env": "PREFILL_KEY"}],
        stream={**STREAM, "after_commit": "continue"},
        env={"PREFILL_KEY": "sk-ant-route"},
    )
    server, _ = await start_relay(cfg)
    try:
        shape = {"text": TEXT, "deltas": 12}
        mock.script([{**shape, "fault": "reset", "after_deltas": 3}, shape])
        # the route injects a key: the request carries the relay's token (issue 25)
        got = await _post(f"{server.url}/t/{KEY_TOKEN}/mock/{MESSAGES}", BODY)
        assert _anthropic_text(got) == TEXT
        first, cont = mock.requests
        assert first.headers["x-api-key"] == cont.headers["x-api-key"] == "sk-ant-route"
        assert "authorization" not in cont.headers
    finally:
        await server.stop()


async def test_a_gzip_request_is_continued_with_a_plain_json_body(
    mock: MockProvider, relay: Relay
) -> None:
    """Claude Code may send its body gzip-compressed: the first request goes upstream as
    the client sent it; the continuation is built from the decoded request and sent as
    plain JSON, without the Content-Encoding."""
    server, rec = relay
    shape = {"text": TEXT, "deltas": 12}
    mock.script([{**shape, "fault": "reset", "after_deltas": 3}, shape])
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{server.url}/mock/{MESSAGES}",
            data=gzip.compress(json.dumps(BODY).encode()),
            headers=headers,
        ) as r,
    ):
        assert r.status == 200
        got = await r.read()
    assert _anthropic_text(got) == TEXT
    first, cont = mock.requests
    assert first.headers.get("content-encoding") == "gzip"
    assert "content-encoding" not in cont.headers
    assert cont.json()["messages"][-1]["role"] == "assistant"
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed"


async def test_chat_prefix_echo_that_does_not_repeat_the_prefix_ends_with_the_native_error(
    mock: MockProvider,
) -> None:
    """An upstream named ``prefix_echo`` whose answer does not start with the prefix: the
    join is broken, never spliced: the turn ends with the native error."""
    server, rec = await _relay(mock, chat_prefix="prefix_echo")
    try:
        shape = {"text": TEXT, "deltas": 10}
        mock.script([{**shape, "fault": "reset", "after_deltas": 4}, shape])
        got = await _post(f"{server.url}/mock/{CHAT}", CHAT_BODY)
        assert b'"server_error"' in got and b"[DONE]" not in got
        turn = (await rec.wait_turns(1))[0]
        assert turn.outcome == "ended_with_error" and turn.continuation == "refused_join"
    finally:
        await server.stop()
