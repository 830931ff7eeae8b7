"""Rate-limit admission in the retry state (core/admission/policy.py with
core/admission/ratelimit.py): first attempts wait in the limiter's line, a 429 is waited
once, on the limiter."""

from __future__ import annotations

from collections import deque

from unbroken.core.admission.health import HealthBoard
from unbroken.core.admission.policy import Failure, FailureClass, Park, RetryPolicy, RetryState
from unbroken.core.admission.ratehead import RateHeaders, Reading
from unbroken.core.admission.ratelimit import RateSettings

K = "r|http://a"
K2 = "r|http://b"
E429 = Failure(FailureClass.STATUS, "HTTP 429", status=429)


def state(
    board: HealthBoard, session: str | None = None, keys: list[str] | None = None
) -> RetryState:
    keys = keys or [K]
    return RetryState(
        RetryPolicy(),
        len(keys),
        board=board,
        keys=keys,
        sticky=session,
        creds=["c"] * len(keys),
        body_bytes=400,
    )


def spend_requests(board: HealthBoard, left: float, per_s: float = 1.0, now: float = 0.0) -> None:
    """One turn learns that ``left`` requests are left, refilling at ``per_s``."""
    s = state(board)
    assert s.next_upstream(now) == 0
    limit = 60.0
    s.record_rate(RateHeaders(requests=Reading(limit, left, (limit - left) / per_s)), now)
    s.settle(now, None)


def test_first_attempts_wait_in_the_rate_line_and_go_in_turn() -> None:
    b = HealthBoard()
    spend_requests(b, 2.0)
    turns = [state(b, f"agent{i}") for i in range(5)]
    got = [t.next_upstream(0.0) for t in turns]
    assert got[:2] == [0, 0]
    parks = got[2:]
    assert all(isinstance(p, Park) and p.why == "ratelimit" and p.key == K for p in parks)
    lim = b.rates.get(K, "c")
    assert len(lim.line) == 3
    # one a second: each grant is the next turn of the line, woken by the pump
    granted, due = b.pump(K, 0.0)
    assert granted == [] and due is not None and abs(due - 1.0) < 1e-9
    for i, t in enumerate(turns[2:], start=1):
        granted, due = b.pump(K, float(i))
        assert granted == [t.ticket]
        assert t.next_upstream(float(i)) == 0
        assert t.ticket not in b.rates.get(K, "c").line


def test_a_429_with_retry_after_is_waited_once() -> None:
    b = HealthBoard()
    s = state(b)
    assert s.next_upstream(0.0) == 0
    s.record_rate(RateHeaders(requests=Reading(60, 0, 60.0), retry_after_s=2.0), 0.0)
    wait = s.record_failure(Failure(FailureClass.STATUS, "HTTP 429", 429, 2.0), 0.0)
    assert wait == 2.0  # the Retry-After (longer than the retry delay): a shared cool-off
    assert b.get(K).cooloff_until == 2.0 and b.rates.get(K, "c").blocked_until == 2.0
    # when it ends, the retry goes at once: a lone turn's retry finds its pacer's token
    assert s.next_upstream(2.0) == 0 and s.retries == 1
    assert b.pacer(K).waited_total == 0 and b.rates.get(K, "c").waited_total == 0


def test_a_429_without_retry_after_waits_the_retry_delay_then_the_rate_line() -> None:
    b = HealthBoard()
    s = state(b)
    assert s.next_upstream(0.0) == 0
    s.record_rate(RateHeaders(requests=Reading(60, 0, 60.0)), 0.0)  # one a second
    assert s.record_failure(E429, 0.0) == 0.25  # never sooner than the retry delay
    assert b.get(K).cooloff_until == 0.0
    park = s.next_upstream(0.25)
    assert isinstance(park, Park) and park.why == "ratelimit"
    assert b.pump(K, 0.5)[0] == []
    granted, _ = b.pump(K, 1.0)
    assert granted == [s.ticket]
    assert s.next_upstream(1.0) == 0 and b.pacer(K).waited_total == 0


def test_a_429_moves_the_retry_to_another_upstream_at_once() -> None:
    b = HealthBoard()
    s = state(b, keys=[K, K2])
    assert s.next_upstream(0.0) == 0
    assert s.record_failure(Failure(FailureClass.STATUS, "HTTP 429", 429, 30.0), 0.0) == 0.0
    assert s.next_upstream(0.0) == 1


