"""Issue 33 item 4 over real sockets, with the mock's faults: every spliced byte checked.

Each test fails on the code before issue 33: a resume naming another response was
caught only at its ``response.completed`` (after its text and a complete tool call
were released), a 400 refusing background mode in other words ended every turn, and
the upstream's response id went into the resume GET and the cancel POST unchecked.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from relay.test_health_relay import until
from relayfix import Recorder, make_config, start_relay
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

PATH = "v1/responses"
BODY: dict[str, Any] = {"model": "m", "input": "hi", "stream": True, "store": False}
TEXT = "The quick brown fox jumps over the lazy dog, twice over."
STREAM = {"first_frame_timeout_s": 2, "idle_timeout_s": 2, "keepalive_s": 30}
#: frames before the first text delta (background mode): created, queued, in_progress,
#: item added, part added
FIRST_DELTA = 6
TOOL = {"reply": "tool", "tool_name": "exec_command", "tool_args": {"cmd": "echo ran"}}

Relay = tuple[RelayServer, Recorder]


@pytest.fixture
async def relay(mock: MockProvider) -> AsyncIterator[Relay]:
    cfg = make_config([{"url": mock.url}], stream={**STREAM, "after_commit": "continue"})
    server, rec = await start_relay(cfg)
    yield server, rec
    await server.stop()


async def _post(url: str, body: dict[str, Any] | None = None) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body or BODY) as r:
        assert r.status == 200, await r.read()
        return await r.read()


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.data or "") for e in SSESplitter().feed(raw) if e.data]


async def test_a_resume_naming_another_response_releases_nothing_of_it(
    mock: MockProvider, relay: Relay
) -> None:
    """The resume keeps the sequence numbers and item ids but names another response
    (only its ``response.completed`` says so): the client gets the text before the cut
    once, then the native error; no text of the resume, no second copy of anything."""
    server, rec = relay
    k = FIRST_DELTA + 2
    mock.script([{"text": TEXT, "fault": "reset", "after_frame": k}, {"resume": "other_response"}])
    got = _events(await _post(f"{server.url}/mock/{PATH}"))
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert len(deltas) == k - FIRST_DELTA + 1  # those released before the cut, once
    assert [e["type"] for e in got[-2:]] == ["error", "response.failed"]
    assert not any(e["type"] == "response.completed" for e in got)
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "ended_with_error" and turn.continuation == "refused_join"
    await until(lambda: bool(mock.background.cancels), cap=10)


async def test_a_resume_of_another_response_never_completes_a_held_tool_call(
    mock: MockProvider, relay: Relay
) -> None:
    """Cut in the middle of a tool call's arguments (held: nothing released), then a
    resume of another response that would complete the call: refused before the call
    is released, and the turn replayed (nothing was released): one call, the one of
    the response that completes.  Before, the other response's call was released,
    then its ``response.completed`` ended the turn with an error: a tool run for a
    response the client never gets."""
    server, _ = relay
    mock.script([{**TOOL, "fault": "reset", "after_frame": 5}, {"resume": "other_response"}])
    got = _events(await _post(f"{server.url}/mock/{PATH}"))
    types = [e["type"] for e in got]
    assert types.count("response.output_item.done") == 1
    assert types.count("response.completed") == 1 and "error" not in types
    done = next(e for e in got if e["type"] == "response.completed")["response"]["id"]
    assert all(e["response"]["id"] == done for e in got if "response" in e)
    assert [q.method for q in mock.requests if not q.path.endswith("/cancel")] == [
        "POST",
        "GET",
        "POST",
    ]


@pytest.mark.parametrize("rid", ["..", "resp_..", "a#frag", "resp_%2F..", "x?y=1"])
async def test_a_response_id_that_is_no_plain_token_is_never_put_in_a_url(
    mock: MockProvider, relay: Relay, rid: str
) -> None:
    """The upstream names a response id that would change the URL it goes into (a
    parent path, a fragment, an encoded slash): no resume GET, no cancel POST; the cut
    ends as without continuation (the native error)."""
    server, rec = relay
    mock.script([{"text": TEXT, "response_id": rid, "fault": "reset", "after_frame": 8}])
    raw = await _post(f"{server.url}/mock/{PATH}")
    assert _events(raw)[-1]["type"] == "response.failed"
    turn = (await rec.wait_turns(1))[0]
    assert turn.continuation == "refused_no_handle"
    assert [(q.method, q.path) for q in mock.requests] == [("POST", f"/{PATH}")]
    assert mock.background.cancels == []


async def test_a_400_refusing_background_in_other_words_is_learnt(
    mock: MockProvider, relay: Relay
) -> None:
    """A 400 that names neither ``background`` nor ``store`` (a proxy's "Unsupported
    parameter."): the turn asks once more as the client sent it, that succeeds, so the
    400 was a refusal of background mode: remembered, and the next turn goes as the
    client sent it at once.  Before, every turn ended with that 400."""
    server, rec = relay
    refusal = {
        "status": 400,
        "body": '{"error":{"message":"Unsupported parameter.","type":'
        '"invalid_request_error","param":null,"code":null}}',
    }
    mock.script([refusal, {"text": TEXT}, {"text": TEXT}])
    for _ in range(2):
        got = _events(await _post(f"{server.url}/mock/{PATH}"))
        assert got[-1]["type"] == "response.completed"
    sent = [q.json() for q in mock.requests]
    assert sent[0]["background"] is True
    assert sent[1] == BODY and sent[2] == BODY  # the client's request, as it sent it
    turns = await rec.wait_turns(2)
    assert [t.outcome for t in turns] == ["ok", "ok"]
    assert turns[0].continuation == "refused_not_resumable"


async def test_a_400_to_the_clients_own_request_is_the_providers_answer(
    mock: MockProvider, relay: Relay
) -> None:
    """The same 400 again without background mode: the provider's answer to the
    client's request reaches it as it is; nothing is remembered (the next turn is a
    background one again)."""
    server, _ = relay
    bad = {"status": 400, "body": '{"error":{"message":"bad model","param":"model"}}'}
    mock.script([bad, bad, {"text": TEXT}])
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/mock/{PATH}", json=BODY) as r:
        assert r.status == 400
        assert b"bad model" in await r.read()
    await _post(f"{server.url}/mock/{PATH}")
    sent = [q.json() for q in mock.requests]
    assert "background" not in sent[1] and sent[2]["background"] is True


MESSAGES = "v1/messages"
ECHO_TEXT = "The quick brown fox jumps over the lazy dog, and then naps.  Twice over!"
ECHO_BODY: dict[str, Any] = {
    "model": "claude-mock",
    "max_tokens": 256,
    "stream": True,
    "messages": [{"role": "user", "content": "tell me"}],
}


def _shown_text(raw: bytes) -> str:
    out = []
    for e in SSESplitter().feed(raw):
        if e.name == "content_block_delta" and e.data:
            out.append(json.loads(e.data)["delta"].get("text", ""))
    return "".join(out)


@pytest.mark.parametrize(
    "echo",
    [{"prefix_echo": True}, {"echo_tail": 3}, {"echo_tail": 9}],
    ids=["whole_prefill", "partial_word", "two_words"],
)
async def test_an_anthropic_continuation_that_echoes_the_prefill_is_refused(
    mock: MockProvider, relay: Relay, echo: dict[str, Any]
) -> None:
    """The continuation repeats the prefill (or its last word or two) before going on:
    never shown twice; the turn ends with Anthropic's native retryable error and the
    client has a prefix of the text, once.  Before, the client saw the text twice."""
    server, rec = relay
    mock.script(
        [
            {"text": ECHO_TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3},
            {"text": ECHO_TEXT, "deltas": 12, **echo},
        ]
    )
    raw = await _post(f"{server.url}/mock/{MESSAGES}", ECHO_BODY)
    shown = _shown_text(raw)
    assert ECHO_TEXT.startswith(shown) and shown  # a prefix, nothing twice
    names = [e.name for e in SSESplitter().feed(raw)]
    assert names[-1] == "error" and "message_stop" not in names
    assert b"overloaded_error" in raw or b"api_error" in raw
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "ended_with_error" and turn.continuation == "refused_join"


async def test_an_anthropic_continuation_of_a_word_is_spliced(
    mock: MockProvider, relay: Relay
) -> None:
    """Guard: a continuation that goes on inside the word (no repeat) is spliced."""
    server, _ = relay
    mock.script(
        [
            {"text": ECHO_TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3},
            {"text": ECHO_TEXT, "deltas": 12},
        ]
    )
    raw = await _post(f"{server.url}/mock/{MESSAGES}", ECHO_BODY)
    assert _shown_text(raw) == ECHO_TEXT


async def test_a_chat_prefix_continuation_that_echoes_the_prefix_is_refused(
    mock: MockProvider,
) -> None:
    """The same join check for a Chat route's documented prefix mode (DeepSeek's
    ``prefix: true``): a continuation that starts with the end of the prefix again is
    refused with the native error, never shown twice."""
    import dataclasses

    cfg = make_config([{"url": mock.url}], stream={**STREAM, "after_commit": "continue"})
    routes = {n: dataclasses.replace(r, chat_prefix="prefix") for n, r in cfg.routes.items()}
    server, rec = await start_relay(dataclasses.replace(cfg, routes=routes))
    try:
        mock.script(
            [
                {"text": ECHO_TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3},
                {"text": ECHO_TEXT, "deltas": 12, "echo_tail": 3},
            ]
        )
        body = {"model": "deepseek-mock", "stream": True, "messages": ECHO_BODY["messages"]}
        raw = await _post(f"{server.url}/mock/v1/chat/completions", body)
        text = "".join(
            (c["delta"].get("content") or "")
            for e in SSESplitter().feed(raw)
            if e.data and e.data != "[DONE]"
            for c in json.loads(e.data).get("choices") or []
        )
        assert ECHO_TEXT.startswith(text) and text
        assert b"[DONE]" not in raw
        turn = (await rec.wait_turns(1))[0]
        assert turn.continuation == "refused_join"
    finally:
        await server.stop()
