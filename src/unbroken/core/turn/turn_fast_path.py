"""The turn machine's fast path: `feed_verbatim`, for a transport that writes bytes.

The same decisions as `TurnMachine.feed_chunk`, frame by frame; only the work
differs: after commit a run of frames the classifier proves plain passes as it is,
in one piece (`Ledger.release_run`).  A part of `TurnMachine`: methods only, on
`TurnFields`.
"""

from __future__ import annotations

from collections.abc import Sequence

from unbroken.core.turn.ledger import LedgerState
from unbroken.core.turn.turn_fields import TurnFields
from unbroken.core.turn.turn_table import TurnEvent, only_step
from unbroken.core.turn.turn_types import Fed, new_fed
from unbroken.core.wire.sse import CR, Event

__all__ = ["PEEL_FRAMES", "FastPath", "joined"]

#: `FastPath.feed_verbatim`: frames fed to the splitter one at a time before commit,
#: at most this many a chunk (a turn commits on its first output, within a frame or
#: two; the rest of a chunk that holds more goes to the splitter at once)
PEEL_FRAMES = 8

#: `feed_verbatim`'s answer for a chunk released whole, as it is (no allocation)
WHOLE: Fed[bytes | None] = Fed(None, None)
_NOTHING: Fed[bytes | None] = Fed(b"", None)
_STREAM = only_step(TurnEvent.FEED_VERBATIM)
_EVENT = TurnEvent.FEED_VERBATIM


def joined(events: Sequence[Event]) -> bytes:
    if not events:
        return b""
    if len(events) == 1:
        return events[0].raw
    return b"".join([e.raw for e in events])


class FastPath(TurnFields):
    """`feed_verbatim`."""

    __slots__ = ()

    def feed_verbatim(self, now: float, chunk: bytes) -> Fed[bytes | None]:
        """`feed_chunk` for a sink that writes bytes (`verbatim`).  ``released`` is
        None when ``chunk`` is released whole, as it is (write it; a run of plain frames
        never ends the attempt, so ``over`` is None then), else the bytes to write now
        (maybe none), then carry out ``over`` if it is not None.

        The decisions are `feed_chunk`'s, frame by frame; only the work differs.  Once
        the ledger has committed, with nothing held and no tool call open, a run of
        frames the classifier proves plain is released as it is, in one piece, with
        no `Event` each (`Ledger.release_run`): a paced stream's chunk of one text
        delta passes whole.  Before commit, and to finish a frame an earlier chunk
        began, frames go to the splitter one at a time (at most `PEEL_FRAMES` a
        chunk), so a turn that arrives in one chunk (a fast model, a burst after a
        pause, a busy relay) takes the run from its first output on.  What no run
        covers goes to `feed_chunk`.  The splitter gets every byte, in order, in
        pieces; it splits any cut of a stream the same way, so it finds exactly the
        frames it would find in the whole chunk.  A run starts only where the
        splitter is `idle`, and a chunk holding a CR takes no run at all (a CR can
        end a line).
        """
        if self.step is not _STREAM:
            self._illegal("feed_verbatim")
        splitter = self._splitter
        ledger = self.attempt_ledger
        assert splitter is not None and ledger is not None
        if CR in chunk or not chunk or self._splice is not None:
            # (a continuation's frames each pass its join check: no runs)
            return self._fed(joined(self._feed_chunk(now, chunk)))
        self.last_rx = now
        size = len(chunk)
        pos = ledger.release_run(chunk) if splitter.idle else 0
        if pos == size:
            if self.continuation is not None:
                self._record(chunk)
            return WHOLE  # the whole chunk: plain output after commit
        out: list[bytes] = [chunk[:pos]] if pos else []
        if pos and self.continuation is not None:
            self._record(chunk[:pos])
        peeled = 0
        while True:
            if peeled < PEEL_FRAMES and (ledger.state is _LEDGER_PENDING or not splitter.idle):
                peeled += 1
                end = chunk.find(b"\n\n", pos)
                end = size if end < 0 else end + 2
            else:
                end = size
            released = self._feed_chunk(now, chunk[pos:end] if pos or end < size else chunk)
            if released:
                out.extend([e.raw for e in released])
            pos = end
            if pos == size or self._over is not None:
                break
            if splitter.idle:
                end = ledger.release_run(chunk, pos)
                if end > pos:
                    out.append(chunk[pos:end])
                    if self.continuation is not None:
                        self._record(chunk[pos:end])
                    pos = end
                    if pos == size:
                        break
        return self._fed(out[0] if len(out) == 1 else b"".join(out))

    def _fed(self, released: bytes) -> Fed[bytes | None]:
        over = self._over
        if not released and over is None:
            return _NOTHING  # (held: no allocation)
        if over is None:
            return new_fed(Fed, (released, None))
        return Fed(released, self._moved(_STREAM, _EVENT, over))


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_LEDGER_PENDING = LedgerState.PENDING
