"""The in-process health store, and what every shared store builds on.

`HealthStore` is ``[health] store = "memory"`` (the default): the board's state is
the process's own.  `unbroken.relay.store.RedisStore` (Redis) and
`unbroken.relay.channel_store.ChannelStore` (``serve --workers`` without Redis)
extend it to share the board's changes; their module docstrings say how.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from unbroken.core.admission.health import Breaker, Change, HealthBoard
from unbroken.core.admission.shared import (
    Garbage,
    KeyReading,
    Message,
    Rejected,
    SharedBounds,
    Throttle,
    escape,
    parse_message,
)
from unbroken.relay.ratestore import RateShare

__all__ = ["HealthStore"]

log = logging.getLogger("unbroken")

#: a shared store re-reads the fleet's state this often
RESYNC_S = 1.0
#: a relay's (or worker's) mark that it has turns in an upstream's line lasts this long
#: unless renewed
WAITERS_TTL_MS = 3000


class HealthStore:
    """In-process health (the default): nothing is shared, nothing can fail."""

    kind = "memory"

    def __init__(
        self,
        board: HealthBoard,
        *,
        clock: Callable[[], float] = time.monotonic,
        bounds: SharedBounds | None = None,
    ):
        self.board = board
        self.clock = clock
        self.origin = uuid.uuid4().hex[:12]
        self.up = True
        #: what shared state may impose on this relay (its own config's bounds)
        self.bounds = bounds or SharedBounds.of(board.settings, 60_000)
        self._throttle = Throttle()
        #: garbage ignored, per kind (for tests and /status)
        self.garbage: dict[str, int] = {}
        #: the providers' rate-limit budgets shared with the siblings (shared stores)
        self.rates: RateShare | None = None
        self.board.listeners.append(self._on_change)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _on_change(self, change: Change) -> None:
        if not change.remote:
            self.publish(change)

    def publish(self, change: Change) -> None:
        """Share a local change (the default store has no one to tell)."""

    def count(self, key: str, failed: bool) -> None:
        """One attempt's result, for the fleet's windowed counters."""

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "state": "ok" if self.up else "degraded"}

    # -- helpers for the shared stores ---------------------------------------------------
    def _encode(self, change: Change) -> bytes:
        ttl = min(max(change.ttl_s, 0.0), self.bounds.bound(change.kind, change.reason))
        return json.dumps(
            {
                "o": self.origin,
                "k": change.key,
                "kind": change.kind,
                "ttl": ttl,
                "r": escape(change.reason),
                "n": change.reopens,
            }
        ).encode()

    def _tell_throttle(
        self, key: str, cred: str, anchor: float, demand: float, asks: bool = True
    ) -> None:
        """This relay's throttle measure for ``key`` and ``cred`` (it was seen to accept
        ``anchor`` a second with ``demand`` requests; ``asks``: after its own decrease,
        a question the siblings answer): tell the siblings
        (`unbroken.relay.ratestore.RateShare.sibling_news`)."""
        msg = {
            "o": self.origin,
            "kind": "throttle",
            "k": key,
            "c": cred,
            "a": anchor,
            "d": demand,
            "q": 1 if asks else 0,
        }
        self._broadcast(json.dumps(msg).encode())

    def _broadcast(self, data: bytes) -> None:
        """Send a message to every sibling (the default store has none)."""

    def _sibling_news(self, msg: Message) -> None:
        """A sibling's ``throttle`` message (validated), for the rate share if any."""
        if self.rates is not None and msg.key is not None and msg.cred is not None:
            self.rates.sibling_news(msg.key, msg.cred, msg.origin, msg.anchor, msg.demand, msg.asks)

    def _ignored(self, why: Garbage, where: str) -> None:
        """Garbage from shared state: counted, logged at most once a minute per kind."""
        self.garbage[why.value] = self.garbage.get(why.value, 0) + 1
        if why is not Garbage.UNKNOWN_KEY and self._throttle.allow(why.value, self.clock()):
            log.warning(
                "health store: ignored %s from %s (%s; logged once a minute)",
                why.value,
                self.kind,
                escape(where),
            )

    def _apply_message(self, data: bytes | str, where: str = "a message") -> Message | None:
        """Validate and apply a peer's message (`core.admission.shared.parse_message`)."""
        msg = parse_message(data, self.bounds, self.board.records)
        if isinstance(msg, Rejected):
            self._ignored(msg.why, where)
            return None
        if msg.origin == self.origin:
            return None
        if msg.clamped:
            self._ignored(Garbage.TTL, where)
        if msg.change is not None:
            self.board.apply(msg.change, self.clock())
        elif msg.kind == "throttle":
            self._sibling_news(msg)
        return msg

    def _apply_reading(self, reading: KeyReading, where: str) -> None:
        if reading.garbage is not None:
            self._ignored(reading.garbage, where)
        if reading.change is not None:
            self.board.apply(reading.change, self.clock())

    def _local_changes(self) -> list[Change]:
        """The board's live opens and cool-offs, as changes (to re-share them)."""
        now = self.clock()
        out: list[Change] = []
        for key, rec in self.board.records.items():
            if rec.state is Breaker.OPEN and rec.open_until > now:
                out.append(Change(key, "open", rec.open_until - now, "resync", rec.reopens))
            if rec.cooloff_until > now:
                out.append(Change(key, "cooloff", rec.cooloff_until - now, rec.cooloff_reason))
        return out
