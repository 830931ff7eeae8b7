"""The retry pacer (core/admission/pacer.py) and the board's lines, with a fake clock.

The outcomes issue 22 asks of the pacing model, each checked here on the sans-IO
core (the benchmark, ``bench/recovery_bench.py``, measures them end to end):
a lone turn never waits on it; a dead upstream gets a bounded rate of retries
however many turns wait; a busy, partly failing one keeps up its retries; a line
is released on a ramp as soon as the upstream answers again.
"""

from __future__ import annotations

import random

from unbroken.core.admission.health import Breaker, HealthBoard, HealthSettings
from unbroken.core.admission.pacer import Pacer, PaceSettings
from unbroken.core.admission.policy import Failure, FailureClass, Park, RetryPolicy, RetryState

K = "r|http://a"
E503 = Failure(FailureClass.STATUS, "HTTP 503", status=503)


def test_a_lone_turn_retrying_every_delay_never_waits_on_its_pacer() -> None:
    b = HealthBoard(pace=RetryPolicy().pace_settings())
    state = RetryState(RetryPolicy(), 1, board=b, keys=[K])
    now = 0.0
    assert state.next_upstream(now) == 0
    for _ in range(1000):  # 1,000 503s in a row: each retry goes 250 ms after its failure
        now += 0.002  # the 503's round trip
        wait = state.record_failure(E503, now)
        assert wait == 0.25
        now += wait
        assert state.next_upstream(now) == 0
    assert b.pacer(K).waited_total == 0 and b.state(K, now) is Breaker.CLOSED


def test_a_dead_upstream_gets_at_most_the_floor_however_many_turns_wait() -> None:
    b = HealthBoard(HealthSettings(breakers=False), pace=PaceSettings(floor_per_s=4.0))
    states = [RetryState(RetryPolicy(), 1, board=b, keys=[K]) for _ in range(200)]
    sent = 0
    for s in states:
        s.next_upstream(0.0)
        s.record_failure(E503, 0.0)
    pending = list(states)
    t = 0.25
    while t <= 30.0:
        granted, _ = b.pump(K, t)
        still = []
        for s in pending:
            got = s.next_upstream(t)
            if isinstance(got, int):
                sent += 1
                s.record_failure(E503, t)
            still.append(s)
        pending = still
        assert granted is not None
        t = round(t + 0.05, 2)
    # 30 s of a dead upstream: the burst (10) and 4 a second, not 200 turns x 4 a second
    assert 10 + 4 * 29 <= sent <= 10 + 4 * 30 + 1


def test_a_busy_partly_failing_upstream_keeps_up_its_retries() -> None:
    """100 turns a second, 30 % of attempts failing: the mean wait before a retry stays
    within 1.2 x delay and none waits more than 1 s (the pacer adds no queueing)."""
    rng = random.Random(7)
    b = HealthBoard(pace=RetryPolicy().pace_settings())
    due: list[tuple[float, RetryState, float]] = []  # (retry due, turn, failed at)
    waits: list[float] = []
    line: list[tuple[RetryState, float]] = []
    t = 0.0

    def attempt(s: RetryState, now: float) -> None:
        if rng.random() < 0.3:
            s.record_failure(E503, now)
            due.append((now + 0.25, s, now))
        else:
            s.record_answer(now)
            b.success(K, now)

    for step in range(10_000):  # 10 s in 1 ms steps
        t = step / 1000
        if step % 10 == 0:  # a new turn every 10 ms
            s = RetryState(RetryPolicy(), 1, board=b, keys=[K])
            assert s.next_upstream(t) == 0
            attempt(s, t)
        b.pump(K, t)
        ready = [d for d in due if d[0] <= t]
        due = [d for d in due if d[0] > t]
        for _, s, failed_at in ready:
            line.append((s, failed_at))
        left = []
        for s, failed_at in line:
            if isinstance(s.next_upstream(t), int):
                waits.append(t - failed_at)
                attempt(s, t)
            else:
                left.append((s, failed_at))
        line = left
    assert len(waits) > 300
    assert sum(waits) / len(waits) <= 1.2 * 0.25 and max(waits) <= 1.0
    assert b.state(K, t) is Breaker.CLOSED  # 30 % is under the breaker's rate


