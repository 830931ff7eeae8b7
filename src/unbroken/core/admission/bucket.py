"""One provider budget as a relay models it (sans-IO): a `Bucket`, and the `Drift`
that the provider's own reports correct its refill with.

Theory of operation
===================
A `Bucket` (one per budget a provider reports: requests, tokens, output tokens;
`core.admission.ratelimit` keeps them per upstream and credential) holds a limit, a
level (what is left) and a refill rate.  Providers refill continuously (OpenAI's and
Anthropic's "reset" is when the budget is full again), so the rate the provider
*tells* is ``(limit - remaining) / reset``, smoothed, and never above the limit a
minute; before any reset it is the limit a minute.  A report sets the level to what
the provider says is left, less what this relay admitted after the answered request
was sent; between reports the level refills at the rate.

**What the reports show corrects what they say** (the requests budget).  On a key
that other traffic shares (a team's key, a batch job, another tool; the ``shared``
provider of the mock's zoo) the rate the provider tells is the key's, not what is
left of it for this relay: the others take part of every refill, and a model that
refills at the key's rate lets go requests the provider then refuses.  Before, only
the throttle found that out, one 429 every 20 to 30 s for as long as the key was
busy, each cutting the admitted rate (one relay behind 40 agents: a turn waited 33 s;
with 70 % of the refill taken, the whole ``max_wait_s``).  So at each report the
bucket compares the level it modelled (the last report, refilled since, less what
this relay sent) with the level reported: the difference, summed over a window of at
least ``WINDOW_S`` seconds and divided by its length, is refill the model counted
that someone else took.  The *drain* follows it (``GAIN`` of each window's measure:
an integral controller; a drain too large shows as reports above the model and comes
down), and the bucket refills at the told rate less the drain and a ``MARGIN`` of
it (the model may not refill as fast as the provider: a report rounds its fraction
away, and the request that fraction was waiting for is refused).

* **Only what a report proves.**  A provider reports no level below zero: below a
  spent report the model's debt is its own refused requests, which the provider did
  not count, and says nothing; a spent report while the model had room is a drain of
  at least that room.
* **Bounded.**  The drain is within ``[0, MAX_DRAIN]`` of the told rate: a report
  never raises the refill above it, and a relay always reckons on some of it (the
  throttle and ``max_wait_s`` bound the rest).  Non-finite readings are ignored.
* **A relay alone** measures it so.  Two relays on one key that share no store each
  count the other's requests as a drain: each reckons on what the other leaves.
* **A fleet** (`Bucket.shared`: Redis or the workers' file) cannot: its level is the
  fleet's lease, and the leases its relays hold and have not sent count as taken in
  the store and as left in the provider's report, which hides a drain.  The store
  counts what its takes granted from each bucket in all, and answers a report with it
  (`core.admission.leasemath.read_granted`); over a window of ``FLEET_WINDOW_S``, what
  the key refilled at its told rate, less what its reported level fell by and what
  the fleet was granted, is what others took (`Drift.observe_fleet`), and the drain
  moves ``FLEET_GAIN`` of the way to it.  Only while the key is ``LOW`` (a key with
  room does not take its refill) and not falling (a limit counted over a sliding
  minute, as the simulator's `quantized`, falls through the low mark once a minute
  with no other traffic: read as a drain, the fleet lost 7 % of its goodput).  The
  relay teaches the fleet's bucket its told rate less the drain, and takes at it.
* **Quiet.**  A drain under ``QUIET`` of the rate is noise, and not reckoned on (the
  controller sees it fade).

Time is a monotonic ``now`` in seconds, passed in.  Nothing here does I/O.
"""

from __future__ import annotations

import math
from typing import Any

from unbroken.core.admission.ratehead import Reading

__all__ = [
    "DEFAULT_WINDOW_S",
    "FALLING",
    "FLEET_GAIN",
    "FLEET_WINDOW_S",
    "GAIN",
    "LOW",
    "MARGIN",
    "MAX_DRAIN",
    "QUIET",
    "SMOOTH",
    "WINDOW_S",
    "Bucket",
    "Drift",
]

#: weight of a new observation in the learned rates (and a limiter's tokens a byte)
SMOOTH = 0.3
#: a limit's window before a reset is seen (limits are per minute)
DEFAULT_WINDOW_S = 60.0

