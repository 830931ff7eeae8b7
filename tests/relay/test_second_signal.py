"""Issue 36 item 6: a second SIGTERM cuts the grace period short, and the turns it cuts
are still journaled as ended.

The second signal used to cancel the whole shutdown: the journal was closed (or the
process left) before the cut turns, which did send their clients a native error
event, reported their ends, so those turns stayed ``outcome`` NULL ("unfinished")
for good.  Real ``unbroken serve`` processes, one and two workers.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from relay.test_health_relay import CHAT, PATH, until
from relay.test_signals import alive
from servefix import serve_subprocess
from unbroken.mock import MockProvider

LONG = {"deltas": 200, "chunk_delay_ms": 100, "count": 100}  # 20 s streams
N = 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
async def test_turns_cut_by_a_second_sigterm_are_journaled_as_ended(
    tmp_path: Path, mock: MockProvider, workers: int
) -> None:
    journal = tmp_path / "journal.sqlite3"
    cfg = tmp_path / "relay.toml"
    cfg.write_text(
        f'[server]\ngrace_s = 60\n[journal]\npath = "{journal}"\n'
        f'[routes.mock]\nupstreams = [{{ url = "{mock.url}" }}]\n'
    )
    served = await serve_subprocess(
        cfg,
        *(["--workers", str(workers)] if workers > 1 else []),
        env={"TMPDIR": str(tmp_path)},
    )
    proc, err = served.proc, served.err
    try:
        url = served.url
        mock.script([LONG])
        conn = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:

            async def stream() -> bytes:
                async with http.post(url + PATH, json=CHAT) as r:
                    return await r.read()

            streams = [asyncio.ensure_future(stream()) for _ in range(N)]
            await until(lambda: len(mock.requests) >= N, cap=20)
            proc.send_signal(signal.SIGTERM)
            await until(lambda: sum("shutting down" in e for e in err) >= workers, cap=20)
            proc.send_signal(signal.SIGTERM)
            bodies = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        code, text = await served.exited()
        assert code == 0, text[-2000:]
        assert not any(isinstance(b, bytes) and b"[DONE]" in b for b in bodies)  # all cut
    finally:
        served.kill()
        await served.exited()
    db = sqlite3.connect(journal)
    try:
        rows = db.execute("SELECT outcome FROM turns").fetchall()
    finally:
        db.close()
    assert len(rows) == N
    assert all(outcome is not None for (outcome,) in rows), rows
    assert not any(alive(p) for p in [proc.pid])
