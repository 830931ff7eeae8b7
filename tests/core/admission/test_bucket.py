"""A budget's refill as the provider's reports show it (core/admission/bucket.py): a key
shared with traffic the relay does not see.

Issue 32: the `shared` provider of the zoo takes half of each refill for a consumer the
relay never sees, and reports the key's limit and reset truthfully.  The relay's bucket
refilled at the key's rate, let go requests the provider then refused, and only the
throttle found out, one 429 every 20 to 30 s, each cutting it (one relay: a turn
waited 33 s; with 70 % taken, the whole `max_wait_s`).
"""

from __future__ import annotations

import math

import pytest

from core.admission.ratesim import Answer, Textbook, run
from unbroken.core.admission.bucket import GAIN, MARGIN, MAX_DRAIN, QUIET, WINDOW_S, Drift
from unbroken.core.admission.ratehead import RateHeaders, Reading
from unbroken.core.admission.ratelimit import Limiter, RateSettings

K = "r|http://a"


def _steady(drift: Drift, *, rate: float, others: float, seconds: float) -> None:
    """Reports every 0.4 s of a key refilling at ``rate`` of which ``others`` go to
    traffic unseen, the relay's model refilled at what the drift leaves it (the relay
    sends nothing: what it sends counts in both)."""
    now, true = 0.0, 10.0
    drift.observe(true, true, rate, now, spent=False)
    while now < seconds:
        model = true + 0.4 * drift.reckon(rate)
        true += 0.4 * (rate - others)
        now += 0.4
        drift.observe(model, true, rate, now, spent=False)
        true = min(true, 20.0)


def test_the_drain_follows_what_others_take_and_the_margin_stays_a_margin() -> None:
    d = Drift()
    _steady(d, rate=5.0, others=2.5, seconds=60.0)
    assert d.drain == pytest.approx(2.5, rel=0.05)
    # it reckons on the drain and a margin more: never on refill the others take
    assert d.reckon(5.0) == pytest.approx(5.0 - (1 + MARGIN) * 2.5, rel=0.05)
    assert d.reckon(5.0) < 2.5


def test_no_others_no_drain() -> None:
    d = Drift()
    _steady(d, rate=5.0, others=0.0, seconds=60.0)
    assert d.drain == 0.0
    assert d.reckon(5.0) == 5.0


def test_a_report_above_the_model_brings_the_drain_down_never_below_none() -> None:
    d = Drift()
    _steady(d, rate=5.0, others=2.5, seconds=30.0)
    assert d.drain > 2.0
    _steady(d, rate=5.0, others=0.0, seconds=60.0)  # the other consumer went away
    assert d.drain < 0.1
    for _ in range(20):  # the provider says far more is left than modelled
        d.observe(0.0, 100.0, 5.0, (_ + 200) * 1.0, spent=False)
    assert d.drain == 0.0


def test_the_drain_is_bounded_by_its_share_of_the_rate() -> None:
    d = Drift()
    for i in range(100):  # a report far below the model, every second
        d.observe(1_000.0, 0.0, 5.0, float(i), spent=True)
    assert d.drain == pytest.approx(MAX_DRAIN * 5.0)
    assert d.reckon(5.0) > 0.0


def test_below_a_spent_report_the_model_measures_nothing() -> None:
    # the model's debt is its own refused requests, which the provider did not count
    d = Drift()
    for i in range(20):
        d.observe(-3.0, 0.0, 5.0, float(i), spent=True)
    assert d.drain == 0.0
    # but a spent report while the model had room is a drain of at least that room
    for i in range(20, 40):
        d.observe(1.0, 0.0, 5.0, float(i), spent=True)
    assert d.drain > 0.0


def test_one_window_moves_it_by_its_gain_of_the_measure() -> None:
    d = Drift()
    d.observe(0.0, 0.0, 5.0, 0.0, spent=False)
    d.observe(2.0, 0.0, 5.0, 1.0, spent=False)  # half a window: no move yet
    assert d.drain == 0.0
    d.observe(2.0, 0.0, 5.0, WINDOW_S, spent=False)
    assert d.drain == pytest.approx(GAIN * 4.0 / WINDOW_S)


def test_garbage_is_ignored_and_a_restart_forgets_the_window() -> None:
    d = Drift()
    d.observe(0.0, 0.0, 5.0, 0.0, spent=False)
    for bad in (math.nan, math.inf, -math.inf):
        d.observe(bad, 0.0, 5.0, 1.0, spent=False)
        d.observe(0.0, bad, 5.0, 1.0, spent=False)
        d.observe(0.0, 0.0, bad, 1.0, spent=False)
    d.observe(0.0, 0.0, 5.0, 0.5, spent=False)  # time going back: a new start
    assert d.drain == 0.0
    d.observe(3.0, 0.0, 5.0, 1.5, spent=False)
    d.restart()
    d.observe(0.0, 0.0, 5.0, 10.0, spent=False)  # (a fresh start: no measure)
    d.observe(0.0, 0.0, 5.0, 10.0 + WINDOW_S, spent=False)
    assert d.drain == 0.0


