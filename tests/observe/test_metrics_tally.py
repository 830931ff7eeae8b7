"""`Metrics` counts a turn's figures into plain tallies and adds them to its
prometheus_client children at the scrape: the exposition is exactly what observing
each figure directly gives (bucket edges, sums, several scrapes, untouched series)."""

from __future__ import annotations

import math
import random

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from unbroken.core.admission.policy import Failure, FailureClass
from unbroken.observe.hooks import AttemptInfo, TurnRecord
from unbroken.observe.metrics import TTFB_BUCKETS, WAIT_BUCKETS, Metrics


def _samples(text: bytes, prefixes: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(prefixes) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _turn(route: str, outcome: str, ttfb: float | None, queued: float) -> TurnRecord:
    turn = TurnRecord(route=route, path="v1/chat/completions", protocol="chat", stream=True)
    turn.outcome = outcome
    turn.started = 1000.0
    turn.first_byte_at = None if ttfb is None else 1000.0 + ttfb
    turn.queued_s = queued
    return turn


def test_tallies_expose_what_direct_observation_does() -> None:
    metrics = Metrics()
    ref = CollectorRegistry(auto_describe=False)
    turns = Counter("unbroken_turns", "t", ["route", "outcome"], registry=ref)
    attempts = Counter("unbroken_attempts", "a", ["route", "upstream", "reason"], registry=ref)
    wasted = Counter("unbroken_wasted_output_tokens", "w", ["route"], registry=ref)
    ttfb = Histogram(
        "unbroken_time_to_first_byte_seconds", "f", ["route"], buckets=TTFB_BUCKETS, registry=ref
    )
    queued = Histogram(
        "unbroken_ratelimit_queued_seconds", "q", ["route"], buckets=WAIT_BUCKETS, registry=ref
    )
    waits = Histogram(
        "unbroken_retry_wait_seconds", "r", ["route"], buckets=WAIT_BUCKETS, registry=ref
    )
    rng = random.Random(34)
    # every bucket edge exactly, either side of it, zero, and random values
    values = [0.0, *TTFB_BUCKETS, *(b * (1 + 1e-12) for b in TTFB_BUCKETS), 1e9]
    values += [rng.uniform(0, 700) for _ in range(300)]
    prefixes = (
        "unbroken_turns",
        "unbroken_attempts",
        "unbroken_wasted",
        "unbroken_time_to_first_byte",
        "unbroken_ratelimit_queued",
        "unbroken_retry_wait",
    )
    for scrape in range(3):
        for i, v in enumerate(values[scrape::3]):
            route = ("a", "b")[i % 2]
            outcome = ("ok", "recovered")[i % 3 == 0]
            q = v / 7 if i % 4 == 0 else 0.0
            t = _turn(route, outcome, None if i % 5 == 0 else v, q)
            a = AttemptInfo(number=1, upstream="http://u", reason=("ok", "503")[i % 2])
            a.est_output_tokens = i % 3
            metrics.attempt_ended(t, a)
            attempts.labels(route, "http://u", a.reason).inc()
            if a.reason == "503" and a.est_output_tokens:
                wasted.labels(route).inc(a.est_output_tokens)
            metrics.attempt_failed(
                t,
                "http://u",
                Failure(FailureClass.STATUS, "503", 503),
                phase="headers",
                wait_s=v / 3,
            )
            waits.labels(route).observe(v / 3)
            metrics.turn_ended(t)
            turns.labels(route, outcome).inc()
            if q:
                queued.labels(route).observe(q)
            if t.first_byte_at is not None:
                ttfb.labels(route).observe(v)
        got = _samples(metrics.expose(), prefixes)
        want = _samples(generate_latest(ref), prefixes)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert math.isclose(got[name], value, rel_tol=1e-12, abs_tol=1e-9), name


def test_a_scrape_with_nothing_new_changes_nothing() -> None:
    metrics = Metrics()
    metrics.turn_ended(_turn("a", "ok", 0.2, 0.0))
    first = metrics.expose()
    assert b'unbroken_turns_total{outcome="ok",route="a"} 1.0' in first
    assert b'unbroken_time_to_first_byte_seconds_bucket{le="0.25",route="a"} 1.0' in first
    assert _samples(metrics.expose(), ("unbroken_",)) == _samples(first, ("unbroken_",))
