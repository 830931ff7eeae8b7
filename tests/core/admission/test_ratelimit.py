"""The rate limiter (core/admission/ratelimit.py) with a fake clock: buckets learned from the
providers' headers, the fair line, AIMD concurrency, 429s."""

from __future__ import annotations

import math

import pytest

from unbroken.core.admission.ratehead import RateHeaders, Reading
from unbroken.core.admission.ratelimit import (
    Limiter,
    RateBoard,
    RateSettings,
    credential_hash,
    max_output_of,
)

K = "r|http://a"
#: for the tests that are not about the slow start: a ramp too wide to matter
WIDE = RateSettings(cold_start=100_000)


def rpm(limit: float, remaining: float, reset_s: float | None = None) -> RateHeaders:
    return RateHeaders(requests=Reading(limit, remaining, reset_s))


def tpm(limit: float, remaining: float, reset_s: float | None = None) -> RateHeaders:
    return RateHeaders(tokens=Reading(limit, remaining, reset_s))


def test_credential_hash_is_stable_short_and_never_the_key() -> None:
    key = "sk-proj-abcdefghijklmnop"
    h = credential_hash(key)
    assert h == credential_hash(key) and len(h) == 12 and key not in h and "abcdef" not in h
    assert credential_hash("sk-other") != h
    assert credential_hash("") == "-"


def test_max_output_of_a_body() -> None:
    assert max_output_of({"max_tokens": 4096}) == 4096
    assert max_output_of({"max_output_tokens": 100}) == 100
    assert max_output_of({"max_completion_tokens": 7, "x": 1}) == 7
    assert max_output_of({"max_tokens": True}) == 0
    assert max_output_of({"max_tokens": -3}) == 0
    assert max_output_of(None) == 0
    assert max_output_of({"generationConfig": {"maxOutputTokens": 8192}}) == 8192  # Gemini
    assert max_output_of({"generationConfig": {"maxOutputTokens": "8192"}}) == 0
    assert max_output_of({"generationConfig": None, "maxOutputTokens": 5}) == 0


def answered(lim: Limiter) -> Limiter:
    """The limiter has heard from the provider once (an answer with no rate headers)."""
    seq = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(seq, RateHeaders(), 0.0)
    lim.finish(seq, 0.0)
    return lim


def test_a_cold_start_sends_a_few_then_waits_for_the_providers_first_answer() -> None:
    lim = Limiter(K, "c", RateSettings(cold_start=4))
    first = lim.admit(1, "a", 10.0, 0.0)
    assert first > 0
    # a lone agent's own concurrent first requests never wait
    assert all(lim.admit(t, "b", 10.0, 0.0) for t in (2, 3, 4))
    assert [lim.admit(t, "c", 10.0, 0.0) for t in (5, 6, 7)] == [0, 0, 0]
    # woken by the answers, or at the latest when the oldest has waited max_wait_s
    assert lim.pump(0.0) == ([], 60.0)
    lim.learn(first, RateHeaders(), 0.05)  # its headers: no rate limit said
    lim.accepted(first, 0.05)  # ... on an answer the provider took: one more may go
    assert lim.pump(0.05)[0] == [5]
    for seq in (2, 3):  # a slow start: one more for each answer taken, so it doubles
        lim.accepted(seq, 0.06)
    assert lim.pump(0.06)[0] == [6, 7] and lim.ramp == 7.0


def test_the_slow_start_ends_past_max_concurrency_and_a_429_halves_it() -> None:
    lim = Limiter(K, "c", RateSettings(cold_start=2, max_concurrency=6))
    for t in range(4):
        seq = lim.admit(0, "s", 0.0, float(t))
        lim.accepted(seq, float(t))
        lim.accepted(seq, float(t))  # an answer counts once
        lim.finish(seq, float(t))  # ... and its end does not count it again
    assert lim.ramp is None  # 2 + 4 reached 6
    lim = Limiter(K, "c", RateSettings(cold_start=8))
    seqs = [lim.admit(0, "s", 0.0, 0.0) for _ in range(6)]
    lim.limited(seqs[0], None, 0.0, 0.0)
    assert lim.ramp == 3.0 and lim.throttle.enabled  # half of the six in flight
    lim.limited(seqs[1], None, 0.0, 0.0)  # the same epoch: once
    assert lim.ramp == 3.0
    # an attempt that ends well with no header event counts as an answer taken
    lim = Limiter(K, "c", RateSettings(cold_start=2))
    lim.finish(lim.admit(0, "s", 0.0, 0.0), 0.0, ok=True)
    assert lim.ramp == 3.0


