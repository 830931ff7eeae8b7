"""End to end with the real Claude Code (``@anthropic-ai/claude-code`` 2.1.328), through
`unbroken run`.

Claude Code runs headless (``claude -p --output-format stream-json --verbose
--allowedTools Bash``) with ``ANTHROPIC_BASE_URL`` at the mock provider, as a user's
own gateway would be; `unbroken run -- claude` relays to it.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from agent_run import claude_argv, claude_env, claude_result, relay_config, run, through_unbroken

from unbroken.mock import MockProvider
from unbroken.mock.wire import events_for

pytestmark = [pytest.mark.e2e, pytest.mark.cli("claude"), pytest.mark.timeout(120)]

TEXT = "Hello from the mock provider."


def _setup(tmp_path: Path, mock: MockProvider, **extra: str) -> tuple[dict[str, str], Path]:
    env = claude_env(tmp_path, mock.url, **extra)
    return env, relay_config(tmp_path / "unbroken.toml", tmp_path / "journal.sqlite3")


def _bash(command: str) -> dict[str, Any]:
    return {"reply": "tool", "tool_name": "Bash",
            "tool_args": {"command": command, "description": "mark"}}


async def test_text_turn_and_its_session_in_the_journal(tmp_path, mock):
    env, cfg = _setup(tmp_path, mock)
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    result = claude_result(r)
    assert result.get("result") == TEXT and not result.get("is_error")
    [req] = mock.requests
    assert req.path == "/v1/messages"
    sid = req.headers["x-claude-code-session-id"]
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        rows = conn.execute("SELECT session_id, client, outcome FROM turns").fetchall()
    finally:
        conn.close()
    assert rows == [(sid, "claude-code", "ok")]


async def test_bash_tool_runs_once(tmp_path, mock):
    env, cfg = _setup(tmp_path, mock)
    mock.script([_bash("echo ran >> marker.txt")])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert len(mock.requests) == 2


async def test_529_storm_absorbed(tmp_path, mock):
    env, cfg = _setup(tmp_path, mock, CLAUDE_CODE_MAX_RETRIES="2")
    mock.script([{"status": 529, "count": 100}])
    alone = await run(claude_argv("say hi"), env, tmp_path / "project")
    alone_requests = len(mock.requests)
    assert alone.code != 0
    mock.reset()
    mock.script([{"status": 529, "count": 100}])
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert claude_result(r).get("result") == TEXT
    retries = [e for e in r.events() if e.get("subtype") == "api_retry"]
    assert not retries  # Claude Code never saw a 529
    assert len(mock.requests) == 101
    print(f"\nclaude 529x100 (CLAUDE_CODE_MAX_RETRIES=2): alone exit {alone.code} after "
          f"{alone_requests} requests ({alone.seconds:.1f} s); through unbroken exit 0 in "
          f"{r.seconds:.1f} s")


async def test_reset_mid_input_json_delta_runs_the_tool_once(tmp_path, mock):
    env, cfg = _setup(tmp_path, mock)
    tool = _bash("echo ran >> marker.txt")
    events = events_for("anthropic", tool, {"model": "fake-model", "stream": True})
    first_json = next(i for i, (_, p) in enumerate(events)
                      if isinstance(p, dict) and p.get("delta", {}).get("type")
                      == "input_json_delta")
    mock.script([{**tool, "fault": "reset", "after_frame": first_json + 1}] * 3 + [tool])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert len({req.body for req in mock.requests[:4]}) == 1  # byte-identical replays
    assert "Server error" not in r.stdout


TOO_LONG = {
    "status": 400,
    "headers": {"request-id": "req_too_long", "content-type": "application/json"},
    "body": '{"type":"error","error":{"type":"invalid_request_error","message":'
            '"prompt is too long: 250000 tokens > 200000 maximum"},"request_id":"req_too_long"}',
}
STORM_THEN_400 = [{"status": 529, "headers": {"retry-after-ms": "1500"}}, TOO_LONG, TOO_LONG]


async def test_a_final_400_after_a_long_storm_stays_a_400(tmp_path, mock):
    """529s for longer than early_headers_s (1 s here), then a final 400 ("prompt is too
    long"): the Claude Code profile sends no early headers, so the 400 reaches it as a
    status and it stops, with no extra request.  With early headers forced on (the
    unknown-client default), the 400 can only be an in-stream error event, and Claude
    Code re-sends the request without streaming: one request more."""
    env, cfg = _setup(tmp_path, mock)
    mock.script(STORM_THEN_400)
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code != 0
    assert claude_result(r).get("terminal_reason") == "prompt_too_long", r.stdout[-2000:]
    assert len(mock.requests) == 2  # the 529, the 400: nothing more
    assert all(req.json().get("stream") is True for req in mock.requests)

    mock.reset()
    mock.script(STORM_THEN_400)
    forced = tmp_path / "early.toml"
    forced.write_text(cfg.read_text() + "\n[clients.claude-code]\nearly_headers = true\n")
    r = await run(through_unbroken(forced, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code != 0
    assert len(mock.requests) == 3
    assert mock.requests[2].json().get("stream") is not True  # the non-streamed retry
    print("\nclaude 529 past early_headers_s then a final 400: with the profile 2 requests "
          "(the 400 as a status); with early headers 3 (re-sent without streaming)")


async def test_cut_right_after_a_complete_tool_call(tmp_path, mock):
    """A cut between the Bash call's content_block_stop and message_stop.  By default the
    call was released (Claude Code dispatches it there): the tool runs once and Claude
    Code shows a synthetic error message before carrying on.  With hold = [...,
    "tool_tail"] the complete call waits for message_stop, so the cut is replayed and
    Claude Code sees one clean tool call."""
    tool = _bash("echo ran >> marker.txt")
    events = events_for("anthropic", tool, {"model": "fake-model", "stream": True})
    stop = max(i for i, (name, _) in enumerate(events) if name == "content_block_stop")
    cut = {**tool, "fault": "reset", "after_frame": stop + 1}

    def synthetic(r: Any) -> list[Any]:
        return [e for e in r.events() if e.get("type") == "assistant"
                and e["message"].get("model") == "<synthetic>"]

    env, cfg = _setup(tmp_path, mock)
    mock.script([cut])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert synthetic(r) and len(mock.requests) == 2

    (tmp_path / "project" / "marker.txt").unlink()
    mock.reset()
    mock.script([cut, tool])
    tail = tmp_path / "tail.toml"
    tail.write_text(cfg.read_text().replace(
        "[stream]", '[stream]\nhold = ["control", "tool_calls", "tool_tail"]'))
    r = await run(through_unbroken(tail, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert not synthetic(r)
    assert len(mock.requests) == 3  # the cut attempt, unbroken's replay, the follow-up
