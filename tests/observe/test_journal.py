"""The SQLite turn journal: rows per outcome, a writer that never blocks the loop,
degradation when the disk fails, retention, the [journal] config, and no secrets."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayfix import KEY_AUTH, Recorder, make_config, start_relay
from servefix import serve_subprocess
from unbroken.config import ConfigError, JournalSettings, parse_config
from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.mock import MockProvider
from unbroken.observe.hooks import AttemptInfo, TurnRecord
from unbroken.observe.journal import SCHEMA, Journal, default_journal_path, journal_path
from unbroken.relay.server import RelayServer

CHAT = "mock/v1/chat/completions"
STREAM = {"first_frame_timeout_s": 30, "idle_timeout_s": 30}


def _body(stream: bool = True, usage: bool = False, text: str = "hi") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def _config(mock: Any, path: Path, **kw: Any) -> Any:
    cfg = make_config([{"url": mock.url}], stream=STREAM, **kw)
    return dataclasses.replace(cfg, journal=JournalSettings(path=str(path)))


def _rows(path: Path, sql: str, *args: Any) -> list[dict[str, Any]]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(sql, args)]
    finally:
        conn.close()


async def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers or {}) as r:
        return await r.read()


# -- rows ---------------------------------------------------------------------------------
async def test_rows_for_each_outcome(mock: MockProvider, tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite3"
    server, rec = await start_relay(_config(mock, path))
    try:
        url = f"{server.url}/{CHAT}"
        # ok, with the client's session id
        await _post(url, _body(usage=True), {"x-session-id": "sess-ok"})
        # recovered: reset mid tool arguments (role, tool start, 3 argument frames), replayed
        mock.script([{"fault": "reset", "after_frame": 5, "reply": "tool"}, {"reply": "tool"}])
        await _post(url, _body(usage=True), {"x-session-affinity": "sess-tool"})
        # ended_with_error: reset after output reached the client (role + 3 text deltas)
        mock.script([{"fault": "reset", "after_frame": 4}])
        await _post(url, _body())
        # passed_through_error: a 400 is not retried
        mock.script([{"status": 400}])
        await _post(url, _body(stream=False))
        # aborted_by_client: the client leaves while the upstream stalls
        mock.script([{"fault": "stall", "after_frame": 0, "seconds": 30}])
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(url, json=_body()))
            await mock.wait_for_requests(len(mock.requests) + 1, timeout=30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await rec.wait_turns(5)
        assert server.journal is not None
        await server.journal.flush()
    finally:
        await server.stop()

    turns = _rows(path, "SELECT * FROM turns ORDER BY turn_id")
    assert [t["outcome"] for t in turns] == [
        "ok",
        "recovered",
        "ended_with_error",
        "passed_through_error",
        "aborted_by_client",
    ]
    ok, recovered, ended, passed, aborted = turns
    assert len({t["run"] for t in turns}) == 1
    assert ok["session_id"] == "sess-ok" and recovered["session_id"] == "sess-tool"
    assert ended["session_id"] is None
    assert ok["route"] == "mock" and ok["path"] == "v1/chat/completions"
    assert ok["protocol"] == "chat" and ok["stream"] == 1 and passed["stream"] == 0
    assert all(t["ended"] >= t["started"] for t in turns)
    assert ok["attempts"] == 1 and recovered["attempts"] == 2
    assert recovered["last_failure"] and recovered["wait_s"] > 0
    assert ok["first_byte_s"] is not None and ok["first_byte_s"] >= 0

    def attempts(turn: dict[str, Any]) -> list[dict[str, Any]]:
        return _rows(path, "SELECT * FROM attempts WHERE turn_uid = ? ORDER BY number", turn["uid"])

    [a] = attempts(ok)
    assert (a["reason"], a["status"], a["upstream"]) == ("ok", 200, mock.url)
    assert a["frames_received"] == a["frames_released"] > 0
    assert a["bytes_received"] == a["bytes_released"] > 0
    assert a["input_tokens"] and a["output_tokens"]  # usage chunk requested

    dead, good = attempts(recovered)
    assert dead["phase"] == "pending" and dead["reason"] not in ("ok", "")
    assert dead["frames_received"] == 5 and dead["frames_released"] == 0
    assert dead["bytes_released"] == 0 and dead["hold_s"] >= 0
    assert dead["est_output_tokens"] > 0  # the tool-call fragments the replay threw away
    assert dead["wait_s"] is not None and dead["wait_s"] > 0
    assert good["reason"] == "ok" and good["frames_released"] > 0 and good["wait_s"] is None

    [cut] = attempts(ended)
    assert cut["phase"] == "committed" and cut["frames_released"] == 4

    [p] = attempts(passed)
    assert p["status"] == 400 and p["reason"] == "passed_through_error"

    [ab] = attempts(aborted)
    assert ab["reason"] == "aborted_by_client"


async def test_turn_in_flight_is_written_at_start(mock: MockProvider, tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    server, _ = await start_relay(_config(mock, path))
    try:
        mock.script([{"fault": "stall", "after_frame": 0, "seconds": 30}])
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(f"{server.url}/{CHAT}", json=_body()))
            await mock.wait_for_requests(1, timeout=30)
            assert server.journal is not None
            await server.journal.flush()
            rows = _rows(path, "SELECT outcome, ended FROM turns")
            assert rows == [{"outcome": None, "ended": None}]  # a crash now keeps this row
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        await server.stop()


# -- the writer never blocks the event loop -----------------------------------------------
class _SlowDisk(sqlite3.Connection):
    """A connection whose commits hang until the test opens the gate."""

    gate = threading.Event()
    entered = threading.Event()

    def commit(self) -> None:
        type(self).entered.set()
        if not type(self).gate.wait(60):
            raise sqlite3.OperationalError("gate never opened")
        super().commit()


async def test_slow_disk_does_not_block_turns(mock: MockProvider, tmp_path: Path) -> None:
    path = tmp_path / "slow.sqlite3"
    _SlowDisk.gate.clear()
    _SlowDisk.entered.clear()
    journal = Journal(path, connect=lambda p: sqlite3.connect(p, factory=_SlowDisk))
    cfg = dataclasses.replace(
        make_config([{"url": mock.url}]), journal=JournalSettings(enabled=False)
    )
    rec = Recorder()
    server = RelayServer(cfg, hooks=journal)
    server.hooks.add(rec)
    journal.start()
    await server.start()
    try:
        url = f"{server.url}/{CHAT}"
        bodies = await asyncio.gather(*(_post(url, _body()) for _ in range(5)))
        assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies)
        await rec.wait_turns(5)
        # the writer is stuck inside a commit while every turn went through
        assert await asyncio.to_thread(_SlowDisk.entered.wait, 30)
        assert not _SlowDisk.gate.is_set()
        # a request to /status is served at once too
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/status") as r:
            assert r.status == 200
        _SlowDisk.gate.set()
        await journal.flush()
    finally:
        _SlowDisk.gate.set()
        await server.stop()
        await journal.aclose()
    rows = _rows(path, "SELECT outcome FROM turns")
    assert [r["outcome"] for r in rows] == ["ok"] * 5


# -- a journal that cannot be written ----------------------------------------------------------
class _FullDisk(sqlite3.Connection):
    def commit(self) -> None:
        raise sqlite3.OperationalError("database or disk is full")


@pytest.mark.parametrize("failure", ["unwritable_path", "disk_full"])
async def test_unwritable_journal_degrades_to_a_warning(
    mock: MockProvider, tmp_path: Path, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    if failure == "unwritable_path":
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("x")  # a file where the directory should be (fails even as root)
        journal = Journal(blocker / "journal.sqlite3")
    else:
        journal = Journal(
            tmp_path / "full.sqlite3", connect=lambda p: sqlite3.connect(p, factory=_FullDisk)
        )
    cfg = dataclasses.replace(
        make_config([{"url": mock.url}]), journal=JournalSettings(enabled=False)
    )
    server = RelayServer(cfg, hooks=journal)
    journal.start()
    await server.start()
    caplog.set_level(logging.WARNING, logger="unbroken")
    try:
        for _ in range(3):
            body = await _post(f"{server.url}/{CHAT}", _body())
            assert body.rstrip().endswith(b"data: [DONE]")
        await journal.flush()
        assert journal.healthy is False and journal.dropped > 0
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/healthz") as r:
            assert r.status == 200
    finally:
        await server.stop()
        await journal.aclose()
    warnings = [r for r in caplog.records if "journal" in r.getMessage()]
    assert warnings and all(r.levelno == logging.WARNING for r in warnings)
    assert len(warnings) == 1  # rate-limited: one line, not one per batch


async def test_relay_serves_when_the_configured_journal_is_unwritable(
    mock: MockProvider, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    server, _ = await start_relay(_config(mock, blocker / "j.sqlite3"))
    try:
        body = await _post(f"{server.url}/{CHAT}", _body())
        assert body.rstrip().endswith(b"data: [DONE]")
        assert server.journal is not None
        await server.journal.flush()
        async with aiohttp.ClientSession() as s, s.get(f"{server.url}/status") as r:
            status = await r.json()
        assert status["journal"]["healthy"] is False
    finally:
        await server.stop()


# -- retention, WAL ---------------------------------------------------------------------------
def _turn(route: str = "r") -> TurnRecord:
    return TurnRecord(route=route, path="v1/chat/completions", protocol="chat", stream=True)


async def test_retention_prunes_old_rows_and_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(SCHEMA)
    old = time.time() - 3 * 86400
    conn.execute(
        "INSERT INTO turns (uid, run, turn_id, route, path, protocol, stream, started, outcome)"
        " VALUES ('old:1', 'old', 1, 'r', 'p', 'chat', 1, ?, 'ok')",
        (old,),
    )
    conn.execute(
        "INSERT INTO attempts (turn_uid, number, upstream, started, reason)"
        " VALUES ('old:1', 1, 'u', ?, 'ok')",
        (old,),
    )
    conn.commit()
    conn.close()
    journal = Journal(path, retention_days=1)
    journal.start()
    try:
        turn = _turn()
        journal.turn_started(turn)
        journal.attempt_ended(turn, AttemptInfo(number=1, upstream="u", reason="ok"))
        turn.outcome = "ok"
        journal.turn_ended(turn)
        await journal.flush()
    finally:
        await journal.aclose()
    assert [r["uid"] for r in _rows(path, "SELECT uid FROM turns")] == [f"{journal.run}:{turn.id}"]
    assert _rows(path, "SELECT count(*) AS n FROM attempts") == [{"n": 1}]
    assert _rows(path, "PRAGMA journal_mode") == [{"journal_mode": "wal"}]


async def test_a_turn_ended_in_a_later_batch_gets_the_same_row(tmp_path: Path) -> None:
    """Within one batch a turn is one complete insert; across batches, an insert and
    an update.  Both write the same row, and a retry's wait lands on its attempt."""
    path = tmp_path / "j.sqlite3"
    journal = Journal(path)
    journal.start()
    turns = []
    try:
        for split in (False, True):
            turn = _turn()
            turn.session_id = "sess"
            journal.turn_started(turn)
            if split:
                await journal.flush()  # the start row is written on its own
            first = AttemptInfo(number=1, upstream="u", reason="503", status=503)
            turn.attempt_log.append(first)
            journal.attempt_ended(turn, first)
            journal.attempt_failed(
                turn, "u", Failure(FailureClass.STATUS, "503", 503), phase="headers", wait_s=0.5
            )
            if split:
                await journal.flush()
            second = AttemptInfo(number=2, upstream="u", reason="ok", status=200)
            journal.attempt_ended(turn, second)
            turn.outcome, turn.attempts, turn.upstream = "recovered", 2, "u"
            turn.last_failure, turn.ended = "503", turn.started + 1.5
            turn.waited_s = 0.5  # what the reporter measured (observe/report.py)
            turn.first_byte_at = turn.started + 1.25
            journal.turn_ended(turn)
            await journal.flush()
            turns.append(turn)
    finally:
        await journal.aclose()
    rows = [_rows(path, "SELECT * FROM turns WHERE turn_id = ?", t.id)[0] for t in turns]
    for row in rows:
        row.pop("uid"), row.pop("turn_id"), row.pop("started"), row.pop("ended")
    assert rows[0] == rows[1]
    assert rows[0]["outcome"] == "recovered" and rows[0]["wait_s"] == 0.5
    assert rows[0]["first_byte_s"] == 1.25 and rows[0]["session_id"] == "sess"
    for t in turns:
        waits = _rows(
            path,
            "SELECT number, wait_s FROM attempts WHERE turn_uid = ? ORDER BY number",
            f"{journal.run}:{t.id}",
        )
        assert waits == [{"number": 1, "wait_s": 0.5}, {"number": 2, "wait_s": None}]


