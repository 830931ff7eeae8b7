"""Workers open one SQLite file at once (`unbroken.observe.sqlite_wal`).

The CI run of stop 39 failed on it: with ``serve --workers 2`` both workers' journals
opened the fresh journal file together at their first write; ``PRAGMA
journal_mode=WAL`` failed at once with "database is locked" in one of them (SQLite
calls no busy handler for it), and that worker's first batch of rows was dropped:
three of six turns cut by a second SIGTERM had no row at all.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from observe.test_journal import _rows, _turn
from unbroken.observe.journal import Journal
from unbroken.observe.sqlite_wal import enter_wal
from unbroken.relay.ratefile import FileRates

ROUNDS = 25  # 57 opens of 400 (200 pairs) lost the race on the old code


def _locked(path: Path) -> sqlite3.Connection:
    """Another connection holding the file's write lock (a rollback-journal file)."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE IF NOT EXISTS t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def test_a_lock_held_by_another_connection_is_waited_out(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    holder = _locked(path)
    conn = sqlite3.connect(path, timeout=0.0)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        conn.execute("PRAGMA journal_mode=WAL")
    pauses: list[float] = []

    def sleep(s: float) -> None:  # the other connection lets go while we wait
        pauses.append(s)
        if len(pauses) == 3:
            holder.execute("COMMIT")

    enter_wal(conn, sleep=sleep)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert len(pauses) == 3 and pauses == sorted(pauses)
    conn.close()
    holder.close()


def test_past_its_budget_or_on_another_error_it_raises(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    holder = _locked(path)
    conn = sqlite3.connect(path, timeout=0.0)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(sqlite3.OperationalError, match="locked"):
        enter_wal(conn, budget_s=1.0, clock=lambda: now[0], sleep=sleep)
    assert 1.0 <= now[0] < 1.1  # it tried until the budget, no longer
    holder.execute("COMMIT")
    holder.close()
    conn.close()
    with pytest.raises(sqlite3.ProgrammingError):  # not a lock: at once
        enter_wal(conn, sleep=lambda s: pytest.fail("slept on a closed connection"))


async def test_two_journals_opening_one_fresh_file_at_once_keep_every_row(
    tmp_path: Path,
) -> None:
    for i in range(ROUNDS):
        path = tmp_path / f"j{i}.sqlite3"
        both = threading.Barrier(2)

        def connect(p: str, both: threading.Barrier = both) -> sqlite3.Connection:
            both.wait(5)  # the two writers' first batches open the file together
            return sqlite3.connect(p, timeout=5.0)

        journals = [Journal(path, connect=connect) for _ in range(2)]
        turns = [_turn() for _ in journals]
        for journal, turn in zip(journals, turns, strict=True):
            journal.start()
            journal.turn_started(turn)
            turn.outcome, turn.attempts, turn.ended = "ok", 1, turn.started + 1
            journal.turn_ended(turn)
        await asyncio.gather(*(j.flush() for j in journals))
        for journal in journals:
            await journal.aclose()
        assert [j.dropped for j in journals] == [0, 0], [j.last_error for j in journals]
        rows = _rows(path, "SELECT run, outcome FROM turns")
        assert sorted(r["run"] for r in rows) == sorted(j.run for j in journals)
        assert all(r["outcome"] == "ok" for r in rows)


async def test_two_workers_opening_a_fresh_rates_file_at_once_both_learn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connect = sqlite3.connect
    for i in range(ROUNDS):
        path = tmp_path / f"rates{i}.sqlite"
        both = threading.Barrier(2)

        def together(*args: Any, both: threading.Barrier = both, **kw: Any) -> sqlite3.Connection:
            both.wait(5)  # the two workers' first transactions open the file together
            conn: sqlite3.Connection = connect(*args, **kw)
            return conn

        monkeypatch.setattr(sqlite3, "connect", together)
        files = [FileRates(path) for _ in range(2)]
        try:
            got = await asyncio.gather(
                *(f.learn(f"k{n}|c:requests", 300.0, 5.0, 299.0) for n, f in enumerate(files)),
                return_exceptions=True,
            )
        finally:
            for f in files:
                f.close()
        assert not [g for g in got if isinstance(g, BaseException)], got
