"""The mock's rate limits: RPM and TPM enforced per key, reported in the providers' headers.

A provider refills its budgets continuously (a token bucket each, full after a
minute); a request costs one request and its prompt tokens (the mock's own count:
a quarter of the canonical request JSON's length, as its ``usage`` reports) plus any
``max_tokens`` it asks for.  A request the budget cannot cover gets ``429`` with
``retry-after`` (whole seconds, rounded up, as OpenAI and Anthropic send it) and
the protocol's rate-limit error; every answer carries the budgets left, in OpenAI's
headers (``x-ratelimit-*``, Go durations) or Anthropic's (``anthropic-ratelimit-*``,
RFC 3339 times).  Keys are told apart by their credential header.

That is the ``textbook`` provider.  Real ones differ, and `BEHAVIOURS` names the
zoo of ways they do (docs/mock.md, "Rate-limit zoo"): limits enforced per second
while reported per minute (``quantized``), a reset that means "until the next
request" (``reset-next``), 429s without ``retry-after`` (``no-retry-after``) or
without any header (``bare``), Anthropic's four header families (``anthropic``), a
token limit that binds (``tpm``), a remaining that overstates the bucket
(``overstated``), and a key shared with traffic the client does not see (``shared``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = ["BEHAVIOURS", "KeyBudget", "MockLimits"]

#: the credential headers that tell keys apart (the first one sent)
KEY_HEADERS = ("authorization", "x-api-key", "api-key", "x-goog-api-key")

#: the rate-limit zoo: how a provider enforces and reports its budgets
BEHAVIOURS = (
    "textbook",
    "quantized",
    "reset-next",
    "no-retry-after",
    "bare",
    "anthropic",
    "tpm",
    "overstated",
    "shared",
)
_FIELDS = ("rpm", "tpm", "style", "start", "behaviour", "shared", "overstate")


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
    #: seconds an empty bucket takes to fill (60 unless quantized)
    period: float = 60.0
    #: the share of the refill that traffic the client does not see takes (``shared``)
    drain: float = 0.0

    def refill(self, now: float) -> None:
        if now > self.t:
            gain = (now - self.t) * self.limit * (1.0 - self.drain) / self.period
            self.level = min(self.limit, self.level + gain)
            self.t = now

    def until(self, level: float) -> float:
        """Seconds until the bucket holds ``level`` at its (the provider's) refill rate."""
        return max(0.0, (min(level, self.limit) - self.level) * self.period / self.limit)

    def reset_s(self) -> float:
        return self.until(self.limit)


@dataclass(slots=True)
class KeyBudget:
    """One key's budgets and what it was answered."""

    requests: _Bucket
    tokens: _Bucket | None
    ok: int = 0
    limited: int = 0
    tokens_spent: float = 0.0
    #: ``quantized``: the per-second bucket that is really enforced
    second: _Bucket | None = None
    #: Anthropic: output tokens, their own budget (``tokens`` is then input tokens)
    output: _Bucket | None = None
    #: each bucket's cost for the last request (``reset-next``: when one more fits)
    last: list[tuple[_Bucket, float]] = field(default_factory=list)

    def cost(self, bucket: _Bucket) -> float:
        return max(1.0, next((c for bk, c in self.last if bk is bucket), 1.0))


def _share(data: dict[str, Any], name: str, default: float, *, top: float) -> float:
    v = data.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= top:
        bound = "[0, 1]" if top == 1 else "[0, 1)"
        raise ValueError(f"limits.{name}: expected a share in {bound}")
    return float(v)


@dataclass(slots=True)
class MockLimits:
    """``rpm`` requests and ``tpm`` tokens a minute per key (0: no such limit).

    ``behaviour`` picks the provider from the zoo (`BEHAVIOURS`); ``clock`` (monotonic
    seconds; None: the event loop's) and ``wall`` (epoch seconds, for RFC 3339 resets)
    let tests move time without sleeping.
    """

    rpm: float = 60.0
    tpm: float = 0.0
    #: "openai" (x-ratelimit-*) or "anthropic" (anthropic-ratelimit-*)
    style: str = "openai"
    #: the share of each budget a key has left when first seen (1: full)
    start: float = 1.0
    #: one of `BEHAVIOURS` ("anthropic" implies style "anthropic")
    behaviour: str = "textbook"
    #: ``shared``: the share of each budget's refill that unseen traffic takes
    shared: float = 0.5
    #: ``overstated``: the share of the limit added to the remaining reported
    overstate: float = 0.5
    clock: Callable[[], float] | None = None
    wall: Callable[[], float] = time.time
    keys: dict[str, KeyBudget] = field(default_factory=dict)
    #: (monotonic time, key, status) of every request, for the benchmark
    log: list[tuple[float, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.behaviour not in BEHAVIOURS:
            raise ValueError(f"limits.behaviour: expected one of {', '.join(BEHAVIOURS)}")
        if self.style not in ("openai", "anthropic"):
            raise ValueError("limits.style: expected 'openai' or 'anthropic'")
        if self.behaviour == "anthropic":
            self.style = "anthropic"
        if self.behaviour == "tpm" and self.tpm <= 0:
            raise ValueError("limits.tpm: behaviour 'tpm' needs a token limit > 0")
        if not 0 <= self.shared < 1:
            raise ValueError("limits.shared: expected a share in [0, 1)")
        if not 0 <= self.overstate <= 1:
            raise ValueError("limits.overstate: expected a share in [0, 1]")

    @classmethod
    def from_dict(cls, data: Any) -> MockLimits:
        if not isinstance(data, dict):
            raise ValueError("limits: expected a table")
        unknown = set(data) - set(_FIELDS)
        if unknown:
            raise ValueError(f"limits.{sorted(unknown)[0]}: unknown key ({', '.join(_FIELDS)})")
        start = _share(data, "start", 1.0, top=1)
        rpm, tpm = data.get("rpm", 60), data.get("tpm", 0)
        for name, v in (("rpm", rpm), ("tpm", tpm)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"limits.{name}: expected a number >= 0")
        style = data.get("style", "openai")
        if style not in ("openai", "anthropic"):
            raise ValueError("limits.style: expected 'openai' or 'anthropic'")
        behaviour = data.get("behaviour", "textbook")
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"limits.behaviour: expected one of {', '.join(BEHAVIOURS)}")
        return cls(
            float(rpm),
            float(tpm),
            style,
            start,
            behaviour,
            _share(data, "shared", 0.5, top=0.999999),
            _share(data, "overstate", 0.5, top=1),
        )

    def _budget(self, key: str, now: float) -> KeyBudget:
        b = self.keys.get(key)
        if b is None:
            f = self.start
            drain = self.shared if self.behaviour == "shared" else 0.0
            if self.rpm > 0:
                requests = _Bucket(self.rpm, self.rpm * f, now, drain=drain)
            else:
                requests = _Bucket(math.inf, math.inf, now)
            tokens = output = second = None
            if self.tpm > 0:
                tokens = _Bucket(self.tpm, self.tpm * f, now, drain=drain)
                if self.style == "anthropic":  # output tokens: a fifth, as Anthropic's tiers
                    out = self.tpm / 5.0
                    output = _Bucket(out, out * f, now, drain=drain)
            if self.behaviour == "quantized" and self.rpm > 0:
                per_s = self.rpm / 60.0  # 300 a minute enforced as 5 a second
                cap = max(1.0, per_s)
                second = _Bucket(cap, cap * f, now, period=cap / per_s)
            b = self.keys[key] = KeyBudget(requests, tokens, second=second, output=output)
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
        split = b.output is not None  # input and output tokens counted apart
        costs: list[tuple[_Bucket, float]] = [(b.requests, 1.0)]
        if b.second is not None:
            costs.append((b.second, 1.0))
        if b.tokens is not None:
            costs.append((b.tokens, float(prompt_tokens if split else prompt_tokens + max_tokens)))
        if b.output is not None:
            costs.append((b.output, float(max_tokens)))
        wait = 0.0
        for i, (bucket, cost) in enumerate(costs):
            bucket.refill(now)
            cost = min(cost, bucket.limit)
            costs[i] = (bucket, cost)
            if bucket.level < cost:
                wait = max(wait, bucket.until(cost))
        status = 429 if wait > 0 else 200
        spent = sum(c for bucket, c in costs if bucket is b.tokens or bucket is b.output)
        b.last = costs
        if status == 200:
            for bucket, cost in costs:
                bucket.level -= cost
            b.ok += 1
            b.tokens_spent += spent
        else:
            b.limited += 1
        self.log.append((now, key, status))
        if self.behaviour == "bare":
            return status, []
        out = self._headers(b)
        if status == 429 and self.behaviour != "no-retry-after":
            out.append(("retry-after", str(max(1, math.ceil(wait)))))
        return status, out

    def _reading(self, b: KeyBudget, bucket: _Bucket) -> tuple[str, str, float]:
        """(limit, remaining, reset seconds) as this behaviour reports ``bucket``."""
        left = max(0.0, math.floor(bucket.level))
        reset = bucket.reset_s()
        if self.behaviour == "overstated":
            left = min(bucket.limit, math.floor(bucket.level + self.overstate * bucket.limit))
            reset = max(0.0, (bucket.limit - left) * bucket.period / bucket.limit)
        elif self.behaviour == "reset-next":
            reset = bucket.until(b.cost(bucket))
        elif self.behaviour == "quantized" and bucket is b.requests and b.second is not None:
            reset = max(bucket.until(1.0), b.second.until(1.0))
        return str(round(bucket.limit)), str(round(left)), reset

    def _headers(self, b: KeyBudget) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.style == "openai":
            for name, bucket in (("requests", b.requests), ("tokens", b.tokens)):
                if bucket is None or not math.isfinite(bucket.limit):
                    continue
                limit, left, reset = self._reading(b, bucket)
                out += [
                    (f"x-ratelimit-limit-{name}", limit),
                    (f"x-ratelimit-remaining-{name}", left),
                    (f"x-ratelimit-reset-{name}", _go_duration(reset)),
                ]
            return out
        fams: list[tuple[str, _Bucket]] = []
        if math.isfinite(b.requests.limit):
            fams.append(("requests", b.requests))
        if b.tokens is not None:
            fams.append(("input-tokens", b.tokens))
            if b.output is not None:
                fams.append(("output-tokens", b.output))
            # "tokens": the most restrictive token limit in effect (the smaller share left)
            tight = min((bk for n, bk in fams if n != "requests"), key=lambda x: x.level / x.limit)
            fams.append(("tokens", tight))
        wall = self.wall()
        for fam, bucket in fams:
            limit, left, reset = self._reading(b, bucket)
            a = f"anthropic-ratelimit-{fam}"
            out += [
                (f"{a}-limit", limit),
                (f"{a}-remaining", left),
                (f"{a}-reset", _rfc3339(wall + reset)),
            ]
        return out

    def view(self) -> dict[str, Any]:
        return {
            "rpm": self.rpm,
            "tpm": self.tpm,
            "style": self.style,
            "behaviour": self.behaviour,
            "ok": sum(b.ok for b in self.keys.values()),
            "limited": sum(b.limited for b in self.keys.values()),
            "tokens": round(sum(b.tokens_spent for b in self.keys.values())),
        }
