"""One rate-limit budget per key across a fleet, through Redis: leases taken atomically.

`RateShare` is written once over a backend (`RateBackend`): `RedisRates` (this
module's Lua scripts, below) for relays sharing a Redis, and
`unbroken.relay.ratefile.FileRates` (the same arithmetic,
`unbroken.core.admission.leasemath`, in SQLite transactions) for the workers of one
``serve --workers N`` without Redis.  What follows says it for Redis; the file's
module docstring says what differs.

The decisions are the core's (`unbroken.core.admission.ratelimit`): each relay admits turns
from its local buckets, synchronously, and never waits on Redis.  With a Redis
store, a bucket the provider has reported becomes *shared*: the fleet's level
lives in Redis (one hash per upstream, credential hash and budget)::

    unbroken:rl:<route>|<url>|<credential hash>:<bucket>   limit, rate, level, t

and the local level is a *lease*, budget this relay took out of the fleet's
bucket.  When turns wait in a shared limiter's line, this module takes a lease for
them in the background with one Lua script (`TAKE`: refill the fleet's buckets
by the time elapsed, at Redis's own clock, and take as many head-of-line requests'
worth as every bucket holds, all or nothing per request), adds it to the local
buckets and pokes the line, so the turns are let go as soon as Redis answers.  A
provider's report lowers the fleet's level to what it says is left (`LEARN`;
it never raises it: refills do).  Keys expire two minutes after their last use.

A relay asks for what it can send soon, less what it holds
(`Limiter.lease_want`), and a take banks at most a second's share of the requests
limit (`Limiter.fleet_hold`, the script's last arguments): a minute's budget banked
while another bound is let go to the fleet at the limit's rate, not sixteen at a
time to each relay.

The relays' lines are one line: a take says who asks and how long its oldest turn
has waited, and a relay whose oldest turn is younger than another relay's still
waiting one is granted nothing yet (`unbroken.core.admission.leasemath.LineMark`),
so the fleet's budget goes to the turns in the order they came, however unevenly the
agents are spread over the relays.

The relays' throttles (`unbroken.core.admission.throttle`) share what each was seen
to accept: when a limiter's admitted rate comes down, the store tells the siblings
(``tell``: a ``throttle`` message naming the key and the credential hash, with the
rate it was seen to accept and its demand, on Redis's channel or the workers'
datagrams; after a decrease the message is a question, ``"q": 1``); each sibling
that sent on that key lately answers with its own (to every question, and once a
window to any measure), and each pools them: a relay served below its share of the
fleet's accepted rate (by demand) is raised to it (`RateShare.sibling_news`).  One
cut by a 429 while a sibling took most answers no longer stays anchored low.

Redis unreachable or slower than the budget (250 ms): the limiter's buckets stop
being shared and refill locally again (each relay paces alone; a 429 then still
blocks its key and halves its window), and they are shared again with the next
report once the store is back.  A turn never waits on Redis itself.

What Redis holds is checked like the rest of the shared state (`unbroken.core.admission.shared`):
a bucket whose fields are not finite numbers (or a key of another type), whose rate
is not above zero, whose level is outside ``[-limit, limit]``, or whose limit or rate
is more than four times off this relay's own view of the budget is garbage: the
lease answers so, the relay logs it (once a minute) and teaches the bucket again,
and the report replaces it, so one bad write heals within one lease, fleet-wide.  A
line mark is believed only while it is well formed and at most `MARK_S` (1.5 s) ahead:
one bad write holds the fleet's line for 1.5 s at most.  A
bucket's time is never ahead of Redis's own clock; a lease is at most what was asked,
and a relay asks again no sooner than ``MIN_RETRY_S`` and no later than
``MAX_RETRY_S`` (the script says when).  An error answer from Redis is garbage,
logged once a minute, never an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from unbroken.core.admission.health import HealthBoard
from unbroken.core.admission.leasemath import (
    BLOCKED_WAIT_S,
    GARBAGE,
    MARK_S,
    MAX_AGE_S,
    MAX_GRANTED,
    MAX_OWNER,
    ORDER_TOL_S,
    read_granted,
)
from unbroken.core.admission.ratelimit import Limiter
from unbroken.core.admission.shared import Garbage, lease_grant

__all__ = ["RateBackend", "RateShare", "RedisRates"]

log = logging.getLogger("unbroken")

#: a rate-limit budget's keys in Redis: ``unbroken:rl:<key>|<credential>:<bucket>``
RATE_KEY_PREFIX = "unbroken:rl:"
TTL_MS = 120_000
BUDGET_S = 0.25
#: head-of-line requests a lease covers at most (more wait for the next one)
MAX_LEASE = 16
#: a fleet that has nothing left is asked again after at most this long
MAX_RETRY_S = 1.0
#: ... and after at least this long (never a busy loop of script calls while turns wait)
MIN_RETRY_S = 0.05

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function num(x)
  local v = tonumber(x)
  if v == nil or v ~= v or v == math.huge or v == -math.huge then return nil end
  return v
end
-- a bucket's fields, validated against this relay's own view of it (its limit and
-- rate): nil when it is not one of ours, or garbage (taught again, replaced)
local function bucket(k, mylimit, myrate)
  if redis.call('TYPE', k).ok ~= 'hash' then return nil end
  local h = redis.call('HMGET', k, 'limit', 'rate', 'level', 't')
  local limit, rate, level, at = num(h[1]), num(h[2]), num(h[3]), num(h[4])
  if not (limit and rate and level and at) or limit <= 0 or rate <= 0 then return nil end
  if level > limit or level < -limit then return nil end
  if limit > 4 * mylimit or limit * 4 < mylimit then return nil end
  if rate > 4 * myrate or rate * 4 < myrate then return nil end
  at = math.min(at, now)
  return limit, rate, level, at
end
"""

