"""The commit ledger over real sockets: protocol x fault x phase against the mock.

Phases are found by classifying the mock's successful stream with the
project's own classifiers (tested on their own in tests/protocols):
before any frame, after the control frames, mid tool arguments, after output.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from relayfix import Recorder, make_config, start_relay
from unbroken.core.wire.protocols import Kind, protocol_for_path
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

PATHS = {
    "chat": "v1/chat/completions",
    "responses": "v1/responses",
    "anthropic": "v1/messages",
}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "responses": {"model": "m", "input": "hi", "stream": True},
    "anthropic": {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    },
}
SUCCESS_TERMINALS = {
    "chat": [b"data: [DONE]", b'"finish_reason": "stop"', b'"finish_reason":"stop"'],
    "responses": [b"response.completed"],
    "anthropic": [b"message_stop"],
}
STREAM = {"first_frame_timeout_s": 0.5, "idle_timeout_s": 0.5, "keepalive_s": 30}


@pytest.fixture
async def relay(mock: MockProvider) -> AsyncIterator[tuple[RelayServer, Recorder]]:
    server, rec = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    yield server, rec
    await server.stop()


async def _fetch(url: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.read()
        return await r.read()


def _frames(proto: str, raw: bytes) -> list[tuple[bytes, int]]:
    classifier = protocol_for_path(PATHS[proto]).new_classifier()
    return [(e.raw, classifier.classify(e)[0]) for e in SSESplitter().feed(raw)]


def _phase(frames: list[tuple[bytes, int]], phase: str) -> int:
    """The number of frames to send before the fault, for a named phase."""
    if phase == "before_any":
        return 0
    if phase == "after_control":
        return next(i for i, (_, k) in enumerate(frames) if k != Kind.CONTROL)
    if phase == "mid_tool":
        return next(i for i, (_, k) in enumerate(frames) if k & Kind.TOOL_DELTA) + 1
    if phase == "after_output":
        return next(i for i, (_, k) in enumerate(frames) if k & Kind.OUTPUT) + 1
    raise AssertionError(phase)


async def _direct(mock: MockProvider, proto: str, reply: str) -> bytes:
    mock.script([{"reply": reply}])
    raw = await _fetch(f"{mock.url}/{PATHS[proto]}", BODIES[proto])
    mock.reset()
    return raw


RECOVERABLE = [
    ("reset", "before_any", "text"),
    ("reset", "after_control", "text"),
    ("reset", "mid_tool", "tool"),
    ("end", "mid_tool", "tool"),
    ("end", "after_control", "text"),
    ("error_event", "after_control", "text"),
    ("stall", "after_control", "text"),
    ("stall", "before_any", "text"),
    ("malformed", "after_control", "text"),
    ("reset", "mid_tool", "tools"),
]


@pytest.mark.parametrize("proto", list(PATHS))
@pytest.mark.parametrize(("fault", "phase", "reply"), RECOVERABLE)
async def test_failure_before_commit_is_invisible(
    mock: MockProvider,
    relay: tuple[RelayServer, Recorder],
    proto: str,
    fault: str,
    phase: str,
    reply: str,
) -> None:
    server, rec = relay
    direct = await _direct(mock, proto, reply)
    k = _phase(_frames(proto, direct), phase)
    action: dict[str, Any] = {"fault": fault, "after_frame": k, "reply": reply}
    if fault == "error_event":
        action["error"] = "overloaded"
    if fault == "stall":
        action["seconds"] = 30
    mock.script([action, {"reply": reply}])
    got = await _fetch(f"{server.url}/mock/{PATHS[proto]}", BODIES[proto])
    assert got == direct  # exactly one attempt's frames, none of the dead one's
    assert len(mock.requests) == 2
    turns = await rec.wait_turns(1)
    assert turns[0].outcome == "recovered"


FATAL = [("reset", "after_output"), ("end", "after_output"), ("stall", "after_output")]


@pytest.mark.parametrize("proto", list(PATHS))
@pytest.mark.parametrize(("fault", "phase"), FATAL)
async def test_failure_after_commit_ends_with_native_error(
    mock: MockProvider, relay: tuple[RelayServer, Recorder], proto: str, fault: str, phase: str
) -> None:
    server, rec = relay
    direct = await _direct(mock, proto, "text")
    frames = _frames(proto, direct)
    k = _phase(frames, phase)
    action: dict[str, Any] = {"fault": fault, "after_frame": k, "reply": "text"}
    if fault == "stall":
        action["seconds"] = 30
    mock.script([action, {"reply": "text"}])
    got = await _fetch(f"{server.url}/mock/{PATHS[proto]}", BODIES[proto])
    prefix = b"".join(raw for raw, _ in frames[:k])
    assert got.startswith(prefix)
    tail = SSESplitter().feed(got[len(prefix) :])
    assert b"".join(e.raw for e in tail) == got[len(prefix) :]
    assert len(tail) == (2 if proto == "responses" else 1)
    err = tail[-1]
    payload = json.loads(err.data or "")
    if proto == "chat":
        assert payload["error"]["type"] == "server_error"
    elif proto == "responses":
        first = json.loads(tail[0].data or "")
        assert tail[0].name == "error" and first["error"]["type"] == "server_error"
        assert err.name == "response.failed"
        assert payload["response"]["status"] == "failed"
        assert payload["response"]["error"]["code"] == "server_error"
        created = json.loads(SSESplitter().feed(prefix)[0].data or "")
        assert payload["response"]["id"] == created["response"]["id"]
    else:
        assert err.name == "error"
        assert payload["error"]["type"] == "overloaded_error"
    for terminal in SUCCESS_TERMINALS[proto]:
        assert terminal not in got
    assert len(mock.requests) == 1  # never replayed after commit
    turns = await rec.wait_turns(1)
    assert turns[0].outcome == "ended_with_error"


@pytest.mark.parametrize("proto", list(PATHS))
async def test_non_retryable_stream_error_passes_through(
    mock: MockProvider, relay: tuple[RelayServer, Recorder], proto: str
) -> None:
    server, rec = relay
    direct = await _direct(mock, proto, "text")
    k = _phase(_frames(proto, direct), "after_control")
    mock.script([{"fault": "error_event", "after_frame": k, "error": "invalid_request"}])
    got = await _fetch(f"{server.url}/mock/{PATHS[proto]}", BODIES[proto])
    assert len(mock.requests) == 1
    events = SSESplitter().feed(got)
    assert events[-1].data and "error" in events[-1].data
    assert (await rec.wait_turns(1))[0].outcome == "passed_through_error"


async def test_hold_all_replays_after_output(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}], stream={**STREAM, "hold": ["all"]})
    server, _ = await start_relay(cfg)
    try:
        direct = await _direct(mock, "chat", "text")
        k = _phase(_frames("chat", direct), "after_output")
        mock.script([{"fault": "reset", "after_frame": k + 1, "reply": "text"}, {"reply": "text"}])
        got = await _fetch(f"{server.url}/mock/{PATHS['chat']}", BODIES["chat"])
        assert got == direct
        assert len(mock.requests) == 2
    finally:
        await server.stop()


async def test_early_headers_and_keepalive_while_retrying(mock: MockProvider) -> None:
    stream = {**STREAM, "early_headers_s": 0.2, "keepalive_s": 0.1}
    server, _ = await start_relay(
        make_config([{"url": mock.url}], retry={"delay_ms": 400, "backoff": "fixed"}, stream=stream)
    )
    try:
        direct = await _direct(mock, "chat", "text")
        mock.script([{"status": 503}, {"status": 503}, {"reply": "text"}])
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/mock/{PATHS['chat']}", json=BODIES["chat"]) as r,
        ):
            assert r.status == 200  # sent early, while the relay still retried
            got = await r.read()
        assert got.startswith(b": keepalive\n\n")
        assert got.replace(b": keepalive\n\n", b"") == direct
    finally:
        await server.stop()


async def test_non_retryable_status_after_early_headers_is_an_error_event(
    mock: MockProvider,
) -> None:
    stream = {**STREAM, "early_headers_s": 0.1}
    server, _ = await start_relay(
        make_config([{"url": mock.url}], retry={"delay_ms": 300, "backoff": "fixed"}, stream=stream)
    )
    try:
        mock.script([{"status": 503}, {"status": 400}])
        got = await _fetch(f"{server.url}/mock/{PATHS['chat']}", BODIES["chat"])
        events = [e for e in SSESplitter().feed(got) if e.data]
        assert len(events) == 1
        assert "error" in json.loads(events[0].data or "")
    finally:
        await server.stop()
