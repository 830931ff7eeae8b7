"""In-memory upstream health: recent outcomes per upstream, for status and metrics.

A `Hooks` observer: it learns from every attempt the relay reports.  Cool-offs
themselves live in the relay (``Relay.cooloffs``), shared by every turn of a
route, because they steer retries; this module only reads them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.observe.hooks import AttemptInfo, Hooks, TurnInfo

__all__ = ["Health", "UpstreamHealth"]


@dataclass(slots=True)
class UpstreamHealth:
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
    ) -> None:
        self.upstreams: dict[tuple[str, str], UpstreamHealth] = {
            (route, up): UpstreamHealth(route, up) for route, ups in routes.items() for up in ups
        }
        self._index = {
            (route, up): i for route, ups in routes.items() for i, up in enumerate(ups)
        }
        self.cooloffs = cooloffs
        self.clock = clock
        self.wall = wall

    def _get(self, route: str, upstream: str) -> UpstreamHealth:
        key = (route, upstream)
        h = self.upstreams.get(key)
        if h is None:
            h = self.upstreams[key] = UpstreamHealth(route, upstream)
        return h

    def attempt_ended(self, turn: TurnInfo, attempt: AttemptInfo) -> None:
        h = self._get(turn.route, attempt.upstream)
        if attempt.reason == "aborted_by_client":
            return  # not the upstream's doing
        if attempt.reason in ("ok", "passed_through_error"):  # it answered
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
        return [
            {
                "route": h.route,
                "upstream": h.upstream,
                "up": h.up,
                "ok": h.ok,
                "failed": h.failed,
                "consecutive_failures": h.consecutive_failures,
                "cooloff_s": round(self.cooloff_s(h.route, h.upstream), 3),
                "recent_failures": [{"at": t, "reason": r} for t, r in h.recent],
            }
            for h in self.upstreams.values()
        ]
