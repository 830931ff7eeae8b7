"""Upstream health (core/admission/health.py) and the policy around it, with a fake clock."""

from __future__ import annotations

import random
from collections import Counter

from unbroken.core.admission.health import (
    QUOTA_LOOK_AGAIN_S,
    AttemptAccounting,
    Breaker,
    Change,
    HealthBoard,
    HealthSettings,
)
from unbroken.core.admission.policy import (
    Failure,
    FailureClass,
    Park,
    RetryPolicy,
    RetryState,
    is_quota_body,
    rendezvous_order,
)

K = "r|http://a"
REFUSED = Failure(FailureClass.REFUSED, "refused")


def board(**kw: object) -> tuple[HealthBoard, list[Change]]:
    kw.setdefault("max_open_s", 60.0)  # these tests name open_s; the default caps it at 1 s
    b = HealthBoard(HealthSettings(**kw))  # type: ignore[arg-type]
    seen: list[Change] = []
    b.listeners.append(seen.append)
    return b, seen


def test_opens_after_consecutive_failures_and_blocks_until_open_s() -> None:
    b, seen = board(failures_to_open=5, open_s=2.0)
    for t in range(4):
        b.failure(K, float(t), "503")
    assert b.state(K, 4.0) is Breaker.CLOSED and b.blocked_until(K, 4.0) == 0.0
    b.failure(K, 4.0, "503")
    assert b.state(K, 4.0) is Breaker.OPEN
    assert b.blocked_until(K, 5.0) == 6.0
    assert [c.kind for c in seen] == ["open"]


def test_a_success_resets_the_consecutive_count() -> None:
    b, _ = board(failures_to_open=3, min_window_attempts=100)
    for t in range(10):
        b.failure(K, t, "stall")
        b.failure(K, t, "stall")
        b.success(K, t)
    assert b.state(K, 10.0) is Breaker.CLOSED


def test_opens_on_the_failure_rate_over_the_window() -> None:
    b, _ = board(failures_to_open=100, failure_rate_to_open=0.5, min_window_attempts=10)
    for i in range(12):  # 2 of 3 fail, never 100 in a row
        if i % 3 == 0:
            b.success(K, i * 0.1)
        else:
            b.failure(K, i * 0.1, "503")
    assert b.state(K, 1.2) is Breaker.OPEN


def test_old_failures_leave_the_window() -> None:
    b, _ = board(failures_to_open=100, window_s=10.0, min_window_attempts=4)
    for t in range(3):
        b.failure(K, float(t), "503")
    for t in range(3):
        b.success(K, 100.0 + t)
    b.failure(K, 103.0, "503")
    assert b.state(K, 103.0) is Breaker.CLOSED  # 1 of 4 in the window, not 4 of 7


def test_half_open_lets_exactly_one_probe_through_and_success_closes() -> None:
    b, seen = board(failures_to_open=1, open_s=2.0, probe_timeout_s=30.0)
    b.failure(K, 0.0, "connection_refused")
    assert not b.take(K, 1.0) or b.blocked_until(K, 1.0) > 1.0
    assert b.blocked_until(K, 2.0) == 0.0 and b.state(K, 2.0) is Breaker.HALF_OPEN
    assert b.take(K, 2.0) is True  # the probe
    assert b.blocked_until(K, 2.1) == 32.0  # everyone else waits for the probe
    assert b.take(K, 2.1) is False
    b.success(K, 2.5)
    assert b.state(K, 2.5) is Breaker.CLOSED and b.take(K, 2.5)
    assert [c.kind for c in seen] == ["open", "half_open", "close"]


def test_a_failed_probe_reopens_for_twice_as_long_up_to_max_open_s() -> None:
    b, seen = board(failures_to_open=1, open_s=2.0, max_open_s=10.0)
    b.failure(K, 0.0, "503")
    now, lengths = 0.0, []
    for _ in range(5):
        now = b.records[K].open_until
        assert b.take(K, now)
        b.failure(K, now, "503")
        lengths.append(b.records[K].open_until - now)
    assert lengths == [4.0, 8.0, 10.0, 10.0, 10.0]
    b.success(K, b.records[K].open_until)
    b.failure(K, 100.0, "503")
    assert b.records[K].open_until - 100.0 == 2.0  # closed resets the doubling
    assert [c.kind for c in seen].count("open") == 7


