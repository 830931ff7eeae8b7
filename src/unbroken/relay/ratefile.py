"""The workers' rate-limit budgets in one SQLite file, without Redis: `FileRates`.

``unbroken serve --workers N`` without Redis shares each provider budget between its
workers as relays share it through Redis (`unbroken.relay.ratestore.RateShare`: each
worker takes leases from the fleet's buckets for the turns in its line, and a
provider's report lowers the fleet's level).  The buckets live in ``rates.sqlite`` in
the supervisor's runtime directory (`unbroken.relay.workers.make_runtime_dir`), one
table of buckets and one of the fleet's line marks (`leasemath.LineMark`, kept where
Redis keeps it in the first bucket's hash)::

    buckets(name, limit, rate, level, t, expires, granted)
                                                    name: <route>|<url>|<cred>:<bucket>
    lines(name, owner, head, until)                 name: the first bucket's

in WAL mode.  A take or a report is one ``BEGIN IMMEDIATE`` transaction (the
workers' writes are serialised by SQLite's lock) that reads the clock inside it
(``time.monotonic()``: ``CLOCK_MONOTONIC``, one clock for every process on the
machine) and runs the arithmetic of `unbroken.core.admission.leasemath`, the same as
Redis's scripts: validation of every bucket against this worker's own view
included.  A row past its ``expires`` is no bucket (as an expired Redis key).

Each worker runs its transactions in one thread of its own, off the event loop,
within the same budget as Redis's (`unbroken.relay.ratestore.BUDGET_S`): slower, or
failing, and the worker paces locally until the next report.  A file that is not a
database (or whose table is not ours) is garbage: logged once a minute, removed (if
it is still the file this worker opened) and made afresh by the next transaction; a
worker whose file was replaced under it opens the new one (each transaction checks
the path's inode), so the workers always meet in one file.  The file goes with the
runtime directory when the supervisor exits (or, after a SIGKILL, when the next one
starts: `unbroken.relay.workers.clean_stale_runtime_dirs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from unbroken.core.admission.leasemath import fleet_learn, fleet_take, read_granted
from unbroken.core.admission.shared import Garbage
from unbroken.observe.sqlite_wal import enter_wal
from unbroken.relay.ratestore import BUDGET_S, TTL_MS

__all__ = ["RATES_FILE", "FileRates", "RatesFileGarbage"]

#: the workers' rate-limit buckets, in the supervisor's runtime directory
RATES_FILE = "rates.sqlite"
TTL_S = TTL_MS / 1000.0
_SCHEMA = (
    'CREATE TABLE IF NOT EXISTS buckets (name TEXT PRIMARY KEY, "limit" REAL, rate REAL,'
    " level REAL, t REAL, expires REAL, granted REAL);"
    " CREATE TABLE IF NOT EXISTS lines (name TEXT PRIMARY KEY, owner TEXT, head REAL,"
    " until REAL)"
)
#: SQLite's primary result codes that mean the file is not ours to use as it is
#: (SQLITE_ERROR: a table that is not ours; SQLITE_CORRUPT, SQLITE_NOTADB,
#: SQLITE_MISMATCH): the file is garbage, and is replaced
_GARBAGE_CODES = frozenset({1, 11, 20, 26})

T = TypeVar("T")


class RatesFileGarbage(Exception):
    """The rate-limit file is not a database of ours (it is removed and made afresh)."""

    why = Garbage.FILE


class FileRates:
    """`RateShare`'s backend for the workers: one SQLite file (see the module docstring)."""

    garbage: tuple[type[BaseException], ...] = (RatesFileGarbage,)

    def __init__(
        self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path)
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unbroken-rates")
        # touched only in the pool's one thread
        self._db: sqlite3.Connection | None = None
        self._ident: tuple[int, int] | None = None
        self._ready = False  # the connection is in WAL mode and the table is there

    # -- RateBackend ---------------------------------------------------------------------
    async def take(
        self,
        names: list[str],
        want: int,
        costs: list[float],
        limits: list[float],
        rates: list[float],
        *,
        me: str = "",
        age: float = 0.0,
        holds: tuple[float, ...] = (),
    ) -> tuple[object, object]:
        def tx(db: sqlite3.Connection, now: float) -> tuple[object, object]:
            found = [self._row(db, n, now) for n in names]
            rows = [row for row, _ in found]
            mark = None
            if me:
                mark = db.execute(
                    "SELECT owner, head, until FROM lines WHERE name = ?", (names[0],)
                ).fetchone()
            got = fleet_take(
                rows, want, costs, limits, rates, now, me=me, age=age, mark=mark, holds=holds
            )
            if got.granted >= 0:
                for name, level, taken, (_, raw) in zip(
                    names, got.levels, got.taken, found, strict=True
                ):
                    total = read_granted(raw)  # (garbage: left as it is, for a report)
                    db.execute(
                        "UPDATE buckets SET level = ?, t = ?, expires = ?, granted = ?"
                        " WHERE name = ?",
                        (level, now, now + TTL_S, raw if total is None else total + taken, name),
                    )
            if got.mark_changed:
                m = got.mark
                if m is None:
                    db.execute("DELETE FROM lines WHERE name = ?", (names[0],))
                else:
                    db.execute(
                        "INSERT OR REPLACE INTO lines (name, owner, head, until)"
                        " VALUES (?, ?, ?, ?)",
                        (names[0], m.owner, m.head, m.until),
                    )
            return got.granted, got.wait_s

        return await self._run(tx)

    async def learn(self, name: str, limit: float, rate: float, value: float) -> tuple[bool, float]:
        def tx(db: sqlite3.Connection, now: float) -> tuple[bool, float]:
            db.execute("DELETE FROM buckets WHERE expires <= ?", (now,))
            row, raw = self._row(db, name, now)
            b, replaced = fleet_learn(row, limit, rate, value, now)
            granted = read_granted(raw) if row is not None and not replaced else 0.0
            if granted is None:  # garbage: replaced, counted afresh
                granted, replaced = 0.0, True
            db.execute(
                'INSERT OR REPLACE INTO buckets (name, "limit", rate, level, t, expires,'
                " granted) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, b.limit, b.rate, b.level, b.t, now + TTL_S, granted),
            )
            return replaced, granted

        return await self._run(tx)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # shut down already
            self._pool.submit(self._drop)
        self._pool.shutdown(wait=False)

    # -- in the pool's thread -------------------------------------------------------------
    async def _run(self, tx: Callable[[sqlite3.Connection, float], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._transaction, tx)

    def _transaction(self, tx: Callable[[sqlite3.Connection, float], T]) -> T:
        try:
            db = self._connect()
            db.execute("BEGIN IMMEDIATE")
            try:
                out = tx(db, self.clock())  # the clock, read inside the transaction
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise
            return out
        except sqlite3.DatabaseError as exc:
            if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) not in _GARBAGE_CODES:
                raise  # busy past the budget, a full disk, a directory gone: an error
            self._replace()
            raise RatesFileGarbage(f"{type(exc).__name__}: {exc}") from None

    @staticmethod
    def _row(
        db: sqlite3.Connection, name: str, now: float
    ) -> tuple[Sequence[object] | None, object]:
        """A bucket's stored ``(limit, rate, level, t)`` and its total granted, as they
        are (to be validated): ``(None, None)`` when there is none (or it has expired: it
        is deleted)."""
        row = db.execute(
            'SELECT "limit", rate, level, t, expires, granted FROM buckets WHERE name = ?',
            (name,),
        ).fetchone()
        if row is None:
            return None, None
        expires = row[4]
        if isinstance(expires, int | float) and expires <= now:
            db.execute("DELETE FROM buckets WHERE name = ?", (name,))
            return None, None
        return tuple(row[:4]), row[5]

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _connect(self) -> sqlite3.Connection:
        """This worker's connection to the file at ``path`` now (a file replaced under
        it, or removed, is opened again)."""
        if self._db is not None and self._ready and self._stat() == self._ident:
            return self._db
        self._drop()
        db = sqlite3.connect(
            self.path, timeout=BUDGET_S, isolation_level=None, check_same_thread=False
        )
        self._db, self._ident = db, self._stat()
        enter_wal(db, budget_s=BUDGET_S)  # the workers start together
        db.execute("PRAGMA synchronous=OFF")  # the budgets outlive no reboot anyway
        db.executescript(_SCHEMA)
        self._ready = True
        return db

    def _drop(self) -> None:
        db, self._db, self._ident, self._ready = self._db, None, None, False
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()

    def _replace(self) -> None:
        """The file is garbage: remove it, if it is still the one this worker opened (or
        it could not be opened at all), and start afresh with the next transaction."""
        ident = self._ident
        self._drop()
        if ident is None or self._stat() == ident:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.path}{suffix}")
