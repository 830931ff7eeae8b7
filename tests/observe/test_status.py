"""GET /status and `unbroken status`: in-flight turns, upstream cool-offs, totals."""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from rich.console import Console

from docsamples import DOCS, block_after
from relayfix import Recorder, make_config
from unbroken.cli import main
from unbroken.core.admission.policy import Failure
from unbroken.mock import MockProvider
from unbroken.observe.hooks import TurnRecord
from unbroken.observe.status import StatusTracker, render, watch
from unbroken.relay.server import RelayServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class _Waiting(Recorder):
    """Sets ``retrying`` once the relay has decided to wait before its next attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.retrying = asyncio.Event()

    def attempt_failed(
        self, turn: TurnRecord, upstream: str, failure: Failure, *, phase: str, wait_s: float | None
    ) -> None:
        super().attempt_failed(turn, upstream, failure, phase=phase, wait_s=wait_s)
        if wait_s is not None:
            self.retrying.set()


WaitingRelay = tuple[RelayServer, _Waiting, "asyncio.Future[aiohttp.ClientResponse]"]


async def _status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/status") as r:
        assert r.status == 200 and r.content_type == "application/json"
        data: dict[str, Any] = await r.json()
        return data


@pytest.fixture
async def waiting_relay(
    mock: MockProvider,
) -> AsyncIterator[tuple[RelayServer, _Waiting, asyncio.Future[aiohttp.ClientResponse]]]:
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


async def test_status_reflects_an_inflight_retry(
    mock: MockProvider, waiting_relay: WaitingRelay
) -> None:
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
    assert turn["client"] == "unknown"  # the client profile (an aiohttp client)
    assert set(turn) == {
        "id",
        "route",
        "path",
        "protocol",
        "stream",
        "client",
        "state",
        "attempts",
        "upstream",
        "last_failure",
        "next_retry_in_s",
        "parked_for",
        "age_s",
        "held_bytes",
        "splices",
        "chain",
    }
    # its attempt chain: the one failed attempt, as the journal records it
    [attempt] = turn["chain"]
    assert attempt["n"] == 1 and attempt["upstream"] == mock.url and attempt["choice"] == "first"
    assert (attempt["reason"], attempt["phase"], attempt["status"]) == ("429", "headers", 429)
    assert attempt["started"] <= attempt["ended"] <= data["now"]
    [failure] = data["last_failures"]
    assert failure == {"turn": turn["id"], "route": "mock", **attempt}
    [[at, ok, failed, turns_ok, turns_failed]] = data["timeline"]["seconds"]
    assert (ok, failed, turns_ok, turns_failed) == (0, 1, 0, 0)
    assert at == int(attempt["ended"])
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
    # a client's abort is neither a good nor a bad turn on the timeline
    assert [b[3:] for b in after["timeline"]["seconds"]] == [[0, 0]] * len(
        after["timeline"]["seconds"]
    )


async def test_status_command_once_and_json(
    mock: MockProvider,
    waiting_relay: WaitingRelay,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, _, _ = waiting_relay
    monkeypatch.setenv("COLUMNS", "160")
    code = await asyncio.to_thread(main, ["status", "--once", "--url", server.url])
    assert code == 0
    out = capsys.readouterr().out
    assert "In flight" in out and "waiting" in out and "429" in out
    assert re.search(r"│ (29|[12]\d)s ", out), out  # retry in 29 s (20-29 on a slow machine)
    assert "Upstreams" in out and mock.url in out
    code = await asyncio.to_thread(main, ["status", "--json", "--url", server.url])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["inflight"][0]["last_failure"] == "429"


async def test_live_view_redraws_in_place(mock: MockProvider, waiting_relay: WaitingRelay) -> None:
    server, _, _ = waiting_relay
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160)
    assert await watch(server.url, 0.0, console=console, max_updates=2) == 0
    out = buf.getvalue()
    assert "waiting" in out and "429" in out
    assert "\x1b[" in out  # cursor movement: the second frame overwrote the first


async def test_status_into_a_file_prints_one_snapshot_and_exits(
    mock: MockProvider, tmp_path: Path
) -> None:
    """``unbroken status > file``: the live view needs a terminal; it drew nothing
    into a file and never exited (without --once)."""
    server = RelayServer(make_config([{"url": mock.url}]))
    await server.start()
    out_file = tmp_path / "status.txt"
    try:
        with out_file.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "unbroken",
                "status",
                "--url",
                server.url,
                stdout=out,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(proc.communicate(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    finally:
        await server.stop()
    assert proc.returncode == 0, err.decode()
    text = out_file.read_text()
    assert "nothing in flight" in text and "Upstreams" in text
    assert "\x1b[" not in text  # no cursor movement: a snapshot, not a redraw


async def test_status_command_unreachable(
    capsys: pytest.CaptureFixture[str], unused_tcp_port: int
) -> None:
    code = await asyncio.to_thread(
        main, ["status", "--once", "--url", f"http://127.0.0.1:{unused_tcp_port}"]
    )
    assert code == 1
    assert "cannot reach" in capsys.readouterr().out


def test_held_bytes_and_render() -> None:
    turn = TurnRecord(route="r", path="v1/messages?beta=true", protocol="anthropic", stream=True)
    turn.state, turn.attempts, turn.upstream = "holding", 2, "http://u.test"
    turn.held = lambda: 2048
    tracker = StatusTracker(
        lambda: [turn],
        list,
        extra=lambda: {"journal": {"healthy": False, "dropped": 7, "path": "/x", "pending": 0}},
    )
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


# -- the terminal view fits the terminal -----------------------------------------------------
LONG_URL = "https://openrouter.ai/api/v1/some/very/long/path"
ROUTE = "openrouter-with-a-long-route-name"


def _snapshot(*, inflight: bool) -> dict[str, Any]:
    now = time.time()
    turns = [
        {
            "id": 12345,
            "route": ROUTE,
            "state": "streaming",
            "attempts": 3,
            "upstream": LONG_URL,
            "last_failure": "server_disconnected",
            "next_retry_in_s": None,
            "age_s": 1234.5,
            "held_bytes": 4096,
        },
        {
            "id": 7,
            "route": "mock",
            "state": "waiting",
            "attempts": 1,
            "upstream": "http://127.0.0.1:43167",
            "last_failure": "429",
            "next_retry_in_s": 29.3,
            "age_s": 0.2,
            "held_bytes": 0,
        },
    ]
    ups = [
        {
            "route": "openrouter",
            "upstream": LONG_URL,
            "up": False,
            "ok": 1234,
            "failed": 56,
            "recent_failures": [
                {"reason": "server_disconnected", "at": now - 3},
                {"reason": "503", "at": now - 1},
            ],
            "cooloff_s": 12,
        }
    ]
    return {
        "version": "0.1.0",
        "now": now,
        "uptime_s": 3.0,
        "inflight": turns if inflight else [],
        "upstreams": ups if inflight else [],
        "totals": {"turns": 3, "outcomes": {"ok": 3}, "failures_by_reason": {"503": 2}},
    }


def _text(data: dict[str, Any], width: int) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(render(data, "http://127.0.0.1:4780"))
    return console.export_text()


def _first_row(text: str, table: str, index: int) -> list[str]:
    """The lines of one cell of the first body row of a table in the view."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip() == table)
    rule = next(i for i in range(start, len(lines)) if "╇" in lines[i])
    cells: list[str] = []
    for line in lines[rule + 1 :]:
        parts = line.split("│")
        if len(parts) <= index or (cells and parts[0].strip()):
            break  # the end of the table, or the next row
        cells.append(parts[index].strip())
    return cells


