"""Client profiles (core/profiles.py): recognition, overrides, and what the machine does
with them: early headers, the keepalive form, the non-streamed wait, final errors."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from relayfix import start_relay
from turnfix import Report, Timers
from unbroken.config import ConfigError, parse_config
from unbroken.core.admission.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.profiles import (
    PROFILES,
    CommitEnd,
    KeepaliveForm,
    Profile,
    identify,
    profile_for,
    profile_named,
)
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import (
    KEEPALIVE,
    AbortUpstream,
    End,
    EndKind,
    FinalInStream,
    GiveUp,
    GiveUpKind,
    Keepalive,
    Open,
    Outcome,
    SendHeaders,
    Stream,
    TurnMachine,
    Wait,
)
from unbroken.core.wire.protocols import ANTHROPIC, CHAT, RESPONSES, Protocol
from unbroken.core.wire.sse import SSESplitter
from unbroken.relay.relay_state import session_id_of


def machine(
    profile: Profile | None,
    protocol: Protocol = RESPONSES,
    *,
    stream: bool = True,
    socket: bool = False,
    **timers: Any,
) -> TurnMachine:
    return TurnMachine(
        protocol=protocol,
        hold=Hold(),
        timers=Timers(**timers),
        retry=RetryState(RetryPolicy(delay_ms=100), 1, rng=random.Random(0)),
        stream=stream,
        now=0.0,
        report=Report(),
        profile=profile,
        socket=socket,
    )


@pytest.mark.parametrize(
    ("headers", "name"),
    [
        ({"User-Agent": "codex_cli_rs/0.169.0 (Linux)"}, "codex"),
        ({"User-Agent": "codex_exec/0.169.0 (Debian 12.0.0; x86_64)"}, "codex"),
        ({"originator": "codex_cli_rs", "User-Agent": "reqwest"}, "codex"),
        ({"User-Agent": "claude-cli/2.1.328 (external, sdk-cli)"}, "claude-code"),
        ({"X-Claude-Code-Session-Id": "abc", "User-Agent": "Anthropic/JS 0.60"}, "claude-code"),
        (
            {"User-Agent": "GeminiCLI-tui/0.61.0/gemini-2.5-flash (linux; x64; terminal)"},
            "gemini-cli",
        ),
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
        {"codex": {"after_commit_end": "close"}},
        {"codex": {"after_commit_end": 1}},
        {"claude-code": {"client_idle_timeout_s": 0}},
        {"claude-code": {"idle_timeout_s": -1}},
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


def test_claude_code_gets_anthropic_pings() -> None:
    m = machine(PROFILES["claude-code"], ANTHROPIC)
    m.start(0.0)
    assert m.tick(100.0) is None  # never early headers
    assert isinstance(m.answered(100.0, 200, sse=True), Stream)
    m.feed_chunk(
        100.0,
        b'event: content_block_delta\ndata: {"type":"content_block_delta",'
        b'"index":0,"delta":{"type":"text_delta","text":"hi"}}\n\n',
    )
    assert m.tick(115.0) == Keepalive(b'event: ping\ndata: {"type": "ping"}\n\n')


@pytest.mark.parametrize("first_frame_timeout_s", [300.0, 60.0, 900.0])
def test_claude_code_nonstreamed_wait_is_at_least_its_own(first_frame_timeout_s: float) -> None:
    """Claude Code waits 300 s for a non-streamed answer (its re-send after any in-stream
    error).  The relay used to give up on it at 150 s and ask again: an answer that
    takes 170 s never arrived through the relay, and did directly."""
    n = machine(
        PROFILES["claude-code"],
        ANTHROPIC,
        stream=False,
        first_frame_timeout_s=first_frame_timeout_s,
    )
    opened = n.start(0.0)
    assert isinstance(opened, Open) and opened.timeout_s >= 300.0
    # an unknown client: the [stream] default, as before
    assert machine(None, ANTHROPIC, stream=False).start(0.0) == Open(0, 300.0)


#: [stream] settings a user might choose, to check the relay's waits against
_STREAMS: list[dict[str, Any]] = [
    {},
    {"first_frame_timeout_s": 60.0, "idle_timeout_s": 30.0, "header_timeout_s": 30.0},
    {"first_frame_timeout_s": 900.0, "idle_timeout_s": 900.0},
]


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("stream", _STREAMS)
def test_the_relay_never_waits_less_or_stalls_later_than_the_client(
    name: str, stream: dict[str, Any]
) -> None:
    """Every profile, whatever the [stream] timers: a non-streamed attempt waits at least
    as long as the client waits for its answer, and a silent stream is cut no later than
    the client would cut it itself (so the relay still replays before the client acts)."""
    profile = PROFILES[name]
    n = machine(profile, stream=False, **stream)
    opened = n.start(0.0)
    assert isinstance(opened, Open)
    if profile.client_nonstream_wait_s is not None:
        assert opened.timeout_s >= profile.client_nonstream_wait_s
    m = machine(profile, **stream)
    if profile.client_idle_timeout_s is not None:
        assert m.timers.first_frame_timeout_s <= profile.client_idle_timeout_s
        assert m.timers.idle_timeout_s <= profile.client_idle_timeout_s
    else:  # an unknown clock: the [stream] settings, untouched
        assert m.timers == Timers(**stream)


def test_known_client_timers() -> None:
    claude, codex = PROFILES["claude-code"], PROFILES["codex"]
    assert claude.client_nonstream_wait_s == 300.0 and claude.client_idle_timeout_s == 300.0
    assert codex.client_idle_timeout_s == 300.0  # stream_idle_timeout_ms's default
    assert claude.nonstream_wait_s is None  # it follows the client's own
    gemini = PROFILES["gemini-cli"]
    assert gemini.client_idle_timeout_s == 300.0  # then it retries silently
    assert gemini.client_nonstream_wait_s is None  # not measured: the [stream] default
    assert gemini.early_headers  # its ~60 s header timer needs them


def _overridden(name: str, table: dict[str, Any]) -> Profile:
    cfg = parse_config({"clients": {name: table}}, env={})
    return profile_named(name, cfg.clients)


def test_stall_timers_follow_the_clients_idle_timeout() -> None:
    """Codex with stream_idle_timeout_ms = 20000 (as `unbroken run` tells the relay): no
    early headers, so its own idle timer never runs while the relay waits; the relay's
    stall timers stand in for it, at 20 s, not [stream]'s 300 s / 120 s."""
    codex = _overridden("codex", {"client_idle_timeout_s": 20})
    m = machine(codex)
    assert isinstance(m.start(0.0), Open)
    assert isinstance(m.answered(1.0, 200, sse=True), Stream)
    assert m.deadline() == 21.0  # first frame: 20 s after the answer
    assert m.tick(20.9) is None
    assert isinstance(m.tick(21.0), AbortUpstream)
    assert isinstance(m.transport_failed(21.0, Failure(FailureClass.RESET, "x")), (Open, Wait))
    # after the first frame: the idle timeout, 20 s too
    m = machine(codex)
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    m.feed_chunk(
        1.0, b'event: response.created\ndata: {"type":"response.created","response":{"id":"r"}}\n\n'
    )
    assert m.deadline() == 21.0
    # [stream] shorter than the client's: kept (a replay before the client notices)
    m = machine(codex, first_frame_timeout_s=5.0, idle_timeout_s=3.0)
    assert (m.timers.first_frame_timeout_s, m.timers.idle_timeout_s) == (5.0, 3.0)
    # the profile's own stall timers win, even over the client's (the user asked)
    own = _overridden(
        "codex", {"client_idle_timeout_s": 0.7, "first_frame_timeout_s": 10, "idle_timeout_s": 12}
    )
    m = machine(own)
    assert (m.timers.first_frame_timeout_s, m.timers.idle_timeout_s) == (10.0, 12.0)
    assert m.min_interval == 10.0


