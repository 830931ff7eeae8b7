"""hold = [..., "tool_tail"]: a complete tool call waits for the end of its message while
nothing was released, so a cut in that gap is replayed, not an error after commit."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import aiohttp
import pytest

from relayfix import start_relay
from unbroken.config import parse_config
from unbroken.core.profiles import check_overrides, profile_named
from unbroken.core.turn.ledger import Hold, Ledger, LedgerState, Verdict
from unbroken.core.wire.protocols import ANTHROPIC, RESPONSES, Protocol
from unbroken.core.wire.sse import Event, SSESplitter
from unbroken.mock.wire import events_for, frames_for

TAIL = Hold(("control", "tool_calls", "tool_tail"))
BODY = {
    "model": "m",
    "stream": True,
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


def _events(protocol: str, action: dict[str, Any]) -> list[Event]:
    return SSESplitter().feed(b"".join(frames_for(protocol, action, BODY)))


def _feed(ledger: Ledger, events: list[Event]) -> list[list[bytes]]:
    return [[e.raw for e in ledger.feed(ev)] for ev in events]


def _name(ev: Event) -> str:
    return ev.name or ""


def test_anthropic_call_waits_for_message_stop_and_a_cut_in_the_gap_replays() -> None:
    events = _events("anthropic", {"reply": "tool"})
    stop = max(i for i, e in enumerate(events) if _name(e) == "content_block_stop")
    assert [_name(e) for e in events[stop + 1 :]] == ["message_delta", "message_stop"]
    # without tool_tail the call is released at its content_block_stop: a cut after it
    # is a failure after commit
    plain = Ledger(ANTHROPIC)
    out = _feed(plain, events[: stop + 1])
    assert out[stop] and plain.state is LedgerState.COMMITTED
    # with it, nothing is released yet, and the cut replays
    ledger = Ledger(ANTHROPIC, hold=TAIL)
    assert not any(_feed(ledger, events[: stop + 2]))
    ledger.failed("reset")
    assert ledger.verdict is Verdict.REPLAY
    # the replay's message_stop releases everything, in order
    ledger.start_attempt()
    out = _feed(ledger, events)
    assert [raw for frames in out for raw in frames] == [e.raw for e in events]
    assert ledger.state is LedgerState.DONE


def test_responses_call_waits_for_response_completed() -> None:
    events = _events("responses", {"reply": "tool"})
    done = max(i for i, e in enumerate(events) if _name(e) == "response.output_item.done")
    ledger = Ledger(RESPONSES, hold=TAIL)
    out = _feed(ledger, events)
    assert not any(out[: len(events) - 1])
    assert [raw for raw in out[-1]] == [e.raw for e in events]
    assert done == len(events) - 2


def _parallel(protocol: Protocol, name: str, start_name: str, end_name: str) -> None:
    events = _events(name, {"reply": "tools"})
    ends = [i for i, e in enumerate(events) if _name(e) == end_name]
    ledger = Ledger(protocol, hold=TAIL)
    out = _feed(ledger, events[: ends[-1] + 1])
    # the first call waits for the second, and both for the message's end: a cut after
    # the second call's end (or in it) replays, so the first was never seen either
    assert not any(out)
    ledger.failed("reset")
    assert ledger.verdict is Verdict.REPLAY
    ledger.start_attempt()
    out = _feed(ledger, events)
    assert [i for i, frames in enumerate(out) if frames] == [len(events) - 1]
    assert ledger.state is LedgerState.DONE
    assert [raw for frames in out for raw in frames] == [e.raw for e in events]


def test_parallel_calls_wait_for_the_end_of_the_message_together() -> None:
    _parallel(ANTHROPIC, "anthropic", "content_block_start", "content_block_stop")
    _parallel(RESPONSES, "responses", "response.output_item.added", "response.output_item.done")


def test_after_text_a_complete_call_is_held_and_a_cut_drops_it() -> None:
    """Text before the call committed the turn: no replay is possible, but the complete
    call still waits for the message's end, and a cut in that gap drops it with the
    native error (the client, which retries, never saw a call the model is asked for
    again); without tool_tail the call was released at its end (issue 33: OpenCode ran
    it, then retried the step and ran the model's second call too)."""
    events = _events("anthropic", {"reply": "text_tool", "text": "Let me run it."})
    stop = max(i for i, e in enumerate(events) if _name(e) == "content_block_stop")
    plain = Ledger(ANTHROPIC)
    assert _feed(plain, events[: stop + 1])[stop]  # released at its end
    ledger = Ledger(ANTHROPIC, hold=TAIL)
    out = _feed(ledger, events[: stop + 2])
    assert ledger.state is LedgerState.COMMITTED  # the text went out
    released = b"".join(raw for frames in out for raw in frames)
    assert b"tool_use" not in released and b"text_delta" in released
    error = ledger.failed("reset")
    assert ledger.verdict is Verdict.FAIL and b"overloaded_error" in error
    assert b"tool_use" not in error
    # uncut, the call goes out with the message's end
    ledger = Ledger(ANTHROPIC, hold=TAIL)
    out = _feed(ledger, events)
    assert [raw for frames in out for raw in frames] == [e.raw for e in events]
    assert any(b'"type":"tool_use"' in raw for raw in out[-1])


def test_config_accepts_tool_tail() -> None:
    cfg = parse_config({"stream": {"hold": ["control", "tool_calls", "tool_tail"]}}, env={})
    assert Hold(cfg.stream.hold).tool_tail
    assert not Hold(("control", "tool_tail")).tool_tail  # needs tool_calls


# -- the default per client profile (issue 33) -------------------------------------------------
def test_profiles_add_tool_tail_for_the_clients_that_need_it() -> None:
    """Codex and OpenCode start a tool at the call's end and retry the turn after a
    cut that follows: their profiles add ``tool_tail`` to ``[stream] hold``; the others
    follow the setting; ``[clients.X] tool_tail`` overrides either way."""
    base = ("control", "tool_calls")
    assert Hold(profile_named("codex").hold_names(base)).tool_tail
    assert Hold(profile_named("opencode").hold_names(base)).tool_tail
    for name in ("claude-code", "gemini-cli", "openai-sdk", "anthropic-sdk", "unknown"):
        assert profile_named(name).hold_names(base) == base, name
        assert "tool_tail" in profile_named(name).hold_names((*base, "tool_tail")), name
    off = {"codex": check_overrides("codex", {"tool_tail": False})}
    assert profile_named("codex", off).hold_names((*base, "tool_tail")) == base
    on = {"unknown": check_overrides("unknown", {"tool_tail": True})}
    assert Hold(profile_named("unknown", on).hold_names(base)).tool_tail
    # without tool_calls there is no complete call to hold on
    assert not Hold(profile_named("codex").hold_names(("control",))).tool_tail


def test_clients_tool_tail_must_be_a_boolean() -> None:
    from unbroken.config import ConfigError

    with pytest.raises(ConfigError, match="tool_tail: expected bool"):
        parse_config({"clients": {"codex": {"tool_tail": "yes"}}}, env={})


CODEX_UA = {"User-Agent": "codex_exec/0.169.0 (Ubuntu 24.4.0; x86_64) xterm (codex-exec; 0.169.0)"}
OPENCODE_UA = {"User-Agent": "opencode/1.18.33 ai-sdk/provider-utils/3.0.20 runtime/bun/1.3.1"}
UNKNOWN_UA = {"User-Agent": "curl/8.5.0"}


#: the frame that ends a tool call
END = {
    "responses": b"event: response.output_item.done\n",
    "anthropic": b"event: content_block_stop\n",
}


def _cut_after_call(protocol: str, end_name: str, reply: str = "tool") -> dict[str, Any]:
    """A tool call, whole, then a reset before the end of the message."""
    tool = {"reply": reply, "tool_name": "bash", "tool_args": {"command": "echo hi"}}
    names = [name for name, _ in events_for(protocol, tool, BODY)]
    end = max(i for i, name in enumerate(names) if name == end_name)
    return {**tool, "fault": "reset", "after_frame": end + 1}


async def _turn(
    mock: Any,
    protocol: str,
    headers: dict[str, str],
    *,
    clients: dict[str, Any] | None = None,
    stream: dict[str, Any] | None = None,
    reply: str = "tool",
) -> tuple[bytes, int]:
    """One streamed turn through a relay whose upstream cuts the first answer right after
    its complete tool call; returns what the client got and how many requests went up."""
    end_name, path = {
        "responses": ("response.output_item.done", "mock/v1/responses"),
        "anthropic": ("content_block_stop", "mock/v1/messages"),
    }[protocol]
    mock.reset()
    cut = _cut_after_call(protocol, end_name, reply)
    mock.script([cut, {k: v for k, v in cut.items() if k not in ("fault", "after_frame")}])
    cfg = parse_config(
        {
            "retry": {"delay_ms": 5, "backoff": "fixed"},
            "routes": {"mock": {"upstreams": [{"url": mock.url}]}},
            "journal": {"enabled": False},
            "stream": stream or {},
            "clients": clients or {},
        },
        env={},
    )
    server, _ = await start_relay(dataclasses.replace(cfg, port=0, grace_s=5.0))
    body = b""
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/{path}", json=BODY | {"stream": True}, headers=headers) as r,
        ):
            with contextlib.suppress(aiohttp.ClientPayloadError):
                async for chunk in r.content.iter_any():
                    body += chunk
    finally:
        await server.stop()
    return body, len(mock.requests)


