"""End to end with the real Codex CLI (``@openai/codex`` 0.169.0), through `unbroken run`.

Codex runs ``codex exec --json`` against the mock provider, configured as a user would
(a custom ``fake`` provider in ``$CODEX_HOME/config.toml``); `unbroken run -- codex`
finds that provider and points Codex at its private relay with ``-c``.  Codex's own
retry knobs are set low (1 request retry, 1 stream retry) to keep the baselines fast.
The storm runs with no unbroken config at all (the defaults a user gets); the other
tests give the relay a journal path and only the ``[stream]`` keys they are about.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from e2e.agent_run import (
    agent_text,
    base_env,
    codex_argv,
    codex_home,
    reconnects,
    relay_config,
    report,
    run,
    through_unbroken,
    timeline,
    zero_config,
)
from unbroken.mock import MockProvider
from unbroken.mock.wire import events_for

pytestmark = [pytest.mark.e2e, pytest.mark.cli("codex"), pytest.mark.timeout(120)]

TEXT = "Hello from the mock provider."


def _setup(
    tmp_path: Path, mock: MockProvider, stream: dict[str, Any] | None = None, **provider: Any
) -> tuple[dict[str, str], Path]:
    env = codex_home(tmp_path, mock.url, **provider)
    cfg = relay_config(tmp_path / "unbroken.toml", tmp_path / "journal.sqlite3", **(stream or {}))
    return env, cfg


def _tool(cmd: str) -> dict[str, Any]:
    return {"reply": "tool", "tool_name": "exec_command", "tool_args": {"cmd": cmd}}


async def test_text_turn(tmp_path: Path, mock: MockProvider) -> None:
    env, cfg = _setup(tmp_path, mock)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r).startswith(TEXT)
    assert not reconnects(r)
    [req] = mock.requests
    assert req.path == "/v1/responses"  # relayed to the provider's own base URL
    assert "codex" in req.headers.get("user-agent", "")
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        rows = conn.execute("SELECT session_id, client, outcome FROM turns").fetchall()
    finally:
        conn.close()
    assert rows == [(req.headers["session-id"], "codex", "ok")]  # the session, named


async def test_tool_turn_runs_once(tmp_path: Path, mock: MockProvider) -> None:
    env, cfg = _setup(tmp_path, mock)
    mock.script([_tool("echo ran >> marker.txt")])
    r = await run(
        through_unbroken(cfg, codex_argv(tmp_path, "run the tool")), env, tmp_path / "project"
    )
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert len(mock.requests) == 2  # the call, then the answer after its output


@pytest.mark.timeout(240)
async def test_503_storm_alone_dies_through_unbroken_with_no_config_completes(
    tmp_path: Path, mock: MockProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """503 x 40, then the answer.  Alone, Codex gives up; through `unbroken run -- codex`
    with no unbroken config (the defaults: a lone turn retried every 250 ms, breakers
    that never open for one turn's failures) it sees one clean turn."""
    env = codex_home(tmp_path, mock.url)
    mock.script([{"status": 503, "count": 40}])
    alone = await run(codex_argv(tmp_path, "say hi"), env, tmp_path / "project")
    alone_requests = len(mock.requests)
    assert alone.code != 0 and not agent_text(alone)
    mock.reset()
    mock.script([{"status": 503, "count": 40}])
    r = await run(
        zero_config(codex_argv(tmp_path, "say hi")), env, tmp_path / "project", limit_s=200
    )
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r).startswith(TEXT)
    assert not reconnects(r)  # Codex never saw a failure
    assert len(mock.requests) == 41
    report(
        capsys,
        f"codex 503 x 40: alone exit {alone.code} after {alone_requests} requests "
        f"({alone.seconds:.1f} s); through `unbroken run -- codex` (no config) exit 0, "
        f"{len(mock.requests)} requests, {r.seconds:.1f} s ({timeline(r, mock.requests)})",
    )


