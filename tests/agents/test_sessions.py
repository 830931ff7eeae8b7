"""Sessions are named in the journal (session-id, X-Claude-Code-Session-Id, ...), with the
client profile; `unbroken stats --by session`; a version-1 journal is migrated."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayfix import make_config, start_relay
from unbroken.cli import main
from unbroken.config import JournalSettings
from unbroken.mock import MockProvider
from unbroken.observe.hooks import TurnRecord
from unbroken.observe.journal import SCHEMA_VERSION, Journal
from unbroken.observe.stats import compute_sessions

CHAT = "mock/v1/chat/completions"
MESSAGES = "mock/v1/messages"


def _rows(path: Path, sql: str) -> list[dict[str, Any]]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql)]
    finally:
        conn.close()


async def test_journal_names_sessions_and_clients(
    mock: MockProvider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "j.sqlite3"
    cfg = dataclasses.replace(
        make_config([{"url": mock.url}]), journal=JournalSettings(path=str(path))
    )
    server, rec = await start_relay(cfg)
    chat = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = {
        "model": "m",
        "max_tokens": 16,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    mock.script([{"status": 503}])
    try:
        async with aiohttp.ClientSession() as s:
            for url, body, headers in [
                (CHAT, chat, {"User-Agent": "codex_exec/0.169.0", "session-id": "codex-s1"}),
                (
                    MESSAGES,
                    anthropic,
                    {"User-Agent": "claude-cli/2.1.328", "X-Claude-Code-Session-Id": "claude-s1"},
                ),
                (CHAT, {**chat, "prompt_cache_key": "pck-1"}, {"User-Agent": "curl/8"}),
            ]:
                async with s.post(f"{server.url}/{url}", json=body, headers=headers) as r:
                    assert r.status == 200
                    await r.read()
        await rec.wait_turns(3)
        assert server.journal is not None
        await server.journal.flush()
    finally:
        await server.stop()
    rows = _rows(path, "SELECT session_id, client, outcome FROM turns ORDER BY turn_id")
    assert [(r["session_id"], r["client"]) for r in rows] == [
        ("codex-s1", "codex"),
        ("claude-s1", "claude-code"),
        ("pck-1", "unknown"),
    ]
    conn = sqlite3.connect(path)
    try:
        sessions = compute_sessions(conn, since_s=None)
    finally:
        conn.close()
    assert sessions[0]["session_id"] == "codex-s1" and sessions[0]["failed_attempts"] == 1
    assert sessions[0]["recovered"] == 1 and sessions[0]["client"] == "codex"
    assert main(["stats", "--journal", str(path), "--by", "session", "--since", "all"]) == 0
    out = capsys.readouterr().out
    assert "codex-s1" in out and "claude-code" in out
    assert main(["stats", "--journal", str(path), "--by", "session", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {s["session_id"] for s in data["sessions"]} == {"codex-s1", "claude-s1", "pck-1"}


V2 = """
CREATE TABLE attempts (turn_uid TEXT NOT NULL, number INTEGER NOT NULL, upstream TEXT NOT NULL,
  started REAL NOT NULL, ended REAL, status INTEGER, reason TEXT NOT NULL, phase TEXT,
  frames_received INTEGER NOT NULL DEFAULT 0, bytes_received INTEGER NOT NULL DEFAULT 0,
  frames_released INTEGER NOT NULL DEFAULT 0, bytes_released INTEGER NOT NULL DEFAULT 0,
  hold_s REAL NOT NULL DEFAULT 0, input_tokens INTEGER, output_tokens INTEGER,
  est_output_tokens INTEGER NOT NULL DEFAULT 0, wait_s REAL, PRIMARY KEY (turn_uid, number));
"""

V1 = """
CREATE TABLE turns (uid TEXT PRIMARY KEY, run TEXT NOT NULL, turn_id INTEGER NOT NULL,
  route TEXT NOT NULL, path TEXT NOT NULL, protocol TEXT NOT NULL, stream INTEGER NOT NULL,
  session_id TEXT, started REAL NOT NULL, ended REAL, outcome TEXT,
  attempts INTEGER NOT NULL DEFAULT 0, upstream TEXT, last_failure TEXT, first_byte_s REAL,
  wait_s REAL NOT NULL DEFAULT 0);
INSERT INTO turns (uid, run, turn_id, route, path, protocol, stream, session_id, started,
  outcome, attempts) VALUES ('r:1', 'r', 1, 'x', 'p', 'chat', 1, 'old', 1e12, 'ok', 1);
PRAGMA user_version=1;
"""


async def test_an_old_journal_gains_the_new_columns_and_tables(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(V1 + V2)  # the attempts table as versions 1 and 2 had it
    conn.close()
    # stats read it before the migration too
    conn = sqlite3.connect(path)
    assert compute_sessions(conn, since_s=None)[0]["client"] is None
    conn.close()
    journal = Journal(path)
    journal.start()
    journal.turn_started(
        TurnRecord(
            route="x", path="p", protocol="chat", stream=True, session_id="new", client="codex"
        )
    )
    await journal.aclose()
    cols = [r["name"] for r in _rows(path, "PRAGMA table_info(turns)")]
    assert "client" in cols
    assert "choice" in [r["name"] for r in _rows(path, "PRAGMA table_info(attempts)")]
    assert _rows(path, "SELECT count(*) AS n FROM upstream_events") == [{"n": 0}]
    assert "queued_s" in cols  # version 4: the time queued for rate limits
    assert _rows(path, "PRAGMA user_version")[0]["user_version"] == SCHEMA_VERSION
    assert _rows(path, "SELECT session_id, client FROM turns ORDER BY started") == [
        {"session_id": "new", "client": "codex"},
        {"session_id": "old", "client": None},
    ]
