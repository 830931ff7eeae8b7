"""Where upstream health is shared: `HealthStore` and its three kinds.

The health of every upstream lives in the process's `unbroken.core.admission.health.HealthBoard`,
which turns consult without ever waiting on I/O.  A store shares the board's
changes (breaker transitions and cool-offs) with the other relay processes, and
applies theirs to the local board:

* `HealthStore` (``[health] store = "memory"``, the default): in-process only.
* `RedisStore` (``store = "redis://host:6379/0"``, ``pip install 'unbroken[redis]'``):
  the fleet's state in Redis, through the official ``redis`` client's asyncio API.
  Keys (``K`` is ``route|url``)::

      unbroken:K:breaker          an open breaker; PX = the time it stays open
      unbroken:K:cooloff          a Retry-After or quota cool-off; PX = its length
      unbroken:K:probe            the half-open probe's owner (SET NX PX; a script
                                  shortens another's lease that is longer than ours)
      unbroken:K:n:<bucket>:ok    attempts per window bucket (INCR + EXPIRE)
      unbroken:K:n:<bucket>:fail
      unbroken:K:waiters          relays with turns in K's line: origin -> until (ms)
      unbroken:rl:K|<cred>:<b>    a provider's rate-limit budget b (requests, tokens) for
                                  one credential hash, the fleet's (`relay.ratestore`)
      channel unbroken:health     every change, JSON, for the other instances at once;
                                  and each throttle's measure (`relay.ratestore`)

  Turns never wait on Redis.  A change is written and published in the background;
  every instance applies what it hears on the channel within milliseconds and
  re-reads the keys every second (each read has a 50 ms budget, then local state is
  used).  The same read says how many relays have turns waiting in an upstream's
  line, and each splits the pacer's floor with them, so a dead upstream gets the
  floor from the whole fleet, not from every relay (a relay alone keeps all of it).
  When Redis is unreachable (an error, or no answer for 3 s: a stalled server) the
  relay keeps serving on local state, logs it once, reports ``degraded``, reconnects
  by itself (a dropped connection is retried at once, without degrading), logs once
  that Redis is back, and writes its local state back so the fleet shares it again.
  Everything read (TTLs, values, counts, marks, messages) is validated and clamped
  to this relay's own bounds by `unbroken.core.admission.shared`: a key that outlives them is
  shortened, garbage is logged once a minute per kind and never degrades the store.
* `ChannelStore` (`unbroken.relay.channel_store`): what ``unbroken serve --workers
  N`` uses when no Redis is configured; its docstring says how.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from unbroken.core.admission.health import Change, HealthBoard
from unbroken.core.admission.shared import (
    Garbage,
    Link,
    SharedBounds,
    escape,
    fleet_share,
    read_breaker,
    read_cooloff,
    read_count,
)
from unbroken.core.wire.redact import redact_url
from unbroken.relay.channel_store import SUN_PATH_MAX, ChannelStore, channel_socket
from unbroken.relay.ratestore import RateShare, RedisRates
from unbroken.relay.store_base import RESYNC_S, WAITERS_TTL_MS, HealthStore

__all__ = [
    "SUN_PATH_MAX",
    "ChannelStore",
    "HealthStore",
    "RedisStore",
    "channel_socket",
    "make_store",
]

log = logging.getLogger("unbroken")

CHANNEL = "unbroken:health"
#: an upstream's health keys in Redis: ``unbroken:<key>:`` and ``breaker``, ``cooloff``,
#: ``probe``, ``waiters`` or ``n:<bucket>:ok|fail`` (rate limits: `ratestore.RATE_KEY_PREFIX`)
HEALTH_KEY_PREFIX = "unbroken:"
READ_BUDGET_S = 0.05
#: a question for the probe lease unanswered this long: Redis is slow, not gone, and this
#: relay probes itself (the reads tell the rest)
PROBE_BUDGET_S = READ_BUDGET_S * 4
#: after a read that ran out of budget, the next one may take this long
SLOW_BUDGET_S = 0.5
#: no answer from Redis for this long (a stalled server): degraded
SILENT_S = 3.0
#: the floor is split among at most this many relays (a bound on garbage in Redis)
MAX_SHARE = 1000
#: a key that outlives this relay's bound is shortened to it (never lengthened)
SHORTEN = """
local t = redis.call('PTTL', KEYS[1])
if t == -1 or t > tonumber(ARGV[1]) then return redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 0
"""
#: the half-open probe: SET NX PX; another's lease that outlives ours (or has no
#: expiry: garbage) is shortened to ours.  Returns {1 mine | 0 not, its PTTL}.
PROBE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, tonumber(ARGV[2])} end
local t = redis.call('PTTL', KEYS[1])
if t == -1 or t > tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  t = tonumber(ARGV[2])
end
return {0, math.max(t, 0)}
"""
#: the probe lease given back: deleted only while it is still ours
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisStore(HealthStore):
    """The fleet's health in Redis (see the module docstring)."""

    kind = "redis"

    def __init__(
        self,
        board: HealthBoard,
        url: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = 0.5,
        bounds: SharedBounds | None = None,
    ) -> None:
        super().__init__(board, clock=clock, bounds=bounds)
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import ResponseError
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "[health] store is a redis:// URL but the redis client is not installed: "
                "pip install 'unbroken[redis]'"
            ) from exc
        self.url = url
        self.retry_s = retry_s
        #: a server's error reply (WRONGTYPE, a script's error): garbage, not an outage
        self._response_error: type[Exception] = ResponseError
        # A pooled connection that died (a restart, CLIENT KILL) is retried once on a
        # new one: a stale connection is not an outage.
        self.redis = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=1.0,
            socket_timeout=2.0,
            retry_on_timeout=False,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._shorten = self.redis.register_script(SHORTEN)
        self._probe = self.redis.register_script(PROBE)
        self._release = self.redis.register_script(RELEASE)
        self.link = Link(SILENT_S)
        self.up = False
        self._subscribed = False
        self._quick_at = float("-inf")
        self._slow = False
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=10_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: dict[str, tuple[bool, float]] = {}  # key -> (mine, until)
        self._asking: set[str] = set()
        self._side: set[asyncio.Future[None]] = set()
        self.fleet: dict[str, tuple[int, int]] = {}  # key -> (ok, failed) over the window
        self.board.probe_gate = self._probe_gate
        self.board.probe_release = self._probe_release
        #: the providers' rate-limit budgets, one per key across the fleet (leases)
        if board.rates.settings.enabled:
            self.rates = RateShare(
                board,
                RedisRates(self.redis),
                is_up=lambda: self.up,
                on_error=self._degrade,
                on_garbage=lambda why: self._ignored(why, "a rate-limit key"),
                tell=self._tell_throttle,
            )

    @property
    def degraded_since(self) -> float | None:
        return self.link.degraded_since

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "state": "ok" if self.up else "degraded",
            "url": redact_url(self.url),  # never a password (userinfo or ?password=)
            #: values from Redis ignored or clamped, per kind (`core.admission.shared.Garbage`)
            "ignored": dict(sorted(self.garbage.items())),
            #: the fleet's attempts over the window, per upstream: [ok, failed]
            "fleet_window": {k: list(v) for k, v in sorted(self.fleet.items()) if any(v)},
            #: rate-limit budgets shared through Redis, and the leases taken
            "ratelimits": self.rates.status() if self.rates is not None else None,
        }

    async def start(self) -> None:
        self._tasks = [
            asyncio.ensure_future(self._run()),
            asyncio.ensure_future(self._writer()),
        ]

    async def close(self) -> None:
        if self.rates is not None:
            self.rates.close()
        tasks = [*self._tasks, *self._side]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.redis.aclose()

    # -- writing -----------------------------------------------------------------------
    def publish(self, change: Change) -> None:
        if change.kind == "half_open" or not self.up:
            return  # half-open is each instance's own clock; degraded: local only
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(("change", change))

    def _broadcast(self, data: bytes) -> None:
        if self.up:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(("message", data))

    def count(self, key: str, failed: bool) -> None:
        if self.up:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(("count", (key, failed)))

    async def _writer(self) -> None:
        while True:
            # A cancellation swallowed below a write (library code) must still stop
            # the writer, or a draining worker never exits (issue 25).
            _stop_if_cancelled()
            what, item = await self._queue.get()
            try:
                if what == "change":
                    await self._write_change(item)
                elif what == "message":
                    await self.redis.publish(CHANNEL, item)
                else:
                    await self._write_count(*item)
            except asyncio.CancelledError:
                raise
            except self._response_error:
                self._ignored(Garbage.WRONG_TYPE, "a write")  # a key that is not ours
            except Exception as exc:
                self._degrade(exc)

    async def _write_change(self, change: Change) -> None:
        k = HEALTH_KEY_PREFIX + change.key
        # never longer than this relay's bounds (what it learned was clamped already)
        bound = self.bounds.bound(change.kind, change.reason)
        ttl_ms = max(1, int(min(change.ttl_s, bound) * 1000))
        pipe = self.redis.pipeline(transaction=False)
        if change.kind == "open":
            pipe.set(f"{k}:breaker", change.reopens, px=ttl_ms)
            pipe.delete(f"{k}:probe")
        elif change.kind == "close":
            pipe.delete(f"{k}:breaker", f"{k}:probe")
        elif change.kind == "cooloff":
            pipe.set(f"{k}:cooloff", change.reason or "cooloff", px=ttl_ms)
        pipe.publish(CHANNEL, self._encode(change))
        await pipe.execute()

    async def _write_count(self, key: str, failed: bool) -> None:
        window = self.board.settings.window_s
        bucket = int(time.time() // (window / 10))
        name = f"{HEALTH_KEY_PREFIX}{key}:n:{bucket}:{'fail' if failed else 'ok'}"
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(name)
        pipe.expire(name, int(window * 2) + 1)
        await pipe.execute()

    # -- the half-open probe: SET NX PX ---------------------------------------------------
    def _probe_gate(self, key: str, ttl_s: float) -> bool | None:
        if not self.up:
            return True  # degraded: every instance decides for itself
        now = self.clock()
        known = self._probes.pop(key, None)
        if known is not None and known[1] > now:
            return known[0]
        if key not in self._asking:
            self._asking.add(key)
            task = asyncio.ensure_future(self._ask_probe(key, ttl_s))
            self._side.add(task)
            task.add_done_callback(self._side.discard)
        return None

    def _probe_release(self, key: str) -> None:
        self._probes.pop(key, None)
        if self.up:
            self._spawn_write(
                self._release(keys=[f"{HEALTH_KEY_PREFIX}{key}:probe"], args=[self.origin])
            )

    async def _ask_probe(self, key: str, ttl_s: float) -> None:
        try:
            async with asyncio.timeout(PROBE_BUDGET_S):
                got = await self._probe(
                    keys=[f"{HEALTH_KEY_PREFIX}{key}:probe"],
                    args=[self.origin, max(1, int(ttl_s * 1000))],
                )
            # another's lease (never longer than ours: PROBE shortens it) ends at its PTTL
            mine, left_ms = read_count(got[0])[0] == 1, read_count(got[1])[0]
            self._probes[key] = (mine, self.clock() + (5.0 if mine else min(5.0, left_ms / 1000)))
        except TimeoutError:  # slow, not gone: this relay probes (the reads tell the rest)
            self._probes[key] = (True, self.clock() + 5.0)
        except Exception as exc:
            self._degrade(exc)
            self._probes[key] = (True, self.clock() + 5.0)
        finally:
            self._asking.discard(key)

    # -- reading: the channel, and a re-read every second -----------------------------------
    async def _run(self) -> None:
        while True:
            _stop_if_cancelled()  # (as the writer: a cancel swallowed below a read)
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                now = self.clock()
                if self._subscribed and self.up and now - self._quick_at > RESYNC_S:
                    # The session's connection dropped (a killed client, a restart):
                    # reconnect at once; only a reconnection that fails degrades.
                    self._subscribed, self._quick_at = False, now
                    continue
                self._degrade(exc)
            self._subscribed = False
            await asyncio.sleep(self.retry_s)

    async def _session(self) -> None:
        self._subscribed = False
        async with asyncio.timeout(2.0):
            await self.redis.ping()
        pubsub = self.redis.pubsub()
        try:
            async with asyncio.timeout(2.0):
                await pubsub.subscribe(CHANNEL)
            self._subscribed = True
            self._back()
            await self._read(budget=1.0)
            next_sync = self.clock() + RESYNC_S
            while True:
                _stop_if_cancelled()
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                if msg is not None and msg.get("type") == "message":
                    self._apply_message(msg["data"], "the channel")
                if self.clock() >= next_sync:
                    next_sync = self.clock() + RESYNC_S
                    # A writer's failure (a stale connection, a stall) marks the store
                    # degraded while this session still reads: a read that succeeds
                    # brings it back, so sharing never stops for good.
                    await self._read(budget=SLOW_BUDGET_S if self._slow else READ_BUDGET_S)
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await pubsub.aclose()

    async def _read(self, *, budget: float) -> None:
        """One re-read: an answer keeps (or brings) the store up; silence for
        ``SILENT_S`` (a stalled Redis) degrades it."""
        self._slow = not await self._resync(budget=budget)
        if not self._slow:
            self._back()
        elif self.link.silent(self.clock()):
            self._degraded_now(TimeoutError(f"no answer for {SILENT_S:g}s"))

    def _back(self) -> None:
        """Redis answers again: share again (logged once per outage)."""
        back = self.link.answered(self.clock())
        was_up, self.up = self.up, True
        if back:
            log.warning("health store: redis is back (%s)", self.status()["url"])
        if not was_up:
            for change in self._local_changes():  # share what we learned meanwhile
                self.publish(change)

    async def _resync(self, *, budget: float) -> bool:
        """Re-read every known upstream's keys; past ``budget`` seconds keep local state.
        True when Redis answered.  Each value is validated (`core.admission.shared`): garbage
        is ignored, a TTL beyond this relay's bounds is clamped and the key shortened."""
        keys = list(self.board.records)
        if not keys:
            return True
        window = self.board.settings.window_s
        width = window / 10
        wall_ms = int(time.time() * 1000)
        current = int(time.time() // width)
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            k = HEALTH_KEY_PREFIX + key
            pacer = self.board.pacers.get(key)
            if pacer is not None and pacer.queue:
                pipe.hset(f"{k}:waiters", self.origin, wall_ms + WAITERS_TTL_MS)
            else:
                pipe.hdel(f"{k}:waiters", self.origin)
            pipe.pexpire(f"{k}:waiters", WAITERS_TTL_MS * 2)
            pipe.hgetall(f"{k}:waiters")
            pipe.pttl(f"{k}:breaker")
            pipe.get(f"{k}:breaker")
            pipe.pttl(f"{k}:cooloff")
            pipe.get(f"{k}:cooloff")
            pipe.mget(
                [f"{k}:n:{b}:ok" for b in range(current - 9, current + 1)]
                + [f"{k}:n:{b}:fail" for b in range(current - 9, current + 1)]
            )
        try:
            async with asyncio.timeout(budget):
                # a key of the wrong type answers an error for its command only
                res = await pipe.execute(raise_on_error=False)
        except TimeoutError:
            return False  # slow Redis: local state stands until the next read
        now = self.clock()
        for i, key in enumerate(keys):
            mark, _, waiters, b_ttl, b_val, c_ttl, c_val, counts = res[i * 8 : (i + 1) * 8]
            k = HEALTH_KEY_PREFIX + key
            if isinstance(mark, Exception) or isinstance(waiters, Exception):
                # not a hash (we renew its TTL every second): it would never go away
                self._ignored(Garbage.WRONG_TYPE, f"{k}:waiters")
                self._spawn_write(self.redis.delete(f"{k}:waiters"))
                waiters = None
            self._share(key, waiters, wall_ms)
            for name, reading in (
                ("breaker", read_breaker(key, b_ttl, b_val, self.bounds)),
                ("cooloff", read_cooloff(key, c_ttl, c_val, self.bounds)),
            ):
                self._apply_reading(reading, f"{k}:{name}")
                if reading.shorten_ms is not None:
                    self._spawn_write(
                        self._shorten(keys=[f"{k}:{name}"], args=[reading.shorten_ms])
                    )
            nums = []
            if isinstance(counts, list):
                for x in counts:
                    n, bad = read_count(x)
                    nums.append(n)
                    if bad:
                        self._ignored(Garbage.VALUE, f"{k}:n")
            else:
                self._ignored(Garbage.WRONG_TYPE, f"{k}:n")
            nums += [0] * (20 - len(nums))
            ok, failed = self.fleet[key] = (sum(nums[:10]), sum(nums[10:20]))
            self.board.fleet_window(key, ok, failed, now)
        return True

    def _spawn_write(self, coro: Any) -> None:
        """A repair in the background (shortening a key, removing a garbage one)."""

        async def run() -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await coro

        task = asyncio.ensure_future(run())
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def _share(self, key: str, waiters: Any, wall_ms: int) -> None:
        """How many relays have turns in ``key``'s line (this one counts itself): the
        pacer's floor is split among them.  Garbage counts as nobody."""
        n, garbage = fleet_share(waiters, wall_ms, WAITERS_TTL_MS, MAX_SHARE)
        if garbage:
            self._ignored(Garbage.VALUE, f"{HEALTH_KEY_PREFIX}{key}:waiters")
        pacer = self.board.pacers.get(key)
        if pacer is not None:
            pacer.share = n

    def _degrade(self, exc: BaseException) -> None:
        """An operation failed for want of Redis."""
        if isinstance(exc, self._response_error):  # Redis answered: garbage, not an outage
            self._ignored(Garbage.WRONG_TYPE, type(exc).__name__)
            return
        self._degraded_now(exc)

    def _degraded_now(self, exc: BaseException) -> None:
        self.up = False
        if self.rates is not None:
            self.rates.unshare_all()  # local pacing until Redis is back
        if self.link.failed(self.clock()):
            log.warning(
                "health store degraded: redis unreachable (%s: %s); serving on local state, "
                "reconnecting",
                type(exc).__name__,
                escape(str(exc)),
            )


def make_store(
    board: HealthBoard,
    url: str,
    *,
    channel_dir: str | None = None,
    worker: int | None = None,
    bounds: SharedBounds | None = None,
) -> HealthStore:
    """The store ``[health] store`` names (workers without one share a local channel);
    ``bounds``: the local config's limits on what the others may impose."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(board, url, bounds=bounds)
    if channel_dir is not None and worker is not None:
        return ChannelStore(board, channel_dir, worker, bounds=bounds)
    return HealthStore(board, bounds=bounds)


def _stop_if_cancelled() -> None:
    """Raise `CancelledError` if the current task was cancelled and library code below
    an await swallowed it (the task stays *cancelling*): a loop that went on would
    never end, and a draining worker would never exit."""
    me = asyncio.current_task()
    if me is not None and me.cancelling():
        raise asyncio.CancelledError