#: a window of reports at least this long makes one measure of the drain
WINDOW_S = 2.0
#: the share of a window's measure the drain moves by
GAIN = 0.5
#: a drain under this share of the rate is noise, and not reckoned on
QUIET = 0.05
#: a fleet's window of reports (over the store's total granted) is at least this long
FLEET_WINDOW_S = 3.0
#: the share of the way to a fleet window's measure the drain moves
FLEET_GAIN = 0.5
#: a fleet's window measures only while the key is this low (a share of its limit):
#: a key with room does not take its refill (nor does a limit counted over a sliding
#: minute: what it reports left falls with every request until the minute turns)
LOW = 0.1
#: ... and not while it falls by more than this share of what it refills
FALLING = 0.25
#: the relay reckons on this share of the drain more (a model that refills as fast as
#: the provider lets go a request the provider then refuses, as soon as the fraction
#: a report rounds away runs out)
MARGIN = 0.05
#: the drain takes at most this share of the rate (a fleet's stored rates stay within
#: `core.admission.leasemath.MAX_SKEW` of each other)
MAX_DRAIN = 0.7


class Drift:
    """One budget's drain: refill the provider's reports show someone else takes."""

    __slots__ = ("_err", "_fleet", "_span", "_t", "drain")

    def __init__(self) -> None:
        #: requests (or tokens) a second that the model's rate counted and others take
        self.drain = 0.0
        self._t: float | None = None  # the last report
        self._err = 0.0  # the window's summed difference (model - report)
        self._span = 0.0  # and the seconds it covers
        #: a fleet's window: (when, the level reported, the fleet's total granted)
        self._fleet: tuple[float, float, float] | None = None

    def reckon(self, rate: float) -> float:
        """What is left of ``rate`` for this relay: less the drain and its margin."""
        drain = self.drain if self.drain > QUIET * rate else 0.0
        return max(rate - (1.0 + MARGIN) * drain, 0.0)

    def observe_fleet(
        self, reported: float, granted: float, rate: float, limit: float, now: float
    ) -> None:
        """A report (``reported`` left) taught to a fleet's bucket, whose store has
        granted ``granted`` from it in all: over a window of ``FLEET_WINDOW_S``, what
        the key refilled at ``rate``, less what its level fell by and what the fleet
        was granted, is what others took.  Only while the key stays ``LOW`` (one with
        room does not take its refill) and is not ``FALLING`` (a key falling through
        the low mark is not yet one that others keep low: a limit over a sliding minute
        falls through it once a minute without any other traffic)."""
        if not all(math.isfinite(x) for x in (reported, granted, rate, limit, now)):
            return
        snap = self._fleet
        if reported > LOW * limit:
            self._fleet = None
            return
        if snap is None or granted < snap[2] or now < snap[0]:
            # (new, or a new total: the store forgot the bucket)
            self._fleet = (now, reported, granted)
            return
        span = now - snap[0]
        if span < FLEET_WINDOW_S:
            return
        self._fleet = (now, reported, granted)
        if reported - snap[1] < -FALLING * rate * span:
            return  # falling: not yet a key others keep low
        others = (rate * span - (reported - snap[1]) - (granted - snap[2])) / span
        top = MAX_DRAIN * max(rate, 0.0)
        self.drain = min(max(self.drain + FLEET_GAIN * (others - self.drain), 0.0), top)

    def restart(self) -> None:
        """The model was not this drift's for a while (a fleet's lease): start afresh."""
        self._t = None
        self._err = self._span = 0.0

    def observe(
        self, modelled: float, reported: float, rate: float, now: float, *, spent: bool
    ) -> None:
        """A report: the provider says ``reported`` is left where the model, refilled
        at ``rate`` less the drain since the last report, had ``modelled``; ``spent``:
        it said nothing was left (it says no less)."""
        if not (math.isfinite(modelled) and math.isfinite(reported) and math.isfinite(rate)):
            return
        if self._t is None or now < self._t:
            self._t = now
            return
        span, self._t = now - self._t, now
        # (the model refilled at what `reckon` leaves, the margin and the quiet zone
        # included: the controller sees it refilled at the rate less the drain, so the
        # margin stays a margin and a quiet drain fades)
        modelled += (rate - self.reckon(rate) - self.drain) * span
        self._span += span
        if not (spent and modelled <= reported):
            # (below a spent report the model's debt is its own refused requests, which
            # the provider did not count: no measure)
            self._err += modelled - reported
        if self._span < WINDOW_S:
            return
        top = MAX_DRAIN * max(rate, 0.0)
        self.drain = min(max(self.drain + GAIN * self._err / self._span, 0.0), top)
        self._err = self._span = 0.0


