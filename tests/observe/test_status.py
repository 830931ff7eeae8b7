"""GET /status and `unbroken status`: in-flight turns, upstream cool-offs, totals."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import aiohttp
import pytest
from rich.console import Console

from relayfix import Recorder, make_config
from unbroken.cli import main
from unbroken.observe.hooks import TurnInfo
from unbroken.observe.status import StatusTracker, render, watch
from unbroken.relay.server import RelayServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class _Waiting(Recorder):
    """Sets ``retrying`` once the relay has decided to wait before its next attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.retrying = asyncio.Event()

    def attempt_failed(self, turn, upstream, failure, *, phase, wait_s):  # type: ignore[no-untyped-def]
        super().attempt_failed(turn, upstream, failure, phase=phase, wait_s=wait_s)
        if wait_s is not None:
            self.retrying.set()


async def _status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/status") as r:
        assert r.status == 200 and r.content_type == "application/json"
        data: dict[str, Any] = await r.json()
        return data


@pytest.fixture
async def waiting_relay(mock):
    """A relay whose one turn is waiting 30 s (Retry-After) before its second attempt."""
    rec = _Waiting()
    server = RelayServer(make_config([{"url": mock.url}]), hooks=rec)
    await server.start()
    mock.script([{"status": 429, "headers": {"Retry-After": "30"}}])
    session = aiohttp.ClientSession()
    task = asyncio.ensure_future(
        session.post(
            f"{server.url}/mock/v1/chat/completions",
            json=CHAT,
            headers={"x-session-id": "secret-session", "Authorization": "Bearer sk-canary-9"},
        )
    )
    async with asyncio.timeout(30):
        await rec.retrying.wait()
    yield server, rec, task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await session.close()
    await server.stop()


async def test_status_reflects_an_inflight_retry(mock, waiting_relay):
    server, rec, task = waiting_relay
    data = await _status(server.url)
    [turn] = data["inflight"]
    assert turn["route"] == "mock" and turn["protocol"] == "chat"
    assert turn["path"] == "v1/chat/completions" and turn["stream"] is True
    assert turn["state"] == "waiting"
    assert turn["attempts"] == 1
    assert turn["upstream"] == mock.url
    assert turn["last_failure"] == "429"
    assert 20 < turn["next_retry_in_s"] <= 30
    assert turn["age_s"] >= 0 and turn["held_bytes"] == 0
    assert set(turn) == {
        "id", "route", "path", "protocol", "stream", "state", "attempts", "upstream",
        "last_failure", "next_retry_in_s", "age_s", "held_bytes",
    }
    [up] = [u for u in data["upstreams"] if u["route"] == "mock"]
    assert up["upstream"] == mock.url and up["up"] is True
    assert up["failed"] == 1 and 20 < up["cooloff_s"] <= 30
    assert [f["reason"] for f in up["recent_failures"]] == ["429"]
    totals = data["totals"]
    assert totals["turns"] == 0 and totals["retries"] == 1 and totals["failures"] == 1
    assert totals["failures_by_reason"] == {"429": 1}
    assert totals["failures_by_phase"] == {"headers": 1}
    assert data["journal"]["healthy"] in (None, True)
    text = json.dumps(data)
    assert "secret-session" not in text and "sk-canary-9" not in text

    # the client leaves: the turn is gone from the view and counted
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await rec.wait_turns(1)
    after = await _status(server.url)
    assert after["inflight"] == []
    assert after["totals"]["turns"] == 1
    assert after["totals"]["outcomes"]["aborted_by_client"] == 1


async def test_status_command_once_and_json(mock, waiting_relay, capsys, monkeypatch):
    server, _, _ = waiting_relay
    monkeypatch.setenv("COLUMNS", "160")
    code = await asyncio.to_thread(main, ["status", "--once", "--url", server.url])
    assert code == 0
    out = capsys.readouterr().out
    assert "In flight" in out and "waiting" in out and "429" in out and "in 2" in out
    assert "Upstreams" in out and mock.url in out
    code = await asyncio.to_thread(main, ["status", "--json", "--url", server.url])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["inflight"][0]["last_failure"] == "429"


async def test_live_view_redraws_in_place(mock, waiting_relay):
    server, _, _ = waiting_relay
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160)
    assert await watch(server.url, 0.0, console=console, max_updates=2) == 0
    out = buf.getvalue()
    assert "waiting" in out and "429" in out
    assert "\x1b[" in out  # cursor movement: the second frame overwrote the first


async def test_status_command_unreachable(capsys, unused_tcp_port):
    code = await asyncio.to_thread(
        main, ["status", "--once", "--url", f"http://127.0.0.1:{unused_tcp_port}"]
    )
    assert code == 1
    assert "cannot reach" in capsys.readouterr().out


def test_held_bytes_and_render():
    class FakeLedger:
        held_bytes = 2048

    turn = TurnInfo(route="r", path="v1/messages?beta=true", protocol="anthropic", stream=True)
    turn.state, turn.attempts, turn.upstream = "holding", 2, "http://u.test"
    turn.ledger = FakeLedger()
    tracker = StatusTracker(lambda: [turn], list, extra=lambda: {"journal": {
        "healthy": False, "dropped": 7, "path": "/x", "pending": 0}})
    data = tracker.snapshot()
    [view] = data["inflight"]
    assert view["held_bytes"] == 2048 and view["path"] == "v1/messages"
    assert view["next_retry_in_s"] is None
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render(data, "http://127.0.0.1:4780"))
    text = console.export_text()
    assert "holding" in text and "2.0 KiB" in text and "http://u.test" in text
    assert "journal NOT WRITTEN (7 rows dropped)" in text
    assert "1 in flight" in text
