"""`unbroken status` shows upstream health: breakers, parked turns, the budget, the store."""

from __future__ import annotations

import io
import time

from rich.console import Console

from unbroken.observe.status import render


def test_the_view_shows_breakers_parked_turns_lines_and_a_degraded_store() -> None:
    now = time.time()
    data = {
        "version": "0.1.0",
        "now": now,
        "uptime_s": 5.0,
        "inflight": [
            {
                "id": 1,
                "route": "mock",
                "state": "parked",
                "attempts": 2,
                "upstream": "http://a",
                "age_s": 1.0,
                "held_bytes": 0,
                "parked_for": "breaker",
            }
        ],
        "upstreams": [
            {
                "route": "mock",
                "upstream": "http://a",
                "up": False,
                "ok": 1,
                "failed": 6,
                "failure_rate": 0.75,
                "breaker": "open",
                "open_until": now + 12,
                "cooloff_s": 0,
                "pacer": {"tokens": 10.0, "waiting": 7, "ramping": False},
                "recent_failures": [],
            },
            {
                "route": "mock",
                "upstream": "http://b",
                "up": True,
                "ok": 3,
                "failed": 1,
                "failure_rate": 0.25,
                "breaker": "half_open",
                "open_until": None,
                "cooloff_s": 0,
                "recent_failures": [],
            },
        ],
        "totals": {},
        "store": {"kind": "redis", "state": "degraded"},
        "workers": [{"id": 0}, {"id": 1}],
    }
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(data, "http://127.0.0.1:4780"))
    text = console.export_text()
    assert "OPEN 12s" in text or "OPEN 11s" in text
    assert "probe" in text and "6 (86%)" in text  # of the 7 attempts beside it
    assert "1 parked" in text and "2 workers" in text and "breaker" in text
    assert "redis store DEGRADED" in text and "mock/http://a: 7 in line" in text


def test_the_view_names_the_turns_waiting_for_a_rate_limit() -> None:
    data = {
        "version": "0.1.0",
        "now": time.time(),
        "uptime_s": 5.0,
        "inflight": [
            {
                "id": 3,
                "route": "mock",
                "state": "parked",
                "attempts": 0,
                "upstream": "http://a",
                "age_s": 0.4,
                "held_bytes": 0,
                "parked_for": "ratelimit",
            }
        ],
        "upstreams": [
            {
                "route": "mock",
                "upstream": "http://a",
                "up": True,
                "ok": 9,
                "failed": 0,
                "breaker": "closed",
                "cooloff_s": 0,
                "recent_failures": [],
                "ratelimits": [
                    {"credential": "3f9a0c1d2e4b", "waiting": 4, "buckets": {}},
                    {"credential": "idle00000000", "waiting": 0, "buckets": {}},
                ],
            },
        ],
        "totals": {},
    }
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(data, "http://127.0.0.1:4780"))
    text = console.export_text()
    assert "mock/http://a: 4 waiting for the rate limit (key 3f9a0c1d2e4b)" in text
    assert "idle00000000" not in text and "ratelimit" in text


def test_the_failed_share_is_of_the_counts_beside_it() -> None:
    """Issue 35: the "failed" cell showed the breaker's failure rate over its 30 s window
    beside the counts since start: "44 (50%)" where 44 of 46 attempts had failed."""
    upstream = {
        "route": "mock",
        "upstream": "http://a",
        "up": True,
        "ok": 2,
        "failed": 44,
        "failure_rate": 0.5,
        "breaker": "closed",
        "cooloff_s": 0,
        "recent_failures": [],
    }
    data = {"version": "0.1.0", "now": time.time(), "uptime_s": 5.0, "inflight": []}
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render({**data, "upstreams": [upstream], "totals": {}}, "http://x"))
    text = console.export_text()
    assert "44 (96%)" in text and "50%" not in text
    console.print(render({**data, "upstreams": [{**upstream, "failed": 0}], "totals": {}}, "x"))
    assert "(0%)" not in console.export_text()  # nothing failed: just 0
