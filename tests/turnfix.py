"""Test doubles for the turn machine: its timers and a recording `TurnObserver`."""

from __future__ import annotations

from typing import Any

from unbroken.config import StreamSettings
from unbroken.core.attempt import AttemptStats
from unbroken.core.policy import Failure
from unbroken.core.turn import Phase, TurnState

#: the machine's timers with the config's defaults (`[stream]`), any of them overridden
Timers = StreamSettings


class Report:
    """Records what the machine tells observers."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def attempt_started(self, number: int, upstream: int, choice: str = "") -> None:
        self.calls.append(("started", number, upstream))

    def attempt_ended(
        self, reason: str, phase: Phase | None, status: int | None, stats: AttemptStats | None
    ) -> None:
        self.calls.append(("ended", reason, phase))

    def attempt_failed(self, failure: Failure, phase: Phase, wait_s: float | None) -> None:
        self.calls.append(("failed", failure.label, phase, wait_s))

    def state(self, state: TurnState) -> None:
        pass

    def hold_overflow(self, held_bytes: int) -> None:
        self.calls.append(("overflow", held_bytes))

    def parked(self, why: str) -> None:
        self.calls.append(("parked", why))

    def headers_sent(self) -> None:
        self.calls.append(("headers",))

    def continuation(self, result: str, splices: int, saved_frames: int) -> None:
        self.calls.append(("continuation", result, splices, saved_frames))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]
