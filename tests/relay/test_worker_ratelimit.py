"""Issue 32: the workers of one ``serve --workers N`` share each key's rate-limit budget,
as relays do through Redis, without Redis (`relay.ratefile`: one SQLite file in the
supervisor's runtime directory).

Before, each worker's buckets believed they had the whole key: two workers spent it
twice.  Two workers run in this process (`RelayServer` with a `WorkerSpec` each, one
runtime directory, as ``serve --workers 2`` gives them) in front of a mock that
enforces 5 requests a second per key and sends OpenAI's headers.  Garbage in the file
(a poisoned row, a file that is not a database) heals, logged once, never a
traceback, never a stuck key.  Waits poll a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relay.test_health_relay import CHAT, PATH, until
from unbroken.config import parse_config
from unbroken.core.admission.leasemath import GARBAGE, UNKNOWN
from unbroken.core.admission.shared import Garbage
from unbroken.mock import MockProvider
from unbroken.mock.limits import MockLimits
from unbroken.relay.ratefile import RATES_FILE, FileRates, RatesFileGarbage
from unbroken.relay.server import RelayServer
from unbroken.relay.siblings import WorkerSpec

KEY = {"Authorization": "Bearer sk-workers-shared-key"}
TURNS = 24


def _config(upstream: str) -> Any:
    data = {
        "retry": {"delay_ms": 5, "max_delay_ms": 50},
        "routes": {"mock": {"upstreams": [{"url": upstream}]}},
        "journal": {"enabled": False},
    }
    return dataclasses.replace(parse_config(data, env={}), port=0, grace_s=2.0)


async def _post(http: aiohttp.ClientSession, url: str) -> int:
    async with http.post(url + PATH, json=CHAT, headers=KEY) as r:
        await r.read()
        return r.status


def _count(mock: Any, status: int) -> int:
    return sum(1 for _, _, s in mock.limits.log if s == status)


def _learned(server: RelayServer) -> bool:
    lims = list(server.relay.board.rates.all())
    return bool(lims) and all(b.version > 0 for lim in lims for b in lim.buckets.values())


def _shared(server: RelayServer) -> bool:
    lims = list(server.relay.board.rates.all())
    return bool(lims) and all(b.shared for lim in lims for b in lim.buckets.values())


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "unbroken"]


def _replace_with(junk: Path, path: Path) -> None:
    """``path`` is now ``junk``, its journal gone (with its WAL there, SQLite would read
    the old pages from the WAL, not the junk)."""
    os.replace(junk, path)
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


class _Workers:
    def __init__(self, cfg: Any, runtime: Path) -> None:
        self.servers = [RelayServer(cfg, worker=WorkerSpec(i, str(runtime))) for i in (0, 1)]

    async def __aenter__(self) -> list[RelayServer]:
        for s in self.servers:
            await s.start()
        return self.servers

    async def __aexit__(self, *exc: object) -> None:
        for s in self.servers:
            await s.stop()


async def _warm(http: aiohttp.ClientSession, a: RelayServer, b: RelayServer) -> None:
    """Each worker learns the key's budget from the provider (a report each)."""
    assert await _post(http, a.url) == 200
    assert await _post(http, b.url) == 200
    await until(lambda: _learned(a) and _learned(b))


async def test_two_workers_spend_one_budget_per_key_not_two(
    tmp_path: Path, mock: MockProvider
) -> None:
    mock.limits = MockLimits(rpm=300, start=0.0)  # five a second, spent at first
    async with _Workers(_config(mock.url), tmp_path) as (a, b), aiohttp.ClientSession() as http:
        assert a.relay.store.kind == b.relay.store.kind == "workers"
        await _warm(http, a, b)
        await until(lambda: _shared(a) and _shared(b))
        mock.limits.log.clear()
        # twenty-four turns at once, half through each worker: alone, each worker would
        # think it has the whole budget (the old code: both spent it, a 429 for about
        # every other request); sharing it, they hardly ever collect a 429
        results = await asyncio.wait_for(
            asyncio.gather(*(_post(http, (a, b)[i % 2].url) for i in range(TURNS))), 60
        )
        assert results == [200] * TURNS
        refused = _count(mock, 429)
        assert _count(mock, 200) == TURNS and refused <= 2, (refused, mock.limits.log)
        # both workers took leases from the one file, and /status says so
        for s in (a, b):
            rates = s.relay.store.status()["ratelimits"]
            assert rates["shared_buckets"] == 1 and rates["leases"] >= 1, rates
        assert (tmp_path / RATES_FILE).exists()
        up = await (await http.get(a.url + "/status")).json()
        [u] = [u for u in up["upstreams"] if u["route"] == "mock"]
        assert u["ratelimits"][0]["shared"] is True


