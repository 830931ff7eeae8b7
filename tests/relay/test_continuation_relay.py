"""after_commit = "continue" over real sockets: Responses background resume with the mock.

Each behaviour test fails on the code before issue 23 (the cut ended the turn with
the native error, and the request was never made a background one).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from relay.test_health_relay import until
from relayfix import Recorder, make_config, start_relay
from unbroken.core.wire.sse import SSESplitter
from unbroken.mock import MockProvider
from unbroken.relay.server import RelayServer

PATH = "v1/responses"
BODY: dict[str, Any] = {"model": "m", "input": "hi", "stream": True, "store": False}
TEXT = "The quick brown fox jumps over the lazy dog, twice over."
STREAM = {"first_frame_timeout_s": 2, "idle_timeout_s": 2, "keepalive_s": 30}
#: frames before the first text delta (background mode): created, queued, in_progress,
#: item added, part added
FIRST_DELTA = 6

Relay = tuple[RelayServer, Recorder]


@pytest.fixture
async def relay(mock: MockProvider) -> AsyncIterator[Relay]:
    cfg = make_config(
        [{"url": mock.url}],
        stream={**STREAM, "after_commit": "continue", "resume_queued_s": 0.5},
    )
    server, rec = await start_relay(cfg)
    yield server, rec
    await server.stop()


async def _post(url: str, body: dict[str, Any] | None = None) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body or BODY) as r:
        assert r.status == 200, await r.read()
        return await r.read()


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.data or "") for e in SSESplitter().feed(raw) if e.data]


async def _uncut(mock: MockProvider) -> bytes:
    """What the mock streams for the background request, uncut."""
    mock.script([{"text": TEXT}])
    raw = await _post(f"{mock.url}/{PATH}", {**BODY, "background": True, "store": True})
    mock.reset()
    return raw


def _assert_one_clean_stream(got: bytes, uncut: bytes) -> None:
    assert got == uncut  # byte for byte: nothing doubled, nothing missing
    events = _events(got)
    seqs = [e["sequence_number"] for e in events]
    assert seqs == sorted(set(seqs))
    assert [e["type"] for e in events].count("response.completed") == 1
    assert not any(e["type"] in ("error", "response.failed") for e in events)


async def test_cut_after_output_is_resumed_exactly(mock: MockProvider, relay: Relay) -> None:
    server, rec = relay
    uncut = await _uncut(mock)
    mock.script([{"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA + 2}])
    got = await _post(f"{server.url}/mock/{PATH}")
    _assert_one_clean_stream(got, uncut)
    first = mock.requests[0].json()
    assert first["background"] is True and first["store"] is True  # overrides store: false
    resume = mock.requests[1]
    assert resume.method == "GET"
    rid = _events(uncut)[0]["response"]["id"]
    assert resume.path == f"/v1/responses/{rid}"
    assert resume.query["stream"] == "true"
    assert resume.query["starting_after"] == str(FIRST_DELTA + 1)  # frame k is number k-1
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed"
    assert turn.splices == 1 and turn.saved_tokens >= 2
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/metrics") as r:
            metrics = await r.text()
        async with http.get(f"{server.url}/status") as r:
            status = await r.json()
    assert 'unbroken_continuations_total{protocol="responses",result="spliced"} 1.0' in metrics
    assert 'unbroken_turns_total{outcome="resumed",route="mock"} 1.0' in metrics
    assert status["totals"]["continuations"] == {"spliced": 1}
    assert status["totals"]["outcomes"]["resumed"] == 1


async def test_many_cuts_in_one_turn(mock: MockProvider, relay: Relay) -> None:
    server, rec = relay
    uncut = await _uncut(mock)
    cuts = [{"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA + 1}]
    cuts += [{"fault": "reset", "after_frame": 1} for _ in range(6)]
    cuts += [{"fault": "end", "after_frame": 1}, {"fault": "stall", "after_frame": 1}]
    mock.script(cuts)
    got = await _post(f"{server.url}/mock/{PATH}")
    _assert_one_clean_stream(got, uncut)
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "resumed" and turn.splices == 9


@pytest.mark.parametrize("answer", ["not_found", "bad_request", "other_id", "backwards"])
async def test_a_resume_that_does_not_join_ends_with_the_native_error(
    mock: MockProvider, relay: Relay, answer: str
) -> None:
    server, rec = relay
    uncut = await _uncut(mock)
    k = FIRST_DELTA + 2
    mock.script([{"text": TEXT, "fault": "reset", "after_frame": k}, {"resume": answer}])
    got = await _post(f"{server.url}/mock/{PATH}")
    frames = SSESplitter().feed(uncut)
    prefix = b"".join(e.raw for e in frames[:k])
    assert got.startswith(prefix)
    tail = _events(got[len(prefix) :])
    assert [e["type"] for e in tail] == ["error", "response.failed"]  # never spliced garbage
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome == "ended_with_error"
    assert turn.continuation == "refused_join"
    # the response nobody will read on is cancelled
    await until(lambda: bool(mock.background.cancels), cap=10)
    assert mock.background.cancels == [_events(uncut)[0]["response"]["id"]]


async def test_an_upstream_refusing_background_is_remembered(
    mock: MockProvider, relay: Relay
) -> None:
    server, rec = relay
    mock.script([{"text": TEXT, "refuse_background": True}, {"text": TEXT}])
    got = await _post(f"{server.url}/mock/{PATH}")
    assert b"response.completed" in got
    first, second = mock.requests[0].json(), mock.requests[1].json()
    assert first["background"] is True
    assert "background" not in second and second["store"] is False  # the client's request
    # Later turns to that upstream go as the client sent them; a cut ends as today.
    mock.script([{"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA + 1}])
    got = await _post(f"{server.url}/mock/{PATH}")
    assert mock.requests[2].body == json.dumps(BODY).encode()
    assert b"event: error" in got
    turns = await rec.wait_turns(2)
    assert turns[1].outcome == "ended_with_error"
    assert turns[1].continuation == "refused_not_resumable"


async def test_client_gone_cancels_the_background_response(
    mock: MockProvider, relay: Relay
) -> None:
    server, _ = relay
    mock.script([{"text": TEXT, "deltas": 40, "chunk_delay_ms": 50}])
    async with aiohttp.ClientSession() as s, s.post(f"{server.url}/mock/{PATH}", json=BODY) as r:
        await r.content.readuntil(b"output_text.delta")
    # the client closed its connection mid-stream
    await until(lambda: bool(mock.background.cancels), cap=10)
    rid = mock.requests[0].json() and next(iter(mock.background.items))
    assert mock.background.cancels == [rid]
    assert mock.background.items[rid].cancelled


async def test_stuck_in_queued_before_commit_is_cancelled_and_replayed(
    mock: MockProvider, relay: Relay
) -> None:
    server, rec = relay
    # Cut after response.created (held: nothing released), resume stays queued.
    mock.script(
        [
            {"text": TEXT, "fault": "reset", "after_frame": 1},
            {"resume": "queued", "seconds": 30},
            {"text": TEXT},
        ]
    )
    got = await _post(f"{server.url}/mock/{PATH}")
    events = _events(got)
    assert events[-1]["type"] == "response.completed"
    assert "".join(e.get("delta", "") for e in events) == TEXT
    methods = [(r.method, r.path.endswith("/cancel")) for r in mock.requests]
    assert methods[:2] == [("POST", False), ("GET", False)]
    assert methods.count(("POST", False)) == 2  # the replay
    await until(lambda: bool(mock.background.cancels), cap=10)
    assert mock.background.cancels[0] == mock.requests[1].path.rsplit("/", 1)[1]
    turn = (await rec.wait_turns(1))[0]
    assert turn.outcome in ("recovered", "resumed")


async def test_default_setting_changes_nothing(mock: MockProvider) -> None:
    """Regression: without the setting, the same request goes upstream and a cut after
    output ends with the native error, as before."""
    server, rec = await start_relay(make_config([{"url": mock.url}], stream=STREAM))
    try:
        body = json.dumps(BODY).encode()
        mock.script([{"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA + 1}])
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{server.url}/mock/{PATH}",
                data=body,
                headers={"content-type": "application/json"},
            ) as r,
        ):
            got = await r.read()
        assert mock.requests[0].body == body
        assert len(mock.requests) == 1
        assert b"event: error" in got and b"response.completed" not in got
        turn = (await rec.wait_turns(1))[0]
        assert turn.outcome == "ended_with_error" and turn.splices == 0
    finally:
        await server.stop()


async def _ws_turn(ws: aiohttp.ClientWebSocketResponse, create: dict[str, Any]) -> list[bytes]:
    await ws.send_str(json.dumps(create))
    out: list[bytes] = []
    while True:
        msg = await ws.receive(timeout=10)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        out.append(msg.data.encode())
        if json.loads(msg.data)["type"] in ("response.completed", "response.failed", "error"):
            return out


async def test_a_websocket_client_keeps_its_socket_and_the_turn_resumes_over_http(
    mock: MockProvider, relay: Relay
) -> None:
    """Background mode is not supported over WebSocket: with the setting on, the relay
    serves a socket's turn over HTTP in background mode and resumes it over HTTP; the
    client's socket sees one stream, then takes its next turn on the same socket."""
    server, rec = relay
    uncut = await _uncut(mock)
    expected = [json.dumps(e, separators=(",", ":")) for e in _events(uncut)]
    create = {"type": "response.create", "model": "m", "input": "hi", "store": False}
    mock.script([{"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA + 2}])
    url = server.url.replace("http://", "ws://") + f"/mock/{PATH}"
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        got = await _ws_turn(ws, create)
        assert [json.loads(m) for m in got] == [json.loads(e) for e in expected]
        again = await _ws_turn(ws, create)  # the same socket serves the next turn
        assert json.loads(again[-1])["type"] == "response.completed"
    posts = [r for r in mock.requests if r.method == "POST"]
    assert posts[0].json()["background"] is True and posts[0].json()["store"] is True
    assert [r.method for r in mock.requests][:2] == ["POST", "GET"]
    turns = await rec.wait_turns(2)
    assert turns[0].outcome == "resumed" and turns[0].splices == 1


async def test_a_route_override_keeps_the_default_on_that_route(mock: MockProvider) -> None:
    """``[routes.NAME] after_commit = "error"`` under a global "continue": that route's
    turns go as the client sent them and end as before; the same bytes as a relay with
    no setting at all."""
    body = json.dumps(BODY).encode()
    action = {"text": TEXT, "fault": "reset", "after_frame": FIRST_DELTA}

    async def cut_turn(cfg: Any) -> bytes:
        server, rec = await start_relay(cfg)
        try:
            mock.reset()
            mock.script([action])
            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    f"{server.url}/mock/{PATH}",
                    data=body,
                    headers={"content-type": "application/json"},
                ) as r,
            ):
                got = await r.read()
            assert [q.body for q in mock.requests] == [body]
            await rec.wait_turns(1)
            return got
        finally:
            await server.stop()

    plain = await cut_turn(make_config([{"url": mock.url}], stream=STREAM))
    cfg = make_config(
        [{"url": mock.url}], stream={**STREAM, "after_commit": "continue"}, route="other"
    )
    routes = dict(cfg.routes)
    routes["mock"] = dataclasses.replace(routes["other"], name="mock", after_commit="error")
    overridden = await cut_turn(dataclasses.replace(cfg, routes=routes))
    assert b"event: error" in plain
    assert overridden == plain
