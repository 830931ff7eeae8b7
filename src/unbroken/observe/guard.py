"""`Guarded`: run an observer so that its failures are logged, never propagated.

Hooks run on the event loop inside the relay's turn; an observer that raises
(a bug, a full queue, a closed database) must not break the turn it watches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from unbroken.core.admission.shared import LOG_EVERY_S
from unbroken.observe.hooks import HOOK_NAMES, Hooks, implements

__all__ = ["Guarded"]

log = logging.getLogger("unbroken")


class Guarded(Hooks):
    """Forwards every hook to ``inner``; an exception is logged (rate-limited) and dropped."""

    def __init__(self, inner: Hooks) -> None:
        self.inner = inner
        self.errors = 0
        self._logged_at: float | None = None
        # Each event the observer implements gets its guarded method once, bound to the
        # observer's own: the fan-out calls it on every turn.
        for name in HOOK_NAMES:
            if implements(inner, name):
                setattr(self, name, self._guard(name, getattr(inner, name)))

    def _guard(self, name: str, method: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any, **kwargs: Any) -> None:
            try:
                method(*args, **kwargs)
            except Exception:
                self._failed(name)

        call.__name__ = name
        return call

    def unguarded(self, name: str) -> tuple[Callable[..., None], Callable[[str], None]]:
        """The observer's own method for event ``name`` and what a failure of it is handed
        to: a fan-out (`MultiHooks`) runs the guard itself, one call less per event."""
        return getattr(self.inner, name), self._failed

    def _implements(self, name: str) -> bool:
        return implements(self.inner, name)

    def _failed(self, hook: str) -> None:
        self.errors += 1
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.exception(
                "observer %s failed in %s (%d errors so far); the relay goes on",
                type(self.inner).__name__,
                hook,
                self.errors,
            )
