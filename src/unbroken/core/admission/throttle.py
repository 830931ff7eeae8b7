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
  (TCP's once per window).  A measure that rests on fewer than ``MIN_SUPPORT``
  accepted answers is a guess (a key spent at the start: the streamed answers that
  were accepted have not come back yet, and one a second is not a limit): the rate
  then doubles each second from it until the next 429 measures again.  Anchored
  on it, one relay of `bench/fleet_sim.py` sat at 1 a second of an
  enforced-per-second 5 for a minute on half the seeds (`anthropic`, 44 %
  goodput).
* **A cold start's refused second counts.**  The requests a limiter let go before
  the throttle was on (its cold start) are counted at its first decrease: when every
  one of them was refused (a key spent at the start) and the last second's are more
  than the guessed rate lets go in one, nothing more goes until they are a second
  old, then one and the rate (`held_until`).  Each relay of a fleet otherwise let
  two or three more go in the second its four were refused: 12 to 13 requests in one
  second of a 5-a-second limit over two workers.
* **Then it probes back up** along CUBIC's curve: concave back to the rate that
  was refused (``W_max``) over ``CLIMB_S`` seconds, flat near it, convex beyond
  it, so a limit that was raised is found again, and a limit that holds costs one
  429 every few dozen requests.  It grows only while it is used (never beyond
  twice the rate actually sent: a quiet relay does not bank a licence).
* **A request alone is never held.**  With nothing in flight and nobody waiting,
  a request goes: the throttle orders a crowd, it never slows the lone agent below
  the simplest retry loop (whose own retry delay and pacer still apply).
* **A fleet shares what its relays were seen to accept.**  Relays (or workers)
  that share a key tell each other their measure after each decrease: the rate
  they were seen to accept (the *anchor*) and their demand (requests in flight or
  waiting); a sibling that sent lately answers with its own, once a window of
  ``SYNC_S``, and always to a decrease's measure (a *question*: the asker's
  window starts afresh, so what was told before it is not in its pool;
  `sibling_news`).  Each relay pools the window's measures and takes
  the fleet's accepted rate in proportion to its demand, but only upwards
  (`_raise`): one cut by a 429 while a sibling took most answers was anchored as
  low as it had been served (one a second of five) and climbed back as slowly as
  it was low, its agents waiting half a minute while its sibling's were served.
  Nothing a sibling says lowers a relay: its own 429s do (a fleet lowered as one
  on every sibling's 429 collapsed at scale in the simulator: 10,000 agents over
  50 relays at 41 to 44 % of the limit).  A sibling's anchor counts for at most
  ``SIBLING_SKEW`` times this relay's own; a lone relay hears none of it.
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
    "MIN_RATE",
    "MIN_SUPPORT",
    "SIBLING_SKEW",
    "SYNC_S",
    "AdmissionThrottle",
    "measure",
]

#: the share of the accepted rate kept after a 429 (CUBIC's and botocore's beta)
BETA = 0.95
#: seconds to climb back to the refused rate after a decrease (CUBIC's K)
CLIMB_S = 8.0
#: after a decrease nothing accepted measured, the rate doubles this often
PROBE_DOUBLE_S = 1.0
#: a decrease before the provider has accepted this many answers is a guess (probes)
MIN_SUPPORT = 4
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
#: siblings' measures within this long of this relay's own are one window's
SYNC_S = 1.0
#: a sibling's anchor counts for at most this many times this relay's own (or 1/s)
SIBLING_SKEW = 4.0
#: siblings pooled in one window at most, and the demand one may claim
MAX_PEERS = 256
MAX_DEMAND = 1_000_000.0


def measure(value: float, top: float) -> float:
    """A rate or a demand as told (or to tell) a sibling: within ``[0, top]``, and 0
    when it is not a finite number."""
    return min(max(value, 0.0), top) if math.isfinite(value) else 0.0


