"""The fleet simulator's relays: the event loop, and what a relay's transport does
around the real core (`bench/fleet_sim.py` drives the turns).

* `Loop`: a discrete-event loop (a heap of timers, a virtual ``now``).
* `SimRelay`: one relay process: a real `HealthBoard` (with its `RateBoard`), and
  in Python what `unbroken.relay.pacing.Waker` does (wake a parked turn when the
  board's pump grants its ticket, when the upstream it waits out a delay for
  recovers, or at the wait's end; pump again when the board says), what
  `unbroken.relay.ratestore.RateShare` does (push reports with ``LEARN``, lease
  budget with ``TAKE``, unshare when the store is slow or down), and what
  `unbroken.relay.store.RedisHealthStore` does (publish breaker changes to the other
  relays, the half-open probe gate, windowed counters and the ``waiters`` marks
  read back every second).  The store is `fleet_sim_world.SimStore`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator
from functools import partial
from typing import TYPE_CHECKING, Any

from fleet_sim_world import SimStore, StoreDown
from unbroken.core.admission.health import Breaker, Change, HealthBoard, HealthSettings
from unbroken.core.admission.pacer import PaceSettings
from unbroken.core.admission.ratelimit import Limiter, RateSettings
from unbroken.core.admission.shared import lease_grant
from unbroken.relay.ratestore import BUDGET_S, MAX_LEASE, MAX_RETRY_S, MIN_RETRY_S, TTL_MS
from unbroken.relay.store_base import RESYNC_S, WAITERS_TTL_MS

#: the fleet's line order in leases (`leasemath.LineMark`, as `relay.ratestore` takes
#: them); False: the relays' lines unordered, as before it (for comparisons)
FLEET_LINE = True
#: relays tell each other their throttle's measure (after a decrease, or answering
#: one), and one served below its share is raised (the stores' ``throttle``
#: message; off: each corrects itself on its own 429s alone)
FLEET_THROTTLE = True
#: a take's requests bucket holds a second's share of its limit (`Limiter.fleet_hold`);
#: off: the whole limit, as before it
FLEET_HOLD = True
#: a decrease's measure is a question every sibling answers (off: answered only when
#: the sibling's own window is fresh, as before it)
FLEET_ASKS = True

if TYPE_CHECKING:
    from fleet_sim_agent import Agent

__all__ = ["Loop", "SimRelay", "Timer"]

#: a coroutine of the simulation: yields the seconds to sleep
Co = Generator[float, None, None]


class Timer:
    __slots__ = ("cancelled", "fn")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """A heap of timers at virtual times; ``now`` moves from one to the next."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self.events = 0

    def call_at(self, when: float, fn: Callable[[], None]) -> Timer:
        t = Timer(fn)
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, t))
        return t

    def call_later(self, delay: float, fn: Callable[[], None]) -> Timer:
        return self.call_at(self.now + max(delay, 0.0), fn)

    def call_soon(self, fn: Callable[[], None]) -> Timer:
        return self.call_at(self.now, fn)

    def spawn(self, co: Co) -> None:
        """Run a coroutine from the next iteration on (like ``ensure_future``)."""

        def step() -> None:
            try:
                delay = next(co)
            except StopIteration:
                return
            self.call_later(delay, step)

        self.call_soon(step)

    def run(self, until: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            when, _, t = pop(heap)
            if t.cancelled:
                continue
            self.now = when
            self.events += 1
            t.fn()
        self.now = until


class _Timeout(Exception):
    pass


def _charged(lim: Limiter) -> list[str]:
    return [n for n in ("requests", "tokens") if n in lim.buckets]


class SimRelay:
    """One relay (see the module docstring)."""

    def __init__(
        self,
        index: int,
        loop: Loop,
        *,
        health: HealthSettings,
        pace: PaceSettings,
        rate: RateSettings,
        store: SimStore | None,
    ) -> None:
        self.index = index
        self.loop = loop
        self.board = HealthBoard(health, pace=pace, rate=rate)
        self.board.pace_listener = self._poke
        #: the other relays sharing the store (set by the fleet)
        self.peers: list[SimRelay] = []
        self.store = store
        self.up = store is not None
        # -- the waker ----------------------------------------------------------------------
        self._tickets: dict[int, Agent] = {}
        self._delays: dict[str, dict[Agent, None]] = {}
        self._timers: dict[str, Timer] = {}
        self._scheduled: set[str] = set()
        # -- the rate share -----------------------------------------------------------------
        self._pushed: dict[tuple[int, str], int] = {}
        #: limiter -> its throttle's measures told to the peers (as RateShare's)
        self._told: dict[int, tuple[int, int]] = {}
        self._busy: set[int] = set()
        self._dirty: set[int] = set()
        self._again: dict[int, Timer] = {}
        self.leases = 0
        # -- the health store ---------------------------------------------------------------
        self._probes: dict[str, tuple[bool, float]] = {}
        self._asking: set[str] = set()
        if store is not None:
            self.board.rates.listeners.append(self._changed)
            self.board.listeners.append(self._on_change)
            self.board.probe_gate = self._probe_gate
            loop.call_later(RESYNC_S * (0.1 + 0.9 * store.rng.random()), self._resync)

    # -- waking turns (relay.pacing.Waker) ----------------------------------------------------
    def wait(self, agent: Agent, seconds: float, key: str | None, ticket: int) -> None:
        """Carry out a turn's `Wait`: it resumes through ``agent.wake``."""
        agent.waiting = True
        if key is not None:
            if ticket:
                self._tickets[ticket] = agent
                self._poke(key, False)  # it may be granted already
            else:
                self._delays.setdefault(key, {})[agent] = None
        agent.timer = self.loop.call_later(seconds, lambda: self.wake(agent))
        agent.wait_key, agent.wait_ticket = key, ticket

    def wake(self, agent: Agent) -> None:
        if not agent.waiting:
            return
        agent.waiting = False
        if agent.timer is not None:
            agent.timer.cancel()
            agent.timer = None
        key, ticket = agent.wait_key, agent.wait_ticket
        if ticket:
            if self._tickets.get(ticket) is agent:
                del self._tickets[ticket]
        elif key is not None:
            delays = self._delays.get(key)
            if delays is not None:
                delays.pop(agent, None)
        self.loop.call_soon(agent.resume)

    def _poke(self, key: str, recovered: bool) -> None:
        if recovered:
            for agent in list(self._delays.pop(key, {})):
                self.wake(agent)
        if key in self._scheduled:
            return
        self._scheduled.add(key)
        self.loop.call_soon(lambda: self._pump(key))

    def _pump(self, key: str) -> None:
        self._scheduled.discard(key)
        granted, due = self.board.pump(key, self.loop.now)
        tickets = self._tickets
        for ticket in granted:
            agent = tickets.get(ticket)
            if agent is not None:
                self.wake(agent)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if due is not None:
            self._timers[key] = self.loop.call_at(due, lambda: self._pump(key))

    # -- the rate share (relay.ratestore.RateShare) -------------------------------------------
    def _changed(self, key: str) -> None:
        by = self.board.rates.limiters.get(key)
        if not by:
            return
        for lim in by.values():
            if not self.up:
                self.unshare(lim)
                continue
            decreases, replies, anchor, demand = lim.news()
            told = self._told.get(id(lim), (0, 0))
            if FLEET_THROTTLE and (decreases, replies) != told:
                self._told[id(lim)] = (decreases, replies)
                asks = decreases != told[0] and FLEET_ASKS
                self.loop.spawn(self._tell_throttle(lim.key, lim.cred, anchor, demand, asks))
            reports = any(
                self._pushed.get((id(lim), n), -1) != lim.buckets[n].version for n in _charged(lim)
            )
            waiting = bool(lim.line) and any(lim.buckets[n].shared for n in _charged(lim))
            if reports or waiting:
                if id(lim) in self._busy:
                    self._dirty.add(id(lim))
                else:
                    self._busy.add(id(lim))
                    self.loop.spawn(self._work(lim))

    def unshare(self, lim: Limiter) -> None:
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

    def _op(self, t0: float) -> Generator[float, None, None]:
        """One round trip: half of it to the store (then the caller acts there), within
        the work's budget (`_Timeout`), failing when the store is down (`StoreDown`)."""
        assert self.store is not None
        rtt = self.store.rtt()
        left = t0 + BUDGET_S - self.loop.now
        if rtt > left:
            yield max(left, 0.0)
            raise _Timeout
        yield rtt / 2
        self.store.op(self.loop.now)

    def _work(self, lim: Limiter) -> Co:
        store = self.store
        assert store is not None
        t0 = self.loop.now
        lid = id(lim)
        try:
            for n in _charged(lim):  # _push
                b = lim.buckets[n]
                if self._pushed.get((lid, n), -1) == b.version:
                    continue
                if b.shared:
                    value = b.reported
                else:
                    b.refill(self.loop.now)
                    value = b.level
                version, limit, rate = b.version, b.limit, b.rate
                yield from self._op(t0)
                _, granted = store.learn(
                    self._name(lim, n), limit, rate, value, TTL_MS, self.loop.now
                )
                yield store.rtt() / 2
                lim.fleet_report(n, granted, self.loop.now)
                self._pushed[(lid, n)] = version
                if not b.shared:
                    b.shared = True
                    b.level = 0.0
            if lim.line and all(lim.buckets[n].shared for n in _charged(lim)):
                yield from self._lease(lim, t0)
        except _Timeout:
            self.unshare(lim)
        except StoreDown:
            yield store.rtt() / 2
            self.unshare(lim)
            self._degrade()
        finally:
            self._busy.discard(lid)
            if lid in self._dirty:
                self._dirty.discard(lid)
                self._again_in(lim, 0.0)

    def _lease(self, lim: Limiter, t0: float) -> Co:
        store = self.store
        assert store is not None
        names = _charged(lim)
        head = lim.line.head()
        if head is None or not names:
            return
        tokens = lim.line.costs.get(head, 0.0)
        costs = [1.0 if n == "requests" else tokens for n in names]
        views = [(lim.buckets[n].limit, max(lim.buckets[n].rate, 1e-9)) for n in names]
        if FLEET_HOLD:
            want = lim.lease_want(self.loop.now, MAX_LEASE, MAX_RETRY_S)
            if want <= 0:
                self._again_in(lim, MAX_RETRY_S / 2)
                return
        else:
            # (the old leases: all the line wants, but nothing while a block holds it,
            # as the old line was empty then: its turns waited in the pacer's line)
            want = 0 if lim.blocked_until > self.loop.now else min(len(lim.line), MAX_LEASE)
        yield from self._op(t0)
        raw_got, raw_wait = store.take(
            [self._name(lim, n) for n in names],
            want,
            costs,
            views,
            TTL_MS,
            self.loop.now,
            me=str(self.index) if FLEET_LINE else "",
            age=lim.line.waited(self.loop.now),
            holds=tuple(lim.fleet_hold(n) for n in names) if FLEET_HOLD else (),
        )
        yield store.rtt() / 2
        got, wait = lease_grant(raw_got, raw_wait, want, MAX_RETRY_S)
        if got < 0:
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
        key = id(lim)
        old = self._again.pop(key, None)
        if old is not None:
            old.cancel()

        def fire() -> None:
            self._again.pop(key, None)
            self.board.rates.changed(lim.key)

        self._again[key] = self.loop.call_later(delay, fire)

    def _name(self, lim: Limiter, bucket: str) -> str:
        return f"unbroken:rl:{lim.key}|{lim.cred}:{bucket}"

    # -- the health store (relay.store.RedisHealthStore) --------------------------------------
    def _degrade(self) -> None:
        if self.up:
            self.up = False
            self.unshare_all()

    def _on_change(self, change: Change) -> None:
        if change.remote or change.kind == "half_open" or not self.up:
            return
        written = None
        if change.kind in ("open", "close"):
            store = self.store
            assert store is not None
            written = partial(store.release_probe, change.key)
        self.loop.spawn(
            self._through_store(lambda peer: peer.board.apply(change, self.loop.now), written)
        )

    def _through_store(
        self, deliver: Callable[[SimRelay], None], written: Callable[[], None] | None = None
    ) -> Co:
        """One message through the store (a change, a throttle's news): written in half
        a round trip (then ``written``), heard by the other relays about as late as the
        writer's answer (``deliver`` to each that is up)."""
        store = self.store
        assert store is not None
        rtt = store.rtt()
        yield rtt / 2
        try:
            store.op(self.loop.now)
        except StoreDown:
            self._degrade()
            return
        if written is not None:
            written()
        yield rtt / 2
        for peer in self.peers:
            if peer.up:
                deliver(peer)

    def _tell_throttle(self, key: str, cred: str, anchor: float, demand: float, asks: bool) -> Co:
        """As the stores' ``throttle`` message (`RateShare.tell`, `sibling_news`): this
        relay's measure (after a decrease, or answering a sibling's); the peers'
        limiters of the same key and credential pool it (raised to their share)."""

        def deliver(peer: SimRelay) -> None:
            lim = peer.board.rates.limiters.get(key, {}).get(cred)
            if lim is None:
                return
            if lim.sibling_news(self.loop.now, str(self.index), anchor, demand, asks=asks):
                peer.board.rates.changed(key)

        return self._through_store(deliver)

    def _probe_gate(self, key: str, ttl_s: float) -> bool | None:
        if not self.up:
            return True
        now = self.loop.now
        known = self._probes.pop(key, None)
        if known is not None and known[1] > now:
            return known[0]
        if key not in self._asking:
            self._asking.add(key)
            self.loop.spawn(self._ask_probe(key, ttl_s))
        return None

    def _ask_probe(self, key: str, ttl_s: float) -> Co:
        store = self.store
        assert store is not None
        rtt = store.rtt()
        try:
            yield rtt / 2
            try:
                store.op(self.loop.now)
            except StoreDown:
                self._degrade()
                self._probes[key] = (True, self.loop.now + 5.0)
                return
            mine, left = store.probe(key, self.index, ttl_s, self.loop.now)
            yield rtt / 2
            self._probes[key] = (mine, self.loop.now + (5.0 if mine else min(5.0, left)))
        finally:
            self._asking.discard(key)

    def count(self, key: str, failed: bool) -> None:
        """An attempt's result for the fleet's windowed counters (fire and forget)."""
        store = self.store
        if store is None or not self.up:
            return
        width = self.board.settings.window_s / 10
        now = self.loop.now
        try:
            store.op(now)
        except StoreDown:
            self._degrade()
            return
        store.count(key, int(now // width), failed)

    def _resync(self) -> None:
        """Every second: the ``waiters`` marks (the pacer's floor split among the relays
        with turns in line) and the fleet's counters (`HealthBoard.fleet_window`)."""
        store = self.store
        assert store is not None
        self.loop.call_later(RESYNC_S, self._resync)
        if not self.board.records:
            return
        self.loop.spawn(self._read())

    def _read(self) -> Co:
        store = self.store
        assert store is not None
        rtt = store.rtt()
        yield rtt / 2
        now = self.loop.now
        try:
            store.op(now)
        except StoreDown:
            self._degrade()
            return
        width = self.board.settings.window_s / 10
        shares: dict[str, int] = {}
        fleet: dict[str, tuple[int, int]] = {}
        for key in list(self.board.records):
            pacer = self.board.pacers.get(key)
            until = now + WAITERS_TTL_MS / 1000 if pacer is not None and pacer.queue else None
            shares[key] = store.mark(key, self.index, until, now)
            fleet[key] = store.window(key, int(now // width))
        yield rtt / 2
        now = self.loop.now
        was_up, self.up = self.up, True
        if not was_up:  # back: share what this relay learned meanwhile
            for key, rec in self.board.records.items():
                if rec.state is Breaker.OPEN and rec.open_until > now:
                    self._on_change(Change(key, "open", rec.open_until - now, "resync", 0))
                if rec.cooloff_until > now:
                    self._on_change(Change(key, "cooloff", rec.cooloff_until - now, "resync"))
        for key, n in shares.items():
            pacer = self.board.pacers.get(key)
            if pacer is not None:
                pacer.share = n
            ok, failed = fleet[key]
            self.board.fleet_window(key, ok, failed, now)

    def view(self) -> dict[str, Any]:
        return {"waiting": len(self._tickets), "leases": self.leases, "up": self.up}
