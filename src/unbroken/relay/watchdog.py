"""The one timer of a turn (`Watchdog`): fires at the machine's deadline and carries
out what `TurnMachine.tick` returns."""

from __future__ import annotations

import asyncio
from typing import Any

from unbroken.core.turn.machine import Action, TurnMachine

__all__ = ["Watchdog"]


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

    __slots__ = ("_handle", "_interval", "closed", "loop", "machine", "on_action")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        machine: TurnMachine,
        on_action: Any,
        interval: float,
    ) -> None:
        """``interval``: the machine's ``min_interval`` (`RelayState.min_interval` caches it)."""
        self.loop, self.machine, self.on_action = loop, machine, on_action
        self._handle: asyncio.TimerHandle | None = None
        self._interval = interval
        self.closed = False

    def arm(self) -> None:
        """Make sure the timer runs while anything is timed (free when it does)."""
        if self.closed or self._handle is not None:
            return
        due = self.machine.deadline()
        if due is None:
            return
        cap = self.loop.time() + self._interval
        self._handle = self.loop.call_at(due if due < cap else cap, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self.closed:
            return
        action = self.machine.tick(self.loop.time())
        if action is not None:
            self.on_action(action)
        self.arm()

    def close(self) -> None:
        self.closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Drop the reference back to the transport (its bound method): a turn's
        # objects are then freed by reference counting as soon as it ends, not left
        # to the cyclic garbage collector (which costs every turn CPU).
        self.on_action = _ignore


def _ignore(action: Action) -> None:
    pass