#: KEYS: the buckets; ARGV: most requests wanted, then per bucket its cost per request,
#: this relay's limit and its rate, then the ttl ms, who asks (its line mark's owner;
#: empty: no line order), how long its oldest turn has waited, and per bucket the most
#: it holds for a take (`leasemath.fleet_take`'s ``holds``; missing: its limit).
#: Returns {granted requests, seconds until one more is there} ({-1, 0}: unknown
#: bucket; {-2, 0}: a key there that is not a valid bucket, or one this relay's own view
#: calls garbage: taught again, replaced).  The fleet's line mark (`leasemath.LineMark`)
#: lives in the first bucket's hash: ``lo`` (owner), ``lh`` (head), ``lu`` (until).
TAKE = (
    _NOW
    + """
local n = tonumber(ARGV[1])
local nk = #KEYS
local ttl = tonumber(ARGV[2 + 3 * nk])
local me = ARGV[3 + 3 * nk] or ''
local state = {}
local wait = 0
for i, k in ipairs(KEYS) do
  local limit, rate, old, at = bucket(k, tonumber(ARGV[1 + nk + i]),
    tonumber(ARGV[1 + 2 * nk + i]))
  if not limit then return {redis.call('EXISTS', k) == 1 and -2 or -1, '0'} end
  local cost = math.min(tonumber(ARGV[i + 1]), limit)
  local hold, top = num(ARGV[4 + 3 * nk + i]), limit
  if hold and hold > 0 then top = math.min(limit, math.max(hold, cost)) end
  local level = math.min(top, old + (now - at) * rate)
  state[i] = {level, cost}
  if cost > 0 then
    local can = math.floor(level / cost + 1e-9)
    if can < n then n = math.max(can, 0) end
    if level < cost and rate > 0 then wait = math.max(wait, (cost - level) / rate) end
  end
end
local function spend(m)
  for i, k in ipairs(KEYS) do
    local level = state[i][1] - m * state[i][2]
    redis.call('HSET', k, 'level', tostring(level), 't', tostring(now))
    if m > 0 then
      local raw, g = redis.call('HGET', k, 'granted'), 0
      if raw then g = num(raw) end
      if g and g >= 0 and g <= MAX_GRANTED then  -- (garbage: left for LEARN to replace)
        redis.call('HSET', k, 'granted', tostring(g + m * state[i][2]))
      end
    end
    redis.call('PEXPIRE', k, ttl)
  end
end
if me == '' then
  spend(n)
  return {n, tostring(wait)}
end
local k1 = KEYS[1]
local mk = redis.call('HMGET', k1, 'lo', 'lh', 'lu')
local lo, lh, lu = mk[1], num(mk[2]), num(mk[3])
local live = lo and lh and lu and string.len(lo) > 0 and string.len(lo) <= MAX_OWNER
  and lh >= now - MAX_AGE_S and lh <= now + ORDER_TOL_S and lu > now and lu <= now + MARK_S
local age = math.min(math.max(num(ARGV[4 + 3 * nk]) or 0, 0), MAX_AGE_S)
local since = now - age
if live and lo ~= me and since > lh + ORDER_TOL_S then
  spend(0)  -- another relay's turn has waited longer: it goes first
  return {0, tostring(math.max(wait, BLOCKED_WAIT_S))}
end
spend(n)
if n < tonumber(ARGV[1]) then
  local head = since
  if live and lo ~= me then head = math.min(since, lh) end
  redis.call('HSET', k1, 'lo', me, 'lh', tostring(head), 'lu', tostring(now + MARK_S))
elseif live and lo == me then
  redis.call('HDEL', k1, 'lo', 'lh', 'lu')
end
return {n, tostring(wait)}
"""
)
for _name, _value in (
    ("MAX_OWNER", MAX_OWNER),
    ("MAX_AGE_S", MAX_AGE_S),
    ("ORDER_TOL_S", ORDER_TOL_S),
    ("MARK_S", MARK_S),
    ("BLOCKED_WAIT_S", BLOCKED_WAIT_S),
    ("MAX_GRANTED", MAX_GRANTED),
):
    TAKE = TAKE.replace(_name, repr(_value))
