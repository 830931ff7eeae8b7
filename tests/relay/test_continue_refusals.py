"""Issue 33 item 5: every turn continue mode refuses is said and counted.

With ``after_commit = "continue"``, a request continue mode cannot cover (Claude
Code's default adaptive thinking, a forced tool call, ...) used to go through with no
word: a cut after output then ended with the native error as if continue mode were
off.  Now the reason is logged once per route and reason, recorded on the turn
(``refused_<reason>``), written to the journal's ``turns.continuation`` and counted by
``unbroken stats``.  Each test fails on the code before (no log line, no column).
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayfix import Recorder
from unbroken.config import parse_config
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider
from unbroken.observe.stats import compute_stats, format_stats
from unbroken.relay.server import RelayServer

TEXT = "The quick brown fox jumps over the lazy dog, and then naps.  Twice over!"
STREAM = {"first_frame_timeout_s": 2, "idle_timeout_s": 2, "keepalive_s": 30}
#: what Claude Code sends by default: adaptive thinking
BODY: dict[str, Any] = {
    "model": "claude-mock",
    "max_tokens": 256,
    "stream": True,
    "thinking": {"type": "adaptive"},
    "messages": [{"role": "user", "content": "tell me"}],
}
CUT = {"text": TEXT, "deltas": 12, "fault": "reset", "after_deltas": 3}


async def _relay(mock: MockProvider, journal: Path) -> tuple[RelayServer, Recorder]:
    cfg = parse_config(
        {
            "retry": {"delay_ms": 5},
            "stream": {**STREAM, "after_commit": "continue"},
            "journal": {"enabled": True, "path": str(journal)},
            "routes": {"mock": {"upstreams": [{"url": mock.url}]}},
        },
        env={},
    )
    rec = Recorder()
    server = RelayServer(dataclasses.replace(cfg, port=0, grace_s=5.0), hooks=rec)
    await server.start()
    return server, rec


async def _post(url: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.read()
        return await r.read()


def _refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "continue mode refused" in r.getMessage()]


async def test_adaptive_thinking_refused_is_logged_once_and_counted(
    mock: MockProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three Claude Code turns with adaptive thinking: two cut after output (each ends
    with Anthropic's native error, no continuation asked), one clean.  One log line
    names the reason; the journal and ``unbroken stats`` count three refused turns,
    two of them cut after output."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    path = tmp_path / "journal.sqlite3"
    server, rec = await _relay(mock, path)
    try:
        mock.script([CUT, CUT, {"text": TEXT}])
        for _ in range(2):
            got = await _post(f"{server.url}/mock/v1/messages", BODY)
            names = [e.name for e in SSESplitter().feed(got)]
            assert names[-1] == "error" and "message_stop" not in names
        await _post(f"{server.url}/mock/v1/messages", BODY)
        assert len(mock.requests) == 3  # no continuation request
        turns = await rec.wait_turns(3)
        assert [t.continuation for t in turns] == ["refused_thinking_enabled"] * 3
    finally:
        await server.stop()
    lines = _refusal_lines(caplog)
    assert len(lines) == 1, lines
    assert "route=mock reason=thinking_enabled" in lines[0]
    assert "adaptive thinking" in lines[0]
    conn = sqlite3.connect(path)
    try:
        got_rows = conn.execute("SELECT continuation FROM turns").fetchall()
        stats = compute_stats(conn, since_s=None)
    finally:
        conn.close()
    assert got_rows == [("refused_thinking_enabled",)] * 3
    assert stats["continue_refused"] == {"thinking_enabled": {"turns": 3, "cut_after_output": 2}}
    text = format_stats(stats)
    assert "Continue mode refused" in text and "thinking_enabled 3 (2 cut after output)" in text


async def test_each_reason_is_logged_once_per_route(
    mock: MockProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A forced tool call (refused for the request), a tool call released before the
    cut (refused at the cut), and a model that answers the prefill with 400 (refused by
    the upstream, with the route key that avoids prefill in the line): each reason
    once, each turn counted."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    path = tmp_path / "journal.sqlite3"
    server, rec = await _relay(mock, path)
    plain = {k: v for k, v in BODY.items() if k != "thinking"}
    forced = {**plain, "tool_choice": {"type": "any"}}
    tools = {"reply": "text_tool", "text": TEXT, "deltas": 4}
    try:
        mock.script(
            [CUT, CUT, {**tools, "fault": "reset", "after_frame": 14}, CUT, {"status": 400}]
        )
        await _post(f"{server.url}/mock/v1/messages", forced)
        await _post(f"{server.url}/mock/v1/messages", forced)
        await _post(f"{server.url}/mock/v1/messages", plain)  # the call released, then cut
        await _post(f"{server.url}/mock/v1/messages", plain)  # prefill answered 400
        turns = await rec.wait_turns(4)
    finally:
        await server.stop()
    assert [t.continuation for t in turns] == [
        "refused_forced_tool",
        "refused_forced_tool",
        "refused_tool_call",
        "refused_not_resumable",
    ]
    lines = _refusal_lines(caplog)
    assert [ln.split("reason=")[1].split(":")[0] for ln in lines] == [
        "forced_tool",
        "tool_call",
        "not_resumable",
    ]
    assert 'anthropic_continue = "user_message"' in lines[2]
    conn = sqlite3.connect(path)
    try:
        stats = compute_stats(conn, since_s=None)
    finally:
        conn.close()
    assert {k: v["turns"] for k, v in stats["continue_refused"].items()} == {
        "forced_tool": 2,
        "tool_call": 1,
        "not_resumable": 1,
    }


async def test_a_chat_route_without_chat_prefix_says_so(
    mock: MockProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Chat Completions has no continuation of its own: a continue route without
    ``chat_prefix`` covers none of its turns, and says it once (``no_option``)."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    server, rec = await _relay(mock, tmp_path / "journal.sqlite3")
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        for _ in range(2):
            await _post(f"{server.url}/mock/v1/chat/completions", body)
        turns = await rec.wait_turns(2)
    finally:
        await server.stop()
    assert [t.continuation for t in turns] == ["refused_no_option"] * 2
    lines = _refusal_lines(caplog)
    assert len(lines) == 1 and "reason=no_option" in lines[0] and "chat_prefix" in lines[0]
