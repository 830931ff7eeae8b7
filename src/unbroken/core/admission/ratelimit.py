"""Admission by the provider's rate limits (sans-IO): a turn waits at the relay, not
in a storm of 429s.

Theory of operation
===================
Each upstream, for each credential (a hash of the key, never the key), has a
`Limiter` that learns the provider's budgets from its answers (`core.admission.ratehead`):

* **Buckets.**  Requests, tokens and output tokens each have a `Bucket`
  (`core.admission.bucket`): a limit, a level (what is left) and a refill rate.
  Providers refill continuously (OpenAI's and Anthropic's "reset" is when the
  budget is full again), so the rate is learned as ``(limit - remaining) / reset``,
  smoothed, and never above the limit a minute (a quantized provider's reset means
  "until the next request": it would say a rate thousands of times too fast);
  before any reset is seen it is a limit per minute.  A header sets the level to
  what the provider says is left, less what this relay admitted after the answered
  request was sent (it is not counted yet).  Between answers the level refills at
  the rate, for the requests budget less what the reports show others take from
  it (its `Drift`: a key shared with traffic the relay does not see).  A level's
  debt is at most its limit, and an attempt that ends before any answer said what
  it cost (a reset before headers) gives its estimate back.
* **Cost.**  A request costs one request and its estimated tokens: the body's
  bytes times the tokens a byte (``0.25`` to start, then learned from the input
  tokens the provider reports, per limiter) plus any ``max_tokens`` it asks for.
  Output tokens are not charged ahead (they are not known); an output budget the
  provider reports spent blocks until its reset.
* **A slow start.**  A new limiter lets ``cold_start`` requests (4) be in flight,
  and one more for each the provider answers without a 429 (doubling every round
  trip, as TCP's slow start), until ``max_concurrency``; a 429 halves it: fifty
  agents starting at once on a key whose headers overstate what is left cost a few
  429s, not fifty, while a lone agent's own first requests (a title and a turn, a
  sub-agent or two) never wait.
* **A second's share.**  Once the provider reports a requests limit, a crowd (more
  than one request in flight or waiting) is let go at most a second's share of it
  at once (at least ``cold_start``, until the provider refuses a request while its
  headers had room: then at least one), then at the limit a minute: a per-minute
  limit may be enforced per second ("quantized", as OpenAI documents), and a burst
  of a whole minute's budget into it is a burst of 429s (so were four at once into
  60 a minute: 40 agents behind it through one relay, 20 % 429s and half the
  goodput).  A request alone never waits on it.  A budget the provider reports
  banked (more left than a second's share: a token budget bound while requests
  refilled, a quiet spell) is drawn at up to twice the share (``DRAIN``), never more
  than twice the share within ``DRAIN_WINDOW_S`` (a request alone included: a lone
  agent waits only past that), until the provider refuses a request while every
  budget it reports has room: then what it says is left is not what may go at once,
  and a bank goes at the share from then on (`Limiter.drain`).  At the share, 160
  short turns banked behind 40 large first requests took 32 s where the provider
  would take them in 16 (`tpm` in docs/benchmarks.md: 75 % of the limit's goodput;
  91 % drawn).  A fleet's leased budget is no bank (`Limiter._drain`).
* **Concurrency** adapts (AIMD) for a provider that reports no budget: unbounded
  until the first 429; then a window of half the requests in flight, one more for
  every window of answered requests, and half again on a 429 (at most once per
  window of requests, like TCP).  A 429 the learned budgets explain is theirs.
* **A line.**  A turn whose cost is not available waits in the limiter's line.
  The line is fair: round robin across sessions (the turn's session key), first
  come first served within a session, so one busy agent cannot starve the others.
  `pump` grants the head as the buckets refill and reserves its cost at once; it
  says when the next grant is due; a grant nobody claims goes back after a while.
  A 429's block holds the line (``blocked_until``): its turns wait it out in their
  places (`core.admission.policy.RetryState._park`; one a cool-off held out comes back
  in its place, `FairLine.add`), and a fleet store leases nothing for it meanwhile.
  The turn the 429 refused retries in the place its turn came in, its wait bound
  counted afresh (`RetryState._park_rate`): not behind the turns that came since.
* **What the provider does corrects what it says.**  Every 429 goes to the
  limiter's `AdmissionThrottle` (`core.admission.throttle`): a ceiling on the admitted request rate,
  off until the first 429, then lowered multiplicatively to what the provider was
  seen to accept and probed back up along CUBIC's curve.  A Retry-After blocks the
  limiter until it says; with none, a budget the 429's headers report short of the
  request's cost is waited until it refills (a budget with room is left as it is).
  The retry itself is a retry like any other (`core.admission.policy`): at least the retry
  delay, and the pacer's go.
* **Bounded.**  No turn waits in the line longer than ``max_wait_s``: a ticket that
  has waited that long is let go whatever the model says (the provider's answer
  corrects the model again).
* **Shared.**  With a fleet store the buckets' levels are the fleet's
  (`Bucket.shared`): they do not refill locally; the store leases budget from the
  fleet's buckets in the background and adds it (`RateBoard.lease`), and turns
  never wait on the store.  A relay asks for what its throttle and its second's
  share let go within a second, less what it holds (`lease_want`: one that leased
  what it could not send held the fleet's budget from its siblings), and the
  fleet's requests bucket banks at most a second's share for a take (`fleet_hold`):
  a minute's budget banked while the tokens bound goes to the fleet at its rate, as
  one relay lets it go to a crowd.  When the store is down, the buckets refill
  locally again (split by the relays last seen).

Time is a monotonic ``now`` in seconds, passed in.  Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

from unbroken.core.admission.bucket import DEFAULT_WINDOW_S, SMOOTH, Bucket
from unbroken.core.admission.fairline import FairLine
from unbroken.core.admission.pacer import GRANT_TTL_S
from unbroken.core.admission.ratehead import RateHeaders
from unbroken.core.admission.throttle import MAX_RATE, AdmissionThrottle, measure

__all__ = [
    "Bucket",
    "FairLine",
    "Limiter",
    "RateBoard",
    "RateSettings",
    "credential_hash",
    "max_output_of",
]

#: the tokens a request body byte starts at (about four bytes a token)
DEFAULT_TOKENS_PER_BYTE = 0.25
#: a reset this short on a 429 that no budget explains is "until the next request may
#: go" (a quantized limit's): the key waits for it
NEXT_HINT_S = 1.0
#: a crowd draws a banked requests budget at up to this many times the second's share
#: (`Limiter.drain`), until the provider refuses a request its reported budgets had room
#: for (their "left" is not what may go at once: a per-second enforcement, a shared key)
DRAIN = 2.0
#: while drawing a bank, at most twice the second's share goes within this long (a
#: second, and a margin for the way there: requests sent a second apart may arrive
#: closer together)
DRAIN_WINDOW_S = 1.05
#: the drain's record of recent sends is bounded (past 300,000 a minute, only its pace
#: bounds a drawn bank)
MAX_SENDS = 10_000


@dataclass(frozen=True, slots=True)
class RateSettings:
    """The ``[ratelimit]`` section."""

    enabled: bool = True
    #: a reset, Retry-After or retry delay longer than this is clamped to it
    max_wait_s: float = 60.0
    #: the AIMD window never grows past this many requests in flight
    max_concurrency: int = 512
    #: the share of the window kept after a 429
    decrease: float = 0.5
    #: requests in flight before the provider has answered once (a lone agent's own
    #: concurrent first requests never wait; a fleet starting at once sends this many)
    cold_start: int = 4


def credential_hash(value: str) -> str:
    """A credential's identity in state, logs and the store: a short hash, never the key."""
    if not value:
        return "-"
    return hashlib.blake2b(value.encode(), digest_size=6, person=b"unbroken-key").hexdigest()


