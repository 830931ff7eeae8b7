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
  long until one more is there.  A bucket may be told to *hold* less than its limit for
  takes: the requests bucket holds a second's share of its limit (`Limiter.fleet_hold`),
  so a per-minute budget banked while another budget bound is let go to the fleet at
  its rate, as one relay lets it go to a crowd, not in one burst that each relay then
  sends at its own second's share (two relays sent 12 to 14 requests in a second of a
  5-a-second limit).
* **Learn** (`fleet_learn`): a provider's report lowers the fleet's level to what it
  says is left, never raises it (refills do).
* **What was granted** (`read_granted`): each bucket counts what its takes granted in
  all (``granted``), and a report is answered with it: over a window, what the key
  refilled less what its reported level fell by and what the fleet was granted is
  what traffic the fleet does not see took (`core.admission.bucket`).  A total that
  is garbage is left by takes and replaced by the next report (which says it replaced
  garbage), counted afresh from 0.
* **One line for the fleet** (`LineMark`): the relays' lines are served oldest first,
  across the fleet, as one relay serves its own.  A take says who asks (``me``) and how
  long its longest-waiting turn has waited (``age``).  A take that runs short leaves a
  *mark*: who it was and since when its oldest turn waits (at the store's clock).  A
  relay whose oldest turn is younger than another relay's mark (by more than
  `ORDER_TOL_S`) is granted nothing and asks again shortly: the older turn goes first.
  Without it the relays that ask at each refill split the fleet's rate evenly,
  whatever their lines: ``serve --workers 2``'s kernel gave one worker 25 of 40 agents
  and those got fewer turns (fairness 0.81; the simulator, `bench/fleet_sim.py
  --first-share 0.625`, shows the same).  The mark is its owner's until it is served
  (its next take is not short) and lasts `MARK_S` unless renewed (a relay that died
  holds no line for long); a mark that is not a valid one is ignored and replaced.
  A lone relay owns every mark it leaves: it never waits on one.

Nothing here reads a clock: ``now`` is the store's clock, passed in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BLOCKED_WAIT_S",
    "GARBAGE",
    "MARK_S",
    "MAX_AGE_S",
    "MAX_GRANTED",
    "MAX_OWNER",
    "ORDER_TOL_S",
    "UNKNOWN",
    "FleetBucket",
    "FleetTake",
    "LineMark",
    "fleet_learn",
    "fleet_take",
    "read_fleet_bucket",
    "read_granted",
    "read_line_mark",
]

#: a take's answer when a bucket is not there (expired, never taught): teach it
UNKNOWN = -1
#: ... when one is there but is garbage (replaced by the next report)
GARBAGE = -2
#: a shared bucket's limit or rate may be at most this many times off this relay's own
MAX_SKEW = 4.0
#: a line mark lasts this long unless its owner renews it (it asks again within
#: ``relay.ratestore.MAX_RETRY_S`` while its turns wait)
MARK_S = 1.5
#: a turn this much younger than the mark still counts as as old (round trips)
ORDER_TOL_S = 0.1
#: a relay whose turn is younger than the mark asks again after at least this long
BLOCKED_WAIT_S = 0.1
#: an age or a mark's time further back than this is garbage (no turn waits so long)
MAX_AGE_S = 3600.0
#: a mark's owner: at most this many bytes
MAX_OWNER = 64
#: a bucket's total granted past this is garbage (counted afresh: a relay's window of
#: it starts again, `core.admission.bucket.Drift.observe_fleet`)
MAX_GRANTED = 1e15


@dataclass(frozen=True, slots=True)
class FleetBucket:
    """One of the fleet's buckets: ``level`` of ``limit`` left at time ``t``, refilled
    at ``rate`` a second."""

    limit: float
    rate: float
    level: float
    t: float


@dataclass(frozen=True, slots=True)
class LineMark:
    """The fleet's oldest waiting turn that a take left short: its relay (``owner``),
    since when it waits (``head``, the store's clock), and until when the mark holds."""

    owner: str
    head: float
    until: float


@dataclass(frozen=True, slots=True)
class FleetTake:
    """A take's answer: ``granted`` requests (`UNKNOWN`, `GARBAGE`: none, and nothing
    written), the seconds until one more is there, and each bucket's new level (to be
    written with ``t = now``) and what was taken from it (added to its ``granted``);
    ``mark_changed``: write ``mark`` (None: delete it)."""

    granted: int
    wait_s: float
    levels: tuple[float, ...] = ()
    mark: LineMark | None = None
    mark_changed: bool = False
    taken: tuple[float, ...] = ()


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


