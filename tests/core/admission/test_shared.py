"""The rules for what a relay takes from shared state (`unbroken.core.admission.shared`),
sans-IO."""

from __future__ import annotations

import json
import math

import pytest

from unbroken.core.admission.health import QUOTA_LOOK_AGAIN_S, Change, HealthSettings
from unbroken.core.admission.shared import (
    MAX_COUNT,
    MAX_DATAGRAM,
    MAX_REOPENS,
    Garbage,
    Link,
    Message,
    Rejected,
    SharedBounds,
    Throttle,
    clamp_ttl,
    escape,
    fleet_share,
    lease_grant,
    parse_message,
    read_breaker,
    read_cooloff,
    read_count,
)

B = SharedBounds(max_open_s=0.5, max_retry_after_s=60.0, quota_cooloff_s=3600.0)
KEY = "r|http://up"
KNOWN = {KEY}


def msg(**fields: object) -> bytes:
    return json.dumps({"o": "peer", **fields}).encode()


def test_bounds_come_from_the_local_config() -> None:
    b = SharedBounds.of(HealthSettings(open_s=1.0, max_open_s=8.0, quota_cooloff_s=30), 5000)
    assert (b.bound("open"), b.bound("cooloff", "retry_after"), b.bound("cooloff", "quota")) == (
        8.0,
        5.0,
        30.0,
    )
    assert b.bound("cooloff", "anything else") == 5.0


@pytest.mark.parametrize(
    ("ttl", "want"),
    [
        (0.2, (0.2, False)),
        (1e9, (0.5, True)),
        (math.inf, (0.5, True)),
        (math.nan, None),
        (-1, None),
        ("1", None),
        (True, None),
        (None, None),
    ],
)
def test_a_ttl_is_a_number_within_the_bound(ttl: object, want: object) -> None:
    assert clamp_ttl(ttl, 0.5) == want


def test_a_valid_change_is_applied_and_a_huge_ttl_clamped() -> None:
    got = parse_message(msg(kind="open", k=KEY, ttl=1e9, r="5 failures", n=3), B, KNOWN)
    assert got == Message("peer", "open", Change(KEY, "open", 0.5, "5 failures", 3), clamped=True)
    got = parse_message(msg(kind="cooloff", k=KEY, ttl=1e9, r="quota"), B, KNOWN)
    assert isinstance(got, Message) and got.change is not None
    assert got.change.ttl_s == 3600.0
    got = parse_message(msg(kind="close", k=KEY), B, KNOWN)
    assert isinstance(got, Message) and got.change == Change(KEY, "close")
    got = parse_message(msg(kind="open", k=KEY, ttl=0.1, n=10**30), B, KNOWN)
    assert isinstance(got, Message) and got.change is not None
    assert got.change.reopens == MAX_REOPENS


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"o": "p", "kind": "open", "k": "r|http://up", "ttl": NaN}', Garbage.MESSAGE),
        (b'{"o": "p", "kind": "open", "k": "r|http://up", "ttl": Infinity}', Garbage.MESSAGE),
        (b'{"o": "p", "kind": "open", "k": "r|http://up", "ttl": -Infinity}', Garbage.MESSAGE),
        (msg(kind="open", k=KEY, ttl="1"), Garbage.MESSAGE),
        (msg(kind="open", k=KEY, ttl=-1), Garbage.MESSAGE),
        (msg(kind="open", k=KEY, ttl=1, n="3"), Garbage.MESSAGE),
        (msg(kind="open", k=KEY, ttl=1, n=True), Garbage.MESSAGE),
        (msg(kind="open", k=KEY, ttl=1, r=["x"]), Garbage.MESSAGE),
        (msg(kind="open", k="other|http://x", ttl=1), Garbage.UNKNOWN_KEY),
        (msg(kind="open", k=7, ttl=1), Garbage.MESSAGE),
        (msg(kind="explode", k=KEY), Garbage.MESSAGE),
        (msg(kind="hello", w="abc"), Garbage.MESSAGE),
        (msg(kind="hello", w=-1), Garbage.MESSAGE),
        (msg(kind="hello", w=10**6), Garbage.MESSAGE),
        (msg(kind="hello", w=1.5), Garbage.MESSAGE),
        (msg(kind="waiting", w=1, k=KEY), Garbage.MESSAGE),
        (msg(kind="waiting", w=1, k=KEY, ttl=float("nan")), Garbage.MESSAGE),
        (msg(kind="waiting", w=1, k=KEY, ttl="3"), Garbage.MESSAGE),
        (msg(kind="waiting", w=-1, k=KEY, ttl=1), Garbage.MESSAGE),
        (msg(kind="waiting", w=1, k=7, ttl=1), Garbage.MESSAGE),
        (msg(kind="waiting", k=KEY, ttl=1), Garbage.MESSAGE),
        (msg(kind="waiting", w=1, k="other|http://x", ttl=1), Garbage.UNKNOWN_KEY),
        (msg(kind="throttle", k=KEY, a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c=7, a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="", a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="a b", a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="--", a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="é1", a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="f" * 65, a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=7, c="abc", a=1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a="1", d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=True, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=-1, d=1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1e12), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1, q=2), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1, q=-1), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1, q="1"), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1, q=True), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1, q=0.5), Garbage.MESSAGE),
        (msg(kind="throttle", k=KEY, c="abc", a=1, d=1, q=None), Garbage.MESSAGE),
        (
            b'{"o": "p", "kind": "throttle", "k": "r|http://up", "c": "a", "a": NaN, "d": 1}',
            Garbage.MESSAGE,
        ),
        (msg(kind="throttle", k="other|http://x", c="abc", a=1, d=1), Garbage.UNKNOWN_KEY),
        (json.dumps({"o": 1, "kind": "hello", "w": 0}).encode(), Garbage.MESSAGE),
        (json.dumps({"o": "x" * 65, "kind": "hello", "w": 0}).encode(), Garbage.MESSAGE),
        (b"[1, 2]", Garbage.MESSAGE),
        (b"\xff\xfe", Garbage.MESSAGE),
        (b"[" * 3000, Garbage.MESSAGE),
        (b" " * (MAX_DATAGRAM + 1), Garbage.OVERSIZE),
    ],
)
def test_garbage_messages_are_rejected_never_raised(data: bytes, why: Garbage) -> None:
    assert parse_message(data, B, KNOWN) == Rejected(why)


