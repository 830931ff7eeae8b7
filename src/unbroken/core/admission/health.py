"""Upstream health (sans-IO): circuit breakers, cool-offs and failure windows.

An upstream is identified by a *key* (``route|url``).  Its record
(`UpstreamHealth`) holds the breaker state (closed, open, half-open), when an open
breaker may be probed again, the consecutive failures, a windowed failure rate
and a cool-off (a ``Retry-After`` or an exhausted quota).  `HealthBoard` keeps the
records of one relay process and answers the two questions a turn asks:

* `HealthBoard.blocked_until`: may this upstream be used now, and if not, until when?
* `HealthBoard.take`: the turn commits to this upstream (a half-open breaker lets
  exactly one probe through; with a fleet, the probe gate decides which instance).

The breaker (the defaults are `HealthSettings`'):

* **closed** → **open** after ``failures_to_open`` consecutive failed attempts
  (connect errors, 5xx, stalls, cut streams; never a 4xx answer; a turn's repeated
  failures on one upstream count once, so a single request the provider always
  fails cannot open the breaker for everyone), or when the
  failure rate over ``window_s`` exceeds ``failure_rate_to_open`` (with at least
  ``min_window_attempts`` attempts in the window; with that many, only the rate
  counts);
* **open** → **half-open** once ``open_s`` has passed (``open_s`` doubles with every
  re-open, up to ``max_open_s``); while open, no turn sends it traffic;
* **half-open**: one probe goes through; success closes the breaker, failure re-opens it.
  With a fleet, the probe is leased (`ProbeGate`): the holder gives its lease back
  (`ProbeRelease`) the moment it has no probe out (its record leaves half-open by its
  own verdict or another's, or the probe's turn ended without one), and the others ask
  again every ``max_open_s`` rather than waiting out the lease, so recovery with
  workers is as quick as with one.  A lease whose holder never gives it back (a
  crash) is taken over when its holder is gone or after ``probe_timeout_s``
  (`probe_lease_stale`).

The breaker is the retry pacer's slow mode (`unbroken.core.admission.pacer`): the board keeps
each upstream's `Pacer`, and the turns waiting on an upstream wait in its line
whatever the reason (no token, an open breaker, a cool-off, a probe out).  ``open_s``
and ``max_open_s`` are short (0.25 s, a lone turn's own retry delay, doubling to 0.5 s),
so while turns wait a probe goes at least twice a second, one for the whole fleet, and
the line is released on the pacer's ramp as soon as an attempt is answered.  With many
attempts in the window the failure rate decides, not a run of consecutive failures (a
busy upstream that fails 30 % of its attempts would otherwise see five in a row every
few seconds).

Every change is given to the board's listeners as a `Change`: transitions for the
logs and metrics, and what a shared store (`unbroken.relay.store`) publishes to the
other instances.  Changes learned from another instance come in through `apply` and
are marked ``remote`` (a store does not publish them again).

Time is a monotonic ``now`` in seconds, passed in.  Nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.core.admission.pacer import Pacer, PaceSettings
from unbroken.core.admission.ratelimit import RateBoard, RateSettings

__all__ = [
    "QUOTA_LOOK_AGAIN_S",
    "AttemptAccounting",
    "Breaker",
    "Change",
    "HealthBoard",
    "HealthSettings",
    "PaceListener",
    "ProbeGate",
    "ProbeRelease",
    "UpstreamHealth",
    "probe_lease_stale",
    "upstream_key",
]

#: buckets per failure-rate window
BUCKETS = 10
#: a spent quota keeps its upstream out at most this long (``quota_cooloff_s`` is cut
#: to it): then the provider is looked at again, so a paid bill is noticed within a
#: minute.  A turn with no other upstream never waits for a quota: it goes to the
#: provider and ends with its answer (`HealthBoard.quota_until`).
QUOTA_LOOK_AGAIN_S = 60.0


class Breaker(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


def upstream_key(route: str, url: str) -> str:
    """An upstream's identity across processes and machines."""
    return f"{route}|{url}"


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """The ``[health]`` section."""

    breakers: bool = True
    failures_to_open: int = 5
    failure_rate_to_open: float = 0.5
    window_s: float = 30.0
    min_window_attempts: int = 20
    open_s: float = 0.25
    max_open_s: float = 0.5
    #: a spent quota keeps the upstream out this long (at most `QUOTA_LOOK_AGAIN_S`)
    quota_cooloff_s: float = 30.0
    probe_timeout_s: float = 30.0
    #: a parked turn is woken when the pacer grants it a go; it also looks again at
    #: least this often (a fallback: a change another instance did not publish)
    park_check_s: float = 1.0
    #: "" or "memory": in-process; "redis://host:port/db": shared through Redis
    store: str = ""