def max_output_of(body: Any) -> int:
    """The output tokens a parsed request body asks for at most (0: none named):
    ``max_tokens`` (Chat, Anthropic), ``max_completion_tokens``, ``max_output_tokens``
    (Responses), or the Gemini API's ``generationConfig.maxOutputTokens``."""
    if not isinstance(body, dict):
        return 0
    get = body.get
    for v in (get("max_tokens"), get("max_completion_tokens"), get("max_output_tokens")):
        if v is not None and _tokens_ok(v):
            return v
    config = get("generationConfig")
    if isinstance(config, dict):
        v = config.get("maxOutputTokens")
        if v is not None and _tokens_ok(v):
            return v
    return 0


def _tokens_ok(v: object) -> TypeGuard[int]:
    """A count of output tokens a request may ask for (an int, not a bool, in range)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 10_000_000


class Limiter:
    """One upstream's budgets for one credential (see the module docstring)."""

    __slots__ = (
        "_decrease_seq",
        "_modeled",
        "_next_hint",
        "_second",
        "_sends",
        "_unanswered",
        "blocked_until",
        "buckets",
        "cred",
        "drain",
        "granted",
        "key",
        "limited_total",
        "line",
        "ramp",
        "running",
        "seen",
        "seq",
        "settings",
        "throttle",
        "tokens_per_byte",
        "uncounted",
        "waited_total",
        "window",
    )

    def __init__(self, key: str, cred: str, settings: RateSettings) -> None:
        self.key = key
        self.cred = cred
        self.settings = settings
        #: "requests", "tokens", "output" -> its bucket, once a header named it
        self.buckets: dict[str, Bucket] = {}
        self.line = FairLine()
        #: ticket -> (when granted, the admission's seq)
        self.granted: dict[int, tuple[float, int]] = {}
        #: admissions the provider has not counted yet: seq -> tokens
        self.uncounted: dict[int, float] = {}
        #: admissions in flight: seq -> tokens (until the attempt is over)
        self.running: dict[int, float] = {}
        #: admissions in flight with no answer yet (accepted or refused)
        self._unanswered: set[int] = set()
        #: admissions in flight let go while the provider's budget was known: seq -> True
        self._modeled: dict[int, bool] = {}
        #: (seq, seconds): the shortest reset under ``NEXT_HINT_S`` an answer reported
        self._next_hint: tuple[int, float] = (0, 0.0)
        #: (tokens, when): the per-second share of a reported per-minute requests limit,
        #: as a bucket (a per-minute limit may be enforced per second: "quantized")
        self._second: tuple[float, float] | None = None
        #: the pace a crowd draws a bank at, in second's shares (`DRAIN`; 1 once the
        #: provider refused a request its budgets had room for)
        self.drain = DRAIN
        #: when the requests of the last `DRAIN_WINDOW_S` went (while drawing a bank)
        self._sends: deque[float] = deque(maxlen=MAX_SENDS)
        self.seq = 0
        #: the provider answered once (until then one request goes at a time)
        self.seen = False
        #: the AIMD window (None: unbounded, no 429 seen)
        self.window: float | None = None
        #: slow start: requests in flight before the provider has accepted many (one
        #: more for each it accepts; None: past ``max_concurrency``, or a 429 ended it)
        self.ramp: float | None = float(settings.cold_start)
        self._decrease_seq = 0
        self.blocked_until = 0.0
        self.tokens_per_byte = DEFAULT_TOKENS_PER_BYTE
        #: the admitted rate the provider's own answers correct (`core.admission.throttle`)
        self.throttle = AdmissionThrottle()
        self.waited_total = 0  # turns that had to wait in line
        self.limited_total = 0  # 429s answered

    # -- cost ------------------------------------------------------------------------
    def estimate(self, body_bytes: int, max_output: int = 0) -> float:
        """The tokens a request of ``body_bytes`` is charged ahead."""
        return body_bytes * self.tokens_per_byte + max_output

    def _costs(self, tokens: float) -> Iterator[tuple[Bucket, float]]:
        b = self.buckets.get("requests")
        if b is not None:
            yield b, 1.0
        b = self.buckets.get("tokens")
        if b is not None:
            yield b, tokens
        b = self.buckets.get("output")
        if b is not None:
            yield b, 1.0 if b.level < 1.0 else 0.0  # spent output blocks until it refills

    def due(self, tokens: float, now: float) -> float:
        """When a request of ``tokens`` may go (``now``: at once; inf: on a finish).
        A line's ticket that has waited ``max_wait_s`` goes anyway (`pump`)."""
        when = self.blocked_until if self.blocked_until > now else now
        window = self.window
        if window is not None and len(self.running) >= int(window):
            return math.inf
        ramp = self.ramp
        if ramp is not None and len(self.running) >= int(ramp):
            return math.inf  # a cold start: the rest wait for the provider's answers
        alone = not self.running and not self.granted and len(self.line) <= 1
        if not self.buckets:
            # No budget reported (yet): no bucket to wait for, and no second's share
            # (`_second_share` is None: `_second_due` says now; no bank to draw)
            due = self.throttle.due(now, alone=alone)
            return due if due > when else when
        for bucket, cost in self._costs(tokens):
            if cost > 0:
                when = max(when, bucket.due(cost, now))
        if not alone:
            when = max(when, self._second_due(now))
        elif self._drain() > 1.0 and (share := self._second_share()) is not None:
            # (alone too: a drawn bank's bound holds for every send)
            when = max(when, self._window_due(now, share))
        return max(when, self.throttle.due(now, alone=alone))

    def _second_share(self) -> tuple[float, float] | None:
        """(rate, burst) of the requests limit's one-second share, once one is reported:
        a burst of a second's worth (at least ``cold_start`` while the drain is on, at
        least one once the provider refused what its headers had room for), then the
        limit a minute."""
        b = self.buckets.get("requests")
        if b is None:
            return None
        rate = b.limit / DEFAULT_WINDOW_S
        return rate, max(float(self.settings.cold_start) if self.drain > 1.0 else 1.0, rate)

    def fleet_hold(self, name: str) -> float:
        """The most the fleet's bucket ``name`` banks for a take (a fleet store's
        `core.admission.leasemath.fleet_take`): the requests bucket a second's share of
        its limit, as this relay lets a crowd go (0: its limit)."""
        share = self._second_share() if name == "requests" else None
        return share[1] if share is not None else 0.0

    def fleet_report(self, name: str, granted: float, now: float) -> None:
        """Bucket ``name``'s last report was taught to the fleet's, whose store has
        granted ``granted`` from it in all: its drift, which the rate this relay
        teaches the fleet follows (`core.admission.bucket`)."""
        b = self.buckets.get(name)
        if b is not None:
            b.fleet_report(granted, now)

    def lease_want(self, now: float, most: int, horizon: float) -> int:
        """How many of the line's head requests a fleet store should lease for now: at
        most ``most``, no more than the throttle and the second's share let go within
        ``horizon`` seconds, less those the budget leased already covers (a relay that
        leased what it cannot send holds it from its siblings)."""

        def soon(tokens: float, rate: float) -> int:  # a bucket's grants within horizon
            return max(1, math.floor(max(tokens, 0.0) + rate * horizon + 1e-9))

        if self.blocked_until > now:
            # its line waits out a block (a 429's): leased now, the fleet's budget would
            # sit here while siblings could send it (the line's turns ask at its end)
            return 0
        n = min(len(self.line), most)
        t = self.throttle
        if t.enabled:
            t.due(now, alone=False)  # refilled to now
            n = min(n, soon(t.tokens, t.rate))
        share = self._second_share()
        if share is not None:
            self._second_due(now)  # refilled to now
            # (at the share: the fleet's bucket banks no more than it for a take, so a
            # fleet has no bank to draw)
            n = min(n, soon(self._second[0] if self._second else share[1], share[0]))
        head = self.line.head()
        held: int | None = None  # head requests the leased budget covers
        for b, cost in self._costs(self.line.costs.get(head, 0.0) if head else 0.0):
            if b.shared and cost > 0:  # (the charged buckets: output is never shared)
                k = max(math.floor(b.level / min(cost, b.limit) + 1e-9), 0)
                held = k if held is None else min(held, k)
        return max(n - (held or 0), 0)

    def _drain(self) -> float:
        """The pace a crowd draws a bank at now, in second's shares: ``drain``, and 1
        for a fleet's budget (its bucket banks no more than a second's share for a take:
        a relay's leased budget is no bank, and each relay's own drain would add up)."""
        b = self.buckets.get("requests")
        return 1.0 if b is not None and b.shared else self.drain

    def _second_due(self, now: float) -> float:
        share = self._second_share()
        if share is None:
            return now
        rate, burst = share
        drain = self._drain()
        pace = rate * drain
        if self._second is None:  # first reported now: what is in flight went this second
            self._second = (burst - len(self.running), now)
        tokens, t = self._second
        tokens = min(burst, tokens + (now - t) * pace)
        self._second = (tokens, now)
        due = now if tokens >= 1.0 - 1e-9 else now + (1.0 - tokens) / pace
        return max(due, self._window_due(now, share)) if drain > 1.0 else due

    def _window_due(self, now: float, share: tuple[float, float]) -> float:
        """While a bank is drawn (the caller knows): when one more request keeps to at
        most twice the ``share`` (`_second_share`) within `DRAIN_WINDOW_S` (``now``: at
        once)."""
        sends, most = self._sends, max(math.floor(2.0 * share[0]), math.ceil(share[1]))
        while sends and sends[0] <= now - DRAIN_WINDOW_S:
            sends.popleft()
        return sends[len(sends) - most] + DRAIN_WINDOW_S if len(sends) >= most else now

    def _spend(self, tokens: float, now: float) -> int:
        buckets = self.buckets
        if buckets:
            for bucket, cost in self._costs(tokens):
                if cost > 0 and bucket is not buckets.get("output"):
                    # a debt is at most the limit (estimates of attempts in flight)
                    bucket.level = max(-bucket.limit, bucket.level - min(cost, bucket.limit))
        self.seq += 1
        self.uncounted[self.seq] = tokens
        self.running[self.seq] = tokens
        self._unanswered.add(self.seq)
        if buckets:
            self._modeled[self.seq] = True
        self.throttle.sent(self.seq, now)
        if buckets and self._second_share() is not None:
            self._second_due(now)  # refilled to now
            tokens, _ = self._second or (0.0, now)
            self._second = (max(tokens - 1.0, -1.0), now)
            if self._drain() > 1.0:
                self._sends.append(now)
        return self.seq

    def _refund(self, seq: int) -> None:
        tokens = self.running.pop(seq, None)
        self._modeled.pop(seq, None)
        if tokens is None:
            return
        if self.uncounted.pop(seq, None) is not None:
            for bucket, cost in self._costs(tokens):
                if cost > 0 and bucket is not self.buckets.get("output"):
                    bucket.level = min(bucket.limit, bucket.level + min(cost, bucket.limit))

    # -- a turn's questions ------------------------------------------------------------
    def admit(
        self,
        ticket: int,
        session: str,
        tokens: float,
        now: float,
        since: float | None = None,
        place: float | None = None,
    ) -> int:
        """May this request go now?  The admission's seq (> 0; its cost is spent), or
        0: it waits in line (keeping its place when it asks again; ``since``: when it
        first waited, for one back in line after a cool-off held it out: the wait
        bound counts from then; ``place``: when its turn came, for a retry of a request
        the provider refused, which goes back in line in that place)."""
        got = self.granted.pop(ticket, None) if ticket else None
        if got is not None:
            return got[1]
        line = self.line
        head = line.head()
        if (head is None or head == ticket) and self.due(tokens, now) <= now:
            if head is not None:
                line.pop_head()
            return self._spend(tokens, now)
        if ticket and ticket not in line:
            start = since if since is not None and since < now else now
            line.add(ticket, session, tokens, start, place)
            if start >= now:  # (one back in line is counted once)
                self.waited_total += 1
        return 0

    def peek(self, ticket: int, tokens: float, now: float) -> bool:
        if ticket and ticket in self.granted:
            return True
        head = self.line.head()
        if head is not None and head != ticket:
            return False
        return self.due(tokens, now) <= now

    def withdraw(self, ticket: int) -> None:
        got = self.granted.pop(ticket, None)
        if got is not None:
            self._refund(got[1])
        self.line.remove(ticket)

    @property
    def waiting(self) -> bool:
        return bool(self.line) or bool(self.granted)

    # -- what the provider said ----------------------------------------------------------
    def learn(self, seq: int, h: RateHeaders, now: float) -> None:
        """An answer's headers for admission ``seq`` (0: not admitted here)."""
        self.seen = True
        self.uncounted.pop(seq, None)
        if h.requests is None and h.tokens is None and h.output is None:
            self._next_hint = (seq, 0.0)  # nothing reported (what the loop below does)
            return
        hint = 0.0
        for name, reading in (("requests", h.requests), ("tokens", h.tokens), ("output", h.output)):
            if reading is None or (reading.limit is None and name not in self.buckets):
                continue
            r = reading.reset_s
            if r is not None and 0.0 < r <= NEXT_HINT_S and (hint == 0.0 or r < hint):
                hint = r
            bucket = self.buckets.get(name)
            if bucket is None:
                assert reading.limit is not None
                bucket = self.buckets[name] = Bucket(reading.limit, now, drifts=name == "requests")
            after = 0.0
            if name != "output":
                after = sum(
                    (1.0 if name == "requests" else t) for s, t in self.uncounted.items() if s > seq
                )
            bucket.learn(reading, after, now)
        self._next_hint = (seq, hint)

    def accepted(self, seq: int, now: float) -> None:
        """Admission ``seq`` was answered, and not with a 429: the slow start widens
        (doubling each round trip) and the throttle climbs."""
        self.seen = True
        if seq not in self._unanswered:
            return  # counted already
        self._unanswered.discard(seq)
        ramp = self.ramp
        if ramp is not None:
            ramp += 1.0
            self.ramp = ramp if ramp < self.settings.max_concurrency else None
        self.throttle.accepted(seq, now)

    def limited(self, seq: int, retry_after_s: float | None, tokens: float, now: float) -> float:
        """A 429 for admission ``seq``: block until it may go again; returns that time.

        The provider refused what the model let go: the throttle lowers the admitted
        rate (once an epoch).  A Retry-After is waited (at most ``max_wait_s``); else a
        budget the provider's headers (learned first) report short of this request's
        cost is waited until it refills; else a reset under ``NEXT_HINT_S`` that the
        429's headers report ("until the next request"); else the throttle paces the
        retry."""
        self.limited_total += 1
        self.seen = True
        self.uncounted.pop(seq, None)
        self._unanswered.discard(seq)
        modeled = self._modeled.pop(seq, False)
        budget_due = now
        for bucket, cost in self._costs(tokens):
            if cost > 0:
                budget_due = max(budget_due, bucket.due(cost, now))
        hint_seq, hint = self._next_hint
        hinted = hint_seq == seq and hint > 0.0
        # A 429 is proof the model is wrong when the model let the request go (a budget
        # was known then), or when nothing the provider says explains it (no budget
        # short, no "next request in under a second", no Retry-After); one that meets a
        # key already spent before anything was known is not, nor a provider's own
        # "come back in N s" to a relay that knows no budget (a sporadic 429 with a
        # Retry-After must not spiral the throttle down: it is waited, as it says).
        explained = budget_due > now or hinted or retry_after_s is not None
        if budget_due <= now and self.drain > 1.0:
            # refused while every budget its headers report had room (let go by the
            # model or not: a cold start's 429s on a key whose headers overstate what
            # is left are the first proof): what they say is left may not go at once
            # (a per-second enforcement, a shared key); a bank goes at the share
            self.drain = 1.0
            self._sends.clear()
        if (
            (modeled or not explained)
            and self.throttle.refused(seq, now, self.seq, self.demand)
            and self.ramp is not None
        ):
            # fewer in flight (halved, as TCP's slow start on a loss), still growing by
            # one for each answer taken: a block's end does not let the whole line go
            self.ramp = max(1.0, min(self.ramp, float(len(self.running))) / 2.0)
        running = len(self.running)
        if not self.buckets and seq > self._decrease_seq:
            # A 429 no reported budget explains (a provider that sends no rate-limit
            # headers): fewer at once.  Once per window of requests, like TCP.
            self._decrease_seq = self.seq
            base = self.window if self.window is not None else float(running)
            self.window = max(1.0, base * self.settings.decrease)
        if retry_after_s is not None:
            until = now + min(retry_after_s, self.settings.max_wait_s)
        else:
            # Only a budget the provider reports short of this request's cost is
            # waited for (its headers, learned first, say which); one with room is
            # not emptied by a 429 that may be another budget's or another limit's.
            due = budget_due if math.isfinite(budget_due) else now
            if due <= now and hinted:
                # No budget explains it, and its own headers say the next request may
                # go in under a second (a per-minute limit enforced per second)
                due = now + hint
            until = min(due, now + self.settings.max_wait_s)
        self.blocked_until = max(self.blocked_until, until)
        return self.blocked_until

    def sibling_news(
        self, now: float, who: str, anchor: float, demand: float, *, asks: bool
    ) -> bool:
        """Sibling ``who`` sharing this key and credential told its measure: seen to
        accept ``anchor`` a second with ``demand`` requests in flight or waiting
        (`AdmissionThrottle.sibling_news`: pooled; a relay served below its share is
        raised to it, none is lowered).  True when a fleet store has something to do:
        this one answers with its own measure, or its rate rose (the line may move); a
        repeated message changes nothing."""
        rate = self.throttle.rate
        answer = self.throttle.sibling_news(now, who, anchor, demand, self.demand, asks=asks)
        return answer or self.throttle.rate != rate

    @property
    def demand(self) -> float:
        """Requests in flight or waiting here: this limiter's weight in the fleet."""
        return float(len(self.running) + len(self.line))

    def news(self) -> tuple[int, int, float, float]:
        """The measures the throttle has had to tell, its decreases (questions: the
        siblings answer them) and its answers to siblings, and the last one's anchor
        and demand: what a fleet store tells the siblings after each
        (`relay.ratestore.RateShare`; a question when the decreases moved)."""
        t = self.throttle  # (finite: a message's JSON has no NaN)
        return t.decreases, t.replies, measure(t.anchor, MAX_RATE), t.demand

    def finish(
        self,
        seq: int,
        now: float,
        *,
        ok: bool = True,
        tokens_in: int | None = None,
        body_bytes: int = 0,
    ) -> None:
        """The attempt of admission ``seq`` is over (its slot is free; ``ok``: it was
        answered, the window grows); learn from the input tokens reported for it."""
        if ok and seq in self._unanswered:
            self.accepted(seq, now)  # an answer no header event told of
        self._unanswered.discard(seq)
        self._modeled.pop(seq, None)
        tokens = self.running.pop(seq, None)
        self.seen = True
        if tokens is None:
            self.uncounted.pop(seq, None)
            return
        if self.uncounted.pop(seq, None) is not None and not ok:
            # It ended before any answer said what it cost (a reset before headers):
            # its estimate goes back, so attempts that die cannot sink a budget.
            for bucket, cost in self._costs(tokens):
                if cost > 0 and bucket is not self.buckets.get("output"):
                    bucket.level = min(bucket.limit, bucket.level + min(cost, bucket.limit))
        if ok and self.window is not None:
            self.window = min(
                float(self.settings.max_concurrency), self.window + 1.0 / max(self.window, 1.0)
            )
        if tokens_in is not None and body_bytes > 0 and tokens_in > 0:
            seen = min(tokens_in / body_bytes, 4.0)
            self.tokens_per_byte = (1 - SMOOTH) * self.tokens_per_byte + SMOOTH * seen

    # -- granting ------------------------------------------------------------------------
    def pump(self, now: float) -> tuple[list[int], float | None]:
        """The tickets that may go now (their cost reserved), and when to pump next
        (None: when something changes, a finish or a header)."""
        for ticket, (when, seq) in list(self.granted.items()):
            if now - when > GRANT_TTL_S:
                del self.granted[ticket]
                self._refund(seq)
        out: list[int] = []
        line = self.line
        max_wait = self.settings.max_wait_s
        while line:
            late = line.overdue(now, max_wait)
            if late is not None:  # no wait is longer than max_wait_s, whatever the model
                tokens = line.costs[late]
                line.remove(late)
                self.granted[late] = (now, self._spend(tokens, now))
                out.append(late)
                continue
            head = line.head()
            assert head is not None
            due = self.due(line.costs[head], now)
            if due > now:
                first = line.deadline()
                if first is not None:  # (a line with a head has one)
                    due = min(due, first[1] + max_wait)
                return out, (due if math.isfinite(due) else None)
            tokens = line.costs[head]
            line.pop_head()
            self.granted[head] = (now, self._spend(tokens, now))
            out.append(head)
        return out, None

    def wait_reason(self, now: float) -> str:
        """Why this line waits, for the logs."""
        why: list[str] = []
        if self.ramp is not None and len(self.running) >= int(self.ramp):
            why.append(f"slow start, {len(self.running)} in flight")
        share = self._second_share()
        if share is not None and self._second_due(now) > now:
            why.append(f"a second's share, {share[0] * self._drain():.3g}/s")
        for name, b in self.buckets.items():
            b.refill(now)
            if b.level < 1.0:
                why.append(f"{name} spent, {b.rate:.3g}/s")
        if self.blocked_until > now:
            why.append(f"blocked {self.blocked_until - now:.1f}s")
        if self.throttle.enabled:
            why.append(f"{self.throttle.rate:.3g}/s after the provider's 429s")
        head = f"rate limit (key {self.cred})"
        return f"{head}: {', '.join(why)}" if why else head

    def view(self, now: float) -> dict[str, Any]:
        return {
            "credential": self.cred,
            "buckets": {n: b.view(now) for n, b in self.buckets.items()},
            "window": None if self.window is None else round(self.window, 2),
            "in_flight": len(self.running),
            "waiting": len(self.line),
            "sessions_waiting": self.line.sessions(),
            "blocked_s": round(max(0.0, self.blocked_until - now), 3),
            "tokens_per_byte": round(self.tokens_per_byte, 4),
            "waited_total": self.waited_total,
            "limited_total": self.limited_total,
            "throttle": self.throttle.view(),
            "shared": any(b.shared for b in self.buckets.values()),
            "drain": self.drain,
        }


