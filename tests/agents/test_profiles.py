"""Client profiles (core/profiles.py): recognition, overrides, and what the machine does
with them: early headers, the keepalive form, the non-streamed wait, final errors."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from multidict import CIMultiDict

from turnfix import Report, Timers
from unbroken.config import ConfigError, parse_config
from unbroken.core.ledger import Hold
from unbroken.core.policy import RetryPolicy, RetryState
from unbroken.core.profiles import PROFILES, KeepaliveForm, Profile, identify, profile_for
from unbroken.core.protocols import ANTHROPIC, CHAT, RESPONSES, Protocol
from unbroken.core.sse import SSESplitter
from unbroken.core.turn import (
    KEEPALIVE,
    End,
    EndKind,
    FinalInStream,
    Keepalive,
    Open,
    SendHeaders,
    Stream,
    TurnMachine,
)
from unbroken.relay.http import session_id_of


def machine(profile: Profile | None, protocol: Protocol = RESPONSES, *, stream: bool = True,
            **timers: Any) -> TurnMachine:
    return TurnMachine(
        protocol=protocol,
        hold=Hold(),
        timers=Timers(**timers),
        retry=RetryState(RetryPolicy(delay_ms=100), 1, rng=random.Random(0)),
        stream=stream,
        now=0.0,
        report=Report(),
        profile=profile,
    )


@pytest.mark.parametrize(
    ("headers", "name"),
    [
        ({"User-Agent": "codex_cli_rs/0.169.0 (Linux)"}, "codex"),
        ({"User-Agent": "codex_exec/0.169.0 (Debian 12.0.0; x86_64)"}, "codex"),
        ({"originator": "codex_cli_rs", "User-Agent": "reqwest"}, "codex"),
        ({"User-Agent": "claude-cli/2.1.328 (external, sdk-cli)"}, "claude-code"),
        ({"X-Claude-Code-Session-Id": "abc", "User-Agent": "Anthropic/JS 0.60"}, "claude-code"),
        ({"User-Agent": "opencode/1.18.33 ai-sdk/provider-utils/3"}, "opencode"),
        ({"User-Agent": "OpenAI/Python 3.57.0"}, "openai-sdk"),
        ({"User-Agent": "Anthropic/Python 2.14.0"}, "anthropic-sdk"),
        ({"User-Agent": "curl/8.0"}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_identify(headers: dict[str, str], name: str) -> None:
    assert identify(CIMultiDict(headers)) == name


def test_config_overrides_a_profile() -> None:
    cfg = parse_config(
        {"clients": {"codex": {"keepalive_s": 2, "early_headers": True, "keepalive": "comment"}}},
        env={},
    )
    p = profile_for(CIMultiDict({"User-Agent": "codex_exec/0.169.0"}), cfg.clients)
    assert p.keepalive_s == 2.0 and p.early_headers and p.keepalive is KeepaliveForm.COMMENT
    # another client keeps its own profile
    assert profile_for(CIMultiDict({"User-Agent": "curl"}), cfg.clients) == PROFILES["unknown"]


@pytest.mark.parametrize(
    "clients",
    [
        {"nope": {}},
        {"codex": {"nope": 1}},
        {"codex": {"keepalive_s": 0}},
        {"codex": {"keepalive_s": True}},
        {"codex": {"early_headers": 1}},
        {"codex": {"keepalive": "loud"}},
        {"codex": 3},
    ],
)
def test_bad_client_config_names_the_key(clients: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"clients": clients}, env={})
    assert "clients" in str(err.value)


def test_unknown_client_gets_early_headers_and_comments() -> None:
    m = machine(None)
    assert isinstance(m.start(0.0), Open)
    assert m.deadline() == 20.0
    assert m.tick(20.0) == SendHeaders(200)
    assert m.tick(35.0) == Keepalive(KEEPALIVE)


def test_codex_gets_no_early_headers_and_keepalive_events() -> None:
    m = machine(PROFILES["codex"], first_frame_timeout_s=1000)
    m.start(0.0)
    assert m.deadline() is None  # nothing timed while connecting: no early headers
    assert m.tick(500.0) is None
    assert isinstance(m.answered(500.0, 200, sse=True), Stream)
    m.feed_chunk(500.0, b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n')
    assert m.headers_out
    ka = m.tick(516.0)
    assert ka == Keepalive(RESPONSES.keepalive_event or b"")
    assert b"event: keepalive" in ka.data  # an event: Codex's idle timer counts it


def test_claude_code_gets_anthropic_pings_and_a_short_nonstreamed_wait() -> None:
    m = machine(PROFILES["claude-code"], ANTHROPIC)
    m.start(0.0)
    assert m.tick(100.0) is None  # never early headers
    assert isinstance(m.answered(100.0, 200, sse=True), Stream)
    m.feed_chunk(100.0, b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                 b'"index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n')
    assert m.tick(115.0) == Keepalive(b'event: ping\ndata: {"type": "ping"}\n\n')
    # non-streamed: the wait stays inside Claude Code's own 300 s
    n = machine(PROFILES["claude-code"], ANTHROPIC, stream=False)
    assert n.start(0.0) == Open(0, 150.0)
    assert machine(None, ANTHROPIC, stream=False).start(0.0) == Open(0, 300.0)


def test_a_comment_keepalive_for_chat_even_when_the_profile_asks_for_events() -> None:
    m = machine(Profile("x", keepalive=KeepaliveForm.EVENT, keepalive_s=5), CHAT)
    m.start(0.0)
    assert m.tick(20.0) == SendHeaders(200)
    assert m.tick(25.0) == Keepalive(KEEPALIVE)


def _final(protocol: Protocol, status: int, body: bytes, rid: str | None) -> list[Any]:
    m = machine(None, protocol)
    m.start(0.0)
    assert m.tick(20.0) == SendHeaders(200)
    assert isinstance(m.answered(21.0, status, sse=False), FinalInStream)
    end = m.final_body(21.0, status, body, rid)
    assert isinstance(end, End) and end.kind is EndKind.ERROR
    return [json.loads(e.data or "") for e in SSESplitter().feed(end.data)]


def test_final_answers_stay_final_in_each_protocol() -> None:
    body = (b'{"type":"error","error":{"type":"invalid_request_error",'
            b'"message":"prompt is too long"}}')
    (a,) = _final(ANTHROPIC, 400, body, "req_1")
    assert a["error"]["type"] == "invalid_request_error" and a["request_id"] == "req_1"
    (a,) = _final(ANTHROPIC, 401, b"not json", None)
    assert a["error"]["type"] == "authentication_error"
    oai = b'{"error":{"message":"bad key","type":"invalid_request_error","code":"invalid_api_key"}}'
    err, failed = _final(RESPONSES, 401, oai, "req_2")
    assert err["code"] == "invalid_api_key" and "req_2" in err["message"]
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"]["code"] == "invalid_api_key"
    (c,) = _final(CHAT, 400, oai, "req_3")
    assert c["error"]["type"] == "invalid_request_error" and "req_3" in c["error"]["message"]
    (c,) = _final(CHAT, 403, b"", None)
    assert c["error"]["type"] == "permission_error"


def test_session_names_in_order() -> None:
    def sid(h: dict[str, str], body: dict[str, Any] | None = None) -> str | None:
        return session_id_of(CIMultiDict(h), body)

    assert sid({"x-session-id": "a", "session-id": "b"}) == "a"
    assert sid({"x-session-affinity": "a2"}) == "a2"
    assert sid({"session-id": "codex-1", "thread-id": "t"}) == "codex-1"
    assert sid({"X-Claude-Code-Session-Id": "cc-1"}) == "cc-1"
    assert sid({}, {"prompt_cache_key": "pck"}) == "pck"
    assert sid({}, {"prompt_cache_key": 3}) is None
    assert sid({}) is None