del _name, _value

#: KEYS: one bucket; ARGV: limit, rate, the level the provider's report implies, ttl ms.
#: Returns {1 when it replaced a key that was not a valid bucket (or a total granted
#: that was garbage: counted afresh from 0), else 0; what takes have granted from the
#: bucket in all (its ``granted`` field, `core.admission.bucket`'s fleet drift)}.
LEARN = (
    _NOW
    + """
local k = KEYS[1]
local limit, rate, value = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local olimit, orate, olevel, at = bucket(k, limit, rate)
local level = value
local replaced = 0
if olimit then
  level = math.min(math.min(olimit, olevel + (now - at) * orate), value)
elseif redis.call('EXISTS', k) == 1 then
  redis.call('DEL', k)  -- garbage (or another type): this report replaces it
  replaced = 1
end
redis.call('HSET', k, 'limit', tostring(limit), 'rate', tostring(rate),
  'level', tostring(level), 't', tostring(now))
redis.call('PEXPIRE', k, tonumber(ARGV[4]))
local raw, g = redis.call('HGET', k, 'granted'), 0
if raw then
  g = num(raw)
  if not g or g < 0 or g > MAX_GRANTED then  -- garbage: replaced, counted afresh
    g = 0
    replaced = 1
    redis.call('HSET', k, 'granted', '0')
  end
end
return {replaced, tostring(g)}
"""
).replace("MAX_GRANTED", repr(MAX_GRANTED))


class RateBackend(Protocol):
    """Where a fleet's buckets live, and the two atomic operations on them (the
    arithmetic is `unbroken.core.admission.leasemath`'s; Redis runs it as `TAKE`, `LEARN`)."""

    #: the errors that mean the store answered with garbage (not that it is away)
    garbage: tuple[type[BaseException], ...]

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
        """``(granted, wait)`` (see `TAKE`); each bounded by `lease_grant` afterwards.
        ``me``, ``age``: who asks and how long its oldest turn has waited (the fleet's
        line order; "" keeps none)."""
        ...

    async def learn(self, name: str, limit: float, rate: float, value: float) -> tuple[bool, float]:
        """Teach a report (see `LEARN`): whether it replaced garbage, and what takes
        have granted from the bucket in all."""
        ...

    def close(self) -> None: ...


def _charged(lim: Limiter) -> list[str]:
    """The buckets a request is charged ahead (not output: it only blocks when spent)."""
    return [n for n in ("requests", "tokens") if n in lim.buckets]


class RedisRates:
    """`RateShare`'s backend on Redis: the `TAKE` and `LEARN` scripts, at Redis's clock."""

    def __init__(self, redis: Any) -> None:
        from redis.exceptions import ResponseError

        #: Redis answered, with an error (a key of another type): garbage, not an outage
        self.garbage: tuple[type[BaseException], ...] = (ResponseError,)
        self._take = redis.register_script(TAKE)
        self._learn = redis.register_script(LEARN)

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
        got, wait = await self._take(
            keys=[RATE_KEY_PREFIX + n for n in names],
            args=[want, *costs, *limits, *rates, TTL_MS, me, age, *holds],
        )
        return got, wait

    async def learn(self, name: str, limit: float, rate: float, value: float) -> tuple[bool, float]:
        got = await self._learn(keys=[RATE_KEY_PREFIX + name], args=[limit, rate, value, TTL_MS])
        if not isinstance(got, list | tuple) or len(got) != 2:
            return False, 0.0
        granted = read_granted(got[1])  # (the script validated it)
        return got[0] == 1, granted if granted is not None else 0.0

    def close(self) -> None:
        pass


