"""`_HttpTurn._prepare`: of two calls at once (the turn's first write and its early
headers), one sends the headers and the other waits for it, then finds them sent;
a waiter that is cancelled leaves the first one's result alone."""

from __future__ import annotations

import asyncio
from typing import Any

from unbroken.relay.http import CleanStream, _HttpTurn


class _Slow(CleanStream):
    def __init__(self, gate: asyncio.Event, log: list[str], name: str) -> None:
        super().__init__()
        self.gate, self.log, self.name = gate, log, name

    async def prepare(self, request: Any) -> Any:
        self.log.append(self.name)
        await self.gate.wait()
        return None


class _Machine:
    def __init__(self) -> None:
        self.sent: list[float] = []

    def headers_sent(self, now: float) -> None:
        self.sent.append(now)


class _Dog:
    def arm(self) -> None:
        pass


def _turn() -> _HttpTurn:
    turn = _HttpTurn.__new__(_HttpTurn)
    turn.loop = asyncio.get_running_loop()
    turn.time = turn.loop.time
    turn.request = None  # type: ignore[assignment]
    turn.response = None
    turn.machine = _Machine()  # type: ignore[assignment]
    turn.watchdog = _Dog()  # type: ignore[assignment]
    turn._preparing = False
    turn._prepared = None
    return turn


async def _until(cond: Any) -> None:
    """Let the other tasks run until ``cond`` holds (a few loop passes, no time)."""
    for _ in range(100):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


async def test_two_prepares_at_once_send_one_response() -> None:
    gate, log = asyncio.Event(), list[str]()
    turn = _turn()
    first, second = _Slow(gate, log, "first"), _Slow(gate, log, "second")
    a = asyncio.ensure_future(turn._prepare(first))
    await _until(lambda: log == ["first"])
    b = asyncio.ensure_future(turn._prepare(second))
    await _until(lambda: turn._prepared is not None)  # the second one waits
    gate.set()
    assert await a is True
    assert await b is False
    assert turn.response is first
    assert log == ["first"]  # the second response was never prepared
    assert len(turn.machine.sent) == 1  # type: ignore[attr-defined]


async def test_a_cancelled_waiter_does_not_disturb_the_first() -> None:
    gate, log = asyncio.Event(), list[str]()
    turn = _turn()
    first = _Slow(gate, log, "first")
    a = asyncio.ensure_future(turn._prepare(first))
    await _until(lambda: log == ["first"])
    b = asyncio.ensure_future(turn._prepare(_Slow(gate, log, "second")))
    await _until(lambda: turn._prepared is not None)
    b.cancel()
    await asyncio.gather(b, return_exceptions=True)
    gate.set()
    assert await a is True
    assert turn.response is first
    assert not turn._preparing and turn._prepared is None
    assert await turn._prepare(_Slow(gate, log, "third")) is False  # sent already


async def test_a_failed_prepare_lets_the_waiter_try() -> None:
    turn = _turn()
    log: list[str] = []
    gate = asyncio.Event()

    class _Gone(CleanStream):
        async def prepare(self, request: Any) -> Any:
            log.append("gone")
            await gate.wait()
            raise ConnectionResetError()

    a = asyncio.ensure_future(turn._prepare(_Gone()))
    await _until(lambda: log == ["gone"])
    second = _Slow(asyncio.Event(), log, "second")
    second.gate.set()
    b = asyncio.ensure_future(turn._prepare(second))
    await _until(lambda: turn._prepared is not None)
    gate.set()
    results = await asyncio.gather(a, b, return_exceptions=True)
    assert type(results[0]).__name__ == "ClientGone"
    assert results[1] is True and turn.response is second
