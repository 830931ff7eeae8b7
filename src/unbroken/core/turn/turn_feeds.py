"""The turn machine's feeds: an answer's body, frame by frame, through the ledger.

`feed_chunk` (SSE bytes through the splitter), `feed_frame` (one WebSocket message)
and `feed_body` (a plain answer's bytes) each return `Fed(released, over)`: what to
write now, and the action that ends the attempt, decided by the frame that brought
it (`_decide`).  A part of `TurnMachine` (`unbroken.core.turn.machine`, whose header is the
theory of operation): methods only, on `TurnFields`.
"""

from __future__ import annotations

from collections.abc import Sequence

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.core.turn.continuation import JoinBroken
from unbroken.core.turn.ledger import NOTHING, Ledger, Verdict
from unbroken.core.turn.turn_fields import TurnFields
from unbroken.core.turn.turn_table import (
    FIRST_FRAME,
    HEADERS_SENT,
    IDLE,
    NOTHING_SENT,
    OVERFLOW_REPORTED,
    TERMINATED,
    WITHIN_BOUND,
    TurnEvent,
    only_step,
)
from unbroken.core.turn.turn_types import Fed, TurnState, new_fed
from unbroken.core.wire.sse import Event, EventTooLarge

__all__ = ["TurnFeeds"]

#: the hot path's legality checks: identities, each from its own event's row (the
#: table says where each is legal)
_CHUNK = only_step(TurnEvent.FEED_CHUNK)
_FRAME = only_step(TurnEvent.FEED_FRAME)
_PASS_THROUGH = only_step(TurnEvent.FEED_BODY)


