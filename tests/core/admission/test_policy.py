"""Retry policy (sans-IO): delays, rotation, Retry-After, exception classes."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import socket
import ssl
from datetime import UTC, datetime
from email.utils import format_datetime

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey

from unbroken.core.admission.policy import (
    RETRY_STATUSES,
    Failure,
    FailureClass,
    RetryPolicy,
    RetryState,
    is_retryable_status,
    parse_retry_after,
)
from unbroken.relay.errors import ERRNO_CLASSES, EXCEPTION_CLASSES, classify_exception

KEY = ConnectionKey("api.example.com", 443, True, True, None, None, None)


def _value(c: FailureClass) -> str:
    return c.value


CONNECT_LEVEL: set[FailureClass] = {
    FailureClass.DNS,
    FailureClass.REFUSED,
    FailureClass.UNREACHABLE,
    FailureClass.CONNECT_FAILED,
    FailureClass.CONNECT_TIMEOUT,
    FailureClass.TLS,
}

CONNECT_SORTED = sorted(CONNECT_LEVEL, key=_value)
OTHERS_SORTED = sorted(set(FailureClass) - CONNECT_LEVEL, key=_value)

#: the old default: a fixed 250 ms (the default is now exponential with full jitter)
FIXED_250 = RetryPolicy(backoff="fixed", delay_ms=250)


def fail(
    cls: FailureClass = FailureClass.RESET,
    retry_after: float | None = None,
    status: int | None = None,
) -> Failure:
    return Failure(cls, "test", status=status, retry_after_s=retry_after)


# ---------------------------------------------------------------------------
# Delays


@pytest.mark.parametrize("retry_number", [1, 2, 5, 50, 10_000])
def test_fixed_delay(retry_number: int) -> None:
    policy = FIXED_250
    assert policy.base_delay(retry_number, random.Random(0)) == 0.25


def test_fixed_delay_capped_by_max_delay() -> None:
    fixed = RetryPolicy(backoff="fixed", delay_ms=5000, max_delay_ms=1000)
    assert fixed.base_delay(1, random.Random(0)) == 1.0


def test_exponential_full_jitter_bounds_and_determinism() -> None:
    policy = RetryPolicy(delay_ms=100, backoff="exponential", max_delay_ms=5_000)
    rng = random.Random(1234)
    twin = random.Random(1234)
    for n in range(1, 40):
        cap = min(5_000, 100 * 2 ** (n - 1)) / 1000
        d = policy.base_delay(n, rng)
        assert 0.0 <= d <= cap
        assert d == twin.uniform(0, cap * 1000) / 1000  # exactly the seeded draw


def test_exponential_jitter_covers_its_range() -> None:
    policy = RetryPolicy(delay_ms=100, backoff="exponential", max_delay_ms=800)
    rng = random.Random(7)
    for n, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 0.8), (60, 0.8)]:
        samples = [policy.base_delay(n, rng) for _ in range(400)]
        assert max(samples) <= cap
        assert min(samples) >= 0.0
        assert max(samples) > 0.9 * cap  # full jitter reaches near the cap
        assert min(samples) < 0.1 * cap  # ... and near zero


def test_exponential_with_huge_retry_number_does_not_overflow() -> None:
    policy = RetryPolicy(delay_ms=250, backoff="exponential", max_delay_ms=30_000)
    assert 0 <= policy.base_delay(10**9, random.Random(0)) <= 30.0


def test_clamp_retry_after() -> None:
    policy = RetryPolicy(backoff="fixed", max_retry_after_ms=60_000)
    assert policy.clamp_retry_after(5) == 5
    assert policy.clamp_retry_after(3600) == 60.0
    assert policy.clamp_retry_after(float("inf")) == 60.0


# ---------------------------------------------------------------------------
# Attempts and rotation


def test_max_attempts_exhaustion() -> None:
    state = RetryState(RetryPolicy(max_attempts=3), n_upstreams=1, rng=random.Random(0))
    assert not state.exhausted()
    for expected_attempts in (1, 2, 3):
        state.next_upstream(0.0)
        assert state.attempts == expected_attempts
        assert state.exhausted() == (expected_attempts == 3)


def test_unlimited_attempts() -> None:
    state = RetryState(RetryPolicy(max_attempts=0), n_upstreams=2, rng=random.Random(0))
    for t in range(1000):
        state.next_upstream(float(t))
        state.record_failure(fail(), float(t))
    assert not state.exhausted()
    assert state.retries == 1000


def test_rotation_wraps() -> None:
    state = RetryState(RetryPolicy(), n_upstreams=3, rng=random.Random(0))
    assert [state.next_upstream(0.0) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_single_upstream_always_zero() -> None:
    state = RetryState(RetryPolicy(), n_upstreams=1, rng=random.Random(0))
    assert [state.next_upstream(0.0) for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("cls", CONNECT_SORTED)
def test_connection_failure_reroutes_at_once_when_another_upstream_exists(
    cls: FailureClass,
) -> None:
    state = RetryState(FIXED_250, n_upstreams=2, rng=random.Random(0))
    assert state.next_upstream(0.0) == 0
    assert state.record_failure(fail(cls), 0.0) == 0.0
    assert state.next_upstream(0.0) == 1


@pytest.mark.parametrize("cls", CONNECT_SORTED)
def test_connection_failure_with_one_upstream_waits(cls: FailureClass) -> None:
    state = RetryState(FIXED_250, n_upstreams=1, rng=random.Random(0))
    state.next_upstream(0.0)
    assert state.record_failure(fail(cls), 0.0) == 0.25


@pytest.mark.parametrize("cls", OTHERS_SORTED)
def test_other_failures_wait_even_with_another_upstream(cls: FailureClass) -> None:
    state = RetryState(FIXED_250, n_upstreams=2, rng=random.Random(0))
    state.next_upstream(0.0)
    assert state.record_failure(fail(cls), 0.0) == 0.25
    assert state.next_upstream(0.25) == 1  # still rotates


def test_reroutes_at_once_property() -> None:
    for cls in FailureClass:
        assert cls.reroutes_at_once == (cls in CONNECT_LEVEL)


def test_connection_failure_does_not_reroute_to_a_cooling_upstream() -> None:
    state = RetryState(FIXED_250, n_upstreams=2, rng=random.Random(0))
    state.next_upstream(0.0)  # 0
    state.record_failure(fail(FailureClass.STATUS, retry_after=30.0, status=429), 0.0)
    assert state.next_upstream(0.25) == 1
    # 1 refuses, 0 is cooling off until t=30: no free upstream, so no instant reroute
    assert state.record_failure(fail(FailureClass.REFUSED), 0.25) == 0.25


def test_retry_after_cooloff_skips_upstream_while_another_is_free() -> None:
    state = RetryState(FIXED_250, n_upstreams=3, rng=random.Random(0))
    assert state.next_upstream(100.0) == 0
    wait = state.record_failure(fail(FailureClass.STATUS, retry_after=10.0, status=429), 100.0)
    assert wait == 0.25  # another upstream is free: the normal delay
    assert state.cooloff_until[0] == 110.0
    assert state.next_upstream(100.25) == 1
    state.record_failure(fail(FailureClass.STATUS, status=503), 100.25)
    assert state.next_upstream(100.5) == 2
    state.record_failure(fail(FailureClass.RESET), 100.5)
    assert state.next_upstream(100.75) == 1  # 0 skipped: still cooling off
    state.record_failure(fail(FailureClass.RESET), 100.75)
    assert state.next_upstream(101.0) == 2
    state.record_failure(fail(FailureClass.RESET), 101.0)
    assert state.next_upstream(110.0) == 0  # cool-off over: back in rotation


def test_retry_after_single_upstream_waits_the_retry_after() -> None:
    state = RetryState(FIXED_250, n_upstreams=1, rng=random.Random(0))
    state.next_upstream(0.0)
    assert state.record_failure(fail(FailureClass.STATUS, retry_after=7.0, status=503), 0.0) == 7.0
    assert state.next_upstream(7.0) == 0


def test_retry_after_clamped_by_max_retry_after_ms() -> None:
    policy = RetryPolicy(backoff="fixed", delay_ms=250, max_retry_after_ms=2_000)
    state = RetryState(policy, n_upstreams=1, rng=random.Random(0))
    state.next_upstream(0.0)
    assert state.record_failure(fail(FailureClass.STATUS, retry_after=3600.0), 0.0) == 2.0
    assert state.cooloff_until[0] == 2.0


def test_retry_after_zero() -> None:
    state = RetryState(FIXED_250, n_upstreams=1, rng=random.Random(0))
    state.next_upstream(0.0)
    assert state.record_failure(fail(FailureClass.STATUS, retry_after=0.0), 0.0) == 0.0


def test_all_upstreams_cooling_waits_for_the_soonest() -> None:
    state = RetryState(FIXED_250, n_upstreams=2, rng=random.Random(0))
    state.next_upstream(0.0)
    state.record_failure(fail(FailureClass.STATUS, retry_after=10.0), 0.0)  # 0 until 10
    assert state.next_upstream(0.25) == 1
    wait = state.record_failure(fail(FailureClass.STATUS, retry_after=5.0), 1.0)  # 1 until 6
    assert wait == 5.0
    assert state.next_upstream(6.0) == 1


def test_next_upstream_when_everyone_cools_picks_the_soonest_free() -> None:
    state = RetryState(
        RetryPolicy(),
        n_upstreams=3,
        rng=random.Random(0),
        cooloff_until={0: 50.0, 1: 20.0, 2: 30.0},
    )
    assert state.next_upstream(0.0) == 1
    assert state.attempts == 1


def test_honor_retry_after_false_ignores_it() -> None:
    policy = RetryPolicy(backoff="fixed", delay_ms=250, honor_retry_after=False)
    state = RetryState(policy, n_upstreams=1, rng=random.Random(0))
    state.next_upstream(0.0)
    assert state.record_failure(fail(FailureClass.STATUS, retry_after=30.0), 0.0) == 0.25
    assert state.cooloff_until == {}


def test_exponential_backoff_grows_with_retries() -> None:
    policy = RetryPolicy(delay_ms=100, backoff="exponential", max_delay_ms=100_000)
    state = RetryState(policy, n_upstreams=1, rng=random.Random(99))
    twin = random.Random(99)
    for n in range(1, 12):
        state.next_upstream(0.0)
        wait = state.record_failure(fail(), 0.0)
        assert wait == twin.uniform(0, min(100_000, 100 * 2 ** (n - 1))) / 1000


def test_failure_label() -> None:
    assert fail(FailureClass.STATUS, status=429).label == "429"
    assert fail(FailureClass.RESET).label == "connection_reset"


# ---------------------------------------------------------------------------
# Retry-After parsing

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"retry-after": "5"}, 5.0),
        ({"retry-after": " 5 "}, 5.0),
        ({"retry-after": "1.5"}, 1.5),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "-3"}, None),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "0"}, 0.0),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # ms wins
        ({"retry-after-ms": "-1", "retry-after": "9"}, 9.0),  # bad ms falls back
        ({"retry-after-ms": "soon", "retry-after": "9"}, 9.0),
        ({"retry-after-ms": "nan", "retry-after": "4"}, 4.0),
        ({"retry-after-ms": "soon"}, None),
        ({"retry-after": "soon"}, None),
        ({"retry-after": ""}, None),
        ({"retry-after": "Wed, 99 Foo 2015 07:28:00 GMT"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": "Thu, 01 Jan 2026 12:00:30 GMT"}, 30.0),
        ({"retry-after": "Thu, 01 Jan 2026 11:59:00 GMT"}, 0.0),  # in the past
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers, now_wall=NOW) == expected


def test_parse_retry_after_http_date_roundtrip() -> None:
    when = datetime(2030, 6, 15, 8, 30, 0, tzinfo=UTC)
    header = format_datetime(when, usegmt=True)
    assert parse_retry_after({"retry-after": header}, now_wall=when.timestamp() - 90) == 90.0


def test_parse_retry_after_with_multidict_headers() -> None:
    from multidict import CIMultiDict

    headers = CIMultiDict({"Retry-After": "12"})
    assert parse_retry_after(headers, now_wall=NOW) == 12.0
    headers = CIMultiDict({"Retry-After-Ms": "40"})
    assert parse_retry_after(headers, now_wall=NOW) == 0.04


def test_parse_retry_after_infinite_is_clamped_by_policy() -> None:
    ra = parse_retry_after({"retry-after": "1e999"}, now_wall=NOW)
    assert ra is not None
    assert RetryPolicy(backoff="fixed", max_retry_after_ms=60_000).clamp_retry_after(ra) == 60.0


# ---------------------------------------------------------------------------
# Statuses


@pytest.mark.parametrize("status", sorted(RETRY_STATUSES))
def test_retryable_statuses(status: int) -> None:
    assert is_retryable_status(status)


@pytest.mark.parametrize("status", [200, 201, 204, 301, 400, 401, 403, 404, 413, 422, 501, 505])
def test_final_statuses(status: int) -> None:
    assert not is_retryable_status(status)


def test_retry_statuses_include_the_usual_suspects() -> None:
    assert {408, 429, 500, 502, 503, 504, 529} <= RETRY_STATUSES


# ---------------------------------------------------------------------------
# Exceptions

EXCEPTION_FACTORIES: dict[type[BaseException], object] = {
    aiohttp.ClientConnectorDNSError: lambda: aiohttp.ClientConnectorDNSError(
        KEY, OSError(socket.EAI_NONAME, "Name or service not known")
    ),
    aiohttp.ClientConnectorCertificateError: lambda: aiohttp.ClientConnectorCertificateError(
        KEY, ssl.SSLCertVerificationError(1, "certificate verify failed")
    ),
    aiohttp.ClientConnectorSSLError: lambda: aiohttp.ClientConnectorSSLError(
        KEY, ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    ),
    aiohttp.ClientSSLError: lambda: aiohttp.ClientSSLError(KEY, ssl.SSLError(1, "bad")),
    ssl.SSLError: lambda: ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC]"),
    aiohttp.ConnectionTimeoutError: lambda: aiohttp.ConnectionTimeoutError(
        "Connection timeout to host https://api.example.com"
    ),
    aiohttp.SocketTimeoutError: lambda: aiohttp.SocketTimeoutError(
        "Timeout on reading data from socket"
    ),
    aiohttp.ServerDisconnectedError: lambda: aiohttp.ServerDisconnectedError(),
    aiohttp.ClientPayloadError: lambda: aiohttp.ClientPayloadError(
        "400, message: Can not decode content-encoding: br"
    ),
    aiohttp.ClientConnectionResetError: lambda: aiohttp.ClientConnectionResetError(
        "Cannot write to closing transport"
    ),
    ConnectionRefusedError: lambda: ConnectionRefusedError(),
    ConnectionResetError: lambda: ConnectionResetError(),
    ConnectionAbortedError: lambda: ConnectionAbortedError(),
    BrokenPipeError: lambda: BrokenPipeError(),
    asyncio.IncompleteReadError: lambda: asyncio.IncompleteReadError(b"partial", 100),
    TimeoutError: lambda: TimeoutError(),
}


def test_exception_factories_cover_the_table() -> None:
    assert set(EXCEPTION_FACTORIES) == {etype for etype, _ in EXCEPTION_CLASSES}


@pytest.mark.parametrize(
    ("etype", "cls"), EXCEPTION_CLASSES, ids=[e.__name__ for e, _ in EXCEPTION_CLASSES]
)
def test_classify_every_exception_class(etype: type[BaseException], cls: FailureClass) -> None:
    exc = EXCEPTION_FACTORIES[etype]()  # type: ignore[operator]
    assert type(exc) is etype
    failure = classify_exception(exc)
    assert failure is not None
    assert failure.cls is cls
    assert failure.reason


@pytest.mark.parametrize(
    ("code", "cls"),
    sorted(ERRNO_CLASSES.items()),
    ids=[errno.errorcode[c] for c in sorted(ERRNO_CLASSES)],
)
def test_classify_every_errno(code: int, cls: FailureClass) -> None:
    msg = os.strerror(code)
    variants: list[BaseException] = [
        OSError(code, msg),
        aiohttp.ClientOSError(code, msg),
        aiohttp.ClientConnectorError(KEY, OSError(code, msg)),
        # aiohappyeyeballs: several addresses failed with the same errno
        aiohttp.ClientConnectorError(KEY, OSError(code, f"Multiple exceptions: {msg}, {msg}")),
    ]
    wrapped = aiohttp.ClientOSError()
    wrapped.__cause__ = OSError(code, msg)
    variants.append(wrapped)
    for exc in variants:
        failure = classify_exception(exc)
        assert failure is not None, exc
        assert failure.cls is cls, (exc, failure)
        assert errno.errorcode[code] in failure.reason


@pytest.mark.parametrize(
    ("exc", "cls"),
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), FailureClass.REFUSED),
        (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), FailureClass.RESET),
        (
            aiohttp.ClientConnectorError(
                KEY, ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")
            ),
            FailureClass.REFUSED,
        ),
        (aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"), FailureClass.RESET),
        (
            aiohttp.ClientConnectorDNSError(KEY, OSError(socket.EAI_AGAIN, "Temporary failure")),
            FailureClass.DNS,
        ),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), FailureClass.TLS),
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), FailureClass.TLS),
        (aiohttp.ServerTimeoutError("timeout"), FailureClass.HEADER_TIMEOUT),
        # the connection closed before the body's end: the server went away mid-body
        (
            aiohttp.ClientPayloadError("Response payload is not completed"),
            FailureClass.DISCONNECTED,
        ),
        (aiohttp.ServerDisconnectedError("Server disconnected"), FailureClass.DISCONNECTED),
        (OSError(errno.EINVAL, "Invalid argument"), FailureClass.OTHER),
        (OSError("no errno"), FailureClass.OTHER),
        (aiohttp.ClientConnectionError("closed"), FailureClass.OTHER),
        (aiohttp.ClientResponseError(None, (), status=500), FailureClass.OTHER),  # type: ignore[arg-type]
    ],
)
def test_classify_specific_exceptions(exc: BaseException, cls: FailureClass) -> None:
    failure = classify_exception(exc)
    assert failure is not None
    assert failure.cls is cls


def test_payload_error_caused_by_a_reset_is_a_reset() -> None:
    exc = aiohttp.ClientPayloadError("Response payload is not completed")
    exc.__cause__ = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    failure = classify_exception(exc)
    assert failure is not None and failure.cls is FailureClass.RESET


def test_self_referencing_cause_chain_terminates() -> None:
    exc = OSError("loop")
    exc.__context__ = exc
    failure = classify_exception(exc)
    assert failure is not None and failure.cls is FailureClass.OTHER


@pytest.mark.parametrize(
    "exc",
    [
        asyncio.CancelledError(),
        ValueError("nope"),
        KeyError("k"),
        RuntimeError("x"),
        KeyboardInterrupt(),
        aiohttp.InvalidURL("not a url"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_not_transport_failures(exc: BaseException) -> None:
    if isinstance(exc, aiohttp.InvalidURL):
        # a ClientError (and a ValueError): the wide net classifies it as network
        assert classify_exception(exc) is not None
    else:
        assert classify_exception(exc) is None


def test_connector_error_with_mixed_errnos_reroutes_at_once() -> None:
    os_error = OSError(
        "Multiple exceptions: [Errno 111] Connect call failed ('127.0.0.1', 9), "
        "[Errno 99] Cannot assign requested address"
    )
    exc = aiohttp.ClientConnectorError(KEY, os_error)
    exc.__cause__ = os_error
    failure = classify_exception(exc)
    assert failure is not None
    assert failure.cls.reroutes_at_once
