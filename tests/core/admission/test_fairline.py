"""A rate limiter's fair line (core/admission/fairline.py): round robin across
sessions, first come first served within one, and since when each ticket waits."""

from __future__ import annotations

from unbroken.core.admission.fairline import FairLine


def test_the_line_is_round_robin_across_sessions_fifo_within_one() -> None:
    line = FairLine()
    for t in (1, 2, 3, 4):
        line.add(t, "busy", 1.0)
    line.add(5, "a", 1.0)
    line.add(6, "b", 1.0)
    line.add(7, "a", 1.0)
    assert list(line) == [1, 5, 6, 2, 7, 3, 4]
    got = [line.pop_head() for _ in range(7)]
    assert got == [1, 5, 6, 2, 7, 3, 4] and len(line) == 0
    line.add(8, "x", 1.0)
    line.add(9, "x", 1.0)
    line.remove(8)
    assert line.head() == 9 and line.sessions() == 1


def test_a_line_says_how_long_its_oldest_ticket_has_waited() -> None:
    line = FairLine()
    assert line.waited(5.0) == 0.0  # nobody in line
    line.add(1, "a", 1.0, 2.0)
    line.add(2, "b", 1.0, 3.0)
    assert line.waited(5.0) == 3.0  # ticket 1, since 2.0
    line.remove(1)
    assert line.waited(5.0) == 2.0
