"""A small virtual-clock fleet against a model provider, for the rate-limit tests:
``agents`` run streamed turns back to back through one relay's `HealthBoard`, each
turn a real `RetryState` (pacer, limiter, throttle, retry delay), woken the way the
transport wakes it (at its `Park`'s time, or when the board's pump grants its ticket).
bench/fleet_sim.py is the full simulator; this one is small enough for a unit test."""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from unbroken.core.admission.health import HealthBoard
from unbroken.core.admission.policy import Failure, FailureClass, Park, RetryPolicy, RetryState
from unbroken.core.admission.ratehead import RateHeaders, Reading
from unbroken.core.admission.ratelimit import RateSettings

K = "r|http://a"


def most_in_a_second(times: list[float]) -> int:
    """The most of ``times`` within any one second (a sliding window)."""
    ts = sorted(times)
    return max(sum(1 for u in ts if t <= u < t + 1.0) for t in ts)


@dataclass
class Answer:
    status: int
    headers: RateHeaders
    retry_after_s: float | None = None


@dataclass
class Quantized:
    """Reports ``per_s * 60`` a minute, enforces ``per_s`` in each whole second; its
    reset says when the next request may go; 429s carry no Retry-After."""

    per_s: int = 5
    sent: list[float] = field(default_factory=list)
    used: Counter[int] = field(default_factory=Counter)

    def __call__(self, now: float) -> Answer:
        self.sent.append(now)
        second = math.floor(now)
        limit = self.per_s * 60
        minute = sum(1 for t in self.sent[-limit * 2 :] if now - t < 60.0)
        ok = self.used[second] < self.per_s
        if ok:
            self.used[second] += 1
        full = self.used[second] >= self.per_s
        reset = (second + 1 - now) if full else 0.0
        remaining = max(0, limit - minute)
        h = RateHeaders(requests=Reading(float(limit), float(remaining), reset))
        return Answer(200 if ok else 429, h)


@dataclass
class Bare:
    """A textbook bucket (``per_s`` a second, ``burst`` deep) that says nothing:
    no rate-limit headers, bare 429s."""

    per_s: float = 5.0
    burst: float = 5.0
    level: float = 5.0
    t: float = 0.0
    sent: list[float] = field(default_factory=list)

    def __call__(self, now: float) -> Answer:
        self.sent.append(now)
        self.level = min(self.burst, self.level + (now - self.t) * self.per_s)
        self.t = now
        if self.level >= 1.0:
            self.level -= 1.0
            return Answer(200, RateHeaders())
        return Answer(429, RateHeaders())


@dataclass
class Textbook:
    """A per-minute bucket (``per_s`` a second, a minute's worth deep) with truthful
    headers; ``overstate``: the share of the limit added to what it reports left;
    ``drain``: the share of the refill another consumer takes (the relay never sees
    it); ``retry_after``: 429s carry one (whole seconds, rounded up)."""

    per_s: float = 5.0
    start: float = 0.0  # the share of the bucket left when the run begins
    overstate: float = 0.0
    drain: float = 0.0
    retry_after: bool = True
    level: float = -1.0
    t: float = 0.0
    sent: list[float] = field(default_factory=list)

    def __call__(self, now: float) -> Answer:
        self.sent.append(now)
        limit = self.per_s * 60
        if self.level < 0:
            self.level = limit * self.start
        self.level = min(limit, self.level + (now - self.t) * self.per_s * (1 - self.drain))
        self.t = now
        ok = self.level >= 1.0
        if ok:
            self.level -= 1.0
        said = min(limit, self.level + self.overstate * limit)
        h = RateHeaders(
            requests=Reading(limit, math.floor(said), (limit - said) / self.per_s),
            retry_after_s=None,
        )
        if ok:
            return Answer(200, h)
        wait = math.ceil((1.0 - self.level) / (self.per_s * (1 - self.drain)))
        ra = float(wait) if self.retry_after else None
        return Answer(429, h, ra)


@dataclass
class Result:
    ok: int
    limited: int
    turns: int
    max_per_s: int  # most requests sent in any whole second
    longest_wait_s: float

    @property
    def share_429(self) -> float:
        return self.limited / max(1, self.ok + self.limited)


def run(
    provider: Callable[[float], Answer],
    *,
    agents: int = 40,
    seconds: float = 60.0,
    header_s: float = 0.05,
    stream_s: float = 0.5,
    settings: RateSettings | None = None,
    relays: int = 1,
) -> Result:
    """``relays`` relays that share nothing but the provider (``serve --workers`` with
    no store, or relays with no Redis), agents alternating between them."""
    boards = [HealthBoard(rate=settings or RateSettings()) for _ in range(relays)]
    queue: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()
    #: (relay, ticket) -> its wake-up
    parked: dict[tuple[int, int], Callable[[float], None]] = {}
    pumps: set[tuple[int, float]] = set()  # (relay, when) a pump is due
    stats = {"ok": 0, "limited": 0, "turns": 0}
    sends: Counter[int] = Counter()
    longest = [0.0]

    def at(t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(queue, (t, next(order), fn))

    def agent(i: int) -> None:
        board = boards[i % relays]
        state = RetryState(
            RetryPolicy(), 1, board=board, keys=[K], sticky=f"a{i}", creds=["c"], body_bytes=2000
        )
        gen = [0]
        waiting_since = [0.0]

        def attempt(now: float) -> None:
            gen[0] += 1
            got = state.next_upstream(now)
            if isinstance(got, Park):
                mine = gen[0]

                def wake(t: float) -> None:
                    if gen[0] == mine:
                        attempt(t)

                parked[(i % relays, state.ticket)] = wake
                at(got.until, wake)
                return
            parked.pop((i % relays, state.ticket), None)
            longest[0] = max(longest[0], now - waiting_since[0])
            sends[math.floor(now)] += 1
            answer = provider(now)
            at(now + header_s, lambda t: answered(t, answer))

        def answered(now: float, answer: Answer) -> None:
            state.record_rate(answer.headers, now)
            if answer.status == 200:
                stats["ok"] += 1
                state.record_answer(now)
                at(now + stream_s, done)
                return
            stats["limited"] += 1
            failure = Failure(
                FailureClass.STATUS, "HTTP 429", status=429, retry_after_s=answer.retry_after_s
            )
            wait = state.record_failure(failure, now)
            waiting_since[0] = now + wait
            at(now + wait, attempt)

        def done(now: float) -> None:
            state.settle(now, None)
            state.close(now)
            stats["turns"] += 1
            if now < seconds:
                agent_turn(now)

        def agent_turn(now: float) -> None:
            nonlocal state
            state = RetryState(
                RetryPolicy(),
                1,
                board=board,
                keys=[K],
                sticky=f"a{i}",
                creds=["c"],
                body_bytes=2000,
            )
            gen[0] += 1
            waiting_since[0] = now
            attempt(now)

        at(0.0, agent_turn)

    for i in range(agents):
        agent(i)
    while queue:
        now, _, fn = heapq.heappop(queue)
        if now > seconds + 120.0:
            break
        fn(now)
        for n, board in enumerate(boards):
            pumps.discard((n, now))
            granted, due = board.pump(K, now)
            for ticket in granted:
                wake = parked.pop((n, ticket), None)
                if wake is not None:
                    at(now, wake)
            if due is not None and due > now and (n, due) not in pumps:
                pumps.add((n, due))
                at(due, lambda t: None)
    return Result(stats["ok"], stats["limited"], stats["turns"], max(sends.values()), longest[0])