@dataclass(frozen=True, slots=True)
class Change:
    """A change of an upstream's health, for observers and for the shared store.

    ``kind``: ``open``, ``half_open``, ``close`` (breaker transitions) or ``cooloff``.
    ``ttl_s``: how long an ``open`` or ``cooloff`` lasts from now.
    """

    key: str
    kind: str
    ttl_s: float = 0.0
    reason: str = ""
    reopens: int = 0
    remote: bool = False
    old: Breaker | None = None

    @property
    def is_transition(self) -> bool:
        return self.kind != "cooloff"


#: told when an upstream's pacing may have changed: (key, recovered); ``recovered``:
#: the upstream answered after a run of failures (turns waiting out a delay may go)
PaceListener = Callable[[str, bool], None]

#: fleet-wide probe ownership: ``gate(key, ttl_s)`` is True (this instance probes),
#: False (another one does), or None (not known yet: look again shortly)
ProbeGate = Callable[[str, float], bool | None]

#: the lease the gate granted is given back: ``release(key)`` (no probe of ours is out)
ProbeRelease = Callable[[str], None]


def probe_lease_stale(age_s: float, ttl_s: float, *, holder_alive: bool) -> bool:
    """May another instance's probe lease be taken over?  Yes when its holder is gone
    (a crash: it can never give it back), or it is older than ``ttl_s`` (a holder that
    never reported), or dated further ahead than that (a clock that jumped)."""
    return not holder_alive or age_s > ttl_s or age_s < -ttl_s