def test_nonstreamed_wait_follows_the_clients() -> None:
    claude = _overridden("claude-code", {"client_nonstream_wait_s": 600})  # API_TIMEOUT_MS
    assert machine(claude, ANTHROPIC, stream=False).start(0.0) == Open(0, 600.0)
    own = _overridden("claude-code", {"client_nonstream_wait_s": 600, "nonstream_wait_s": 50})
    assert machine(own, ANTHROPIC, stream=False).start(0.0) == Open(0, 50.0)
    # streamed requests wait for headers as long as Claude Code does (360 s, measured)
    assert machine(claude, ANTHROPIC).start(0.0) == Open(0, 360.0)


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
    body = (
        b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long"}}'
    )
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


MESSAGE_START = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
    b'"type":"message","role":"assistant","content":[],"model":"m"}}\n\n'
)
TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hel"}}\n\n'
)
OVERLOADED = (
    b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
    b'"message":"Overloaded"}}\n\n'
)


def _committed(profile: Profile | None, *, socket: bool = False) -> TurnMachine:
    """A streamed Anthropic turn that has released text: committed."""
    m = machine(profile, ANTHROPIC, socket=socket)
    m.start(0.0)
    assert isinstance(m.answered(0.0, 200, sse=True), Stream)
    out, over = m.feed_chunk(1.0, MESSAGE_START + TEXT_DELTA)
    assert b"Hel" in b"".join(e.raw for e in out) and over is None
    return m


