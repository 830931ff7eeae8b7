"""The fleet's lease arithmetic in Python gives the answers Redis's Lua scripts give.

`unbroken.core.admission.leasemath` is what the workers' SQLite file runs
(`relay.ratefile`); `relay.ratestore.TAKE` and ``LEARN`` are what Redis runs.  Each
case of the table goes through both: the scripts on a real ``redis-server``
(`redisfix`), with their clock set to the case's ``now`` (the one line that reads
``TIME`` is replaced, nothing else), and the Python functions on the same stored
fields.  Garbage buckets included: the answers, and what is written, agree.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import redis

from redisfix import RedisServer
from unbroken.core.admission.leasemath import (
    BLOCKED_WAIT_S,
    GARBAGE,
    MARK_S,
    UNKNOWN,
    FleetBucket,
    FleetTake,
    LineMark,
    fleet_learn,
    fleet_take,
    read_fleet_bucket,
    read_granted,
    read_line_mark,
)
from unbroken.relay.ratestore import LEARN, TAKE, TTL_MS

NOW = 1_000_000.5
_CLOCK = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) + tonumber(t[2]) / 1000000"


def _at(script: str, now: float) -> str:
    """The script with its clock at ``now`` (Redis's ``TIME`` replaced)."""
    assert _CLOCK in script
    return script.replace(_CLOCK, f"local now = {now!r}")


#: a bucket as stored: its fields (strings, as Redis keeps them), or None (no key)
Fields = tuple[Any, Any, Any, Any] | None


def fields(limit: Any, rate: Any, level: Any, t: Any) -> Fields:
    return (str(limit), str(rate), str(level), str(t))


#: (case, stored buckets, want, costs, this relay's limits, rates)
TAKES: list[tuple[str, list[Fields], int, list[float], list[float], list[float]]] = [
    ("full, one asks one", [fields(300, 5, 300, NOW)], 1, [1.0], [300], [5]),
    ("full, asks sixteen", [fields(300, 5, 300, NOW)], 16, [1.0], [300], [5]),
    ("spent, refills in 0.3 s", [fields(300, 5, 0, NOW - 0.3)], 4, [1.0], [300], [5]),
    ("spent now: a wait", [fields(300, 5, 0.25, NOW)], 3, [1.0], [300], [5]),
    ("in debt", [fields(300, 5, -40, NOW - 1)], 2, [1.0], [300], [5]),
    ("refill capped at the limit", [fields(300, 5, 299, NOW - 600)], 16, [1.0], [300], [5]),
    ("time ahead of the clock", [fields(300, 5, 2.5, NOW + 50)], 5, [1.0], [300], [5]),
    (
        "requests and tokens: the scarcer decides",
        [fields(300, 5, 10, NOW - 0.1), fields(450000, 7500, 30000, NOW - 0.1)],
        16,
        [1.0, 9000.0],
        [300, 450000],
        [5, 7500],
    ),
    (
        "a cost above the limit is the limit",
        [fields(100, 2, 100, NOW)],
        2,
        [500.0],
        [100],
        [2],
    ),
    ("a zero cost", [fields(300, 5, 0, NOW)], 3, [0.0], [300], [5]),
    ("no key", [None], 2, [1.0], [300], [5]),
    ("no key for the second", [fields(300, 5, 300, NOW), None], 1, [1.0, 1.0], [300, 9], [5, 1]),
    ("garbage: rate 0, level -100", [fields(300, 0, -100, NOW)], 1, [1.0], [300], [5]),
    ("garbage: level past the limit", [fields(300, 5, 301, NOW)], 1, [1.0], [300], [5]),
    ("garbage: level below -limit", [fields(300, 5, -300.5, NOW)], 1, [1.0], [300], [5]),
    ("garbage: limit 0", [fields(0, 5, 0, NOW)], 1, [1.0], [300], [5]),
    ("garbage: NaN", [fields(300, 5, "nan", NOW)], 1, [1.0], [300], [5]),
    ("garbage: inf", [fields(300, "inf", 1, NOW)], 1, [1.0], [300], [5]),
    ("garbage: text", [fields(300, 5, "lots", NOW)], 1, [1.0], [300], [5]),
    ("garbage: empty", [fields(300, 5, "", NOW)], 1, [1.0], [300], [5]),
    ("garbage: a field missing", [("300", "5", None, str(NOW))], 1, [1.0], [300], [5]),
    ("garbage: limit 5x this relay's", [fields(1500, 5, 10, NOW)], 1, [1.0], [300], [5]),
    ("garbage: rate 5x below", [fields(300, 1, 10, NOW)], 1, [1.0], [300], [5]),
    ("within 4x: believed", [fields(1200, 20, 10, NOW)], 1, [1.0], [300], [5]),
    ("numbers as Redis writes them", [fields("3e2", " 5", "1.5e1", NOW)], 3, [1.0], [300], [5]),
]

#: (case, stored bucket, limit, rate, the reported level)
LEARNS: list[tuple[str, Fields, float, float, float]] = [
    ("new", None, 300, 5, 120),
    ("lowers", fields(300, 5, 200, NOW - 1), 300, 5, 120),
    ("never raises", fields(300, 5, 50, NOW - 1), 300, 5, 120),
    ("refilled first", fields(300, 5, 50, NOW - 20), 300, 5, 120),
    ("a new limit and rate", fields(300, 5, 100, NOW), 600, 10, 500),
    ("debt", fields(300, 5, 10, NOW), 300, 5, -30),
    ("replaces rate 0, level -100", fields(300, 0, -100, NOW), 300, 5, 120),
    ("replaces text", fields(300, 5, "lots", NOW), 300, 5, 120),
    ("replaces a limit 5x off", fields(1500, 5, 10, NOW), 300, 5, 120),
]


def _store(r: redis.Redis, key: str, f: Fields) -> None:
    r.delete(key)
    if f is None:
        return
    names = ("limit", "rate", "level", "t")
    r.hset(key, mapping={n: v for n, v in zip(names, f, strict=True) if v is not None})


def _stored(r: redis.Redis, key: str) -> tuple[float, ...]:
    got = r.hmget(key, "limit", "rate", "level", "t")
    return tuple(float(x) for x in got if x is not None)


def _close(a: float, b: float) -> bool:
    # Lua writes numbers with 14 significant digits (``tostring``)
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-9)


