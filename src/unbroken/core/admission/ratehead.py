"""Providers' rate-limit headers, read and checked (sans-IO).

What each provider says about the budget left on a key, turned into one shape
(`RateHeaders`: a `Reading` of limit, remaining and reset for requests, tokens and
output tokens, and a ``Retry-After``):

* OpenAI: ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
  ``x-ratelimit-reset-requests`` (a Go duration: ``1s``, ``6m0s``, ``20ms``), the
  same for ``-tokens``;
* Anthropic: ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-
  {limit,remaining,reset}`` (the reset an RFC 3339 time); ``tokens`` is read when
  sent, else ``input-tokens``; ``output-tokens`` is its own reading;
* ``retry-after-ms`` and ``retry-after`` (seconds or an HTTP date), any provider.

Gemini's ``RetryInfo.retryDelay`` (``"30s"``) comes in a 429's JSON body, not in
headers: the Gemini protocol reads it (`core.wire.protocols.gemini.retry_delay`) and the
turn makes it the failure's ``Retry-After``, which the limiter is told like a header's.

Every value is checked.  A non-number, a negative or non-finite value, a limit of
zero or more than `MAX_LIMIT` is ignored; a remaining above its limit is clamped to
the limit; a reset or a retry delay longer than ``max_wait_s`` (a reset of years)
is clamped to it, so a garbage header never parks a turn for long.  Each problem is
named in `RateHeaders.problems` (``"header=value: why"``); the relay logs each
header's first problem once per upstream.

Header names are looked up in lower case (pass a case-insensitive mapping, or a
dict with lower-case keys).  Time is passed in (``now_wall``, for the dates).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

__all__ = [
    "MAX_LIMIT",
    "RateHeaders",
    "Reading",
    "parse_duration",
    "parse_rate_headers",
]

#: a limit above this (a billion requests or tokens a window) is garbage
MAX_LIMIT = 1_000_000_000.0

_DURATION = re.compile(r"(\d+(?:\.\d+)?|\.\d+)(ms|us|µs|ns|h|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(frozen=True, slots=True)
class Reading:
    """One budget as a provider reported it (None: not sent, or not valid)."""

    limit: float | None = None
    remaining: float | None = None
    #: seconds until the budget is full again (clamped to ``max_wait_s``)
    reset_s: float | None = None

    @property
    def empty(self) -> bool:
        return self.limit is None and self.remaining is None and self.reset_s is None


@dataclass(frozen=True, slots=True)
class RateHeaders:
    """What one answer said about the key's budgets."""

    requests: Reading | None = None
    tokens: Reading | None = None
    output: Reading | None = None
    retry_after_s: float | None = None
    problems: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return (
            self.requests is None
            and self.tokens is None
            and self.output is None
            and self.retry_after_s is None
        )


NO_HEADERS = RateHeaders()


def parse_duration(text: str) -> float | None:
    """Seconds in a Go-style duration (``1h2m3.5s``, ``20ms``) or a plain number."""
    s = text.strip()
    if not s:
        return None
    try:
        value = float(s)
    except ValueError:
        pass
    else:
        return value if math.isfinite(value) else None
    pos = 0
    total = 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            return None
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if pos != len(s) or pos == 0:
        return None
    return total


