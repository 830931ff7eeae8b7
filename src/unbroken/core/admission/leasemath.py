"""A fleet's rate-limit buckets, taken from and taught (sans-IO): the arithmetic of leases.

A shared store keeps one bucket per provider budget for the whole fleet (``limit``,
``rate``, ``level``, ``t``), and a relay takes leases from it
(`unbroken.relay.ratestore.RateShare`).  Redis runs this arithmetic in Lua, inside the
server (`unbroken.relay.ratestore.TAKE`, ``LEARN``); the workers of one ``serve
--workers N`` run it here, inside a SQLite transaction (`unbroken.relay.ratefile`).
Both give the same answers (tests/core/admission/test_leasemath.py runs a table of
cases through both):

* **Validated against this relay's own view** (`read_fleet_bucket`): every field is a
  finite number; the limit and the rate are above zero; the level is within
  ``[-limit, limit]``; the limit and the rate are at most four times off this relay's
  own.  Anything else is garbage: a take answers so (`GARBAGE`: the relay teaches the
  bucket again) and a report replaces it.  A bucket's time is never ahead of ``now``.
* **Take** (`fleet_take`): refill each bucket by the time elapsed, then grant as many
  head-of-line requests as every bucket holds (all or nothing per request), and say how
  long until one more is there.
* **Learn** (`fleet_learn`): a provider's report lowers the fleet's level to what it
  says is left, never raises it (refills do).

Nothing here reads a clock: ``now`` is the store's clock, passed in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GARBAGE",
    "UNKNOWN",
    "FleetBucket",
    "FleetTake",
    "fleet_learn",
    "fleet_take",
    "read_fleet_bucket",
]

#: a take's answer when a bucket is not there (expired, never taught): teach it
UNKNOWN = -1
#: ... when one is there but is garbage (replaced by the next report)
GARBAGE = -2
#: a shared bucket's limit or rate may be at most this many times off this relay's own
MAX_SKEW = 4.0


@dataclass(frozen=True, slots=True)
class FleetBucket:
    """One of the fleet's buckets: ``level`` of ``limit`` left at time ``t``, refilled
    at ``rate`` a second."""

    limit: float
    rate: float
    level: float
    t: float


@dataclass(frozen=True, slots=True)
class FleetTake:
    """A take's answer: ``granted`` requests (`UNKNOWN`, `GARBAGE`: none, and nothing
    written), the seconds until one more is there, and each bucket's new level (to be
    written with ``t = now``)."""

    granted: int
    wait_s: float
    levels: tuple[float, ...] = ()


def _num(value: object) -> float | None:
    """A finite number (a numeric string too: Redis keeps text), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        if "_" in value:  # float() reads "1_0"; Lua's tonumber does not
            return None
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def read_fleet_bucket(
    fields: Sequence[object] | None, my_limit: float, my_rate: float, now: float
) -> FleetBucket | None:
    """A stored bucket's ``(limit, rate, level, t)``, validated against this relay's own
    view of it (its limit and rate); None when there is none or it is garbage."""
    if fields is None or len(fields) != 4:
        return None
    limit, rate, level, at = (_num(f) for f in fields)
    if limit is None or rate is None or level is None or at is None:
        return None
    if limit <= 0 or rate <= 0 or level > limit or level < -limit:
        return None
    if limit > MAX_SKEW * my_limit or limit * MAX_SKEW < my_limit:
        return None
    if rate > MAX_SKEW * my_rate or rate * MAX_SKEW < my_rate:
        return None
    return FleetBucket(limit, rate, level, min(at, now))


def fleet_take(
    rows: Sequence[Sequence[object] | None],
    want: int,
    costs: Sequence[float],
    limits: Sequence[float],
    rates: Sequence[float],
    now: float,
) -> FleetTake:
    """Take up to ``want`` requests' worth from every bucket in ``rows`` (each its
    stored fields, None: not there), a request costing ``costs[i]`` of bucket ``i``;
    ``limits`` and ``rates`` are this relay's own view of each."""
    n = want
    wait = 0.0
    state: list[tuple[float, float]] = []
    for row, my_limit, my_rate, asked in zip(rows, limits, rates, costs, strict=True):
        b = read_fleet_bucket(row, my_limit, my_rate, now)
        if b is None:
            return FleetTake(GARBAGE if row is not None else UNKNOWN, 0.0)
        level = min(b.limit, b.level + (now - b.t) * b.rate)
        cost = min(asked, b.limit)
        state.append((level, cost))
        if cost > 0:
            can = math.floor(level / cost + 1e-9)
            if can < n:
                n = max(can, 0)
            if level < cost:
                wait = max(wait, (cost - level) / b.rate)
    return FleetTake(n, wait, tuple(level - n * cost for level, cost in state))


def fleet_learn(
    row: Sequence[object] | None, limit: float, rate: float, value: float, now: float
) -> tuple[FleetBucket, bool]:
    """A provider's report (``value`` left of ``limit``, refilling at ``rate``) taught to
    the stored bucket ``row``: the bucket to write, and whether it replaced garbage."""
    old = read_fleet_bucket(row, limit, rate, now)
    if old is not None:
        level = min(old.limit, old.level + (now - old.t) * old.rate, value)
        return FleetBucket(limit, rate, level, now), False
    return FleetBucket(limit, rate, value, now), row is not None
