"""Issue 36, item 4: a stalled attempt leaves nothing behind.

The relay cuts a stalled upstream answer (`http_attempt.abort_response`).  It used to
do so with ``resp.close()`` alone, which hands the waiting read aiohttp's single
module-level ``ClientConnectionError("Connection closed")``; each raise of that one
instance prepends its frames to the same ``__traceback__``, so every stalled
attempt's frames, and through them its turn, request and buffers, stayed reachable
for the life of the process (~22 KB per stall in a soak, linear).

The test counts what a finished turn should not leave: the turn machines and HTTP
attempts still alive after a collection, once after N stalled turns and again after
2N.  Counting objects of the relay's own types (not RSS, not timing) keeps it
robust on a loaded machine; the old code left one of each per stalled turn.
"""

from __future__ import annotations

import gc
from typing import Any

import aiohttp

from relay.regressionfix import CHAT, CHAT_PATH, relay_for
from unbroken.core.turn.machine import TurnMachine
from unbroken.mock import MockProvider, frames_for
from unbroken.relay.http_attempt import HttpAttempt

N = 12


def _alive() -> dict[str, int]:
    gc.collect()
    counts = {"TurnMachine": 0, "HttpAttempt": 0}
    for obj in gc.get_objects():
        if isinstance(obj, TurnMachine):
            counts["TurnMachine"] += 1
        elif isinstance(obj, HttpAttempt):
            counts["HttpAttempt"] += 1
    return counts


async def _stalled_turns(
    http: aiohttp.ClientSession, url: str, mock: MockProvider, rec: Any, n: int
) -> None:
    """``n`` turns, each stalled once: half before any output (replayed, the client
    gets the whole stream), half after output (ended with the native error)."""
    clean = b"".join(frames_for("chat", {}, CHAT))
    for i in range(n):
        before = i % 2 == 0
        if before:
            mock.script([{"fault": "stall", "after_frame": 1, "seconds": 5}, {}])
        else:
            mock.script([{"fault": "stall", "after_frame": 3, "seconds": 5}])
        async with http.post(f"{url}/mock/{CHAT_PATH}", json=CHAT) as resp:
            body = await resp.read()
        if before:
            assert body == clean
        else:
            assert b'"error"' in body and b"[DONE]" not in body


async def test_stalled_attempts_leave_no_turn_behind(mock: MockProvider) -> None:
    stream = {"idle_timeout_s": 0.1, "first_frame_timeout_s": 0.1}
    async with relay_for(mock.url, stream=stream) as (server, rec), aiohttp.ClientSession() as http:
        await _stalled_turns(http, server.url, mock, rec, 2)  # warm-up: pools, caches
        await rec.wait_turns(2)
        await _stalled_turns(http, server.url, mock, rec, N)
        await rec.wait_turns(2 + N)
        at_n = _alive()
        await _stalled_turns(http, server.url, mock, rec, N)
        await rec.wait_turns(2 + 2 * N)
        at_2n = _alive()
        stalls = [f for f in rec.failures if f[0] == "stall"]
    assert len(stalls) == 2 + 2 * N  # every turn did stall once
    grown = {k: at_2n[k] - at_n[k] for k in at_n}
    # The old code: +N of each (one per stalled turn).  Allow a turn still unwinding.
    assert all(g <= 2 for g in grown.values()), (
        f"{N} more stalled turns left {grown} more objects alive "
        f"(after {N}: {at_n}, after {2 * N}: {at_2n})"
    )