async def test_reset_mid_tool_arguments_runs_the_tool_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    env, cfg = _setup(tmp_path, mock)
    tool = _tool("echo ran >> marker.txt")
    events = events_for("responses", tool, {"model": "fake-model", "stream": True})
    first_args = next(
        i for i, (name, _) in enumerate(events) if name == "response.function_call_arguments.delta"
    )
    mock.script([{**tool, "fault": "reset", "after_frame": first_args + 1}] * 3 + [tool])
    r = await run(
        through_unbroken(cfg, codex_argv(tmp_path, "run the tool")), env, tmp_path / "project"
    )
    assert r.code == 0, r.stderr[-3000:]
    assert not reconnects(r)
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    bodies = [req.body for req in mock.requests[:4]]
    assert len(set(bodies)) == 1  # every replay byte-identical


async def test_silent_200_longer_than_codex_idle_timeout(
    tmp_path: Path, mock: MockProvider
) -> None:
    """An upstream answers 200 then stays silent: alone, Codex's idle timer fires and it
    reconnects; through unbroken Codex's timer never starts (no early headers for it),
    unbroken's stall detection replays, and Codex sees a clean turn."""
    env, cfg = _setup(tmp_path, mock, stream_idle_timeout_ms=1500)
    stall = {"fault": "stall", "after_frame": 0, "seconds": 30}
    mock.script([stall])
    alone = await run(codex_argv(tmp_path, "say hi"), env, tmp_path / "project")
    assert any("idle timeout" in m for m in reconnects(alone)), alone.stdout[-2000:]
    mock.reset()
    mock.script([stall])
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert not reconnects(r)
    assert agent_text(r).startswith(TEXT)
    assert len(mock.requests) == 2  # the stalled attempt, then unbroken's replay
    print(
        f"\ncodex silent 200: alone {reconnects(alone)}; through unbroken none ({r.seconds:.1f} s)"
    )


#: The relay's own stall timers for Codex: by default they follow Codex's idle timeout
#: (a slow upstream is then cut as Codex would cut it); set longer, the keepalives must
#: hold Codex's idle timer meanwhile.
STALL_10S = "\n[clients.codex]\nfirst_frame_timeout_s = 10\nidle_timeout_s = 10\n"


