"""What the provider *does* corrects what its headers say (sans-IO): an admitted
request rate that follows the provider's 429s.

Theory of operation
===================
A provider's rate-limit headers are a model of its limits, and models are wrong
in the field: a per-minute limit enforced per second ("quantized"), a reset that
means "until the next request", headers that overstate what is left, a key shared
with traffic this relay does not see, or no headers at all.  Each `Limiter`
(`core.admission.ratelimit`) therefore carries an `AdmissionThrottle`, a ceiling on the rate of
requests it lets go that only the provider's own answers move:

* **Off until the provider refuses.**  Until a 429 the throttle admits
  everything: a lone agent, or a fleet within its limits, never waits on it.
* **A 429 lowers the rate multiplicatively** (CUBIC's decrease, as the AWS SDKs'
  adaptive retry mode does on throttles): to ``BETA`` of what the provider was
  seen to *accept*, the answered share of this epoch's answers times the rate at
  which this epoch's requests were sent (Google SRE's accepts against requests).
  So a relay that sent 2,000 requests a second into a 5-a-second limit comes
  down to the provider's 5 in one step, not in seventeen.  Only one decrease per
  epoch: a 429 for a request sent before the last decrease says nothing new
  (TCP's once per window).
* **Then it probes back up** along CUBIC's curve: concave back to the rate that
  was refused (``W_max``) over ``CLIMB_S`` seconds, flat near it, convex beyond
  it, so a limit that was raised is found again, and a limit that holds costs one
  429 every few dozen requests.  It grows only while it is used (never beyond
  twice the rate actually sent: a quiet relay does not bank a licence).
* **A request alone is never held.**  With nothing in flight and nobody waiting,
  a request goes: the throttle orders a crowd, it never slows the lone agent below
  the simplest retry loop (whose own retry delay and pacer still apply).
* **A fleet's 429 is every relay's, and so is its rate.**  Relays (or workers)
  that share a key tell each other each decrease: what the relay was seen to
  accept (its *anchor*) and its demand (requests in flight or waiting).  The
  provider refuses the fleet's total, so a sibling's news lowers this relay too,
  once an epoch (`fleet_refused`; news within ``SYNC_S`` of this relay's own
  decrease is the same refusal), and the epoch's anchors are pooled: each relay
  takes the fleet's accepted rate in proportion to its demand (`_even_out`).
  Alone, each relay found the limit as many times as there are relays, and one
  cut by a 429 while a sibling took most answers was anchored as low as it was
  served (one a second of five) and climbed back as slowly: its agents waited
  half a minute while its sibling's were served.  A sibling's anchor counts for
  at most ``MAX_SKEW`` times this relay's own (a word from shared state is
  bounded); a relay that sent nothing lately has nothing to lower and tells
  nothing; a lone relay never hears any of it.
* **Bounded.**  The rate stays within ``[MIN_RATE, MAX_RATE]`` and the wait it
  asks for is at most ``1 / MIN_RATE`` (the limiter caps every wait at
  ``max_wait_s`` on top).

Time is a monotonic ``now`` in seconds, passed in.  Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = [
    "BETA",
    "CLIMB_S",
    "MAX_RATE",
    "MAX_SKEW",
    "MIN_RATE",
    "SYNC_S",
    "AdmissionThrottle",
]

#: the share of the accepted rate kept after a 429 (CUBIC's and botocore's beta)
BETA = 0.95
#: seconds to climb back to the refused rate after a decrease (CUBIC's K)
CLIMB_S = 8.0
#: after a decrease nothing accepted measured, the rate doubles this often
PROBE_DOUBLE_S = 1.0
#: the lowest admitted rate, requests a second (one every 20 s at the very worst)
MIN_RATE = 0.05
#: the highest admitted rate the curve may reach (a sanity bound, not a target)
MAX_RATE = 100_000.0
#: an epoch's requests count as sent over at least this long (a burst of four in a
#: millisecond is not a rate of four thousand a second)
MIN_EPOCH_S = 1.0
#: the bucket holds this many seconds of the rate (at least one request)
BURST_S = 1.0
#: a 429 is measured against the answers accepted in the last this many seconds too
#: (a per-minute limit enforced per second accepts one second's worth)
RECENT_S = 1.0
#: a sibling's decrease within this long of this relay's own is the same epoch's
SYNC_S = 1.0
#: a sibling's anchor counts for at most this many times this relay's own (or 1/s)
MAX_SKEW = 4.0
#: siblings pooled in one epoch at most, and the demand one may claim
MAX_PEERS = 256
MAX_DEMAND = 1_000_000.0


class AdmissionThrottle:
    """One limiter's outcome-driven ceiling on the rate of admissions (see above)."""

    __slots__ = (
        "_accepts",
        "_ep_ok",
        "_ep_refused",
        "_ep_sent",
        "_ep_seq",
        "_ep_t0",
        "_peers",
        "_probing",
        "_t",
        "anchor",
        "decreases",
        "demand",
        "enabled",
        "fleet_decreases",
        "rate",
        "t_decrease",
        "tokens",
        "w_max",
    )

    def __init__(self) -> None:
        self.enabled = False
        #: the admitted rate (requests a second), once enabled
        self.rate = MAX_RATE
        #: the rate the provider last refused (CUBIC's W_max)
        self.w_max = MAX_RATE
        self.t_decrease = 0.0
        self.tokens = 1.0
        self._t = 0.0
        #: the epoch: requests sent with seq > _ep_seq (since the last decrease)
        self._ep_seq = 0
        self._ep_t0: float | None = None
        self._ep_sent = 0
        self._ep_ok = 0
        self._ep_refused = 0
        self.decreases = 0  # for /status
        #: ... of which a sibling's news made (`fleet_refused`)
        self.fleet_decreases = 0
        #: the last decrease's own measure, told to the siblings: the rate accepted
        #: (the anchor) and the demand (requests in flight or waiting)
        self.anchor = 0.0
        self.demand = 0.0
        #: the siblings' news in this epoch: who -> (anchor, demand)
        self._peers: dict[str, tuple[float, float]] = {}
        #: the last decrease was a guess (its epoch had no accepted answer)
        self._probing = False
        #: when the answers of the last ``RECENT_S`` were accepted (bounded)
        self._accepts: deque[float] = deque(maxlen=100_000)

    # -- the curve ---------------------------------------------------------------------
    def _curve(self, now: float) -> float:
        """CUBIC's window as a rate: back to ``w_max`` after ``CLIMB_S``, then beyond.
        After a decrease that nothing accepted measured (the estimate is a guess), it
        doubles every ``PROBE_DOUBLE_S`` instead until the next 429 (TCP's slow start
        after a timeout): a rate anchored low on a guess is not stuck there."""
        t = now - self.t_decrease
        c = self.w_max * (1.0 - BETA) / CLIMB_S**3
        cubic = self.w_max + c * (t - CLIMB_S) ** 3
        if self._probing:
            return max(cubic, BETA * self.w_max * math.pow(2.0, min(t / PROBE_DOUBLE_S, 40.0)))
        return cubic

    def _refill(self, now: float) -> None:
        dt = now - self._t
        if dt > 0:
            cap = max(1.0, self.rate * BURST_S)
            self.tokens = min(cap, self.tokens + dt * self.rate)
            self._t = now

    # -- a limiter's questions -----------------------------------------------------------
    def due(self, now: float, *, alone: bool) -> float:
        """When one more request may go (``now``: at once)."""
        if not self.enabled or alone:
            return now
        self._refill(now)
        if self.tokens >= 1.0 - 1e-9:
            return now
        return now + min((1.0 - self.tokens) / self.rate, 1.0 / MIN_RATE)

    def sent(self, seq: int, now: float) -> None:
        """Admission ``seq`` went (its token is spent)."""
        if self._ep_t0 is None:
            self._ep_t0 = now
        if seq > self._ep_seq:
            self._ep_sent += 1
        if self.enabled:
            self._refill(now)
            self.tokens = max(self.tokens - 1.0, -1.0)

    def accepted(self, seq: int, now: float) -> None:
        """Admission ``seq`` got an answer that was not a 429: the rate climbs."""
        if seq > self._ep_seq:
            self._ep_ok += 1
        self._accepts.append(now)
        if not self.enabled:
            return
        self._refill(now)
        sent_rate = self._sent_rate(now)
        grown = self._curve(now)
        if sent_rate is not None:
            grown = min(grown, max(2.0 * sent_rate, self.rate))  # only while it is used
        self.rate = min(MAX_RATE, max(self.rate, grown))

    def refused(self, seq: int, now: float, last_seq: int, demand: float = 0.0) -> bool:
        """Admission ``seq`` was answered 429.  True when the rate was lowered (once
        an epoch); ``last_seq``: the newest admission (the next epoch starts after it);
        ``demand``: this relay's requests in flight or waiting (told the siblings)."""
        if seq <= self._ep_seq:
            return False  # sent before the last decrease: it says nothing new
        self._ep_refused += 1
        answered = self._ep_ok + self._ep_refused
        sent_rate = self._sent_rate(now)
        if sent_rate is None:
            sent_rate = self.rate if self.enabled else 1.0
        accepted = sent_rate * self._ep_ok / answered
        recent = self._recent(now)
        if recent > 0.0:  # what got through in the last second: a quantized limit's size
            accepted = min(accepted, recent) if accepted > 0.0 else recent
        # within the fleet's epoch the siblings' news still holds (pooled again)
        same = self.enabled and now - self.t_decrease < SYNC_S
        self._decrease(now, last_seq, accepted, sent_rate, demand, keep_peers=same)
        return True

    def fleet_refused(
        self, now: float, last_seq: int, who: str, anchor: float, demand: float, mine: float
    ) -> bool:
        """Sibling ``who`` sharing this key came down (a 429, or a sibling's news): it
        had been seen to accept ``anchor`` a second with ``demand`` requests in flight
        or waiting; ``mine``: this relay's demand now (see the module docstring).
        True when this relay came down too (its own news is then told)."""
        anchor = min(max(anchor, 0.0), MAX_RATE) if math.isfinite(anchor) else 0.0
        demand = min(max(demand, 0.0), MAX_DEMAND) if math.isfinite(demand) else 0.0
        if self.enabled and now - self.t_decrease < SYNC_S:
            # the same refusal: nothing lowered again, the epoch's anchors pooled
            if who in self._peers or len(self._peers) < MAX_PEERS:
                self._peers[who] = (anchor, demand)
                self._even_out()
            return False
        sent_rate = self._sent_rate(now)
        if sent_rate is None:
            return False  # it sent nothing this epoch: nothing of it to lower
        answered = self._ep_ok + self._ep_refused
        accepted = sent_rate * (self._ep_ok / answered if answered else 1.0)
        recent = self._recent(now)
        if recent > 0.0:
            accepted = min(accepted, recent) if accepted > 0.0 else recent
        self._decrease(now, last_seq, accepted, sent_rate, mine, keep_peers=False)
        self.fleet_decreases += 1
        self._peers[who] = (anchor, demand)
        self._even_out()
        return True

    def _even_out(self) -> None:
        """The epoch's anchors pooled: this relay's rate is the fleet's accepted rate
        in proportion to its demand (a sibling's anchor bounded by ``MAX_SKEW``)."""
        peers = self._peers
        if not peers or self.demand <= 0.0:
            return
        bound = MAX_SKEW * max(self.anchor, 1.0)
        pooled = self.anchor + sum(min(a, bound) for a, _ in peers.values())
        wanted = self.demand + sum(d for _, d in peers.values())
        if pooled <= 0.0:
            return
        self.w_max = min(MAX_RATE, max(MIN_RATE, pooled * self.demand / wanted))
        self.rate = max(MIN_RATE, BETA * self.w_max)

    def _decrease(
        self,
        now: float,
        last_seq: int,
        accepted: float,
        sent_rate: float,
        demand: float,
        *,
        keep_peers: bool,
    ) -> None:
        """CUBIC's decrease, anchored on the ``accepted`` rate (a new epoch)."""
        self.anchor = accepted
        self.demand = min(max(demand, 0.0), MAX_DEMAND) if math.isfinite(demand) else 0.0
        self._probing = accepted <= 0.0
        if self._probing:  # nothing got through this epoch: less than was sent
            accepted = BETA * sent_rate
        ref = min(self.rate, accepted) if self.enabled else accepted
        if self.enabled and ref < self.w_max:
            # CUBIC's fast convergence: a relay whose share shrinks gives up a little
            # more, so relays that share a provider and nothing else even out
            ref *= (1.0 + BETA) / 2.0
        self.w_max = min(MAX_RATE, max(MIN_RATE, ref))
        self.rate = max(MIN_RATE, BETA * self.w_max)
        self.enabled = True
        self.t_decrease = now
        self._t = now
        self.tokens = 0.0  # the next one goes a period later
        self.decreases += 1
        self._ep_seq = last_seq
        self._ep_t0 = now
        self._ep_sent = self._ep_ok = self._ep_refused = 0
        if keep_peers:
            self._even_out()
        else:
            self._peers = {}

    def _recent(self, now: float) -> float:
        """Answers accepted a second, over the last ``RECENT_S``."""
        acc = self._accepts
        while acc and now - acc[0] > RECENT_S:
            acc.popleft()
        return len(acc) / RECENT_S

    def _sent_rate(self, now: float) -> float | None:
        """The rate this epoch's requests went at (a burst counts over ``MIN_EPOCH_S``)."""
        t0 = self._ep_t0
        if t0 is None or self._ep_sent == 0:
            return None
        return self._ep_sent / max(now - t0, MIN_EPOCH_S)

    def view(self) -> dict[str, Any]:
        return {
            "on": self.enabled,
            "per_s": round(self.rate, 3) if self.enabled else None,
            "refused_at_per_s": round(self.w_max, 3) if self.enabled else None,
            "decreases": self.decreases,
            "fleet_decreases": self.fleet_decreases,
            "pooled_with": len(self._peers),
        }
