"""``unbroken serve --workers 2``: real processes on a real port, a real supervisor.

The relay runs as a subprocess in front of in-process mock providers.  Which
worker answered is read from ``/status`` (``worker``); every poll opens a new
connection, so the kernel's SO_REUSEPORT spreading is exercised.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest_asyncio

from relay.test_health_relay import CHAT, PATH, until
from servefix import Served, serve_subprocess
from unbroken.mock import MockProvider


async def start_fleet(tmp_path: Path, upstreams: list[str], workers: int = 2) -> Served:
    cfg = tmp_path / "fleet.toml"
    ups = ", ".join(f'{{ url = "{u}" }}' for u in upstreams)
    cfg.write_text(
        "[server]\ngrace_s = 20\n[retry]\ndelay_ms = 5\n[journal]\nenabled = false\n"
        f"[routes.mock]\nupstreams = [{ups}]\n"
    )
    return await serve_subprocess(cfg, "--workers", str(workers))


@pytest_asyncio.fixture
async def mock2() -> AsyncIterator[MockProvider]:
    async with MockProvider(host="127.0.0.1", port=0) as provider:
        yield provider


async def stop(fleet: Served) -> int:
    code, _ = await fleet.stop()
    return code


async def test_both_workers_answer_and_a_killed_worker_is_restarted(
    tmp_path: Path, mock: MockProvider
) -> None:
    fleet = await start_fleet(tmp_path, [mock.url])
    try:
        seen: dict[int, int] = {}

        async def both() -> bool:
            data = await fleet.status()
            seen[data["worker"]["id"]] = data["worker"]["pid"]
            return len(seen) == 2

        await until(both, cap=20)
        data = await fleet.status()
        assert sorted(w["id"] for w in data["workers"]) == [0, 1]  # the merged view
        old = seen[0]
        os.kill(old, signal.SIGKILL)

        async def restarted() -> bool:
            data = await fleet.status()
            return any(w["id"] == 0 and w["pid"] != old for w in data["workers"])

        await until(restarted, cap=20)
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(fleet.url + PATH, json=CHAT) as r:
                    assert r.status == 200 and b"[DONE]" in await r.read()
    finally:
        assert await stop(fleet) == 0


async def test_sigterm_drains_both_workers(tmp_path: Path, mock: MockProvider) -> None:
    fleet = await start_fleet(tmp_path, [mock.url])
    mock.script([{"deltas": 30, "chunk_delay_ms": 100, "count": 100}])  # ~3 s streams
    conn = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def stream() -> bytes:
            async with http.post(fleet.url + PATH, json=CHAT) as r:
                assert r.status == 200
                return await r.read()

        streams = [asyncio.ensure_future(stream()) for _ in range(8)]

        async def on_both() -> bool:
            data = await fleet.status()
            return {t["worker"] for t in data["inflight"]} == {0, 1}

        try:
            await until(on_both, cap=10)
        except AssertionError:  # the kernel put all 8 on one worker: add more
            streams += [asyncio.ensure_future(stream()) for _ in range(8)]
            await until(on_both, cap=10)
        fleet.proc.send_signal(signal.SIGTERM)
        bodies = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert all(b"[DONE]" in body for body in bodies)  # every stream finished whole
    assert await stop(fleet) == 0


async def test_health_learned_by_one_worker_steers_the_other(
    tmp_path: Path, mock: MockProvider, mock2: MockProvider
) -> None:
    fleet = await start_fleet(tmp_path, [mock.url, mock2.url])
    try:
        await until(lambda: _both_up(fleet), cap=20)
        mock.script([{"status": 429, "headers": {"Retry-After": "60"}}])
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as http:
            async with http.post(fleet.url + PATH, json=CHAT) as r:
                assert r.status == 200
            assert len(mock.requests) == 1  # the 429, then upstream 2
            cooled: set[int] = set()

            async def both_know() -> bool:
                data = await fleet.status()
                [u] = [u for u in data["upstreams"] if u["upstream"] == mock.url]
                if u["cooloff_s"] > 30:
                    cooled.add(data["worker"]["id"])
                return cooled == {0, 1}

            await until(both_know, cap=20)
            for _ in range(20):  # new connections: both workers take some
                async with http.post(fleet.url + PATH, json=CHAT) as r:
                    assert r.status == 200
            assert len(mock.requests) == 1 and len(mock2.requests) == 21
    finally:
        assert await stop(fleet) == 0


async def _both_up(fleet: Served) -> bool:
    data = await fleet.status()
    return len(data.get("workers", [])) == 2
