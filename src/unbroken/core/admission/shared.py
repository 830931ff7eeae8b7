"""What a relay takes from shared state, validated and clamped (sans-IO).

Health is shared through Redis (`unbroken.relay.store.RedisStore`) or, between the
workers of one ``unbroken serve --workers N``, through Unix datagrams
(`unbroken.relay.channel_store.ChannelStore`).  Anyone who can write to that Redis, or send a
datagram as the relay's user, can put anything there; this module decides what a
relay believes of it.  The rules:

* **Bounded by the local config.**  An open breaker lasts at most ``max_open_s``; a
  cool-off at most ``max_retry_after_ms`` (``quota_cooloff_s`` for a spent quota, at
  most `unbroken.core.admission.health.QUOTA_LOOK_AGAIN_S`), whatever a key's TTL or a message's
  ``ttl`` says (`SharedBounds`).  A cool-off's reason is one a relay writes
  (`COOLOFF_REASONS`); any other value is garbage, and no cool-off.  A Redis key
  that outlives the bound is clamped here and shortened in Redis by the store
  (`KeyReading.shorten_ms`), so it dies with the breaker it opened.
* **Validated.**  TTLs are finite, non-negative numbers (JSON's ``NaN`` and
  ``Infinity`` are not numbers); counts are integers in ``[0, MAX_COUNT]``; a
  breaker's re-open count is clamped to ``[0, MAX_REOPENS]``; a message names an
  upstream this relay has configured (others are ignored: no state for strangers),
  a known kind, a worker number in range; a datagram is at most ``MAX_DATAGRAM``
  bytes.  Text (a change's reason) is escaped (no control character, so no forged
  log line) and cut to ``MAX_SHARED_TEXT`` characters.
* **Garbage is ignored, never fatal.**  A value that fails a rule is dropped (or
  the key counts as nobody's, or as no count), classified by `Garbage`, and the
  store logs it at most once a minute per kind (`Throttle`; a message about an
  upstream this relay does not have is normal in a mixed fleet: counted only).  It never raises, and
  never marks the store degraded: only an unreachable Redis does that.
* **The store's link** (`Link`): up or degraded, and each transition is reported
  once (the store logs it once), whatever number of errors or answers follow.

Nothing here does I/O or reads a clock: ``now`` is passed in.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any

from unbroken.core.admission.health import QUOTA_LOOK_AGAIN_S, Change, HealthSettings

__all__ = [
    "CHANGE_KINDS",
    "COOLOFF_REASONS",
    "LOG_EVERY_S",
    "MAX_COUNT",
    "MAX_CRED",
    "MAX_DATAGRAM",
    "MAX_REOPENS",
    "MAX_SHARED_TEXT",
    "Garbage",
    "KeyReading",
    "Link",
    "Message",
    "Rejected",
    "SharedBounds",
    "Throttle",
    "clamp_ttl",
    "escape",
    "fleet_share",
    "lease_grant",
    "parse_message",
    "read_breaker",
    "read_cooloff",
    "read_count",
]

#: a datagram (or a channel message) larger than this is dropped unread
MAX_DATAGRAM = 4096
#: a reason (or any text) from shared state is cut to this many characters
MAX_SHARED_TEXT = 160
#: a breaker's re-open count from shared state is clamped to this (open_s doubles
#: per re-open up to max_open_s, so more means nothing)
MAX_REOPENS = 30
#: attempts one window bucket may count (a bound on a garbage count)
MAX_COUNT = 1_000_000
#: worker numbers a ``hello`` may name
MAX_WORKER = 1024
#: an origin (a relay's random id) is at most this long
MAX_ORIGIN = 64
#: a ``throttle`` message's credential hash: at most this many letters and digits (or
#: ``-``, no credential: `unbroken.core.admission.ratelimit.credential_hash`)
MAX_CRED = 64
CHANGE_KINDS = frozenset({"open", "close", "cooloff"})
#: the reasons a cool-off can have (`HealthBoard.cooloff`); any other is garbage
COOLOFF_REASONS = frozenset({"retry_after", "quota"})
#: a repeated log line at most this often: garbage of one kind here (`Throttle`), and
#: the relay's other warnings that could repeat (a failing observer, a full connection
#: table, an unwritable journal, Redis garbage)
LOG_EVERY_S = 60.0


class Garbage(enum.StrEnum):
    """What was wrong with a value from shared state (one log line a minute each)."""

    MESSAGE = "malformed message"
    OVERSIZE = "oversized message"
    #: normal in a fleet whose relays have different routes: counted, never logged
    UNKNOWN_KEY = "message for an upstream not configured here"
    TTL = "ttl beyond this relay's bounds (clamped)"
    VALUE = "malformed value"
    WRONG_TYPE = "key of the wrong type"
    #: the workers' rate-limit file is not a database of ours (replaced)
    FILE = "unreadable file (replaced)"


@dataclass(frozen=True, slots=True)
class SharedBounds:
    """The local config's bounds on what shared state may impose."""

    max_open_s: float = 0.5
    max_retry_after_s: float = 60.0
    quota_cooloff_s: float = 30.0
    #: a sibling's ``waiting`` mark (it has turns in an upstream's line) lasts at most
    #: this long unless renewed (the workers' channel; Redis: ``WAITERS_TTL_MS``)
    waiting_s: float = 3.0

    @classmethod
    def of(cls, health: HealthSettings, max_retry_after_ms: int) -> SharedBounds:
        return cls(
            max_open_s=health.max_open_s,
            max_retry_after_s=max_retry_after_ms / 1000.0,
            quota_cooloff_s=min(health.quota_cooloff_s, QUOTA_LOOK_AGAIN_S),
        )

    def bound(self, kind: str, reason: str = "") -> float:
        """The longest an ``open`` or a ``cooloff`` (by its reason) may last here."""
        if kind == "open":
            return self.max_open_s
        if kind == "waiting":
            return self.waiting_s
        if reason == "quota":
            return self.quota_cooloff_s
        return self.max_retry_after_s


