"""End to end with the real Gemini CLI (``@google/gemini-cli`` 0.61.0), through
`unbroken run`.

Gemini CLI runs headless (``gemini -p ... -m gemini-2.5-flash``, ``--approval-mode
yolo`` when its shell tool must run) with API-key auth and ``GOOGLE_GEMINI_BASE_URL``
at the mock provider, as a user's own gateway would be; `unbroken run -- gemini`
relays to it.  Most tests run unbroken with its defaults (250 ms retries), so the
figures they print are docs/agents.md's.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from e2e.agent_run import GEMINI_MODEL, gemini_argv, gemini_env, run, through_unbroken
from unbroken.mock import MockProvider
from unbroken.mock.wire import frames_for

pytestmark = [pytest.mark.e2e, pytest.mark.cli("gemini"), pytest.mark.timeout(240)]

TEXT = "Hello from the mock provider."
#: the reply's text pieces, as the mock streams them (8 events)
PIECES = [
    json.loads(f[6:])["candidates"][0]["content"]["parts"][0]["text"]
    for f in frames_for("gemini", None, {"model": GEMINI_MODEL, "stream": True})
]


def _setup(tmp_path: Path, mock: MockProvider, extra: str = "") -> tuple[dict[str, str], Path]:
    """Gemini CLI's environment, and an unbroken config with the defaults (and a journal)."""
    env = gemini_env(tmp_path, mock.url)
    cfg = tmp_path / "unbroken.toml"
    cfg.write_text(f'[journal]\npath = "{tmp_path / "journal.sqlite3"}"\n{extra}')
    return env, cfg


def _shell(command: str) -> dict[str, Any]:
    return {
        "reply": "tool",
        "tool_name": "run_shell_command",
        "tool_args": {"command": command, "description": "mark"},
    }