def read_granted(value: object) -> float | None:
    """A bucket's total granted by takes (its ``granted`` field): 0 when there is none,
    None when it is garbage (not a number, below zero, past `MAX_GRANTED`: a take leaves
    it, a report replaces it with 0 and says it replaced garbage)."""
    if value is None:
        return 0.0
    g = _num(value)
    return g if g is not None and 0.0 <= g <= MAX_GRANTED else None


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


def _owner(value: object) -> str | None:
    """A mark's owner: a text of 1 to `MAX_OWNER` bytes (as Lua counts), else None."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or not 0 < len(value.encode("utf-8", "replace")) <= MAX_OWNER:
        return None
    return value


def read_line_mark(fields: Sequence[object] | None, now: float) -> LineMark | None:
    """A stored mark's ``(owner, head, until)``, validated: None when there is none, it
    has expired, or it is garbage (a head in the future or more than `MAX_AGE_S` back,
    an ``until`` more than `MARK_S` ahead, an owner that is no short text)."""
    if fields is None or len(fields) != 3:
        return None
    owner = _owner(fields[0])
    head, until = _num(fields[1]), _num(fields[2])
    if owner is None or head is None or until is None:
        return None
    if not now - MAX_AGE_S <= head <= now + ORDER_TOL_S or not now < until <= now + MARK_S:
        return None
    return LineMark(owner, head, until)


def fleet_take(
    rows: Sequence[Sequence[object] | None],
    want: int,
    costs: Sequence[float],
    limits: Sequence[float],
    rates: Sequence[float],
    now: float,
    *,
    me: str = "",
    age: float = 0.0,
    mark: Sequence[object] | None = None,
    holds: Sequence[object] | None = None,
) -> FleetTake:
    """Take up to ``want`` requests' worth from every bucket in ``rows`` (each its
    stored fields, None: not there), a request costing ``costs[i]`` of bucket ``i``;
    ``limits`` and ``rates`` are this relay's own view of each.  ``me``: who asks (""
    keeps no line order), ``age``: how long its oldest turn has waited, ``mark``: the
    stored line mark's fields (see the module docstring); ``holds``: the most each
    bucket banks for takes (missing, or not a number above zero: its limit)."""
    n = want
    wait = 0.0
    state: list[tuple[float, float]] = []
    for i, (row, my_limit, my_rate, asked) in enumerate(
        zip(rows, limits, rates, costs, strict=True)
    ):
        b = read_fleet_bucket(row, my_limit, my_rate, now)
        if b is None:
            return FleetTake(GARBAGE if row is not None else UNKNOWN, 0.0)
        cost = min(asked, b.limit)
        hold = _num(holds[i]) if holds is not None and i < len(holds) else None
        top = b.limit if hold is None or hold <= 0 else min(b.limit, max(hold, cost))
        level = min(top, b.level + (now - b.t) * b.rate)
        state.append((level, cost))
        if cost > 0:
            can = math.floor(level / cost + 1e-9)
            if can < n:
                n = max(can, 0)
            if level < cost:
                wait = max(wait, (cost - level) / b.rate)
    taken = tuple(n * cost for _, cost in state)
    if not me:
        return FleetTake(n, wait, tuple(level - n * cost for level, cost in state), taken=taken)
    line = read_line_mark(mark, now)
    waited = _num(age)
    since = now - min(max(waited if waited is not None else 0.0, 0.0), MAX_AGE_S)
    if line is not None and line.owner != me and since > line.head + ORDER_TOL_S:
        # another relay's turn has waited longer: it goes first
        return FleetTake(
            0,
            max(wait, BLOCKED_WAIT_S),
            tuple(level for level, _ in state),
            taken=(0.0,) * len(state),
        )
    levels = tuple(level - n * cost for level, cost in state)
    if n < want:  # short: this relay's oldest turn is the fleet's oldest waiting
        head = since if line is None or line.owner == me else min(since, line.head)
        return FleetTake(n, wait, levels, LineMark(me, head, now + MARK_S), True, taken)
    if line is not None and line.owner == me:  # served: the mark goes
        return FleetTake(n, wait, levels, None, True, taken)
    return FleetTake(n, wait, levels, taken=taken)


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
