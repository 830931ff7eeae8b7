"""Where upstream health is shared: `HealthStore` and its three kinds.

The health of every upstream lives in the process's `unbroken.core.health.HealthBoard`,
which turns consult without ever waiting on I/O.  A store shares the board's
changes (breaker transitions and cool-offs) with the other relay processes, and
applies theirs to the local board:

* `HealthStore` (``[health] store = "memory"``, the default): in-process only.
* `RedisStore` (``store = "redis://host:6379/0"``, ``pip install 'unbroken[redis]'``):
  the fleet's state in Redis, through the official ``redis`` client's asyncio API.
  Keys (``K`` is ``route|url``)::

      unbroken:K:breaker          an open breaker; PX = the time it stays open
      unbroken:K:cooloff          a Retry-After or quota cool-off; PX = its length
      unbroken:K:probe            the half-open probe's owner (SET NX PX)
      unbroken:K:n:<bucket>:ok    attempts per window bucket (INCR + EXPIRE)
      unbroken:K:n:<bucket>:fail
      unbroken:K:waiters          relays with turns in K's line: origin -> until (ms)
      unbroken:rl:K|<cred>:<b>    a provider's rate-limit budget b (requests, tokens) for
                                  one credential hash, the fleet's (`relay.ratestore`)
      channel unbroken:health     every change, JSON, for the other instances at once

  Turns never wait on Redis.  A change is written and published in the background;
  every instance applies what it hears on the channel within milliseconds and
  re-reads the keys every second (each read has a 50 ms budget, then local state is
  used).  The same read says how many relays have turns waiting in an upstream's
  line, and each splits the pacer's floor with them, so a dead upstream gets the
  floor from the whole fleet, not from every relay (a relay alone keeps all of it).
  When Redis is unreachable the relay keeps serving on local state, logs one
  warning per minute, reports ``degraded``, reconnects by itself, and then writes its
  local state back so the fleet shares it again.
* `ChannelStore`: what ``unbroken serve --workers N`` uses when no Redis is
  configured.  Each worker binds a Unix datagram socket in the supervisor's runtime
  directory and sends every change to its siblings' sockets (no broker, nothing to
  start, a dead sibling costs one failed ``sendto``); the half-open probe is owned by
  whoever creates ``probe-<hash>`` there first (``O_CREAT|O_EXCL``, expiring like
  ``PX``).  A worker that (re)starts asks its siblings for their state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.core.health import Breaker, Change, HealthBoard
from unbroken.core.redact import redact_url
from unbroken.relay.ratestore import RateShare

__all__ = ["ChannelStore", "HealthStore", "RedisStore", "make_store"]

log = logging.getLogger("unbroken")

CHANNEL = "unbroken:health"
PREFIX = "unbroken:"
READ_BUDGET_S = 0.05
RESYNC_S = 1.0
#: a relay's mark in an upstream's ``waiters`` hash lasts this long unless renewed
WAITERS_TTL_MS = 3000
#: the floor is split among at most this many relays (a bound on garbage in Redis)
MAX_SHARE = 1000
WARN_EVERY_S = 60.0


class HealthStore:
    """In-process health (the default): nothing is shared, nothing can fail."""

    kind = "memory"

    def __init__(self, board: HealthBoard, *, clock: Callable[[], float] = time.monotonic):
        self.board = board
        self.clock = clock
        self.origin = uuid.uuid4().hex[:12]
        self.up = True
        self.board.listeners.append(self._on_change)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _on_change(self, change: Change) -> None:
        if not change.remote:
            self.publish(change)

    def publish(self, change: Change) -> None:
        """Share a local change (the default store has no one to tell)."""

    def count(self, key: str, failed: bool) -> None:
        """One attempt's result, for the fleet's windowed counters."""

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": "ok" if self.up else "degraded"}

    # -- helpers for the shared stores ---------------------------------------------------
    def _encode(self, change: Change) -> bytes:
        return json.dumps(
            {
                "o": self.origin,
                "k": change.key,
                "kind": change.kind,
                "ttl": change.ttl_s,
                "r": change.reason,
                "n": change.reopens,
            }
        ).encode()

    def _apply_message(self, data: bytes | str) -> dict[str, Any] | None:
        try:
            msg = json.loads(data)
            if msg.get("o") == self.origin:
                return None
            if msg.get("kind") in ("open", "close", "cooloff"):
                self.board.apply(
                    Change(
                        str(msg["k"]),
                        str(msg["kind"]),
                        float(msg.get("ttl", 0.0)),
                        str(msg.get("r", "")),
                        int(msg.get("n", 0)),
                    ),
                    self.clock(),
                )
            return msg  # type: ignore[no-any-return]
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("health store: ignored a malformed message")
            return None

    def _local_changes(self) -> list[Change]:
        """The board's live opens and cool-offs, as changes (to re-share them)."""
        now = self.clock()
        out: list[Change] = []
        for key, rec in self.board.records.items():
            if rec.state is Breaker.OPEN and rec.open_until > now:
                out.append(Change(key, "open", rec.open_until - now, "resync", rec.reopens))
            if rec.cooloff_until > now:
                out.append(Change(key, "cooloff", rec.cooloff_until - now, rec.cooloff_reason))
        return out