def _reset_seconds(text: str, now_wall: float) -> float | None:
    """A reset: a duration, a number of seconds, or a date (RFC 3339 or HTTP)."""
    d = parse_duration(text)
    if d is not None:
        return d
    s = text.strip()
    try:
        when = datetime.fromisoformat(s.replace("Z", "+00:00").replace("z", "+00:00"))
        if when.tzinfo is None:
            return None
        return when.timestamp() - now_wall
    except ValueError:
        pass
    try:
        return parsedate_to_datetime(s).timestamp() - now_wall
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class _Checker:
    __slots__ = ("max_wait_s", "now_wall", "problems")

    def __init__(self, now_wall: float, max_wait_s: float) -> None:
        self.now_wall = now_wall
        self.max_wait_s = max_wait_s
        self.problems: list[str] = []

    def bad(self, name: str, raw: str, why: str) -> None:
        self.problems.append(f"{name}={raw[:40]!r}: {why}")

    def number(self, headers: Mapping[str, str], name: str) -> float | None:
        raw = headers.get(name)
        if raw is None:
            return None
        try:
            value = float(raw.strip())
        except ValueError:
            self.bad(name, raw, "not a number, ignored")
            return None
        if not math.isfinite(value) or value < 0:
            self.bad(name, raw, "negative or not finite, ignored")
            return None
        return value

    def seconds(self, name: str, raw: str | None, value: float | None) -> float | None:
        if raw is None:
            return None
        if value is None or not math.isfinite(value):
            self.bad(name, raw, "not a duration or a date, ignored")
            return None
        if value < 0:
            if value > -5.0:  # a date a moment in the past (clock skew): now
                return 0.0
            self.bad(name, raw, "in the past, ignored")
            return None
        if value > self.max_wait_s:
            self.bad(name, raw, f"longer than {self.max_wait_s:g}s, clamped")
            return self.max_wait_s
        return value

    def reading(
        self, headers: Mapping[str, str], limit: str, remaining: str, reset: str
    ) -> Reading | None:
        lim = self.number(headers, limit)
        if lim is not None and (lim < 1 or lim > MAX_LIMIT):
            self.bad(limit, headers[limit], "out of range, ignored")
            lim = None
        rem = self.number(headers, remaining)
        if rem is not None and rem > MAX_LIMIT:
            self.bad(remaining, headers[remaining], "out of range, ignored")
            rem = None
        if rem is not None and lim is not None and rem > lim:
            self.bad(remaining, headers[remaining], "above its limit, clamped")
            rem = lim
        raw = headers.get(reset)
        rs = self.seconds(reset, raw, None if raw is None else _reset_seconds(raw, self.now_wall))
        out = Reading(lim, rem, rs)
        return None if out.empty else out


def _family(prefix: str, a: str, b: str, c: str) -> tuple[str, str, str]:
    return f"{prefix}{a}", f"{prefix}{b}", f"{prefix}{c}"


# Each family's (limit, remaining, reset) header names, built once (not per answer).
_OPENAI_REQUESTS = _family("x-ratelimit-", "limit-requests", "remaining-requests", "reset-requests")
_OPENAI_TOKENS = _family("x-ratelimit-", "limit-tokens", "remaining-tokens", "reset-tokens")
_A = "anthropic-ratelimit-"
_ANTHROPIC_REQUESTS = _family(_A, "requests-limit", "requests-remaining", "requests-reset")
_ANTHROPIC_TOKENS = tuple(
    _family(_A, f"{f}-limit", f"{f}-remaining", f"{f}-reset") for f in ("tokens", "input-tokens")
)
_ANTHROPIC_OUTPUT = _family(
    _A, "output-tokens-limit", "output-tokens-remaining", "output-tokens-reset"
)


#: the first letters, either case, of every header name `parse_rate_headers` reads
_FIRST = frozenset("xXaArR")
_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-", "retry-after")


def _may_report(headers: Mapping[str, str]) -> bool:
    """Some header name is one `parse_rate_headers` reads (all begin with one of
    `_PREFIXES`); when none is, it reads nothing and reports nothing."""
    for name in headers:
        if name[:1] in _FIRST and name.lower().startswith(_PREFIXES):
            return True
    return False


def parse_rate_headers(
    headers: Mapping[str, str], *, now_wall: float, max_wait_s: float = 60.0
) -> RateHeaders:
    """The budgets an answer's headers report (see the module docstring)."""
    if not _may_report(headers):
        return NO_HEADERS  # (most answers: one look at each name, not 14 lookups)
    c = _Checker(now_wall, max_wait_s)
    requests = tokens = output = None
    names = _OPENAI_REQUESTS
    if names[0] in headers or names[1] in headers:
        requests = c.reading(headers, *names)
    names = _OPENAI_TOKENS
    if names[0] in headers or names[1] in headers:
        tokens = c.reading(headers, *names)
    names = _ANTHROPIC_REQUESTS
    if requests is None and (names[0] in headers or names[1] in headers):
        requests = c.reading(headers, *names)
    if tokens is None:
        for names in _ANTHROPIC_TOKENS:
            if names[0] in headers or names[1] in headers:
                tokens = c.reading(headers, *names)
                if tokens is not None:
                    break
    names = _ANTHROPIC_OUTPUT
    if names[0] in headers or names[1] in headers:
        output = c.reading(headers, *names)
    retry_after: float | None = None
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        ms = parse_duration(raw_ms)
        retry_after = c.seconds("retry-after-ms", raw_ms, None if ms is None else ms / 1000.0)
    raw = headers.get("retry-after")
    if retry_after is None and raw is not None:
        retry_after = c.seconds("retry-after", raw, _reset_seconds(raw, now_wall))
    if requests is None and tokens is None and output is None and retry_after is None:
        return RateHeaders(problems=tuple(c.problems)) if c.problems else NO_HEADERS
    return RateHeaders(requests, tokens, output, retry_after, tuple(c.problems))
