"""Retry policy (sans-IO): what is retryable, how long to wait, where to go next.

Nothing here touches a socket or an event loop.  Time comes in as ``now``
arguments (monotonic seconds, or wall-clock seconds for HTTP dates) and
randomness through an injected ``random.Random``, so every decision can be
tested with plain values.

Replay *safety* (may this failure be retried at all, given what the client has
seen?) is not decided here: that is the ledger's job.  This module only answers
"if we retry, when and where".
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import msgspec

from unbroken.core.admission.health import QUOTA_LOOK_AGAIN_S, HealthBoard
from unbroken.core.admission.pacer import PaceSettings
from unbroken.core.admission.ratehead import RateHeaders
from unbroken.core.admission.ratelimit import Limiter

__all__ = [
    "QUOTA_STATUSES",
    "RETRY_STATUSES",
    "Failure",
    "FailureClass",
    "Park",
    "RetryPolicy",
    "RetryState",
    "counts_against_upstream",
    "is_quota_body",
    "is_retryable_status",
    "parse_retry_after",
    "rendezvous_order",
]

#: HTTP statuses that are retried (the opencode-retry-forever defaults).
RETRY_STATUSES: frozenset[int] = frozenset(
    {408, 409, 425, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524, 525, 527, 529, 530}
)


#: statuses that mean "this account's quota or credit is spent" (a long cool-off)
QUOTA_STATUSES: frozenset[int] = frozenset({402})

#: lower-case markers of an exhausted quota or a billing problem in an error body
QUOTA_MARKERS: tuple[bytes, ...] = (
    b"insufficient_quota",  # OpenAI's code
    b"exceeded your current quota",  # OpenAI's message
    b"billing_hard_limit_reached",
    b"billing_not_active",
    b"credit balance is too low",  # Anthropic's message
    b"payment required",
)


def is_retryable_status(status: int) -> bool:
    """Retried, or (a quota status) rerouted to another upstream when there is one."""
    return status in RETRY_STATUSES or status in QUOTA_STATUSES


def is_quota_body(body: bytes) -> bool:
    """An error body that says the quota or credit is spent (``insufficient_quota``...)."""
    low = body[:65536].lower()
    return any(m in low for m in QUOTA_MARKERS)


class FailureClass(enum.StrEnum):
    """Why an attempt failed.  ``connection`` classes reroute without waiting."""

    STATUS = "status"  # a retryable HTTP status
    DNS = "dns"
    REFUSED = "connection_refused"
    RESET = "connection_reset"
    ABORTED = "connection_aborted"
    BROKEN_PIPE = "broken_pipe"
    UNREACHABLE = "unreachable"
    CONNECT_FAILED = "connect_failed"  # connect failed, no single errno (happy eyeballs)
    CONNECT_TIMEOUT = "connect_timeout"
    TLS = "tls"
    DISCONNECTED = "server_disconnected"  # closed before/while sending the response
    HEADER_TIMEOUT = "header_timeout"
    STALL = "stall"  # first-frame or idle timeout on a stream
    TRUNCATED = "truncated"  # body ended without the protocol's terminal frame
    STREAM_ERROR = "stream_error"  # retryable error event inside a 200 stream
    MALFORMED = "malformed"  # a frame the classifier could not parse
    PAYLOAD = "payload_error"  # body transfer broke (chunking, content-length)
    OTHER = "other_network"

    @property
    def reroutes_at_once(self) -> bool:
        """The upstream could not even be reached: try another one now."""
        return self in _CONNECT_LEVEL


_CONNECT_LEVEL = frozenset(
    {
        FailureClass.DNS,
        FailureClass.REFUSED,
        FailureClass.UNREACHABLE,
        FailureClass.CONNECT_FAILED,
        FailureClass.CONNECT_TIMEOUT,
        FailureClass.TLS,
    }
)


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt: its class, a short human reason, and any Retry-After."""

    cls: FailureClass
    reason: str
    status: int | None = None
    retry_after_s: float | None = None

    @property
    def label(self) -> str:
        return str(self.status) if self.status is not None else self.cls.value

    @property
    def quota(self) -> bool:
        """The upstream's quota or credit is spent: a long cool-off, never a plain retry."""
        return self.status in QUOTA_STATUSES or self.reason.startswith("quota")


def counts_against_upstream(failure: Failure) -> bool:
    """A failure the breaker counts: network errors, stalls, cut streams, 5xx; never a 4xx."""
    return failure.status is None or failure.status >= 500