async def test_a_plain_prompt_and_its_turn_in_the_journal(
    tmp_path: Path, mock: MockProvider
) -> None:
    env, cfg = _setup(tmp_path, mock)
    r = await run(through_unbroken(cfg, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert r.stdout.strip() == TEXT
    [req] = mock.requests
    assert req.path == f"/v1beta/models/{GEMINI_MODEL}:streamGenerateContent"
    assert req.query["alt"] == "sse" and req.headers["x-goog-api-key"]
    assert req.headers["user-agent"].startswith("GeminiCLI")
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        rows = conn.execute("SELECT protocol, client, outcome FROM turns").fetchall()
    finally:
        conn.close()
    assert rows == [("gemini", "gemini-cli", "ok")]


async def test_a_503_storm_is_absorbed(tmp_path: Path, mock: MockProvider) -> None:
    """30 x 503: alone, Gemini CLI gives up after 10 attempts (~205 s, measured for the
    issue); through unbroken with its defaults it never sees one."""
    env, cfg = _setup(tmp_path, mock)
    mock.script([{"status": 503, "count": 30}])
    r = await run(through_unbroken(cfg, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert r.stdout.strip() == TEXT
    assert len(mock.requests) == 31
    own = [line for line in r.stderr.splitlines() if " unbroken " not in line]
    assert not [line for line in own if "503" in line or "ttempt" in line], own
    print(f"\ngemini 503x30 through unbroken (defaults): exit 0 in {r.seconds:.1f} s")


async def test_early_headers_and_blank_line_keepalives_before_the_first_event(
    tmp_path: Path, mock: MockProvider
) -> None:
    """A storm that outlasts ``early_headers_s``: Gemini CLI gets the ``200`` and then
    only blank-line keepalives for seconds before its first event, and reads the answer
    (so early headers can serve its ~60 s header timer, and the Gemini keepalive does not
    stop its parser)."""
    env, cfg = _setup(tmp_path, mock, "[stream]\nearly_headers_s = 0.5\nkeepalive_s = 0.3\n")
    mock.script([{"status": 503, "count": 12}])
    r = await run(through_unbroken(cfg, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert r.stdout.strip() == TEXT
    assert len(mock.requests) == 13
    conn = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        ((first_byte, took, outcome),) = conn.execute(
            "SELECT first_byte_s, ended - started, outcome FROM turns"
        ).fetchall()
    finally:
        conn.close()
    assert outcome == "recovered"
    assert first_byte < 1.5 < took - 1.0  # the headers went early, the text came later
    print(
        f"\ngemini early headers after {first_byte:.2f} s, blank lines, the text after "
        f"{took:.1f} s: exit 0"
    )


RETRY_INFO = json.dumps(
    {
        "error": {
            "code": 429,
            "message": "You exceeded your current quota, please check your plan and billing "
            "details. Please retry in 3s.",
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [{"quotaId": "GenerateRequestsPerMinutePerProjectPerModel"}],
                },
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "3s"},
            ],
        }
    }
)


async def test_a_429_with_retry_info_is_obeyed(tmp_path: Path, mock: MockProvider) -> None:
    env, cfg = _setup(tmp_path, mock)
    mock.script([{"status": 429, "body": RETRY_INFO}])
    r = await run(through_unbroken(cfg, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert r.stdout.strip() == TEXT
    first, second = mock.requests
    waited = second.at - first.at
    assert 3.0 <= waited < 5.0  # the retryDelay, not the 250 ms default
    print(f"\ngemini 429 with retryDelay 3s: the retry went after {waited:.2f} s")


async def test_a_cut_before_output_runs_the_shell_tool_exactly_once(
    tmp_path: Path, mock: MockProvider
) -> None:
    """Resets before the functionCall event (right after the headers, and with only the
    headers of a stalled attempt): unbroken replays them, the call reaches Gemini CLI
    once, and its shell tool runs once."""
    env, cfg = _setup(tmp_path, mock)
    tool = _shell("echo ran >> marker.txt")
    mock.script([{**tool, "fault": "reset", "after_frame": 0}] * 3 + [tool])
    argv = gemini_argv("run the tool", yolo=True)
    r = await run(through_unbroken(cfg, argv), env, tmp_path / "project")
    assert r.code == 0, r.stderr[-3000:]
    assert (tmp_path / "project" / "marker.txt").read_text() == "ran\n"
    assert len({req.body for req in mock.requests[:4]}) == 1  # byte-identical replays
    assert len(mock.requests) == 5  # 3 cut, the call, the follow-up with its result
    follow_up = mock.requests[4].json()["contents"][-1]["parts"][0]
    assert follow_up["functionResponse"]["name"] == "run_shell_command"


async def test_a_cut_after_output_ends_without_duplicated_text(
    tmp_path: Path, mock: MockProvider
) -> None:
    """A reset after two text events.  The profile ends the stream with a reset: Gemini
    CLI prints the partial text once and fails the turn.  Forced to the native error
    event instead (``after_commit_end = "error"``), Gemini CLI retries the turn and
    prints the prefix twice: the evidence for its profile (docs/gate.md)."""
    prefix = "".join(PIECES[:2])
    cut = {"fault": "reset", "after_frame": 2}
    env, cfg = _setup(tmp_path, mock)
    mock.script([cut])
    r = await run(through_unbroken(cfg, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.code != 0
    assert r.stdout.count(prefix) == 1 and TEXT not in r.stdout, r.stdout
    assert len(mock.requests) == 1  # never replayed after output, and no retry of its own
    reset_out = r.stdout

    mock.reset()
    mock.script([cut])
    forced = tmp_path / "error.toml"
    forced.write_text(cfg.read_text() + '\n[clients.gemini-cli]\nafter_commit_end = "error"\n')
    r = await run(through_unbroken(forced, gemini_argv("say hi")), env, tmp_path / "project")
    assert r.stdout.count(prefix) == 2, r.stdout  # its own retry shows the prefix again
    assert len(mock.requests) == 2
    print(
        f"\ngemini cut after 2 text events: reset -> exit non-zero, stdout {reset_out!r}; "
        f"native error -> exit {r.code}, stdout {r.stdout!r}"
    )
