"""Issue 36 item 6: the journal's gaps on a full disk.

A turn whose start row was written before the disk filled used to lose its end
(dropped with the batch): ``unbroken stats`` then counted it as an unfinished turn
forever.  Its end is now kept and written once the journal is writable again, and
that moment is logged once.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest

from observe.test_journal import _rows, _turn
from unbroken.observe.journal import Journal
from unbroken.observe.stats import compute_stats


class _Disk(sqlite3.Connection):
    """A connection whose commits fail while ``full`` is set (a full disk)."""

    full = threading.Event()

    def commit(self) -> None:
        if _Disk.full.is_set():
            raise sqlite3.OperationalError("database or disk is full")
        super().commit()


async def test_a_turn_ended_while_the_disk_was_full_is_not_left_unfinished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    path = tmp_path / "j.sqlite3"
    _Disk.full.clear()
    journal = Journal(path, connect=lambda p: sqlite3.connect(p, factory=_Disk))
    journal.start()
    try:
        turns = [_turn() for _ in range(3)]
        for t in turns:
            journal.turn_started(t)
        await journal.flush()  # the start rows are written
        _Disk.full.set()
        for t in turns:
            t.outcome, t.attempts, t.upstream, t.ended = "ok", 1, "u", t.started + 1
            journal.turn_ended(t)
        late = _turn()
        journal.turn_started(late)  # started and ended while full: dropped whole
        late.outcome, late.ended = "ok", late.started + 1
        journal.turn_ended(late)
        await journal.flush()
        assert journal.healthy is False
        assert not any("writable again" in r.getMessage() for r in caplog.records)
        _Disk.full.clear()
        after = _turn()
        journal.turn_started(after)
        await journal.flush()
        assert journal.healthy is True
    finally:
        _Disk.full.clear()
        await journal.aclose()
    rows = _rows(path, "SELECT turn_id, outcome FROM turns ORDER BY turn_id")
    got = {r["turn_id"]: r["outcome"] for r in rows}
    assert all(got[t.id] == "ok" for t in turns), got  # no phantom unfinished turn
    assert late.id not in got
    conn = sqlite3.connect(path)
    try:
        report = compute_stats(conn, since_s=None)
    finally:
        conn.close()
    assert report["outcomes"]["unfinished"] == 1  # only the one really in flight
    again = [r.getMessage() for r in caplog.records if "writable again" in r.getMessage()]
    assert len(again) == 1, again
    assert "2 rows dropped while it was not, 3 turn ends written late" in again[0]
