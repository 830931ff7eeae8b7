"""Recovery after an outage with ``unbroken serve --workers N`` and no Redis (issue 36).

A benchmark, not a test: it measures and reports, it asserts nothing.

    python bench/workers_recovery_bench.py [--workers 2] [--outage 30] [--turns 200] \\
        [--runs 10] [--json FILE]

Each run starts a fresh relay (``serve --workers N``, defaults: no Redis, so the
workers share health through their runtime directory's channel and probe lock) in
front of the project's mock, which answers 503 to everything for ``--outage``
seconds while ``--turns`` streamed turns wait in the relay (parked behind the open
breaker); then the mock answers again.  Recovery is the time from that moment to
the last turn's end.  The half-open probe goes through whichever worker holds the
``probe-<hash>`` lock; a lock that outlives its probe (issue 36, item 1) showed as
recoveries of up to ``probe_timeout_s`` (30 s).  Printed: one line per run, then how
many runs recovered within 1.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from unbroken.mock import MockProvider

WITHIN_S = 1.5
TAIL_S = 60.0  # a turn not finished this long after recovery counts as not finished


def body(i: int) -> bytes:
    msg = {"role": "user", "content": f"turn {i}"}
    return json.dumps({"model": "m", "stream": True, "messages": [msg]}).encode()


async def turn(http: aiohttp.ClientSession, url: str, i: int) -> tuple[bool, float, str]:
    """One streamed turn: (completed, when it ended, what went wrong)."""
    try:
        async with http.post(url, data=body(i), headers={"content-type": "application/json"}) as r:
            data = await r.read()
            ok = r.status == 200 and b"[DONE]" in data and b'"error"' not in data
            err = "" if ok else f"HTTP {r.status}: {data[:200]!r}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        ok, err = False, f"{type(exc).__name__}: {exc}"
    return ok, time.monotonic(), err


async def start_relay(
    mock_url: str, workers: int, workdir: Path
) -> tuple[asyncio.subprocess.Process, str]:
    cfg = workdir / "relay.toml"
    cfg.write_text(
        "[server]\ngrace_s = 1\n[retry]\nverbose = false\n[journal]\nenabled = false\n"
        f'[routes.mock]\nupstreams = [{{ url = "{mock_url}" }}]\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNBROKEN_", "OPENCODE_"))}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "unbroken", "serve", "--config", str(cfg), "--port", "0"),
        *("--workers", str(workers)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**env, "XDG_STATE_HOME": str(workdir), "HOME": str(workdir)},
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    m = re.search(r"http://\S+", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"no URL in {line!r}")
    return proc, m.group(0)


async def one_run(mock: MockProvider, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    proc, url = await start_relay(mock.url, args.workers, workdir)
    try:
        chat = f"{url}/mock/v1/chat/completions"
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=args.outage + TAIL_S + 30)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
            for _ in range(3):  # warm: every import, the pools
                ok, _, err = await turn(http, chat, -1)
                if ok:
                    break
                print(f"warm-up turn failed: {err}", flush=True)
            else:
                raise RuntimeError(f"the warm-up turn failed: {err}")
            mock.set_default({"status": 503})
            tasks = [asyncio.ensure_future(turn(http, chat, i)) for i in range(args.turns)]
            await asyncio.sleep(args.outage)
            mock.set_default(None)
            t_rec = time.monotonic()
            done, pending = await asyncio.wait(tasks, timeout=TAIL_S)
            for t in pending:
                t.cancel()
            ends = [t.result() for t in done]
        finished = [end for ok, end, _ in ends if ok]
        last = max(finished) - t_rec if finished else None
        return {"completed": len(finished), "turns": args.turns, "recovery_s": last}
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="workers-recovery-") as tmp:
        async with MockProvider(port=0, record=False) as mock:
            for n in range(args.runs):
                res = await one_run(mock, args, Path(tmp))
                rec = res["recovery_s"]
                print(
                    f"run {n + 1}: {res['completed']}/{res['turns']} turns, last one "
                    + (f"{rec:.2f} s after recovery" if rec is not None else "never"),
                    flush=True,
                )
                results.append(res)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--outage", type=float, default=30.0, help="seconds of 503s")
    ap.add_argument("--turns", type=int, default=200, help="turns waiting through the outage")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    recs = [r["recovery_s"] for r in results]
    good = sum(
        1
        for r in results
        if r["recovery_s"] is not None
        and r["completed"] == r["turns"]
        and r["recovery_s"] <= WITHIN_S
    )
    print(
        f"--workers {args.workers}, {args.outage:g} s outage, {args.turns} turns: "
        f"{good} of {len(results)} runs recovered within {WITHIN_S:g} s "
        f"(max {max((x for x in recs if x is not None), default=float('nan')):.2f} s)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
