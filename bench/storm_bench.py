"""Storm benchmark: what circuit breakers save a provider during an outage.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/storm_bench.py [--turns 200] [--outage 30] [--json FILE]

Everything runs in this process on loopback: mock providers
(``unbroken.mock.MockProvider``), one relay (``RelayServer``) and the clients.
Two scenarios, each run with ``[health] breakers`` on and off (default retry
settings otherwise: 250 ms fixed retries, paced per upstream; see
``bench/recovery_bench.py`` for the pacing model's own benchmark):

* **failover**: a route of [primary, backup]; the primary answers 503 for
  ``--outage`` seconds.  ``--turns`` clients send streamed turns back to back.
  Reported: requests the primary received during the outage, turns completed.
* **single**: a route of one upstream that answers 503 for ``--outage`` seconds;
  ``--turns`` turns start at once and wait it out.  Reported: requests during the
  outage, and how long after the upstream returned the last turn completed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from typing import Any

import aiohttp

from unbroken.config import parse_config
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
PATH = "/storm/v1/chat/completions"


def _config(urls: list[str], breakers: bool) -> Any:
    data = {
        "retry": {"verbose": False},
        "health": {"breakers": breakers},
        "journal": {"enabled": False},
        "routes": {"storm": {"upstreams": [{"url": u} for u in urls]}},
    }
    return dataclasses.replace(parse_config(data, env={}), port=0)


async def _turn(http: aiohttp.ClientSession, url: str) -> float:
    t0 = time.monotonic()
    async with http.post(url + PATH, json=CHAT) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
    return time.monotonic() - t0


async def failover(turns: int, outage: float, breakers: bool) -> dict[str, Any]:
    async with (
        MockProvider(port=0, record=True) as primary,
        MockProvider(port=0, record=False) as backup,
    ):
        primary.script([{"status": 503, "count": 1_000_000}])
        async with RelayServer(_config([primary.url, backup.url], breakers)) as server:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=conn) as http:
                stop = time.monotonic() + outage
                latencies: list[float] = []

                async def client() -> None:
                    while time.monotonic() < stop:
                        latencies.append(await _turn(http, server.url))

                await asyncio.gather(*(client() for _ in range(turns)))
                sent = len(primary.requests)
        return {
            "scenario": "failover",
            "breakers": breakers,
            "primary_requests_during_outage": sent,
            "turns_completed": len(latencies),
            "turn_p50_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
        }


async def single(turns: int, outage: float, breakers: bool) -> dict[str, Any]:
    async with MockProvider(port=0, record=True) as up:
        up.script([{"status": 503, "count": 1_000_000}])
        async with RelayServer(_config([up.url], breakers)) as server:
            conn = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
                tasks = [asyncio.ensure_future(_turn(http, server.url)) for _ in range(turns)]
                await asyncio.sleep(outage)
                sent = len(up.requests)
                up.reset()  # the upstream is back
                back = time.monotonic()
                await asyncio.gather(*tasks)
                drained = time.monotonic() - back
        return {
            "scenario": "single",
            "breakers": breakers,
            "requests_during_outage": sent,
            "all_done_after_return_s": round(drained, 2),
        }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for scenario in (failover, single):
        for breakers in (True, False):
            res = await scenario(args.turns, args.outage, breakers)
            print(json.dumps(res), flush=True)
            results.append(res)
    return {"turns": args.turns, "outage_s": args.outage, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--outage", type=float, default=30.0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
