"""Each upstream's recent outcomes (and its breaker, read off the board), for status
and metrics.

A `Hooks` observer: it learns from every attempt the relay reports.  What steers
retries (cool-offs, circuit breakers) lives in the relay's health board
(`unbroken.core.admission.health.HealthBoard`, shared through the health store); this module
only reads it, through ``breakers`` (`RelayState.health_view`), and adds each upstream's
breaker state, open-until time, failure rate and cool-off to its snapshot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.core.turn.machine import NOT_UPSTREAM, UPSTREAM_ANSWERED
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnRecord

__all__ = ["Health", "UpstreamOutcomes"]


@dataclass(slots=True)
class UpstreamOutcomes:
    route: str
    upstream: str
    ok: int = 0
    failed: int = 0
    consecutive_failures: int = 0
    last_ok: float | None = None
    #: (wall time, reason) of the most recent failures
    recent: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=20))

    @property
    def up(self) -> bool:
        """Up unless its last attempts all failed (three in a row)."""
        return self.consecutive_failures < 3


class Health(Hooks):
    def __init__(
        self,
        routes: dict[str, list[str]],
        cooloffs: dict[str, dict[int, float]],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        breakers: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.breakers = breakers
        self.upstreams: dict[tuple[str, str], UpstreamOutcomes] = {
            (route, up): UpstreamOutcomes(route, up) for route, ups in routes.items() for up in ups
        }
        self._index = {(route, up): i for route, ups in routes.items() for i, up in enumerate(ups)}
        self.cooloffs = cooloffs
        self.clock = clock
        self.wall = wall

    def _get(self, route: str, upstream: str) -> UpstreamOutcomes:
        key = (route, upstream)
        h = self.upstreams.get(key)
        if h is None:
            h = self.upstreams[key] = UpstreamOutcomes(route, upstream)
        return h

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        h = self._get(turn.route, attempt.upstream)
        if attempt.reason in NOT_UPSTREAM:
            return  # not the upstream's doing (the client left, or a relay bug)
        if attempt.reason in UPSTREAM_ANSWERED:
            h.ok += 1
            h.consecutive_failures = 0
            h.last_ok = attempt.ended or self.wall()
            return
        h.failed += 1
        h.consecutive_failures += 1
        h.recent.append((attempt.ended or self.wall(), attempt.reason))

    def cooloff_s(self, route: str, upstream: str) -> float:
        """Seconds this upstream still asked to be left alone (Retry-After)."""
        idx = self._index.get((route, upstream))
        if idx is None:
            return 0.0
        until = self.cooloffs.get(route, {}).get(idx, 0.0)
        return max(0.0, until - self.clock())

    def snapshot(self) -> list[dict[str, Any]]:
        boards = {(b["route"], b["upstream"]): b for b in self.breakers()} if self.breakers else {}
        wall = self.wall()
        out = []
        for h in self.upstreams.values():
            b = boards.get((h.route, h.upstream), {})
            breaker = b.get("breaker", "closed")
            open_for = float(b.get("open_for_s", 0.0))
            cooloff = max(self.cooloff_s(h.route, h.upstream), float(b.get("cooloff_s", 0.0)))
            out.append(
                {
                    "route": h.route,
                    "upstream": h.upstream,
                    "up": h.up and breaker == "closed",
                    "ok": h.ok,
                    "failed": h.failed,
                    "consecutive_failures": h.consecutive_failures,
                    "cooloff_s": round(cooloff, 3),
                    "cooloff_reason": b.get("cooloff_reason", "retry_after" if cooloff else ""),
                    "breaker": breaker,
                    "open_until": round(wall + open_for, 3) if breaker == "open" else None,
                    "failure_rate": b.get("failure_rate", 0.0),
                    #: the retry pacer (`core.admission.pacer`): tokens, turns in line, ramping
                    "pacer": b.get("pacer") or {},
                    #: the provider's rate limits per credential (`core.admission.ratelimit`):
                    #: budgets learned, the AIMD window, turns waiting for the budget
                    "ratelimits": b.get("ratelimits") or [],
                    "recent_failures": [{"at": t, "reason": r} for t, r in h.recent],
                }
            )
        return out
