"""The turn journal: one SQLite row per turn and per attempt, written off the event loop.

A `Hooks` observer.  On the event loop it only copies structural facts (ids,
route, upstream, status, phase, counters, token counts; never a header value
other than the client's session id, never a key, never content) into a queue.
A writer thread drains the queue in batches, one transaction per batch, in WAL
mode.  A turn row is written when the turn starts and completed when it ends,
so a crash leaves the turns that were in flight with ``outcome`` NULL and
loses at most the last batch window (a quarter second) of rows.

A journal that cannot be written (read-only directory, disk full, corrupt
file) logs a warning (at most once a minute), drops those rows and tries again
with the next batch: the relay never waits for it and never fails because of it.
The ends of turns whose start row is already written are kept (up to
`MAX_OWED_ENDS`) and written when the journal is writable again, so a full disk
leaves no phantom "unfinished" turn; that moment is logged once, with what was
dropped meanwhile.

See docs/observability.md for the schema.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import math
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from unbroken.core.admission.policy import Failure
from unbroken.core.admission.shared import LOG_EVERY_S
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord
from unbroken.observe.sqlite_wal import enter_wal

__all__ = ["SCHEMA", "SCHEMA_VERSION", "Journal", "default_journal_path", "journal_path"]

log = logging.getLogger("unbroken")

#: 2: turns.client; 3: attempts.choice, upstream_events; 4: turns.queued_s;
#: 5: turns.splices, turns.saved_tokens (continuations, issue 23); 6: turns.continuation
SCHEMA_VERSION = 6
SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    uid          TEXT PRIMARY KEY,   -- '<run>:<turn id>'
    run          TEXT NOT NULL,      -- one per relay start
    turn_id      INTEGER NOT NULL,   -- the relay's turn number (as in /status and logs)
    route        TEXT NOT NULL,
    path         TEXT NOT NULL,      -- upstream path after the route, no query string
    protocol     TEXT NOT NULL,      -- chat | responses | anthropic | ... | other
    stream       INTEGER NOT NULL,   -- 1 when the client asked for a stream
    session_id   TEXT,               -- x-session-id, x-session-affinity, session-id,
                                     -- x-claude-code-session-id or prompt_cache_key
    client       TEXT,               -- the client profile: codex | claude-code | ...
    started      REAL NOT NULL,      -- unix time
    ended        REAL,
    outcome      TEXT,               -- ok | recovered | ended_with_error |
                                     -- passed_through_error | aborted_by_client |
                                     -- resumed (finished in place after a cut);
                                     -- NULL: in flight, or the relay stopped hard
    attempts     INTEGER NOT NULL DEFAULT 0,
    upstream     TEXT,               -- of the last attempt
    last_failure TEXT,               -- label of the last failed attempt
    first_byte_s REAL,               -- start to the first byte sent to the client
    wait_s       REAL NOT NULL DEFAULT 0, -- total time really waited between attempts
    queued_s     REAL NOT NULL DEFAULT 0, -- time waited at the relay for the rate limit
    splices      INTEGER NOT NULL DEFAULT 0, -- continuations after cuts (outcome resumed)
    saved_tokens INTEGER NOT NULL DEFAULT 0, -- output frames (~ tokens) a redo would resample
    continuation TEXT                -- continue mode's last word on the turn: spliced, or
                                     -- refused_<reason> (thinking_enabled, tool_call, ...);
                                     -- NULL: continue mode off, or nothing to say
);
CREATE INDEX IF NOT EXISTS turns_started ON turns (started);
CREATE TABLE IF NOT EXISTS attempts (
    turn_uid          TEXT NOT NULL,
    number            INTEGER NOT NULL,  -- 1, 2, ...
    upstream          TEXT NOT NULL,     -- base URL (never carries credentials)
    started           REAL NOT NULL,
    ended             REAL,
    status            INTEGER,           -- upstream HTTP status, when one arrived
    reason            TEXT NOT NULL,     -- ok, or the failure: 503, connection_reset, stall,
                                         -- ..., passed_through_error, aborted_by_client
    phase             TEXT,              -- failures: connect | headers | pending |
                                         -- committed | stall
    frames_received   INTEGER NOT NULL DEFAULT 0,
    bytes_received    INTEGER NOT NULL DEFAULT 0,
    frames_released   INTEGER NOT NULL DEFAULT 0,
    bytes_released    INTEGER NOT NULL DEFAULT 0,
    hold_s            REAL NOT NULL DEFAULT 0,  -- time frames were held
    input_tokens      INTEGER,           -- as reported by the provider
    output_tokens     INTEGER,
    est_output_tokens INTEGER NOT NULL DEFAULT 0,  -- output frames generated (~ tokens)
    wait_s            REAL,              -- wait planned before the next attempt, if any
    choice            TEXT,              -- how the upstream was chosen: first | sticky |
                                         -- rotated | breaker_skip | parked
    PRIMARY KEY (turn_uid, number)
);
CREATE TABLE IF NOT EXISTS upstream_events (
    at       REAL NOT NULL,              -- unix time
    run      TEXT NOT NULL,
    route    TEXT NOT NULL,
    upstream TEXT NOT NULL,
    kind     TEXT NOT NULL,              -- breaker transition: open | half_open | close
    reason   TEXT,                       -- why it opened (the failure that did it)
    ttl_s    REAL,                       -- how long it stays open
    remote   INTEGER NOT NULL DEFAULT 0  -- 1: learned from another instance
);
CREATE INDEX IF NOT EXISTS upstream_events_at ON upstream_events (at);
"""