def test_a_429_with_nothing_learned_halves_the_window() -> None:
    b = HealthBoard(rate=RateSettings(cold_start=64))
    first = state(b)
    assert first.next_upstream(0.0) == 0
    first.record_rate(RateHeaders(), 0.0)  # answered, no rate headers: nothing to learn
    first.settle(0.0, None)
    turns = [state(b, f"a{i}") for i in range(8)]
    for t in turns:
        assert t.next_upstream(0.0) == 0
    # no header at all: the retry delay, a window of 8 / 2, and the throttle comes on
    assert turns[0].record_failure(E429, 0.0) == 0.25
    lim = b.rates.get(K, "c")
    assert lim.window == 4.0 and lim.blocked_until == 0.0 and lim.throttle.enabled
    assert isinstance(turns[0].next_upstream(0.25), Park)  # 7 still run: the window is full
    for t in turns[1:]:
        t.settle(0.5, None)
        t.close()
    granted, _ = b.pump(K, 0.5)  # the throttle (down to 70 % of 180 a second) lets it go
    assert granted == [turns[0].ticket]


def test_a_turn_that_ends_in_the_rate_line_leaves_it() -> None:
    b = HealthBoard()
    spend_requests(b, 0.0)
    s = state(b, "x")
    assert isinstance(s.next_upstream(0.0), Park)
    lim = b.rates.get(K, "c")
    assert s.ticket in lim.line
    s.close(3.0)
    assert s.ticket not in lim.line and not lim.waiting


def test_disabled_rate_limits_leave_the_old_path() -> None:
    b = HealthBoard(rate=RateSettings(enabled=False))
    s = state(b)
    assert s.next_upstream(0.0) == 0
    s.record_rate(RateHeaders(requests=Reading(60, 0, 60.0)), 0.0)
    assert not b.rates.limiters
    wait = s.record_failure(Failure(FailureClass.STATUS, "HTTP 429", 429, 2.0), 0.0)
    assert wait == 2.0 and b.get(K).cooloff_until == 2.0  # Retry-After as a cool-off


def test_a_turn_a_cooloff_holds_out_of_the_rate_line_keeps_its_wait_bound() -> None:
    """Issue 32: no wait longer than ``max_wait_s``.  A turn waiting in a rate line left
    it while a cool-off (another turn's 429 with a Retry-After) held the upstream, and
    came back at its end as a newcomer: its bound started again at the back of the
    line, and in the fleet simulator (`shared` at 1 request a second) a turn waited
    94.5 s for its first attempt.  It comes back with the time it first waited."""
    b = HealthBoard(rate=RateSettings(max_wait_s=60.0))
    spend_requests(b, 0.0, per_s=1 / 600)  # one request in ten minutes: only the bound
    t = state(b, "agent")
    park = t.next_upstream(0.0)
    assert isinstance(park, Park) and park.why == "ratelimit"
    lim = b.rates.get(K, "c")
    assert lim.line.oldest() == (t.ticket, 0.0)
    b.cooloff(K, 10.0, 30.0, "retry_after")  # held out from 10 s to 40 s
    park = t.next_upstream(10.0)
    assert isinstance(park, Park) and park.why != "ratelimit" and t.ticket not in lim.line
    later = state(b, "later")  # a newcomer, meanwhile
    assert isinstance(later.next_upstream(40.0), Park)
    assert isinstance(t.next_upstream(40.0), Park)  # back in line: first, since 0 s
    assert lim.line.oldest() == (t.ticket, 0.0)
    granted, due = b.pump(K, 59.0)
    assert granted == [] and due == 60.0  # the bound, from when it first waited
    granted, _ = b.pump(K, 60.0)
    assert granted == [t.ticket]
    assert t.next_upstream(60.0) == 0
    assert lim.waited_total == 2  # two turns waited (the one back counted once)


