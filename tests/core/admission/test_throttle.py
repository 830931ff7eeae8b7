"""The outcome-driven throttle (core/admission/throttle.py) and what it does for a fleet behind a
provider whose headers are wrong: issue 32's storm, replayed on a virtual clock."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from core.admission.ratesim import Answer, Bare, Quantized, Textbook, most_in_a_second, run
from unbroken.core.admission.throttle import (
    BETA,
    CLIMB_S,
    MAX_PEERS,
    MAX_RATE,
    MIN_RATE,
    MIN_SUPPORT,
    SIBLING_SKEW,
    SYNC_S,
    AdmissionThrottle,
)


def test_off_until_the_provider_refuses() -> None:
    t = AdmissionThrottle()
    for seq in range(1, 1000):
        assert t.due(seq * 0.001, alone=False) == seq * 0.001
        t.sent(seq, seq * 0.001)
        t.accepted(seq, seq * 0.001)
    assert not t.enabled


def test_a_429_brings_the_rate_down_to_what_the_provider_accepted_in_one_step() -> None:
    t = AdmissionThrottle()
    # 2,000 a second sent for a second; the provider took 5 of them
    for seq in range(1, 2001):
        now = seq / 2000
        t.sent(seq, now)
        if seq % 400 == 0:
            t.accepted(seq, now)
    assert t.refused(1500, 1.0, last_seq=2000)
    assert t.enabled and t.w_max == pytest.approx(5.0) and t.rate == pytest.approx(BETA * 5.0)
    # the next request waits a period: no burst right after a refusal
    assert t.due(1.0, alone=False) == pytest.approx(1.0 + 1 / t.rate)


def test_one_decrease_an_epoch() -> None:
    t = AdmissionThrottle()
    for seq in range(1, 41):
        t.sent(seq, 0.0)
    t.accepted(1, 0.01)
    assert t.refused(2, 0.02, last_seq=40)
    rate = t.rate
    for seq in range(3, 41):  # sent before the decrease: they say nothing new
        assert not t.refused(seq, 0.03, last_seq=40)
    assert t.rate == rate and t.decreases == 1
    t.sent(41, 1.0)
    assert t.refused(41, 1.1, last_seq=41)  # a request of the new epoch: it does
    assert t.decreases == 2 and t.rate <= rate


def test_it_climbs_back_to_the_refused_rate_then_beyond_but_only_while_used() -> None:
    t = AdmissionThrottle()
    for seq in range(1, 11):
        t.sent(seq, seq * 0.1)
        t.accepted(seq, seq * 0.1)
    t.sent(11, 1.05)
    assert t.refused(11, 1.1, last_seq=11)
    w_max = t.w_max
    seq, now = 11, 1.1
    while now < 1.1 + 2 * CLIMB_S:
        now += 1 / t.rate
        seq += 1
        t.sent(seq, now)
        t.accepted(seq, now)
        if now < 1.1 + CLIMB_S:
            assert t.rate <= w_max + 1e-9  # concave: back to the refused rate, not past it
    assert t.rate > w_max  # then it probes beyond
    # a quiet relay does not bank a licence: the rate is at most twice what is sent
    quiet = AdmissionThrottle()
    quiet.sent(1, 0.0)
    quiet.refused(1, 0.1, last_seq=1)
    before = quiet.rate
    quiet.sent(2, 100.0)  # one request in 100 s: the curve is far up, the use is not
    quiet.accepted(2, 100.0)
    assert quiet.rate == before


def _measured_after(accepted: int) -> tuple[float, float]:
    """A key spent at the start: a burst of ten, ``accepted`` of them answered, then a
    429; then three seconds of use at the admitted rate.  (anchor, rate at the end)"""
    t = AdmissionThrottle()
    for seq in range(1, 11):
        t.sent(seq, 0.0)
    for i in range(accepted):
        t.accepted(1 + i, 0.3 + 0.01 * i)
    assert t.refused(10, 0.5, last_seq=10)
    anchor, seq, now = t.w_max, 10, 0.5
    while now < 3.5:
        now += 1 / t.rate
        seq += 1
        t.sent(seq, now)
        t.accepted(seq, now)
    return anchor, t.rate


def test_a_measure_on_too_few_answers_is_a_guess_that_probes_up() -> None:
    """Two streamed answers back before a 429 measure two a second, which is no limit:
    their siblings have not come back yet.  Anchored on it, one relay of the fleet
    simulator sat at 1 a second of a per-second 5 for a minute on half the seeds
    (issue 32, `anthropic`: 44 % goodput).  A guess doubles each second until the next
    429 measures again; a measure on ``MIN_SUPPORT`` answers climbs back as CUBIC does."""
    anchor, rate = _measured_after(2)
    assert anchor == pytest.approx(2.0) and rate > 4 * anchor
    anchor, rate = _measured_after(MIN_SUPPORT)
    assert anchor == pytest.approx(4.0) and rate <= anchor  # concave, under CLIMB_S


def _busy(t: AdmissionThrottle, until: float, per_s: float = 5.0, seq: int = 0) -> int:
    """``t`` sent and was answered ``per_s`` a second until ``until``; the last seq."""
    now = 0.0
    while now < until:
        seq += 1
        t.sent(seq, now)
        t.accepted(seq, now + 0.05)
        now += 1 / per_s
    return seq


def test_a_siblings_news_never_lowers_a_relay_and_is_answered_once_a_window() -> None:
    # issue 32: relays that share a key share what each was seen to accept
    t = AdmissionThrottle()
    seq = _busy(t, 3.0, per_s=4.0)
    assert t.sibling_news(3.0, "b", anchor=1.0, demand=20.0, mine=10.0, asks=True)  # it answers
    assert t.replies == 1 and t.anchor == pytest.approx(4.0, rel=0.05) and t.demand == 10.0
    assert not t.enabled and t.decreases == 0  # nothing a sibling says lowers it
    # an answer in the same window: pooled, not answered again
    assert not t.sibling_news(3.0 + SYNC_S / 2, "c", anchor=1.0, demand=20.0, mine=10.0, asks=False)
    assert t.replies == 1
    # a later window is answered again (if it sent lately)
    _busy(t, 3.0 + 2 * SYNC_S, per_s=4.0, seq=seq)
    assert t.sibling_news(3.0 + 2 * SYNC_S, "b", anchor=1.0, demand=20.0, mine=10.0, asks=True)
    assert t.replies == 2 and not t.enabled
    # a relay over its share is not lowered by the pool either (its own 429s do that)
    high = AdmissionThrottle()
    seq = _busy(high, 3.0, per_s=4.0) + 1
    high.sent(seq, 3.0)
    assert high.refused(seq, 3.0, last_seq=seq, demand=20.0)
    w_max, rate = high.w_max, high.rate
    assert not high.sibling_news(3.05, "a", anchor=1.0, demand=20.0, mine=20.0, asks=False)
    assert (high.w_max, high.rate) == (w_max, rate) and high.raises == 0


def test_a_relay_served_below_its_share_is_raised_to_it() -> None:
    # issue 32 (`overstated` over two relays): one relay was cut to one request a second
    # by an early 429, having seen a second of answers while its sibling took most;
    # its curve, scaled to that anchor, took 30 s to reach 2 a second while its 20
    # agents waited.  The window's measures are pooled: it takes its share by demand.
    low = AdmissionThrottle()
    seq = _busy(low, 3.0, per_s=1.0) + 1
    low.sent(seq, 3.0)
    assert low.refused(seq, 3.0, last_seq=seq, demand=20.0)
    assert low.w_max == pytest.approx(1.0, rel=0.05) and low.anchor == pytest.approx(1.0)
    # its sibling answers: 4 a second accepted, 20 waiting
    assert not low.sibling_news(3.1, "b", anchor=4.0, demand=20.0, mine=20.0, asks=False)
    assert low.w_max == pytest.approx(2.5, rel=0.05)  # (1 + 4) * 20 / 40
    assert low.rate == pytest.approx(BETA * low.w_max) and low.raises == 1
    assert low.decreases == 1
    # uneven demand: 25 and 15 agents get 5/8 and 3/8 of the pool; a third relay's
    # measure in the same window joins it
    three = AdmissionThrottle()
    seq = _busy(three, 3.0, per_s=1.0) + 1
    three.sent(seq, 3.0)
    assert three.refused(seq, 3.0, last_seq=seq, demand=25.0)
    three.sibling_news(3.05, "a", anchor=4.0, demand=15.0, mine=25.0, asks=False)
    assert three.w_max == pytest.approx(5.0 * 25 / 40, rel=0.05)
    three.sibling_news(3.2, "c", anchor=3.0, demand=10.0, mine=25.0, asks=False)
    assert three.w_max == pytest.approx(8.0 * 25 / 50, rel=0.05)


def test_a_siblings_question_is_answered_even_in_an_open_window() -> None:
    """A decrease's measure is a question: the asker's window starts afresh, so what
    was told before it is not in its pool.  Answered only when the answering relay's
    own window was fresh, a worker cut to 0.57 a second by its third 429 (its sibling
    had come down 0.5 s before, its window still open) heard nothing for eight seconds
    with 23 turns waiting (issue 32's benchmark, `bare` over two workers)."""
    a = AdmissionThrottle()
    seq = _busy(a, 3.0, per_s=4.0) + 1
    a.sent(seq, 3.0)
    assert a.refused(seq, 3.0, last_seq=seq, demand=16.0)
    replies = a.replies
    for i in range(1, 3):  # it goes on sending
        a.sent(seq + i, 3.0 + 0.1 * i)
    # B comes down 0.4 s later, inside A's window: A answers all the same
    assert a.sibling_news(3.4, "b", anchor=0.6, demand=21.0, mine=16.0, asks=True)
    assert a.replies == replies + 1
    # the same question again within half a window: pooled, not answered again
    assert not a.sibling_news(3.6, "b", anchor=0.6, demand=21.0, mine=16.0, asks=True)
    # an answer (not a question) inside the window: not answered
    assert not a.sibling_news(3.7, "c", anchor=1.0, demand=5.0, mine=16.0, asks=False)
    assert a.replies == replies + 1
    # B pools A's answer and is raised to its share
    b = AdmissionThrottle()
    seq = _busy(b, 3.4, per_s=0.6) + 1
    b.sent(seq, 3.4)
    assert b.refused(seq, 3.4, last_seq=seq, demand=21.0)
    low = b.w_max
    b.sibling_news(3.41, "a", anchor=a.anchor, demand=a.demand, mine=21.0, asks=False)
    assert b.raises == 1 and b.w_max > 1.5 * low


def test_questions_from_many_siblings_are_answered_within_bounds() -> None:
    t = AdmissionThrottle()
    _busy(t, 3.0, per_s=4.0)
    for i in range(1000):  # a thousand siblings ask at once
        assert t.sibling_news(3.0 + i * 1e-4, f"s{i}", anchor=1.0, demand=1.0, mine=10.0, asks=True)
    assert len(t._answered) <= MAX_PEERS and len(t._peers) <= MAX_PEERS
    assert t.replies == 1000 and not t.enabled  # answered, never lowered


def test_a_siblings_word_is_bounded() -> None:
    t = AdmissionThrottle()
    seq = _busy(t, 3.0, per_s=2.0) + 1
    t.sent(seq, 3.0)
    assert t.refused(seq, 3.0, last_seq=seq, demand=10.0)
    own = t.anchor
    # a claim of a million a second counts as SIBLING_SKEW times this relay's own measure
    t.sibling_news(3.1, "x", anchor=1e6, demand=10.0, mine=10.0, asks=False)
    assert t.w_max == pytest.approx((own + SIBLING_SKEW * own) / 2, rel=0.01)
    # not a number, or below zero: nothing accepted, no demand
    t.sibling_news(3.2, "x", anchor=float("nan"), demand=float("inf"), mine=10.0, asks=False)
    assert math.isfinite(t.w_max) and t.w_max >= MIN_RATE
    t.sibling_news(3.3, "y", anchor=-5.0, demand=-1.0, mine=10.0, asks=False)
    assert math.isfinite(t.w_max) and t.w_max >= MIN_RATE
    # siblings pooled in one window are bounded in number
    for i in range(1000):
        t.sibling_news(3.4, f"s{i}", anchor=1.0, demand=1.0, mine=10.0, asks=False)
    assert t.decreases == 1 and t.w_max <= MAX_RATE


def test_a_relay_that_sent_nothing_neither_answers_nor_changes() -> None:
    t = AdmissionThrottle()
    assert not t.sibling_news(5.0, "b", anchor=5.0, demand=20.0, mine=0.0, asks=True)
    assert not t.enabled and t.decreases == 0 and t.replies == 0
    assert t.due(5.0, alone=False) == 5.0


def test_a_request_alone_is_never_held() -> None:
    t = AdmissionThrottle()
    t.sent(1, 0.0)
    t.refused(1, 0.0, last_seq=1)
    assert t.due(0.0, alone=True) == 0.0
    assert t.due(0.0, alone=False) > 0.0
    assert t.due(0.0, alone=False) <= 1.0 / MIN_RATE


def _sends_until(t: AdmissionThrottle, now: float, end: float, seq: int) -> list[float]:
    """A crowd behind ``t`` (never alone): each request goes when it is due; none is
    answered."""
    sent = []
    while now < end:
        due = t.due(now, alone=False)
        if due > now:
            now = due
            continue
        seq += 1
        t.sent(seq, now)
        sent.append(now)
    return sent


def test_a_cold_start_all_refused_holds_the_rest_of_its_second() -> None:
    """Issue 32, `bare` over two workers: each relay's cold start of four went into a
    spent key and was refused, and its throttle, on a guess of 3.6 a second, let two
    or three more go in that same second: 12 to 13 requests in one second of a
    5-a-second limit.  The refused four count: nothing more goes until they are a
    second old, then one, then the rate."""
    t = AdmissionThrottle()
    cold = [0.001 * seq for seq in range(1, 5)]
    for seq, at in enumerate(cold, 1):
        t.sent(seq, at)
    assert t.refused(1, 0.05, last_seq=4)
    most = math.floor(t.rate)
    assert most == 3  # (the guess: 95 % of 95 % of four a second)
    after = _sends_until(t, 0.05, 3.0, seq=4)
    # the next goes a second after the second of the four: from then on only three of
    # them are within a second, and it makes the guess's three
    assert after[0] == pytest.approx(cold[len(cold) - most] + 1.0)
    assert most_in_a_second(cold + after) <= len(cold)
    assert t.due(0.5, alone=True) == 0.5  # a request alone is never held


def test_only_a_cold_start_is_held_so() -> None:
    """A guess after the throttle was on (the first answers of an epoch were 429s) paces
    from its decrease as before: what it sent in the last second was let go by the
    throttle's own rate."""
    t = AdmissionThrottle()
    t.sent(1, 0.0)
    assert t.refused(1, 0.01, last_seq=1)
    seq = 1 + len(_sends_until(t, 0.01, 5.0, seq=1))
    assert t.refused(seq, 5.0, last_seq=seq)
    assert t.held_until <= 5.0
    assert t.due(5.0, alone=False) == pytest.approx(5.0 + 1.0 / t.rate)


# -- the fleet, against the providers ----------------------------------------
def test_a_quantized_provider_is_not_stormed() -> None:
    # issue 32: 300 a minute reported, 5 a second enforced, no Retry-After.  Before: 98 %
    # of the requests were 429s (2,047 requests a second through one relay).
    r = run(Quantized(per_s=5), agents=40, seconds=120.0)
    assert r.share_429 <= 0.05, r
    assert r.ok / 120.0 >= 0.9 * 5, r  # goodput: at least 90 % of the limit
    assert r.max_per_s <= 3 * 5, r  # the first second's slow start at most


def test_a_provider_that_says_nothing_is_not_stormed() -> None:
    r = run(Bare(per_s=5.0, burst=5.0), agents=40, seconds=120.0)
    assert r.share_429 <= 0.05, r
    assert r.ok / 120.0 >= 0.9 * 5, r


def test_a_lone_agent_never_waits_on_any_of_it() -> None:
    for provider in (Quantized(per_s=5), Bare(per_s=5.0, burst=5.0)):
        r = run(provider, agents=1, seconds=60.0)
        assert r.limited == 0 and r.longest_wait_s == 0.0, r


@pytest.mark.parametrize(
    ("provider", "capacity"),
    [
        (Textbook(start=0.0), 5.0),  # truthful headers, the key spent at first
        (Textbook(start=0.0, retry_after=False), 5.0),
        (Textbook(start=0.0, overstate=0.5), 5.0),  # says half a limit more is left
        (Textbook(start=0.0, overstate=0.5, retry_after=False), 5.0),
        (Textbook(start=0.0, drain=0.5), 2.5),  # half the refill goes to traffic unseen
    ],
    ids=["textbook", "no-retry-after", "overstated", "overstated-no-retry-after", "shared"],
)
def test_the_zoos_other_providers_are_not_stormed_either(
    provider: Textbook, capacity: float
) -> None:
    r = run(provider, agents=40, seconds=120.0)
    assert r.share_429 <= 0.05, r
    assert r.ok / 120.0 >= 0.9 * capacity, r
    assert r.max_per_s <= 2 * 5, r
    assert r.longest_wait_s <= 60.0, r  # max_wait_s


@pytest.mark.parametrize("name", ["textbook", "overstated", "quantized", "bare"])
def test_two_relays_that_share_nothing_stay_under_five_percent(name: str) -> None:
    """``serve --workers 2`` with no store: two throttles, each correcting itself on the
    429s its own requests collect, against one provider."""
    providers: dict[str, Callable[[float], Answer]] = {
        "textbook": Textbook(start=0.0),
        "overstated": Textbook(start=0.0, overstate=0.5),
        "quantized": Quantized(per_s=5),
        "bare": Bare(per_s=5.0, burst=5.0),
    }
    r = run(providers[name], agents=40, seconds=120.0, relays=2)
    assert r.share_429 <= 0.05, r
    assert r.ok / 120.0 >= 0.85 * 5, r
