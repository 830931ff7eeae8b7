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
  429 every few dozen requests.  In a fleet (below) the curve's constant is
  never below ``C_MIN``: a relay anchored low is back sooner, not half a minute
  later.  It grows only while it is used (never beyond
  twice the rate actually sent: a quiet relay does not bank a licence).
* **A request alone is never held.**  With nothing in flight and nobody waiting,
  a request goes: the throttle orders a crowd, it never slows the lone agent below
  the simplest retry loop (whose own retry delay and pacer still apply).
* **A fleet's 429 is every relay's.**  Relays (or workers) that share a key tell
  each other when a 429 lowered their rate (`fleet_refused`): the provider refuses
  the fleet's total, so each comes down at once, anchored on what it was seen to
  accept, and they climb back together.  Each relay probing on its own found the
  limit as many times as there are relays, and their rates drifted apart (the one
  that came down last kept more).  Once an epoch: a sibling's news within
  ``SYNC_S`` of this relay's own decrease is the same refusal.  A relay that sent
  nothing lately has nothing to lower; a lone relay never hears one.
* **Bounded.**  The rate stays within ``[MIN_RATE, MAX_RATE]`` and the wait it
  asks for is at most ``1 / MIN_RATE`` (the limiter caps every wait at
  ``max_wait_s`` on top).

Time is a monotonic ``now`` in seconds, passed in.  Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["BETA", "CLIMB_S", "C_MIN", "MAX_RATE", "MIN_RATE", "SYNC_S", "AdmissionThrottle"]

#: the share of the accepted rate kept after a 429 (CUBIC's and botocore's beta)
BETA = 0.95
#: seconds to climb back to the refused rate after a decrease (CUBIC's K)
CLIMB_S = 8.0
#: after a decrease nothing accepted measured, the rate doubles this often
PROBE_DOUBLE_S = 1.0
#: CUBIC's constant at least, in a fleet (requests a second, per second cubed): the
#: climb is scaled to the refused rate, and a relay anchored low (it had seen a second
#: of answers while a sibling took the rest) climbed as slowly as it was low: from 1 a
#: second to 2 in 30 s.  With the floor it is back within 3 s and passes 3 a second
#: within 10 s; a refused rate of 50 a second or more climbs as before.  Only once a
#: sibling has told of a 429 (`fleet_refused`): the fleet then probes together, and a
#: lone relay's curve, and the 429s it costs, are as they were.
C_MIN = 0.005
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


class AdmissionThrottle:
    """One limiter's outcome-driven ceiling on the rate of admissions (see above)."""

    __slots__ = (
        "_accepts",
        "_ep_ok",
        "_ep_refused",
        "_ep_sent",
        "_ep_seq",
        "_ep_t0",
        "_probing",
        "_t",
        "decreases",
        "enabled",
        "fleet",
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
        #: ... of which a sibling's 429 made (`fleet_refused`; never told again)
        self.fleet_decreases = 0
        #: a sibling has told of a 429: this relay probes as one of a fleet (`C_MIN`)
        self.fleet = False
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
        k = CLIMB_S
        if self.fleet and c < C_MIN:  # a low anchor in a fleet: see C_MIN
            c = C_MIN
            k = self.climb_s()
        cubic = self.w_max + c * (t - k) ** 3
        if self._probing:
            return max(cubic, BETA * self.w_max * math.pow(2.0, min(t / PROBE_DOUBLE_S, 40.0)))
        return cubic

    def climb_s(self) -> float:
        """Seconds from the last decrease back to the refused rate (CUBIC's K):
        ``CLIMB_S``, or less in a fleet when ``C_MIN`` sets the pace (a low anchor)."""
        c = self.w_max * (1.0 - BETA) / CLIMB_S**3
        if not self.fleet or c >= C_MIN:
            return CLIMB_S
        return float((self.w_max * (1.0 - BETA) / C_MIN) ** (1.0 / 3.0))

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

    def refused(self, seq: int, now: float, last_seq: int) -> bool:
        """Admission ``seq`` was answered 429.  True when the rate was lowered (once
        an epoch); ``last_seq``: the newest admission (the next epoch starts after it)."""
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
        self._decrease(now, last_seq, accepted, sent_rate)
        return True

    def fleet_refused(self, now: float, last_seq: int) -> bool:
        """A sibling sharing this key lowered its rate after a 429 (see the module
        docstring).  True when this relay's rate was lowered too."""
        self.fleet = True
        if self.enabled and now - self.t_decrease < SYNC_S:
            return False  # this relay came down for the same refusal
        sent_rate = self._sent_rate(now)
        if sent_rate is None:
            return False  # it sent nothing this epoch: nothing of it to lower
        answered = self._ep_ok + self._ep_refused
        accepted = sent_rate * (self._ep_ok / answered if answered else 1.0)
        recent = self._recent(now)
        if recent > 0.0:
            accepted = min(accepted, recent) if accepted > 0.0 else recent
        self._decrease(now, last_seq, accepted, sent_rate)
        self.fleet_decreases += 1
        return True

    def _decrease(self, now: float, last_seq: int, accepted: float, sent_rate: float) -> None:
        """CUBIC's decrease, anchored on the ``accepted`` rate (a new epoch)."""
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
        }
