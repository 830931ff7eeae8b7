"""Providers' rate-limit headers (core/admission/ratehead.py): read, checked, clamped."""

from __future__ import annotations

from typing import cast

import pytest

from unbroken.core.admission.ratehead import Reading, parse_duration, parse_rate_headers

NOW = 1_750_000_000.0  # a wall-clock time


def approx(x: float) -> float:
    """`pytest.approx`, typed as the float it stands for in a `Reading`."""
    return cast(float, pytest.approx(x))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5", 0.5),
        ("17", 17.0),
        ("", None),
        ("soon", None),
        ("1x", None),
        ("s1", None),
        ("1s garbage", None),
    ],
)
def test_durations(text: str, seconds: float | None) -> None:
    got = parse_duration(text)
    assert got == approx(seconds) if seconds is not None else got is None


def test_openai_headers() -> None:
    h = parse_rate_headers(
        {
            "x-ratelimit-limit-requests": "500",
            "x-ratelimit-remaining-requests": "499",
            "x-ratelimit-reset-requests": "120ms",
            "x-ratelimit-limit-tokens": "30000",
            "x-ratelimit-remaining-tokens": "29000",
            "x-ratelimit-reset-tokens": "2s",
        },
        now_wall=NOW,
    )
    assert h.requests == Reading(500, 499, approx(0.12))
    assert h.tokens == Reading(30000, 29000, 2.0)
    assert h.output is None and h.retry_after_s is None and h.problems == ()


def test_anthropic_headers_with_rfc3339_resets() -> None:
    h = parse_rate_headers(
        {
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": "2025-06-15T15:06:50Z",  # NOW + 10 s
            "anthropic-ratelimit-input-tokens-limit": "40000",
            "anthropic-ratelimit-input-tokens-remaining": "39000",
            "anthropic-ratelimit-input-tokens-reset": "2025-06-15T15:06:41.500Z",
            "anthropic-ratelimit-output-tokens-limit": "8000",
            "anthropic-ratelimit-output-tokens-remaining": "8000",
            "anthropic-ratelimit-output-tokens-reset": "2025-06-15T15:06:40Z",
            "retry-after": "10",
        },
        now_wall=NOW,
    )
    assert h.requests == Reading(50, 0, approx(10.0))
    assert h.tokens == Reading(40000, 39000, approx(1.5))
    assert h.output == Reading(8000, 8000, approx(0.0))
    assert h.retry_after_s == 10.0


def test_anthropic_combined_tokens_win_over_input_tokens() -> None:
    h = parse_rate_headers(
        {
            "anthropic-ratelimit-tokens-limit": "100",
            "anthropic-ratelimit-tokens-remaining": "7",
            "anthropic-ratelimit-input-tokens-limit": "90",
            "anthropic-ratelimit-input-tokens-remaining": "80",
        },
        now_wall=NOW,
    )
    assert h.tokens == Reading(100, 7, None)


def test_retry_after_forms() -> None:
    assert parse_rate_headers({"retry-after-ms": "1500"}, now_wall=NOW).retry_after_s == 1.5
    assert parse_rate_headers({"retry-after": "3"}, now_wall=NOW).retry_after_s == 3.0
    date = "Sun, 15 Jun 2025 15:06:45 GMT"  # NOW + 5 s
    got = parse_rate_headers({"retry-after": date}, now_wall=NOW).retry_after_s
    assert got == approx(5.0)


def test_no_headers_is_empty() -> None:
    h = parse_rate_headers({"content-type": "text/event-stream"}, now_wall=NOW)
    assert h.empty and h.problems == ()


@pytest.mark.parametrize(
    ("headers", "field", "value", "problem"),
    [
        # a remaining of -5: ignored (the limit stays)
        (
            {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "-5"},
            "requests",
            Reading(10, None, None),
            "negative",
        ),
        # non-numbers
        (
            {"x-ratelimit-limit-requests": "ten", "x-ratelimit-remaining-requests": "3"},
            "requests",
            Reading(None, 3, None),
            "not a number",
        ),
        (
            {"x-ratelimit-limit-tokens": "nan", "x-ratelimit-remaining-tokens": "inf"},
            "tokens",
            None,
            "not finite",
        ),
        # a limit of zero, or of 10^12
        (
            {"x-ratelimit-limit-requests": "0", "x-ratelimit-remaining-requests": "0"},
            "requests",
            Reading(None, 0, None),
            "out of range",
        ),
        (
            {"x-ratelimit-limit-tokens": "1e12", "x-ratelimit-remaining-tokens": "5"},
            "tokens",
            Reading(None, 5, None),
            "out of range",
        ),
        # remaining above the limit: clamped
        (
            {"x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "99"},
            "requests",
            Reading(10, 10, None),
            "clamped",
        ),
        # a reset of years: clamped to max_wait_s
        (
            {
                "x-ratelimit-limit-requests": "10",
                "x-ratelimit-remaining-requests": "0",
                "x-ratelimit-reset-requests": "87600h",
            },
            "requests",
            Reading(10, 0, 60.0),
            "clamped",
        ),
        (
            {
                "anthropic-ratelimit-requests-limit": "10",
                "anthropic-ratelimit-requests-remaining": "0",
                "anthropic-ratelimit-requests-reset": "2999-01-01T00:00:00Z",
            },
            "requests",
            Reading(10, 0, 60.0),
            "clamped",
        ),
        # a reset that is no time at all, or long past
        (
            {"x-ratelimit-limit-requests": "10", "x-ratelimit-reset-requests": "whenever"},
            "requests",
            Reading(10, None, None),
            "not a duration",
        ),
        (
            {
                "anthropic-ratelimit-requests-limit": "10",
                "anthropic-ratelimit-requests-reset": "2001-01-01T00:00:00Z",
            },
            "requests",
            Reading(10, None, None),
            "in the past",
        ),
    ],
)
def test_bad_values_are_ignored_or_clamped_and_named(
    headers: dict[str, str], field: str, value: Reading | None, problem: str
) -> None:
    h = parse_rate_headers(headers, now_wall=NOW, max_wait_s=60.0)
    assert getattr(h, field) == value
    assert any(problem in p for p in h.problems), h.problems


def test_absurd_retry_after_is_clamped_and_a_negative_one_ignored() -> None:
    h = parse_rate_headers({"retry-after": "315360000"}, now_wall=NOW, max_wait_s=30.0)
    assert h.retry_after_s == 30.0 and "clamped" in h.problems[0]
    h = parse_rate_headers({"retry-after": "-7"}, now_wall=NOW)
    assert h.retry_after_s is None and "in the past" in h.problems[0]
    h = parse_rate_headers({"retry-after-ms": "lots"}, now_wall=NOW)
    assert h.retry_after_s is None and "retry-after-ms" in h.problems[0]
