"""Scaling benchmark: streamed req/s with ``unbroken serve --workers 1`` vs ``--workers 2``.

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/workers_bench.py [--seconds 8] [--concurrency 64] [--reps 3] [--json FILE]

Separate processes on loopback, ephemeral ports: the mock provider (request
recording off), ``python -m unbroken serve --workers N`` in front of it, and
``--clients`` load-generator processes sharing ``--concurrency`` keep-alive
connections, each sending streamed Chat Completions (8 text deltas) over raw
sockets (``--aiohttp``: with aiohttp clients, which cost several times the CPU
per request and so cap the rate on a 2-core machine before the relay does).
Every process runs on the same machine, so the workers compete with the mock and
the load generators for the cores: the ratio is a lower bound of what a second
core gives the relay.
Runs alternate N=1 and N=2; the median of ``--reps`` runs is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.queues import SimpleQueue
from pathlib import Path

import aiohttp

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
MOCK = """
import asyncio, sys
from unbroken.mock import MockProvider
async def main():
    async with MockProvider(port=0, record=False) as m:
        m.script([{"deltas": 8, "count": 1_000_000}])
        print(m.url, flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""


def _start(cmd: list[str], pattern: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(pattern, line)
    if not m:
        proc.kill()
        raise RuntimeError(f"no URL in {line!r}")
    return proc, m.group(0)


async def _load(url: str, concurrency: int, seconds: float) -> int:
    done = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        warm_until = time.monotonic() + 1.0
        stop = warm_until + seconds

        async def one() -> None:
            nonlocal done
            while time.monotonic() < stop:
                async with http.post(url + "/mock/v1/chat/completions", json=CHAT) as r:
                    body = await r.read()
                if r.status == 200 and b"[DONE]" in body and time.monotonic() > warm_until:
                    done += 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return done


async def _raw_load(url: str, concurrency: int, seconds: float) -> int:
    """The same turns over raw keep-alive sockets: far less client CPU than aiohttp's."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(CHAT).encode()
    request = (
        f"POST /mock/v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    done = 0
    warm_until = time.monotonic() + 1.0
    stop = warm_until + seconds

    async def one() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.monotonic() < stop:
                writer.write(request)
                parts: list[bytes] = []
                tail = b""
                while not tail.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                    chunk = await reader.read(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    parts.append(chunk)
                    tail = (tail + chunk)[-16:]
                if b"[DONE]" in b"".join(parts) and time.monotonic() > warm_until:
                    done += 1
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return done


def _client(
    url: str, concurrency: int, seconds: float, out: SimpleQueue[int], raw: bool = True
) -> None:
    load = _raw_load if raw else _load
    out.put(asyncio.run(load(url, concurrency, seconds)))


def run_once(mock_url: str, workers: int, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(
            "[retry]\nverbose = false\n[journal]\nenabled = false\n"
            f'[routes.mock]\nupstreams = [{{ url = "{mock_url}" }}]\n'
        )
        relay, url = _start(
            [
                sys.executable,
                "-m",
                "unbroken",
                "serve",
                "--config",
                str(cfg),
                "--port",
                "0",
                "--workers",
                str(workers),
            ],
            r"http://127\.0\.0\.1:\d+",
        )
        try:
            ctx = multiprocessing.get_context("spawn")
            out: SimpleQueue[int] = ctx.SimpleQueue()
            per = max(1, args.concurrency // args.clients)
            procs = [
                ctx.Process(target=_client, args=(url, per, args.seconds, out, not args.aiohttp))
                for _ in range(args.clients)
            ]
            for p in procs:
                p.start()
            total = sum(out.get() for _ in procs)
            for p in procs:
                p.join()
            return total / float(args.seconds)
        finally:
            relay.terminate()
            relay.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--clients", type=int, default=2, help="load-generator processes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--aiohttp",
        action="store_true",
        help="load with aiohttp clients (default: raw sockets, cheaper per request)",
    )
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    mock, mock_url = _start([sys.executable, "-c", MOCK], r"http://127\.0\.0\.1:\d+")
    runs: dict[int, list[float]] = {1: [], 2: []}
    try:
        for _ in range(args.reps):
            for workers in (1, 2):
                rps = run_once(mock_url, workers, args)
                runs[workers].append(rps)
                print(f"workers={workers} {rps:.0f} req/s", flush=True)
    finally:
        mock.terminate()
        mock.wait(10)
    one, two = statistics.median(runs[1]), statistics.median(runs[2])
    report = {
        "cpus": os.cpu_count(),
        "seconds": args.seconds,
        "concurrency": args.concurrency,
        "clients": args.clients,
        "runs": runs,
        "median_rps": {"1": one, "2": two},
        "ratio": round(two / one, 2) if one else None,
    }
    print(json.dumps(report), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
