"""The mock's rate limits: RPM and TPM enforced per key, reported in the providers' headers.

A provider refills its budgets continuously (a token bucket each, full after a
minute); a request costs one request and its prompt tokens (the mock's own count:
a quarter of the canonical request JSON's length, as its ``usage`` reports) plus any
``max_tokens`` it asks for.  A request the budget cannot cover gets ``429`` with
``retry-after`` (whole seconds, rounded up, as OpenAI and Anthropic send it) and
the protocol's rate-limit error; every answer carries the budgets left, in OpenAI's
headers (``x-ratelimit-*``, Go durations) or Anthropic's (``anthropic-ratelimit-*``,
RFC 3339 times).  Keys are told apart by their credential header.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = ["KeyBudget", "MockLimits"]

#: the credential headers that tell keys apart (the first one sent)
KEY_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")


def _go_duration(seconds: float) -> str:
    if seconds < 1.0:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60.0)
    return f"{int(minutes)}m{rest:.3f}s" if minutes else f"{rest:.3f}s"


def _rfc3339(wall: float) -> str:
    return (
        datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


@dataclass(slots=True)
class _Bucket:
    limit: float
    level: float
    t: float

    def refill(self, now: float) -> None:
        if now > self.t:
            self.level = min(self.limit, self.level + (now - self.t) * self.limit / 60.0)
            self.t = now

    def reset_s(self) -> float:
        return (self.limit - self.level) * 60.0 / self.limit


@dataclass(slots=True)
class KeyBudget:
    """One key's budgets and what it was answered."""

    requests: _Bucket
    tokens: _Bucket | None
    ok: int = 0
    limited: int = 0
    tokens_spent: float = 0.0


@dataclass(slots=True)
class MockLimits:
    """``rpm`` requests and ``tpm`` tokens a minute per key (0: no such limit)."""

    rpm: float = 60.0
    tpm: float = 0.0
    #: "openai" (x-ratelimit-*) or "anthropic" (anthropic-ratelimit-*)
    style: str = "openai"
    #: the share of each budget a key has left when first seen (1: full)
    start: float = 1.0
    keys: dict[str, KeyBudget] = field(default_factory=dict)
    #: (monotonic time, key, status) of every request, for the benchmark
    log: list[tuple[float, str, int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> MockLimits:
        if not isinstance(data, dict):
            raise ValueError("limits: expected a table")
        unknown = set(data) - {"rpm", "tpm", "style", "start"}
        if unknown:
            raise ValueError(f"limits.{sorted(unknown)[0]}: unknown key (rpm, tpm, style, start)")
        start = data.get("start", 1.0)
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0 <= start <= 1:
            raise ValueError("limits.start: expected a share in [0, 1]")
        rpm, tpm = data.get("rpm", 60), data.get("tpm", 0)
        for name, v in (("rpm", rpm), ("tpm", tpm)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"limits.{name}: expected a number >= 0")
        style = data.get("style", "openai")
        if style not in ("openai", "anthropic"):
            raise ValueError("limits.style: expected 'openai' or 'anthropic'")
        return cls(float(rpm), float(tpm), style, float(start))

    def _budget(self, key: str, now: float) -> KeyBudget:
        b = self.keys.get(key)
        if b is None:
            rpm = self.rpm if self.rpm > 0 else math.inf
            f = self.start
            tokens = _Bucket(self.tpm, self.tpm * f, now) if self.tpm > 0 else None
            level = rpm * f if math.isfinite(rpm) else rpm
            b = self.keys[key] = KeyBudget(_Bucket(rpm, level, now), tokens)
        return b

    def charge(
        self, headers: Any, prompt_tokens: int, max_tokens: int, now: float
    ) -> tuple[int, list[tuple[str, str]]]:
        """(200 or 429, the headers to send) for one request at monotonic ``now``."""
        key = ""
        for name in KEY_HEADERS:
            value = headers.get(name)
            if value:
                key = value
                break
        b = self._budget(key, now)
        cost = float(prompt_tokens + max_tokens)
        req, tok = b.requests, b.tokens
        req.refill(now)
        if tok is not None:
            tok.refill(now)
            cost = min(cost, tok.limit)
        wait = 0.0
        if req.level < 1.0:
            wait = (1.0 - req.level) * 60.0 / req.limit
        if tok is not None and tok.level < cost:
            wait = max(wait, (cost - tok.level) * 60.0 / tok.limit)
        status = 429 if wait > 0 else 200
        if status == 200:
            req.level -= 1.0
            if tok is not None:
                tok.level -= cost
            b.ok += 1
            b.tokens_spent += cost
        else:
            b.limited += 1
        self.log.append((now, key, status))
        out = self._headers(b)
        if status == 429:
            out.append(("retry-after", str(max(1, math.ceil(wait)))))
        return status, out

    def _headers(self, b: KeyBudget) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        wall = time.time()
        for name, bucket in (("requests", b.requests), ("tokens", b.tokens)):
            if bucket is None or not math.isfinite(bucket.limit):
                continue
            left = str(max(0, math.floor(bucket.level)))
            if self.style == "openai":
                out += [
                    (f"x-ratelimit-limit-{name}", str(round(bucket.limit))),
                    (f"x-ratelimit-remaining-{name}", left),
                    (f"x-ratelimit-reset-{name}", _go_duration(bucket.reset_s())),
                ]
            else:
                fam = "requests" if name == "requests" else "input-tokens"
                a = f"anthropic-ratelimit-{fam}"
                out += [
                    (f"{a}-limit", str(round(bucket.limit))),
                    (f"{a}-remaining", left),
                    (f"{a}-reset", _rfc3339(wall + bucket.reset_s())),
                ]
        return out

    def view(self) -> dict[str, Any]:
        return {
            "rpm": self.rpm,
            "tpm": self.tpm,
            "style": self.style,
            "ok": sum(b.ok for b in self.keys.values()),
            "limited": sum(b.limited for b in self.keys.values()),
            "tokens": round(sum(b.tokens_spent for b in self.keys.values())),
        }
