"""Issue 32's bounds (core/admission/ratelimit.py): whatever a header says, no wait is longer than
``max_wait_s``, a budget's debt is at most its limit, an attempt that died before its
headers gives its estimate back, and a 429 empties only the budget it is about."""

from __future__ import annotations

import math

import pytest

from unbroken.core.admission.ratehead import RateHeaders, Reading, parse_rate_headers
from unbroken.core.admission.ratelimit import Limiter, RateSettings

K = "r|http://a"


def wait_of(lim: Limiter, ticket: int, tokens: float, now: float) -> float:
    """How long ``ticket`` waits in ``lim``'s line, pumping as the relay does."""
    if lim.admit(ticket, "s", tokens, now):
        return 0.0
    t = now
    for _ in range(10_000):
        granted, due = lim.pump(t)
        if ticket in granted:
            return t - now
        assert due is not None and math.isfinite(due), "nothing would ever wake it"
        t = max(due, t + 1e-6)
    raise AssertionError("never granted")


def test_attempts_that_die_before_their_headers_give_their_estimate_back() -> None:
    # a cold start: four large requests go before any budget is known; the first one's
    # answer reports the token budget, the other three are reset before their headers
    lim = Limiter(K, "c", RateSettings(max_wait_s=5.0))
    seqs = [lim.admit(0, f"a{i}", 30_000.0, 0.0) for i in range(4)]
    assert all(seqs)
    lim.learn(seqs[0], RateHeaders(tokens=Reading(10_000, 9_000, 60.0)), 0.1)
    assert lim.buckets["tokens"].level >= -10_000  # a debt is at most the limit
    lim.finish(seqs[0], 0.1)
    for s in seqs[1:]:
        lim.finish(s, 0.2, ok=False)  # a reset before headers: the estimate goes back
    assert lim.buckets["tokens"].level >= 9_000  # the debt went with them
    assert lim.admit(0, "b", 100.0, 0.3) > 0  # nothing to wait for


def test_a_report_with_many_uncounted_admissions_cannot_sink_a_budget_past_its_limit() -> None:
    lim = Limiter(K, "c", RateSettings())
    seqs = [lim.admit(0, f"a{i}", 50_000.0, 0.0) for i in range(4)]
    lim.learn(seqs[0], RateHeaders(tokens=Reading(20_000, 100, 6.0)), 0.0)
    assert lim.buckets["tokens"].level >= -20_000


def test_no_wait_in_the_line_is_longer_than_max_wait_s() -> None:
    # a limit with no reset: the per-minute guess would wait 60 s for a spent budget
    lim = Limiter(K, "c", RateSettings(max_wait_s=5.0))
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, RateHeaders(requests=Reading(1000, 0, None)), 0.0)
    lim.finish(s, 0.0)
    assert wait_of(lim, 1, 0.0, 0.0) <= 5.0 + 1e-6
    # a token budget far below what a request asks, learned with no reset
    lim = Limiter(K, "c", RateSettings(max_wait_s=5.0))
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, RateHeaders(tokens=Reading(9_000_000, 0, None)), 0.0)
    lim.finish(s, 0.0)
    assert wait_of(lim, 1, 9_000_000.0, 0.0) <= 5.0 + 1e-6


def test_retry_after_nan_is_ignored_and_the_wait_stays_bounded() -> None:
    h = parse_rate_headers(
        {
            "retry-after": "NaN",
            "x-ratelimit-limit-tokens": "10000",
            "x-ratelimit-remaining-tokens": "0",
        },
        now_wall=0.0,
        max_wait_s=5.0,
    )
    assert h.retry_after_s is None and h.problems
    lim = Limiter(K, "c", RateSettings(max_wait_s=5.0))
    s = lim.admit(0, "s", 10_000.0, 0.0)
    lim.learn(s, h, 0.0)
    until = lim.limited(s, h.retry_after_s, 10_000.0, 0.0)
    lim.finish(s, 0.0, ok=False)
    assert until <= 5.0  # not a whole minute's refill of the token budget
    assert wait_of(lim, 1, 10_000.0, 0.0) <= 5.0 + 1e-6


def test_a_429_without_retry_after_waits_for_the_budget_it_is_about_not_for_every_one() -> None:
    # Codex's 39 KB first request: requests spent (reset in 3 s), tokens 99 % left
    lim = Limiter(K, "c", RateSettings())
    tokens = lim.estimate(39_000)
    s = lim.admit(0, "s", tokens, 0.0)
    h = RateHeaders(
        requests=Reading(500, 0, 3.0), tokens=Reading(200_000, 198_000, 0.6), retry_after_s=None
    )
    lim.learn(s, h, 0.0)
    until = lim.limited(s, None, tokens, 0.0)
    lim.finish(s, 0.0, ok=False)
    assert until <= 3.0 + 1e-9  # the requests budget's reset, not the tokens' refill
    assert lim.buckets["tokens"].level > 190_000  # a budget with room is not emptied
    assert wait_of(lim, 1, tokens, 0.0) <= 3.0 + 1e-6


