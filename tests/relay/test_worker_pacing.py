"""Issue 36, item 5: workers without Redis split the pacer's floor, as Redis does.

``unbroken serve --workers N`` without Redis shares health over the workers'
channel (`relay.store.ChannelStore`).  Each worker's pacer gave a dead upstream the
whole floor: 4, 8 and 16 retries a second into an outage for 1, 2 and 4 workers
when breakers do not open.  Now a worker with turns in an upstream's line says so on
the channel, and each splits the floor among the workers that wait, so the fleet
sends one floor.

Two workers run in this process (`RelayServer` with a `WorkerSpec` each, one runtime
directory: the channel ``serve --workers 2`` gives them), in front of a mock that
answers 503 to everything, breakers off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import aiohttp

from relay.test_health_relay import CHAT, PATH, until
from unbroken.config import parse_config
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer
from unbroken.relay.siblings import WorkerSpec

FLOOR = 10.0  # retries a second the upstream gets from the fleet
BURST = 2.0
WINDOW_S = 3.0


def _config(upstream: str) -> Any:
    data = {
        # every turn would retry every 20 ms: only the pacer holds them back
        "retry": {
            "delay_ms": 20,
            "backoff": "fixed",
            "pace_floor_per_s": FLOOR,
            "pace_burst": BURST,
        },
        "health": {"breakers": False},
        "stream": {"early_headers_s": 60, "keepalive_s": 60},
        "journal": {"enabled": False},
        "routes": {"mock": {"upstreams": [{"url": upstream}]}},
    }
    return dataclasses.replace(parse_config(data, env={}), port=0, grace_s=1.0)


async def _post(http: aiohttp.ClientSession, url: str) -> None:
    async with http.post(url + PATH, json=CHAT) as resp:
        await resp.read()


async def test_two_workers_send_one_floor_of_retries_into_a_dead_upstream(
    tmp_path: Path, mock: MockProvider
) -> None:
    mock.script([{"status": 503, "count": 1_000_000}])  # down for the whole test
    cfg = _config(mock.url)
    key = f"mock|{mock.url}"
    runtime = str(tmp_path)
    a = RelayServer(cfg, worker=WorkerSpec(0, runtime))
    b = RelayServer(cfg, worker=WorkerSpec(1, runtime))
    await a.start()
    await b.start()
    try:
        assert a.relay.store.kind == b.relay.store.kind == "workers"
        async with aiohttp.ClientSession() as http:
            turns = [
                asyncio.ensure_future(_post(http, server.url))
                for server in (a, b)
                for _ in range(10)
            ]
            try:
                pa, pb = a.relay.board.pacer(key), b.relay.board.pacer(key)
                await until(lambda: bool(pa.queue) and bool(pb.queue), cap=10)
                # each worker learns that the other waits too: each takes half the floor
                await until(lambda: pa.share == 2 and pb.share == 2, cap=10)
                assert pa.view(time.monotonic())["floor_per_s"] == FLOOR / 2
                # the fleet's retries over a window: one floor, not one per worker
                # (the old code: 2 x FLOOR a second).  The sleep is the window measured.
                n0, t0 = len(mock.requests), time.monotonic()
                await asyncio.sleep(WINDOW_S)
                n1, t1 = len(mock.requests), time.monotonic()
                assert pa.queue and pb.queue  # turns waited all along
            finally:
                for t in turns:
                    t.cancel()
                await asyncio.gather(*turns, return_exceptions=True)
            sent, elapsed = n1 - n0, t1 - t0
            bound = 1.5 * FLOOR * elapsed + 2 * BURST
            assert sent <= bound, (
                f"{sent} retries in {elapsed:.2f} s from two workers: more than one floor "
                f"({FLOOR:g}/s; bound {bound:.0f})"
            )
            assert sent > 0
            # nobody waits any more: each worker has its whole floor back
            await until(lambda: pa.share == 1 and pb.share == 1, cap=10)
    finally:
        await a.stop()
        await b.stop()