#: inserts: the statement up to VALUES, and the row's placeholders (several rows go
#: into one statement: SQLite then runs once per statement, not once per row, and the
#: writer thread gives the GIL back once per statement, not once per row)
_INSERT: dict[str, tuple[str, str]] = {
    "turn": (
        "INSERT OR REPLACE INTO turns (uid, run, turn_id, route, path, protocol, stream,"
        " session_id, client, started, ended, outcome, attempts, upstream, last_failure,"
        " first_byte_s, wait_s, queued_s, splices, saved_tokens, continuation) VALUES ",
        "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    ),
    # a turn still in flight: the columns its end fills take their defaults (NULL, 0)
    "turn_start": (
        "INSERT OR REPLACE INTO turns (uid, run, turn_id, route, path, protocol, stream,"
        " session_id, client, started) VALUES ",
        "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    ),
    "attempt": (
        "INSERT OR REPLACE INTO attempts (turn_uid, number, upstream, started, ended, status,"
        " reason, phase, frames_received, bytes_received, frames_released, bytes_released,"
        " hold_s, input_tokens, output_tokens, est_output_tokens, choice) VALUES ",
        "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    ),
    "upstream": (
        "INSERT INTO upstream_events (at, run, route, upstream, kind, reason, ttl_s, remote)"
        " VALUES ",
        "(?, ?, ?, ?, ?, ?, ?, ?)",
    ),
}
_UPDATE: dict[str, str] = {
    "turn_end": (
        "UPDATE turns SET ended = ?, outcome = ?, attempts = ?, upstream = ?, last_failure = ?,"
        " first_byte_s = ?, wait_s = ?, queued_s = ?, splices = ?, saved_tokens = ?,"
        " continuation = ? WHERE uid = ?"
    ),
    "wait": "UPDATE attempts SET wait_s = ? WHERE turn_uid = ? AND number = ?",
}
#: rows per multi-row insert, a power of two (at most 21 columns: 336 parameters, within
#: SQLite's 999)
_ROWS_PER_INSERT = 16

PRUNE_EVERY_S = 3600.0
#: turn ends kept while the journal cannot be written (their start rows are there:
#: dropped, they would show as unfinished turns); beyond this they are dropped too
MAX_OWED_ENDS = 50_000
#: while only owed ends wait, a journal that cannot be written is tried this often
OWED_RETRY_S = 1.0
MAX_JOURNAL_TEXT = 256  # session ids and paths are cut to this many characters

_Op = tuple[str, Any]
_chain = itertools.chain
#: the columns of a turn's row written when it starts (`_INSERT`'s ``turn_start``)
_START_COLUMNS = 10


# sqlite3 binds int, float, str and bytearray parameters as they are; any other value,
# None included, goes through its adapter lookup, which (CPython 3.11) looks for
# ``__adapt__`` on a class and builds an AttributeError when it is missing, about 2,400
# instructions per NULL.  A registered adapter is found first (a C function that gives
# None back: an empty dict's ``get``), still about 1,100 instructions (a key tuple
# built, a dict lookup, a call).  The rows of a turn (about 11 NULLs) bind `NULL`
# instead: a float, bound as it is, and SQLite stores a NaN as NULL ("SQLite does not
# support NaN": ``sqlite3_bind_double`` of a NaN binds NULL; a NOT NULL column refuses
# it as it refuses None).  What is read back is NULL either way.
_NONE_ADAPTER: dict[None, None] = {}
sqlite3.register_adapter(type(None), _NONE_ADAPTER.get)
#: a NULL column in a journal row (see above)
NULL = math.nan


def default_journal_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/unbroken/journal.sqlite3`` (``~/.local/state`` when unset)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "unbroken" / "journal.sqlite3"


def journal_path(configured: str | None, env: Mapping[str, str] | None = None) -> Path:
    """The configured ``[journal] path``, or the default."""
    return Path(configured) if configured else default_journal_path(env)


def _cut(text: str | None) -> str | float:
    """``text`` at most `MAX_JOURNAL_TEXT` long (None: `NULL`)."""
    return NULL if text is None else text[:MAX_JOURNAL_TEXT]


@functools.lru_cache(maxsize=32)
def _insert(kind: str, rows: int) -> str:
    """The insert of ``rows`` rows of ``kind`` in one statement."""
    head, one = _INSERT[kind]
    return head + ", ".join([one] * rows)


def _turn_end(turn: TurnRecord, wait_s: float) -> tuple[Any, ...]:
    """The columns a turn's end fills: ended, outcome, ..., wait_s (as in ``turn_end``)."""
    first_byte_s = NULL
    if turn.first_byte_at is not None:
        first_byte_s = turn.first_byte_at - turn.started
        if not first_byte_s > 0.0:  # max(0.0, ...), without the call
            first_byte_s = 0.0
    outcome, last_failure = turn.outcome, turn.last_failure
    return (
        turn.ended if turn.ended is not None else time.time(),
        NULL if outcome is None else outcome,
        turn.attempts,
        turn.upstream or NULL,
        NULL if last_failure is None else last_failure,
        first_byte_s,
        wait_s,
        turn.queued_s,
        turn.splices,
        turn.saved_tokens,
        _cut(turn.continuation),
    )


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a journal written by an older unbroken up to `SCHEMA_VERSION`."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    if "client" not in columns:  # version 1
        conn.execute("ALTER TABLE turns ADD COLUMN client TEXT")
    if "queued_s" not in columns:  # versions 1 to 3
        conn.execute("ALTER TABLE turns ADD COLUMN queued_s REAL NOT NULL DEFAULT 0")
    if "splices" not in columns:  # versions 1 to 4
        conn.execute("ALTER TABLE turns ADD COLUMN splices INTEGER NOT NULL DEFAULT 0")
        conn.execute("ALTER TABLE turns ADD COLUMN saved_tokens INTEGER NOT NULL DEFAULT 0")
    if "continuation" not in columns:  # versions 1 to 5
        conn.execute("ALTER TABLE turns ADD COLUMN continuation TEXT")
    columns = {row[1] for row in conn.execute("PRAGMA table_info(attempts)")}
    if "choice" not in columns:  # version 2 (upstream_events comes with SCHEMA)
        conn.execute("ALTER TABLE attempts ADD COLUMN choice TEXT")


def _connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, timeout=5.0)


class Journal(Hooks):
    """Batched, non-blocking SQLite journal of turns and attempts."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention_days: float = 14.0,
        connect: Callable[[str], sqlite3.Connection] = _connect,
        batch_window_s: float = 0.25,
        max_pending: int = 200_000,
    ) -> None:
        self.path = Path(path)
        self.retention_days = retention_days
        self.run = uuid.uuid4().hex[:12]
        self.batch_window_s = batch_window_s
        self.max_pending = max_pending
        self._connect = connect
        # A deque, not a queue.Queue: appending never wakes the writer thread (which
        # would fight the event loop for the GIL on every hook call); the writer
        # drains it every batch window, or at once when _wake is set (flush, stop).
        self._q: collections.deque[_Op] = collections.deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None
        self._warned_at: float | None = None
        self._pruned_at = 0.0
        self._closed = False
        #: rows (operations) that could not be written, or were refused when the queue was full
        self.dropped = 0
        #: turn ends (``turn_end`` update rows) that failed to be written, to write later
        self._owed: collections.deque[Sequence[Any]] = collections.deque()
        self._owed_tried_at = 0.0
        #: rows dropped when the journal last became unwritable (for the "writable again" line)
        self._dropped_before: int | None = None
        #: the last write succeeded (None: nothing written yet)
        self.healthy: bool | None = None
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(
                target=self._run, name=f"unbroken-journal-{self.run}", daemon=True
            )
            self._thread.start()

    async def flush(self) -> None:
        """Wait until every row queued before this call has been written (or dropped)."""
        self.start()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def _set() -> None:
            if not done.done():
                done.set_result(None)

        self._q.append(("flush", lambda: loop.call_soon_threadsafe(_set)))
        self._wake.set()
        await done

    async def aclose(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Write what is queued, close the database, stop the writer thread."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._q.append(("stop", None))
        self._wake.set()
        await asyncio.to_thread(thread.join, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Blocking variant of `aclose` (for use outside an event loop)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._q.append(("stop", None))
            self._wake.set()
            self._thread.join(timeout)

    def status(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "healthy": self.healthy,
            "dropped": self.dropped,
            "pending": len(self._q),
        }

    # -- hooks (event loop: copy facts, enqueue, return) --------------------------------
    def _put(self, op: _Op) -> None:
        if self._closed:
            return
        if len(self._q) >= self.max_pending:
            self.dropped += 1
            self._warn("the writer is behind (queue full)")
            return
        self._q.append(op)

    # A hook only queues references: the writer thread reads the fields, builds the
    # rows and formats the ids.  It reads nothing that can still change: a turn's
    # identity fields (route, path, protocol, stream, session id, client, started, id)
    # are set when the turn is made, an `AttemptInfo` is final once reported ended,
    # and a `TurnRecord` is final once reported ended (`Hooks.turn_ended`).
    def turn_started(self, turn: TurnRecord) -> None:
        self._put(("turn", turn))

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        self._put(("attempt", (turn.id, attempt)))

    def upstream_changed(
        self, route: str, upstream: str, kind: str, *, reason: str, ttl_s: float, remote: bool
    ) -> None:
        self._put(
            (
                "upstream",
                (
                    time.time(),
                    self.run,
                    route,
                    upstream,
                    kind,
                    _cut(reason) or None,
                    ttl_s if kind == "open" else None,
                    int(remote),
                ),
            )
        )

    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        if wait_s is None or not turn.attempt_log:
            return
        self._put(("wait", (wait_s, turn.id, turn.attempt_log[-1].number)))

    def turn_ended(self, turn: TurnRecord) -> None:
        self._put(("turn_end", (turn, turn.waited_s)))

    # -- writer thread -------------------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        q = self._q
        while not stopping:
            self._wake.wait(self.batch_window_s)
            self._wake.clear()
            batch: list[_Op] = []
            waiters: list[Callable[[], None]] = []
            while q:
                item = q.popleft()
                kind = item[0]
                if kind == "stop":
                    stopping = True
                    break
                if kind == "flush":
                    waiters.append(item[1])
                    break  # rows queued after the flush wait for the next round
                batch.append(item)
            if q and not stopping:
                self._wake.set()  # more to do: no need to wait out the window
            if batch or (self._owed and time.monotonic() - self._owed_tried_at >= OWED_RETRY_S):
                self._write(batch)
            self._maintain()
            for wake in waiters:
                try:
                    wake()
                except RuntimeError:  # the waiting loop is closed
                    pass
        self._close_conn()

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        conn = self._connect(str(self.path))
        try:
            enter_wal(conn)  # workers open one journal at once (observe/sqlite_wal.py)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.executescript(SCHEMA)
            _migrate(conn)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def _write(self, batch: list[_Op]) -> None:
        conn = self._conn
        statements: list[tuple[str, list[Sequence[Any]]]] = []
        owed = list(self._owed)
        self._owed_tried_at = time.monotonic()
        try:
            statements = self._statements(batch)
            if owed:  # ends that failed before: their rows were written before them
                statements.append(("turn_end", owed))
            if conn is None:
                conn = self._conn = self._open()
            try:
                for kind, rows in statements:
                    update = _UPDATE.get(kind)
                    if update is not None:
                        conn.executemany(update, rows)
                        continue
                    # Groups of 16 rows in one statement each, then the rest in groups
                    # of 8, 4, 2 and 1: a batch of n rows is at most n // 16 + 4
                    # statements, of five shapes a kind of row (the prepared-statement
                    # cache keeps every shape it sees, and a large one is a large
                    # program: the five of a turn's whole row take about 85 KB).
                    i, n, size = 0, len(rows), _ROWS_PER_INSERT
                    while i < n:
                        while n - i < size:
                            size >>= 1
                        part = rows[i : i + size]
                        conn.execute(_insert(kind, size), list(_chain(*part)))
                        i += size
                conn.commit()
            except BaseException:
                try:
                    conn.rollback()
                except sqlite3.Error:
                    pass
                raise
        except Exception as exc:  # sqlite3.Error, OSError, or a bug: never kill the writer
            # A turn's end whose start row is written is kept for later (else the turn
            # shows as unfinished for good); the rest of the batch is dropped.
            ends = [rows for kind, rows in statements if kind == "turn_end" and rows is not owed]
            keep = [row for rows in ends for row in rows]
            room = max(0, MAX_OWED_ENDS - len(self._owed))
            self._owed.extend(keep[:room])
            self.dropped += len(batch) - min(len(keep), room)
            if self._dropped_before is None:
                self._dropped_before = self.dropped - len(batch) + min(len(keep), room)
            self.healthy = False
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._close_conn()
            self._warn(self.last_error)
            return
        for _ in owed:
            self._owed.popleft()
        self.healthy = True
        if self._dropped_before is not None:
            log.warning(
                "journal %s is writable again: %d rows dropped while it was not%s",
                self.path,
                self.dropped - self._dropped_before,
                f", {len(owed)} turn ends written late" if owed else "",
            )
            self._dropped_before = None

    def _statements(self, batch: list[_Op]) -> list[tuple[str, list[Sequence[Any]]]]:
        """A batch as (kind, rows) in the order to write: an insert or update each.

        A turn that started and ended within the batch (most of them) is one complete
        insert, not an insert and an update.  Inserts go first, then the updates
        (the rows they update are written by then).
        """
        run = self.run
        turns: dict[int, list[Any]] = {}  # turn id -> its row, while still unwritten
        attempts: list[Sequence[Any]] = []
        events: list[Sequence[Any]] = []
        ends: list[Sequence[Any]] = []
        waits: list[Sequence[Any]] = []
        for kind, item in batch:
            if kind == "turn":
                t: TurnRecord = item
                turns[t.id] = [
                    f"{run}:{t.id}",
                    run,
                    t.id,
                    t.route,
                    _cut(t.path.split("?")[0]),
                    t.protocol,
                    int(t.stream),
                    _cut(t.session_id),
                    t.client or NULL,
                    t.started,
                ]
            elif kind == "turn_end":
                t, wait_s = item
                end = _turn_end(t, wait_s)
                row = turns.get(t.id)
                if row is not None:
                    row += end
                else:
                    ends.append((*end, f"{run}:{t.id}"))
            elif kind == "attempt":
                turn_id, a = item
                ended, status = a.ended, a.status
                tokens_in, tokens_out = a.input_tokens, a.output_tokens
                attempts.append(
                    (
                        f"{run}:{turn_id}",
                        a.number,
                        a.upstream,
                        a.started,
                        NULL if ended is None else ended,
                        NULL if status is None else status,
                        a.reason or "unknown",
                        a.phase or NULL,
                        a.frames_received,
                        a.bytes_received,
                        a.frames_released,
                        a.bytes_released,
                        a.hold_seconds,
                        NULL if tokens_in is None else tokens_in,
                        NULL if tokens_out is None else tokens_out,
                        a.est_output_tokens,
                        a.choice or NULL,
                    )
                )
            elif kind == "wait":
                wait_s, turn_id, number = item
                waits.append((wait_s, f"{run}:{turn_id}", number))
            elif kind == "upstream":
                events.append(item)
        whole: list[Sequence[Any]] = []
        started: list[Sequence[Any]] = []
        for row in turns.values():
            (whole if len(row) > _START_COLUMNS else started).append(row)
        out: list[tuple[str, list[Sequence[Any]]]] = []
        for kind, rows in (
            ("turn", whole),
            ("turn_start", started),
            ("attempt", attempts),
            ("upstream", events),
            ("turn_end", ends),
            ("wait", waits),
        ):
            if rows:
                out.append((kind, rows))
        return out

    def _maintain(self) -> None:
        """Delete rows older than the retention period (at start, then hourly)."""
        if self.retention_days <= 0 or self._conn is None:
            return
        now = time.time()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        cutoff = now - self.retention_days * 86400.0
        try:
            self._conn.execute(
                "DELETE FROM attempts WHERE turn_uid IN (SELECT uid FROM turns WHERE started < ?)",
                (cutoff,),
            )
            self._conn.execute("DELETE FROM turns WHERE started < ?", (cutoff,))
            self._conn.execute("DELETE FROM upstream_events WHERE at < ?", (cutoff,))
            self._conn.commit()
        except Exception as exc:
            self._warn(f"pruning failed: {exc}")

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error:
                pass

    def _warn(self, why: str) -> None:
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= LOG_EVERY_S:
            self._warned_at = now
            log.warning(
                "journal %s cannot be written (%s): %d rows dropped so far; "
                "the relay keeps serving",
                self.path,
                why,
                self.dropped,
            )
