"""The fleet simulator's world: the provider zoo, outages, and the shared store.

Everything here is the *simulated* side (`bench/fleet_sim.py` drives the real core
against it): a provider that enforces a rate limit and reports it (or not, or
wrongly) in its headers, and a store with the semantics of the relay's Redis
scripts (`unbroken.relay.ratestore`'s ``TAKE`` and ``LEARN``, the health store's
probe ``SET NX PX``, windowed counters and ``waiters`` marks), with a latency and
windows when it is down.  Time is the simulation's virtual ``now``.

The providers (the issue 32 zoo), each with a true limit of ``limit_rps`` requests
a second (``limit_rps * 60`` a minute):

==================  ==========================================================
``textbook``        a continuous per-minute bucket; truthful OpenAI headers;
                    429s carry ``retry-after`` (whole seconds, rounded up)
``quantized``       reports ``limit * 60`` a minute but enforces ``limit`` a
                    second; remaining is the minute's count; reset is when the
                    next request may go; no ``retry-after``
``no-retry-after``  ``textbook`` without ``retry-after`` on its 429s
``bare``            ``textbook``'s bucket, no headers at all, bare 429s
``anthropic``       ``quantized``'s enforcement, reported in
                    ``anthropic-ratelimit-*`` headers (RFC 3339 resets)
``tpm``             the token budget binds: large bodies (``tpm_body_bytes``);
                    requests and tokens reported, ``retry-after`` on 429s
``overstated``      ``textbook`` whose headers say ``overstate`` of the limit
                    more is left than there is
``shared``          ``textbook`` with a consumer the relays do not see taking
                    ``background_share`` of the limit
==================  ==========================================================
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from unbroken.core.admission.leasemath import fleet_learn, fleet_take

__all__ = [
    "OUTAGES",
    "PROVIDERS",
    "Outage",
    "ProviderModel",
    "SimStore",
    "provider_model",
]

#: the providers of the zoo, in the table's order
PROVIDERS = (
    "textbook",
    "quantized",
    "no-retry-after",
    "bare",
    "anthropic",
    "tpm",
    "overstated",
    "shared",
)
#: the outage patterns
OUTAGES = ("none", "outage", "brownout")
#: the wall clock at the simulation's time 0 (for RFC 3339 resets): any fixed date
WALL0 = 1_800_000_000.0


def go_duration(seconds: float) -> str:
    """A Go duration as OpenAI sends it (``20ms``, ``1.5s``, ``1m0.000s``)."""
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60.0)
    return f"{int(minutes)}m{rest:.3f}s" if minutes else f"{rest:.3f}s"


def rfc3339(wall: float) -> str:
    return (
        datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


class TrueBucket:
    """What the provider enforces: ``cap`` at most, refilled at ``rate`` a second."""

    __slots__ = ("cap", "level", "rate", "t")

    def __init__(self, cap: float, rate: float, level: float) -> None:
        self.cap, self.rate, self.level, self.t = cap, rate, level, 0.0

    def refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(self.cap, self.level + (now - self.t) * self.rate)
            self.t = now

    def wait(self, cost: float) -> float:
        """Seconds until ``cost`` is there (0: now)."""
        need = min(cost, self.cap) - self.level
        return 0.0 if need <= 1e-9 else need / self.rate

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.cap - self.level) / self.rate


@dataclass(frozen=True, slots=True)
class Outage:
    """``kind`` (``none``, ``outage``: every request a 503, ``brownout``: half of them)
    from ``start_s`` for ``duration_s``."""

    kind: str = "none"
    start_s: float = 20.0
    duration_s: float = 30.0

    def active(self, now: float) -> bool:
        return self.kind != "none" and self.start_s <= now < self.start_s + self.duration_s

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


class ProviderModel:
    """One key at one provider (see the module docstring for ``name``)."""

    def __init__(
        self,
        name: str,
        *,
        limit_rps: float,
        rng: random.Random,
        start_share: float = 0.0,
        overstate: float = 0.2,
        background_share: float = 0.4,
        tpm_body_bytes: int = 40_000,
    ) -> None:
        if name not in PROVIDERS:
            raise ValueError(f"provider: {name!r} is not one of {', '.join(PROVIDERS)}")
        self.name = name
        self.limit_rps = limit_rps
        self.rng = rng
        self.per_minute = limit_rps * 60.0
        self.overstate = overstate
        self.background_share = background_share if name == "shared" else 0.0
        quantized = name in ("quantized", "anthropic")
        cap = limit_rps if quantized else self.per_minute
        self.requests = TrueBucket(cap, limit_rps, cap * start_share)
        self.tokens: TrueBucket | None = None
        #: the request body's bytes, and the prompt tokens the provider counts for it
        self.body_bytes = tpm_body_bytes if name == "tpm" else 2_000
        self.prompt_tokens = self.body_bytes // 4
        if name == "tpm":
            # requests are plentiful (10x); the tokens budget allows limit_rps bodies a second
            self.requests = TrueBucket(self.per_minute * 10, limit_rps * 10, 0.0)
            self.requests.level = self.requests.cap * start_share
            tpm = self.per_minute * self.prompt_tokens
            self.tokens = TrueBucket(tpm, tpm / 60.0, tpm * start_share)
        #: ok request times of the last minute (the quantized providers' "remaining")
        self._minute: deque[float] = deque()
        self.ok = 0
        self.limited = 0
        self.background_ok = 0

    @property
    def quantized(self) -> bool:
        return self.name in ("quantized", "anthropic")

    def _charge(self, now: float, cost: float) -> float:
        """Spend one request (and ``cost`` tokens) if there; else the wait (> 0)."""
        req, tok = self.requests, self.tokens
        req.refill(now)
        wait = req.wait(1.0)
        if tok is not None:
            tok.refill(now)
            wait = max(wait, tok.wait(cost))
        if wait > 0:
            return wait
        req.level -= 1.0
        if tok is not None:
            tok.level -= min(cost, tok.cap)
        if self.quantized:
            self._minute.append(now)
        return 0.0

    def background(self, now: float) -> None:
        """One request of the consumer the relays do not see."""
        if self._charge(now, self.prompt_tokens) == 0.0:
            self.background_ok += 1

    def request(self, now: float) -> tuple[int, dict[str, str]]:
        """(200 or 429, the answer's headers) for one of the fleet's requests."""
        wait = self._charge(now, self.prompt_tokens)
        status = 200 if wait == 0.0 else 429
        if status == 200:
            self.ok += 1
        else:
            self.limited += 1
        headers = self._headers(now)
        if status == 429 and self.name in ("textbook", "tpm", "overstated", "shared"):
            headers["retry-after"] = str(max(1, math.ceil(wait)))
        return status, headers

    def _headers(self, now: float) -> dict[str, str]:
        name = self.name
        if name == "bare":
            return {}
        out: dict[str, str] = {}
        req = self.requests
        if self.quantized:
            minute = self._minute
            while minute and minute[0] <= now - 60.0:
                minute.popleft()
            limit = self.per_minute
            left = max(0.0, limit - len(minute))
            reset = req.wait(1.0)  # until the next request may go
        else:
            limit = req.cap
            left = req.level
            reset = req.reset_s()
            if name == "overstated":
                left = min(limit, left + self.overstate * limit)
                reset = max(0.0, limit - left) / req.rate
        readings = [("requests", limit, left, reset)]
        tok = self.tokens
        if tok is not None:
            readings.append(("tokens", tok.cap, tok.level, tok.reset_s()))
        for bucket, lim, rem, rs in readings:
            remaining = str(max(0, math.floor(rem)))
            if name == "anthropic":
                a = f"anthropic-ratelimit-{bucket}"
                out[f"{a}-limit"] = str(round(lim))
                out[f"{a}-remaining"] = remaining
                out[f"{a}-reset"] = rfc3339(WALL0 + now + rs)
            else:
                out[f"x-ratelimit-limit-{bucket}"] = str(round(lim))
                out[f"x-ratelimit-remaining-{bucket}"] = remaining
                out[f"x-ratelimit-reset-{bucket}"] = go_duration(rs)
        return out


def provider_model(name: str, limit_rps: float, rng: random.Random) -> ProviderModel:
    return ProviderModel(name, limit_rps=limit_rps, rng=rng)


# -- the store ---------------------------------------------------------------------------
class StoreDown(Exception):
    """The simulated store does not answer (a fault window)."""


class SimStore:
    """A Redis with the relay's scripts' semantics, a latency and down windows.

    ``latency_s``: a round trip's mean (each one is drawn in ``[0.5, 1.5]`` of it);
    ``down``: ``(start, end)`` windows where every operation fails.  ``ops`` counts
    round trips (a pipeline or a script call is one)."""

    def __init__(
        self,
        rng: random.Random,
        *,
        latency_s: float = 0.001,
        down: Sequence[tuple[float, float]] = (),
    ) -> None:
        self.rng = rng
        self.latency_s = latency_s
        self.down_windows = tuple(down)
        self.ops = 0
        #: rate buckets: name -> [limit, rate, level, t, expires]
        self.buckets: dict[str, list[float]] = {}
        #: the fleet's line marks: first bucket's name -> (owner, head, until)
        self.marks: dict[str, tuple[str, float, float]] = {}
        #: each bucket's total granted by takes (``granted`` in the Redis hash)
        self.granted: dict[str, float] = {}
        #: probe leases: key -> (owner, until)
        self.probes: dict[str, tuple[int, float]] = {}
        #: windowed counters: (key, bucket number, failed) -> count
        self.counts: dict[tuple[str, int, bool], int] = {}
        #: waiters marks: key -> {relay: until}
        self.waiters: dict[str, dict[int, float]] = {}

    def rtt(self) -> float:
        return self.latency_s * (0.5 + self.rng.random())

    def is_down(self, now: float) -> bool:
        return any(a <= now < b for a, b in self.down_windows)

    def op(self, now: float) -> None:
        """One round trip reaches the store at ``now`` (raises `StoreDown`)."""
        if self.is_down(now):
            raise StoreDown
        self.ops += 1

    # -- ratestore.TAKE / LEARN ------------------------------------------------------------
    def _row(self, name: str, now: float) -> list[float] | None:
        """A bucket's stored ``[limit, rate, level, t]`` (None: none, or it expired and is
        gone, as an expired Redis key); the scripts' arithmetic validates it."""
        b = self.buckets.get(name)
        if b is not None and b[4] <= now:
            del self.buckets[name]
            b = None
        return b[:4] if b is not None else None

    def take(
        self,
        names: Sequence[str],
        want: int,
        costs: Sequence[float],
        views: Sequence[tuple[float, float]],
        ttl_ms: int,
        now: float,
        *,
        me: str = "",
        age: float = 0.0,
        holds: tuple[float, ...] = (),
    ) -> tuple[int, str]:
        """``TAKE``: refill the fleet's buckets, take ``want`` requests' worth at most
        (``views``: the relay's own (limit, rate) of each bucket), the fleet's line in
        the order its turns came (`unbroken.core.admission.leasemath.fleet_take`)."""
        got = fleet_take(
            [self._row(name, now) for name in names],
            want,
            costs,
            [v[0] for v in views],
            [v[1] for v in views],
            now,
            me=me,
            age=age,
            mark=self.marks.get(names[0]),
            holds=holds,
        )
        if got.granted < 0:
            return got.granted, "0"
        for i, (name, level) in enumerate(zip(names, got.levels, strict=True)):
            b = self.buckets[name]
            b[2], b[3], b[4] = level, now, now + ttl_ms / 1000.0
            if i < len(got.taken):
                self.granted[name] = self.granted.get(name, 0.0) + got.taken[i]
        if got.mark_changed:
            m = got.mark
            if m is None:
                self.marks.pop(names[0], None)
            else:
                self.marks[names[0]] = (m.owner, m.head, m.until)
        return got.granted, repr(got.wait_s)

    def learn(
        self, name: str, limit: float, rate: float, value: float, ttl_ms: int, now: float
    ) -> tuple[int, float]:
        """``LEARN``: the fleet's level is lowered to a provider's report (never raised;
        `unbroken.core.admission.leasemath.fleet_learn`); (replaced, what takes have
        granted from the bucket in all)."""
        row = self._row(name, now)
        b, replaced = fleet_learn(row, limit, rate, value, now)
        if row is None or replaced:
            self.granted.pop(name, None)  # (an expired or replaced key's total goes too)
        self.buckets[name] = [b.limit, b.rate, b.level, b.t, now + ttl_ms / 1000.0]
        return int(replaced), self.granted.get(name, 0.0)

    def poison(self, now: float) -> None:
        """The issue's one write (``HSET ... rate 0 level -100``) on every rate bucket."""
        for b in self.buckets.values():
            b[1], b[2] = 0.0, -100.0
            b[4] = max(b[4], now + 120.0)

    # -- the health store ------------------------------------------------------------------
    def probe(self, key: str, owner: int, ttl_s: float, now: float) -> tuple[bool, float]:
        """``SET probe NX PX``: (this owner holds it, seconds left on the holder's lease)."""
        held = self.probes.get(key)
        if held is None or held[1] <= now:
            held = self.probes[key] = (owner, now + ttl_s)
        return held[0] == owner, held[1] - now

    def release_probe(self, key: str) -> None:
        self.probes.pop(key, None)

    def count(self, key: str, bucket: int, failed: bool) -> None:
        k = (key, bucket, failed)
        self.counts[k] = self.counts.get(k, 0) + 1

    def window(self, key: str, current: int) -> tuple[int, int]:
        ok = sum(self.counts.get((key, b, False), 0) for b in range(current - 9, current + 1))
        failed = sum(self.counts.get((key, b, True), 0) for b in range(current - 9, current + 1))
        return ok, failed

    def mark(self, key: str, relay: int, until: float | None, now: float) -> int:
        """Set (or clear) a relay's waiters mark; the relays with a live mark (>= 1)."""
        marks = self.waiters.setdefault(key, {})
        if until is None:
            marks.pop(relay, None)
        else:
            marks[relay] = until
        return max(1, sum(1 for u in marks.values() if u > now))
