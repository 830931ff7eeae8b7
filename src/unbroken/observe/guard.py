"""`Guarded`: run an observer so that its failures are logged, never propagated.

Hooks run on the event loop inside the relay's turn; an observer that raises
(a bug, a full queue, a closed database) must not break the turn it watches.
"""

from __future__ import annotations

import logging
import time

from unbroken.core.policy import Failure
from unbroken.observe.hooks import AttemptInfo, Hooks, TurnInfo

__all__ = ["Guarded"]

log = logging.getLogger("unbroken")

#: at most one log line per observer in this many seconds (after the first)
LOG_EVERY_S = 60.0


class Guarded(Hooks):
    """Forwards every hook to ``inner``; an exception is logged (rate-limited) and dropped."""

    def __init__(self, inner: Hooks) -> None:
        self.inner = inner
        self.errors = 0
        self._logged_at: float | None = None

    def _failed(self, hook: str) -> None:
        self.errors += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.exception(
                "observer %s failed in %s (%d errors so far); the relay goes on",
                type(self.inner).__name__, hook, self.errors,
            )

    def turn_started(self, turn: TurnInfo) -> None:
        try:
            self.inner.turn_started(turn)
        except Exception:
            self._failed("turn_started")

    def attempt_started(self, turn: TurnInfo, upstream: str) -> None:
        try:
            self.inner.attempt_started(turn, upstream)
        except Exception:
            self._failed("attempt_started")

    def attempt_failed(
        self, turn: TurnInfo, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        try:
            self.inner.attempt_failed(turn, upstream, failure, phase=phase, wait_s=wait_s)
        except Exception:
            self._failed("attempt_failed")

    def attempt_ended(self, turn: TurnInfo, attempt: AttemptInfo) -> None:
        try:
            self.inner.attempt_ended(turn, attempt)
        except Exception:
            self._failed("attempt_ended")

    def hold_overflow(self, turn: TurnInfo, held_bytes: int) -> None:
        try:
            self.inner.hold_overflow(turn, held_bytes)
        except Exception:
            self._failed("hold_overflow")

    def turn_ended(self, turn: TurnInfo) -> None:
        try:
            self.inner.turn_ended(turn)
        except Exception:
            self._failed("turn_ended")