def test_a_limiters_requests_bucket_reckons_on_it_and_says_so() -> None:
    lim = Limiter(K, "c", RateSettings())
    t = 0.0
    lim.learn(lim.admit(0, "s", 0.0, t), RateHeaders(requests=Reading(300, 10, 58.0)), t)
    b = lim.buckets["requests"]
    assert b.drift is not None and b.rate == pytest.approx(5.0)
    left = 10.0
    for _ in range(100):  # 2.5 a second go elsewhere; the relay sends nothing
        t += 0.5
        left = min(300.0, left + 0.5 * 2.5)
        lim.learn(lim.admit(0, "s", 0.0, t), RateHeaders(requests=Reading(300, left, 1.0)), t)
    assert b.told == pytest.approx(5.0, rel=0.01)  # the provider's own rate, as it says
    assert b.rate == pytest.approx(5.0 - (1 + MARGIN) * 2.5, rel=0.1)
    view = lim.view(t)["buckets"]["requests"]
    assert view["others_per_s"] == pytest.approx(2.5, rel=0.1)


@pytest.mark.parametrize("taken", [0.3, 0.5, 0.7])
def test_one_relay_on_a_key_others_share_stops_being_refused(taken: float) -> None:
    """Before: a 429 every 20 to 30 s after the start for as long as the run went (the
    throttle's probes), each one cutting the rate; the longest wait 22, 33 and 60 s."""
    p = Textbook(start=0.0, drain=taken)
    refused: list[float] = []

    def provider(now: float) -> Answer:
        a = p(now)
        if a.status == 429:
            refused.append(now)
        return a

    r = run(provider, agents=40, seconds=120.0)
    assert [t for t in refused if t > 10.0] == [], refused  # the start's, and no more
    assert r.ok / 120.0 >= 0.9 * 5.0 * (1 - taken), r
    assert r.longest_wait_s <= 30.0, r


# -- a fleet's bucket: what the store granted, against what the key reports ------------
def test_a_fleets_window_measures_what_others_took() -> None:
    """From the second window the key is low on (the first is a fall, not yet a key
    others keep low)."""
    d = Drift()
    # 5 a second refilled; the fleet was granted 2.5 a second and the key stayed spent:
    # others took the rest
    for i in range(31):
        d.observe_fleet(0.0, 2.5 * i, 5.0, 300.0, float(i))
    assert d.drain == pytest.approx(2.5, rel=0.05)
    assert d.reckon(5.0) == pytest.approx(5.0 - (1 + MARGIN) * 2.5, rel=0.05)
    # they went away: the fleet takes all of it, and the drain follows
    for i in range(31, 80):
        d.observe_fleet(0.0, 2.5 * 30 + 5.0 * (i - 30), 5.0, 300.0, float(i))
    assert d.drain < 0.01 and d.reckon(5.0) == 5.0


def test_a_fleets_window_measures_nothing_while_the_key_has_room() -> None:
    # a key with room does not take its refill (nor does a limit over a sliding minute,
    # whose count falls with each request: the simulator's quantized provider)
    d = Drift()
    for i in range(60):
        d.observe_fleet(300.0 - 5.0 * i, 5.0 * i, 5.0, 300.0, float(i))
    # then the minute turns: what it reports left stays put while the fleet sends
    for i in range(60, 180):
        d.observe_fleet(0.0, 5.0 * i, 5.0, 300.0, float(i))
        # (the last of the fall, in the second window low: a tenth of the rate at
        # most, for a window, and it fades)
        assert d.drain <= 0.1 * 5.0, i
    assert d.drain < 0.01


def test_a_fleets_total_going_back_starts_the_window_again() -> None:
    d = Drift()
    d.observe_fleet(0.0, 1000.0, 5.0, 300.0, 0.0)
    d.observe_fleet(0.0, 0.0, 5.0, 300.0, 10.0)  # the store forgot the bucket
    assert d.drain == 0.0
    d.observe_fleet(0.0, 50.0, 5.0, 300.0, 20.0)  # the fleet took all of it
    assert d.drain == 0.0
    for bad in (math.nan, math.inf):
        d.observe_fleet(bad, 50.0, 5.0, 300.0, 30.0)
        d.observe_fleet(0.0, bad, 5.0, 300.0, 30.0)
    assert d.drain == 0.0


def test_a_quiet_drain_is_not_reckoned_on() -> None:
    d = Drift()
    d.drain = 0.9 * QUIET * 5.0
    assert d.reckon(5.0) == 5.0
    d.drain = 2.0 * QUIET * 5.0
    assert d.reckon(5.0) < 5.0


def test_a_limiter_reckons_on_its_fleets_drift_only_while_shared() -> None:
    lim = Limiter(K, "c", RateSettings())
    lim.learn(lim.admit(0, "s", 0.0, 0.0), RateHeaders(requests=Reading(300, 0, 60.0)), 0.0)
    b = lim.buckets["requests"]
    lim.fleet_report("requests", 0.0, 0.0)
    lim.fleet_report("requests", 10.0, 10.0)  # not the fleet's yet: nothing
    assert b.drift is not None and b.drift.drain == 0.0
    b.shared = True
    for i in range(2, 12):
        lim.fleet_report("requests", 20.0 * i, 10.0 * i)  # 2 a second granted of 5
    assert b.rate == pytest.approx(5.0 - (1 + MARGIN) * 3.0, rel=0.1)
    lim.fleet_report("nothing", 1.0, 100.0)  # no such bucket: nothing