def test_a_hello_names_a_worker_in_range() -> None:
    assert parse_message(msg(kind="hello", w=3), B, KNOWN) == Message("peer", "hello", worker=3)


def test_a_waiting_mark_names_a_worker_and_lasts_at_most_the_bound() -> None:
    # issue 36: the workers' channel splits the pacer's floor by these marks
    got = parse_message(msg(kind="waiting", w=2, k=KEY, ttl=1.0), B, KNOWN)
    assert got == Message("peer", "waiting", worker=2, key=KEY, ttl_s=1.0)
    got = parse_message(msg(kind="waiting", w=2, k=KEY, ttl=1e9), B, KNOWN)
    assert got == Message("peer", "waiting", worker=2, key=KEY, ttl_s=B.waiting_s, clamped=True)
    got = parse_message(msg(kind="waiting", w=2, k=KEY, ttl=0), B, KNOWN)
    assert isinstance(got, Message) and got.ttl_s == 0.0  # withdrawn


def test_a_throttle_message_names_a_key_and_a_credential_hash() -> None:
    # issue 32: a sibling's 429 lowered its admitted rate for this key and credential
    # (it had been seen to accept ``a`` a second, with ``d`` requests in flight or waiting)
    got = parse_message(msg(kind="throttle", k=KEY, c="0a1b2c3d4e5f", a=2.5, d=20), B, KNOWN)
    assert got == Message("peer", "throttle", key=KEY, cred="0a1b2c3d4e5f", anchor=2.5, demand=20)
    got = parse_message(msg(kind="throttle", k=KEY, c="-", a=0, d=0), B, KNOWN)  # no credential
    assert got == Message("peer", "throttle", key=KEY, cred="-")
    got = parse_message(msg(kind="throttle", k=KEY, c="f" * 64, a=1, d=1), B, KNOWN)
    assert isinstance(got, Message) and got.cred == "f" * 64
    # after the sender's own decrease, a question (answered); answering one, not; a
    # sender that does not say asks
    for q, asks in ((1, True), (0, False)):
        got = parse_message(msg(kind="throttle", k=KEY, c="-", a=1, d=1, q=q), B, KNOWN)
        assert isinstance(got, Message) and got.asks is asks
    assert got == Message("peer", "throttle", key=KEY, cred="-", anchor=1, demand=1, asks=False)


def test_text_is_escaped_into_one_line_and_cut() -> None:
    got = parse_message(msg(kind="open", k=KEY, ttl=0.1, r="x\n2026 forged\r\x1b[2J"), B, KNOWN)
    assert isinstance(got, Message) and got.change is not None
    assert got.change.reason == "x\\n2026 forged\\r\\x1b[2J"
    assert escape("é ok") == "é ok"
    assert escape("a" * 500) == "a" * 160 + "..."
    assert "\n" not in escape("\u2028\n\x00") and escape("\x00") == "\\x00"


def test_a_breaker_key_is_clamped_and_shortened() -> None:
    r = read_breaker(KEY, 999_999_999_999, b"2", B)
    assert r.change == Change(KEY, "open", 0.5, "fleet", 2)
    assert (r.shorten_ms, r.garbage) == (500, Garbage.TTL)
    r = read_breaker(KEY, -1, b"1", B)  # no expiry at all: forever, clamped
    assert r.change is not None and r.change.ttl_s == 0.5 and r.shorten_ms == 500
    r = read_breaker(KEY, 200, b"1", B)
    assert (r.change, r.shorten_ms, r.garbage) == (Change(KEY, "open", 0.2, "fleet", 1), None, None)
    r = read_breaker(KEY, 200, b"not-a-count", B)  # still open; the value is garbage
    assert r.change == Change(KEY, "open", 0.2, "fleet", 0) and r.garbage is Garbage.VALUE
    r = read_breaker(KEY, 200, b"99999", B)
    assert r.change is not None and r.change.reopens == MAX_REOPENS
    assert read_breaker(KEY, -2, None, B).change is None  # no key
    assert read_breaker(KEY, "x", None, B).change is None
    r = read_breaker(KEY, 200, ValueError("WRONGTYPE"), B)
    assert (r.change, r.garbage) == (None, Garbage.WRONG_TYPE)


