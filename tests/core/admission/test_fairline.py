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


def test_a_ticket_back_in_line_keeps_its_time_and_the_order() -> None:
    """One a cool-off held out of the line comes back with the time it first waited
    (`RetryState._rate_since`): the oldest is still the first, and its bound counts."""
    line = FairLine()
    line.add(2, "b", 1.0, 5.0)
    line.add(3, "c", 1.0, 7.0)
    line.add(1, "a", 1.0, 0.0)  # back from a cool-off: it first waited at 0 s
    assert line.oldest() == (1, 0.0) and list(line.since) == [1, 2, 3]
    assert line.overdue(59.9, 60.0) is None and line.overdue(60.0, 60.0) == 1
    line.add(4, "d", 1.0, 9.0)  # a newcomer goes last, as always
    assert list(line.since) == [1, 2, 3, 4]


def test_a_ticket_back_in_line_is_served_in_its_place() -> None:
    """The rotation keeps the time too: one back from a cool-off is served before the
    turns that came while it was held out (before, it went to the back of the rotation:
    `shared` through one relay served agents' second turns before others' first, 0.91
    fairness at half the turns)."""
    line = FairLine()
    line.add(5, "e", 1.0, 1.1)  # a turn that came during the cool-off
    line.add(6, "f", 1.0, 1.2)
    line.add(2, "b", 1.0, 0.2)  # back from the cool-off, in the order they woke
    line.add(1, "a", 1.0, 0.1)
    line.add(7, "b", 1.0, 1.3)  # b's next ticket: after its first, as always
    line.add(3, "c", 1.0, 0.3)
    assert list(line) == [1, 2, 3, 5, 6, 7]
    assert [line.pop_head() for _ in range(6)] == [1, 2, 3, 5, 6, 7]


def test_a_ticket_back_in_line_goes_before_its_sessions_later_tickets() -> None:
    line = FairLine()
    line.add(4, "a", 1.0, 2.0)
    line.add(5, "b", 1.0, 3.0)
    line.add(1, "a", 1.0, 0.5)  # a's first ticket, back from a cool-off
    assert line.head() == 1 and list(line) == [1, 5, 4]
    assert list(line.since) == [1, 4, 5]


def test_a_retry_takes_its_place_by_when_its_turn_came_and_waits_its_own_bound() -> None:
    """A turn back to retry a request the provider refused goes in line by when it came
    (``place``), ahead of the turns that came since; its wait bound counts from when it
    began to wait again, not from its place (its first attempt's time in flight is no
    wait in line: it is not let go at once for it)."""
    line = FairLine()
    line.add(2, "b", 1.0, 5.0)
    line.add(3, "c", 1.0, 7.0)
    line.add(1, "a", 1.0, 50.0, place=0.5)  # came at 0.5, refused, waits again from 50
    assert list(line) == [1, 2, 3] and line.head() == 1
    assert line.oldest() == (1, 0.5) and line.waited(51.0) == 50.5  # the fleet's order
    assert line.deadline() == (2, 5.0)  # the bound that runs out first is ticket 2's
    assert line.overdue(64.9, 60.0) is None and line.overdue(65.0, 60.0) == 2
    line.remove(2)
    line.remove(3)
    assert line.deadline() == (1, 50.0)
    assert line.overdue(109.9, 60.0) is None and line.overdue(110.0, 60.0) == 1
    assert line.pop_head() == 1 and not line.waits and line.deadline() is None
    line.add(4, "d", 1.0, 3.0, place=3.0)  # a place no earlier than the wait: the same
    line.add(5, "e", 1.0, 2.0)  # back from a cool-off: its wait began first
    assert line.deadline() == (5, 2.0) and list(line.waits) == [5, 4] == list(line.since)
