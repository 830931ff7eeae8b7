"""The one timer of a turn (`Watchdog`): fires at the machine's deadline and carries
out what `TurnMachine.tick` returns.  `LoopDeadlines`: the deadlines of every turn on
one event-loop timer."""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any

from unbroken.core.turn.machine import Action, TurnMachine

__all__ = ["LoopDeadlines", "Watchdog"]

#: what asyncio's loop counts as due when it runs its timers: up to its clock's resolution
#: ahead (``BaseEventLoop._clock_resolution``, read through the public API)
_RESOLUTION = time.get_clock_info("monotonic").resolution

#: a deadline in `LoopDeadlines`: [when, sequence, callback, context]; the callback and the
#: context are None once it is cancelled or has run
Entry = list[Any]


def loop_clock(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """``loop.time`` as a callable: `time.monotonic` when the loop's ``time`` is
    asyncio's own (``BaseEventLoop.time`` returns ``time.monotonic()``: the same value,
    without the Python call), else the loop's (uvloop's, a test's)."""
    if getattr(type(loop), "time", None) is asyncio.BaseEventLoop.time:
        return time.monotonic
    return loop.time


class LoopDeadlines:
    """Deadlines on one event-loop timer: ``loop.call_at`` without a `TimerHandle` each.

    Every turn arms one or two deadlines (its watchdog; the header deadline of each
    attempt) and nearly all are cancelled long before they are due.  Through the loop,
    each is a `TimerHandle` pushed onto the loop's heap with a Python-level comparison
    per step, and a cancellation; here it is a small list pushed onto a heap compared in
    C, and a cancellation is two stores.  One loop timer stays armed for the earliest
    live deadline (at its exact time: nothing runs later than ``loop.call_at`` would
    run it); when it fires, every deadline then due runs, in order of time (then of
    arming), each in the context it was given, an exception in one reported to the
    loop's exception handler as the loop would.  Cancelled deadlines leave the heap
    when they reach its head, or all at once when they are most of it (as the loop
    does with its own).
    """

    __slots__ = ("_armed_at", "_dead", "_handle", "_heap", "_seq", "loop", "time")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: the loop's clock, as a callable: ``loop.time``, or `time.monotonic` itself
        #: when the loop's ``time`` is asyncio's (which returns it: the same values,
        #: without a Python call a read; uvloop keeps its own)
        self.time: Callable[[], float] = loop_clock(loop)
        self._heap: list[Entry] = []
        self._seq = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_at = 0.0
        self._dead = 0  # cancelled entries still in the heap

    def __len__(self) -> int:
        """Live deadlines."""
        return len(self._heap) - self._dead

    def call_at(
        self,
        when: float,
        callback: Callable[[], object],
        context: contextvars.Context | None = None,
    ) -> Entry:
        """Run ``callback`` (in ``context``, if given) at loop time ``when``; the entry
        returned is what `cancel` takes."""
        entry = [when, next(self._seq), callback, context]
        heapq.heappush(self._heap, entry)
        if self._handle is None or when < self._armed_at:
            self._arm(when)
        return entry

    def cancel(self, entry: Entry) -> None:
        """Cancel a deadline (nothing if it ran or was cancelled already)."""
        if entry[2] is None:
            return
        entry[2] = entry[3] = None
        self._dead += 1
        heap = self._heap
        if self._dead > 64 and self._dead * 2 > len(heap):
            heap[:] = [e for e in heap if e[2] is not None]
            heapq.heapify(heap)
            self._dead = 0

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = when
        self._handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        heap = self._heap
        loop = self.loop
        end = loop.time() + _RESOLUTION
        while heap:
            entry = heap[0]
            callback = entry[2]
            if callback is None:
                heapq.heappop(heap)
                self._dead -= 1
                continue
            if entry[0] > end:
                break
            heapq.heappop(heap)
            context = entry[3]
            entry[2] = entry[3] = None
            try:
                if context is None:
                    callback()
                else:
                    context.run(callback)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                loop.call_exception_handler(
                    {"message": f"Exception in timer callback {callback!r}", "exception": exc}
                )
        if heap and self._handle is None:
            self._arm(heap[0][0])


class Watchdog:
    """The one timer of a turn: fires at the machine's deadline and carries out `tick`.

    Activity only moves timestamps inside the machine; the timer is not re-armed for
    it.  What makes that safe: every deadline counts from the event that sets it
    (early headers from the turn's start, a stall from the answer or the last frame,
    a keepalive from the last write), at least ``min_interval`` later, and the timer
    is always armed no later than ``min_interval`` from the moment it is armed.  So
    a deadline any later event sets falls after the timer, which re-arms exactly
    when it fires.  A short turn arms one timer and never moves it; a long one wakes
    once per ``min_interval`` (15 s by default).  ``on_action`` carries out what
    `tick` returns.
    """

    __slots__ = (
        "_context",
        "_handle",
        "_interval",
        "closed",
        "deadlines",
        "loop",
        "machine",
        "on_action",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        machine: TurnMachine,
        on_action: Any,
        interval: float,
        deadlines: LoopDeadlines,
    ) -> None:
        """``interval``: the machine's ``min_interval`` (`RelayState.min_interval` caches it);
        ``deadlines``: the loop's (`RelayState.deadlines`), where the turn's attempts put
        their header deadline too."""
        self.loop, self.machine, self.on_action = loop, machine, on_action
        self.deadlines = deadlines
        self._context = contextvars.copy_context()  # what a TimerHandle would capture
        self._handle: Entry | None = None
        self._interval = interval
        self.closed = False

    def arm(self) -> None:
        """Make sure the timer runs while anything is timed (free when it does)."""
        if self.closed or self._handle is not None:
            return
        due = self.machine.deadline()
        if due is None:
            return
        cap = self.deadlines.time() + self._interval
        self._handle = self.deadlines.call_at(due if due < cap else cap, self._fire, self._context)

    def _fire(self) -> None:
        self._handle = None
        if self.closed:
            return
        action = self.machine.tick(self.deadlines.time())
        if action is not None:
            self.on_action(action)
        self.arm()

    def close(self) -> None:
        self.closed = True
        if self._handle is not None:
            self.deadlines.cancel(self._handle)
            self._handle = None
        # Drop the reference back to the transport (its bound method): a turn's
        # objects are then freed by reference counting as soon as it ends, not left
        # to the cyclic garbage collector (which costs every turn CPU).
        self.on_action = _ignore


def _ignore(action: Action) -> None:
    pass
