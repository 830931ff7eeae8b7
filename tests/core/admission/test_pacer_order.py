"""The pacer's line keeps its order (core/admission/pacer.py), over random sequences of events.

The ramp test in test_pacer.py checked "oldest first" on one release; this drives a
pacer with random arrivals, asks again, pumps (open, half-open, closed), successes,
failures, withdrawals and requeues, against a model of the line: a deque.  Whatever
happens, a ticket leaves the line only from its head (a grant, or an `admit` that
finds a token), the line is the model's, and every grant is claimed once.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.core.admission.pacer import GRANT_TTL_S, Pacer, PaceSettings

K = "r|http://a"

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.floats(0.0, 0.5)),
        st.tuples(st.just("ask"), st.integers(0, 50)),
        st.tuples(st.just("claim"), st.integers(0, 50)),
        st.tuples(
            st.just("pump"),
            st.floats(0.0, 1.0),
            st.sampled_from(["closed", "open", "half_open_free", "half_open_busy"]),
        ),
        st.tuples(st.just("success"), st.floats(0.0, 0.3)),
        st.tuples(st.just("failure"), st.floats(0.0, 0.3)),
        st.tuples(st.just("withdraw"), st.integers(0, 50)),
        st.tuples(st.just("requeue"), st.integers(0, 50)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    OPS,
    st.floats(0.5, 10.0),  # floor_per_s
    st.sampled_from([1.0, 2.0, 10.0]),  # burst
)
def test_tickets_leave_the_line_oldest_first_whatever_happens(
    ops: list[tuple[Any, ...]], floor: float, burst: float
) -> None:
    p = Pacer(K, PaceSettings(floor_per_s=floor, burst=burst, ramp_s=0.1))
    line: deque[int] = deque()  # the model: who waits, oldest first
    granted: dict[int, float] = {}  # granted by a pump, not yet claimed: when
    now = 0.0
    next_ticket = 1
    for op in ops:
        kind = op[0]
        if kind == "join":  # a new retry arrives, after a pause
            now += float(op[1])
            ticket, next_ticket = next_ticket, next_ticket + 1
            went = p.admit(ticket, now)
            if went:
                assert not line, "a newcomer went ahead of the line"
            else:
                line.append(ticket)
        elif kind == "ask" and line:  # a waiting retry asks again
            ticket = line[int(op[1]) % len(line)]
            went = p.admit(ticket, now)
            if went:
                assert ticket == line[0], f"{ticket} went ahead of {line[0]}"
                line.popleft()
        elif kind == "claim" and granted:  # a granted retry comes for its token
            ticket = sorted(granted)[int(op[1]) % len(granted)]
            del granted[ticket]
            assert p.admit(ticket, now), "a granted ticket was refused"
        elif kind == "pump":
            now += float(op[1])
            mode = op[2]
            out, _ = p.pump(
                now,
                blocked_until=now + 1.0 if mode == "open" else 0.0,
                probe=None if mode in ("closed", "open") else mode == "half_open_free",
            )
            # expired grants went back to the bucket: their turns must ask again
            for ticket in [t for t, when in granted.items() if now - when > GRANT_TTL_S]:
                del granted[ticket]
            assert out == list(line)[: len(out)], "a pump granted out of order"
            for ticket in out:
                line.popleft()
                granted[ticket] = now
            if mode == "open" or mode == "half_open_busy":
                assert out == []
            if mode == "half_open_free":
                assert len(out) <= 1  # the probe: the head alone
        elif kind == "success":
            now += float(op[1])
            p.success(now)
        elif kind == "failure":
            now += float(op[1])
            p.failure(now)
        elif kind == "withdraw" and line:
            ticket = line[int(op[1]) % len(line)]
            p.withdraw(ticket)
            line.remove(ticket)
        elif kind == "requeue" and granted:  # a granted probe could not go: back to the head
            ticket = sorted(granted)[int(op[1]) % len(granted)]
            del granted[ticket]
            p.requeue(ticket)
            line.appendleft(ticket)
        assert list(p.queue) == list(line)
        assert set(p.granted) == set(granted)
