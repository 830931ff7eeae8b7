"""The stall clock stands still while a write to the client blocks (core/turn/turn_clock.py),
over random sequences of reads, writes (nested too) and pauses.

One test checked it before (a write blocked 49 s is not upstream silence).  Here a
model counts the upstream's silence: the time since the last byte during which no
write was in progress.  After every event the machine's deadline must be where that
silence reaches ``idle_timeout_s`` (no deadline while a write blocks), `tick` must
abort the upstream exactly then and not a moment before.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnfix import TEXT, make, streaming
from unbroken.core.turn.machine import AbortUpstream

IDLE_S = 2.0

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pause"), st.floats(0.0, 3.0)),
        st.tuples(st.just("read")),
        st.tuples(st.just("write_started")),
        st.tuples(st.just("wrote")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_stall_is_due_when_the_silence_outside_writes_reaches_the_idle_timeout(
    ops: list[tuple[Any, ...]],
) -> None:
    m, _ = make(idle_timeout_s=IDLE_S, early_headers_s=10_000.0, keepalive_s=10_000.0)
    streaming(m, now=1.0)
    now = 1.0
    m.feed_chunk(now, TEXT)  # the first frame: the idle watch runs from here
    m.headers_sent(now)
    silence = 0.0  # the model: upstream silence since the last byte, writes excluded
    writing = 0
    for op in ops:
        kind = op[0]
        if kind == "pause":
            dt = float(op[1])
            if not writing:  # not past the stall: the test below drives that one
                dt = min(dt, IDLE_S - silence - 0.01)
                silence += max(dt, 0.0)
            now += max(dt, 0.0)
        elif kind == "read":
            m.feed_chunk(now, TEXT)
            silence = 0.0
        elif kind == "write_started":
            m.write_started(now)
            writing += 1
        elif kind == "wrote" and writing:
            m.wrote(now)
            writing -= 1
        due = m.deadline()
        if writing:
            assert due is None  # nothing runs while the relay writes
            assert m.tick(now + 1000.0) is None
        else:
            assert due == pytest.approx(now + IDLE_S - silence, abs=1e-6)
            assert m.tick(now) is None
    while writing:
        m.wrote(now)
        writing -= 1
    due = m.deadline()
    assert due is not None and due == pytest.approx(now + IDLE_S - silence, abs=1e-6)
    assert m.tick(due - 1e-3) is None
    assert isinstance(m.tick(due), AbortUpstream)