class TurnFeeds(TurnFields):
    """The body's events: `feed_chunk`, `feed_frame`, `feed_body`."""

    __slots__ = ()

    def feed_chunk(self, now: float, chunk: bytes) -> Fed[Sequence[Event]]:
        """SSE body bytes, through the splitter and the ledger frame by frame:
        ``released`` the frames to write now (boundaries kept), then ``over``."""
        if self.step is not _CHUNK:
            self._illegal("feed_chunk")
        released = self._feed_chunk(now, chunk)
        over = self._over
        if over is None:
            return new_fed(Fed, (released, None))
        return Fed(released, self._moved(_CHUNK, _EVENT_FEED_CHUNK, over))

    def _feed_chunk(self, now: float, chunk: bytes) -> Sequence[Event]:
        self.last_rx = now
        splitter = self._splitter
        assert splitter is not None
        too_large: EventTooLarge | None = None
        try:
            events = splitter.feed(chunk)
        except EventTooLarge as exc:
            # The complete events before it still count; then the attempt has failed.
            events, too_large = exc.events, exc
        if too_large is not None:
            out = self._feed_events(now, events)
            if self._over is None:
                self._over = self._transport_failed(
                    now, Failure(_FAILURE_MALFORMED, str(too_large))
                )
            return out
        if not events:
            return NOTHING
        return self._feed_events(now, events)

    def _feed_events(self, now: float, events: list[Event]) -> Sequence[Event]:
        if not events:
            return NOTHING
        if self._splice is not None:
            return self._feed_spliced(now, events)
        ledger = self.attempt_ledger
        assert ledger is not None
        if self.watch is FIRST_FRAME:
            for event in events:
                if event.name is not None or event.data is not None:  # `Event.is_comment`
                    self._set_watch(IDLE)
                    break
        feed = ledger.feed
        out: list[Event] = []
        done_marker = False
        for event in events:
            released = feed(event)
            if released:
                out.extend(released)
            verdict = ledger.verdict
            if verdict is not _VERDICT_CONTINUE:
                if verdict is _VERDICT_DONE:
                    if event.data == "[DONE]":
                        done_marker = True
                    continue
                break
        if ledger.hold_overflowed and self.overflow is WITHIN_BOUND:
            self._overflowed(ledger)
        if out:
            self._released()
            if self.continuation is not None:
                self._record_events(out)
        if done_marker:
            self._set_reply(TERMINATED)
        if ledger.verdict is _VERDICT_CUT:  # after the frames before it were recorded
            out.extend(self._cut_by_error(now, ledger))
        verdict = ledger.verdict
        if verdict is _VERDICT_REPLAY or verdict is _VERDICT_FAIL:
            self._decide(now)
        return out

    def feed_frame(self, now: float, event: Event) -> Fed[Sequence[Event]]:
        """One frame (a WebSocket message): ``released`` the frames to send, then ``over``."""
        if self.step is not _FRAME:
            self._illegal("feed_frame")
        released = self._feed_frame(now, event)
        over = self._over
        if over is None:
            return new_fed(Fed, (released, None))
        return Fed(released, self._moved(_FRAME, _EVENT_FEED_FRAME, over))

    def _feed_frame(self, now: float, event: Event) -> Sequence[Event]:
        self.last_rx = now
        if self.watch is FIRST_FRAME:
            self._set_watch(IDLE)
        splice = self._splice
        if splice is not None:
            try:
                spliced = splice.splice(event)
            except JoinBroken as exc:
                self._over = self._join_broken(now, str(exc))
                return NOTHING
            if spliced is None:
                return NOTHING
            if not isinstance(spliced, Event):
                return self._feed_frames(now, spliced)
            event = spliced
        ledger = self.attempt_ledger
        assert ledger is not None
        released = ledger.feed(event)
        if ledger.hold_overflowed and self.overflow is WITHIN_BOUND:
            self._overflowed(ledger)
        if released:
            self._released()
            if self.continuation is not None:
                self._record_events(released)
        verdict = ledger.verdict
        if verdict is _VERDICT_REPLAY or verdict is _VERDICT_FAIL:
            self._decide(now)
        return released

    def _feed_frames(self, now: float, events: Sequence[Event]) -> Sequence[Event]:
        """`feed_frame` for the frames a splicer made of one message, in order."""
        ledger = self.attempt_ledger
        assert ledger is not None
        out: list[Event] = []
        for event in events:
            out.extend(ledger.feed(event))
            if ledger.verdict is _VERDICT_REPLAY or ledger.verdict is _VERDICT_FAIL:
                break
        if out:
            self._released()
            self._record_events(out)
        if ledger.verdict is _VERDICT_REPLAY or ledger.verdict is _VERDICT_FAIL:
            self._decide(now)
        return out

    def feed_body(self, now: float, chunk: bytes) -> Fed[bytes]:
        """Plain body bytes: each chunk is released at once (the first byte commits)."""
        if self.step is not _PASS_THROUGH:
            self._illegal("feed_body")
        self.last_rx = now
        if self.watch is FIRST_FRAME:
            self._set_watch(IDLE)
        ledger = self.attempt_ledger
        assert ledger is not None
        released = ledger.feed(Event(chunk, None, ""))
        if released:
            self._released()
        out = chunk if released else b""
        over = self._over
        if over is None:
            return new_fed(Fed, (out, None))
        return Fed(out, self._moved(_PASS_THROUGH, _EVENT_FEED_BODY, over))

    def _released(self) -> None:
        if self.reply is NOTHING_SENT:
            self._set_reply(HEADERS_SENT)
            self.report.headers_sent()
            self.report.state(_STATE_STREAMING)

    def _overflowed(self, ledger: Ledger) -> None:
        """The ledger's hold went over its bound (it released what it held): told once."""
        self._set_overflow(OVERFLOW_REPORTED)
        self.report.hold_overflow(ledger.max_hold_bytes)

    def _decide(self, now: float) -> None:
        """A frame ended the attempt (a replay, or a failure after commit): decided
        now, by the feed that brought it, so no later event of this attempt is legal."""
        self._over = self._verdict_action(now, None)


# Enum members the functions above read, as module constants: on Python 3.11 an
# Enum class's attribute (``LedgerState.DONE``) is looked up through
# ``EnumType.__getattr__`` (about 950 instructions), a global in about 40.
_EVENT_FEED_BODY = TurnEvent.FEED_BODY
_EVENT_FEED_CHUNK = TurnEvent.FEED_CHUNK
_EVENT_FEED_FRAME = TurnEvent.FEED_FRAME
_FAILURE_MALFORMED = FailureClass.MALFORMED
_STATE_STREAMING = TurnState.STREAMING
_VERDICT_CONTINUE = Verdict.CONTINUE
_VERDICT_CUT = Verdict.CUT
_VERDICT_DONE = Verdict.DONE
_VERDICT_FAIL = Verdict.FAIL
_VERDICT_REPLAY = Verdict.REPLAY
