"""The observer protocol: one place declares the events; fan-out and guarding follow it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.observe.guard import Guarded
from unbroken.observe.hooks import (
    HOOK_NAMES,
    AttemptInfo,
    Hooks,
    MultiHooks,
    TurnRecord,
    implements,
)


class Seen(Hooks):
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    def turn_started(self, turn: TurnRecord) -> None:
        self.log.append(f"{self.tag}:started")

    def turn_ended(self, turn: TurnRecord) -> None:
        self.log.append(f"{self.tag}:ended")


class Broken(Hooks):
    def turn_started(self, turn: TurnRecord) -> None:
        raise RuntimeError("observer bug")


TURN = TurnRecord(route="r", path="v1/chat/completions", protocol="chat", stream=True)


def test_every_hook_method_is_an_event() -> None:
    assert set(HOOK_NAMES) == {
        "turn_started",
        "attempt_started",
        "attempt_failed",
        "attempt_ended",
        "hold_overflow",
        "turn_ended",
        "upstream_changed",
        "continuation",
    }
    for name in HOOK_NAMES:
        assert getattr(MultiHooks, name) is not getattr(Hooks, name)
    # Guarded forwards every event its observer implements (bound per instance)
    seen: list[str] = []

    def record(name: str) -> Any:
        return lambda self, *a, **k: seen.append(name)

    every = type("Every", (Hooks,), {n: record(n) for n in HOOK_NAMES})()
    guarded = Guarded(every)
    for name in HOOK_NAMES:
        getattr(guarded, name)()
    assert seen == list(HOOK_NAMES)


def test_a_nested_fan_out_is_flattened_and_follows_changes_to_the_inner_list() -> None:
    log: list[str] = []
    inner = MultiHooks(Seen("a", log))
    outer = MultiHooks(inner, Guarded(Seen("b", log)))
    outer.turn_started(TURN)
    assert all(
        m.__self__ is not inner
        for m, _ in (outer._bound or {})["turn_started"]
        if hasattr(m, "__self__")
    )
    inner.add(Seen("c", log))  # a change inside: the outer re-binds
    outer.turn_started(TURN)
    inner.remove(inner.hooks[0])
    outer.turn_started(TURN)
    assert log == [
        "a:started",
        "b:started",
        "a:started",
        "c:started",
        "b:started",
        "c:started",
        "b:started",
    ]


def test_a_change_deep_inside_reaches_every_outer_fan_out_and_no_other() -> None:
    """No module-wide generation counter: a change re-binds the fan-out it is made to
    and those it is nested in (at any depth), and leaves unrelated ones bound."""
    log: list[str] = []
    inner = MultiHooks(Seen("a", log))
    middle = MultiHooks(inner)
    outer = MultiHooks(middle, Seen("b", log))
    other = MultiHooks(Seen("z", log))
    outer.turn_started(TURN)
    other.turn_started(TURN)
    inner.add(Seen("c", log))
    assert outer._bound is None and middle._bound is None
    assert other._bound is not None  # unrelated: still bound
    outer.turn_started(TURN)
    assert log == ["a:started", "b:started", "z:started", "a:started", "c:started", "b:started"]
    with pytest.raises(AttributeError):
        outer.hooks.append(Seen("x", log))  # type: ignore[attr-defined]  # a tuple: add()


def test_fan_out_calls_the_hooks_that_implement_an_event_in_order() -> None:
    log: list[str] = []
    multi = MultiHooks(Seen("a", log), Hooks(), Guarded(Seen("b", log)))
    multi.turn_started(TURN)
    multi.attempt_ended(TURN, AttemptInfo(number=1, upstream="u"))  # nobody implements it
    multi.add(Seen("c", log))  # added later: bound on the next event
    multi.turn_ended(TURN)
    assert log == ["a:started", "b:started", "a:ended", "b:ended", "c:ended"]
    assert implements(multi, "turn_ended") and not implements(multi, "hold_overflow")
    assert implements(Guarded(Seen("x", log)), "turn_started")
    assert not implements(Guarded(Hooks()), "turn_started")


def test_a_failing_observer_is_logged_and_never_breaks_the_turn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []
    multi = MultiHooks(Guarded(Broken()), Seen("ok", log))
    with caplog.at_level(logging.ERROR, logger="unbroken"):
        multi.turn_started(TURN)
        multi.attempt_failed(
            TURN, "u", Failure(FailureClass.RESET, "reset"), phase="pending", wait_s=0.1
        )
    assert log == ["ok:started"]
    assert "observer Broken failed in turn_started" in caplog.text


def test_the_fan_out_guards_a_guarded_observer_and_only_it() -> None:
    """The fan-out runs a `Guarded` observer's method itself: its failure is counted by
    its guard and the others still run; an unguarded observer's failure propagates."""
    log: list[str] = []
    guarded = Guarded(Broken())
    multi = MultiHooks(guarded, Seen("ok", log))
    multi.turn_started(TURN)
    multi.turn_started(TURN)
    assert guarded.errors == 2 and log == ["ok:started", "ok:started"]
    with pytest.raises(RuntimeError, match="observer bug"):
        MultiHooks(Seen("a", log), Broken()).turn_started(TURN)


class Calls(Hooks):
    """Every event, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def turn_started(self, turn: TurnRecord) -> None:
        self.log.append("turn_started")

    def attempt_started(self, turn: TurnRecord, upstream: str) -> None:
        self.log.append(f"attempt_started:{upstream}")

    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        self.log.append(f"attempt_failed:{upstream}")

    def attempt_ended(self, turn: TurnRecord, attempt: AttemptInfo) -> None:
        self.log.append(f"attempt_ended:{attempt.upstream}")

    def turn_ended(self, turn: TurnRecord) -> None:
        self.log.append("turn_ended")


def _run(defer: bool, flush_after: int) -> list[str]:
    """Two attempts (a failure, then ok), with `flush` after ``flush_after`` steps."""
    from unbroken.core.turn.machine import Outcome, Phase
    from unbroken.observe.report import HooksObserver

    calls = Calls()
    info = TurnRecord(route="r", path="v1/chat/completions", protocol="chat", stream=True)
    report = HooksObserver(info, calls, ("a", "b"), set())
    steps: list[Callable[[], None]] = [
        lambda: report.attempt_started(1, 0),
        lambda: report.attempt_failed(Failure(FailureClass.STATUS, "503"), Phase.HEADERS, 0.1),
        lambda: report.attempt_ended("503", Phase.HEADERS, 503, None),
        lambda: report.attempt_started(2, 1),
        lambda: report.close(Outcome.RECOVERED),
    ]
    report.open(defer=defer)
    for i, step in enumerate(steps):
        if i == flush_after:
            report.flush()
        step()
    report.flush()
    return calls.log


@pytest.mark.parametrize("flush_after", range(6))
def test_deferred_opening_gives_the_observers_the_same_calls_in_order(flush_after: int) -> None:
    # The HTTP transport defers the first calls until its request is on its way; the
    # other reports flush first, so wherever the flush falls nothing moves or repeats.
    assert (
        _run(True, flush_after)
        == _run(False, flush_after)
        == [
            "turn_started",
            "attempt_started:a",
            "attempt_failed:a",
            "attempt_ended:a",
            "attempt_started:b",
            "attempt_ended:b",
            "turn_ended",
        ]
    )
