"""Put a SQLite connection in WAL mode when other processes may be doing the same.

``PRAGMA journal_mode=WAL`` on a file that another connection is opening (the
workers of ``serve --workers 2`` write one journal and one ``rates.sqlite``, and
they start together) can fail at once with "database is locked": SQLite does
not call the busy handler for it, so the connection's timeout does not help.
Measured: 200 pairs of threads opening a fresh journal at the same instant, 57 of
the 400 opens failed (two processes: 94 of 400); the journal dropped that worker's
first batch of rows.  `enter_wal` retries the pragma, briefly, until ``budget_s``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

__all__ = ["enter_wal"]

_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (primary codes)


def _is_busy(exc: sqlite3.Error) -> bool:
    """The error is another connection holding the lock (worth trying again)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in _BUSY_CODES
    return "locked" in str(exc) or "busy" in str(exc)


def enter_wal(
    conn: sqlite3.Connection,
    *,
    budget_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """``PRAGMA journal_mode=WAL``, tried again while the file is locked by another
    connection, for up to ``budget_s``; past it (or on any other error) it raises.
    Blocking: call it off the event loop (a writer thread, an executor)."""
    deadline = clock() + budget_s
    pause = 0.002
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or clock() >= deadline:
                raise
        sleep(pause)
        pause = min(0.05, pause * 2)
