"""End to end with the real Claude Code (``@anthropic-ai/claude-code`` 2.1.328), through
`unbroken run`.

Claude Code runs headless (``claude -p --output-format stream-json --verbose
--allowedTools Bash``) with ``ANTHROPIC_BASE_URL`` at the mock provider, as a user's
own gateway would be; `unbroken run -- claude` relays to it.  The storms run with no
unbroken config at all (the defaults a user gets); the other tests give the relay a
journal path and only the ``[stream]`` keys they are about.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from e2e.agent_run import (
    STALL_TIMERS,
    claude_argv,
    claude_env,
    claude_result,
    relay_config,
    report,
    run,
    through_unbroken,
    timeline,
    zero_config,
)
from unbroken.mock import MockProvider
from unbroken.mock.wire import events_for

pytestmark = [pytest.mark.e2e, pytest.mark.cli("claude"), pytest.mark.timeout(120)]

TEXT = "Hello from the mock provider."


def _setup(
    tmp_path: Path, mock: MockProvider, stream: dict[str, Any] | None = None, **extra: str
) -> tuple[dict[str, str], Path]:
    env = claude_env(tmp_path, mock.url, **extra)
    cfg = relay_config(tmp_path / "unbroken.toml", tmp_path / "journal.sqlite3", **(stream or {}))
    return env, cfg


#: the error event as the ending after commit ([clients.claude-code]), for comparison
ERROR_ENDING = '\n[clients.claude-code]\nafter_commit_end = "error"\n'


def _bash(command: str) -> dict[str, Any]:
    return {
        "reply": "tool",
        "tool_name": "Bash",
        "tool_args": {"command": command, "description": "mark"},
    }


async def test_text_turn_and_its_session_in_the_journal(tmp_path: Path, mock: MockProvider) -> None:
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


async def test_bash_tool_runs_once(tmp_path: Path, mock: MockProvider) -> None:
    env, cfg = _setup(tmp_path, mock)
    mock.script([_bash("echo ran >> marker.txt")])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert len(mock.requests) == 2


async def test_529_storm_kills_claude_code_alone(
    tmp_path: Path, mock: MockProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    """The baseline: Claude Code alone gives up on a 529 storm (its retries cut to 2
    here; with its default 10 it gives up after 11 requests, ~190 s)."""
    env = claude_env(tmp_path, mock.url, CLAUDE_CODE_MAX_RETRIES="2")
    mock.script([{"status": 529, "count": 100}])
    alone = await run(claude_argv("say hi"), env, tmp_path / "project")
    assert alone.code != 0
    assert len(mock.requests) == 3
    report(
        capsys,
        f"claude 529 x 100 alone (CLAUDE_CODE_MAX_RETRIES=2): exit {alone.code} "
        f"after {len(mock.requests)} requests ({alone.seconds:.1f} s)",
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("count", [30, 100])
async def test_529_storm_absorbed_with_no_unbroken_config(
    tmp_path: Path, mock: MockProvider, capsys: pytest.CaptureFixture[str], count: int
) -> None:
    """`unbroken run -- claude` with no unbroken config (the defaults: a lone turn retried
    every 250 ms, breakers that never open for one turn's failures): 529 x ``count``,
    then the answer.  Claude Code sees one clean turn: no error, no ``api_retry``."""
    env = claude_env(tmp_path, mock.url)
    mock.script([{"status": 529, "count": count}])
    r = await run(zero_config(claude_argv("say hi")), env, tmp_path / "project", limit_s=200)
    assert r.code == 0, r.stderr[-3000:]
    result = claude_result(r)
    assert result.get("result") == TEXT and not result.get("is_error"), r.stdout[-3000:]
    retries = [e for e in r.events() if e.get("subtype") == "api_retry"]
    assert not retries  # Claude Code never saw a 529
    assert len(mock.requests) == count + 1
    assert all(req.path == "/v1/messages" for req in mock.requests)
    report(
        capsys,
        f"claude 529 x {count} through `unbroken run -- claude` (no config): exit 0, "
        f"{len(mock.requests)} requests, {r.seconds:.1f} s ({timeline(r, mock.requests)})",
    )


async def test_reset_mid_input_json_delta_runs_the_tool_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    env, cfg = _setup(tmp_path, mock)
    tool = _bash("echo ran >> marker.txt")
    events = events_for("anthropic", tool, {"model": "fake-model", "stream": True})
    first_json = next(
        i
        for i, (_, p) in enumerate(events)
        if isinstance(p, dict) and p.get("delta", {}).get("type") == "input_json_delta"
    )
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


async def test_a_final_400_after_a_long_storm_stays_a_400(
    tmp_path: Path, mock: MockProvider
) -> None:
    """529s for longer than early_headers_s (1 s here), then a final 400 ("prompt is too
    long"): the Claude Code profile sends no early headers, so the 400 reaches it as a
    status and it stops, with no extra request.  With early headers forced on (the
    unknown-client default), the 400 can only be an in-stream error event, and Claude
    Code re-sends the request without streaming: one request more."""
    # early_headers_s = 1: the 529's 1.5 s Retry-After outlasts it (the default is 20 s)
    env, cfg = _setup(tmp_path, mock, {"early_headers_s": 1})
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
    print(
        "\nclaude 529 past early_headers_s then a final 400: with the profile 2 requests "
        "(the 400 as a status); with early headers 3 (re-sent without streaming)"
    )


async def test_cut_right_after_a_complete_tool_call(tmp_path: Path, mock: MockProvider) -> None:
    """A cut between the Bash call's content_block_stop and message_stop.  By default the
    call was released (Claude Code dispatches it there) and the claude-code profile ends
    the stream with a reset.  Claude Code then does one of two things, depending on
    whether it had started the call when the reset arrived (a race, both seen): it drops
    the call it had not started and sends the same request again (an api_retry), whose
    answer (the model's call, again) it runs; or it lets the started call finish, shows
    "Connection lost mid-response" and carries on with its result.  Either way no call
    runs twice.  With the error event instead, it runs the cut call, shows "Server error
    mid-response" and carries on.  With hold = [..., "tool_tail"] the complete call waits
    for message_stop, so the cut is replayed and Claude Code sees one clean tool call."""
    tool = _bash("echo A >> marker.txt")
    events = events_for("anthropic", tool, {"model": "fake-model", "stream": True})
    stop = max(i for i, (name, _) in enumerate(events) if name == "content_block_stop")
    cut = {**tool, "fault": "reset", "after_frame": stop + 1}
    again = _bash("echo B >> marker.txt")  # the model's answer to the same request, again
    marker = tmp_path / "project" / "marker.txt"

    def synthetic(r: Any) -> list[str]:
        return [
            e["message"]["content"][0].get("text", "")
            for e in r.events()
            if e.get("type") == "assistant" and e["message"].get("model") == "<synthetic>"
        ]

    env, cfg = _setup(tmp_path, mock)
    mock.script([cut, again])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    ran = marker.read_text().splitlines()
    assert len(ran) == len(set(ran))  # no call ran twice
    if mock.requests[0].body == mock.requests[1].body:  # the same request again
        assert ran == ["B"] and not synthetic(r)
        assert [e for e in r.events() if e.get("subtype") == "api_retry"]
        branch = "dropped the unstarted call, re-sent the request"
    else:  # it carried on with the result of the call it had started
        assert ran[0] == "A" and "Connection lost mid-response" in synthetic(r)[0]
        follow_up = mock.requests[1].json()["messages"][-1]["content"]
        assert any(c.get("type") == "tool_result" for c in follow_up)
        branch = "finished the started call, carried on"
    print(f"\nclaude, a reset after a complete call: {branch} ({len(mock.requests)} requests)")

    marker.unlink()
    mock.reset()
    mock.script([cut])
    error = tmp_path / "error.toml"
    error.write_text(cfg.read_text() + ERROR_ENDING)
    r = await run(through_unbroken(error, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert marker.read_text() == "A\n"
    assert "Server error mid-response" in synthetic(r)[0] and len(mock.requests) == 2

    marker.unlink()
    mock.reset()
    mock.script([cut, tool])
    tail = relay_config(
        tmp_path / "tail.toml",
        tmp_path / "journal.sqlite3",
        hold=["control", "tool_calls", "tool_tail"],
    )
    r = await run(through_unbroken(tail, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert marker.read_text() == "A\n"
    assert not synthetic(r)
    assert not [e for e in r.events() if e.get("subtype") == "api_retry"]
    assert len(mock.requests) == 3  # the cut attempt, unbroken's replay, the follow-up


async def test_a_cut_while_the_tool_runs_lets_it_finish_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    """The upstream goes silent after the Bash call's content_block_stop and the relay's
    stall timer (3 s) cuts it while the tool (sleep 5) is still running.  After the
    reset, Claude Code waits for the tool it started, shows "Connection lost
    mid-response", and carries on with the result: the tool runs once and the next
    request holds its result (the same as after the error event)."""
    tool = _bash("sleep 5; echo ran >> marker.txt")
    events = events_for("anthropic", tool, {"model": "fake-model", "stream": True})
    stop = max(i for i, (name, _) in enumerate(events) if name == "content_block_stop")
    env, cfg = _setup(tmp_path, mock, STALL_TIMERS)  # the defaults would wait 120 s
    mock.script([{**tool, "fault": "stall", "after_frame": stop + 1, "seconds": 60}])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert claude_result(r).get("result") == TEXT
    assert len(mock.requests) == 2
    follow_up = mock.requests[1].json()["messages"][-1]["content"]
    assert any(c.get("type") == "tool_result" for c in follow_up)


#: message_start, the text block's start, a ping and three text deltas, then the upstream
#: connection dies: after commit (the text reached Claude Code), so never replayed
CUT_AFTER_TEXT = {"fault": "reset", "after_frame": 6}


def _texts(r: Any) -> list[str]:
    """Every text block of every assistant message Claude Code printed."""
    return [
        b["text"]
        for e in r.events()
        if e.get("type") == "assistant"
        for b in e["message"].get("content", [])
        if b.get("type") == "text"
    ]


def _streamed(mock: MockProvider) -> list[bool]:
    return [req.json().get("stream") is True for req in mock.requests]


async def test_a_cut_after_text_ends_with_a_reset_and_claude_code_streams_again(
    tmp_path: Path, mock: MockProvider
) -> None:
    """The upstream dies after three text deltas, after commit: never replayed.  The
    claude-code profile ends the stream by aborting Claude Code's connection; Claude Code
    re-sends the request streamed (after ~0.6 s: one api_retry) and prints the answer
    once.  With the error event instead (after_commit_end = "error", every other
    client's ending) it re-sends it at once, without streaming: the answer also arrives
    once, but not streamed (see the next test for what that costs)."""
    env, cfg = _setup(tmp_path, mock)
    mock.script([CUT_AFTER_TEXT])
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert claude_result(r).get("result") == TEXT
    assert _texts(r) == [TEXT]  # once: the cut prefix is not repeated
    assert _streamed(mock) == [True, True]
    assert len([e for e in r.events() if e.get("subtype") == "api_retry"]) == 1
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        outcomes = [o for (o,) in conn.execute("SELECT outcome FROM turns ORDER BY turn_id")]
    finally:
        conn.close()
    assert outcomes == ["ended_with_error", "ok"]
    reset_s = r.seconds

    mock.reset()
    mock.script([CUT_AFTER_TEXT])
    error = tmp_path / "error.toml"
    error.write_text(cfg.read_text() + ERROR_ENDING)
    r = await run(through_unbroken(error, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert claude_result(r).get("result") == TEXT
    assert _texts(r) == [TEXT]
    assert _streamed(mock) == [True, False]  # re-sent without streaming
    assert not [e for e in r.events() if e.get("subtype") == "api_retry"]
    print(
        f"\nclaude, a cut after text: reset -> 2 requests (streamed, streamed), "
        f"{reset_s:.1f} s; error event -> 2 requests (streamed, non-streamed), {r.seconds:.1f} s"
    )


async def test_after_a_cut_a_long_answer_arrives_only_streamed(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Why the reset: after a cut, the answer takes ~9 s to generate, longer than Claude
    Code's wait for a non-streamed answer (API_TIMEOUT_MS = 5000 here; 300 s by default,
    while it asks for max_tokens = 32000 on its non-streamed re-send too, minutes of
    generation).  After the reset Claude Code re-streams: the frames arrive 0.7 s apart
    and the answer completes.  After the error event its non-streamed re-sends time out,
    one after the other (the same answer, which would arrive whole after 9 s), and the
    session fails."""
    env, cfg = _setup(tmp_path, mock, API_TIMEOUT_MS="5000", CLAUDE_CODE_MAX_RETRIES="2")
    mock.script([CUT_AFTER_TEXT, {"chunk_delay_ms": 700}])
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert claude_result(r).get("result") == TEXT and _texts(r) == [TEXT]
    assert _streamed(mock) == [True, True]
    reset_s = r.seconds

    mock.reset()
    mock.script([CUT_AFTER_TEXT] + [{"delay_ms": 9000}] * 8)
    error = tmp_path / "error.toml"
    error.write_text(cfg.read_text() + ERROR_ENDING)
    r = await run(through_unbroken(error, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code != 0
    result = claude_result(r)
    assert result.get("is_error") and "timed out" in str(result.get("result")), r.stdout[-2000:]
    streamed = _streamed(mock)
    assert streamed[0] and not any(streamed[1:]) and len(streamed) >= 3
    print(
        f"\nclaude, a cut after text, then a 9 s answer (API_TIMEOUT_MS=5000): reset -> "
        f"completes streamed in {reset_s:.1f} s; error event -> {len(streamed) - 1} "
        f"non-streamed re-sends time out, exit {r.code} after {r.seconds:.1f} s"
    )


#: a longer answer: twelve text deltas, so five cuts after two deltas each still leave text
LONG = "Done: the command ran and printed its marker.  Everything is in place now."


async def test_five_cuts_after_text_are_continued_and_the_tool_runs_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    """``after_commit = "continue"`` (issue 23): the answer after the tool's result is
    cut five times after two text deltas each; every cut is continued by prefill (the
    committed text as an assistant message), so Claude Code sees one clean streamed
    answer: no error, no ``api_retry``, the text once, and the tool ran once."""
    # Claude Code asks for adaptive thinking by default: no prefill with thinking.
    env, cfg = _setup(
        tmp_path, mock, {"after_commit": "continue"}, CLAUDE_CODE_DISABLE_THINKING="1"
    )
    answer = {"text": LONG, "deltas": 12}
    cut = {**answer, "fault": "reset", "after_deltas": 2}
    mock.script([_bash("echo ran >> marker.txt"), *[cut] * 5, answer])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    result = claude_result(r)
    assert result.get("result") == LONG and not result.get("is_error"), r.stdout[-3000:]
    assert _texts(r) == [LONG]
    assert not [e for e in r.events() if e.get("subtype") == "api_retry"]
    assert len(mock.requests) == 7  # the call, the answer, five continuations
    prefills = [req.json()["messages"][-1] for req in mock.requests[2:]]
    assert all(p["role"] == "assistant" for p in prefills)
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        outcomes = [o for (o,) in conn.execute("SELECT outcome FROM turns ORDER BY turn_id")]
    finally:
        conn.close()
    assert outcomes == ["ok", "resumed"]
    continued_s = r.seconds

    # With thinking (Claude Code's default: adaptive) a prefill is refused: the cut ends
    # as today, with the reset, and Claude Code streams the request again.
    mock.reset()
    env, cfg = _setup(tmp_path, mock, {"after_commit": "continue"})
    mock.script([cut, answer])
    r = await run(through_unbroken(cfg, claude_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert mock.requests[0].json()["thinking"]["type"] == "adaptive"
    assert claude_result(r).get("result") == LONG
    assert len([e for e in r.events() if e.get("subtype") == "api_retry"]) == 1
    assert "assistant" not in [m["role"] for m in mock.requests[1].json()["messages"][-1:]]
    print(
        f"\nclaude, five cuts after text, continued: exit 0, {continued_s:.1f} s, 7 requests; "
        f"with thinking on, a cut is refused and ends with the reset ({r.seconds:.1f} s)"
    )


async def test_cuts_in_the_text_before_a_tool_call_run_the_tool_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    """The answer is text, then a ``Bash`` call (as Claude Code's model often answers);
    the text is cut three times: each continuation brings the rest of the text and then
    the call, which reaches Claude Code as block 1, whole.  It runs once; no error."""
    env, cfg = _setup(
        tmp_path, mock, {"after_commit": "continue"}, CLAUDE_CODE_DISABLE_THINKING="1"
    )
    lead = {**_bash("echo ran >> marker.txt"), "reply": "text_tool", "deltas": 12}
    lead["text"] = "Let me run the command that writes the marker file, then check it."
    cut = {**lead, "fault": "reset", "after_deltas": 2}
    mock.script([*[cut] * 3, lead, {"text": TEXT}])
    r = await run(through_unbroken(cfg, claude_argv("run the tool")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    result = claude_result(r)
    assert result.get("result") == TEXT and not result.get("is_error"), r.stdout[-3000:]
    assert lead["text"] in _texts(r)
    assert not [e for e in r.events() if e.get("subtype") == "api_retry"]
    assert len(mock.requests) == 5  # the answer, three continuations, after the tool
    tool_results = [
        b
        for req in mock.requests
        for m in req.json()["messages"]
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    ]
    assert len(tool_results) == 1