async def test_batches_of_any_size_use_a_few_insert_shapes_per_table(tmp_path: Path) -> None:
    """SQLite keeps each statement text it prepares; a multi-row insert per batch size
    would fill that cache with large programs (RSS grew 3.5 KiB per open stream).  A
    batch is written in groups of 16, 8, 4, 2 and 1 rows: five shapes a kind of row
    (whole turns, turns in flight, attempts), whatever the batch sizes."""
    from unbroken.observe import journal as journal_module

    journal_module._insert.cache_clear()
    journal = Journal(tmp_path / "j.sqlite3")
    journal.start()
    try:
        for size in (1, 5, 31, 32, 33, 70, 100):
            for i in range(size):
                turn = _turn()
                journal.turn_started(turn)
                journal.attempt_ended(turn, AttemptInfo(number=1, upstream="u", reason="ok"))
                if i % 2:
                    turn.outcome, turn.ended = "ok", time.time()
                    journal.turn_ended(turn)
            await journal.flush()
    finally:
        await journal.aclose()
    assert journal_module._insert.cache_info().currsize <= 3 * 5
    assert _rows(tmp_path / "j.sqlite3", "SELECT count(*) AS n FROM turns") == [{"n": 272}]
    assert _rows(tmp_path / "j.sqlite3", "SELECT count(*) AS n FROM attempts") == [{"n": 272}]
    ended = "SELECT count(*) AS n FROM turns WHERE outcome = 'ok'"
    assert _rows(tmp_path / "j.sqlite3", ended) == [{"n": 134}]