class AdmissionThrottle:
    """One limiter's outcome-driven ceiling on the rate of admissions (see above)."""

    __slots__ = (
        "_accepts",
        "_answered",
        "_ep_ok",
        "_ep_refused",
        "_ep_sent",
        "_ep_seq",
        "_ep_t0",
        "_ok_total",
        "_peers",
        "_pool_t",
        "_probing",
        "_sends",
        "_t",
        "anchor",
        "decreases",
        "demand",
        "enabled",
        "held_until",
        "raises",
        "rate",
        "replies",
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
        #: answers accepted since the start (a measure before ``MIN_SUPPORT`` is a guess)
        self._ok_total = 0
        self.decreases = 0  # for /status
        #: this relay's measure told to the siblings (after each decrease, and once a
        #: window in answer to theirs: ``replies``): the rate it was seen to accept
        #: (its anchor) and its demand (requests in flight or waiting)
        self.anchor = 0.0
        self.demand = 0.0
        self.replies = 0
        #: the siblings' measures in this window: who -> (anchor, demand), and when
        #: the window opened
        self._peers: dict[str, tuple[float, float]] = {}
        self._pool_t = -math.inf
        #: siblings whose question (a decrease's measure) this relay answered, and when
        self._answered: dict[str, float] = {}
        self.raises = 0  # for /status: raised to the pooled share
        #: the last decrease was a guess (its epoch had no accepted answer, or it came
        #: before ``MIN_SUPPORT`` answers were accepted)
        self._probing = False
        #: when the answers of the last ``RECENT_S`` were accepted (bounded)
        self._accepts: deque[float] = deque(maxlen=100_000)
        #: when the requests of the last ``BURST_S`` went (before it was on too: a cold
        #: start's)
        self._sends: deque[float] = deque(maxlen=100_000)
        #: after a cold start that was all refused, nothing goes before this (but a
        #: request alone: `_decrease`)
        self.held_until = 0.0

    # -- the curve ---------------------------------------------------------------------
    def _curve(self, now: float) -> float:
        """CUBIC's window as a rate: back to ``w_max`` after ``CLIMB_S``, then beyond.
        After a decrease that nothing accepted measured, or too few answers
        (``MIN_SUPPORT``: the estimate is a guess), it
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
        when = self.held_until if self.held_until > now else now
        if self.tokens < 1.0 - 1e-9:
            when = max(when, now + min((1.0 - self.tokens) / self.rate, 1.0 / MIN_RATE))
        return when

    def sent(self, seq: int, now: float) -> None:
        """Admission ``seq`` went (its token is spent)."""
        if self._ep_t0 is None:
            self._ep_t0 = now
        if not self.enabled:  # (a cold start's: the first decrease counts them)
            self._last_second(now).append(now)
        if seq > self._ep_seq:
            self._ep_sent += 1
        if self.enabled:
            self._refill(now)
            self.tokens = max(self.tokens - 1.0, -1.0)

    def accepted(self, seq: int, now: float) -> None:
        """Admission ``seq`` got an answer that was not a 429: the rate climbs."""
        if seq > self._ep_seq:
            self._ep_ok += 1
        self._ok_total += 1
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
        sent_rate = self._sent_rate(now)
        if sent_rate is None:
            sent_rate = self.rate if self.enabled else 1.0
        accepted = self._accepted(now, sent_rate)
        self._decrease(now, last_seq, accepted, sent_rate)
        self._open_pool(now, accepted, demand)
        self._raise()  # (siblings heard in the window so far still count)
        return True

    def sibling_news(
        self,
        now: float,
        who: str,
        anchor: float,
        demand: float,
        mine: float,
        *,
        asks: bool,
    ) -> bool:
        """Sibling ``who`` sharing this key told its measure: it had been seen to
        accept ``anchor`` a second with ``demand`` requests in flight or waiting (after
        a 429 of its own: ``asks``, a question; or answering one's news); ``mine``:
        this relay's demand now.  Never lowers this relay; raises it to its share of
        the pool when it was served below it (see the module docstring).  True when
        this relay should tell its own measure in turn, and only if it sent lately:
        once a window, and to every question (at most once in half a window from one
        sibling).  A question opened the asker's window afresh, so a measure this
        relay told before it is not in its pool: left unanswered because this relay's
        own window was open, a worker cut to 0.57 a second heard nothing for eight
        seconds with 23 turns waiting (the benchmark, `bare` over two workers)."""
        anchor, demand = measure(anchor, MAX_RATE), measure(demand, MAX_DEMAND)
        reply = False
        fresh = now - self._pool_t >= SYNC_S  # a new window: this relay's own measure
        owed = asks and now - self._answered.get(who, -math.inf) >= SYNC_S / 2
        if fresh or owed:
            sent_rate = self._sent_rate(now)
            if sent_rate is None:
                return False  # it sent nothing lately: nothing to pool, nothing to tell
            self._open_pool(now, self._accepted(now, sent_rate), mine)
            self.replies += 1
            reply = True
            if asks:
                if len(self._answered) >= MAX_PEERS:  # bounded: the old ones go
                    self._answered = {
                        w: t for w, t in self._answered.items() if now - t < SYNC_S / 2
                    }
                if who in self._answered or len(self._answered) < MAX_PEERS:
                    self._answered[who] = now
        if who in self._peers or len(self._peers) < MAX_PEERS:
            self._peers[who] = (anchor, demand)
            self._raise()
        return reply

    def _accepted(self, now: float, sent_rate: float) -> float:
        """The rate this epoch's requests (sent at ``sent_rate``) were seen accepted
        at: the answered share of what was sent, and at most what got through in the
        last second (a quantized limit's size)."""
        answered = self._ep_ok + self._ep_refused
        accepted = sent_rate * (self._ep_ok / answered if answered else 1.0)
        recent = self._recent(now)
        if recent > 0.0:
            accepted = min(accepted, recent) if accepted > 0.0 else recent
        return accepted

    def _open_pool(self, now: float, accepted: float, demand: float) -> None:
        """This relay's measure for the siblings (a window of ``SYNC_S``): the rate
        it was seen to accept and its demand; the window's siblings start afresh."""
        if now - self._pool_t >= SYNC_S:
            self._peers = {}
        self._pool_t = now
        self.anchor = accepted
        self.demand = measure(demand, MAX_DEMAND)

    def _raise(self) -> None:
        """The window's measures pooled: this relay's share is the fleet's accepted
        rate in proportion to its demand (a sibling's anchor bounded by ``SIBLING_SKEW``).
        A relay served below its share is raised to it at once; none is lowered (its
        own 429s do that)."""
        peers = self._peers
        if not self.enabled or not peers or self.demand <= 0.0:
            return
        bound = SIBLING_SKEW * max(self.anchor, 1.0)
        pooled = self.anchor + sum(min(a, bound) for a, _ in peers.values())
        wanted = self.demand + sum(d for _, d in peers.values())
        share = min(MAX_RATE, pooled * self.demand / wanted)
        if share > self.w_max:  # (a decrease opens a window: w_max only rises in one)
            self.w_max = share
            self.rate = max(self.rate, BETA * share)
            self.raises += 1

    def _decrease(self, now: float, last_seq: int, accepted: float, sent_rate: float) -> None:
        """CUBIC's decrease, anchored on the ``accepted`` rate (a new epoch)."""
        guess = accepted <= 0.0
        first = not self.enabled
        if guess:  # nothing got through this epoch: less than was sent
            accepted = BETA * sent_rate
        # (and a measure on too few answers is no measure: probe up from it)
        self._probing = guess or self._ok_total < MIN_SUPPORT
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
        if first:
            sends, most = self._last_second(now), max(1, math.floor(self.rate * BURST_S + 1e-9))
            if guess and len(sends) >= most:
                # A cold start that was all refused (a spent key), and its last second
                # already sent more than the guess lets go in one: nothing more until
                # those are a second old, then one and the rate.  (Each relay of a
                # fleet sent its four into a spent key and let two or three more go in
                # that second: 12 to 13 in one second of a 5-a-second limit.)
                self.held_until = self._t = sends[len(sends) - most] + BURST_S
                self.tokens = 1.0
            sends.clear()
        self.decreases += 1
        self._ep_seq = last_seq
        self._ep_t0 = now
        self._ep_sent = self._ep_ok = self._ep_refused = 0

    def _last_second(self, now: float) -> deque[float]:
        """The sends of the last ``BURST_S`` (recorded until the throttle is on)."""
        sends = self._sends
        while sends and sends[0] <= now - BURST_S:
            sends.popleft()
        return sends

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
            "raises": self.raises,
            "pooled_with": len(self._peers),
        }