async def test_the_relay_cuts_a_silent_upstream_when_codex_would(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Codex's stream_idle_timeout_ms is 1.5 s; the relay's own [stream] timers would wait
    60 s for a first frame.  Codex gets no early headers, so its idle timer never runs
    while the relay waits: `unbroken run` tells the relay Codex's timeout, the relay cuts
    the silent 200 after 1.5 s, not 60 s, and replays; Codex sees one clean turn."""
    env, _ = _setup(tmp_path, mock, stream_idle_timeout_ms=1500)
    cfg = relay_config(
        tmp_path / "unbroken.toml",
        tmp_path / "journal.sqlite3",
        first_frame_timeout_s=60,
        idle_timeout_s=60,
    )
    mock.script([{"fault": "stall", "after_frame": 0, "seconds": 90}])
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert not reconnects(r)
    assert agent_text(r).startswith(TEXT)
    assert len(mock.requests) == 2  # the silent attempt, then the relay's replay
    assert r.seconds < 30, r.seconds  # not the relay's 60 s
    print(f"\ncodex silent 200, idle timeout 1.5 s, [stream] 60 s: completes in {r.seconds:.1f} s")


@pytest.mark.parametrize("ending", ["error", "reset"])
async def test_a_cut_after_text_codex_retries_the_turn_once(
    tmp_path: Path, mock: MockProvider, ending: str
) -> None:
    """The upstream dies after three text deltas, after commit.  Codex's profile ends the
    stream with the error event (``error`` + ``response.failed``); a reset (for
    comparison, as [clients.codex] after_commit_end) ends the same: Codex reconnects once
    ("Reconnecting... 1/3") and prints the answer once; 2 requests.  The error event is
    the default: Codex retries at once, with the reason in words, and it is the only
    ending a WebSocket turn has."""
    env, cfg = _setup(tmp_path, mock, stream_max_retries=3)
    if ending == "reset":
        cfg.write_text(cfg.read_text() + '\n[clients.codex]\nafter_commit_end = "reset"\n')
    mock.script([{"fault": "reset", "after_frame": 7}])
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    text = agent_text(r)
    assert text.startswith(TEXT) and text.count(TEXT) == 1  # once: no repeated prefix
    [reconnect] = reconnects(r)
    assert reconnect.startswith("Reconnecting... 1/3")
    assert len(mock.requests) == 2
    print(f"\ncodex, a cut after text, {ending}: {reconnect[:90]!r}, {r.seconds:.1f} s")


async def test_keepalive_events_hold_codex_idle_timer(tmp_path: Path, mock: MockProvider) -> None:
    """A slow upstream: a frame every second, against Codex's 0.7 s idle timer.  Alone,
    Codex gives up; through unbroken, told to wait 10 s for a frame ([clients.codex]),
    which holds the opening frames and then sends its Responses keepalive event between
    frames (Codex's idle timer ignores SSE comments), the turn completes."""
    env, cfg = _setup(tmp_path, mock, stream_idle_timeout_ms=700)
    cfg.write_text(cfg.read_text() + STALL_10S)
    text = {"text": "slow answer", "deltas": 1, "chunk_delay_ms": 1000}
    mock.script([text])
    alone = await run(codex_argv(tmp_path, "say hi"), env, tmp_path / "project")
    assert any("idle timeout" in m for m in reconnects(alone)), alone.stdout[-2000:]
    mock.reset()
    mock.script([text])
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert not reconnects(r), r.stdout
    assert "slow answer" in agent_text(r)
    assert len(mock.requests) == 1
    print(
        f"\ncodex 1 s between frames, 0.7 s idle timeout: alone {reconnects(alone)}; "
        "through unbroken none"
    )


def test_unbroken_run_print_env_for_codex(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from unbroken.cli import main

    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model_provider = "fake"\n[model_providers.fake]\nbase_url = "http://127.0.0.1:9/v1"\n'
        "supports_websockets = true\n"
    )
    import os

    old = os.environ.get("CODEX_HOME")
    os.environ["CODEX_HOME"] = str(home)
    try:
        assert main(["run", "--print-env", "--", "codex", "exec", "hi"]) == 0
    finally:
        if old is None:
            del os.environ["CODEX_HOME"]
        else:
            os.environ["CODEX_HOME"] = old
    out = capsys.readouterr().out
    assert 'model_providers.fake.base_url="http://127.0.0.1:4780/fake/v1"' in out
    assert 'openai_base_url="http://127.0.0.1:4780/openai/v1"' in out
    assert "[routes.fake]" in out and json.dumps("http://127.0.0.1:9") in out


async def test_websocket_turn_and_its_handshake_headers_reach_codex(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Codex over WebSocket (``supports_websockets``): unbroken opens the upstream socket
    before it accepts Codex, so the handshake headers Codex reads arrive.  Codex shows
    ``openai-model`` as a reroute notice, which proves it (the notice appears alone and
    through unbroken alike)."""
    env, cfg = _setup(tmp_path, mock, supports_websockets=True)
    headers = {
        "openai-model": "gpt-other",
        "x-codex-turn-state": "ts-1",
        "x-models-etag": "etag-1",
        "x-reasoning-included": "true",
    }
    mock.script_upgrades([{"headers": headers}] * 3)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r).startswith(TEXT)
    notices = [
        e["item"].get("message", "")
        for e in r.events()
        if e.get("type") == "item.completed" and e["item"].get("type") == "error"
    ]
    assert any("model rerouted: fake-model -> gpt-other" in n for n in notices), notices
    assert [q.method for q in mock.requests] == ["WS", "WS"]  # the warm-up, then the turn
    assert [u.status for u in mock.upgrades] == [101]  # one upstream socket, reused


TOO_LONG = {
    "status": 400,
    "headers": {"x-request-id": "req_too_long", "content-type": "application/json"},
    "body": '{"error":{"message":"Your input exceeds the context window","type":'
    '"invalid_request_error","param":null,"code":"context_length_exceeded"}}',
}


@pytest.mark.parametrize("early_headers", [False, True])
async def test_a_final_400_after_a_storm_stops_codex(
    tmp_path: Path, mock: MockProvider, early_headers: bool
) -> None:
    """A 503 past early_headers_s, then a final 400 (context_length_exceeded).  With the
    Codex profile the 400 arrives as a status; with early headers forced on it can only
    be in-stream, as ``error`` + ``response.failed`` carrying the provider's code.  Either
    way Codex recognises it and stops: no extra request, no "Reconnecting"."""
    # early_headers_s = 1: the 503's 1.5 s Retry-After outlasts it (the default is 20 s)
    env, cfg = _setup(tmp_path, mock, {"early_headers_s": 1}, stream_max_retries=3)
    if early_headers:
        cfg.write_text(cfg.read_text() + "\n[clients.codex]\nearly_headers = true\n")
    mock.script([{"status": 503, "headers": {"retry-after-ms": "1500"}}] + [TOO_LONG] * 4)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code != 0
    assert not reconnects(r)
    failed = [e for e in r.events() if e.get("type") == "turn.failed"]
    assert failed and "context window" in failed[0]["error"]["message"]
    assert len(mock.requests) == 2


async def test_websocket_socket_dies_mid_tool_arguments_tool_runs_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Over WebSocket, the upstream socket closes (1011) twice in the middle of the call's
    arguments: unbroken replays on fresh upstream sockets, Codex's own socket stays up,
    and exec_command runs once."""
    env, cfg = _setup(tmp_path, mock, supports_websockets=True)
    tool = _tool("echo ran >> marker.txt")
    events = events_for("responses", tool, {"model": "fake-model", "stream": True})
    first_args = next(
        i for i, (name, _) in enumerate(events) if name == "response.function_call_arguments.delta"
    )
    close = {**tool, "fault": "close", "after_frame": first_args + 1, "code": 1011}
    mock.script([{}, close, close, tool])  # the warm-up, two dead sockets, the call
    r = await run(
        through_unbroken(cfg, codex_argv(tmp_path, "run the tool")), env, tmp_path / "project"
    )
    assert r.code == 0, r.stderr[-3000:]
    assert not reconnects(r)
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert [q.socket for q in mock.requests[:4]] == [1, 1, 2, 3]


async def test_keepalive_messages_hold_codex_idle_timer_over_websocket(
    tmp_path: Path, mock: MockProvider
) -> None:
    """The slow upstream over WebSocket (a frame a second, Codex idle timeout 0.7 s):
    alone, Codex abandons the turn and sends it again; through unbroken (told to wait
    10 s for a frame), the keepalive messages ({"type":"keepalive"}) between frames count
    for its idle timer (pings do not), and the one slow turn completes."""
    env, cfg = _setup(tmp_path, mock, supports_websockets=True, stream_idle_timeout_ms=700)
    cfg.write_text(cfg.read_text() + STALL_10S)
    slow = {"text": "slow answer", "deltas": 1, "chunk_delay_ms": 1000}
    script = [{}, slow, {}, slow]  # the warm-up, then the turn (twice, for a retry)
    mock.script(script)
    alone = await run(codex_argv(tmp_path, "say hi"), env, tmp_path / "project")
    assert len(mock.requests) > 2 and "slow answer" not in agent_text(alone)
    mock.reset()
    mock.script(script)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r) == "slow answer" and not reconnects(r)
    assert [q.method for q in mock.requests] == ["WS", "WS"]


async def test_twenty_cuts_after_output_are_resumed_with_no_error(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Issue 23: with ``[stream] after_commit = "continue"`` the relay makes Codex's
    request a background one (``store: true`` over Codex's ``store: false``) and, each
    time the stream is cut after output, resumes it from the last sequence number fed
    (``GET /v1/responses/{id}?stream=true&starting_after=N``).  Twenty cuts in one turn:
    Codex exits 0 with the exact text, never reconnects, and nothing is sampled twice
    (one POST).  Before issue 23 the first cut ended the stream with the native error
    and Codex reconnected."""
    env, cfg = _setup(tmp_path, mock, {"after_commit": "continue"}, stream_max_retries=1)
    text = " ".join(f"word{i}" for i in range(80))
    script: list[dict[str, Any]] = [
        {"text": text, "deltas": 80, "fault": "reset", "after_frame": 7}
    ]
    script += [{"fault": "reset", "after_frame": 3} for _ in range(19)]
    mock.script(script)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r) == text
    assert not reconnects(r)
    posts = [q for q in mock.requests if q.method == "POST"]
    gets = [q for q in mock.requests if q.method == "GET"]
    assert len(posts) == 1 and len(gets) == 20
    sent = posts[0].json()
    assert sent["background"] is True and sent["store"] is True
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        rows = conn.execute("SELECT outcome, splices FROM turns").fetchall()
    finally:
        conn.close()
    assert rows == [("resumed", 20)]
    print(f"\ncodex, 20 cuts after output, after_commit = continue: exit 0 in {r.seconds:.1f} s")


async def test_websocket_codex_keeps_its_socket_through_cuts_resumed_over_http(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Issue 23 over WebSocket: background mode is not supported on a socket, so with
    ``after_commit = "continue"`` unbroken serves Codex's socket turns over HTTP in
    background mode underneath and resumes them there.  Five cuts after output: Codex
    keeps its socket, exits 0 with the exact text and never reconnects."""
    env, cfg = _setup(tmp_path, mock, {"after_commit": "continue"}, supports_websockets=True)
    text = " ".join(f"word{i}" for i in range(40))
    cut = {"text": text, "deltas": 40, "fault": "reset", "after_frame": 7}
    mock.set_default({"text": text, "deltas": 40})
    # (the warm-up is answered by the relay: never POSTed, it takes no action; issue 33)
    mock.script([cut] + [{"fault": "reset", "after_frame": 3}] * 4)
    r = await run(through_unbroken(cfg, codex_argv(tmp_path, "say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert agent_text(r) == text
    assert not reconnects(r)
    assert sum(1 for q in mock.requests if q.method == "GET") == 4 + 1
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        rows = conn.execute("SELECT protocol, outcome, splices FROM turns").fetchall()
    finally:
        conn.close()
    assert ("responses-ws", "resumed", 5) in rows


def _builtin_openai_home(root: Path, mock_url: str) -> dict[str, str]:
    """A CODEX_HOME for Codex's built-in ``openai`` provider (no custom provider), at the
    mock through ``openai_base_url``: the provider a user gets, over WebSocket."""
    home, codex = root / "home", root / "codex"
    for d in (home, codex, root / "project"):
        d.mkdir(parents=True, exist_ok=True)
    (codex / "config.toml").write_text(
        "\n".join(
            [
                'model = "fake-model"',
                'approval_policy = "never"',
                'sandbox_mode = "danger-full-access"',
                f'openai_base_url = "{mock_url}/v1"',
                "",
            ]
        )
    )
    env = base_env(home)
    env["CODEX_HOME"] = str(codex)
    env["OPENAI_API_KEY"] = "sk-fake"
    return env


async def test_builtin_provider_websocket_warmup_in_continue_mode_is_no_generation(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Issue 33 item 1: Codex's built-in ``openai`` provider goes over WebSocket and warms
    its socket with ``response.create`` + ``generate: false``.  In continue mode the
    relay serves the socket's turns over HTTP (background mode): the warm-up is
    answered by the relay, never POSTed (a provider that ignores ``generate`` generated
    the scripted tool call for it, which then never ran).  One generation per turn,
    the tool runs once, Codex never reconnects."""
    env = _builtin_openai_home(tmp_path, mock.url)
    cfg = relay_config(tmp_path / "unbroken.toml", tmp_path / "journal.sqlite3")
    cfg.write_text(cfg.read_text().replace("[stream]\n", '[stream]\nafter_commit = "continue"\n'))
    mock.script([_tool("echo ran >> marker.txt")])
    r = await run(
        through_unbroken(cfg, codex_argv(tmp_path, "run the tool")), env, tmp_path / "project"
    )
    assert r.code == 0, r.stderr[-3000:]
    assert not reconnects(r), r.stdout[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert [u.status for u in mock.upgrades] in ([], [101])  # (the first socket, unused)
    posts = [q for q in mock.requests if q.method == "POST"]
    assert len(posts) == 2  # the call, then the answer after its output: no warm-up
    for q in posts:
        sent = q.json()
        assert "generate" not in sent and sent["background"] is True
    assert not [q for q in mock.requests if q.method == "WS"]