def parse_retry_after(headers: Mapping[str, str], *, now_wall: float) -> float | None:
    """Seconds to wait from ``retry-after-ms``, ``Retry-After`` (seconds or HTTP-date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
            if value >= 0:
                return value
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if ra is None:
        return None
    ra = ra.strip()
    try:
        seconds = float(ra)
    except ValueError:
        try:
            when = parsedate_to_datetime(ra)
        except (TypeError, ValueError, IndexError):
            return None
        return max(0.0, when.timestamp() - now_wall)
    return seconds if seconds >= 0 else None


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The ``[retry]`` settings that shape waiting (see docs/configuration.md).

    A retry waits ``delay_ms`` (``backoff = "fixed"``, the default; or a full-jitter
    exponential draw), then takes its go from the upstream's pacer
    (`unbroken.core.admission.pacer`): ``pace_floor_per_s`` retries a second while the upstream
    fails (0: ``1000 / delay_ms``, so a lone turn never waits on it), plus
    ``pace_ratio`` for every answered attempt, at most ``pace_burst`` at once.
    """

    delay_ms: int = 250
    backoff: str = "fixed"  # or "exponential" (full jitter, up to max_delay_ms)
    max_delay_ms: int = 30_000
    max_attempts: int = 0  # total attempts including the first; 0 = unlimited
    honor_retry_after: bool = True
    max_retry_after_ms: int = 60_000
    #: retries a second a failing upstream gets from this relay (0: 1000 / delay_ms)
    pace_floor_per_s: float = 0.0
    #: retries earned by each answered attempt (retries in proportion to successes)
    pace_ratio: float = 1.0
    #: retries that may go at once
    pace_burst: float = 10.0

    def base_delay(self, retry_number: int, rng: random.Random) -> float:
        """Seconds before retry number ``retry_number`` (1 = the first retry)."""
        if self.backoff == "exponential":
            cap = min(self.max_delay_ms, self.delay_ms * (2 ** min(retry_number - 1, 40)))
            return rng.uniform(0, cap) / 1000.0  # full jitter
        return min(self.delay_ms, self.max_delay_ms) / 1000.0

    def clamp_retry_after(self, seconds: float) -> float:
        return min(seconds, self.max_retry_after_ms / 1000.0)

    def pace_settings(self) -> PaceSettings:
        floor = self.pace_floor_per_s or 1000.0 / max(1, self.delay_ms)
        return PaceSettings(floor_per_s=floor, ratio=self.pace_ratio, burst=self.pace_burst)


@dataclass(frozen=True, slots=True)
class Park:
    """No upstream may be tried now: wait until ``until`` (monotonic), then look again."""

    until: float
    why: str  # "breaker" | "cooloff" | "probe" | "pacer" | "ratelimit"
    #: the upstream whose line the turn waits in (its key), if any
    key: str | None = None


def rendezvous_order(session: str, keys: Sequence[str]) -> list[int]:
    """Upstream indexes by rendezvous (highest random weight) hashing of ``session``.

    Stable across processes and machines; removing one upstream moves only the
    sessions that ranked it first.
    """

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{session}\0{keys[i]}".encode(), digest_size=8).digest()

    return sorted(range(len(keys)), key=weight, reverse=True)