def test_a_429_nothing_explains_waits_for_a_reset_under_a_second_and_only_that() -> None:
    # quantized: 295 of 300 a minute left, refused, "the next one may go in 400 ms"
    lim = Limiter(K, "c", RateSettings())
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, RateHeaders(requests=Reading(300, 295, 0.4)), 0.0)
    assert lim.limited(s, None, 0.0, 0.0) == pytest.approx(0.4)
    # a long reset on a budget with room is not "the next request": no block at all
    lim = Limiter(K, "c", RateSettings())
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, RateHeaders(requests=Reading(300, 295, 30.0)), 0.0)
    assert lim.limited(s, None, 0.0, 0.0) == 0.0
    # another answer's hint is not this 429's
    lim = Limiter(K, "c", RateSettings())
    a, b = lim.admit(0, "s", 0.0, 0.0), lim.admit(0, "s", 0.0, 0.0)
    lim.learn(a, RateHeaders(requests=Reading(300, 295, 0.4)), 0.0)
    lim.learn(b, RateHeaders(), 0.0)
    assert lim.limited(b, None, 0.0, 0.0) == 0.0


def test_a_crowd_gets_a_seconds_share_of_a_per_minute_limit_at_once_a_lone_request_always() -> None:
    # 300 a minute reported, 295 left: a quantized provider takes 5 in any one second
    lim = Limiter(K, "c", RateSettings(cold_start=4, max_concurrency=4))
    first = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(first, RateHeaders(requests=Reading(300, 295, 1.0)), 0.0)
    lim.finish(first, 0.0)  # taken: the slow start is past max_concurrency, out of the way
    assert lim.ramp is None
    went = [lim.admit(t, f"a{t}", 0.0, 0.0) for t in range(1, 21)]
    assert sum(1 for s in went if s) == 4  # the second's 5, less the one just sent
    granted, due = lim.pump(0.0)
    # then the bank is drawn at twice the share (tests/core/admission/test_drain.py)
    assert granted == [] and due == pytest.approx(0.1)
    assert lim.pump(0.1)[0] == [5]
    # a request alone is never held by it (nor by a drawn bank's bound below twice the
    # share in a second: tests/core/admission/test_drain.py)
    lone = Limiter(K, "c", RateSettings())
    lone.drain = 1.0
    for t in range(10):
        seq = lone.admit(0, "s", 0.0, t * 0.01)
        assert seq
        if t == 0:
            lone.learn(seq, RateHeaders(requests=Reading(60, 59, 1.0)), 0.0)
        lone.finish(seq, t * 0.01)


def test_sporadic_429s_with_retry_after_do_not_spiral_the_throttle_down() -> None:
    # a provider that reports no budget answers one request in 200 with a 429 and a
    # Retry-After (the soak's fault mix): it is waited, and the admitted rate holds
    lim = Limiter(K, "c", RateSettings(cold_start=100_000))
    t = 0.0
    for n in range(1, 2001):
        t += 0.01  # 100 requests a second, each answered at once
        seq = lim.admit(0, f"a{n % 200}", 0.0, t)
        assert seq, f"request {n} held at {t:.2f} s: {lim.throttle.view()}"
        if n % 200 == 0:
            lim.limited(seq, 1.0, 0.0, t)
            lim.finish(seq, t, ok=False)
            t += 1.0  # the Retry-After
        else:
            lim.accepted(seq, t)
            lim.finish(seq, t)
    assert not lim.throttle.enabled


def test_the_wake_at_max_wait_s_lets_the_ticket_go() -> None:
    """Found by the fleet simulator: a ticket that began to wait at 7.041998270529125 is
    woken at ``since + 60`` (67.04199827052912), where ``now - since`` is
    59.99999999999999: it was not overdue, and the pump asked to be woken at the same
    instant again (the simulator's clock stood still for good; a relay spins its loop
    until its clock moves on)."""
    since = 7.041998270529125
    lim = Limiter(K, "c", RateSettings(max_wait_s=60.0))
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, RateHeaders(tokens=Reading(1000, 0, 3600.0)), 0.0)  # spent for an hour
    lim.finish(s, 0.0)
    assert not lim.admit(1, "t", 1000.0, since)
    granted, due = lim.pump(since)
    assert granted == [] and due == since + 60.0
    granted, again = lim.pump(due)
    assert granted == [1], (granted, again)