@pytest.mark.parametrize("width", [80, 100, 200])
@pytest.mark.parametrize("inflight", [False, True])
def test_the_live_view_fits_the_terminal(width: int, inflight: bool) -> None:
    text = _text(_snapshot(inflight=inflight), width)
    assert max(len(line) for line in text.splitlines()) <= width, text
    # headers are never cut: a narrow header is whole, a wide one wraps at its space
    for word in (
        "turn",
        "route",
        "state",
        "try",
        "upstream",
        "last",
        "failure",
        "retry",
        "age",
        "held",
        "failed",
        "recent",
        "failures",
        "cool-off",
    ):
        assert re.search(rf"(^|[ ┃]){word}( |$)", text, re.M), (word, text)
    if inflight:
        # a wide column wraps its whole value; a narrow one truncates with an ellipsis
        assert "".join(_first_row(text, "In flight", 4)) == LONG_URL, text
        assert "".join(_first_row(text, "Upstreams", 1)) == LONG_URL, text
        route = _first_row(text, "In flight", 1)[0]
        if width == 80:
            assert route.endswith("…") and ROUTE.startswith(route[:-1]), text
        if width == 200:
            assert route == ROUTE, text
        assert "streaming" in text and "DOWN" in text


async def test_status_once_fits_80_columns_with_nothing_in_flight(
    mock: MockProvider, tmp_path: Path
) -> None:
    server = RelayServer(make_config([{"url": mock.url}]))
    await server.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "unbroken",
            "status",
            "--once",
            "--url",
            server.url,
            env={**__import__("os").environ, "COLUMNS": "80"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop()
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "upstream" in text and "last" in text and "failure" in text
    assert "nothing in flight" in text


def test_since_start_names_the_top_reasons_and_how_many_more() -> None:
    data = _snapshot(inflight=False)
    data["totals"]["failures_by_reason"] = {f"r{i}": i for i in range(1, 10)}  # 9 reasons
    text = _text(data, 80)
    shown = re.findall(r"│   (r\d) ", text)
    assert shown == ["r9", "r8", "r7", "r6", "r5", "r4"]
    assert re.search(r"│   and 3 more +│ +6 │", text), text  # r3 + r2 + r1
    data["totals"]["failures_by_reason"] = {f"r{i}": i for i in range(1, 7)}
    assert "more" not in _text(data, 80)


@pytest.mark.parametrize("interval", ["0", "-1", "0.1", "nan"])
async def test_status_refuses_an_interval_below_0_2_s(interval: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "unbroken",
        "status",
        "--interval",
        interval,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert err.decode().splitlines() == [
        f"unbroken status: --interval must be at least 0.2 s, got {float(interval):g}"
    ]
    assert out == b""


def test_status_help_shows_the_interval_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "at least 0.2 (default: 1.0)" in help_text


# -- the samples in docs/observability.md ------------------------------------------------------
OBSERVABILITY = DOCS / "observability.md"


def _json_sample() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(block_after(OBSERVABILITY, "`GET /status` returns JSON:"))
    return data


def _keys(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))


async def test_the_status_json_sample_has_the_shape_of_a_real_one(
    mock: MockProvider, waiting_relay: WaitingRelay
) -> None:
    server, _, _ = waiting_relay
    real = await _status(server.url)
    sample = _json_sample()
    _keys(sample, real, "top level")
    _keys(sample["inflight"][0], real["inflight"][0], "inflight[]")
    _keys(sample["inflight"][0]["chain"][0], real["inflight"][0]["chain"][0], "chain[]")
    _keys(sample["last_failures"][0], real["last_failures"][0], "last_failures[]")
    _keys(sample["timeline"], real["timeline"], "timeline")
    assert sample["timeline"]["fields"] == real["timeline"]["fields"]
    [up] = [u for u in real["upstreams"] if u["route"] == "mock"]
    _keys(sample["upstreams"][0], up, "upstreams[]")
    _keys(
        sample["upstreams"][0]["recent_failures"][0], up["recent_failures"][0], "recent_failures[]"
    )
    for key in ("totals", "journal", *(k for k in ("process",) if k in real)):
        _keys(sample[key], real[key], key)
    _keys(sample["totals"]["outcomes"], real["totals"]["outcomes"], "outcomes")
    reasons = {r["reason"] for u in sample["upstreams"] for r in u["recent_failures"]}
    assert reasons == set(sample["totals"]["failures_by_reason"])


def test_the_status_view_sample_is_the_view_of_the_json_sample() -> None:
    shown = block_after(OBSERVABILITY, "draws that as a")
    text = _text(_json_sample(), 80)
    assert [line.rstrip() for line in shown.splitlines()] == [
        line.rstrip() for line in text.splitlines()
    ], text


async def test_status_sends_the_token_when_one_is_set(
    monkeypatch: pytest.MonkeyPatch, unused_tcp_port: int
) -> None:
    from aiohttp import web

    from unbroken.observe.status import fetch_status

    seen: list[str | None] = []

    async def status(request: web.Request) -> web.Response:
        seen.append(request.headers.get("x-unbroken-token"))
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/status", status)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        monkeypatch.setenv("UNBROKEN_TOKEN", "a-status-token-0123456789")
        assert await fetch_status(f"http://127.0.0.1:{unused_tcp_port}") == {"ok": True}
        monkeypatch.delenv("UNBROKEN_TOKEN")
        await fetch_status(f"http://127.0.0.1:{unused_tcp_port}")
    finally:
        await runner.cleanup()
    assert seen == ["a-status-token-0123456789", None]


def test_last_failures_and_the_timeline_are_bounded() -> None:
    """/status lists the last `LAST_FAILURES` failed attempts and `TIMELINE_S` seconds."""
    from unbroken.observe.hooks import AttemptInfo, TurnRecord
    from unbroken.observe.status import LAST_FAILURES, TIMELINE_S, StatusTracker

    tracker = StatusTracker()
    t0 = 1_800_000_000.0
    for i in range(TIMELINE_S + 50):
        turn = TurnRecord(route="r", path="v1/x", protocol="chat", stream=True)
        for n, reason in ((1, "503"), (2, "ok")):
            at = t0 + i + 0.1 * n
            attempt = AttemptInfo(number=n, upstream="u", started=at, ended=at, reason=reason)
            turn.attempt_log.append(attempt)
            tracker.attempt_ended(turn, attempt)
        turn.outcome, turn.ended = "recovered", t0 + i + 0.5
        tracker.turn_ended(turn)
    now = t0 + TIMELINE_S + 50
    failures = tracker.last_failures()
    assert len(failures) == LAST_FAILURES
    assert [f["ended"] for f in failures] == sorted(f["ended"] for f in failures)
    assert {(f["n"], f["reason"]) for f in failures} == {(1, "503")}
    seconds = tracker.timeline(now)["seconds"]
    assert len(seconds) == TIMELINE_S - 1  # the seconds after now - TIMELINE_S
    assert seconds[-1] == [int(now) - 1, 1, 1, 1, 0]
    assert all(b[1:] == [1, 1, 1, 0] for b in seconds)