_V1_TURNS = """
CREATE TABLE turns (
    uid TEXT PRIMARY KEY, run TEXT NOT NULL, turn_id INTEGER NOT NULL, route TEXT NOT NULL,
    path TEXT NOT NULL, protocol TEXT NOT NULL, stream INTEGER NOT NULL, session_id TEXT,
    started REAL NOT NULL, ended REAL, outcome TEXT, attempts INTEGER NOT NULL DEFAULT 0,
    upstream TEXT, last_failure TEXT, first_byte_s REAL, wait_s REAL NOT NULL DEFAULT 0
);
"""


@pytest.mark.parametrize("schema", ["current", "version 1, migrated"])
async def test_a_turn_in_flight_reads_back_as_when_its_row_named_every_column(
    tmp_path: Path, schema: str
) -> None:
    """A turn still in flight at the batch's end is inserted with its start's columns
    only; the others take their defaults, in a journal of every schema version: what
    is read back (values and types) is what the insert of every column wrote."""
    path = tmp_path / "j.sqlite3"
    if schema != "current":
        conn = sqlite3.connect(path)
        conn.executescript(_V1_TURNS)
        conn.execute("PRAGMA user_version=1")
        conn.commit()
        conn.close()
    journal = Journal(path)
    journal.start()
    try:
        turn = _turn()
        journal.turn_started(turn)
        await journal.flush()
    finally:
        await journal.aclose()
    (row,) = _rows(
        path,
        "SELECT ended, outcome, attempts, upstream, last_failure, first_byte_s, wait_s,"
        " queued_s, splices, saved_tokens, continuation, typeof(attempts) AS ta,"
        " typeof(wait_s) AS tw, typeof(queued_s) AS tq, typeof(splices) AS ts,"
        " typeof(saved_tokens) AS tt, typeof(ended) AS te FROM turns WHERE turn_id = ?",
        turn.id,
    )
    assert row == {
        "ended": None,
        "outcome": None,
        "attempts": 0,
        "upstream": None,
        "last_failure": None,
        "first_byte_s": None,
        "wait_s": 0.0,
        "queued_s": 0.0,
        "splices": 0,
        "saved_tokens": 0,
        "continuation": None,
        "ta": "integer",
        "tw": "real",
        "tq": "real",
        "ts": "integer",
        "tt": "integer",
        "te": "null",
    }