class RetryState(msgspec.Struct):
    """Attempt bookkeeping for one turn over a route's upstreams (sans-IO).

    ``next_upstream`` picks the upstream for the next attempt: the session's
    rendezvous order when the turn carries a ``sticky`` key, else the route's order;
    the first attempt takes the first usable one (from ``prefer``, when the turn
    starts on a given upstream, as a WebSocket whose socket is there), a retry the
    next usable one after the current.  An upstream is skipped while it asked
    (Retry-After, quota) to be left alone or its breaker (``board``) is open; a retry
    also needs its pacer's go (`core.admission.pacer`).  With a ``board``, when no upstream
    may be tried it returns a `Park`: the turn waits in that upstream's line (the
    transport wakes it when the pacer grants it, or at ``until``).
    ``record_failure`` says how long to wait before the next attempt.

    Every attempt, the first included, also needs the provider's budget for the
    upstream's credential (``creds``; `core.admission.ratelimit`): a turn whose cost is not
    there waits in that limiter's fair line (``Park(why="ratelimit")``).  A 429 is
    a retry like any other: it waits at least the retry delay (or its Retry-After)
    and takes its go from the upstream's pacer, so 429s can never storm; the
    limiter learns from it (its throttle lowers the admitted rate) and the retry
    then waits in the limiter's line for what the provider's budget allows.

    A msgspec Struct, not a dataclass: the same fields, made by a C ``__init__``
    (about 2,000 instructions for a turn's, against 11,000 for the dataclass's Python
    one with its keyword arguments packed into a dict and out again).
    """

    policy: RetryPolicy
    n_upstreams: int
    rng: random.Random = msgspec.field(default_factory=random.Random)
    cooloff_until: dict[int, float] = msgspec.field(default_factory=dict)
    board: HealthBoard | None = None
    keys: Sequence[str] = ()  # the board's key of each upstream
    sticky: str | None = None  # the session key: same session, same upstream
    quota_cooloff_s: float = 3600.0
    #: the first attempt goes here when it is usable (-1: the order's first)
    prefer: int = -1
    #: a parked turn looks again at least this often
    park_check_s: float = 1.0
    attempts: int = 0
    retries: int = 0
    current: int = -1
    why: str = ""  # how the last upstream was chosen: first, sticky, rotated, breaker_skip
    quota_wall: bool = False  # the last failure was a spent quota with no other upstream
    #: this turn's place-holder in the pacers' lines (0: none yet)
    ticket: int = 0
    #: the key of the line this turn waits in, if any
    line: str | None = None
    #: each upstream's credential hash (`ratelimit.credential_hash`); none given: the
    #: turn is not rate limited (the transports always give them)
    creds: Sequence[str] = ()
    #: the request body's size and the output tokens it asks for (its cost)
    body_bytes: int = 0
    max_output: int = 0
    _adm: tuple[Limiter, int, float] | None = None  # the live admission: (limiter, seq, tokens)
    _rate_line: Limiter | None = None  # the limiter whose line the turn waits in
    #: since when this attempt has waited for a rate budget (kept while a cool-off or a
    #: breaker holds it out of the line: back in line, its wait bound still counts)
    _rate_since: float | None = None
    #: when this turn first asked a limiter for its budget: a retry after a 429 waits
    #: in the rate line in its place by this time (not behind the turns that came
    #: since); any other failure starts it afresh
    _came: float | None = None
    _pace_done: bool = False  # this retry has its pacer's go already
    _order: list[int] | None = None
    #: the upstream whose fleet probe lease this turn's attempt holds, until a verdict
    _probe: str | None = None
    _counted: set[int] = msgspec.field(default_factory=set)  # upstreams this turn has failed on

    def exhausted(self) -> bool:
        return self.policy.max_attempts > 0 and self.attempts >= self.policy.max_attempts

    def _blocked(self, i: int, now: float) -> float:
        until = self.cooloff_until.get(i, 0.0)
        until = until if until > now else 0.0
        board = self.board
        if board is not None:
            until = max(until, board.blocked_until(self.keys[i], now))
        return until

    def order(self) -> list[int]:
        order = self._order
        if order is None:
            if self.sticky and self.keys and self.n_upstreams > 1:
                order = rendezvous_order(self.sticky, self.keys)
            else:
                order = list(range(self.n_upstreams))
            self._order = order
        return order

    def next_upstream(self, now: float, *, pace: bool = True) -> int | Park:
        """Choose the upstream for the next attempt and count the attempt (or `Park`).

        ``pace=False``: retries skip the pacer (the testing mode's no-wait runs)."""
        n = self.n_upstreams
        order = self.order()
        first = self.current < 0
        if first:
            start = order.index(self.prefer) if 0 <= self.prefer < n else 0
        else:
            start = (order.index(self.current) + 1) % n
        board = self.board
        paced = pace and not first and board is not None
        rated = board is not None and pace and bool(self.creds) and board.rates.settings.enabled
        ticket = self.ticket
        if paced and not ticket:
            assert board is not None
            ticket = self.ticket = board.new_ticket()
        choice = -1
        skipped = False
        soonest = float("inf")
        why = "cooloff"
        blocked_at = -1  # the upstream free soonest, when every one is blocked
        in_line = -1  # the first free upstream whose pacer says wait
        rate_in: tuple[int, Limiter, float] | None = None  # the first whose budget is spent
        lim: Limiter | None = None
        tokens = 0.0
        quota_at, held = -1, False  # an upstream kept out by a quota only; any other block
        for k in range(n):
            idx = order[(start + k) % n]
            until = self._blocked(idx, now)
            if until > 0.0:
                skipped = True
                if board is not None and self._quota_only(board, idx, now):
                    quota_at = idx if quota_at < 0 else quota_at
                else:
                    held = True
                if until < soonest:
                    soonest, blocked_at = until, idx
                    why = self._why_blocked(idx, now)
                continue
            if board is not None:
                key = self.keys[idx]
                pace_it = paced and not self._pace_done
                if pace_it and not board.peek(key, ticket, now):
                    if in_line < 0:
                        in_line = idx
                    continue
                if rated:
                    lim = board.rates.get(key, self.creds[idx])
                    tokens = lim.estimate(self.body_bytes, self.max_output)
                    if not lim.peek(ticket, tokens, now):
                        if rate_in is None:
                            rate_in = (idx, lim, tokens)
                            if pace_it:  # the pacer's go is this retry's: claim it
                                self._pace_done = board.admit(key, self._ticket(board), now)
                        continue
                if not board.take(key, now):  # a half-open probe that is not ours
                    skipped = True
                    if paced and self.line == key:
                        board.requeue(key, ticket)  # granted the probe: first in line again
                    probe_until = board.blocked_until(key, now) or now + 0.05
                    if probe_until < soonest:
                        soonest, why, blocked_at = probe_until, "probe", idx
                    continue
                if board.holds_probe(key):
                    self._probe = key  # given back by a verdict, or when the turn ends
                if pace_it:
                    board.admit(key, ticket, now)  # peek said yes: spends the token
                if rated and lim is not None:
                    self._admitted(board, key, lim, tokens, now)
            choice = idx
            break
        if choice < 0 and quota_at >= 0 and not held and in_line < 0 and rate_in is None:
            # Only spent quotas: the provider answers now, rather than the turn waiting
            # for a cool-off (issue 36); its quota answer ends the turn (`quota_wall`).
            choice, skipped = quota_at, False
        if choice < 0:
            if board is not None:
                if in_line < 0 and rate_in is not None:
                    return self._park_rate(board, now, *rate_in)
                return self._park(board, now, in_line, blocked_at, soonest, why)
            # no board: everyone is cooling off, take the one free soonest
            choice = min(range(n), key=lambda i: self.cooloff_until.get(i, 0.0))
        if self.line is not None and board is not None:
            board.withdraw(self.line, ticket)
            self.line = None
        if skipped or in_line >= 0:
            self.why = "breaker_skip"
        elif first:
            self.why = "sticky" if self.sticky and n > 1 else "first"
        else:
            self.why = "rotated"
        self.current = choice
        self.attempts += 1
        self._pace_done = False
        return choice

    def next_resume(self, now: float, *, pace: bool = True) -> int | Park:
        """The next attempt continues a cut response (`core.turn.continuation`): it goes to
        the current upstream (where the response lives) and nowhere else, after its
        pacer's go like any retry (else a `Park` in its line).  Cool-offs and breakers
        do not hold it back: it resumes what that upstream already runs."""
        idx = self.current
        board = self.board
        if pace and board is not None and self.keys and idx >= 0:
            key = self.keys[idx]
            ticket = self._ticket(board)
            if not self._pace_done and not board.peek(key, ticket, now):
                if self.line is not None and self.line != key:
                    board.withdraw(self.line, ticket)
                self.line = key
                board.admit(key, ticket, now)  # no: it keeps (or takes) its place
                return Park(now + self.park_check_s, "pacer", key)
            if not self._pace_done:
                board.admit(key, ticket, now)  # peek said yes: spends the token
            if self.line is not None:
                board.withdraw(self.line, ticket)
                self.line = None
        self.why = "resume"
        self.attempts += 1
        self._pace_done = False
        return idx

    def resume_delay(self, failure: Failure) -> float:
        """The wait before a continuation of a cut response (`next_resume`): the retry
        delay, or the upstream's Retry-After.  The upstream's health learns of the cut
        from the attempt's end, as for any cut after commit (not twice)."""
        self.retries += 1
        ra = failure.retry_after_s if self.policy.honor_retry_after else None
        if ra is not None:
            return self.policy.clamp_retry_after(ra)
        return self.policy.base_delay(self.retries, self.rng)

    def _ticket(self, board: HealthBoard) -> int:
        if not self.ticket:
            self.ticket = board.new_ticket()
        return self.ticket

    def _admitted(
        self, board: HealthBoard, key: str, lim: Limiter, tokens: float, now: float
    ) -> None:
        """The limiter lets the attempt go: its cost is spent (it leaves any rate line)."""
        seq = lim.admit(self.ticket, self.sticky or f"#{self.ticket}", tokens, now)
        self._adm = (lim, seq, tokens)
        self._rate_since = None
        if self._came is None:
            self._came = now
        old = self._rate_line
        if old is not None:
            if old is not lim:
                old.withdraw(self.ticket)
                board.rates.changed(old.key)
            self._rate_line = None

    def _park_rate(
        self, board: HealthBoard, now: float, idx: int, lim: Limiter, tokens: float
    ) -> Park:
        """Wait in a limiter's line: the provider's budget for this key is spent."""
        ticket = self._ticket(board)
        key = self.keys[idx]
        if self.line is not None:  # not in a pacer's line meanwhile
            board.withdraw(self.line, ticket)
            self.line = None
        old = self._rate_line
        if old is not lim:
            if old is not None:
                old.withdraw(ticket)
            self._rate_line = lim
        if self._rate_since is None:
            self._rate_since = now
        if self._came is None:
            self._came = now
        # keeps (or takes) its place; one back from a block keeps its time in line, a
        # retry its turn's place
        lim.admit(
            ticket,
            self.sticky or f"#{ticket}",
            tokens,
            now,
            since=self._rate_since,
            place=self._came,
        )
        board.rates.changed(key)
        return Park(now + self.park_check_s, "ratelimit", key)

    def current_key(self) -> str | None:
        """The health key of the upstream the current attempt went to (None: none yet)."""
        if self.keys and self.current >= 0:
            return self.keys[self.current]
        return None

    @property
    def admitted(self) -> bool:
        """An attempt of this turn holds a limiter's admission."""
        return self._adm is not None

    def _finish(self, now: float, *, ok: bool, tokens_in: int | None = None) -> None:
        adm = self._adm
        if adm is None:
            return
        self._adm = None
        lim, seq, _ = adm
        lim.finish(seq, now, ok=ok, tokens_in=tokens_in, body_bytes=self.body_bytes)
        if self.board is not None:
            self.board.rates.changed(lim.key)

    def record_rate(self, headers: RateHeaders, now: float) -> None:
        """The current attempt's answer said this about the key's budgets."""
        adm = self._adm
        if adm is not None:
            first = not adm[0].seen
            adm[0].learn(adm[1], headers, now)
            if self.board is not None and (first or not headers.empty):
                self.board.rates.changed(adm[0].key)

    def settle(self, now: float, tokens_in: int | None) -> None:
        """The turn's last attempt ended well: its admission ends, its reported input
        tokens teach the limiter what a byte costs."""
        self._finish(now, ok=True, tokens_in=tokens_in)

    def _park(
        self, board: HealthBoard, now: float, in_line: int, at: int, soonest: float, why: str
    ) -> Park:
        """Wait in a line: a free upstream's pacer, else the one blocked the shortest."""
        if not self.ticket:
            self.ticket = board.new_ticket()
        idx = in_line if in_line >= 0 else at
        key = self.keys[idx]
        lim = self._rate_line
        if lim is not None and in_line < 0 and lim.key == key and lim.blocked_until >= soonest:
            # A block its rate line is held through too (a 429's Retry-After, a budget
            # the 429 reported short): the turn keeps its place there and waits the
            # block out.  In the pacer's line a block's end lets turns go on its ramp,
            # while turns that came meanwhile went straight to the budget (`shared`
            # through one relay served some agents' third turns before others' first).
            if self.line is not None:
                board.withdraw(self.line, self.ticket)
                self.line = None
            return Park(soonest, why, key)
        if lim is not None:  # no longer waits for a budget, but for the pacer or a block
            lim.withdraw(self.ticket)
            board.rates.changed(lim.key)
            self._rate_line = None
        if self.line is not None and self.line != key:
            board.withdraw(self.line, self.ticket)
        self.line = key
        if in_line >= 0:
            board.admit(key, self.ticket, now)  # no: it keeps (or takes) its place
            return Park(now + self.park_check_s, "pacer", key)
        board.wait_in_line(key, self.ticket)
        return Park(soonest, why, key)

    def close(self, now: float | None = None) -> None:
        """The turn is over: it leaves any line it waits in, and ends its admission (and
        a probe lease its attempt held with no verdict)."""
        board = self.board
        if self._probe is not None and board is not None:
            board.probe_abandoned(self._probe)
            self._probe = None
        if self.line is not None and board is not None:
            board.withdraw(self.line, self.ticket)
            self.line = None
        lim = self._rate_line
        if lim is not None and board is not None:
            lim.withdraw(self.ticket)
            board.rates.changed(lim.key)
            self._rate_line = None
        self._rate_since = None
        if self._adm is not None:  # not settled: it did not end well
            self._finish(now if now is not None else 0.0, ok=False)

    def record_answer(self, now: float) -> None:
        """The current upstream answered (headers of a final answer): it is known good,
        and its limiter's throttle learns the provider took the request."""
        self._probe = None  # a verdict: the board gives the lease back
        adm = self._adm
        if adm is not None:
            adm[0].accepted(adm[1], now)
        board = self.board
        if board is not None and self.keys and self.current >= 0:
            board.answered(self.keys[self.current], now)

    def _quota_only(self, board: HealthBoard, i: int, now: float) -> bool:
        """Kept out by a spent quota only (the route's own cool-off is that quota's)."""
        until = board.quota_until(self.keys[i], now)
        return until > 0.0 and self.cooloff_until.get(i, 0.0) <= until

    def _why_blocked(self, i: int, now: float) -> str:
        board = self.board
        if board is not None:
            rec = board.records.get(self.keys[i])
            if rec is not None and rec.state.value != "closed":
                return "breaker"
        return "cooloff"

    def record_failure(self, failure: Failure, now: float) -> float:
        """Note a failure of the current upstream; return the wait (s) before the next try."""
        self.retries += 1
        self.quota_wall = False
        self._probe = None  # a verdict: the board gives the lease back
        board = self.board
        key = self.keys[self.current] if board is not None and self.keys else None
        adm = self._adm
        limited = adm is not None and failure.status == 429 and not failure.quota
        if not limited:
            # Only a request the rate limit refused keeps its turn's place in the rate
            # line: a failing upstream's retries at the head of the line held the turns
            # that came since out for a whole outage (the simulator's 30 s outage: a
            # first attempt waited 35 s, against 8 s in turn with the others)
            self._came = None
        if adm is not None:
            lim, seq, tokens = adm
            if limited:
                # The provider's rate limit: the limiter blocks this key until it says
                # (Retry-After) or until a budget it reports short refills, and its
                # throttle lowers the rate it admits.  The retry is a retry: the
                # retry delay at least, and the pacer's go (below).
                ra = failure.retry_after_s if self.policy.honor_retry_after else None
                if ra is not None:
                    ra = self.policy.clamp_retry_after(ra)
                lim.limited(seq, ra, tokens, now)
            self._finish(now, ok=False)
        if failure.quota:  # looked at again within a minute (a paid bill)
            self.cooloff_until[self.current] = now + min(self.quota_cooloff_s, QUOTA_LOOK_AGAIN_S)
            if board is not None and key is not None:
                board.success(key, now)  # it answered; the cool-off keeps turns away
                board.cooloff(key, now, self.quota_cooloff_s, "quota")
            if not self._other_free(now):
                self.quota_wall = True  # never retry forever into a quota wall
            return 0.0
        ra = failure.retry_after_s if self.policy.honor_retry_after else None
        if ra is not None:
            ra = self.policy.clamp_retry_after(ra)
            self.cooloff_until[self.current] = now + ra
            if board is not None and key is not None and ra > 0:
                board.cooloff(key, now, ra, "retry_after")
        if board is not None and key is not None:
            if counts_against_upstream(failure):
                first_here = self.current not in self._counted
                self._counted.add(self.current)
                board.failure(key, now, failure.label, count=first_here)
            else:  # a 4xx (429, 408, ...) is an answer: the upstream is up (a probe passed)
                board.success(key, now)
                board.pace_failure(key, now)  # but not a success for its pacer
        other_free = self._other_free(now)
        if limited and other_free:
            return 0.0  # another upstream (another key's budget): at once
        if failure.cls.reroutes_at_once and other_free:
            return 0.0
        if limited:  # never sooner than the retry delay, whatever a header says
            delay = self.policy.base_delay(self.retries, self.rng)
            return max(delay, ra) if ra is not None else delay
        if ra is not None:
            if other_free:
                return self.policy.base_delay(self.retries, self.rng)
            # Every other upstream is cooling off too: wait for the soonest.
            soonest = min(self.cooloff_until.get(i, 0.0) for i in range(self.n_upstreams))
            return max(ra if self.n_upstreams == 1 else soonest - now, 0.0)
        return self.policy.base_delay(self.retries, self.rng)

    def _other_free(self, now: float) -> bool:
        return any(
            i != self.current and self._blocked(i, now) <= 0.0 for i in range(self.n_upstreams)
        )
