"""GET /metrics: a valid Prometheus exposition, per-relay registries, numbers that move."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relayfix import make_config, start_relay
from unbroken.mock import MockProvider

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def _scrape(url: str) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        ctype = r.headers["Content-Type"]
        text = await r.text()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return ctype, samples


def _get(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _post(url: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=CHAT) as r:
        return await r.read()


async def test_metrics_parse_and_move_with_traffic(mock: MockProvider) -> None:
    server, rec = await start_relay(make_config([{"url": mock.url}]))
    try:
        ctype, before = await _scrape(server.url)
        assert ctype.startswith("text/plain") and "version=" in ctype
        assert _get(before, "unbroken_inflight_turns") == 0
        assert _get(before, "unbroken_held_bytes") == 0
        assert _get(before, "unbroken_upstream_up", route="mock", upstream=mock.url) == 1
        assert _get(before, "unbroken_turns_total", route="mock", outcome="ok") == 0

        await _post(f"{server.url}/mock/v1/chat/completions")
        mock.script([{"status": 503}, {"fault": "reset", "after_frame": 1}])
        await _post(f"{server.url}/mock/v1/chat/completions")
        await rec.wait_turns(2)

        _, after = await _scrape(server.url)
        assert _get(after, "unbroken_turns_total", route="mock", outcome="ok") == 1
        assert _get(after, "unbroken_turns_total", route="mock", outcome="recovered") == 1
        attempts = {
            labels: v for (name, labels), v in after.items() if name == "unbroken_attempts_total"
        }
        reasons = {dict(labels)["reason"]: v for labels, v in attempts.items()}
        assert reasons["ok"] == 2 and reasons["503"] == 1 and sum(reasons.values()) == 4
        assert all(dict(labels)["upstream"] == mock.url for labels in attempts)
        assert _get(after, "unbroken_replays_total", phase="headers") == 1
        assert _get(after, "unbroken_replays_total", phase="pending") == 1
        assert _get(after, "unbroken_retry_wait_seconds_count", route="mock") == 2
        assert _get(after, "unbroken_retry_wait_seconds_sum", route="mock") > 0
        assert _get(after, "unbroken_time_to_first_byte_seconds_count", route="mock") == 2
        assert (
            _get(after, "unbroken_time_to_first_byte_seconds_bucket", route="mock", le="+Inf") == 2
        )
        assert _get(after, "unbroken_inflight_turns") == 0
    finally:
        await server.stop()


async def test_upstream_down_and_inflight_gauges(mock: MockProvider) -> None:
    cfg = make_config([{"url": mock.url}], retry={"delay_ms": 1, "max_attempts": 3})
    server, rec = await start_relay(cfg)
    try:
        # three failures in a row (then the relay gives up): down
        mock.script([{"status": 503}] * 3)
        await _post(f"{server.url}/mock/v1/chat/completions")
        await rec.wait_turns(1)
        _, samples = await _scrape(server.url)
        assert (
            _get(samples, "unbroken_turns_total", route="mock", outcome="passed_through_error") == 1
        )
        assert _get(samples, "unbroken_upstream_up", route="mock", upstream=mock.url) == 0
        # a waiting turn shows as in flight
        mock.script([{"status": 429, "headers": {"Retry-After": "30"}}])
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(
                s.post(f"{server.url}/mock/v1/chat/completions", json=CHAT)
            )
            await mock.wait_for_requests(4, timeout=30)  # the turn is in flight now
            _, live = await _scrape(server.url)
            assert _get(live, "unbroken_inflight_turns") == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await rec.wait_turns(2)
        _, done = await _scrape(server.url)
        assert _get(done, "unbroken_inflight_turns") == 0
        assert _get(done, "unbroken_turns_total", route="mock", outcome="aborted_by_client") == 1
    finally:
        await server.stop()


async def test_two_relays_keep_separate_registries(mock: MockProvider) -> None:
    one, rec1 = await start_relay(make_config([{"url": mock.url}]))
    two, rec2 = await start_relay(make_config([{"url": mock.url}]))
    try:
        await _post(f"{one.url}/mock/v1/chat/completions")
        await _post(f"{one.url}/mock/v1/chat/completions")
        await _post(f"{two.url}/mock/v1/chat/completions")
        await rec1.wait_turns(2)
        await rec2.wait_turns(1)
        _, s1 = await _scrape(one.url)
        _, s2 = await _scrape(two.url)
        assert _get(s1, "unbroken_turns_total", route="mock", outcome="ok") == 2
        assert _get(s2, "unbroken_turns_total", route="mock", outcome="ok") == 1
    finally:
        await one.stop()
        await two.stop()
