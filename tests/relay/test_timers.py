"""`relay.watchdog.LoopDeadlines`: the turns' deadlines on one event-loop timer run as
``loop.call_at`` would run them (time order, none early, cancellation, context,
errors), and cancelled ones do not pile up."""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any

import pytest

from unbroken.relay.watchdog import LoopDeadlines, Watchdog

_VAR: contextvars.ContextVar[str] = contextvars.ContextVar("timers_test", default="none")


async def test_due_deadlines_run_in_time_order_then_arming_order() -> None:
    loop = asyncio.get_running_loop()
    timers = LoopDeadlines(loop)
    ran: list[tuple[str, float]] = []
    done = loop.create_future()
    now = loop.time()

    def at(name: str, when: float) -> None:
        def cb() -> None:
            ran.append((name, loop.time()))
            if name == "last":
                done.set_result(None)

        timers.call_at(when, cb)

    at("last", now + 0.05)
    at("b", now + 0.02)
    at("a", now + 0.01)
    at("b2", now + 0.02)  # the same time as "b": after it, as armed
    await asyncio.wait_for(done, 5)
    assert [n for n, _ in ran] == ["a", "b", "b2", "last"]
    when = {"a": now + 0.01, "b": now + 0.02, "b2": now + 0.02, "last": now + 0.05}
    resolution = time.get_clock_info("monotonic").resolution
    for name, t in ran:  # none ran before its time
        assert t + resolution >= when[name], name
    assert len(timers) == 0


async def test_a_cancelled_deadline_never_runs_and_later_ones_still_do() -> None:
    loop = asyncio.get_running_loop()
    timers = LoopDeadlines(loop)
    ran: list[str] = []
    done = loop.create_future()
    now = loop.time()
    head = timers.call_at(now + 0.01, lambda: ran.append("cancelled"))

    def kept() -> None:
        ran.append("kept")
        done.set_result(None)

    timers.call_at(now + 0.02, kept)
    timers.cancel(head)
    timers.cancel(head)  # twice: nothing more
    assert len(timers) == 1
    await asyncio.wait_for(done, 5)
    assert ran == ["kept"]


async def test_an_earlier_deadline_rearms_the_loop_timer() -> None:
    loop = asyncio.get_running_loop()
    timers = LoopDeadlines(loop)
    now = loop.time()
    late = timers.call_at(now + 3600, lambda: None)
    done = loop.create_future()
    timers.call_at(now + 0.01, lambda: done.set_result(loop.time()))
    fired_at = await asyncio.wait_for(done, 5)
    assert fired_at < now + 1
    timers.cancel(late)


async def test_callbacks_run_in_their_context_and_errors_go_to_the_loop() -> None:
    loop = asyncio.get_running_loop()
    timers = LoopDeadlines(loop)
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        token = _VAR.set("the turn's")
        ctx = contextvars.copy_context()
        _VAR.reset(token)
        seen: list[str] = []
        done = loop.create_future()
        now = loop.time()

        def boom() -> None:
            raise ValueError("boom")

        timers.call_at(now + 0.01, boom)
        timers.call_at(now + 0.01, lambda: seen.append(_VAR.get()), ctx)

        def last() -> None:
            seen.append(_VAR.get())
            done.set_result(None)

        timers.call_at(now + 0.02, last)
        await asyncio.wait_for(done, 5)
        assert seen == ["the turn's", "none"]
        assert len(errors) == 1 and isinstance(errors[0]["exception"], ValueError)
    finally:
        loop.set_exception_handler(None)


async def test_cancelled_deadlines_do_not_pile_up() -> None:
    """Thousands of turns whose deadlines are cancelled long before they are due (every
    short turn's) leave a heap the size of what is live, not of what was armed."""
    loop = asyncio.get_running_loop()
    timers = LoopDeadlines(loop)
    now = loop.time()
    live = [timers.call_at(now + 3600 + i, lambda: None) for i in range(10)]
    for i in range(10_000):
        timers.cancel(timers.call_at(now + 60 + i * 1e-3, lambda: None))
    assert len(timers) == 10
    assert len(timers._heap) <= 2 * 65 + 10
    for entry in live:
        timers.cancel(entry)


async def test_the_relay_keeps_one_per_loop() -> None:
    from unbroken.config import parse_config
    from unbroken.relay.relay_state import RelayState

    relay = RelayState(
        parse_config({"routes": {"r": {"upstreams": [{"url": "http://127.0.0.1:9"}]}}})
    )
    loop = asyncio.get_running_loop()
    assert relay.deadlines(loop) is relay.deadlines(loop)
    other = asyncio.new_event_loop()
    try:
        assert relay.deadlines(other) is not relay.deadlines(loop)
    finally:
        other.close()
    await relay.close()


async def test_a_deadline_armed_by_a_callback_runs() -> None:
    loop = asyncio.get_running_loop()
    timers = LoopDeadlines(loop)
    done = loop.create_future()
    now = loop.time()
    timers.call_at(now + 0.01, lambda: timers.call_at(loop.time(), lambda: done.set_result(1)))
    assert await asyncio.wait_for(done, 5) == 1


@pytest.mark.parametrize("n", [1, 3])
async def test_watchdogs_share_one_loop_timer(n: int) -> None:
    """Watchdogs on one `LoopDeadlines` arm no TimerHandle of their own (counted in the
    loop's scheduled handles)."""
    loop = asyncio.get_running_loop()
    deadlines = LoopDeadlines(loop)

    class _Machine:
        def deadline(self) -> float:
            return loop.time() + 60

    before = len(loop._scheduled)  # type: ignore[attr-defined]
    dogs = [Watchdog(loop, _Machine(), lambda a: None, 15.0, deadlines) for _ in range(n)]  # type: ignore[arg-type]
    for dog in dogs:
        dog.arm()
    assert len(loop._scheduled) <= before + 1  # type: ignore[attr-defined]
    for dog in dogs:
        dog.close()


async def test_the_loop_clock_is_monotonic_itself_only_for_asyncio_s_own_time() -> None:
    """`loop_clock`: asyncio's ``loop.time`` returns ``time.monotonic()``, so the relay
    reads that directly (no Python call); a loop with a clock of its own keeps it."""
    from unbroken.relay.watchdog import loop_clock

    loop = asyncio.get_running_loop()
    assert type(loop).time is asyncio.BaseEventLoop.time
    assert loop_clock(loop) is time.monotonic and LoopDeadlines(loop).time is time.monotonic
    before = loop.time()
    assert before <= loop_clock(loop)() <= loop.time()

    class Shifted(asyncio.SelectorEventLoop):
        def time(self) -> float:
            return 1000.0 + super().time()

    other = Shifted()
    try:
        clock = loop_clock(other)
        assert clock is not time.monotonic and clock() >= 1000.0
    finally:
        other.close()