class _Warner:
    """One warning per minute while a store is degraded."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last = -WARN_EVERY_S

    def warn(self, message: str, *args: Any) -> None:
        now = self.clock()
        if now - self.last >= WARN_EVERY_S:
            self.last = now
            log.warning(message, *args)


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
    ) -> None:
        super().__init__(board, clock=clock)
        try:
            import redis.asyncio as aioredis
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "[health] store is a redis:// URL but the redis client is not installed: "
                "pip install 'unbroken[redis]'"
            ) from exc
        self.url = url
        self.retry_s = retry_s
        self.redis = aioredis.Redis.from_url(
            url, socket_connect_timeout=1.0, socket_timeout=2.0, retry_on_timeout=False
        )
        self.up = False
        self.degraded_since: float | None = None
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=10_000)
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: dict[str, tuple[bool, float]] = {}  # key -> (mine, until)
        self._asking: set[str] = set()
        self._side: set[asyncio.Future[None]] = set()
        self._warner = _Warner(clock)
        self.fleet: dict[str, tuple[int, int]] = {}  # key -> (ok, failed) over the window
        self.board.probe_gate = self._probe_gate
        #: the providers' rate-limit budgets, one per key across the fleet (leases)
        self.rates: RateShare | None = None
        if board.rates.settings.enabled:
            self.rates = RateShare(board, self.redis, is_up=lambda: self.up, on_error=self._degrade)

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "state": "ok" if self.up else "degraded",
            "url": redact_url(self.url),  # never a password (userinfo or ?password=)
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

    def count(self, key: str, failed: bool) -> None:
        if self.up:
            with contextlib.suppress(asyncio.QueueFull):
                self._queue.put_nowait(("count", (key, failed)))

    async def _writer(self) -> None:
        while True:
            what, item = await self._queue.get()
            try:
                if what == "change":
                    await self._write_change(item)
                else:
                    await self._write_count(*item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._degrade(exc)

    async def _write_change(self, change: Change) -> None:
        k = PREFIX + change.key
        pipe = self.redis.pipeline(transaction=False)
        if change.kind == "open":
            pipe.set(f"{k}:breaker", change.reopens, px=max(1, int(change.ttl_s * 1000)))
            pipe.delete(f"{k}:probe")
        elif change.kind == "close":
            pipe.delete(f"{k}:breaker", f"{k}:probe")
        elif change.kind == "cooloff":
            pipe.set(
                f"{k}:cooloff", change.reason or "cooloff", px=max(1, int(change.ttl_s * 1000))
            )
        pipe.publish(CHANNEL, self._encode(change))
        await pipe.execute()

    async def _write_count(self, key: str, failed: bool) -> None:
        window = self.board.settings.window_s
        bucket = int(time.time() // (window / 10))
        name = f"{PREFIX}{key}:n:{bucket}:{'fail' if failed else 'ok'}"
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

    async def _ask_probe(self, key: str, ttl_s: float) -> None:
        try:
            async with asyncio.timeout(READ_BUDGET_S * 4):
                got = await self.redis.set(
                    f"{PREFIX}{key}:probe", self.origin, nx=True, px=int(ttl_s * 1000)
                )
            self._probes[key] = (bool(got), self.clock() + 5.0)
        except Exception as exc:
            self._degrade(exc)
            self._probes[key] = (True, self.clock() + 5.0)
        finally:
            self._asking.discard(key)

    # -- reading: the channel, and a re-read every second -----------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._degrade(exc)
            await asyncio.sleep(self.retry_s)

    async def _session(self) -> None:
        async with asyncio.timeout(2.0):
            await self.redis.ping()
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(CHANNEL)
            self._back()
            await self._resync(budget=1.0)
            next_sync = self.clock() + RESYNC_S
            while True:
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.25)
                if msg is not None and msg.get("type") == "message":
                    self._apply_message(msg["data"])
                if self.clock() >= next_sync:
                    next_sync = self.clock() + RESYNC_S
                    # A writer's failure (a stale connection after a restart, say) marks
                    # the store degraded while this session still reads: a read that
                    # succeeds brings it back, so sharing never stops for good.
                    if await self._resync(budget=READ_BUDGET_S) and not self.up:
                        self._back()
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _back(self) -> None:
        """Redis answers again: share again (logged once per outage)."""
        was_down = self.degraded_since is not None
        self.up = True
        self.degraded_since = None
        if was_down:
            log.warning("health store: redis is back (%s)", self.status()["url"])
        for change in self._local_changes():  # share what we learned meanwhile
            self.publish(change)

    async def _resync(self, *, budget: float) -> bool:
        """Re-read every known upstream's keys; past ``budget`` seconds keep local state.
        True when Redis answered."""
        keys = list(self.board.records)
        if not keys:
            return True
        window = self.board.settings.window_s
        width = window / 10
        wall_ms = int(time.time() * 1000)
        current = int(time.time() // width)
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            k = PREFIX + key
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
                res = await pipe.execute()
        except TimeoutError:
            return False  # slow Redis: local state stands until the next read
        now = self.clock()
        for i, key in enumerate(keys):
            _, _, waiters, b_ttl, b_val, c_ttl, c_val, counts = res[i * 8 : (i + 1) * 8]
            self._share(key, waiters, wall_ms)
            if isinstance(b_ttl, int) and b_ttl > 0:
                reopens = int(b_val or 0)
                self.board.apply(Change(key, "open", b_ttl / 1000.0, "fleet", reopens), now)
            if isinstance(c_ttl, int) and c_ttl > 0:
                reason = c_val.decode() if isinstance(c_val, bytes) else str(c_val or "")
                self.board.apply(Change(key, "cooloff", c_ttl / 1000.0, reason), now)
            nums = [int(x) if x is not None else 0 for x in counts]
            ok, failed = self.fleet[key] = (sum(nums[:10]), sum(nums[10:]))
            self.board.fleet_window(key, ok, failed, now)
        return True

    def _share(self, key: str, waiters: Any, wall_ms: int) -> None:
        """How many relays have turns in ``key``'s line (this one counts itself): the
        pacer's floor is split among them.  Garbage counts as nobody."""
        n = 0
        if isinstance(waiters, dict):
            for until in waiters.values():
                try:
                    if int(until) > wall_ms:
                        n += 1
                except (TypeError, ValueError):
                    continue
        pacer = self.board.pacers.get(key)
        if pacer is not None:
            pacer.share = min(max(n, 1), MAX_SHARE)

    def _degrade(self, exc: BaseException) -> None:
        if self.up or self.degraded_since is None:
            self.degraded_since = self.clock()
        self.up = False
        if self.rates is not None:
            self.rates.unshare_all()  # local pacing until Redis is back
        self._warner.warn(
            "health store degraded: redis unreachable (%s: %s); serving on local state, "
            "reconnecting",
            type(exc).__name__,
            exc,
        )