@dataclass(slots=True)
class UpstreamHealth:
    key: str
    state: Breaker = Breaker.CLOSED
    open_until: float = 0.0
    reopens: int = 0  # re-opens since the breaker last closed (open_s doubles each)
    consecutive_failures: int = 0
    cooloff_until: float = 0.0
    cooloff_reason: str = ""
    probe_until: float = 0.0  # a probe is out (here or elsewhere) until then
    #: this instance sent the probe and holds its lease, the fleet's with a probe gate
    #: (given back as soon as no probe is out)
    probe_held: bool = False
    #: when the breaker last closed: the failures counted before are the outage's
    closed_at: float = float("-inf")
    #: bucket number -> [ok, failed]
    buckets: dict[int, list[int]] = field(default_factory=dict)

    def window(self, now: float, window_s: float) -> tuple[int, int]:
        """(ok, failed) attempts over the last ``window_s``."""
        width = window_s / BUCKETS
        current = int(now // width)
        ok = failed = 0
        for b in [b for b in self.buckets if b <= current - BUCKETS]:
            del self.buckets[b]
        for counts in self.buckets.values():
            ok += counts[0]
            failed += counts[1]
        return ok, failed

    def _count(self, now: float, window_s: float, slot: int) -> None:
        b = int(now // (window_s / BUCKETS))
        counts = self.buckets.get(b)
        if counts is None:
            # a new bucket: drop those that left the window (the dict stays <= BUCKETS + 1)
            for old in [o for o in self.buckets if o <= b - BUCKETS]:
                del self.buckets[old]
            counts = self.buckets[b] = [0, 0]
        counts[slot] += 1


class HealthBoard:
    """The health records of one relay process (see the module docstring)."""

    def __init__(
        self,
        settings: HealthSettings | None = None,
        *,
        probe_gate: ProbeGate | None = None,
        pace: PaceSettings | None = None,
        rate: RateSettings | None = None,
    ) -> None:
        self.settings = settings or HealthSettings()
        self.records: dict[str, UpstreamHealth] = {}
        self.listeners: list[Callable[[Change], None]] = []
        self.probe_gate = probe_gate
        #: told when this instance gives its probe lease back (the gate's transport)
        self.probe_release: ProbeRelease | None = None
        self.pace = pace or PaceSettings()
        #: each upstream's retry pacer (`core.admission.pacer`), made on first use
        self.pacers: dict[str, Pacer] = {}
        #: told when a line may move (the relay pumps it and wakes who it grants)
        self.pace_listener: PaceListener | None = None
        #: the providers' rate limits per upstream and credential (`core.admission.ratelimit`);
        #: their lines are pumped with the pacers' (one ticket, one line per turn)
        self.rates = RateBoard(rate)
        self.rates.poke = self._poke_rate
        self._tickets = 0

    def get(self, key: str) -> UpstreamHealth:
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = UpstreamHealth(key)
        return rec

    def _emit(self, change: Change) -> None:
        for listener in self.listeners:
            listener(change)
        if change.kind != "half_open":
            self._poke(change.key)

    def _poke(self, key: str, recovered: bool = False) -> None:
        """Tell the listener that ``key``'s line may move (only when someone waits)."""
        listener = self.pace_listener
        if listener is None:
            return
        if recovered:
            listener(key, True)
            return
        p = self.pacers.get(key)
        if (p is not None and (p.queue or p.granted)) or self.rates.waiting(key):
            listener(key, False)

    def _poke_rate(self, key: str) -> None:
        listener = self.pace_listener
        if listener is not None:
            listener(key, False)

    # -- pacing (`core.admission.pacer`) ----------------------------------------------
    def pacer(self, key: str) -> Pacer:
        p = self.pacers.get(key)
        if p is None:
            p = self.pacers[key] = Pacer(key, self.pace)
        return p

    def new_ticket(self) -> int:
        """A waiting retry's place-holder in the pacers' lines (unique per board)."""
        self._tickets += 1
        return self._tickets

    def admit(self, key: str, ticket: int, now: float) -> bool:
        """May this retry go to ``key`` now?  (False: it waits in that line.)"""
        p = self.pacer(key)
        ok = p.admit(ticket, now)
        if not ok:
            self._poke(key)
        return ok

    def peek(self, key: str, ticket: int, now: float) -> bool:
        p = self.pacers.get(key)
        return True if p is None else p.peek(ticket, now)

    def wait_in_line(self, key: str, ticket: int) -> None:
        """A turn waits for ``key`` (blocked: an open breaker, a cool-off, a probe out)."""
        p = self.pacer(key)
        if ticket not in p.queue and ticket not in p.granted:
            p.queue.append(ticket)
            p.waited_total += 1
            self._poke(key)

    def withdraw(self, key: str, ticket: int) -> None:
        p = self.pacers.get(key)
        if p is not None:
            p.withdraw(ticket)
            self._poke(key)

    def requeue(self, key: str, ticket: int) -> None:
        p = self.pacers.get(key)
        if p is not None:
            p.requeue(ticket)

    def pump(self, key: str, now: float) -> tuple[list[int], float | None]:
        """The tickets that may go to ``key`` now, and when to pump it next: its
        pacer's line and its rate limiters' lines."""
        granted, due = self._pump_pacer(key, now)
        if key in self.rates.limiters:
            more, when = self.rates.pump(key, now)
            if more:
                granted = [*granted, *more]
            if when is not None and (due is None or when < due):
                due = when
        return granted, due

    def _pump_pacer(self, key: str, now: float) -> tuple[list[int], float | None]:
        p = self.pacers.get(key)
        if p is None:
            return [], None
        rec = self.records.get(key)
        if rec is None:
            return p.pump(now)
        self._refresh(rec, now)
        blocked = rec.cooloff_until if rec.cooloff_until > now else 0.0
        probe: bool | None = None
        if rec.state is _BREAKER_OPEN:
            blocked = max(blocked, rec.open_until)
        elif rec.state is _BREAKER_HALF_OPEN:
            probe = rec.probe_until <= now
        return p.pump(now, blocked_until=blocked, probe=probe)

    def answered(self, key: str, now: float) -> None:
        """An attempt's answer arrived (its headers: any status but a failure one).

        The upstream is known good: a half-open breaker closes, the pacer is credited
        and its line released on the ramp.  (`success` still counts the attempt when
        it ends.)"""
        rec = self.get(key)
        self._refresh(rec, now)
        rec.consecutive_failures = 0
        if rec.state is not _BREAKER_CLOSED:
            self._close(rec, now)
        recovered = self.pacer(key).success(now)
        self._poke(key, recovered)

    def pace_failure(self, key: str, now: float) -> None:
        """An attempt failed: the pacer's ramp stops (each failure, counted or not)."""
        p = self.pacers.get(key)
        if p is not None:
            p.failure(now)

    def _refresh(self, rec: UpstreamHealth, now: float) -> None:
        if rec.state is _BREAKER_OPEN and now >= rec.open_until:
            rec.state = _BREAKER_HALF_OPEN
            rec.probe_until = 0.0
            self._emit(Change(rec.key, "half_open", reopens=rec.reopens, old=_BREAKER_OPEN))

    def state(self, key: str, now: float) -> Breaker:
        rec = self.get(key)
        self._refresh(rec, now)
        return rec.state

    # -- a turn's questions -------------------------------------------------------------
    def blocked_until(self, key: str, now: float) -> float:
        """0.0 when the upstream may be tried now; else the monotonic time it may be again.

        A half-open breaker whose probe is out counts as blocked until the probe's lease
        ends (it usually reports before, and parked turns look again meanwhile).
        """
        rec = self.records.get(key)
        if rec is None:
            return 0.0
        self._refresh(rec, now)
        until = rec.cooloff_until if rec.cooloff_until > now else 0.0
        if rec.state is _BREAKER_OPEN:
            until = max(until, rec.open_until)
        elif rec.state is _BREAKER_HALF_OPEN and rec.probe_until > now:
            until = max(until, rec.probe_until)
        return until

    def take(self, key: str, now: float) -> bool:
        """The turn sends its attempt here.  False: a half-open probe is not ours to send."""
        rec = self.records.get(key)
        if rec is None:
            return True
        self._refresh(rec, now)
        if rec.state is not _BREAKER_HALF_OPEN:
            return True
        if rec.probe_until > now:
            return False
        ttl = self.settings.probe_timeout_s
        gate = self.probe_gate
        mine = True if gate is None else gate(key, ttl)
        if mine is None:  # the fleet has not answered yet
            rec.probe_until = now + 0.05
            return False
        if mine:
            rec.probe_until = now + ttl
            rec.probe_held = True
            return True
        # Another instance probes.  It gives the lease back as soon as it has no probe
        # out, and shares its verdict at once: look again as often as a half-open
        # breaker probes, not once the lease runs out (issue 36).
        rec.probe_until = now + min(ttl, max(self.settings.max_open_s, 0.05))
        return False

    def _give_back(self, rec: UpstreamHealth) -> None:
        """No probe of ours is out any more: the fleet's probe lease goes back."""
        if rec.probe_held:
            rec.probe_held = False
            release = self.probe_release
            if release is not None:
                release(rec.key)

    def holds_probe(self, key: str) -> bool:
        """This instance holds the probe lease for ``key`` (one turn's attempt: while
        it is out, `take` lets no other local turn through)."""
        rec = self.records.get(key)
        return rec is not None and rec.probe_held

    def probe_abandoned(self, key: str) -> None:
        """The turn whose attempt held the probe ended without a verdict (its client
        went away, its attempts ran out, the relay stopped): the slot and the fleet's
        lease are free at once."""
        rec = self.records.get(key)
        if rec is not None and rec.probe_held:
            self._give_back(rec)
            if rec.state is _BREAKER_HALF_OPEN:
                rec.probe_until = 0.0
                self._poke(key)

    def quota_until(self, key: str, now: float) -> float:
        """When ``key``'s quota cool-off ends, if a spent quota is all that keeps it out
        (else 0.0).  A turn that has no other upstream goes there anyway: the
        provider's answer ends it at once (a quota error, or an answer: the bill was
        paid), rather than waiting."""
        rec = self.records.get(key)
        if rec is None:
            return 0.0
        self._refresh(rec, now)
        if (
            rec.state is _BREAKER_CLOSED
            and rec.cooloff_until > now
            and rec.cooloff_reason == "quota"
        ):
            return rec.cooloff_until
        return 0.0

    def in_line(self, key: str) -> int:
        """Turns waiting for ``key``: in its pacer's line and its rate lines."""
        p = self.pacers.get(key)
        return (len(p.queue) if p is not None else 0) + self.rates.in_line(key)

    def wait_reason(self, key: str, now: float) -> str:
        """Why turns wait in ``key``'s line, for the logs: the longest block there."""
        rate = self.rates.wait_reason(key, now)
        rec = self.records.get(key)
        if rec is None:
            return rate or "retry pacing"
        self._refresh(rec, now)
        parts = [rate] if rate else []
        if rec.state is _BREAKER_OPEN:
            parts.append("breaker open")
        elif rec.state is _BREAKER_HALF_OPEN:
            parts.append(
                "breaker half-open, probe out" if rec.probe_until > now else "breaker half-open"
            )
        if rec.cooloff_until > now:
            parts.append(
                f"{rec.cooloff_reason or 'cooloff'} cool-off, {rec.cooloff_until - now:.1f}s left"
            )
        return ", ".join(parts) or "retry pacing"

    # -- outcomes ---------------------------------------------------------------------------
    def success(self, key: str, now: float) -> None:
        """An attempt got an answer (any status but a failure one)."""
        rec = self.get(key)
        rec._count(now, self.settings.window_s, 0)
        rec.consecutive_failures = 0
        if rec.state is not _BREAKER_CLOSED:
            self._close(rec, now)

    def _close(self, rec: UpstreamHealth, now: float) -> None:
        old = rec.state
        rec.state = _BREAKER_CLOSED
        rec.reopens = 0
        rec.probe_until = 0.0
        rec.open_until = 0.0
        self._give_back(rec)
        # The probe passed: the failures in the window were the outage's.  Kept, the
        # first failure after it would reopen the breaker on a stale rate.
        rec.buckets.clear()
        rec.closed_at = now
        p = self.pacers.get(rec.key)
        if p is not None:
            p.start_ramp(now)
        self._emit(Change(rec.key, "close", reason="probe succeeded", old=old))

    def failure(self, key: str, now: float, reason: str, *, count: bool = True) -> None:
        """An attempt failed in a way that counts against the upstream (never a 4xx).

        ``count=False``: the turn already failed here once; only a probe's failure still
        matters (so one request that always fails cannot open a breaker by itself).
        """
        rec = self.get(key)
        s = self.settings
        self.pace_failure(key, now)
        self._refresh(rec, now)
        if rec.state is _BREAKER_HALF_OPEN and s.breakers:
            rec._count(now, s.window_s, 1)
            rec.consecutive_failures += 1
            self._open(rec, now, f"probe failed ({reason})", reopen=True)
            return
        if not count:
            return
        rec._count(now, s.window_s, 1)
        rec.consecutive_failures += 1
        if not s.breakers:
            return
        if rec.state is _BREAKER_CLOSED:
            ok, failed = rec.window(now, s.window_s)
            total = ok + failed
            if total >= s.min_window_attempts:
                # Enough attempts to tell: the rate decides (a run of five failures is
                # routine for a busy upstream that fails a share of its attempts).
                if failed / total > s.failure_rate_to_open:
                    self._open(rec, now, f"failure rate {failed}/{total} over {s.window_s:g}s")
            elif rec.consecutive_failures >= s.failures_to_open:
                self._open(rec, now, f"{rec.consecutive_failures} consecutive failures ({reason})")

    def fleet_window(self, key: str, ok: int, failed: int, now: float) -> None:
        """The whole fleet's attempts over the window (from a shared store's counters).

        A closed breaker opens when the fleet's failure rate is over the threshold,
        even if this instance alone has seen too few attempts to tell.
        """
        s = self.settings
        total = ok + failed
        if not s.breakers or total < s.min_window_attempts:
            return
        rec = self.get(key)
        if now - rec.closed_at < s.window_s:
            return  # the fleet's window still holds the outage a probe just ended
        self._refresh(rec, now)
        if rec.state is _BREAKER_CLOSED and failed / total > s.failure_rate_to_open:
            self._open(rec, now, f"fleet failure rate {failed}/{total} over {s.window_s:g}s")

    def _open(self, rec: UpstreamHealth, now: float, reason: str, *, reopen: bool = False) -> None:
        s = self.settings
        if reopen:
            rec.reopens += 1
        ttl = min(s.max_open_s, s.open_s * (2 ** min(rec.reopens, 30)))
        old = rec.state
        rec.state = _BREAKER_OPEN
        rec.open_until = now + ttl
        rec.probe_until = 0.0
        self._give_back(rec)
        self._emit(Change(rec.key, "open", ttl, reason, rec.reopens, old=old))

    def cooloff(self, key: str, now: float, seconds: float, reason: str) -> None:
        """The upstream asked to be left alone (Retry-After), or its quota is spent
        (for at most `QUOTA_LOOK_AGAIN_S`: then it is looked at again)."""
        if reason == "quota":
            seconds = min(seconds, QUOTA_LOOK_AGAIN_S)
        rec = self.get(key)
        until = now + seconds
        if until <= rec.cooloff_until:
            return
        rec.cooloff_until = until
        rec.cooloff_reason = reason
        self._emit(Change(key, "cooloff", seconds, reason))

    # -- what other instances learned -------------------------------------------------------
    def apply(self, change: Change, now: float) -> None:
        """A change published by another instance (``change.remote`` is set for listeners)."""
        rec = self.get(change.key)
        remote = Change(
            change.key, change.kind, change.ttl_s, change.reason, change.reopens, True, rec.state
        )
        if change.kind == "cooloff":
            until = now + change.ttl_s
            if until > rec.cooloff_until:
                rec.cooloff_until = until
                rec.cooloff_reason = change.reason
                self._emit(remote)
        elif change.kind == "open":
            until = now + change.ttl_s
            if rec.state is not _BREAKER_OPEN or until > rec.open_until:
                rec.state = _BREAKER_OPEN
                rec.open_until = until
                rec.reopens = max(rec.reopens, change.reopens)
                rec.probe_until = 0.0
                self._give_back(rec)  # another's verdict: our probe, if out, is moot
                self._emit(remote)
        elif change.kind == "close" and rec.state is not _BREAKER_CLOSED:
            rec.state = _BREAKER_CLOSED
            rec.reopens = 0
            rec.open_until = rec.probe_until = 0.0
            rec.consecutive_failures = 0
            rec.buckets.clear()
            rec.closed_at = now
            self._give_back(rec)
            p = self.pacers.get(rec.key)
            if p is not None:
                p.start_ramp(now)  # another instance's probe passed: release the line
            self._emit(remote)

    # -- views ------------------------------------------------------------------------------
    def view(self, key: str, now: float) -> dict[str, Any]:
        rec = self.get(key)
        self._refresh(rec, now)
        ok, failed = rec.window(now, self.settings.window_s)
        total = ok + failed
        return {
            "breaker": rec.state.value,
            "open_for_s": round(max(0.0, rec.open_until - now), 3)
            if rec.state is _BREAKER_OPEN
            else 0.0,
            "consecutive_failures": rec.consecutive_failures,
            "failure_rate": round(failed / total, 3) if total else 0.0,
            "window_attempts": total,
            "cooloff_s": round(max(0.0, rec.cooloff_until - now), 3),
            "cooloff_reason": rec.cooloff_reason if rec.cooloff_until > now else "",
            "reopens": rec.reopens,
            "pacer": self.pacer(key).view(now),
            #: the providers' rate limits learned per credential (`core.admission.ratelimit`)
            "ratelimits": self.rates.view(key, now),
        }


class AttemptAccounting:
    """Each attempt's end, counted on the health board and for the fleet's counters.

    The machine records failures before commit (they decide the next wait) and
    answers as they arrive (they release the pacer's line); this counts the rest:
    each attempt's end (the failure window), failures after commit (once a turn per
    upstream: a turn continued in place after cuts has several committed attempts),
    and what the fleet's windowed counters hear (one failure per turn per upstream,
    like the local breaker).  The transport's observer calls it with the attempt's
    record and ``now``, and sends the fleet count it returns to the shared store.
    """

    __slots__ = ("_cut", "_failed", "board")

    def __init__(self, board: HealthBoard) -> None:
        self.board = board
        #: turn id -> the upstreams it failed on (the fleet counts one failure per turn)
        self._failed: dict[int, set[str]] = {}
        #: turn id -> the upstreams it was cut on after commit (counted once a turn)
        self._cut: dict[int, set[str]] = {}

    def turn_ended(self, turn: int) -> None:
        self._failed.pop(turn, None)
        self._cut.pop(turn, None)

    def attempt_ended(
        self, now: float, turn: int, key: str, *, reason: str, phase: str, status: int | None
    ) -> bool | None:
        """Count the end of turn ``turn``'s attempt on upstream ``key``.  Returns what
        the fleet's counters hear: True a failure, False a success, None nothing."""
        if reason == "aborted_by_client":
            return None
        answered = reason in ("ok", "passed_through_error")
        if answered:
            self.board.success(key, now)
            return False
        if phase == "committed" and (status or 0) < 400:
            cut = self._cut.setdefault(turn, set())
            if key not in cut:
                cut.add(key)
                self.board.failure(key, now, reason)
        if (status or 500) >= 500:
            seen = self._failed.setdefault(turn, set())
            if key not in seen:
                seen.add(key)
                return True
        return None


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_BREAKER_CLOSED = Breaker.CLOSED
_BREAKER_HALF_OPEN = Breaker.HALF_OPEN
_BREAKER_OPEN = Breaker.OPEN