class Bucket:
    """One budget: ``level`` of ``limit`` left, refilled at ``rate`` a second (the
    ``told`` rate less its drift's drain, for the requests budget)."""

    __slots__ = (
        "drift",
        "level",
        "limit",
        "rate",
        "rate_seen",
        "reported",
        "shared",
        "t",
        "told",
        "version",
    )

    def __init__(self, limit: float, now: float, *, drifts: bool = False) -> None:
        self.limit = limit
        self.level = limit
        #: the refill the provider's resets imply (``told``), and what this relay
        #: reckons on: that, less the drain its reports show others take (`Drift`)
        self.told = self.rate = limit / DEFAULT_WINDOW_S
        self.drift = Drift() if drifts else None
        self.t = now
        #: the rate was learned from a reset (not the per-minute guess)
        self.rate_seen = False
        #: the level is the fleet's lease (refilled by the store, not by the clock)
        self.shared = False
        #: the level the provider's last report implies, and how many reports came
        #: (a fleet store lowers the fleet's level to it)
        self.reported = limit
        self.version = 0

    def refill(self, now: float) -> None:
        dt = now - self.t
        if dt > 0:
            if not self.shared:
                self.level = min(self.limit, self.level + dt * self.rate)
            self.t = now

    def due(self, cost: float, now: float) -> float:
        """When ``cost`` is available (``now`` if it is; shared: never by itself)."""
        self.refill(now)
        need = min(cost, self.limit) - self.level
        if need <= 1e-9:
            return now
        if self.shared:
            return math.inf
        return now + need / self.rate if self.rate > 0 else math.inf

    def learn(self, r: Reading, uncounted: float, now: float) -> None:
        """A provider's reading; ``uncounted``: spent since that request was sent."""
        self.refill(now)
        if r.limit is not None and r.limit != self.limit:
            self.limit = r.limit
            if not self.rate_seen:
                self.told = self.limit / DEFAULT_WINDOW_S
        rem = r.remaining
        if rem is None:
            self.reckon()
            return
        if r.reset_s is not None and r.reset_s > 0.001 and rem < self.limit:
            # A per-minute limit never refills faster than its limit a minute, whatever
            # a reset says (a quantized provider's reset is "until the next request").
            seen = max((self.limit - rem) / r.reset_s, self.limit / 3600.0)
            seen = min(seen, self.limit / DEFAULT_WINDOW_S)
            self.told = (1 - SMOOTH) * self.told + SMOOTH * seen if self.rate_seen else seen
            self.rate_seen = True
        elif r.reset_s is not None and rem <= 0 and r.reset_s <= 0.001:
            rem = min(self.limit, 1.0)  # spent, and reset now: one may go
        level = max(-self.limit, min(self.limit, rem) - uncounted)  # debt: at most a limit
        if self.drift is not None:
            if self.shared:
                self.drift.restart()  # the level is the fleet's lease, not a model
            else:
                self.drift.observe(self.level, level, self.told, now, spent=rem <= 0)
        self.reckon()
        self.reported = level
        self.version += 1
        if self.shared:
            self.level = min(self.level, level)  # the fleet's lease: only ever lowered here
        else:
            self.level = level

    def fleet_report(self, granted: float, now: float) -> None:
        """This bucket's last report was taught to the fleet's, whose store has granted
        ``granted`` from it in all (`Drift.observe_fleet`)."""
        if self.drift is not None and self.shared:
            self.drift.observe_fleet(self.reported, granted, self.told, self.limit, now)
            self.reckon()

    def reckon(self) -> None:
        """The rate this relay reckons on: the provider's, less its drift's drain."""
        self.rate = self.drift.reckon(self.told) if self.drift is not None else self.told

    def view(self, now: float) -> dict[str, Any]:
        self.refill(now)
        out: dict[str, Any] = {
            "limit": round(self.limit),
            "left": round(self.level, 1),
            "per_s": round(self.rate, 3),
        }
        if self.drift is not None:
            out["others_per_s"] = round(self.drift.drain, 3)
        return out
