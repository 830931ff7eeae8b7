"""`unbroken demo`: the real command, a faster storm whose journal `stats` reads, and the
samples of both in docs/, checked against a real run."""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from docsamples import DOCS, block_after, counted_names, lines_in_order, numbers_out
from unbroken.cli import main
from unbroken.demo import DemoRun, _turns, format_summary, render_run, run_demo, storms
from unbroken.observe.stats import compute_stats, format_stats


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One real `unbroken demo --json --journal FILE`: its summary and its journal."""
    journal = tmp_path_factory.mktemp("demo") / "journal.sqlite3"
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--json", "--journal", str(journal)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary, journal


def test_demo_json_command(demo_run: tuple[dict[str, Any], Path]) -> None:
    summary, _ = demo_run
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


async def test_fast_storm_and_its_journal(tmp_path: Path) -> None:
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


async def test_the_gemini_storm_through_the_relay_and_without_it(tmp_path: Path) -> None:
    """`--protocol gemini`: the same agent turns over the Gemini API, each under one of the
    Gemini API's storms; through the relay every one completes, straight at the mock a
    third are lost."""
    path = tmp_path / "gemini.sqlite3"
    summary = await run_demo(
        turns=6, retry_after_s=0.6, stall_s=10, journal=str(path), protocol="gemini"
    )
    assert summary["protocol"] == "gemini"
    assert summary["completed"] == 6 and summary["lost"] == 0
    assert summary["duplicates"] == 0 and summary["corrupted"] == 0
    assert summary["faults_injected"] == sum(s.faults for s in storms(protocol="gemini")) == 12
    absorbed = summary["absorbed_by_reason"]
    # the in-stream RPC error before output is replayed like a reset (a slow machine may
    # add a stall)
    assert {k: absorbed[k] for k in ("503", "server_disconnected", "429", "stream_error")} == {
        "503": 6,
        "server_disconnected": 2,
        "429": 1,
        "stream_error": 1,
    }
    assert absorbed["stall"] >= 1
    # the drop after output reached the client (as the native error event), nothing else
    assert summary["failures_after_commit"] == summary["client_errors"] == 1
    # straight at the mock: the 503 burst and the resets lose their turns
    assert (summary["direct_completed"], summary["direct_lost"]) == (4, 2)
    assert summary["direct_client_errors"] == 8 and summary["direct_duplicates"] == 0

    db = sqlite3.connect(path)
    turns = db.execute("SELECT protocol, client, stream, outcome FROM turns").fetchall()
    assert len(turns) == 13  # 6 x 2 steps, plus the step retried after the drop
    assert {t[:3] for t in turns} == {("gemini", "unknown", 1)}
    assert Counter(t[3] for t in turns) == {"ok": 7, "recovered": 5, "ended_with_error": 1}
    # the 429's RetryInfo.retryDelay (0.6 s) was obeyed, not the demo's 200 ms delay
    ((wait,),) = db.execute("SELECT wait_s FROM attempts WHERE status = 429").fetchall()
    assert wait >= 0.6


def test_the_gemini_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--protocol", "gemini", "--turns", "6", "--no-direct"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "6 concurrent agent turns over the Gemini API" in out
    assert ", ".join(s.name for s in storms(protocol="gemini")) in out
    assert "turns completed 6 of 6" in out and "duplicated frames 0" in out
    assert "Client: a Gemini API client" in out


@pytest.mark.parametrize("protocol", ["anthropic", "chat"])
async def test_with_after_commit_continue_a_drop_after_output_completes_without_error(
    tmp_path: Path, protocol: str
) -> None:
    """``--after-commit continue`` (issue 23): the drop after output is continued in place
    (Messages by prefill, Chat by the mock's prefix mode): no error reaches the agent,
    the text is exact, and the journal says ``resumed``.  With the default it is the
    native error, as before."""
    path = tmp_path / "continue.sqlite3"
    summary = await run_demo(
        turns=6,
        direct=False,
        retry_after_s=0.2,
        stall_s=10,
        journal=str(path),
        protocol=protocol,
        after_commit="continue",
    )
    assert summary["completed"] == 6 and summary["lost"] == 0
    assert summary["duplicates"] == 0 and summary["corrupted"] == 0
    assert summary["client_errors"] == 0
    assert summary["continued"] == summary["failures_after_commit"] == 1
    outcomes = Counter(o for (o,) in sqlite3.connect(path).execute("SELECT outcome FROM turns"))
    assert outcomes["resumed"] == 1 and outcomes["ended_with_error"] == 0
    assert sum(outcomes.values()) == 12  # no step was retried by the agent
    if protocol == "anthropic":
        default = await run_demo(
            turns=6, direct=False, retry_after_s=0.2, stall_s=10, protocol=protocol
        )
        assert default["completed"] == 6 and default["corrupted"] == 0
        assert default["client_errors"] == default["failures_after_commit"] == 1
        assert default["continued"] == 0


def test_the_continue_demo_command(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--protocol", "anthropic", "--after-commit", "continue", "--turns", "6"]
    assert main([*args, "--no-direct"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "6 concurrent agent turns over Anthropic Messages" in out
    assert "continued in place 1 drop(s) after output" in out
    assert "what the client saw clean streams, nothing else" in out
    assert "Client: a Messages client" in out


def test_demo_text_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--turns", "6", "--no-direct"]) == 0
    out = capsys.readouterr().out
    assert "turns completed       6 of 6" in out
    assert "duplicated frames     0" in out
    assert "Straight against the mock" not in out


# -- the samples in docs/ ---------------------------------------------------------------------
DEMO_MARKER = "$ pip install -e . && unbroken demo"
DEMO_DOC = DOCS / "demo.md"


def test_the_demo_sample_is_what_the_demo_prints(
    demo_run: tuple[dict[str, Any], Path],
) -> None:
    summary, _ = demo_run
    sample = block_after(DEMO_DOC, DEMO_MARKER).splitlines()
    # the introduction names the storms, in order
    intro = " ".join(sample[1:4])
    assert ", ".join(s.name for s in storms()) in intro, intro
    # the live table: its columns, and one row per storm kind
    fake_server = SimpleNamespace(relay=SimpleNamespace(inflight=[]))
    run = DemoRun("Through unbroken", _turns(6, storms(), "x"), fake_server)  # type: ignore[arg-type]
    headers = [c.header for c in render_run(run).columns]
    header_line = next(line for line in sample if line.startswith("┃"))
    assert [h.strip() for h in header_line.strip("┃").split("┃")] == headers
    rows = [line for line in sample if line.startswith("│")]
    assert [r.split("│")[2].strip() for r in rows[:6]] == [s.name for s in storms()]
    # the summary: the same lines, labels and wording; the same failure labels
    start = next(i for i, line in enumerate(sample) if line.startswith("Through unbroken ("))
    real = format_summary(summary).splitlines()
    assert len(sample) - start == len(real), "\n".join(real)
    for mine, theirs in zip(sample[start:], real, strict=True):
        if "failures absorbed" in mine:
            assert counted_names(mine) == counted_names(theirs), (mine, theirs)
            mine, theirs = mine.split("(")[0], theirs.split("(")[0]
        assert numbers_out(mine) == numbers_out(theirs), (mine, theirs)


def test_every_number_the_demo_prints_is_explained_in_its_doc(
    demo_run: tuple[dict[str, Any], Path],
) -> None:
    summary, _ = demo_run
    text = DEMO_DOC.read_text()
    explained = text[text.index("What the numbers mean:") :]
    explained = explained[: explained.index("\n## ")]
    labels = {
        m.group(1).strip()
        for m in re.finditer(r"^  ([a-z][a-z .()]+?)  +\S", format_summary(summary), re.M)
    }
    assert labels >= {"turns completed", "wasted tokens (est.)", "duplicated frames"}
    for label in labels:
        assert f"**{label}**" in explained, label
    fake_server = SimpleNamespace(relay=SimpleNamespace(inflight=[]))
    run = DemoRun("x", _turns(1, storms(), "x"), fake_server)  # type: ignore[arg-type]
    for column in render_run(run).columns:
        assert f"`{column.header}`" in explained, column.header


STATS_SAMPLES = [
    (DOCS / "observability.md", "## `unbroken stats [--since 24h] [--json]`"),
]


@pytest.mark.parametrize(("path", "marker"), STATS_SAMPLES, ids=["observability"])
def test_the_stats_samples_are_what_stats_prints_for_a_demo_journal(
    demo_run: tuple[dict[str, Any], Path], path: Path, marker: str
) -> None:
    _, journal = demo_run
    report = compute_stats(sqlite3.connect(journal), since_s=None)
    real = format_stats(report, since="24h", journal=str(journal)).splitlines()
    sample = block_after(path, marker).splitlines()
    for mine, theirs in lines_in_order(sample, real):
        if re.search(r"by cause|causes:", mine):
            assert counted_names(mine) == counted_names(theirs), (mine, theirs)
            continue
        assert numbers_out(mine) == numbers_out(theirs), (mine, theirs)


@pytest.mark.parametrize("width", [80, 100, 160])
@pytest.mark.parametrize("protocol", ["chat", "gemini"])
def test_the_live_table_keeps_each_turn_on_one_line_at_80_columns(
    width: int, protocol: str
) -> None:
    """The live view draws the table for the terminal's width: at 80 columns every
    turn was two or three lines, its states cut to ``retr…`` and ``wait…``."""
    import io
    import time

    from rich.console import Console

    from unbroken.demo import _Absorbed
    from unbroken.observe.hooks import TurnRecord

    kinds = storms(protocol=protocol)
    turns = _turns(len(kinds), kinds, "x")
    inflight = []
    for t in turns:
        t.state = "requesting"
        info = TurnRecord(route="r", path="p", protocol="chat", stream=True)
        info.session_id, info.state, info.attempts = f"demo-session-{t.number}", "waiting", 12
        info.last_failure, info.next_retry_at = "server_disconnected", time.time() + 12.3
        inflight.append(info)
    absorbed = _Absorbed()
    for t in turns:
        absorbed.by_session[f"demo-session-{t.number}"] = 12
    server = SimpleNamespace(relay=SimpleNamespace(inflight=inflight))
    run = DemoRun("Through unbroken", turns, server, absorbed)  # type: ignore[arg-type]
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=True, color_system=None)
    console.print(render_run(run, console.width))
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width
    for t in turns:
        (row,) = [line for line in lines if line.strip(" │").startswith(f"{t.number} ")]
        assert t.storm in row and "requesting" in row and "waiting" in row  # whole
        assert "12" in row.split(t.storm, 1)[1]
