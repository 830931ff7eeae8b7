"""The breaker's failure window (core/admission/health.py), over random sequences of attempts.

Two single tests checked it before (old failures leave the window; a closing breaker
forgets the outage's failures).  Here a model counts every attempt, each in its
bucket (``window_s / BUCKETS`` wide), and the board's window must agree after every
event: the attempts of the last ``BUCKETS`` buckets, none from before the breaker
last closed (a probe that passes empties it), none twice.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.core.admission.health import BUCKETS, Breaker, Change, HealthBoard, HealthSettings

K = "r|http://a"

EVENTS = st.lists(
    st.tuples(st.sampled_from(["ok", "fail", "look"]), st.floats(0.0, 4.0)), max_size=150
)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.sampled_from([1.0, 10.0, 30.0]), st.booleans())
def test_the_window_holds_the_attempts_of_its_buckets_since_the_last_close(
    events: list[tuple[str, float]], window_s: float, breakers: bool
) -> None:
    b = HealthBoard(
        HealthSettings(
            breakers=breakers,
            window_s=window_s,
            failures_to_open=3,
            min_window_attempts=5,
            failure_rate_to_open=0.5,
            open_s=0.5,
            max_open_s=2.0,
        )
    )
    closes: list[Change] = []
    b.listeners.append(lambda c: closes.append(c) if c.kind == "close" else None)
    width = window_s / BUCKETS
    model: list[tuple[int, int]] = []  # (bucket, 0 ok | 1 failed), since the last close
    now = 0.0
    for kind, dt in events:
        now += dt
        before = len(closes)
        if kind == "ok":
            model.append((int(now // width), 0))
            b.success(K, now)
        elif kind == "fail":
            model.append((int(now // width), 1))
            b.failure(K, now, "503")
        else:
            b.state(K, now)  # a look: may turn an open breaker half-open
        if len(closes) > before:  # a probe passed: the outage's attempts are forgotten
            assert breakers
            model.clear()
        current = int(now // width)
        inside = [slot for bucket, slot in model if bucket > current - BUCKETS]
        want = (inside.count(0), inside.count(1))
        assert b.get(K).window(now, window_s) == want
        assert len(b.get(K).buckets) <= BUCKETS + 1
    if not breakers:
        assert b.state(K, now) is Breaker.CLOSED and not closes
