"""WebSocket benchmark: Responses over WebSocket, direct vs through unbroken vs a bare relay.

    python bench/ws_bench.py [--quick] [--out docs/performance.md]

Three processes per path: the mock provider, the system under test (pinned to
CPU 0 with taskset when available) and the load generator (pinned to CPU 1).
Measures, in one run:

* messages/s at concurrency 32 (each socket sends ``response.create`` and
  reads every event up to ``response.completed``, in a loop);
* round-trip time of a one-delta turn at concurrency 1 (create sent ->
  ``response.completed`` received), p50 and p99; added = path - direct.

Targets (issue 4): >= 0.85x direct messages/s, <= 0.3 ms added round trip.
Results go to the "## WebSocket" section of the output file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

ROOT = Path(__file__).resolve().parent.parent
CREATE = {"type": "response.create", "model": "m", "input": "hi", "store": False}
SECTION = "## WebSocket"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() else []


# -- the bare WebSocket pass-through (the floor) -------------------------------------
async def _bare_main(upstream: str, port: int) -> None:
    session = aiohttp.ClientSession()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        client = web.WebSocketResponse(compress=False, max_msg_size=0)
        await client.prepare(request)
        async with session.ws_connect(
            upstream + request.path, compress=0, max_msg_size=0, decode_text=False
        ) as up:

            async def down() -> None:
                async for msg in up:
                    await client.send_frame(msg.data, WSMsgType.TEXT)

            task = asyncio.ensure_future(down())
            async for msg in client:
                if msg.type is WSMsgType.TEXT:
                    await up.send_str(msg.data)
            task.cancel()
        return client

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


# -- load generation ------------------------------------------------------------------
async def _turns(url: str, action: dict[str, Any], seconds: float, conc: int) -> dict[str, Any]:
    """Run turns on ``conc`` sockets for ``seconds``; count messages and round trips."""
    headers = {"x-mock-action": json.dumps(action)}
    counts = [0] * conc
    rtts: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(i: int, session: aiohttp.ClientSession) -> None:
        async with session.ws_connect(url, headers=headers, max_msg_size=0) as ws:
            msg_create = json.dumps(CREATE)
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                await ws.send_str(msg_create)
                while True:
                    msg = await ws.receive()
                    if msg.type is not WSMsgType.TEXT:
                        raise RuntimeError(f"socket ended: {msg}")
                    counts[i] += 1
                    if '"response.completed"' in msg.data[:64]:
                        break
                rtts.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, session) for i in range(conc)))
        elapsed = time.perf_counter() - t0
    return {"messages": sum(counts), "elapsed": elapsed, "rtts": rtts}


def _loadgen(url: str, action: dict[str, Any], seconds: float, conc: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            *_pin(1),
            sys.executable,
            __file__,
            "--loadgen",
            url,
            json.dumps(action),
            str(seconds),
            str(conc),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- processes ----------------------------------------------------------------------------
class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.tmp = tempfile.mkdtemp(prefix="unbroken-wsbench-")

    def start(self, args: list[str], pattern: str) -> subprocess.Popen[str]:
        env = {**os.environ, "XDG_STATE_HOME": self.tmp}
        p = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.procs.append(p)
        assert p.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if re.search(pattern, line):
                return p
            if not line and p.poll() is not None:
                break
        raise RuntimeError(f"{args} did not become ready")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)


def run(quick: bool) -> dict[str, Any]:
    seconds = 3.0 if quick else 10.0
    reps = 1 if quick else 3
    procs = Procs()
    try:
        mport, rport, bport = _free_port(), _free_port(), _free_port()
        procs.start(
            [*_pin(1), sys.executable, "-m", "unbroken", "mock", "--port", str(mport)], "listening"
        )
        cfg = Path(procs.tmp) / "unbroken.toml"
        # As shipped (journal on, in a temporary XDG_STATE_HOME), but quiet logs.
        cfg.write_text(
            "[retry]\nverbose = false\n"
            f'[routes.mock]\nupstreams = [{{ url = "http://127.0.0.1:{mport}" }}]\n'
        )
        procs.start(
            [
                *_pin(0),
                sys.executable,
                "-m",
                "unbroken",
                "serve",
                "--config",
                str(cfg),
                "--port",
                str(rport),
            ],
            "relaying on",
        )
        procs.start(
            [*_pin(0), sys.executable, __file__, "--bare", f"ws://127.0.0.1:{mport}", str(bport)],
            "ready",
        )
        urls = {
            "direct": f"ws://127.0.0.1:{mport}/v1/responses",
            "bare": f"ws://127.0.0.1:{bport}/v1/responses",
            "unbroken": f"ws://127.0.0.1:{rport}/mock/v1/responses",
        }
        res: dict[str, Any] = {"throughput": {}, "rtt": {}}
        for url in urls.values():  # warm up
            _loadgen(url, {"deltas": 1}, 0.5, 2)
        for _ in range(reps):  # interleave the paths so noise hits them alike
            for name, url in urls.items():
                r = _loadgen(url, {"deltas": 50}, seconds, 32)
                res["throughput"].setdefault(name, []).append(r["messages"] / r["elapsed"])
                r = _loadgen(url, {"deltas": 1}, seconds / 2, 1)
                res["rtt"].setdefault(name, []).extend(r["rtts"])
        return res
    finally:
        procs.stop()


def render(res: dict[str, Any], argv: list[str]) -> str:
    tp = {k: statistics.median(v) for k, v in res["throughput"].items()}

    def q(values: list[float], p: float) -> float:
        s = sorted(values)
        return s[min(len(s) - 1, int(p * len(s)))] * 1000

    rtt = {k: (q(v, 0.5), q(v, 0.99), len(v)) for k, v in res["rtt"].items()}
    ratio = tp["unbroken"] / tp["direct"]
    bare_ratio = tp["bare"] / tp["direct"]
    added = rtt["unbroken"][0] - rtt["direct"][0]
    added_bare = rtt["bare"][0] - rtt["direct"][0]
    ok_tp, ok_rtt = ratio >= 0.85, added <= 0.3
    lines = [
        SECTION,
        "",
        "Reproduce: `python bench/ws_bench.py" + (" " + " ".join(argv) if argv else "") + "`",
        "",
        f"Relay pinned to CPU 0, load generator and mock on CPU 1; nproc={os.cpu_count()}, "
        f"Python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}. "
        "Medians over repetitions; the paths are interleaved so noise hits them alike.",
        "",
        "| path | messages/s (c=32, 50-delta turns) | ratio to direct "
        "| round trip p50 / p99 (c=1, one delta) | added p50 |",
        "|---|---|---|---|---|",
        f"| direct | {tp['direct']:,.0f} | 1.00x | {rtt['direct'][0]:.2f} / "
        f"{rtt['direct'][1]:.2f} ms | — |",
        f"| bare aiohttp WS relay | {tp['bare']:,.0f} | {bare_ratio:.2f}x | "
        f"{rtt['bare'][0]:.2f} / {rtt['bare'][1]:.2f} ms | {added_bare:+.2f} ms |",
        f"| unbroken | {tp['unbroken']:,.0f} | {ratio:.2f}x | {rtt['unbroken'][0]:.2f} / "
        f"{rtt['unbroken'][1]:.2f} ms | {added:+.2f} ms |",
        "",
        "| target | result | verdict |",
        "|---|---|---|",
        f"| messages/s ≥ 0.85× direct | {ratio:.2f}× | {'PASS' if ok_tp else 'MISS'} |",
        f"| added round trip ≤ 0.3 ms | {added:+.2f} ms | {'PASS' if ok_rtt else 'MISS'} |",
        "",
        "unbroken runs as shipped (journal on, in a temporary directory): it classifies every "
        "message through the commit ledger (control frames are held until the first output), "
        "keeps per-connection history for `previous_response_id`, journals each turn, and "
        "answers pings; the bare relay only copies frames. unbroken can exceed direct in "
        "messages/s because it coalesces the messages that one upstream read delivers into one "
        "write, which also saves the client a read per message; the mock writes each message "
        "on its own.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str) -> None:
    doc = path.read_text() if path.exists() else "# Performance\n"
    start = doc.find(SECTION)
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + text
    else:
        nxt = doc.find("\n## ", start + len(SECTION))
        doc = doc[:start] + text + (doc[nxt + 1 :] if nxt >= 0 else "")
    path.write_text(doc)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--loadgen":
        url, action, seconds, conc = sys.argv[2:6]
        r = asyncio.run(_turns(url, json.loads(action), float(seconds), int(conc)))
        print(json.dumps(r))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--bare":
        asyncio.run(_bare_main(sys.argv[2], int(sys.argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run, for a smoke test")
    parser.add_argument("--out", type=Path, help="write the WebSocket section into this file")
    args = parser.parse_args()
    res = run(args.quick)
    argv = [a for a in sys.argv[1:] if a]
    text = render(res, argv)
    print(text)
    if args.out:
        write_section(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