def test_with_no_limit_reported_everything_goes() -> None:
    lim = answered(Limiter(K, "c", WIDE))
    seqs = [lim.admit(0, "s", 100.0, 0.0) for _ in range(1000)]
    assert all(seqs) and len(set(seqs)) == 1000 and lim.waited_total == 0


def test_requests_budget_learned_from_headers_then_turns_wait_for_the_refill() -> None:
    lim = Limiter(K, "c", RateSettings())
    seq = lim.admit(0, "s", 10.0, 0.0)
    # 60 a minute, 2 left, full again in 58 s: one more a second
    lim.learn(seq, rpm(60, 2, 58.0), 0.0)
    assert lim.admit(1, "a", 10.0, 0.0) > 0
    assert lim.admit(2, "b", 10.0, 0.0) > 0
    assert lim.admit(3, "c", 10.0, 0.0) == 0  # spent: waits in line
    assert list(lim.line) == [3]
    granted, due = lim.pump(0.0)
    assert granted == [] and due == pytest.approx(1.0)
    granted, due = lim.pump(1.0)
    assert granted == [3] and due is None
    assert lim.admit(3, "c", 10.0, 1.0) > 0  # claims its grant


def test_headers_count_what_was_admitted_after_the_answered_request() -> None:
    lim = Limiter(K, "c", WIDE)
    first = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(first, rpm(100, 50, 30.0), 0.0)  # 50 left
    a = lim.admit(0, "s", 0.0, 0.0)
    for _ in range(9):
        lim.admit(0, "s", 0.0, 0.0)
    # a's answer says 49 left; the nine sent after it are not counted by the provider yet
    lim.learn(a, rpm(100, 49, 30.0), 0.0)
    assert lim.buckets["requests"].level == pytest.approx(40.0)


def test_tokens_budget_charges_the_estimate_and_learns_tokens_per_byte() -> None:
    lim = Limiter(K, "c", RateSettings())
    assert lim.estimate(4000) == 1000.0
    assert lim.estimate(4000, max_output=500) == 1500.0
    seq = lim.admit(0, "s", 1000.0, 0.0)
    lim.learn(seq, tpm(10_000, 2_000, 48.0), 0.0)  # refills 8,000 in 48 s: 166.7 a second
    assert lim.admit(1, "s", 1500.0, 0.0) > 0  # 2,000 left
    assert lim.admit(2, "s", 1000.0, 0.0) == 0  # 500 left: waits
    _, due = lim.pump(0.0)
    assert due == pytest.approx(3.0)  # 500 more at 166.7 a second
    # the provider reports 2,000 input tokens for 4,000 bytes: 0.5 a byte, learned smoothly
    lim.withdraw(2)
    lim.finish(seq, 0.0, tokens_in=2000, body_bytes=4000)
    assert 0.25 < lim.tokens_per_byte < 0.5
    for _ in range(30):
        s = lim.admit(0, "t", 0.0, 0.0)
        lim.finish(s, 0.0, tokens_in=2000, body_bytes=4000)
    assert lim.tokens_per_byte == pytest.approx(0.5, rel=1e-3)


def test_a_request_larger_than_the_limit_goes_with_a_full_bucket() -> None:
    lim = Limiter(K, "c", RateSettings())
    lim.learn(lim.admit(0, "s", 0.0, 0.0), tpm(1000, 1000, 0.0), 0.0)
    assert lim.admit(1, "s", 5000.0, 0.0) > 0  # capped at the limit: never waits forever
    assert lim.admit(2, "s", 5000.0, 0.0) == 0
    _, due = lim.pump(0.0)
    assert due is not None and math.isfinite(due)