def clamp_ttl(ttl_s: object, bound: float) -> tuple[float, bool] | None:
    """``(ttl, clamped)`` within ``[0, bound]``; None when it is not a number (NaN,
    a string, a bool, negative)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        return None
    ttl = float(ttl_s)
    if math.isnan(ttl) or ttl < 0:
        return None
    if ttl > bound:
        return bound, True
    return ttl, False


def escape(text: str, limit: int = MAX_SHARED_TEXT) -> str:
    """``text`` with every non-printable character escaped (``\\n`` -> ``\\\\n``), cut to
    ``limit`` characters: safe in one log line."""
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


# -- messages: the workers' datagrams and the Redis channel --------------------------------
@dataclass(frozen=True, slots=True)
class Message:
    """A valid message: a change to apply (``open``, ``close``, ``cooloff``), a
    worker's ``hello`` (it asks for the others' state), a worker's ``waiting`` mark
    (it has turns in ``key``'s line for ``ttl_s`` more seconds; 0: no longer; at most
    `SharedBounds.waiting_s`), or a sibling's ``throttle`` measure for ``key`` and
    credential hash ``cred`` (after a decrease, or answering one): it had been seen to
    accept ``anchor`` a second with ``demand`` requests in flight or waiting
    (`unbroken.core.admission.throttle.AdmissionThrottle.sibling_news`)."""

    origin: str
    kind: str
    change: Change | None = None
    worker: int | None = None
    key: str | None = None
    ttl_s: float = 0.0
    cred: str | None = None
    anchor: float = 0.0
    demand: float = 0.0
    #: a ``throttle`` measure told after its sender's decrease: a question (answered);
    #: a sender that does not say (``q`` missing) asks
    asks: bool = True
    #: a TTL was beyond this relay's bounds and was clamped
    clamped: bool = False


@dataclass(frozen=True, slots=True)
class Rejected:
    why: Garbage


def _reject_constant(name: str) -> float:
    raise ValueError(f"not a number: {name}")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rate(value: object) -> float | None:
    """A finite number in ``[0, MAX_COUNT]`` (a rate a second, a count), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) and 0.0 <= v <= MAX_COUNT else None