def test_an_unreported_probe_frees_its_slot_after_probe_timeout_s() -> None:
    b, _ = board(failures_to_open=1, open_s=1.0, probe_timeout_s=5.0)
    b.failure(K, 0.0, "stall")
    assert b.take(K, 1.0)
    assert not b.take(K, 5.9)
    assert b.take(K, 6.0)


def test_a_repeated_failure_of_one_turn_counts_once() -> None:
    b, _ = board(failures_to_open=2)
    state = RetryState(RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K])
    for t in range(10):
        assert state.next_upstream(float(t)) == 0
        state.record_failure(Failure(FailureClass.STATUS, "HTTP 500", status=500), float(t))
    assert b.state(K, 10.0) is Breaker.CLOSED and b.records[K].consecutive_failures == 1


def test_4xx_answers_never_count() -> None:
    b, _ = board(failures_to_open=1)
    for n in range(5):
        state = RetryState(RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K])
        state.next_upstream(float(n))
        state.record_failure(Failure(FailureClass.STATUS, "HTTP 429", status=429), float(n))
    assert b.state(K, 5.0) is Breaker.CLOSED


def test_probe_gate_pending_then_lost() -> None:
    answers: list[bool | None] = [None, False]
    b = HealthBoard(
        HealthSettings(failures_to_open=1, open_s=1.0), probe_gate=lambda key, ttl: answers.pop(0)
    )
    b.failure(K, 0.0, "503")
    assert b.take(K, 1.0) is False  # the fleet has not answered
    assert b.blocked_until(K, 1.0) == 1.05
    assert b.take(K, 1.05) is False  # another instance probes
    # it gives the lease back when it has no probe out: look again in max_open_s, not
    # when its lease (probe_timeout_s) runs out (issue 36)
    assert b.blocked_until(K, 1.1) == 1.05 + b.settings.max_open_s


def test_remote_changes_apply_and_are_marked_remote() -> None:
    b, seen = board()
    b.apply(Change(K, "cooloff", 5.0, "retry_after"), 10.0)
    assert b.blocked_until(K, 12.0) == 15.0
    b.apply(Change(K, "open", 3.0, "fleet", 1), 12.0)
    assert b.state(K, 12.0) is Breaker.OPEN and b.records[K].reopens == 1
    b.apply(Change(K, "close"), 13.0)
    assert b.state(K, 13.0) is Breaker.CLOSED
    assert all(c.remote for c in seen) and [c.kind for c in seen] == ["cooloff", "open", "close"]


# -- the policy around it ------------------------------------------------------------------
KEYS = ["r|http://a", "r|http://b", "r|http://c"]


def test_every_upstream_open_parks_until_the_earliest_reopen() -> None:
    b, _ = board(failures_to_open=1, open_s=2.0)
    b.failure(KEYS[0], 0.0, "503")
    b.failure(KEYS[1], 1.0, "503")
    state = RetryState(RetryPolicy(), 2, rng=random.Random(0), board=b, keys=KEYS[:2])
    park = state.next_upstream(1.5)
    assert park == Park(2.0, "breaker", KEYS[0]) and state.attempts == 0
    assert state.next_upstream(2.0) == 0  # the half-open probe


def test_an_open_upstream_is_skipped_while_another_is_healthy() -> None:
    b, _ = board(failures_to_open=1, open_s=60.0)
    b.failure(KEYS[0], 0.0, "connection_refused")
    for t in range(100):
        state = RetryState(RetryPolicy(), 2, rng=random.Random(0), board=b, keys=KEYS[:2])
        assert state.next_upstream(float(t) / 10) == 1
        assert state.why == "breaker_skip"


def test_quota_cools_off_for_a_minute_at_most_and_reroutes() -> None:
    b, seen = board()
    state = RetryState(
        RetryPolicy(), 2, rng=random.Random(0), board=b, keys=KEYS[:2], quota_cooloff_s=3600.0
    )
    assert state.next_upstream(0.0) == 0
    wait = state.record_failure(Failure(FailureClass.STATUS, "HTTP 402", status=402), 0.0)
    assert wait == 0.0 and not state.quota_wall
    # looked at again within a minute, whatever quota_cooloff_s says (issue 36)
    assert b.blocked_until(KEYS[0], 0.0) == QUOTA_LOOK_AGAIN_S and seen[-1].reason == "quota"
    assert state.next_upstream(0.0) == 1
    state.record_failure(Failure(FailureClass.STATUS, "quota: insufficient_quota", status=429), 1)
    assert state.quota_wall  # no upstream left: the turn ends with the provider's answer