def test_a_busy_session_cannot_starve_the_others() -> None:
    lim = Limiter(K, "c", WIDE)
    lim.learn(lim.admit(0, "s", 0.0, 0.0), rpm(60, 0, 60.0), 0.0)  # one a second
    ticket = 0
    for _ in range(20):  # a busy agent queues twenty turns first
        ticket += 1
        assert lim.admit(ticket, "busy", 0.0, 0.0) == 0
    for name in ("a", "b", "c"):
        ticket += 1
        assert lim.admit(ticket, name, 0.0, 0.0) == 0
    order: list[int] = []
    t = 0.0
    while len(order) < 8:
        granted, due = lim.pump(t)
        order.extend(granted)
        assert due is not None
        t = due
    # busy, a, b, c, busy, busy...: the three light agents are through by the fourth grant
    assert order[:4] == [1, 21, 22, 23] and order[4:] == [2, 3, 4, 5]


def test_a_turn_keeps_its_place_and_a_withdrawn_grant_goes_back() -> None:
    lim = Limiter(K, "c", RateSettings())
    lim.learn(lim.admit(0, "s", 0.0, 0.0), rpm(60, 0, 60.0), 0.0)
    assert lim.admit(1, "a", 0.0, 0.0) == 0
    assert lim.admit(2, "b", 0.0, 0.0) == 0
    assert lim.admit(1, "a", 0.0, 0.5) == 0 and list(lim.line) == [1, 2]
    assert not lim.peek(2, 0.0, 5.0)  # not the head
    granted, _ = lim.pump(1.0)
    assert granted == [1]
    level = lim.buckets["requests"].level
    lim.withdraw(1)  # its turn went away: the reserved request goes back
    assert lim.buckets["requests"].level == pytest.approx(level + 1)
    granted, _ = lim.pump(1.0)
    assert granted == [2]


def test_an_unclaimed_grant_expires() -> None:
    lim = Limiter(K, "c", RateSettings())
    lim.learn(lim.admit(0, "s", 0.0, 0.0), rpm(60, 0, 60.0), 0.0)
    lim.admit(1, "a", 0.0, 0.0)
    assert lim.pump(1.0)[0] == [1]
    lim.pump(10.0)
    assert 1 not in lim.granted and len(lim.running) == 1  # only the first, unfinished


def window(lim: Limiter) -> float | None:
    """The AIMD window (read through a call: each read is fresh to the type checker)."""
    return lim.window


def test_aimd_window_halves_on_a_429_once_per_window_and_grows_back() -> None:
    lim = answered(Limiter(K, "c", RateSettings(decrease=0.5, cold_start=100_000)))
    seqs = [lim.admit(0, "s", 0.0, 0.0) for _ in range(16)]
    assert lim.window is None
    for s in seqs[:4]:  # four 429s from requests already in flight: one decrease
        lim.limited(s, 0.0, 0.0, 0.0)
        lim.finish(s, 0.0, ok=False)
    assert window(lim) == 8.0
    # 12 still run: the window is full, the next waits for a finish
    assert lim.admit(100, "s", 0.0, 0.0) == 0
    assert lim.pump(0.0) == ([], 60.0)  # a finish, or max_wait_s at the latest
    for s in seqs[4:9]:
        lim.finish(s, 0.0)
    granted, _ = lim.pump(2.0)  # the window has room, and the throttle (0.9 a second) a token
    assert granted == [100]
    assert 8.0 < (window(lim) or 0.0) < 9.0  # one more per window of answers
    later = lim.admit(0, "s", 0.0, 0.0)
    assert later == 0  # the window is full again (7 old + the granted one)


def test_a_429_blocks_until_retry_after_or_the_learned_refill() -> None:
    lim = Limiter(K, "c", RateSettings(max_wait_s=30.0))
    s = lim.admit(0, "s", 0.0, 0.0)
    assert lim.limited(s, 2.5, 0.0, 10.0) == 12.5
    lim.finish(s, 10.0, ok=False)
    assert not lim.peek(0, 0.0, 12.0) and lim.peek(0, 0.0, 12.5)
    s = lim.admit(0, "s", 0.0, 13.0)
    assert lim.limited(s, 1e9, 0.0, 13.0) == 43.0  # clamped
    # no Retry-After, the 429's headers say the budget is spent: until it refills
    lim = Limiter(K, "c", RateSettings())
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, rpm(120, 0, 60.0), 0.0)  # 2 a second
    assert lim.limited(s, None, 0.0, 0.0) == pytest.approx(0.5)
    assert lim.window is None  # explained by the learned budget: no smaller window
    # nothing learned at all: no block (the retry delay and the throttle pace it)
    lim = Limiter(K, "c", RateSettings())
    assert lim.limited(lim.admit(0, "s", 0.0, 0.0), None, 0.0, 0.0) == 0.0
    assert lim.throttle.enabled