@pytest.mark.parametrize("cut", ["reset", "in-stream error", "stall", "clean end"])
def test_claude_code_ends_a_cut_after_commit_by_aborting_the_connection(cut: str) -> None:
    """After commit Claude Code gets no error event (it would re-send the request without
    streaming): the client connection is aborted, so it re-streams.  Never a clean end."""
    m = _committed(PROFILES["claude-code"])
    end: object
    if cut == "reset":
        end = m.transport_failed(2.0, Failure(FailureClass.RESET, "reset"))
    elif cut == "in-stream error":
        out, end = m.feed_chunk(2.0, OVERLOADED)
        assert not out  # the error event is not passed on
    elif cut == "stall":
        assert isinstance(m.tick(1.0 + 120.0), AbortUpstream)
        end = m.transport_failed(121.0, Failure(FailureClass.RESET, "aborted"))
    else:
        end = m.body_ended(2.0)
    assert end == End(EndKind.ABORT)
    assert m.outcome is Outcome.ENDED_WITH_ERROR
    assert m.shutdown_error() == b""


@pytest.mark.parametrize("name", ["codex", "opencode", "anthropic-sdk", "unknown"])
def test_other_clients_end_a_cut_after_commit_with_the_native_error(name: str) -> None:
    m = _committed(PROFILES[name])
    end = m.transport_failed(2.0, Failure(FailureClass.RESET, "reset"))
    assert isinstance(end, End) and end.kind is EndKind.ERROR
    assert b"overloaded_error" in end.data
    m = _committed(PROFILES[name])
    out, over = m.feed_chunk(2.0, OVERLOADED)
    assert b"overloaded_error" in b"".join(e.raw for e in out)
    assert over == End(EndKind.ERROR, b"")


def test_the_reset_ending_is_for_http_only() -> None:
    """A WebSocket turn has no connection of its own to abort: the error message."""
    m = _committed(PROFILES["claude-code"], socket=True)
    end = m.transport_failed(2.0, Failure(FailureClass.RESET, "reset"))
    assert isinstance(end, End) and end.kind is EndKind.ERROR and b"overloaded_error" in end.data


def test_after_commit_end_is_a_client_setting() -> None:
    error = _overridden("claude-code", {"after_commit_end": "error"})
    assert error.after_commit_end is CommitEnd.ERROR
    end = _committed(error).transport_failed(2.0, Failure(FailureClass.RESET, "reset"))
    assert isinstance(end, End) and end.kind is EndKind.ERROR
    reset = _overridden("unknown", {"after_commit_end": "reset"})
    end = _committed(reset).transport_failed(2.0, Failure(FailureClass.RESET, "reset"))
    assert end == End(EndKind.ABORT)
    assert PROFILES["unknown"].after_commit_end is CommitEnd.ERROR  # the default, unchanged
    assert PROFILES["codex"].after_commit_end is CommitEnd.ERROR
    assert PROFILES["claude-code"].after_commit_end is CommitEnd.RESET