def test_quota_bodies_are_recognised() -> None:
    assert is_quota_body(b'{"error": {"code": "insufficient_quota"}}')
    assert is_quota_body(b'{"error": {"message": "Your credit balance is too low"}}')
    assert not is_quota_body(b'{"error": {"message": "Rate limit reached"}}')
    assert not is_quota_body(b'{"error": {"message": "billing service busy, retry"}}')
    assert is_quota_body(b'{"error": {"code": "billing_hard_limit_reached"}}')


def test_the_default_backoff_is_fixed_and_exponential_has_full_jitter() -> None:
    assert RetryPolicy().backoff == "fixed"
    assert RetryPolicy().base_delay(40, random.Random(0)) == 0.25
    policy = RetryPolicy(backoff="exponential")
    assert policy.delay_ms == 250
    rng = random.Random(1)
    waits = [policy.base_delay(10, rng) for _ in range(200)]
    assert max(waits) <= 30.0 and min(waits) < 5.0 and len(set(waits)) == 200


def test_sticky_sessions_keep_their_upstream_and_spread() -> None:
    b, _ = board(failures_to_open=1, open_s=60.0)
    picks: Counter[int] = Counter()
    for i in range(300):
        state = RetryState(RetryPolicy(), 3, board=b, keys=KEYS, sticky=f"session-{i}")
        pick = state.next_upstream(0.0)
        assert isinstance(pick, int)  # not parked: the board has all three open for it
        picks[pick] += 1
    assert min(picks.values()) > 60  # spread over all three
    same = {
        RetryState(RetryPolicy(), 3, board=b, keys=KEYS, sticky="s").next_upstream(0.0)
        for _ in range(20)
    }
    assert len(same) == 1


def test_rendezvous_moves_only_the_sessions_of_a_dead_upstream() -> None:
    sessions = [f"s{i}" for i in range(500)]
    before = {s: rendezvous_order(s, KEYS)[0] for s in sessions}
    b, _ = board(failures_to_open=1, open_s=60.0)
    b.failure(KEYS[1], 0.0, "connection_refused")
    for s in sessions:
        got = RetryState(RetryPolicy(), 3, board=b, keys=KEYS, sticky=s).next_upstream(1.0)
        if before[s] != 1:
            assert got == before[s]
        else:
            assert got != 1


def test_retries_beyond_the_pacers_burst_wait_in_line_first_attempts_never() -> None:
    b, _ = board()
    states = [RetryState(RetryPolicy(), 1, board=b, keys=[K]) for _ in range(50)]
    assert all(s.next_upstream(0.0) == 0 for s in states)  # first attempts: never paced
    got = [s.next_upstream(0.0) for s in states]
    assert sum(1 for g in got if isinstance(g, int)) == 10  # the burst
    assert all(g == Park(1.0, "pacer", K) for g in got if not isinstance(g, int))  # a look
    # again after park_check_s at the latest (they are woken when granted)
    assert len(b.pacer(K).queue) == 40
    # asking again keeps the place in line; the floor (4/s) lets the head go after 0.25 s
    waiting = [s for s, g in zip(states, got, strict=True) if not isinstance(g, int)]
    assert [s.next_upstream(0.25) for s in waiting[1:3]] == [Park(1.25, "pacer", K)] * 2
    assert waiting[0].next_upstream(0.25) == 0
    assert len(b.pacer(K).queue) == 39 and b.pacer(K).waited_total == 40
    for s in waiting[1:]:
        s.close()  # the turns went away: they leave the line
    assert not b.pacer(K).queue


