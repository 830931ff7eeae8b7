"""The load generator and the mock, each run in a process of its own
(``http_bench.py --loadgen`` and ``http_bench.py --mock``).

Line protocol: one JSON command per stdin line, one JSON answer per stdout line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

from harness import cpu_seconds


class LoadGen:
    def __init__(self) -> None:
        import aiohttp

        self.aiohttp = aiohttp
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=False),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        self.held: list[asyncio.Task[None]] = []
        self.release = asyncio.Event()

    async def one(
        self, url: str, body: bytes, headers: dict[str, str], marker: bytes | None
    ) -> tuple[float | None, float, int, int]:
        """One streamed request: (first marker s, end s, SSE frames, body reads)."""
        t0 = time.perf_counter()
        first: float | None = None
        frames = reads = 0
        tail = b""
        last_lf = False
        keep = len(marker) - 1 if marker else 0
        async with self.session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300]
                raise RuntimeError(f"HTTP {resp.status}: {text!r}")
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                reads += 1
                if marker is not None and first is None:
                    if marker in (tail + chunk if tail else chunk):
                        first = now - t0
                    else:
                        tail = chunk[-keep:]
                frames += chunk.count(b"\n\n") + (1 if last_lf and chunk[:1] == b"\n" else 0)
                last_lf = chunk[-1:] == b"\n"
        return first, time.perf_counter() - t0, frames, reads

    async def cmd_ttfc(self, c: dict[str, Any]) -> dict[str, Any]:
        """Sequential requests, interleaved over the targets, order rotated each round."""
        targets: list[list[str]] = c["targets"]
        body = c["body"].encode()
        headers = c["headers"]
        marker = c["marker"].encode()
        first: dict[str, list[float]] = {name: [] for name, _ in targets}
        end: dict[str, list[float]] = {name: [] for name, _ in targets}
        errors: dict[str, int] = {name: 0 for name, _ in targets}
        last_error = ""
        for _name, url in targets:  # warm the connections
            for _ in range(c.get("warmup", 3)):
                with contextlib.suppress(Exception):
                    await self.one(url, body, headers, marker)
        k = len(targets)
        gap = c.get("gap_ms", 0) / 1000
        for i in range(c["n"]):
            for j in range(k):
                name, url = targets[(i + j) % k]
                if gap:
                    # every system under test shares one CPU: let the last one finish its
                    # turn's bookkeeping first, or its tail is charged to this request
                    await asyncio.sleep(gap)
                try:
                    f, e, _, _ = await self.one(url, body, headers, marker)
                except Exception as exc:
                    errors[name] += 1
                    last_error = repr(exc)
                    continue
                if f is None:
                    errors[name] += 1
                    last_error = f"{name}: marker not seen"
                    continue
                first[name].append(f * 1000)
                end[name].append(e * 1000)
        return {"first_ms": first, "end_ms": end, "errors": errors, "last_error": last_error}

    async def cmd_throughput(self, c: dict[str, Any]) -> dict[str, Any]:
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        conc, warmup, duration = c["concurrency"], c["warmup"], c["duration"]
        pids: list[int] = c.get("cpu_pids", [])
        loop = asyncio.get_running_loop()
        t_start = loop.time() + warmup
        t_end = t_start + duration
        done = 0
        errors = 0
        frames = 0
        last_error = ""
        cpu: dict[str, list[float]] = {}

        async def client() -> None:
            nonlocal done, errors, frames, last_error
            while loop.time() < t_end:
                try:
                    _, _, nf, _ = await self.one(url, body, headers, None)
                except Exception as exc:
                    errors += 1
                    last_error = repr(exc)
                    await asyncio.sleep(0.01)
                    continue
                now = loop.time()
                if t_start <= now < t_end:
                    done += 1
                    frames += nf

        async def sampler() -> None:
            await asyncio.sleep(max(0.0, t_start - loop.time()))
            cpu["start"] = [cpu_seconds(p) for p in pids] + [time.perf_counter()]
            await asyncio.sleep(max(0.0, t_end - loop.time()))
            cpu["end"] = [cpu_seconds(p) for p in pids] + [time.perf_counter()]

        await asyncio.gather(sampler(), *(client() for _ in range(conc)))
        wall = cpu["end"][-1] - cpu["start"][-1]
        util = [(b - a) / wall for a, b in zip(cpu["start"][:-1], cpu["end"][:-1], strict=True)]
        return {
            "rps": done / wall,
            "done": done,
            "frames_per_req": frames / done if done else 0.0,
            "wall_s": wall,
            "errors": errors,
            "last_error": last_error,
            "cpu_util": dict(zip(map(str, pids), util, strict=True)),
        }

    async def cmd_batch(self, c: dict[str, Any]) -> dict[str, Any]:
        """``n`` streamed requests at ``concurrency``; SSE frames and body reads counted."""
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        queue = list(range(c["n"]))
        totals = {"frames": 0, "reads": 0, "ok": 0, "errors": 0}
        last_error = ""

        async def client() -> None:
            nonlocal last_error
            while queue:
                queue.pop()
                try:
                    _, _, nf, nr = await self.one(url, body, headers, None)
                except Exception as exc:
                    totals["errors"] += 1
                    last_error = repr(exc)
                    continue
                totals["ok"] += 1
                totals["frames"] += nf
                totals["reads"] += nr

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(c["concurrency"])))
        return {**totals, "wall_s": time.perf_counter() - t0, "last_error": last_error}

    async def cmd_multi(self, c: dict[str, Any]) -> dict[str, Any]:
        """Several commands at once (e.g. one batch per SUT, so they share the same noise)."""
        results = await asyncio.gather(*(getattr(self, f"cmd_{j['op']}")(j) for j in c["jobs"]))
        return {"results": list(results)}

    async def cmd_hold(self, c: dict[str, Any]) -> dict[str, Any]:
        """Open ``n`` streams, wait until each has its first body bytes, keep them open."""
        url, body, headers = c["url"], c["body"].encode(), c["headers"]
        n = c["n"]
        self.release = asyncio.Event()
        ready = 0
        failed = 0
        last_error = ""
        all_ready = asyncio.Event()

        async def hold_one() -> None:
            nonlocal ready, failed, last_error
            resp = None
            try:
                resp = await self.session.post(url, data=body, headers=headers)
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                await resp.content.readany()
                ready += 1
            except Exception as exc:
                failed += 1
                last_error = repr(exc)
                if resp is not None:
                    resp.close()
                return
            finally:
                if ready + failed >= n:
                    all_ready.set()
            try:
                await self.release.wait()
            finally:
                resp.close()

        self.held = [asyncio.ensure_future(hold_one()) for _ in range(n)]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(c.get("timeout", 60)):
                await all_ready.wait()
        return {"ready": ready, "failed": failed, "last_error": last_error}

    async def cmd_release(self, c: dict[str, Any]) -> dict[str, Any]:
        self.release.set()
        for t in self.held:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self.held, return_exceptions=True)
        n = len(self.held)
        self.held = []
        return {"released": n}

    async def close(self) -> None:
        await self.cmd_release({})
        await self.session.close()


async def _loadgen_main(gen_cls: type[LoadGen]) -> None:
    gen = gen_cls()
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                return
            try:
                result = await getattr(gen, f"cmd_{op}")(cmd)
            except Exception as exc:
                result = {"fatal": repr(exc)}
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()
    finally:
        await gen.close()


def loadgen_main(gen_cls: type[LoadGen] = LoadGen) -> None:
    """Answer commands on stdin with ``gen_cls`` (a subclass may add commands)."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_loadgen_main(gen_cls))


# =====================================================================================
# The mock provider process (``http_bench.py --mock``)


async def _mock_main() -> None:
    from unbroken.mock import MockProvider

    class BenchMock(MockProvider):
        def _record(self, rec: Any) -> None:  # keep memory and GC work flat
            pass

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with BenchMock(host="127.0.0.1", port=0) as mock:
        print(f"bench mock listening on {mock.url}", flush=True)
        await stop.wait()


def mock_main() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_mock_main())