def test_take_and_learn_answer_as_the_lua_scripts_do(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    try:
        take = r.register_script(_at(TAKE, NOW))
        learn = r.register_script(_at(LEARN, NOW))
        for case, rows, want, costs, limits, rates in TAKES:
            keys = [f"rl:{case}:{i}" for i in range(len(rows))]
            for k, f in zip(keys, rows, strict=True):
                _store(r, k, f)
            got, wait = take(keys=keys, args=[want, *costs, *limits, *rates, TTL_MS])
            py = fleet_take(rows, want, costs, limits, rates, NOW)
            assert (py.granted, _close(py.wait_s, float(wait))) == (got, True), (case, got, wait)
            if got >= 0:
                for k, level, taken in zip(keys, py.levels, py.taken, strict=True):
                    assert _close(_stored(r, k)[2], level), case
                    assert _stored(r, k)[3] == NOW, case
                    # what was granted from each bucket, added to its total (none before)
                    assert read_granted(r.hget(k, "granted")) == pytest.approx(taken), case
            else:
                assert not py.levels
        for case, f, limit, rate, value in LEARNS:
            k = f"rl:learn:{case}"
            _store(r, k, f)
            if f is not None:
                r.hset(k, "granted", "12.5")
            replaced, granted = learn(keys=[k], args=[limit, rate, value, TTL_MS])
            b, py_replaced = fleet_learn(f, limit, rate, value, NOW)
            assert py_replaced == (replaced == 1), case
            # the bucket's total granted, kept by a report (a replaced one starts afresh)
            kept = 12.5 if f is not None and not py_replaced else 0.0
            assert read_granted(granted) == kept, case
            lua = _stored(r, k)
            mine = (b.limit, b.rate, b.level, b.t)
            assert all(_close(x, y) for x, y in zip(lua, mine, strict=True)), (case, lua, mine)
        # a total that is garbage: a take leaves it (and grants as ever), a report says
        # it replaced garbage (the relay logs it) and counts afresh from 0
        for bad in ("lots", "-3", "inf", "1e99"):
            assert read_granted(bad) is None
            _store(r, "rl:g", fields(300, 5, 100, NOW))
            r.hset("rl:g", "granted", bad)
            assert take(keys=["rl:g"], args=[2, 1.0, 300, 5, TTL_MS])[0] == 2
            assert r.hget("rl:g", "granted") == bad.encode(), bad
            replaced, granted = learn(keys=["rl:g"], args=[300, 5, 10, TTL_MS])
            assert (replaced, read_granted(granted)) == (1, 0.0), bad
            assert take(keys=["rl:g"], args=[1, 1.0, 300, 5, TTL_MS])[0] == 1
            assert read_granted(r.hget("rl:g", "granted")) == 1.0, bad
        # a key of another type: garbage for both (the table in SQLite has no types:
        # a row whose fields are not numbers is its garbage)
        r.set("rl:string", "x")
        got, _ = take(keys=["rl:string"], args=[1, 1.0, 300, 5, TTL_MS])
        assert got == GARBAGE
        assert fleet_take([(None, None, None, None)], 1, [1.0], [300], [5], NOW).granted == GARBAGE
    finally:
        r.close()


def test_the_table_covers_every_answer() -> None:
    answers = {fleet_take(rows, w, c, lim, rt, NOW).granted for _, rows, w, c, lim, rt in TAKES}
    assert {UNKNOWN, GARBAGE, 0, 1, 16} <= answers


@pytest.mark.parametrize("bad", [True, b"\xff", object(), "1_0", (1, 2)])
def test_a_field_that_is_no_number_is_garbage(bad: Any) -> None:
    assert read_fleet_bucket((300, 5, bad, NOW), 300, 5, NOW) is None


def test_a_bucket_is_never_ahead_of_the_clock() -> None:
    assert read_fleet_bucket((300, 5, 1, NOW + 9), 300, 5, NOW) == FleetBucket(300, 5, 1, NOW)


# -- the fleet's line order (leasemath.LineMark) ------------------------------------------
#: a line mark as stored: (owner, head, until), or None (none)
Mark = tuple[Any, Any, Any] | None
FULL = fields(300, 5, 300, NOW)
SPENT = fields(300, 5, 0.5, NOW)
ONE = fields(300, 5, 1, NOW)

#: (case, the bucket, the stored mark, want, who asks, its oldest turn's age)
LINES: list[tuple[str, Fields, Mark, int, str, Any]] = [
    ("no mark, short: marks its oldest", SPENT, None, 3, "a", 2.0),
    ("no mark, served: no mark", FULL, None, 2, "a", 2.0),
    ("another's older mark: waits", FULL, ("b", NOW - 5, NOW + 1), 2, "a", 1.0),
    ("another's older mark, spent: waits", SPENT, ("b", NOW - 5, NOW + 1), 2, "a", 1.0),
    ("older than another's mark, short: takes it", ONE, ("b", NOW - 1, NOW + 1), 3, "a", 5.0),
    ("older than another's mark, served: it stays", FULL, ("b", NOW - 1, NOW + 1), 2, "a", 5.0),
    ("within the tolerance: goes", FULL, ("b", NOW - 1, NOW + 1), 2, "a", 0.95),
    ("just past the tolerance: waits", FULL, ("b", NOW - 1, NOW + 1), 2, "a", 0.85),
    ("its own mark, served: gone", FULL, ("a", NOW - 3, NOW + 1), 2, "a", 1.0),
    ("its own mark, short: renewed", SPENT, ("a", NOW - 3, NOW + 0.2), 2, "a", 1.0),
    ("an expired mark: none", FULL, ("b", NOW - 5, NOW - 0.1), 2, "a", 1.0),
    ("garbage: until too far ahead", FULL, ("b", NOW - 5, NOW + 100), 2, "a", 1.0),
    ("garbage: a head in the future", FULL, ("b", NOW + 5, NOW + 1), 2, "a", 1.0),
    ("garbage: a head an age ago", FULL, ("b", NOW - 4000, NOW + 1), 2, "a", 1.0),
    ("garbage: a head that is text", FULL, ("b", "soon", NOW + 1), 2, "a", 1.0),
    ("garbage: a NaN until", FULL, ("b", NOW - 5, "nan"), 2, "a", 1.0),
    ("garbage: an empty owner", FULL, ("", NOW - 5, NOW + 1), 2, "a", 1.0),
    ("garbage: a long owner", FULL, ("b" * 65, NOW - 5, NOW + 1), 2, "a", 1.0),
    ("garbage, short: replaced", SPENT, ("b", NOW - 5, NOW + 100), 2, "a", 1.0),
    ("nobody asks: no line order", FULL, ("b", NOW - 5, NOW + 1), 2, "", 1.0),
    ("an age below zero is zero", FULL, ("b", NOW - 0.05, NOW + 1), 2, "a", -9.0),
    ("an age that is no number is zero", FULL, ("b", NOW - 0.05, NOW + 1), 2, "a", "nan"),
    ("an age past an hour is an hour", ONE, ("b", NOW - 3599, NOW + 1), 3, "a", 1e12),
]


def _store_mark(r: redis.Redis, key: str, m: Mark) -> None:
    r.hdel(key, "lo", "lh", "lu")
    if m is not None:
        r.hset(key, mapping={"lo": str(m[0]), "lh": str(m[1]), "lu": str(m[2])})


def _mark_of(r: redis.Redis, key: str) -> tuple[str, str, str] | None:
    got = [x.decode() if isinstance(x, bytes) else x for x in r.hmget(key, "lo", "lh", "lu")]
    if got[0] is None:
        return None
    return str(got[0]), str(got[1]), str(got[2])


def _py_mark(m: Mark) -> tuple[str, str, str] | None:
    return None if m is None else (str(m[0]), str(m[1]), str(m[2]))


def test_the_fleet_line_answers_as_the_lua_script_does(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    try:
        take = r.register_script(_at(TAKE, NOW))
        for case, row, mark, want, me, age in LINES:
            k = f"rl:line:{case}"
            _store(r, k, row)
            _store_mark(r, k, mark)
            got, wait = take(keys=[k], args=[want, 1.0, 300, 5, TTL_MS, me, age])
            py = fleet_take(
                [row], want, [1.0], [300], [5], NOW, me=me, age=age, mark=_py_mark(mark)
            )
            assert (py.granted, _close(py.wait_s, float(wait))) == (got, True), (case, got, wait)
            assert _close(_stored(r, k)[2], py.levels[0]), case
            stored = _mark_of(r, k)
            if not py.mark_changed:  # untouched: what was there
                assert stored == _py_mark(mark), (case, stored)
            elif py.mark is None:
                assert stored is None, (case, stored)
            else:
                m = py.mark
                assert stored is not None and stored[0] == m.owner, (case, stored)
                assert _close(float(stored[1]), m.head), case
                assert _close(float(stored[2]), m.until), case
    finally:
        r.close()


def _line(case: str) -> FleetTake:
    _, row, mark, want, me, age = next(c for c in LINES if c[0] == case)
    return fleet_take([row], want, [1.0], [300], [5], NOW, me=me, age=age, mark=_py_mark(mark))


def test_the_oldest_turn_in_the_fleet_goes_first() -> None:
    waits = _line("another's older mark: waits")
    assert waits.granted == 0 and waits.wait_s == BLOCKED_WAIT_S and not waits.mark_changed
    assert waits.levels == (300.0,)  # nothing taken
    short = _line("no mark, short: marks its oldest")
    assert short.granted == 0 and short.mark == LineMark("a", NOW - 2.0, NOW + MARK_S)
    takes = _line("older than another's mark, short: takes it")
    assert takes.granted == 1 and takes.mark == LineMark("a", NOW - 5.0, NOW + MARK_S)
    assert _line("older than another's mark, served: it stays").mark_changed is False
    assert _line("within the tolerance: goes").granted == 2
    assert _line("just past the tolerance: waits").granted == 0
    mine = _line("its own mark, served: gone")
    assert mine.granted == 2 and mine.mark_changed and mine.mark is None
    assert _line("its own mark, short: renewed").mark == LineMark("a", NOW - 1.0, NOW + MARK_S)
    assert _line("nobody asks: no line order").granted == 2
    for case, *_ in LINES:
        if case.startswith("garbage") or case.startswith("an expired"):
            assert _line(case).granted == (0 if "short" in case else 2), case
    assert _line("an age past an hour is an hour").mark == LineMark("a", NOW - 3600.0, NOW + MARK_S)


def test_a_mark_is_read_only_when_valid() -> None:
    assert read_line_mark(("a", NOW - 1, NOW + 1), NOW) == LineMark("a", NOW - 1, NOW + 1)
    assert read_line_mark((b"a", b"1", b"2"), 1.5) == LineMark("a", 1.0, 2.0)
    for bad in [None, ("a", NOW), (b"\xff", NOW, NOW + 1), (1, NOW, NOW + 1), ("a", NOW, NOW)]:
        assert read_line_mark(bad, NOW) is None, bad


def test_one_bad_write_of_a_mark_holds_the_line_for_mark_s_at_most() -> None:
    """A well-formed mark nobody renews (a relay that died, or one write into the
    store): the others wait on it for `MARK_S` at most, then take as before."""
    evil = ("evil", NOW - 100.0, NOW + MARK_S)
    assert fleet_take([FULL], 2, [1.0], [300], [5], NOW, me="a", age=1.0, mark=evil).granted == 0
    later = NOW + MARK_S + 0.01
    full = fields(300, 5, 300, later)
    assert fleet_take([full], 2, [1.0], [300], [5], later, me="a", age=1.0, mark=evil).granted == 2
    # a mark written further ahead than a relay ever writes it is no mark at all
    far = ("evil", NOW - 100.0, NOW + 10 * MARK_S)
    assert fleet_take([FULL], 2, [1.0], [300], [5], NOW, me="a", age=1.0, mark=far).granted == 2


# -- what a bucket holds for a take (fleet_take's ``holds``) ---------------------------
#: (case, stored buckets, want, costs, limits, rates, holds)
HOLDS: list[tuple[str, list[Fields], int, list[float], list[float], list[float], list[Any]]] = [
    ("banked: a second's share", [FULL], 16, [1.0], [300], [5], [5.0]),
    (
        "banked long ago: still a second's share",
        [fields(300, 5, 300, NOW - 600)],
        16,
        [1.0],
        [300],
        [5],
        [5.0],
    ),
    ("below the hold: refills to it", [fields(300, 5, 1, NOW - 0.4)], 16, [1.0], [300], [5], [5.0]),
    (
        "in debt: the hold changes nothing",
        [fields(300, 5, -40, NOW - 1)],
        2,
        [1.0],
        [300],
        [5],
        [5.0],
    ),
    ("a hold above the limit is the limit", [FULL], 16, [1.0], [300], [5], [9e9]),
    ("a hold below a request's cost is its cost", [FULL], 4, [3.0], [300], [5], [0.5]),
    ("a hold of zero: the limit", [FULL], 16, [1.0], [300], [5], [0.0]),
    ("a hold below zero: the limit", [FULL], 16, [1.0], [300], [5], [-5.0]),
    ("a hold that is no number: the limit", [FULL], 16, [1.0], [300], [5], ["nan"]),
    ("no hold: the limit", [FULL], 16, [1.0], [300], [5], []),
    (
        "requests held, tokens not",
        [FULL, fields(450000, 7500, 450000, NOW)],
        16,
        [1.0, 500.0],
        [300, 450000],
        [5, 7500],
        [5.0, 0.0],
    ),
]


def test_a_hold_answers_as_the_lua_script_does(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    try:
        take = r.register_script(_at(TAKE, NOW))
        for case, rows, want, costs, limits, rates, holds in HOLDS:
            keys = [f"rl:hold:{case}:{i}" for i in range(len(rows))]
            for k, f in zip(keys, rows, strict=True):
                _store(r, k, f)
            args = [want, *costs, *limits, *rates, TTL_MS, "", 0, *holds]
            got, wait = take(keys=keys, args=args)
            py = fleet_take(rows, want, costs, limits, rates, NOW, holds=holds)
            assert (py.granted, _close(py.wait_s, float(wait))) == (got, True), (case, got, wait)
            for k, level in zip(keys, py.levels, strict=True):
                assert _close(_stored(r, k)[2], level), case
    finally:
        r.close()


def _held(case: str) -> FleetTake:
    _, rows, want, costs, limits, rates, holds = next(c for c in HOLDS if c[0] == case)
    return fleet_take(rows, want, costs, limits, rates, NOW, holds=holds)


def test_a_banked_budget_goes_to_the_fleet_a_second_at_a_time() -> None:
    """A per-minute budget banked while another bound (`tpm`: tokens) is let go at a
    second's share, then at its rate: two relays each taking sixteen of it and sending
    at their own second's share sent 12 to 14 requests in a second of a 5-a-second
    limit (the benchmark, before)."""
    assert _held("banked: a second's share").granted == 5
    assert _held("banked: a second's share").levels == (0.0,)
    assert _held("banked long ago: still a second's share").granted == 5
    assert _held("below the hold: refills to it").granted == 3
    assert _held("in debt: the hold changes nothing").granted == 0
    assert _held("requests held, tokens not").granted == 5
    assert _held("requests held, tokens not").levels == (0.0, 450000 - 5 * 500.0)
    # what the store cannot trust is the limit, as with no hold at all
    for case in ("a hold above the limit", "of zero", "below zero", "no number", "no hold"):
        [got] = [_held(c) for c, *_ in HOLDS if case in c]
        assert got.granted == 16, case
    assert _held("a hold below a request's cost is its cost").granted == 1
    # the old answer, without it: the whole bank at once
    assert fleet_take([FULL], 16, [1.0], [300], [5], NOW).granted == 16
