"""A fleet's cold start on a key is one relay's (core/admission/ratelimit.py,
`RateBoard.cold_gate`, `Limiter.cold_answer`).

Issue 32's benchmark (docs/benchmarks.md): on a key whose budget is spent at the start,
two relays over Redis each let their ``cold_start`` (4) go before any answer: 8 of
`bare`'s 16 429s came in the first 10 ms, where one relay pays 4.  The store's gate
gives the cold start to the first relay that asks; a sibling starts at one request in
flight and widens by one for each answer, as any slow start.  The gate here is a plain
function: the sans-IO core's injection point, as the stores' is (`RateShare._cold_gate`).
"""

from __future__ import annotations

from unbroken.core.admission.rateboard import COLD_GATE_S, RateBoard
from unbroken.core.admission.ratelimit import RateSettings

K = "r|http://a"


def _board(answer: bool | None) -> tuple[RateBoard, list[tuple[str, str, float]]]:
    """A board whose gate answers ``answer`` (the store's, until `_store_knows`)."""
    board = RateBoard(RateSettings(cold_start=4))
    asked: list[tuple[str, str, float]] = []

    def gate(key: str, cred: str, ttl_s: float) -> bool | None:
        asked.append((key, cred, ttl_s))
        return getattr(board, "_test_answer", answer)

    board.cold_gate = gate
    return board, asked


def _store_knows(board: RateBoard, mine: bool) -> None:
    board._test_answer = mine  # type: ignore[attr-defined]


def _let_go(board: RateBoard, turns: int, now: float = 0.0) -> int:
    """How many of a crowd of ``turns`` go at once (they stay in flight)."""
    lim = board.get(K, "c")
    went = sum(1 for t in range(1, turns + 1) if lim.admit(t, f"s{t}", 0.0, now))
    granted, _ = board.pump(K, now)
    return went + len(granted)


def test_no_fleet_store_means_the_cold_start_is_the_relays_own() -> None:
    board = RateBoard(RateSettings(cold_start=4))
    assert _let_go(board, 10) == 4
    assert board.get(K, "c").cold == "own"


def test_the_relay_that_takes_the_gate_has_the_whole_cold_start() -> None:
    board, asked = _board(True)
    assert _let_go(board, 10) == 4
    assert board.get(K, "c").cold == "mine"
    assert asked == [(K, "c", COLD_GATE_S)]  # asked once, for the key and credential


def test_a_sibling_that_started_first_leaves_one_in_flight_then_a_slow_start() -> None:
    board, _ = _board(False)
    lim = board.get(K, "c")
    assert _let_go(board, 10) == 1
    assert lim.cold == "fleet's"
    assert lim.view(0.0)["cold_start"] == "fleet's"  # (/status)
    # each answer widens it by one, as the slow start does
    [seq] = list(lim.running)
    lim.accepted(seq, 0.1)
    lim.finish(seq, 0.1)
    granted, _ = board.pump(K, 0.1)
    assert len(granted) == 2


def test_while_the_store_is_asked_one_goes_then_the_cold_start_when_it_answers() -> None:
    board, asked = _board(None)
    lim = board.get(K, "c")
    assert _let_go(board, 10) == 1  # a lone agent's first request never waits
    assert lim.cold == "asking"
    # the store answered: it changed the key, and its line is pumped
    _store_knows(board, True)
    granted, _ = board.pump(K, 0.01)
    assert len(granted) == 3 and len(lim.running) == 4
    assert lim.cold == "mine" and asked[-1] == (K, "c", COLD_GATE_S)


def test_a_429_while_asking_keeps_the_halved_ramp() -> None:
    board, _ = _board(None)
    lim = board.get(K, "c")
    assert _let_go(board, 10) == 1
    [seq] = list(lim.running)
    lim.limited(seq, None, 0.0, 0.01)  # a spent key: the slow start halves
    lim.finish(seq, 0.01, ok=False)
    _store_knows(board, True)
    board.pump(K, 0.02)
    assert lim.cold == "mine"
    assert lim.ramp == 1.0  # not raised to the cold start after a refusal


def test_an_answered_limiter_is_never_asked() -> None:
    board, asked = _board(True)
    lim = board.get(K, "c")
    lim.cold_answer(None)  # (a limiter that already took its cold start)
    assert lim.cold == "mine" and len(asked) == 1
    board.get(K, "c")
    board.pump(K, 0.0)
    assert len(asked) == 1