def test_a_line_is_released_on_a_ramp_as_soon_as_the_upstream_answers() -> None:
    b = HealthBoard(HealthSettings(failures_to_open=1, open_s=1.0, max_open_s=1.0))
    b.failure(K, 0.0, "503")  # open until 1.0
    states = [RetryState(RetryPolicy(), 1, board=b, keys=[K]) for _ in range(200)]
    for s in states:
        s.current = 0  # each has failed once already: these are retries
        got = s.next_upstream(0.5)
        assert got == Park(1.0, "breaker", K)
    assert b.pump(K, 0.5) == ([], 1.0)  # open: nothing goes, the next look is at the reopen
    granted, due = b.pump(K, 1.0)  # half-open: the head of the line alone, the probe
    assert granted == [states[0].ticket] and due is None
    assert states[0].next_upstream(1.0) == 0
    assert b.pump(K, 1.1) == ([], None)  # the probe is out: nothing more
    b.answered(K, 1.2)  # the probe's headers: the upstream is known good
    assert b.state(K, 1.2) is Breaker.CLOSED
    times: dict[int, float] = {}
    t = 1.2
    while len(times) < 199 and t < 5.0:
        granted, due = b.pump(K, t)
        for ticket in granted:
            times[ticket] = t
        if due is None:
            break
        t = due
    assert len(times) == 199
    at_once = sum(1 for v in times.values() if v == 1.2)
    assert at_once <= 12  # the bucket's burst, not all 199 in the same millisecond
    assert max(times.values()) - 1.2 <= 1.0  # all through within a second
    ordered = [times[s.ticket] for s in states[1:]]
    assert ordered == sorted(ordered)  # oldest first


def test_a_failure_ends_the_ramp_and_the_floor_resumes() -> None:
    p = Pacer(K, PaceSettings(floor_per_s=4.0, burst=1.0))
    for ticket in range(1, 51):
        p.admit(ticket, 0.0)
    assert len(p.queue) == 49
    p.success(0.0)
    assert p.ramping
    granted, _ = p.pump(0.3, blocked_until=0.0)
    assert len(granted) >= 10
    p.failure(0.3)
    assert not p.ramping
    later, due = p.pump(0.31)
    assert later == [] and due is not None and due >= 0.3 + 0.2


def test_a_granted_turn_that_goes_away_gives_its_token_back() -> None:
    p = Pacer(K, PaceSettings(burst=1.0))
    assert p.admit(1, 0.0)
    assert not p.admit(2, 0.0)
    granted, _ = p.pump(0.25)
    assert granted == [2] and p.tokens < 1.0
    p.withdraw(2)
    assert p.tokens >= 1.0 and not p.granted


def test_a_fleet_splits_the_floor_among_the_relays_with_turns_waiting() -> None:
    p = Pacer(K, PaceSettings(floor_per_s=4.0))
    p.share = 2
    assert p.view(0.0)["floor_per_s"] == 2.0


def test_a_retry_that_finds_the_probe_taken_elsewhere_and_goes_on_leaves_no_place_behind() -> None:
    keys = ["r|http://a", "r|http://b"]
    b = HealthBoard(
        HealthSettings(failures_to_open=1, open_s=1.0, max_open_s=1.0),
        probe_gate=lambda key, ttl: False,  # another instance of the fleet probes
    )
    b.failure(keys[0], 0.0, "503")  # a's breaker: half-open at 1.0
    b.pacer(keys[0])  # a has had retries before
    state = RetryState(RetryPolicy(), 2, board=b, keys=keys)
    state.current = 1  # a retry: the rotation starts at a
    assert state.next_upstream(1.5) == 1  # a's probe is not ours: b takes the retry
    assert not b.pacer(keys[0]).queue and not b.pacer(keys[0]).granted


def test_continuations_of_cut_responses_take_their_pacers_go_on_their_own_upstream() -> None:
    """`RetryState.next_resume` (issue 23): a continuation goes to the upstream that runs
    the response, never another, and spends that upstream's pacer token like a retry:
    200 turns cut at once on a dead upstream resume at the floor, not all at once."""
    b = HealthBoard(HealthSettings(breakers=False), pace=PaceSettings(floor_per_s=4.0))
    keys = [K, "r|http://b"]
    states = [RetryState(RetryPolicy(), 2, board=b, keys=keys) for _ in range(200)]
    for s in states:
        assert s.next_upstream(0.0) == 0
        s.record_failure(E503, 0.0)  # the upstream fails: its pacer falls to the floor
    sent = 0
    t = 0.25
    while t <= 10.0:
        b.pump(K, t)
        for s in states:
            got = s.next_resume(t)
            if isinstance(got, int):
                assert got == 0  # the response lives there: never rerouted
                sent += 1
                b.pace_failure(K, t)
            else:
                assert isinstance(got, Park) and got.why == "pacer"
        t = round(t + 0.05, 2)
    assert 10 + 4 * 9 <= sent <= 10 + 4 * 10 + 1, sent