async def test_queue_is_bounded(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite3", max_pending=3)  # never started: nothing drains
    for _ in range(5):
        journal.turn_started(_turn())
    assert journal.dropped == 2
    await journal.aclose()


# -- configuration -------------------------------------------------------------------------------
def test_journal_config_defaults_and_values(tmp_path: Path) -> None:
    cfg = parse_config({}, env={})
    assert cfg.journal == JournalSettings(enabled=True, path=None, retention_days=14.0)
    cfg = parse_config(
        {"journal": {"enabled": False, "path": "~/j.sqlite3", "retention_days": 3}}, env={}
    )
    assert cfg.journal.enabled is False and cfg.journal.retention_days == 3.0
    assert cfg.journal.path == str(Path("~/j.sqlite3").expanduser())


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"retention_days": "14"}, "journal.retention_days"),
        ({"retention_days": -1}, "journal.retention_days"),
        ({"enabled": "yes"}, "journal.enabled"),
        ({"path": 3}, "journal.path"),
        ({"path": "  "}, "journal.path"),
        ({"keep": 1}, "journal.keep"),
    ],
)
def test_journal_config_errors_name_the_key(section: Any, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"journal": section}, env={})
    assert err.value.key == key


def test_journal_config_table_type() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"journal": 1}, env={})
    assert err.value.key == "journal"


