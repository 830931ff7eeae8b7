"""`unbroken demo`: the real command, a faster storm whose journal `stats` reads, and the
samples of both in docs/, checked against a real run."""

from __future__ import annotations

import asyncio
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
    assert summary["client_gave_up"] == 0
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


@pytest.fixture(scope="module")
def gemini_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One real `unbroken demo --protocol gemini --json --journal FILE`, with the CLI's
    defaults: its summary and its journal."""
    journal = tmp_path_factory.mktemp("gemini") / "journal.sqlite3"
    command = ["demo", "--protocol", "gemini", "--json", "--journal", str(journal)]
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", *command],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary, journal


def test_the_gemini_storm_through_the_relay_and_without_it(
    gemini_run: tuple[dict[str, Any], Path],
) -> None:
    """`--protocol gemini` with the CLI's defaults: the same agent turns over the Gemini
    API, each under one of the Gemini API's storms; through the relay every one
    completes, straight at the mock a third are lost.  Every fault is accounted for:
    absorbed, or a drop after output (issue 35: a turn parked behind the 429s for 3 s,
    then stalled, got no headers for 5 s and its client gave up before the relay's stall
    timer fired: 24 faults = 21 absorbed + 2 drops, the third error `aborted_by_client`)."""
    summary, path = gemini_run
    assert summary["protocol"] == "gemini" and summary["turns"] == 12
    assert summary["completed"] == 12 and summary["lost"] == 0
    assert summary["duplicates"] == 0 and summary["corrupted"] == 0
    assert summary["faults_injected"] == 2 * sum(s.faults for s in storms(protocol="gemini"))
    assert summary["faults_injected"] == 24
    # (a slow machine may add a stall)
    assert summary["failures_absorbed"] + summary["failures_after_commit"] >= 24
    # the in-stream RPC error before output is replayed like a reset, and both stalls
    # were the relay's to absorb
    absorbed = summary["absorbed_by_reason"]
    assert {k: absorbed[k] for k in ("503", "server_disconnected", "429", "stream_error")} == {
        "503": 12,
        "server_disconnected": 4,
        "429": 2,
        "stream_error": 2,
    }
    assert absorbed["stall"] >= 2
    # the drops after output reached the client (as the native error event), nothing else
    assert summary["failures_after_commit"] == summary["client_errors"] == 2
    assert summary["client_gave_up"] == 0
    # straight at the mock: the 503 bursts and the resets lose their turns
    assert (summary["direct_completed"], summary["direct_lost"]) == (8, 4)
    assert summary["direct_client_errors"] == 16 and summary["direct_duplicates"] == 0

    db = sqlite3.connect(path)
    turns = db.execute("SELECT protocol, client, stream, outcome FROM turns").fetchall()
    assert len(turns) == 26  # 12 x 2 steps, plus the steps retried after the drops
    assert {t[:3] for t in turns} == {("gemini", "unknown", 1)}
    assert Counter(t[3] for t in turns) == {"ok": 14, "recovered": 10, "ended_with_error": 2}
    gave_up = "SELECT count(*) FROM attempts WHERE reason = 'aborted_by_client'"
    assert db.execute(gave_up).fetchone() == (0,)
    # the 429s' RetryInfo.retryDelay (1 s) was obeyed, not the demo's 200 ms delay
    waits = db.execute("SELECT wait_s FROM attempts WHERE status = 429").fetchall()
    assert len(waits) == 2 and min(w for (w,) in waits) >= 1.0


def test_gemini_refuses_after_commit_continue(capsys: pytest.CaptureFixture[str]) -> None:
    """The Gemini API has no continuation: ``--after-commit continue`` with it did nothing
    (issue 35); now it is one line and exit 2, before anything starts."""
    args = ["demo", "--protocol", "gemini", "--after-commit", "continue"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Gemini API has no way to continue" in err
    with pytest.raises(ValueError, match="needs --protocol chat or anthropic"):
        asyncio.run(run_demo(turns=1, direct=False, protocol="gemini", after_commit="continue"))


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


@pytest.mark.parametrize("protocol", ["chat", "gemini"])
def test_at_80_columns_the_live_tables_headers_are_whole(protocol: str) -> None:
    """Issue 35: at 80 columns the compact columns added up to 83, so rich squeezed the
    last ones and the header read ``abs e…``; now every header is whole with the
    widest values in every column."""
    import io
    import time

    from rich.console import Console

    from unbroken.demo import _COMPACT, _Absorbed
    from unbroken.observe.hooks import TurnRecord

    kinds = storms(protocol=protocol)
    turns = _turns(len(kinds), kinds, "x")
    inflight = []
    for t in turns:
        t.state, t.step, t.errors = "requesting", 1, 12  # the widest client state and step
        info = TurnRecord(route="r", path="p", protocol="chat", stream=True)
        info.session_id, info.state, info.attempts = f"demo-session-{t.number}", "waiting", 123
        info.last_failure, info.next_retry_at = "server_disconnected", time.time() + 123.4
        inflight.append(info)
    absorbed = _Absorbed()
    for t in turns:
        absorbed.by_session[f"demo-session-{t.number}"] = 123
    server = SimpleNamespace(relay=SimpleNamespace(inflight=inflight))
    run = DemoRun("Through unbroken", turns, server, absorbed)  # type: ignore[arg-type]
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    console.print(render_run(run, console.width))
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    (header,) = [line for line in lines if line.split()[:1] == ["#"]]
    assert header.split() == [h for h, _ in _COMPACT.values()]
    assert "…" not in header
    for t in turns:
        (row,) = [line for line in lines if line.split()[:1] == [str(t.number)]]
        assert "answer" in row and "requesting" in row and "waiting" in row
        assert row.split()[-3:] == ["123s", "123", "12"]  # next try, absorbed, errors


@pytest.mark.parametrize("protocol", ["chat", "gemini", "anthropic"])
def test_at_80_columns_the_summary_breaks_only_between_words(protocol: str) -> None:
    """Issue 35: the summary was printed unwrapped (soft_wrap), with lines of 81 to 92
    columns, so an 80-column terminal broke them mid-word (``stream_err`` / ``or``)."""
    import io

    from rich.console import Console

    summary: dict[str, Any] = {
        "protocol": protocol,
        "turns": 12,
        "completed": 12,
        "faults_injected": 24,
        "failures_absorbed": 21,
        "absorbed_by_reason": {
            "503": 12,
            "server_disconnected": 4,
            "429": 2,
            "stream_error": 2,
            "stall": 1,
        },
        "continued": 1,
        "client_errors": 3,
        "failures_after_commit": 2,
        "client_gave_up": 1,
        "duplicates": 0,
        "wasted_tokens_est": 0,
        "seconds": 5.0,
        "direct_completed": 8,
        "direct_lost": 4,
        "direct_client_errors": 16,
        "direct_seconds": 5.0,
    }
    wide = format_summary(summary, width=10_000)
    buf = io.StringIO()
    console = Console(file=buf, width=80, force_terminal=True, color_system=None)
    console.print(format_summary(summary, console.width), highlight=False, soft_wrap=True)
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert buf.getvalue().split() == wide.split()  # the same words, none cut
    # a value that goes on is under its first line's value; a count stays with its name
    assert "                        stream_error ×2, stall ×1)" in lines
    assert "client gave up        1 attempt(s)" in buf.getvalue()


def test_every_relay_state_is_explained_in_the_demo_doc() -> None:
    """The live table's relay column shows `/status`'s turn states; ``parked`` was
    missing from docs/demo.md (issue 35)."""
    from unbroken.core.turn.turn_types import TurnState
    from unbroken.demo import DEMO_STATE_STYLE

    text = DEMO_DOC.read_text()
    explained = text[text.index("What the numbers mean:") :]
    for state in TurnState:
        if state is TurnState.DONE:  # a done turn is no longer in flight
            continue
        assert f"`{state.value}`" in explained, state
        assert state.value in DEMO_STATE_STYLE, state
