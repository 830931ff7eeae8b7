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
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime

__all__ = [
    "RETRY_STATUSES",
    "Failure",
    "FailureClass",
    "RetryPolicy",
    "RetryState",
    "is_retryable_status",
    "parse_retry_after",
]

#: HTTP statuses that are retried (the opencode-retry-forever defaults).
RETRY_STATUSES: frozenset[int] = frozenset(
    {408, 409, 425, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524, 525, 527, 529, 530}
)


def is_retryable_status(status: int) -> bool:
    return status in RETRY_STATUSES


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
    """The ``[retry]`` settings that shape waiting (see README, Configuration)."""

    delay_ms: int = 250
    backoff: str = "fixed"  # or "exponential"
    max_delay_ms: int = 30_000
    max_attempts: int = 0  # total attempts including the first; 0 = unlimited
    honor_retry_after: bool = True
    max_retry_after_ms: int = 60_000

    def base_delay(self, retry_number: int, rng: random.Random) -> float:
        """Seconds before retry number ``retry_number`` (1 = the first retry)."""
        if self.backoff == "exponential":
            cap = min(self.max_delay_ms, self.delay_ms * (2 ** min(retry_number - 1, 40)))
            return rng.uniform(0, cap) / 1000.0  # full jitter
        return min(self.delay_ms, self.max_delay_ms) / 1000.0

    def clamp_retry_after(self, seconds: float) -> float:
        return min(seconds, self.max_retry_after_ms / 1000.0)


@dataclass(slots=True)
class RetryState:
    """Attempt bookkeeping for one turn over a route's upstreams (sans-IO).

    ``next_upstream`` rotates through the upstreams, skipping one that asked
    us (by Retry-After) to stay away while another is available.  ``delay``
    says how long to wait before the next attempt.
    """

    policy: RetryPolicy
    n_upstreams: int
    rng: random.Random = field(default_factory=random.Random)
    cooloff_until: dict[int, float] = field(default_factory=dict)
    attempts: int = 0
    retries: int = 0
    current: int = -1

    def exhausted(self) -> bool:
        return self.policy.max_attempts > 0 and self.attempts >= self.policy.max_attempts

    def next_upstream(self, now: float) -> int:
        """Choose the upstream for the next attempt and count the attempt."""
        n = self.n_upstreams
        start = (self.current + 1) % n
        choice = start
        for k in range(n):
            idx = (start + k) % n
            if self.cooloff_until.get(idx, 0.0) <= now:
                choice = idx
                break
        else:
            # everyone is cooling off: take the one free soonest
            choice = min(range(n), key=lambda i: self.cooloff_until.get(i, 0.0))
        self.current = choice
        self.attempts += 1
        return choice

    def record_failure(self, failure: Failure, now: float) -> float:
        """Note a failure of the current upstream; return the wait (s) before the next try."""
        self.retries += 1
        ra = failure.retry_after_s if self.policy.honor_retry_after else None
        if ra is not None:
            ra = self.policy.clamp_retry_after(ra)
            self.cooloff_until[self.current] = now + ra
        other_free = self._other_free(now)
        if failure.cls.reroutes_at_once and other_free:
            return 0.0
        if ra is not None:
            if other_free:
                return self.policy.base_delay(self.retries, self.rng)
            # Every other upstream is cooling off too: wait for the soonest.
            soonest = min(self.cooloff_until.get(i, 0.0) for i in range(self.n_upstreams))
            return max(ra if self.n_upstreams == 1 else soonest - now, 0.0)
        return self.policy.base_delay(self.retries, self.rng)

    def _other_free(self, now: float) -> bool:
        return any(
            i != self.current and self.cooloff_until.get(i, 0.0) <= now
            for i in range(self.n_upstreams)
        )
