"""The limiters of one relay process, and a fleet's cold start (sans-IO).

`RateBoard` holds one `unbroken.core.admission.ratelimit.Limiter` per upstream key and
credential, pumps their lines, and tells its listeners (a fleet store's top-ups, the
health board's waker) of every change.  With a fleet store, a new limiter's cold start
is the fleet's (`RateBoard.cold_gate`): the store's lease on the key decides which
relay lets its ``cold_start`` go; the others start at one in flight
(`Limiter.cold_answer`).  Nothing here does I/O; time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from unbroken.core.admission.ratelimit import Limiter, RateSettings

__all__ = ["COLD_GATE_S", "ColdGate", "RateBoard"]

#: a fleet's cold start on a key is one relay's for this long after the fleet's first
#: request on it (`RateBoard.cold_gate`): relays starting together on a spent key send
#: ``cold_start`` requests into it, and one each more, not ``cold_start`` each
COLD_GATE_S = 10.0

#: a fleet store's lease on a key's cold start: ``gate(key, cred, ttl_s)`` is True (this
#: relay takes it), False (a sibling took it), None (asked: the store tells the key's
#: listeners when it knows, `RateBoard.changed`)
ColdGate = Callable[[str, str, float], bool | None]


class RateBoard:
    """The limiters of one relay process, by upstream key and credential."""

    def __init__(self, settings: RateSettings | None = None) -> None:
        self.settings = settings or RateSettings()
        #: upstream key -> credential hash -> its limiter
        self.limiters: dict[str, dict[str, Limiter]] = {}
        #: told when a line of ``key`` may move (the health board's listener)
        self.poke: Callable[[str], None] | None = None
        #: told of every change of ``key``'s limiters (a fleet store's top-ups)
        self.listeners: list[Callable[[str], None]] = []
        #: a fleet store's lease on a new limiter's cold start (None: no fleet)
        self.cold_gate: ColdGate | None = None

    def get(self, key: str, cred: str) -> Limiter:
        by = self.limiters.get(key)
        if by is None:
            by = self.limiters[key] = {}
        lim = by.get(cred)
        if lim is None:
            lim = by[cred] = Limiter(key, cred, self.settings)
            if self.cold_gate is not None:
                lim.cold_answer(None)
                self.ask_cold(lim)
        elif lim.cold == "asking":
            self.ask_cold(lim)
        return lim

    def ask_cold(self, lim: Limiter) -> None:
        """Ask the fleet store for ``lim``'s cold start (again: it said it would know)."""
        gate = self.cold_gate
        lim.cold_answer(True if gate is None else gate(lim.key, lim.cred, COLD_GATE_S))

    def waiting(self, key: str) -> bool:
        by = self.limiters.get(key)
        if by:  # (a loop, not a generator: asked twice a turn)
            for lim in by.values():
                if lim.line or lim.granted:  # `Limiter.waiting`, inline
                    return True
        return False

    def pump(self, key: str, now: float) -> tuple[list[int], float | None]:
        by = self.limiters.get(key)
        if not by:
            return [], None
        out: list[int] = []
        due: float | None = None
        for lim in by.values():
            if lim.cold == "asking":
                self.ask_cold(lim)
            got, d = lim.pump(now)
            out.extend(got)
            if d is not None and (due is None or d < due):
                due = d
        return out, due

    def changed(self, key: str) -> None:
        for listener in self.listeners:
            listener(key)
        poke = self.poke
        if poke is not None and self.waiting(key):
            poke(key)

    def all(self) -> Iterator[Limiter]:
        for by in self.limiters.values():
            yield from by.values()

    def view(self, key: str, now: float) -> list[dict[str, Any]]:
        by = self.limiters.get(key)
        return [lim.view(now) for lim in by.values()] if by else []

    def in_line(self, key: str) -> int:
        """Turns waiting in ``key``'s rate lines."""
        by = self.limiters.get(key)
        return sum(len(lim.line) for lim in by.values()) if by else 0

    def wait_reason(self, key: str, now: float) -> str | None:
        """Why turns wait in ``key``'s rate lines, for the logs (None: none do)."""
        by = self.limiters.get(key) or {}
        return "; ".join(lim.wait_reason(now) for lim in by.values() if lim.line) or None