def test_output_budget_spent_blocks_until_it_refills() -> None:
    lim = Limiter(K, "c", RateSettings())
    s = lim.admit(0, "s", 0.0, 0.0)
    lim.learn(s, RateHeaders(output=Reading(8000, 0, 4.0)), 0.0)
    assert lim.admit(1, "s", 100.0, 0.0) == 0
    _, due = lim.pump(0.0)
    assert due == pytest.approx(60 / 8000)  # one token at 8,000 a minute, the most it refills
    granted, _ = lim.pump(1.0)
    assert granted == [1]


def test_board_pumps_every_credential_of_an_upstream_and_pokes_only_when_someone_waits() -> None:
    board = RateBoard()
    poked: list[str] = []
    board.poke = poked.append
    a, b = board.get(K, "a"), board.get(K, "b")
    for lim in (a, b):
        lim.learn(lim.admit(0, "s", 0.0, 0.0), rpm(60, 0, 60.0), 0.0)
    board.changed(K)
    assert poked == []
    a.admit(1, "x", 0.0, 0.0)
    b.admit(2, "y", 0.0, 0.0)
    board.changed(K)
    assert poked == [K]
    granted, due = board.pump(K, 1.0)
    assert sorted(granted) == [1, 2] and due is None
    assert [v["credential"] for v in board.view(K, 1.0)] == ["a", "b"]


def _fleet_line(n: int) -> Limiter:
    """A limiter whose requests budget (300 a minute) is the fleet's, none leased yet,
    with ``n`` turns in its line."""
    lim = Limiter(K, "c", RateSettings())
    seq = lim.admit(0, "s", 10.0, 0.0)
    lim.learn(seq, rpm(300, 0, 60.0), 0.0)
    lim.finish(seq, 0.0)
    b = lim.buckets["requests"]
    b.shared, b.level = True, 0.0
    for t in range(1, n + 1):
        assert lim.admit(t, f"s{t}", 10.0, 0.0) == 0
    return lim


def test_a_relay_leases_what_it_can_send_soon_less_what_it_holds() -> None:
    """`Limiter.lease_want`: a relay that leased more than it can send holds the fleet's
    budget from its siblings (the fleet's bucket holding a second's share and leases
    of up to sixteen whatever the throttle let go: `quantized` over two relays fell to
    72 to 93 % goodput in the simulator, seeds 1-4)."""
    lim = _fleet_line(20)
    assert lim.fleet_hold("requests") == 5.0 and lim.fleet_hold("tokens") == 0.0
    # a second's share: five at once, five more within the second
    assert lim.lease_want(0.0, 16, 1.0) == 10
    assert lim.lease_want(0.0, 8, 1.0) == 8
    lim.buckets["requests"].level = 4.0  # four leased already
    assert lim.lease_want(0.0, 16, 1.0) == 6
    lim.buckets["requests"].level = 12.0
    assert lim.lease_want(0.0, 16, 1.0) == 0
    # a throttle at one a second, its token spent: one within the second
    lim.buckets["requests"].level = 0.0
    t = lim.throttle
    t.enabled, t.rate, t.tokens, t._t = True, 1.0, 0.0, 0.0
    assert lim.lease_want(0.0, 16, 1.0) == 1
    assert lim.lease_want(0.0, 16, 3.0) == 3
    # however low the throttle, a turn in line is leased for: never a stuck line
    t.rate = 0.05
    assert lim.lease_want(0.0, 16, 1.0) == 1
    # fewer in line than it could send: the line
    assert _fleet_line(3).lease_want(0.0, 16, 1.0) == 3
    assert _fleet_line(0).lease_want(0.0, 16, 1.0) == 0
