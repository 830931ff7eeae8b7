"""Proven under load (issue 10): a 60 s soak and a leak check, through ``bench/soak.py``.

Both run by default, in the long tier (``-m 'not slow'`` deselects them).  The soak
drives 200 concurrent streamed turns with 5 % injected faults, client aborts and slow
readers through a real ``unbroken serve`` process, checking every turn's
bytes; the leak check sends 2,000 requests with random client aborts and
expects the relay's fds and tasks back at their idle level.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
async def test_soak_60s_200_streams_with_faults() -> None:
    # warm-up: the first 30 s (allocator arenas, SQLite's page cache, aiohttp's caches fill)
    report = await soak.run_soak(
        duration_s=60, streams=200, fault_rate=0.05, warmup_s=30, sample_s=10
    )
    c = report.counts
    summary = (
        f"{c.turns} turns, {c.faults} faults, {c.recovered} recovered, "
        f"{c.ended_with_error} ended with the error event, {c.aborted} aborted; "
        f"samples {report.samples}; errors {c.errors}; stderr {report.stderr_tail}"
    )
    assert report.ok, "; ".join(report.failures) + " | " + summary
    assert c.turns >= 500 and c.faults >= 20, summary  # the load really ran
    assert c.recovered + c.ended_with_error >= c.faults // 2, summary


@pytest.mark.timeout(240)
async def test_no_leak_after_2000_requests_with_random_aborts() -> None:
    leak = await soak.run_leak_check(requests=2000, concurrency=20, abort_rate=0.3)
    assert leak.aborted >= 400  # the aborts really happened
    assert not leak.failures, (leak.failures, leak.idle_before, leak.idle_after)
    assert leak.idle_after["tasks"] == leak.idle_before["tasks"]
