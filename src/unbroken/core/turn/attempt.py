"""Per-attempt statistics: what one upstream attempt received, released and held (sans-IO).

The ledger decides; this record only counts.  The turn machine gives each attempt
a fresh `AttemptStats`, the ledger fills it in as frames pass, and observers get a
frozen copy when the attempt ends.
"""

from __future__ import annotations

from unbroken.core.wire.protocols import usage_from

__all__ = ["AttemptStats"]


class AttemptStats:
    """Counters of one attempt.  Mutable while the attempt runs; copied when it ends."""

    __slots__ = (
        "_usage",
        "first_raw",
        "hold_seconds",
        "output_frames",
        "received_bytes",
        "received_frames",
        "recent",
        "released_bytes",
        "released_frames",
    )

    def __init__(self) -> None:
        self.received_frames = 0
        self.received_bytes = 0
        self.released_frames = 0
        self.released_bytes = 0
        self.hold_seconds = 0.0
        #: frames of output, reasoning or tool calls (about one token each)
        self.output_frames = 0
        #: the first frame and the last few (where providers report usage)
        self.first_raw = b""
        self.recent: list[bytes] = []  # at most 4 (a list: a deque allocates 64 slots)
        #: (received_frames, usage) of the last `usage` call
        self._usage: tuple[int, tuple[int | None, int | None]] | None = None

    def usage_frames(self) -> list[bytes]:
        return [self.first_raw, *self.recent]

    def usage(self) -> tuple[int | None, int | None]:
        """``usage_from(self.usage_frames())``: (input, output) tokens reported, read
        once for as long as no frame arrives (the turn's end and its report both ask)."""
        known = self._usage
        if known is not None and known[0] == self.received_frames:
            return known[1]
        got = usage_from(self.usage_frames())
        self._usage = (self.received_frames, got)
        return got
