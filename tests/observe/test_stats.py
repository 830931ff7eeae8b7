"""`unbroken stats` over a seeded journal: every number checked by hand."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from unbroken.cli import main
from unbroken.observe.journal import SCHEMA, Journal
from unbroken.observe.stats import compute_stats, format_stats, parse_since, percentile

A, B = "http://a.test", "http://b.test"

# (turn, outcome, started hours ago, first_byte_s, attempts: (upstream, reason, phase, status,
#  est_output_tokens, wait_s, input_tokens, output_tokens))
SEED: list[tuple[str, str | None, float, float | None, list[tuple[Any, ...]]]] = [
    ("t1", "ok", 1, 0.5, [(A, "ok", None, 200, 5, None, 10, 5)]),
    ("t2", "ok", 2, 0.7, [(A, "ok", None, 200, 5, None, 10, 5)]),
    (
        "t3",
        "recovered",
        3,
        1.2,
        [
            (A, "503", "headers", 503, 0, 0.25, None, None),
            (B, "connection_reset", "pending", 200, 7, 0.25, None, None),
            (A, "ok", None, 200, 6, None, 12, 6),
        ],
    ),
    (
        "t4",
        "recovered",
        4,
        2.0,
        [
            (A, "stall", "stall", 200, 3, 1.0, None, None),
            (A, "ok", None, 200, 6, None, 12, 6),
        ],
    ),
    (
        "t5",
        "ended_with_error",
        5,
        0.3,
        [(A, "connection_reset", "committed", 200, 20, None, None, None)],
    ),
    (
        "t6",
        "passed_through_error",
        6,
        0.1,
        [(A, "passed_through_error", "committed", 400, 0, None, None, None)],
    ),
    (
        "t7",
        "aborted_by_client",
        7,
        None,
        [
            (A, "503", "headers", 503, 0, 0.25, None, None),
            (A, "aborted_by_client", "committed", None, 0, None, None, None),
        ],
    ),
    (
        "t8",
        "passed_through_error",
        8,
        0.9,
        [
            (A, "503", "headers", 503, 0, 0.25, None, None),
            (A, "503", "headers", 503, 0, 0.25, None, None),
            (A, "503", "headers", 503, 0, None, None, None),
        ],
    ),
    ("t9", None, 0.01, None, []),  # in flight (or the relay died)
    (
        "t11",
        "ended_with_error",
        9,
        0.4,
        [
            (A, "payload_error", "pending", 200, 5, 0.25, None, None),
            (A, "stall", "committed", 200, 9, None, None, None),
        ],
    ),
    (
        "t10",
        "recovered",
        48,
        0.8,
        [  # outside the last 24 h
            (A, "503", "headers", 503, 0, 0.25, None, None),
            (A, "ok", None, 200, 5, None, 10, 5),
        ],
    ),
]


def seed(path: Path, now: float, rows: list[tuple[Any, ...]] = SEED) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    for n, (uid, outcome, hours, ttfb, attempts) in enumerate(rows, 1):
        started = now - hours * 3600
        wait = sum(a[5] or 0 for a in attempts)
        conn.execute(
            "INSERT INTO turns (uid, run, turn_id, route, path, protocol, stream, started, ended,"
            " outcome, attempts, upstream, first_byte_s, wait_s)"
            " VALUES (?, 'run', ?, 'r', 'v1/chat/completions', 'chat', 1, ?, ?, ?, ?, ?, ?, ?)",
            (
                uid,
                n,
                started,
                None if outcome is None else started + 3,
                outcome,
                len(attempts),
                attempts[-1][0] if attempts else None,
                ttfb,
                wait,
            ),
        )
        for i, (up, reason, phase, status, est, wait_s, t_in, t_out) in enumerate(attempts, 1):
            conn.execute(
                "INSERT INTO attempts (turn_uid, number, upstream, started, ended, status, reason,"
                " phase, est_output_tokens, wait_s, input_tokens, output_tokens)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (uid, i, up, started, started + 1, status, reason, phase, est, wait_s, t_in, t_out),
            )
    conn.commit()
    conn.close()


@pytest.fixture
def journal(tmp_path: Path) -> tuple[Path, float]:
    path = tmp_path / "journal.sqlite3"
    now = time.time()
    seed(path, now)
    return path, now


def test_stats_over_the_last_24h(journal: tuple[Path, float]) -> None:
    path, now = journal
    s = compute_stats(sqlite3.connect(path), since_s=86400, now=now)
    assert s["turns"] == 10
    assert s["outcomes"] == {
        "ok": 2,
        "recovered": 2,
        "ended_with_error": 2,
        "passed_through_error": 2,
        "aborted_by_client": 1,
        "resumed": 0,
        "unfinished": 1,
    }
    # turns that hit a failure and were not aborted: t3 t4 t5 t8 t11; recovered: t3 t4
    assert s["turns_with_failures"] == 5
    assert s["recovery_rate"] == 0.4
    assert s["attempts"] == 16
    assert s["failures"] == 10
    assert s["failures_by_phase"] == {"headers": 5, "pending": 2, "committed": 2, "stall": 1}
    assert s["failures_by_cause"] == {
        "503": 5,
        "connection_reset": 2,
        "stall": 2,
        "payload_error": 1,
    }
    assert s["failures_by_upstream"] == {A: 9, B: 1}
    assert s["retries_per_turn"] == {"p50": 1, "p99": 2, "max": 2}
    assert s["waiting_s"] == {"total": 2.5, "p50": 0.25, "p99": 1.0, "max": 1.0}
    assert s["time_to_first_byte_s"] == {"p50": 0.5, "p99": 2.0, "max": 2.0}
    assert s["wasted_tokens_est"] == 15  # 7 + 3 + 5; the committed attempt's 20 is not a replay's
    assert s["tokens"] == {"input": 44, "output": 22}
    before = s["replay_safety"]["before_commit"]
    assert before == {
        "failures": 8,
        "turns": 5,
        "recovered": 2,
        "ended": {
            "recovered": 2,
            "aborted_by_client": 1,
            "passed_through_error": 1,
            "ended_with_error": 1,
        },
    }
    after = s["replay_safety"]["after_commit"]
    assert after == {
        "failures": 2,
        "turns": 2,
        "ended": {"ended_with_error": 2},
        "by_cause": {"connection_reset": 1, "stall": 1},
    }


def test_stats_window(journal: tuple[Path, float]) -> None:
    path, now = journal
    conn = sqlite3.connect(path)
    everything = compute_stats(conn, since_s=None, now=now)
    assert everything["turns"] == 11
    assert everything["outcomes"]["recovered"] == 3
    assert everything["recovery_rate"] == 0.5
    recent = compute_stats(conn, since_s=3600 * 2.5, now=now)  # t9, t1, t2
    assert recent["turns"] == 3 and recent["recovery_rate"] is None
    assert recent["failures_by_phase"] == {}


def test_empty_journal(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "j.sqlite3")
    conn.executescript(SCHEMA)
    s = compute_stats(conn)
    assert s["turns"] == 0 and s["recovery_rate"] is None
    assert s["retries_per_turn"] == {"p50": None, "p99": None, "max": None}
    assert "no turn hit a failure" in format_stats(s)


def test_stats_json_command(
    journal: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = journal
    assert main(["stats", "--journal", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("turns", "outcomes", "failures_by_phase", "recovery_rate"):
        assert key in out
    assert out["turns"] == 10 and out["recovery_rate"] == 0.4
    assert main(["stats", "--journal", str(path), "--json", "--since", "all"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"] == 11


def test_stats_text_command(
    journal: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = journal
    assert main(["stats", "--journal", str(path), "--since", "24h"]) == 0
    out = capsys.readouterr().out
    assert "last 24h" in out
    assert "Recovery rate" in out and "40.0%" in out
    assert "by phase      headers 5, pending 2, committed 2, stall 1" in out
    assert "Retries per turn          p50 1  p99 2  max 2" in out
    assert "Wasted tokens (est.)" in out and "15" in out
    assert "before commit   8 failures in 5 turns: 2 recovered invisibly" in out
    assert (
        "after commit    2 failures in 2 turns (never replayed); ended: ended_with_error 2" in out
    )


def test_stats_finds_the_journal_through_the_config(
    journal: tuple[Path, float],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = journal
    conf = tmp_path / "u.toml"
    conf.write_text(f"[journal]\npath = {json.dumps(str(path))}\n")
    assert main(["stats", "--config", str(conf), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"] == 10
    # a journal named, and not there: bad command-line input, one line and exit 2 (it
    # was 1, issue 35)
    for missing in (tmp_path / "none.sqlite3", Path("/nonexistent"), tmp_path):
        assert main(["stats", "--journal", str(missing)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"unbroken stats: no journal at {missing}\n"
        assert captured.out == ""


def test_stats_before_the_first_turn_says_there_are_none_yet_and_where_they_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`unbroken serve` writes its journal from its first turn: before that, stats said
    "no journal" (exit 1) as if the relay were not running or not journaling."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("UNBROKEN_CONFIG", raising=False)
    assert main(["stats"]) == 0
    out = capsys.readouterr().out
    assert "no turns yet" in out and str(tmp_path / "unbroken" / "journal.sqlite3") in out
    assert main(["stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"] == 0
    assert main(["stats", "--json", "--by", "session"]) == 0
    assert json.loads(capsys.readouterr().out) == {"sessions": []}
    conf = tmp_path / "off.toml"
    conf.write_text("[journal]\nenabled = false\n")
    assert main(["stats", "--config", str(conf)]) == 1
    assert "the journal is off" in capsys.readouterr().err


def test_since_takes_a_minus_sign_and_its_error_says_what_it_takes(
    journal: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = journal
    assert main(["stats", "--journal", str(path), "--since", "5h", "--json"]) == 0
    five = json.loads(capsys.readouterr().out)
    assert main(["stats", "--journal", str(path), "--since", "-5h", "--json"]) == 0
    minus = json.loads(capsys.readouterr().out)  # argparse took -5h for an option
    assert minus["turns"] == five["turns"] > 0
    assert main(["stats", "--journal", str(path), "--since=-5h", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["turns"] == five["turns"]
    assert main(["stats", "--since", "yesterday"]) == 2
    err = capsys.readouterr().err
    assert "'yesterday'" in err and "s, m, h, d or w" in err and "or all" in err
    assert err.count("\n") == 1  # one line


def test_parse_since_and_percentile() -> None:
    assert parse_since("90s") == 90 and parse_since("30m") == 1800
    assert parse_since("24h") == 86400 and parse_since("7d") == 7 * 86400
    assert parse_since("2w") == 14 * 86400 and parse_since("15") == 15
    assert parse_since("all") is None
    assert parse_since("-1h") == 3600 and parse_since("- 2d") == 2 * 86400
    for bad in ("h", "1x", "--1h", "1h2m", ""):
        with pytest.raises(ValueError):
            parse_since(bad)
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100


async def test_time_waiting_is_the_time_really_waited_never_more_than_the_turn_s_age(
    tmp_path: Path,
) -> None:
    """A client that goes away 2 s into a 30 s retry wait: the turn waited 2 s, and
    the journal, `unbroken stats` and /status say 2 s (they said 30 s: the wait as
    scheduled, longer than the turn itself)."""
    from unbroken.core.admission.policy import Failure, FailureClass
    from unbroken.core.turn.machine import Outcome, Phase
    from unbroken.observe.hooks import MultiHooks, TurnRecord
    from unbroken.observe.journal import Journal
    from unbroken.observe.report import HooksObserver
    from unbroken.observe.status import StatusTracker

    clock = [time.time()]  # (the journal prunes what is older than its retention)
    journal = Journal(tmp_path / "j.sqlite3")
    status = StatusTracker()
    journal.start()
    try:
        info = TurnRecord(route="r", path="v1/chat/completions", protocol="chat", stream=True)
        info.started = clock[0]
        report = HooksObserver(
            info, MultiHooks(journal, status), ["u"], set(), wall=lambda: clock[0]
        )
        report.open()
        report.attempt_started(1, 0)
        clock[0] += 0.5
        report.attempt_ended("503", Phase.HEADERS, 503, None)
        report.attempt_failed(Failure(FailureClass.STATUS, "503", 503), Phase.HEADERS, 30.0)
        clock[0] += 2.0  # the client goes away during the wait
        report.close(Outcome.ABORTED_BY_CLIENT)
        await journal.flush()
    finally:
        await journal.aclose()
    assert status.retry_wait_s == 2.0
    conn = sqlite3.connect(tmp_path / "j.sqlite3")
    try:
        (wait_s, age) = conn.execute("SELECT wait_s, ended - started FROM turns").fetchone()
        report_ = compute_stats(conn, since_s=None)
    finally:
        conn.close()
    assert wait_s == 2.0 and wait_s <= age
    assert report_["waiting_s"]["total"] == 2.0
    assert info.waited_s == 2.0


def test_a_version_4_journal_gains_the_continuation_columns_and_stats_show_them(
    tmp_path: Path,
) -> None:
    """Journal schema 5 (issue 23): turns.splices and turns.saved_tokens.  A journal
    written before them is migrated when opened; stats count turns finished in place."""
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    lines = SCHEMA.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("queued_s"))
    lines[at] = "    queued_s REAL NOT NULL DEFAULT 0"
    old = "\n".join(
        ln
        for ln in lines
        if not ln.lstrip().startswith(("splices", "saved_tokens", "continuation"))
    )
    assert "splices" not in old
    conn.executescript(old)
    conn.execute("PRAGMA user_version=4")
    conn.commit()
    conn.close()
    Journal(path)._open().close()  # opening migrates (the writer thread opens it)
    conn = sqlite3.connect(path)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    assert {"splices", "saved_tokens"} <= columns
    now = time.time()
    conn.execute(
        "INSERT INTO turns (uid, run, turn_id, route, path, protocol, stream, started, ended,"
        " outcome, attempts, splices, saved_tokens)"
        " VALUES ('r:1', 'r', 1, 'r', 'v1/responses', 'responses', 1, ?, ?, 'resumed', 3, 2, 40)",
        (now - 10, now - 5),
    )
    conn.commit()
    s = compute_stats(conn, since_s=3600, now=now)
    assert s["outcomes"]["resumed"] == 1
    assert s["continued"] == {"turns": 1, "splices": 2, "saved_tokens_est": 40}
    assert "Finished in place" in format_stats(s)
    conn.close()


def test_a_turn_finished_in_place_counts_as_recovered(tmp_path: Path) -> None:
    """A turn cut after commit and finished in place (outcome ``resumed``) hit failures
    and the client got the whole answer: the recovery rate counts it.  (It counted only
    ``recovered``: a run whose every cut turn was resumed showed 0.0 %.)"""
    cut = (A, "server_disconnected", "committed", 200, 2, 0.25, None, None)
    rows = [
        ("r1", "resumed", 1, 0.2, [cut, cut, (A, "ok", None, 200, 6, None, 10, 6)]),
        ("r2", "ended_with_error", 2, 0.3, [cut]),
        ("r3", "recovered", 3, 0.3, [(A, "503", "headers", 503, 0, 0.25, None, None)]),
    ]
    path = tmp_path / "j.sqlite3"
    now = time.time()
    seed(path, now, rows)
    conn = sqlite3.connect(path)
    s = compute_stats(conn, since_s=None, now=now)
    conn.close()
    assert (s["turns_with_failures"], s["turns_recovered"]) == (3, 2)
    assert s["recovery_rate"] == 0.6667
    out = format_stats(s)
    assert "66.7%  (2 of 3 turns that hit a failure ended recovered or resumed)" in out
