"""Test doubles for the turn machine: its timers, a recording `TurnObserver`, and a
chat-protocol machine with the frames its tests feed it (`make`, `chunk`, `ROLE`, ...)."""

from __future__ import annotations

import json
import random
from typing import Any

from unbroken.config import StreamSettings
from unbroken.core.admission.policy import Failure, FailureClass, RetryPolicy, RetryState
from unbroken.core.turn.attempt import AttemptStats
from unbroken.core.turn.ledger import Hold
from unbroken.core.turn.machine import Action, Fed, Open, Phase, Stream, TurnMachine, TurnState
from unbroken.core.wire.protocols import CHAT

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

    def uncovered(self, result: str) -> None:
        self.calls.append(("uncovered", result))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


def make(
    *,
    stream: bool = True,
    upstreams: int = 1,
    max_attempts: int = 0,
    delay_ms: int = 100,
    **timers: Any,
) -> tuple[TurnMachine, Report]:
    report = Report()
    retry = RetryState(
        RetryPolicy(delay_ms=delay_ms, backoff="fixed", max_attempts=max_attempts),
        upstreams,
        rng=random.Random(0),
    )
    m = TurnMachine(
        protocol=CHAT,
        hold=Hold(),
        timers=Timers(**timers),
        retry=retry,
        stream=stream,
        now=0.0,
        report=report,
    )
    return m, report


def chunk(delta: dict[str, Any], finish: str | None = None, id_: str = "c1") -> bytes:
    obj = {"id": id_, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = chunk({"role": "assistant"})
TEXT = chunk({"content": "hello"})
FINISH = chunk({}, "stop")
DONE = b"data: [DONE]\n\n"
RETRYABLE = b'data: {"error": {"type": "server_error", "message": "boom"}}\n\n'
RESET = Failure(FailureClass.RESET, "reset")
REFUSED = Failure(FailureClass.REFUSED, "refused")


def raw(fed: Any) -> bytes:
    """The bytes of what a feed released (its frames')."""
    events = fed.released if isinstance(fed, Fed) else fed
    return b"".join(e.raw for e in events)


def seen(fed: Fed[Any]) -> tuple[bytes, Action | None]:
    """A feed's released bytes and its ``over``."""
    return raw(fed), fed.over


def streaming(m: TurnMachine, now: float = 1.0) -> None:
    assert isinstance(m.start(0.0), Open)
    assert isinstance(m.answered(now, 200, sse=True), Stream)