@pytest.mark.parametrize(
    ("protocol", "headers", "terminal"),
    [
        ("responses", CODEX_UA, b"event: response.completed"),
        ("anthropic", OPENCODE_UA, b"event: message_stop"),
        ("responses", OPENCODE_UA, b"event: response.completed"),
    ],
    ids=["codex", "opencode-anthropic", "opencode-openai"],
)
async def test_a_cut_right_after_a_complete_call_is_replayed_by_default(
    mock: Any, protocol: str, headers: dict[str, str], terminal: bytes
) -> None:
    """Zero config: for Codex and OpenCode the call was never released when the cut
    came, so the relay replays it and the client gets one clean call (before issue 33
    it got the call, then the native error, and ran the model's next call as well)."""
    body, requests = await _turn(mock, protocol, headers)
    assert requests == 2
    assert body.count(END[protocol]) == 1 and terminal in body  # one call, whole
    assert b"overloaded" not in body and b"response.failed" not in body
    assert b"event: error" not in body


@pytest.mark.parametrize(
    ("protocol", "headers", "clients", "stream"),
    [
        ("responses", UNKNOWN_UA, None, None),  # an unknown client: [stream] hold
        ("anthropic", OPENCODE_UA, {"opencode": {"tool_tail": False}}, None),
        ("responses", CODEX_UA, {"codex": {"tool_tail": False}}, None),
        ("responses", CODEX_UA, None, {"hold": ["control"]}),  # no dispatch gate at all
    ],
    ids=["unknown", "opencode-off", "codex-off", "no-tool-hold"],
)
async def test_without_the_tail_the_call_is_released_and_the_cut_ends_with_an_error(
    mock: Any,
    protocol: str,
    headers: dict[str, str],
    clients: dict[str, Any] | None,
    stream: dict[str, Any] | None,
) -> None:
    body, requests = await _turn(mock, protocol, headers, clients=clients, stream=stream)
    assert requests == 1
    assert body.count(END[protocol]) == 1  # the call was released
    assert b"event: error" in body


async def test_stream_hold_adds_the_tail_for_every_client(mock: Any) -> None:
    body, requests = await _turn(
        mock, "responses", UNKNOWN_UA, stream={"hold": ["control", "tool_calls", "tool_tail"]}
    )
    assert requests == 2 and b"event: response.completed" in body


@pytest.mark.parametrize("headers", [OPENCODE_UA, CODEX_UA], ids=["opencode", "codex"])
async def test_after_text_a_cut_right_after_the_call_drops_it_with_the_error(
    mock: Any, headers: dict[str, str]
) -> None:
    """Text, then a complete call, then the cut: the text committed the turn, so the
    relay ends it with the native error, but the call was still held and is dropped:
    the client, which retries the step, never ran it (before issue 33 OpenCode ran it,
    then ran the model's call of the retried step: bash twice)."""
    body, requests = await _turn(mock, "anthropic", headers, reply="text_tool")
    assert requests == 1
    assert b"text_delta" in body and b"overloaded_error" in body
    assert b'"type":"tool_use"' not in body