def test_a_cooloff_key_is_bounded_by_its_reason() -> None:
    r = read_cooloff(KEY, 10**12, b"retry_after", B)
    assert r.change == Change(KEY, "cooloff", 60.0, "retry_after") and r.shorten_ms == 60_000
    r = read_cooloff(KEY, 10**12, b"quota", B)
    assert r.change is not None and r.change.ttl_s == 3600.0
    # issue 36: a value no relay writes is garbage, believed by none (it parked the fleet)
    for value in (b"\xff\n", b"a\nb", b"<anything>", b"", b"QUOTA", 7):
        r = read_cooloff(KEY, 5000, value, B)
        assert (r.change, r.garbage) == (None, Garbage.VALUE), value


def test_a_cooloff_message_with_an_unknown_reason_is_rejected() -> None:
    got = parse_message(msg(kind="cooloff", k=KEY, ttl=5.0, r="<anything>"), B, KNOWN)
    assert got == Rejected(Garbage.MESSAGE)
    got = parse_message(msg(kind="cooloff", k=KEY, ttl=5.0, r="retry_after"), B, KNOWN)
    assert isinstance(got, Message) and got.change == Change(KEY, "cooloff", 5.0, "retry_after")


def test_a_quota_cooloff_is_bounded_by_the_look_again_interval() -> None:
    b = SharedBounds.of(HealthSettings(quota_cooloff_s=3600), 60_000)
    assert b.bound("cooloff", "quota") == QUOTA_LOOK_AGAIN_S


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, (0, False)),
        (b"7", (7, False)),
        (7, (7, False)),
        (True, (0, True)),
        (b"abc", (0, True)),
        (b"-5", (0, True)),
        (b"99999999999999999999", (MAX_COUNT, True)),
        (b"\xff", (0, True)),
    ],
)
def test_counts_are_bounded_integers(value: object, want: tuple[int, bool]) -> None:
    assert read_count(value) == want


def test_waiters_count_while_their_mark_is_plausible() -> None:
    now = 1_000_000
    marks = {b"a": str(now + 3000).encode(), b"b": str(now + 1).encode(), b"c": b"0"}
    assert fleet_share(marks, now, 3000, 1000) == (2, False)
    assert fleet_share({b"x": str(now + 10**12).encode()}, now, 3000, 1000) == (1, True)
    assert fleet_share({b"x": b"abc"}, now, 3000, 1000) == (1, True)
    assert fleet_share(None, now, 3000, 1000) == (1, False)
    assert fleet_share({}, now, 3000, 1000) == (1, False)
    many = {str(i).encode(): str(now + 100).encode() for i in range(50)}
    assert fleet_share(many, now, 3000, 10) == (10, False)


def test_a_lease_is_at_most_what_was_asked() -> None:
    assert lease_grant(3, b"0.25", 4, 1.0) == (3, 0.25)
    assert lease_grant(10**9, b"0", 4, 1.0) == (4, 0.0)
    assert lease_grant(-1, b"0", 4, 1.0) == (-1, 0.0)
    assert lease_grant(-7, b"0", 4, 1.0) == (-1, 0.0)
    assert lease_grant(2, b"nan", 4, 1.0) == (2, 1.0)
    assert lease_grant(2, b"inf", 4, 1.0) == (2, 1.0)
    assert lease_grant(2, b"-3", 4, 1.0) == (2, 0.0)
    assert lease_grant(b"x", b"junk", 4, 1.0) == (-1, 1.0)


def test_a_throttle_allows_one_line_a_minute_per_kind() -> None:
    t = Throttle(60.0)
    assert t.allow("a", 0.0) and t.allow("b", 1.0)
    assert not t.allow("a", 59.0)
    assert t.allow("a", 60.0)


def test_the_link_reports_each_transition_once() -> None:
    link = Link(silent_s=3.0)
    assert link.failed(0.0)  # cannot connect at start: degraded, said once
    assert not link.failed(0.5) and not link.failed(1.0)
    assert link.answered(2.0) and link.up  # back, said once
    assert not link.answered(3.0) and not link.answered(4.0)
    assert not link.silent(6.9)
    assert link.silent(7.0)  # no answer for 3 s
    assert link.failed(7.0) and not link.silent(8.0)
    fresh = Link()
    assert not fresh.answered(0.0)  # first connection: nothing was lost