# -- the turn machine parks -----------------------------------------------------------------
def test_the_machine_parks_until_the_reopen_and_sends_nothing_meanwhile() -> None:
    from turnfix import Report, Timers
    from unbroken.core.turn.ledger import Hold
    from unbroken.core.turn.machine import Open, TurnMachine, TurnState, Wait
    from unbroken.core.wire.protocols import CHAT

    states: list[TurnState] = []

    class Recording(Report):
        def state(self, state: TurnState) -> None:
            states.append(state)

    b, _ = board(failures_to_open=1, open_s=3.0, park_check_s=1.0)
    b.failure(K, 0.0, "503")
    retry = RetryState(RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K])
    report = Recording()
    m = TurnMachine(
        protocol=CHAT,
        hold=Hold(),
        timers=Timers(),
        retry=retry,
        stream=True,
        now=0.5,
        report=report,
    )
    # parked in the upstream's line (woken by its pacer), looking again every park_check_s
    assert m.start(0.5) == Wait(1.0, K, 1)
    assert states == [TurnState.PARKED] and not report.of("started")
    assert report.of("parked") == [("parked", "breaker")]  # /status says what it waits for
    assert m.next_attempt(1.5) == Wait(1.0, K, 1)
    assert m.next_attempt(2.5) == Wait(0.5, K, 1)  # the reopen is nearer than park_check_s
    assert m.next_attempt(3.0) == Open(0, 120.0)  # the half-open probe
    assert report.of("started") == [("started", 1, 0)] and retry.attempts == 1


def test_a_probe_answered_with_a_429_closes_the_breaker() -> None:
    b, _ = board(failures_to_open=1, open_s=1.0)
    b.failure(K, 0.0, "503")
    state = RetryState(RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K])
    assert state.next_upstream(1.0) == 0  # the probe
    state.record_failure(Failure(FailureClass.STATUS, "HTTP 429", status=429), 1.1)
    assert b.state(K, 1.1) is Breaker.CLOSED  # it answered: up, if busy


def test_the_fleets_window_opens_a_closed_breaker() -> None:
    b, seen = board(min_window_attempts=10, failure_rate_to_open=0.5)
    b.fleet_window(K, ok=1, failed=5, now=0.0)  # too few attempts to tell
    assert b.state(K, 0.0) is Breaker.CLOSED
    b.fleet_window(K, ok=4, failed=8, now=1.0)
    assert b.state(K, 1.0) is Breaker.OPEN and seen[-1].reason.startswith("fleet failure rate")


def test_the_window_keeps_a_bounded_number_of_buckets() -> None:
    b, _ = board(window_s=10.0)
    for t in range(10_000):  # a day of successes, never a failure or a view
        b.success(K, float(t))
    assert len(b.records[K].buckets) <= 11


def test_a_closed_breaker_is_not_reopened_by_the_outages_own_failures() -> None:
    """Found by bench/recovery_bench.py: two relays sharing Redis took up to 25 s to
    recover from a 1 s outage.  A probe closed the breaker, and the next read of the
    fleet's window (still holding the outage's failures) opened it again at once; so
    did the first failure after recovery on the local window.  Once a probe passed,
    the failures before it are history."""
    b, seen = board(failures_to_open=1, min_window_attempts=10, open_s=0.25)
    for t in range(20):
        b.failure(K, t / 100, "503", count=True)  # the outage: 20 failures in the window
    b.answered(K, 1.0)  # a probe got through: closed
    assert b.state(K, 1.0) is Breaker.CLOSED
    b.fleet_window(K, ok=2, failed=40, now=2.0)  # the fleet's window: the outage
    assert b.state(K, 2.0) is Breaker.CLOSED
    for t in range(9):  # a few ordinary attempts, one of them failing
        b.success(K, 2.0 + t / 10)
    b.failure(K, 3.0, "503")
    assert b.state(K, 3.0) is Breaker.CLOSED, seen[-1]
    b.fleet_window(K, ok=2, failed=40, now=40.0)  # a new outage, a window later: it counts
    assert b.state(K, 40.0) is Breaker.OPEN


# -- AttemptAccounting: what each attempt's end counts --------------------------------------
def test_accounting_counts_an_answer_as_a_success_for_board_and_fleet() -> None:
    b, _ = board()
    acc = AttemptAccounting(b)
    b.failure("k", 0.0, "reset")
    assert b.get("k").consecutive_failures == 1
    assert acc.attempt_ended(1.0, 7, "k", reason="ok", phase="", status=200) is False
    assert b.get("k").consecutive_failures == 0
    assert (
        acc.attempt_ended(1.0, 7, "k", reason="passed_through_error", phase="", status=400) is False
    )
    assert acc.attempt_ended(1.0, 7, "k", reason="aborted_by_client", phase="", status=None) is None