async def test_serve_exits_2_on_a_bad_journal_key(tmp_path: Path) -> None:
    conf = tmp_path / "u.toml"
    conf.write_text("[journal]\nretention_days = 'two weeks'\n")
    code, err = await (await serve_subprocess(conf, listen=False)).exited(60)
    assert code == 2
    assert "journal.retention_days" in err


def test_default_path_follows_xdg_state_home(tmp_path: Path) -> None:
    assert default_journal_path({"XDG_STATE_HOME": str(tmp_path)}) == (
        tmp_path / "unbroken" / "journal.sqlite3"
    )
    home = Path.home() / ".local" / "state" / "unbroken" / "journal.sqlite3"
    assert default_journal_path({}) == home
    assert default_journal_path({"XDG_STATE_HOME": "relative/dir"}) == home  # per the XDG spec
    assert journal_path("/x/j.sqlite3", {}) == Path("/x/j.sqlite3")


# -- secrets never reach the journal, /status or /metrics ------------------------------
async def test_no_canary_in_journal_status_or_metrics(mock: MockProvider, tmp_path: Path) -> None:
    canary = "sk-canary-4242beef"
    path = tmp_path / "j.sqlite3"
    cfg = make_config(
        [{"url": mock.url, "api_key_env": "CANARY_KEY"}],
        env={"CANARY_KEY": canary + "-configured"},
        stream=STREAM,
    )
    cfg = dataclasses.replace(cfg, journal=JournalSettings(path=str(path)))
    server, rec = await start_relay(cfg)
    try:
        url = f"{server.url}/{CHAT}"
        headers = {
            "Authorization": f"Bearer {canary}",
            "x-api-key": canary,
            "x-session-id": "session-1",
            **KEY_AUTH,
        }
        mock.script([{"status": 503}, {"fault": "reset", "after_frame": 1}])
        await _post(url, _body(text=f"my key is {canary}"), headers)
        mock.script([{"status": 401}])
        await _post(url, _body(stream=False, text=canary), headers)
        await rec.wait_turns(2)
        assert server.journal is not None
        await server.journal.flush()
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{server.url}/status") as r:
                status_text = await r.text()
            async with s.get(f"{server.url}/metrics") as r:
                metrics_text = await r.text()
    finally:
        await server.stop()
    assert canary not in status_text and canary not in metrics_text
    assert "session-1" not in status_text and "session-1" not in metrics_text
    dump = "\n".join(sqlite3.connect(path).iterdump())
    assert "session-1" in dump  # the journal keeps the session id, as asked
    assert canary not in dump
    for f in tmp_path.iterdir():  # noqa: ASYNC240  # the database file and any WAL left behind
        assert canary.encode() not in f.read_bytes()


async def test_missing_values_are_stored_as_null_in_either_batch(tmp_path: Path) -> None:
    """A row's missing values are bound as a NaN, which SQLite stores as NULL (no adapter
    call per None): what is read back is NULL, of type null, whether the turn's start
    and end were written in one batch or two."""
    path = tmp_path / "j.sqlite3"
    journal = Journal(path)
    journal.start()
    try:
        whole = _turn()
        journal.turn_started(whole)
        journal.attempt_ended(whole, AttemptInfo(number=1, upstream="u", reason="ok"))
        whole.outcome, whole.ended = "ok", time.time()
        journal.turn_ended(whole)
        split = _turn()
        journal.turn_started(split)
        await journal.flush()
        split.outcome, split.ended = "ok", time.time()
        journal.turn_ended(split)
        await journal.flush()
    finally:
        await journal.aclose()
    nullable = (
        "session_id",
        "client",
        "upstream",
        "last_failure",
        "first_byte_s",
        "continuation",
    )
    for t in (whole, split):
        (row,) = _rows(
            path,
            "SELECT " + ", ".join(f"typeof({c}) AS {c}" for c in nullable) + " FROM turns"
            " WHERE turn_id = ?",
            t.id,
        )
        assert row == dict.fromkeys(nullable, "null")
    (attempt,) = _rows(
        path,
        "SELECT typeof(ended) AS e, typeof(status) AS s, typeof(phase) AS p,"
        " typeof(input_tokens) AS i, typeof(output_tokens) AS o, typeof(choice) AS c"
        " FROM attempts",
    )
    assert attempt == {"e": "null", "s": "null", "p": "null", "i": "null", "o": "null", "c": "null"}
