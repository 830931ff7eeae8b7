"""A finished turn is freed by reference counting: it leaves no reference cycle.

Cyclic garbage is not a leak (the collector finds it), but every turn that leaves
some makes the collector run more often and walk more objects: CPU on every turn
(it was 40-odd objects per turn, the turn's own and the aiohttp request and
response it held).  So each transport tears its turn down: the watchdog drops its
callback, the attempt drops its sink, the record drops its live reader.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from relayfix import make_config, start_relay

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
CREATE = {"type": "response.create", "model": "m", "input": "hi", "store": False}


#: where a turn's own objects come from: the relay's, and the aiohttp request and
#: response it holds.  (asyncio may leave a closing transport in a cycle for a moment;
#: that is not a turn's, and it is not counted.)
_OURS = ("unbroken.", "aiohttp.web_request", "aiohttp.web_response", "aiohttp.client_reqrep")


async def _garbage_per_turn(turn: Callable[[], Awaitable[None]], n: int = 20) -> dict[str, int]:
    """The turn-related types left as cyclic garbage by ``n`` turns (after warm-up)."""
    for _ in range(5):
        await turn()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(n):
            await turn()
        # Each turn before the last has ended (a connection serves one request at a
        # time); the last may still be ending: its objects are live, not counted.
        gc.collect()
        found = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in gc.garbage
            if type(o).__module__.startswith(_OURS)
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return dict(found)


@pytest.fixture
async def relay(mock: Any) -> AsyncIterator[Any]:
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    yield server
    await server.stop()


@pytest.mark.parametrize("stream", [True, False])
async def test_http_turns_leave_no_cycles(relay: Any, stream: bool) -> None:
    url = f"{relay.url}/mock/v1/chat/completions"
    async with aiohttp.ClientSession() as s:

        async def turn() -> None:
            async with s.post(url, json={**BODY, "stream": stream}) as r:
                assert r.status == 200
                await r.read()

        assert await _garbage_per_turn(turn) == {}


async def test_a_retried_turn_leaves_no_cycles(relay: Any, mock: Any, no_waits: None) -> None:
    # no_waits: the retry's Wait still runs, for 0 s (11 turns took 10 s of backoff)
    url = f"{relay.url}/mock/v1/chat/completions"
    async with aiohttp.ClientSession() as s:

        async def turn() -> None:
            mock.script([{"status": 503}, {}])
            async with s.post(url, json={**BODY, "stream": True}) as r:
                assert r.status == 200
                await r.read()

        assert await _garbage_per_turn(turn, n=10) == {}


async def test_websocket_turns_leave_no_cycles(relay: Any) -> None:
    url = relay.url.replace("http://", "ws://") + "/mock/v1/responses"
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:

        async def turn() -> None:
            await ws.send_str(json.dumps(CREATE))
            while True:
                msg = await asyncio.wait_for(ws.receive(), 30)
                assert msg.type is aiohttp.WSMsgType.TEXT, msg
                if json.loads(msg.data)["type"] == "response.completed":
                    return

        assert await _garbage_per_turn(turn) == {}


def test_serve_makes_the_collector_cheap() -> None:
    """`serve` (and each worker) raises the first threshold and freezes start-up objects;
    run in a child process, so this process's collector stays as it was."""
    code = textwrap.dedent(
        """
        import asyncio, gc
        from unbroken.config import parse_config
        from unbroken.relay.server import GC_THRESHOLD0, serve

        config = parse_config({"server": {"port": 0}}, env={})
        seen = {}

        async def main():
            stop = asyncio.Event()

            def ready(url):
                seen["threshold"] = gc.get_threshold()[0]
                seen["frozen"] = gc.get_freeze_count()
                stop.set()

            await serve(config, ready=ready, stop_event=stop)

        before = gc.get_threshold()[0]
        asyncio.run(main())
        assert before == 700, before
        assert seen["threshold"] == GC_THRESHOLD0 and seen["frozen"] > 1000, seen
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