class ChannelStore(HealthStore):
    """Workers on one machine, no Redis: Unix datagrams between siblings (see above)."""

    kind = "workers"

    def __init__(
        self,
        board: HealthBoard,
        directory: str | os.PathLike[str],
        worker: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(board, clock=clock)
        self.dir = Path(directory)
        self.worker = worker
        self.path = self.dir / f"w{worker}.sock"
        self.sock: socket.socket | None = None
        self.board.probe_gate = self._probe_gate

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": "ok", "worker": self.worker}

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(str(self.path))
        self.sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)
        self._send(json.dumps({"o": self.origin, "kind": "hello", "w": self.worker}).encode())

    async def close(self) -> None:
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
            self.sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def publish(self, change: Change) -> None:
        if change.kind == "half_open":
            return
        if change.kind in ("open", "close"):
            with contextlib.suppress(FileNotFoundError):
                self._probe_path(change.key).unlink()
        self._send(self._encode(change))

    def _send(self, data: bytes, to: str | None = None) -> None:
        sock = self.sock
        if sock is None:
            return
        peers = (
            [to] if to else [str(p) for p in self.dir.glob("w*.sock") if p.name != self.path.name]
        )
        for peer in peers:
            try:
                sock.sendto(data, peer)
            except OSError:
                pass  # a sibling that is gone or restarting: it asks for state when back

    def _readable(self) -> None:
        sock = self.sock
        while sock is not None:
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            msg = self._apply_message(data)
            if msg is not None and msg.get("kind") == "hello":
                peer = str(self.dir / f"w{int(msg.get('w', -1))}.sock")
                for change in self._local_changes():
                    self._send(self._encode(change), to=peer)

    def _probe_path(self, key: str) -> Path:
        return self.dir / f"probe-{hashlib.sha1(key.encode()).hexdigest()[:16]}"

    def _probe_gate(self, key: str, ttl_s: float) -> bool | None:
        path = self._probe_path(key)
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                try:
                    age = time.time() - path.stat().st_mtime
                except FileNotFoundError:
                    continue
                if age > ttl_s:  # the owner's lease ran out
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    continue
                return False
            except OSError as exc:  # pragma: no cover - a broken runtime dir
                if exc.errno in (errno.EACCES, errno.ENOENT):
                    return True
                raise
            os.close(fd)
            return True
        return False


def make_store(
    board: HealthBoard,
    url: str,
    *,
    channel_dir: str | None = None,
    worker: int | None = None,
) -> HealthStore:
    """The store ``[health] store`` names (workers without one share a local channel)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(board, url)
    if channel_dir is not None and worker is not None:
        return ChannelStore(board, channel_dir, worker)
    return HealthStore(board)