class RateShare:
    """A fleet store's share of the rate limiters (see the module docstring), over a
    backend: `RedisRates` (relays), `unbroken.relay.ratefile.FileRates` (workers)."""

    def __init__(
        self,
        board: HealthBoard,
        backend: RateBackend,
        *,
        is_up: Callable[[], bool],
        on_error: Callable[[BaseException], None],
        on_garbage: Callable[[Garbage], None] | None = None,
        on_answer: Callable[[], None] | None = None,
        tell: Callable[[str, str, float, float, bool], None] | None = None,
    ) -> None:
        self.board = board
        self.backend = backend
        self.is_up = is_up
        self.on_error = on_error
        self.on_garbage = on_garbage
        #: told when the backend answered (a store that logged an error logs "back")
        self.on_answer = on_answer
        #: tells the siblings a limiter's measure, after its throttle came down or in
        #: answer to theirs (the store's message: key, credential hash, anchor,
        #: demand, and whether it is a decrease's: a question); see `sibling_news`
        self.tell = tell
        #: (key, credential) -> the throttle's measures told so far (decreases, replies)
        self._told: dict[tuple[str, str], tuple[int, int]] = {}
        self.sibling_news_total = 0  # for /status
        #: (limiter, bucket) -> the report version pushed to the store
        self._pushed: dict[tuple[int, str], int] = {}
        self._busy: set[int] = set()  # limiters with a top-up under way
        self._dirty: set[int] = set()  # ... and a change since it began
        self._again: dict[int, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self.leases = 0  # leases taken (for /status)
        #: who this relay is in the fleet's line marks (`leasemath.LineMark`)
        self.me = uuid.uuid4().hex[:12]
        board.rates.listeners.append(self._changed)

    def close(self) -> None:
        for handle in self._again.values():
            handle.cancel()
        for task in self._tasks:
            task.cancel()
        self.backend.close()

    def status(self) -> dict[str, Any]:
        shared = sum(1 for lim in self.board.rates.all() for b in lim.buckets.values() if b.shared)
        return {
            "shared_buckets": shared,
            "leases": self.leases,
            "sibling_news": self.sibling_news_total,
        }

    def _name(self, lim: Limiter, bucket: str) -> str:
        """A bucket's name in the store (Redis: after `RATE_KEY_PREFIX`)."""
        return f"{lim.key}|{lim.cred}:{bucket}"

    # -- events ------------------------------------------------------------------------
    def _changed(self, key: str) -> None:
        by = self.board.rates.limiters.get(key)
        if not by:
            return
        up = self.is_up()
        for lim in by.values():
            decreases, replies, anchor, demand = lim.news()
            told = self._told.get((lim.key, lim.cred), (0, 0))
            if (decreases, replies) != told:
                self._told[(lim.key, lim.cred)] = (decreases, replies)
                if up and self.tell is not None:  # a decrease since: a question
                    self.tell(lim.key, lim.cred, anchor, demand, decreases != told[0])
            if not up:
                self.unshare(lim)
                continue
            reports = any(
                self._pushed.get((id(lim), n), -1) != lim.buckets[n].version for n in _charged(lim)
            )
            waiting = bool(lim.line) and any(lim.buckets[n].shared for n in _charged(lim))
            if reports or waiting:
                if id(lim) in self._busy:
                    self._dirty.add(id(lim))
                else:
                    self._spawn(self._work(lim))

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.ensure_future(coro)
        except RuntimeError:  # no running loop (a board used outside the relay)
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def sibling_news(
        self, key: str, cred: str, who: str, anchor: float, demand: float, asks: bool = True
    ) -> None:
        """Sibling ``who``'s measure for ``key`` and ``cred`` (its anchor and demand;
        ``asks``: a decrease's, which this relay answers): pooled by this relay's
        limiter, which may be raised to its share and may answer with its own
        (`core.admission.throttle.AdmissionThrottle.sibling_news`)."""
        lim = self.board.rates.limiters.get(key, {}).get(cred)
        if lim is None:
            return
        self.sibling_news_total += 1
        if lim.sibling_news(asyncio.get_running_loop().time(), who, anchor, demand, asks=asks):
            self.board.rates.changed(key)  # tells the answer; a new rate moves the line

    def unshare(self, lim: Limiter) -> None:
        """Local pacing for this limiter (Redis is away): its buckets refill locally."""
        changed = False
        for b in lim.buckets.values():
            if b.shared:
                b.shared = False
                changed = True
        if changed:
            for n in list(lim.buckets):
                self._pushed.pop((id(lim), n), None)
            poke = self.board.rates.poke
            if poke is not None:
                poke(lim.key)

    def unshare_all(self) -> None:
        for lim in list(self.board.rates.all()):
            self.unshare(lim)

    # -- the store ---------------------------------------------------------------------
    async def _work(self, lim: Limiter) -> None:
        self._busy.add(id(lim))
        try:
            async with asyncio.timeout(BUDGET_S):
                await self._push(lim)
                if lim.line and all(lim.buckets[n].shared for n in _charged(lim)):
                    await self._lease(lim)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self.unshare(lim)  # slow: pace locally until the next report
        except Exception as exc:
            self.unshare(lim)
            if isinstance(exc, self.backend.garbage):  # the store answered, with an error
                if self.on_garbage is not None:
                    why = getattr(exc, "why", None)
                    self.on_garbage(why if isinstance(why, Garbage) else Garbage.WRONG_TYPE)
            else:
                self.on_error(exc)
        else:
            if self.on_answer is not None:
                self.on_answer()
        finally:
            self._busy.discard(id(lim))
            if id(lim) in self._dirty:
                self._dirty.discard(id(lim))
                self._again_in(lim, 0.0)

    async def _push(self, lim: Limiter) -> None:
        """Share the provider's new reports: the fleet's level is lowered to them."""
        for n in _charged(lim):
            b = lim.buckets[n]
            if self._pushed.get((id(lim), n), -1) == b.version:
                continue
            if b.shared:
                value = b.reported  # the provider's new report
            else:  # sharing it (again): what this relay reckons is left now
                b.refill(asyncio.get_running_loop().time())
                value = b.level
            replaced, granted = await self.backend.learn(self._name(lim, n), b.limit, b.rate, value)
            if replaced and self.on_garbage is not None:
                self.on_garbage(Garbage.VALUE)
            self._pushed[(id(lim), n)] = b.version
            lim.fleet_report(n, granted, asyncio.get_running_loop().time())
            if not b.shared:
                b.shared = True
                b.level = 0.0  # from now on, what this relay holds is leased

    async def _lease(self, lim: Limiter) -> None:
        """Take budget for the turns in line from the fleet's buckets."""
        names = _charged(lim)
        head = lim.line.head()
        if head is None or not names:
            return
        tokens = lim.line.costs.get(head, 0.0)
        costs = [1.0 if n == "requests" else tokens for n in names]
        limits = [lim.buckets[n].limit for n in names]
        rates = [max(lim.buckets[n].rate, 1e-9) for n in names]
        want = lim.lease_want(asyncio.get_running_loop().time(), MAX_LEASE, MAX_RETRY_S)
        if want <= 0:  # what it holds covers what it may send for a while: ask later
            self._again_in(lim, MAX_RETRY_S / 2)
            return
        got, wait = await self.backend.take(
            [self._name(lim, n) for n in names],
            want,
            costs,
            limits,
            rates,
            me=self.me,
            age=lim.line.waited(asyncio.get_running_loop().time()),
            holds=tuple(lim.fleet_hold(n) for n in names),
        )
        if got == GARBAGE and self.on_garbage is not None:
            self.on_garbage(Garbage.VALUE)
        got, wait = lease_grant(got, wait, want, MAX_RETRY_S)
        if got < 0:  # the fleet forgot the bucket (expired, Redis restarted): teach it
            for n in names:
                self._pushed.pop((id(lim), n), None)
            self._again_in(lim, 0.0)
            return
        if got:
            self.leases += 1
            for n, cost in zip(names, costs, strict=True):
                b = lim.buckets[n]
                b.level += got * min(cost, b.limit)
            poke = self.board.rates.poke
            if poke is not None:
                poke(lim.key)
        if lim.line and (got < want or got == 0):
            self._again_in(lim, min(max(wait, MIN_RETRY_S), MAX_RETRY_S) if not got else 0.0)

    def _again_in(self, lim: Limiter, delay: float) -> None:
        """Ask again for ``lim`` after ``delay`` (the fleet's next refill)."""
        key = id(lim)
        old = self._again.pop(key, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._again.pop(key, None)
            with contextlib.suppress(Exception):
                self.board.rates.changed(lim.key)

        self._again[key] = loop.call_later(delay, fire)