async def test_a_poisoned_row_heals_logged_once_never_a_stuck_key(
    tmp_path: Path, mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    # the file's twin of issue 32's `HSET ... rate 0 level -100`, which stopped a key
    caplog.set_level(logging.INFO, logger="unbroken")
    mock.limits = MockLimits(rpm=300)  # five a second, full
    async with _Workers(_config(mock.url), tmp_path) as (a, b), aiohttp.ClientSession() as http:
        await _warm(http, a, b)
        await until(lambda: _shared(a) and _shared(b))
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            n = db.execute(
                "UPDATE buckets SET rate = 0, level = -100 WHERE name LIKE '%:requests'"
            ).rowcount
        assert n == 1
        results = await asyncio.wait_for(
            asyncio.gather(*(_post(http, (a, b)[i % 2].url) for i in range(8))), 30
        )
        assert results == [200] * 8
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            [(rate, level)] = db.execute(
                "SELECT rate, level FROM buckets WHERE name LIKE '%:requests'"
            ).fetchall()
        assert rate > 0 and level >= -300  # replaced by a worker's own view of it
        garbage = [m for m in _messages(caplog) if Garbage.VALUE.value in m]
        assert 1 <= len(garbage) <= 2, garbage  # once a minute, per worker at most
        assert not any("Traceback" in m for m in _messages(caplog))
        assert _shared(a) or _shared(b)


async def test_a_file_that_is_no_database_is_replaced_and_turns_pace_locally_meanwhile(
    tmp_path: Path, mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    mock.limits = MockLimits(rpm=600)  # ten a second, full
    async with _Workers(_config(mock.url), tmp_path) as (a, b), aiohttp.ClientSession() as http:
        await _warm(http, a, b)
        await until(lambda: _shared(a) and _shared(b))
        junk = tmp_path / "junk"
        junk.write_bytes(b"not a database, not at all\n" * 200)
        _replace_with(junk, tmp_path / RATES_FILE)
        for _ in range(3):  # the turns never wait on the file
            results = await asyncio.wait_for(
                asyncio.gather(*(_post(http, (a, b)[i % 2].url) for i in range(6))), 30
            )
            assert results == [200] * 6
        # a worker removed the junk; the next report made the file afresh and shares again

        async def healed() -> bool:
            assert await _post(http, a.url) == 200
            assert await _post(http, b.url) == 200
            await asyncio.sleep(0.05)  # the share is written in the background
            return _shared(a) and _shared(b)

        await until(healed, cap=10)
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            assert db.execute("SELECT count(*) FROM buckets").fetchone()[0] >= 1
        lines = [m for m in _messages(caplog) if Garbage.FILE.value in m]
        assert 1 <= len(lines) <= 2, lines  # once a minute, per worker at most
        assert not any("Traceback" in m for m in _messages(caplog))


# -- the file on its own: two workers' backends -------------------------------------------
@contextlib.contextmanager
def _two_backends(tmp_path: Path) -> Iterator[tuple[list[float], FileRates, FileRates]]:
    """Two workers' backends on one rates file, on one clock (``clock[0]``, movable)."""
    clock = [100.0]
    a = FileRates(tmp_path / RATES_FILE, clock=lambda: clock[0])
    b = FileRates(tmp_path / RATES_FILE, clock=lambda: clock[0])
    try:
        yield clock, a, b
    finally:
        a.close()
        b.close()


async def test_two_backends_on_one_file_share_one_bucket(tmp_path: Path) -> None:
    with _two_backends(tmp_path) as (clock, a, b):
        args = ([1.0], [300.0], [5.0])
        assert await a.take(["k:requests"], 4, *args) == (UNKNOWN, 0.0)
        assert await a.learn("k:requests", 300, 5, 3) == (False, 0.0)
        assert await a.take(["k:requests"], 2, *args) == (2, 0.0)
        assert await b.take(["k:requests"], 2, *args) == (1, 0.0)  # what a left
        got, wait = await b.take(["k:requests"], 2, *args)
        assert got == 0 and wait == pytest.approx(0.2)
        clock[0] += 0.4  # refilled two
        assert await a.take(["k:requests"], 5, *args) == (2, 0.0)
        # never raises the level; answers what the takes granted in all (2 + 1 + 2)
        assert await b.learn("k:requests", 300, 5, 250) == (False, 5.0)
        assert (await a.take(["k:requests"], 1, *args))[0] == 0
        clock[0] += 121.0  # expired: unknown, taught again
        assert (await b.take(["k:requests"], 1, *args))[0] == UNKNOWN
        # garbage: rate 0, level -100, or text: the take says so, a report replaces it
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            db.execute(
                "INSERT OR REPLACE INTO buckets VALUES ('k:requests', 300, 0, -100, 0, 1e9, 7)"
            )
        assert (await a.take(["k:requests"], 1, *args))[0] == GARBAGE
        assert await a.learn("k:requests", 300, 5, 10) == (True, 0.0)  # (counted afresh)
        assert await b.take(["k:requests"], 1, *args) == (1, 0.0)
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            db.execute("UPDATE buckets SET level = 'lots'")
        assert (await b.take(["k:requests"], 1, *args))[0] == GARBAGE


async def test_two_backends_on_one_file_hold_a_second_of_a_banked_budget(
    tmp_path: Path,
) -> None:
    """The workers' file holds what a take asks it to (`leasemath.fleet_take`'s
    ``holds``, a second's share of the requests limit): a banked minute's budget goes
    to the workers five at a time, then at its rate."""
    with _two_backends(tmp_path) as (clock, a, b):
        args = ([1.0], [300.0], [5.0])
        assert (await a.learn("k:requests", 300, 5, 300))[0] is False  # banked
        assert await a.take(["k:requests"], 16, *args, holds=(5.0,)) == (5, 0.0)
        got, wait = await b.take(["k:requests"], 16, *args, holds=(5.0,))
        assert got == 0 and wait == pytest.approx(0.2)
        clock[0] += 0.4
        assert await b.take(["k:requests"], 16, *args, holds=(5.0,)) == (2, 0.0)
        clock[0] += 60.0  # a minute idle: still a second's share
        assert await a.take(["k:requests"], 16, *args, holds=(5.0,)) == (5, 0.0)


async def test_two_backends_on_one_file_serve_the_oldest_turn_first(tmp_path: Path) -> None:
    """The fleet's line (`leasemath.LineMark`) in the workers' file: a worker whose turn
    waits longer goes first, whoever asks at the refill."""
    with _two_backends(tmp_path) as (clock, a, b):
        args = ([1.0], [300.0], [5.0])
        assert (await a.learn("k:requests", 300, 5, 0))[0] is False  # spent
        got, _ = await a.take(["k:requests"], 3, *args, me="a", age=4.0)
        assert got == 0  # short: a's turn, waiting 4 s, is the fleet's oldest
        clock[0] += 0.4  # two refilled
        got, wait = await b.take(["k:requests"], 5, *args, me="b", age=1.0)
        assert (got, wait) == (0, pytest.approx(0.1))  # b's waits less: it waits on
        assert await a.take(["k:requests"], 3, *args, me="a", age=4.4) == (2, 0.0)
        clock[0] += 0.2  # one more; a is still short: its mark stays
        assert await b.take(["k:requests"], 5, *args, me="b", age=1.6) == (0, pytest.approx(0.1))
        assert await a.take(["k:requests"], 1, *args, me="a", age=4.6) == (1, 0.0)  # served
        clock[0] += 0.2
        assert await b.take(["k:requests"], 5, *args, me="b", age=1.8) == (1, 0.0)
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            owner = db.execute("SELECT owner FROM lines").fetchall()
        assert owner == [("b",)]  # b is short now: its turn is the oldest


async def test_a_junk_file_is_garbage_once_then_made_afresh(tmp_path: Path) -> None:
    path = tmp_path / RATES_FILE
    a = FileRates(path)
    b = FileRates(path)
    try:
        assert (await a.learn("k:requests", 300, 5, 3))[0] is False
        assert await b.take(["k:requests"], 1, [1.0], [300.0], [5.0]) == (1, 0.0)
        junk = tmp_path / "junk"
        junk.write_bytes(os.urandom(8192))
        _replace_with(junk, path)  # b sees a new file at the path: it opens that
        with pytest.raises(RatesFileGarbage):
            await b.take(["k:requests"], 1, [1.0], [300.0], [5.0])
        # b removed it: a, whose file was replaced under it, opens a fresh one
        assert await a.take(["k:requests"], 1, [1.0], [300.0], [5.0]) == (UNKNOWN, 0.0)
        assert (await b.learn("k:requests", 300, 5, 3))[0] is False
        assert await a.take(["k:requests"], 5, [1.0], [300.0], [5.0]) == (3, 0.0)
        # a table that is not ours is garbage too
        with sqlite3.connect(path) as db:
            db.execute("DROP TABLE buckets")
            db.execute("CREATE TABLE buckets (x)")
        with pytest.raises(RatesFileGarbage):
            await a.take(["k:requests"], 1, [1.0], [300.0], [5.0])
        assert (await b.learn("k:requests", 300, 5, 3))[0] is False
    finally:
        a.close()
        b.close()


async def test_an_unusable_file_means_local_pacing_logged_once_until_it_answers(
    tmp_path: Path, mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    mock.limits = MockLimits(rpm=600)  # ten a second, full
    (tmp_path / RATES_FILE).mkdir()  # no file can be opened there: not garbage, an error
    async with _Workers(_config(mock.url), tmp_path) as (a, b), aiohttp.ClientSession() as http:
        for _ in range(3):
            results = await asyncio.wait_for(
                asyncio.gather(*(_post(http, (a, b)[i % 2].url) for i in range(6))), 30
            )
            assert results == [200] * 6
        assert not _shared(a) and not _shared(b)  # each paces alone meanwhile
        lines = [m for m in _messages(caplog) if "rate-limit file is unusable" in m]
        assert len(lines) == 2, lines  # once per worker, whatever the reports that followed
        (tmp_path / RATES_FILE).rmdir()

        async def shared_again() -> bool:
            assert await _post(http, a.url) == 200
            assert await _post(http, b.url) == 200
            await asyncio.sleep(0.05)  # the share is written in the background
            return _shared(a) and _shared(b)

        await until(shared_again, cap=10)
        assert len([m for m in _messages(caplog) if "file answers again" in m]) == 2
        assert not any("Traceback" in m for m in _messages(caplog))


async def test_the_files_total_granted_is_counted_and_garbage_in_it_replaced(
    tmp_path: Path,
) -> None:
    """What the takes granted from a bucket in all (`core/admission/bucket.py`'s fleet
    drift) is kept in the file; a total that is garbage is left by takes and replaced by
    the next report, which says it replaced garbage (the worker logs it)."""
    with _two_backends(tmp_path) as (clock, a, b):
        args = ([1.0], [300.0], [5.0])
        assert await a.learn("k:requests", 300, 5, 10) == (False, 0.0)
        assert await a.take(["k:requests"], 3, *args) == (3, 0.0)
        assert await b.take(["k:requests"], 4, *args) == (4, 0.0)
        assert await b.learn("k:requests", 300, 5, 3) == (False, 7.0)
        with sqlite3.connect(tmp_path / RATES_FILE) as db:
            db.execute("UPDATE buckets SET granted = 'lots'")
        clock[0] += 1.0
        assert await a.take(["k:requests"], 2, *args) == (2, 0.0)  # granted as ever
        assert await a.learn("k:requests", 300, 5, 3) == (True, 0.0)  # replaced
        assert await b.take(["k:requests"], 1, *args) == (1, 0.0)
        assert await b.learn("k:requests", 300, 5, 3) == (False, 1.0)