def parse_message(
    data: bytes | str, bounds: SharedBounds, known: Container[str]
) -> Message | Rejected:
    """Validate one message (see the module docstring); never raises."""
    if len(data) > MAX_DATAGRAM:
        return Rejected(Garbage.OVERSIZE)
    try:
        msg = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return Rejected(Garbage.MESSAGE)
    if not isinstance(msg, dict):
        return Rejected(Garbage.MESSAGE)
    origin, kind = msg.get("o"), msg.get("kind")
    if not isinstance(origin, str) or len(origin) > MAX_ORIGIN or not isinstance(kind, str):
        return Rejected(Garbage.MESSAGE)
    if kind == "hello":
        w = _int(msg.get("w"))
        if w is None or not 0 <= w < MAX_WORKER:
            return Rejected(Garbage.MESSAGE)
        return Message(origin, kind, worker=w)
    if kind == "waiting":
        key, w = msg.get("k"), _int(msg.get("w"))
        if not isinstance(key, str) or w is None or not 0 <= w < MAX_WORKER:
            return Rejected(Garbage.MESSAGE)
        if key not in known:
            return Rejected(Garbage.UNKNOWN_KEY)
        got = clamp_ttl(msg.get("ttl"), bounds.bound(kind))
        if got is None:
            return Rejected(Garbage.MESSAGE)
        return Message(origin, kind, worker=w, key=key, ttl_s=got[0], clamped=got[1])
    if kind == "throttle":
        key, cred = msg.get("k"), msg.get("c")
        if not isinstance(key, str) or not isinstance(cred, str):
            return Rejected(Garbage.MESSAGE)
        if cred != "-" and not (0 < len(cred) <= MAX_CRED and cred.isascii() and cred.isalnum()):
            return Rejected(Garbage.MESSAGE)
        anchor, demand = _rate(msg.get("a")), _rate(msg.get("d"))
        asks = _int(msg.get("q", 1))
        if anchor is None or demand is None or asks not in (0, 1):
            return Rejected(Garbage.MESSAGE)
        if key not in known:
            return Rejected(Garbage.UNKNOWN_KEY)
        return Message(
            origin, kind, key=key, cred=cred, anchor=anchor, demand=demand, asks=asks == 1
        )
    if kind not in CHANGE_KINDS:
        return Rejected(Garbage.MESSAGE)
    key, reason, reopens = msg.get("k"), msg.get("r", ""), msg.get("n", 0)
    n = _int(reopens)
    if not isinstance(key, str) or not isinstance(reason, str) or n is None:
        return Rejected(Garbage.MESSAGE)
    if key not in known:
        return Rejected(Garbage.UNKNOWN_KEY)
    if kind == "cooloff" and reason not in COOLOFF_REASONS:
        return Rejected(Garbage.MESSAGE)
    reason = escape(reason)
    ttl, clamped = 0.0, False
    if kind != "close":
        got = clamp_ttl(msg.get("ttl", 0.0), bounds.bound(kind, reason))
        if got is None:
            return Rejected(Garbage.MESSAGE)
        ttl, clamped = got
    change = Change(key, kind, ttl, reason, min(max(n, 0), MAX_REOPENS))
    return Message(origin, kind, change=change, clamped=clamped)


# -- Redis keys ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyReading:
    """What a breaker or cool-off key in Redis means here."""

    #: the change to apply (None: nothing there, or nothing usable)
    change: Change | None = None
    #: the key outlives this relay's bound: shorten it to this many ms
    shorten_ms: int | None = None
    garbage: Garbage | None = None


def _pttl_s(pttl: object) -> float | None:
    """A PTTL reply in seconds: -1 (no expiry) is forever; None: no key (or garbage)."""
    p = _int(pttl)
    if p is None or p == -2 or p == 0 or p < -2:
        return None
    return math.inf if p == -1 else p / 1000.0


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


def read_breaker(key: str, pttl: object, value: object, bounds: SharedBounds) -> KeyReading:
    """``unbroken:K:breaker``: PTTL is how long it stays open, the value its re-opens."""
    ttl = _pttl_s(pttl)
    if ttl is None:
        return KeyReading()
    if isinstance(value, BaseException):  # WRONGTYPE: not one of ours
        return KeyReading(garbage=Garbage.WRONG_TYPE)
    text = _text(value)
    garbage = None
    try:
        reopens = int(text) if text is not None else -1
    except ValueError:
        reopens = -1
    if not 0 <= reopens:
        reopens, garbage = 0, Garbage.VALUE
    bound = bounds.bound("open")
    shorten = None
    if ttl > bound:
        ttl, shorten, garbage = bound, max(1, int(bound * 1000)), Garbage.TTL
    change = Change(key, "open", ttl, "fleet", min(reopens, MAX_REOPENS))
    return KeyReading(change, shorten, garbage)