def test_accounting_counts_a_cut_after_commit_once_a_turn() -> None:
    b, _ = board()
    acc = AttemptAccounting(b)
    cut = {"reason": "connection_reset", "phase": "committed", "status": 200}
    # the fleet hears nothing of a cut (a 200 answered); the breaker hears it once
    assert acc.attempt_ended(1.0, 1, "k", **cut) is None  # type: ignore[arg-type]
    assert acc.attempt_ended(2.0, 1, "k", **cut) is None  # type: ignore[arg-type]
    assert b.get("k").consecutive_failures == 1
    acc.attempt_ended(3.0, 2, "k", **cut)  # type: ignore[arg-type]
    assert b.get("k").consecutive_failures == 2  # another turn
    acc.turn_ended(1)
    acc.attempt_ended(4.0, 1, "k", **cut)  # type: ignore[arg-type]
    assert b.get("k").consecutive_failures == 3  # turn 1's record was forgotten


def test_accounting_tells_the_fleet_one_failure_per_turn_and_upstream() -> None:
    b, _ = board()
    acc = AttemptAccounting(b)
    assert acc.attempt_ended(1.0, 1, "k", reason="503", phase="headers", status=503) is True
    assert acc.attempt_ended(2.0, 1, "k", reason="503", phase="headers", status=503) is None
    assert acc.attempt_ended(2.0, 1, "j", reason="reset", phase="connect", status=None) is True
    assert acc.attempt_ended(2.0, 2, "k", reason="503", phase="headers", status=503) is True
    # a 4xx that is not passed through counts nowhere; the breaker is the machine's
    assert acc.attempt_ended(3.0, 3, "k", reason="429", phase="headers", status=429) is None
    assert b.get("k").consecutive_failures == 0  # failures before commit: the machine's


def test_a_line_says_why_it_waits() -> None:
    """Issue 36: the "wait in line" log said "(breaker closed)" for a quota cool-off."""
    b, _ = board()
    assert b.wait_reason(K, 0.0) == "retry pacing"
    b.cooloff(K, 0.0, 3600.0, "quota")
    assert b.wait_reason(K, 0.0) == "quota cool-off, 60.0s left"
    assert b.quota_until(K, 0.0) == QUOTA_LOOK_AGAIN_S
    for _ in range(5):
        b.failure(K, 1.0, "503")
    assert b.wait_reason(K, 1.0).startswith("breaker open, quota cool-off")
    assert b.quota_until(K, 1.0) == 0.0  # a breaker keeps it out too: turns wait


def test_a_probe_whose_turn_ends_without_a_verdict_frees_the_slot_at_once() -> None:
    """Issue 36: the slot (and a fleet's lease) was held for probe_timeout_s (30 s)."""
    b, _ = board()
    for _ in range(5):
        b.failure(K, 0.0, "503")
    released: list[str] = []
    b.probe_release = released.append
    state = RetryState(RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K])
    assert state.next_upstream(1.0) == 0  # the probe
    assert b.blocked_until(K, 1.0) > 20  # its lease
    state.close()  # the client went away before any answer
    assert released == [K] and b.blocked_until(K, 1.0) == 0.0
    other = RetryState(RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K])
    assert other.next_upstream(1.0) == 0  # the next turn probes now
    other.record_failure(Failure(FailureClass.STATUS, "HTTP 503", status=503), 1.1)
    other.close()
    assert released == [K, K]  # its verdict gave the lease back; close added nothing


def test_a_turn_with_only_quota_spent_upstreams_asks_the_provider_instead_of_parking() -> None:
    """Issue 36: one 402 parked every later turn for quota_cooloff_s."""
    b, _ = board()
    cooloffs: dict[int, float] = {}  # the relay's per-route cool-offs, shared by its turns
    first = RetryState(
        RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K], cooloff_until=cooloffs
    )
    assert first.next_upstream(0.0) == 0
    first.record_failure(Failure(FailureClass.STATUS, "HTTP 402", status=402), 0.0)
    assert first.quota_wall  # it ends with the provider's answer
    later = RetryState(
        RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K], cooloff_until=cooloffs
    )
    assert later.next_upstream(1.0) == 0 and later.why == "first"  # not a Park
    b.cooloff(K, 1.0, 100.0, "retry_after")  # a Retry-After is waited out, as before
    again = RetryState(
        RetryPolicy(), 1, rng=random.Random(0), board=b, keys=[K], cooloff_until=cooloffs
    )
    assert isinstance(again.next_upstream(2.0), Park)