def _anthropic_frame(tag: str, kind: str) -> bytes:
    def ev(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

    if kind == "start":
        return ev(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": tag,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": "m",
                },
            },
        )
    if kind == "text":
        return ev(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": tag},
            },
        )
    if kind == "stop":
        return ev("message_stop", {"type": "message_stop"})
    if kind == "error":
        return OVERLOADED
    return b"event: content_block_delta\ndata: {broken " + tag.encode() + b"\n\n"


_KINDS = st.sampled_from(["start", "text", "text", "stop", "error", "malformed"])
_ATTEMPT = st.tuples(st.lists(_KINDS, max_size=6), st.sampled_from(["eof", "reset", "stall"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_ATTEMPT, min_size=1, max_size=6))
def test_the_reset_ending_never_ends_a_cut_turn_cleanly_nor_sends_an_error_event(
    attempts: list[tuple[list[str], str]],
) -> None:
    """Claude Code's profile, over random attempts: a replay releases nothing; a turn
    whose ``message_stop`` the client never got ends by an abort (never cleanly, and
    never with an error event: that would make Claude Code re-send without streaming);
    no frame is released twice; every turn ends."""
    m = TurnMachine(
        protocol=ANTHROPIC,
        hold=Hold(),
        timers=Timers(),
        retry=RetryState(RetryPolicy(delay_ms=1, max_attempts=5), 1, rng=random.Random(0)),
        stream=True,
        now=0.0,
        report=Report(),
        profile=PROFILES["claude-code"],
    )
    now, client, released = 0.0, bytearray(), []
    action: Any = m.start(now)
    for n in range(40):
        if isinstance(action, (End, GiveUp)):
            break
        now += 1.0
        if isinstance(action, Wait):
            action = m.next_attempt(now)
            continue
        assert isinstance(action, Open)
        kinds, ending = attempts[n % len(attempts)]
        assert isinstance(m.answered(now, 200, sse=True), Stream)
        before = len(client)
        over = None
        for i, kind in enumerate(kinds):
            out, over = m.feed_chunk(now, _anthropic_frame(f"a{n}f{i}", kind))
            released += [e.raw for e in out]
            client += b"".join(e.raw for e in out)
            if over is not None:
                break
        if over is None:
            if ending == "stall":
                m.tick(now + 10_000.0)
            over = (
                m.body_ended(now)
                if ending == "eof"
                else m.transport_failed(now, Failure(FailureClass.RESET, "reset"))
            )
        if isinstance(over, (Wait, Open)):
            assert len(client) == before  # a replay released nothing
        if isinstance(over, End):
            client += over.data
        action = over
    assert isinstance(action, (End, GiveUp)) and m.ended and m.outcome is not None
    finished = b"message_stop" in client
    if isinstance(action, End) and action.kind is EndKind.CLEAN:
        assert finished
    if client and not finished:
        assert action == End(EndKind.ABORT)
    if not client:  # nothing streamed: a give-up is a status (no early headers)
        assert not isinstance(action, GiveUp) or action.kind is not GiveUpKind.IN_STREAM
    # never an error event after output (what follows message_stop is the upstream's)
    assert b"overloaded_error" not in client.split(b"message_stop")[0]
    tagged = [f for f in released if b"text_delta" in f or b"message_start" in f]
    assert len(tagged) == len(set(tagged))


def test_before_commit_the_reset_profile_still_replays() -> None:
    """The ending after commit changes nothing before it: a cut is replayed."""
    m = machine(PROFILES["claude-code"], ANTHROPIC)
    m.start(0.0)
    m.answered(0.0, 200, sse=True)
    assert not m.feed_chunk(1.0, MESSAGE_START).released  # held
    assert isinstance(m.transport_failed(2.0, Failure(FailureClass.RESET, "reset")), (Open, Wait))


# -- through a relay ----------------------------------------------------------------------
MESSAGES = "mock/v1/messages"
CLAUDE = {"User-Agent": "claude-cli/2.1.328 (external, sdk-cli)"}


async def _relay(
    mock: Any, clients: dict[str, Any] | None = None, stream: dict[str, Any] | None = None
) -> tuple[Any, Any]:
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
    return await start_relay(dataclasses.replace(cfg, port=0, grace_s=5.0))


async def test_a_slow_nonstreamed_answer_arrives_when_the_relay_waits_as_long_as_the_client(
    mock: Any,
) -> None:
    """Claude Code's non-streamed wait, scaled down 100x: it waits 4 s (400 s) for an
    answer that takes 2 s (200 s) every time.  A relay that waits as long as the client
    (``client_nonstream_wait_s``, the profile's default) passes it on after one request.
    A relay that waits less (here 1 s, as the old table's 150 s against 300 s) drops
    every answer just before it arrives and asks again, until the client gives up."""
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    timeout = aiohttp.ClientTimeout(total=4.0)
    for clients, completes in [
        ({"client_nonstream_wait_s": 4}, True),
        ({"client_nonstream_wait_s": 4, "nonstream_wait_s": 1}, False),
    ]:
        mock.reset()
        mock.set_default({"delay_ms": 2000})
        server, _ = await _relay(mock, {"claude-code": clients})
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s:
                try:
                    async with s.post(f"{server.url}/{MESSAGES}", json=body, headers=CLAUDE) as r:
                        answer: Any = (r.status, await r.json())
                except TimeoutError:
                    answer = "client timed out"
            if completes:
                assert answer[0] == 200 and answer[1]["content"][0]["text"]
                assert len(mock.requests) == 1
            else:
                assert answer == "client timed out"
                assert len(mock.requests) >= 2  # asked again: the same slow answer
        finally:
            await server.stop()


async def _read_stream(url: str, headers: dict[str, str]) -> tuple[bytes, str | None]:
    """A streamed Anthropic request: the bytes received, and how the body ended."""
    body = {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    got = bytearray()
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        assert r.status == 200
        try:
            async for chunk in r.content.iter_any():
                got += chunk
        except aiohttp.ClientPayloadError as exc:
            return bytes(got), type(exc).__name__
    return bytes(got), None


async def test_a_cut_after_text_reaches_claude_code_as_a_reset_and_others_as_an_error(
    mock: Any,
) -> None:
    """The upstream dies after three text deltas (after commit).  Claude Code's stream is
    cut off (no error event, no clean end: aiohttp reports a payload error); an SDK
    client gets Anthropic's overloaded_error event and the end of the body.  Neither is
    replayed: one upstream request each."""
    server, rec = await _relay(mock)
    try:
        for n, (headers, cut) in enumerate(
            [
                (CLAUDE, True),
                ({"User-Agent": "Anthropic/Python 2.14.0"}, False),
            ],
            start=1,
        ):
            mock.script([{"fault": "reset", "after_frame": 6}])
            got, ended = await _read_stream(f"{server.url}/{MESSAGES}", headers)
            assert b"Hel" in got and b"message_stop" not in got
            if cut:
                assert ended == "ClientPayloadError" and b"event: error" not in got
            else:
                assert ended is None and b"overloaded_error" in got
            turns = await rec.wait_turns(n)
            assert turns[-1].outcome == "ended_with_error"
            assert len(mock.requests) == n
    finally:
        await server.stop()


async def test_a_silent_upstream_is_cut_at_codexs_idle_timeout_not_the_relays(mock: Any) -> None:
    """``[stream]`` waits 30 s for a first frame; Codex's own idle timeout, told to the
    relay (scaled down: 0.5 s), is shorter.  An upstream answers 200 and then says
    nothing: the relay cuts it at Codex's 0.5 s and replays, so Codex (whose idle timer
    has not started: no headers yet) gets the answer of the second attempt, as it would
    have got it by reconnecting after its own timeout if it had been talking directly."""
    server, rec = await _relay(
        mock,
        {"codex": {"client_idle_timeout_s": 0.5}},
        {"first_frame_timeout_s": 30, "idle_timeout_s": 30},
    )
    mock.script([{"fault": "stall", "after_frame": 0, "seconds": 60}])
    body = {"model": "m", "stream": True, "input": "hi"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.post(
                f"{server.url}/mock/v1/responses",
                json=body,
                headers={"User-Agent": "codex_exec/0.169.0"},
            ) as r:
                assert r.status == 200
                got = await r.read()
        assert b"response.completed" in got
        [turn] = await rec.wait_turns(1)
        assert turn.outcome == "recovered"
        assert [phase for _, phase, _ in rec.failures] == ["stall"]
        assert len(mock.requests) == 2
    finally:
        await server.stop()