def test_turns_a_429_blocks_keep_their_place_in_the_rate_line() -> None:
    """Issue 32's fairness: turns waiting in the rate line when another turn's 429
    (Retry-After 1 s) blocked the key went to the pacer's line, which let them go on its
    ramp when the block ended, while turns that came meanwhile went straight to the
    budget: `shared` through one relay served some agents' third turns before others'
    first (0.91 fairness at half the turns).  They keep their place now, and the
    limiter holds its line through the block."""
    b = HealthBoard()
    spend_requests(b, 1.0)  # one left, one a second
    first = state(b, "first")
    assert first.next_upstream(0.0) == 0  # the one left
    waiting = [state(b, f"agent{i}") for i in range(3)]
    for t in waiting:
        park = t.next_upstream(0.0)
        assert isinstance(park, Park) and park.why == "ratelimit"
    lim = b.rates.get(K, "c")
    assert list(lim.line) == [t.ticket for t in waiting]
    first.record_failure(
        Failure(FailureClass.STATUS, "HTTP 429", status=429, retry_after_s=1.0), 0.5
    )
    for t in waiting:  # woken: the key is blocked until 1.5 s
        park = t.next_upstream(0.5)
        assert isinstance(park, Park) and park.until == 1.5
    assert list(lim.line) == [t.ticket for t in waiting]  # in their places
    assert b.pacer(K).queue == deque()
    granted, due = b.pump(K, 1.0)
    assert granted == [] and due is not None and due >= 1.5  # held through the block
    fresh = state(b, "fresh")  # a turn that comes as the block ends
    assert isinstance(fresh.next_upstream(1.5), Park)
    order = [*waiting, fresh]
    assert list(lim.line) == [t.ticket for t in order]
    served: list[RetryState] = []
    now = 1.5
    while len(served) < len(order) and now < 120.0:
        granted, due = b.pump(K, now)
        for t in order:
            if t.ticket in granted:
                assert t.next_upstream(now) == 0
                t.record_rate(RateHeaders(requests=Reading(60.0, 0.0, 60.0)), now)
                t.settle(now, None)  # answered: the slow start lets the next one go
                served.append(t)
        assert due is not None or len(served) == len(order)
        now = max(due or now, now + 0.01)
    assert served == order  # in the order they came


def test_a_turn_the_provider_refused_retries_in_its_place_in_the_rate_line() -> None:
    """Issue 32's fairness over two relays: a turn whose request was refused (a cold
    start's blind request into a spent key, a 429 with room) went back to the rate line
    behind every turn that came since, and waited the whole line again (the benchmark's
    `shared` over two relays: agents with one turn at half the turns while others had
    four, fairness 0.919).  It goes back in the place its turn came in now."""
    b = HealthBoard()
    early = state(b, "early")
    assert early.next_upstream(0.0) == 0  # a blind first request, at once
    spend_requests(b, 0.0, now=0.1)  # another answer: the key is spent, one a second
    later = [state(b, f"later{i}") for i in range(3)]
    for i, t in enumerate(later):
        assert isinstance(t.next_upstream(0.2 + i / 10), Park)
    early.record_failure(E429, 0.5)  # refused (no Retry-After)
    park = early.next_upstream(2.0)  # after the retry delay: the rate line
    assert isinstance(park, Park) and park.why == "ratelimit"
    lim = b.rates.get(K, "c")
    assert list(lim.line) == [early.ticket, *(t.ticket for t in later)]
    first = lim.line.deadline()
    assert first is not None and first[0] == later[0].ticket  # its bound counts from 2.0


def test_a_turn_a_failing_upstream_refused_retries_behind_the_turns_that_came_since() -> None:
    """Only a request the rate limit refused keeps its turn's place: a failing
    upstream's retries (a 503, an outage) at the head of the line held the turns that
    came since out for a whole outage (the simulator's 30 s outage: a first attempt
    waited 35 s, against 8 s in turn with the others)."""
    b = HealthBoard()
    early = state(b, "early")
    assert early.next_upstream(0.0) == 0
    spend_requests(b, 0.0, now=0.1)  # the key is spent, one a second
    later = [state(b, f"later{i}") for i in range(3)]
    for i, t in enumerate(later):
        assert isinstance(t.next_upstream(0.2 + i / 10), Park)
    early.record_failure(Failure(FailureClass.STATUS, "HTTP 503", status=503), 0.5)
    now = 2.0
    park = early.next_upstream(now)
    while isinstance(park, Park) and park.why != "ratelimit" and now < 60.0:  # the pacer's go
        now = max(park.until, now + 0.01)
        b.pump(K, now)
        park = early.next_upstream(now)
    assert isinstance(park, Park) and park.why == "ratelimit"
    lim = b.rates.get(K, "c")
    assert lim.line.head() != early.ticket and list(lim.line)[-1] == early.ticket
