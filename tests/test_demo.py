"""`unbroken demo`: the real command, and a faster storm whose journal `stats` reads."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys

from unbroken.cli import main
from unbroken.demo import run_demo, storms
from unbroken.observe.stats import compute_stats


async def test_demo_json_command():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "unbroken", "demo", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()
    summary = json.loads(out)
    for key in ("turns", "completed", "faults_injected", "duplicates", "direct_completed"):
        assert key in summary
    assert summary["duplicates"] == 0
    assert summary["corrupted"] == 0
    assert summary["completed"] == summary["turns"] == 12
    assert summary["faults_injected"] == 2 * sum(s.faults for s in storms()) == 24
    # every fault before commit was absorbed; the drops after output reached the client
    assert summary["failures_absorbed"] >= 22  # a slow CI machine may add a stall or two
    assert summary["failures_after_commit"] == summary["client_errors"] == 2
    assert summary["direct_completed"] < summary["turns"]
    assert summary["direct_client_errors"] > summary["client_errors"]
    assert summary["seconds"] + summary["direct_seconds"] < 60


async def test_fast_storm_and_its_journal(tmp_path):
    path = tmp_path / "demo.sqlite3"
    summary = await run_demo(
        turns=6, direct=False, retry_after_s=0.2, stall_s=10, journal=str(path)
    )
    assert summary["completed"] == 6 and summary["duplicates"] == 0
    assert summary["faults_injected"] == 12 and summary["direct_completed"] is None
    s = compute_stats(sqlite3.connect(path), since_s=None)
    # 6 turns x 2 steps, plus the step the agent retried after the drop after output
    assert s["turns"] == 13
    assert s["outcomes"]["recovered"] == 5 and s["outcomes"]["ended_with_error"] == 1
    assert s["outcomes"]["ok"] == 7
    assert s["replay_safety"]["before_commit"]["failures"] == 11
    assert s["replay_safety"]["after_commit"]["ended"] == {"ended_with_error": 1}
    assert s["failures_by_phase"]["stall"] == 1
    assert s["wasted_tokens_est"] > 0
    turns = sqlite3.connect(path).execute("SELECT DISTINCT session_id FROM turns").fetchall()
    assert len(turns) == 6  # one agent session per turn


def test_demo_text_summary(capsys):
    assert main(["demo", "--turns", "6", "--no-direct"]) == 0
    out = capsys.readouterr().out
    assert "turns completed       6 of 6" in out
    assert "duplicated frames     0" in out
    assert "Straight against the mock" not in out