class RateBoard:
    """The limiters of one relay process, by upstream key and credential."""

    def __init__(self, settings: RateSettings | None = None) -> None:
        self.settings = settings or RateSettings()
        #: upstream key -> credential hash -> its limiter
        self.limiters: dict[str, dict[str, Limiter]] = {}
        #: told when a line of ``key`` may move (the health board's listener)
        self.poke: Callable[[str], None] | None = None
        #: told of every change of ``key``'s limiters (a fleet store's top-ups)
        self.listeners: list[Callable[[str], None]] = []

    def get(self, key: str, cred: str) -> Limiter:
        by = self.limiters.get(key)
        if by is None:
            by = self.limiters[key] = {}
        lim = by.get(cred)
        if lim is None:
            lim = by[cred] = Limiter(key, cred, self.settings)
        return lim

    def waiting(self, key: str) -> bool:
        by = self.limiters.get(key)
        if by:  # (a loop, not a generator: asked twice a turn)
            for lim in by.values():
                if lim.line or lim.granted:  # `Limiter.waiting`, inline
                    return True
        return False

    def pump(self, key: str, now: float) -> tuple[list[int], float | None]:
        by = self.limiters.get(key)
        if not by:
            return [], None
        out: list[int] = []
        due: float | None = None
        for lim in by.values():
            got, d = lim.pump(now)
            out.extend(got)
            if d is not None and (due is None or d < due):
                due = d
        return out, due

    def changed(self, key: str) -> None:
        for listener in self.listeners:
            listener(key)
        poke = self.poke
        if poke is not None and self.waiting(key):
            poke(key)

    def all(self) -> Iterator[Limiter]:
        for by in self.limiters.values():
            yield from by.values()

    def view(self, key: str, now: float) -> list[dict[str, Any]]:
        by = self.limiters.get(key)
        return [lim.view(now) for lim in by.values()] if by else []

    def in_line(self, key: str) -> int:
        """Turns waiting in ``key``'s rate lines."""
        by = self.limiters.get(key)
        return sum(len(lim.line) for lim in by.values()) if by else 0

    def wait_reason(self, key: str, now: float) -> str | None:
        """Why turns wait in ``key``'s rate lines, for the logs (None: none do)."""
        by = self.limiters.get(key) or {}
        return "; ".join(lim.wait_reason(now) for lim in by.values() if lim.line) or None