def read_cooloff(key: str, pttl: object, value: object, bounds: SharedBounds) -> KeyReading:
    """``unbroken:K:cooloff``: PTTL is how long it lasts, the value its reason."""
    ttl = _pttl_s(pttl)
    if ttl is None:
        return KeyReading()
    if isinstance(value, BaseException):
        return KeyReading(garbage=Garbage.WRONG_TYPE)
    reason = _text(value)
    if reason not in COOLOFF_REASONS:  # not a cool-off any relay writes: believed by none
        return KeyReading(garbage=Garbage.VALUE)
    garbage = None
    bound = bounds.bound("cooloff", reason)
    shorten = None
    if ttl > bound:
        ttl, shorten, garbage = bound, max(1, int(bound * 1000)), Garbage.TTL
    if ttl <= 0:
        return KeyReading(None, shorten, garbage)
    return KeyReading(Change(key, "cooloff", ttl, reason), shorten, garbage)


def read_count(value: object) -> tuple[int, bool]:
    """A window bucket's count: ``(count, garbage)``; no key counts 0."""
    if value is None:
        return 0, False
    n = _int(value)
    if n is None:
        text = _text(value)
        try:
            n = int(text) if text is not None else -1
        except ValueError:
            n = -1
    if n < 0:
        return 0, True
    return min(n, MAX_COUNT), n > MAX_COUNT


def fleet_share(waiters: object, wall_ms: int, ttl_ms: int, max_share: int) -> tuple[int, bool]:
    """How many relays have turns in an upstream's line (``unbroken:K:waiters``: origin
    -> until, wall-clock ms): ``(n, garbage)``.  A mark counts while ``until`` is ahead,
    and no further ahead than a relay ever sets it (plus as much again for clock
    skew); anything else counts as nobody.  At least 1 (this relay), at most
    ``max_share``."""
    if not isinstance(waiters, Mapping):
        return 1, waiters is not None and not isinstance(waiters, list | tuple)
    n, garbage = 0, False
    horizon = wall_ms + 2 * ttl_ms
    for until in waiters.values():
        text = _text(until)
        try:
            u = int(text) if text is not None else -1
        except ValueError:
            u = -1
        if u < 0 or u > horizon:
            garbage = True
        elif u > wall_ms:
            n += 1
    return min(max(n, 1), max_share), garbage


def lease_grant(got: object, wait: object, want: int, max_wait_s: float) -> tuple[int, float]:
    """A lease script's answer, bounded: ``(granted, wait_s)``; -1 granted: the fleet
    does not know the bucket (teach it again).  Granted is at most ``want``; the wait
    is a finite number in ``[0, max_wait_s]``."""
    g = _int(got)
    if g is None:
        text = _text(got)
        try:
            g = int(text) if text is not None else -1
        except ValueError:
            g = -1
    g = -1 if g < 0 else min(g, want)
    text = _text(wait)
    try:
        w = float(text) if text is not None else float(wait)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        w = max_wait_s
    if math.isnan(w):
        w = max_wait_s
    return g, min(max(w, 0.0), max_wait_s)


# -- logging and the link ---------------------------------------------------------------
class Throttle:
    """At most one line per ``every_s`` per kind (garbage is logged, never flooded)."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self.last: dict[str, float] = {}

    def allow(self, kind: str, now: float) -> bool:
        last = self.last.get(kind)
        if last is not None and now - last < self.every_s:
            return False
        self.last[kind] = now
        return True


class Link:
    """A shared store's connection: up or degraded, each transition reported once.

    ``failed`` (an error, or reads unanswered for ``silent_s``) and ``answered`` (a
    read that succeeded) return True exactly when the state changes: the store logs
    that line.  A store starts down and not yet degraded (connecting)."""

    def __init__(self, silent_s: float = 2.0) -> None:
        self.silent_s = silent_s
        self.up = False
        self.degraded_since: float | None = None
        self.last_answer: float | None = None

    def answered(self, now: float) -> bool:
        """Redis answered: True when this ends an outage (log "back" once)."""
        self.last_answer = now
        was = self.degraded_since is not None
        self.up = True
        self.degraded_since = None
        return was

    def failed(self, now: float) -> bool:
        """An operation failed for want of Redis: True when this starts an outage."""
        if not self.up and self.degraded_since is not None:
            return False
        self.up = False
        self.degraded_since = now
        return True

    def silent(self, now: float) -> bool:
        """Reads went unanswered: True when that has lasted ``silent_s`` while up (the
        store then fails, as on an error)."""
        return self.up and self.last_answer is not None and now - self.last_answer >= self.silent_s

    def view(self) -> dict[str, Any]:
        return {"up": self.up, "degraded_since": self.degraded_since}
