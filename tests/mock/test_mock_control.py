"""Recording, queues, per-request actions and the HTTP control API."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import aiohttp
import pytest

from unbroken.mock import ActionError, MockProvider, frames_for

CHAT = "/v1/chat/completions"
REQ: dict[str, Any] = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}


async def chat(
    session: aiohttp.ClientSession, mock: MockProvider, path: str = CHAT, **kwargs: Any
) -> tuple[int, bytes]:
    kwargs.setdefault("json", REQ)
    async with session.post(mock.url + path, **kwargs) as resp:
        return resp.status, await resp.read()


async def test_recording(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    await chat(session, mock, params={"a": "1"}, headers={"X-Trace": "t1"})
    rec = (await mock.wait_for_requests(1))[0]
    assert rec.method == "POST"
    assert rec.path == CHAT
    assert rec.query["a"] == "1"
    assert rec.headers["x-trace"] == "t1"  # case-insensitive copy
    assert rec.json() == REQ
    assert rec.key is None
    assert rec.protocol == "chat"
    assert rec.action == {}
    # control requests are not recorded
    async with session.get(mock.url + "/_mock/health") as resp:
        assert resp.status == 200
    assert len(mock.requests) == 1


async def test_fifo_queue_then_default(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"status": 503}, {"status": 429, "count": 2}])
    assert mock.pending() == 3
    statuses = [(await chat(session, mock))[0] for _ in range(4)]
    assert statuses == [503, 429, 429, 200]
    assert mock.pending() == 0
    assert [r.action for r in mock.requests] == [
        {"status": 503},
        {"status": 429, "count": 2},
        {"status": 429, "count": 2},
        {},
    ]


async def test_script_is_atomic(mock: MockProvider) -> None:
    with pytest.raises(ActionError, match=r"actions\[1\]\.fault"):
        mock.script([{"status": 500}, {"fault": "nope"}])
    assert mock.pending() == 0


async def test_named_queues(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"status": 500}], key="a")
    mock.script([{"status": 502}], key="b")
    mock.script([{"status": 503}])
    assert (mock.pending("a"), mock.pending("b"), mock.pending()) == (1, 1, 1)
    assert (await chat(session, mock, headers={"x-mock-key": "b"}))[0] == 502
    assert (await chat(session, mock, headers={"x-mock-key": "b"}))[0] == 200  # empty -> default
    assert (await chat(session, mock, headers={"x-mock-key": "a"}))[0] == 500
    assert (await chat(session, mock))[0] == 503
    assert [r.key for r in mock.requests] == ["b", "b", "a", None]


async def test_x_mock_action_header(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"status": 500}])
    status, body = await chat(session, mock, headers={"x-mock-action": '{"deltas": 3}'})
    assert status == 200
    assert body == b"".join(frames_for("chat", {"deltas": 3}, REQ))
    assert mock.pending() == 1  # the queue was not consumed
    status, body = await chat(session, mock, headers={"x-mock-action": '{"fault": "bad"}'})
    assert status == 400
    assert b"fault" in body
    status, body = await chat(session, mock, headers={"x-mock-action": "{nope"})
    assert status == 400
    assert b"x-mock-action" in body
    assert mock.pending() == 1


async def test_default_action(session: aiohttp.ClientSession) -> None:
    async with MockProvider(default={"status": 529}) as mock:
        assert (await chat(session, mock))[0] == 529
        mock.set_default({"reply": "tool"})
        status, body = await chat(session, mock)
        assert status == 200 and b"tool_calls" in body
        mock.reset()  # restores the constructor default
        assert (await chat(session, mock))[0] == 529
        assert len(mock.requests) == 1


async def test_reset(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"status": 500}] * 3)
    mock.script([{"status": 500}], key="k")
    await chat(session, mock)
    mock.reset()
    assert mock.requests == []
    assert mock.pending() == 0 and mock.pending("k") == 0
    assert (await chat(session, mock))[0] == 200


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        ("/openai/v1/chat/completions", "chat"),
        ("/api/v1/chat/completions", "chat"),
        ("/codex/v1/responses", "responses"),
        ("/anthropic/v1/messages", "anthropic"),
        ("/v1/messages/", "anthropic"),
    ],
)
async def test_path_prefixes(
    mock: MockProvider, session: aiohttp.ClientSession, path: str, protocol: str
) -> None:
    status, _ = await chat(session, mock, path)
    assert status == 200
    assert mock.requests[-1].protocol == protocol
    assert mock.requests[-1].path == path


async def test_unknown_route_and_method(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    assert (await chat(session, mock, "/v1/embeddings"))[0] == 404
    assert (await chat(session, mock, "/_mock/nothing"))[0] == 404
    async with session.get(mock.url + CHAT) as resp:
        assert resp.status == 405
    assert mock.requests == []


async def test_invalid_json_body(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    mock.script([{"status": 500}])
    status, body = await chat(session, mock, "/v1/messages", json=None, data=b"\xff\xfe")
    assert status == 400
    assert json.loads(body)["type"] == "error"
    assert mock.pending() == 1  # no action consumed
    assert mock.requests[0].action is None
    assert mock.requests[0].body == b"\xff\xfe"


async def test_wait_for_requests(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    waiter = asyncio.create_task(mock.wait_for_requests(3, timeout=5))
    for _ in range(3):
        await chat(session, mock)
    requests = await waiter
    assert len(requests) == 3
    with pytest.raises(TimeoutError, match="3 of 4"):
        await mock.wait_for_requests(4, timeout=0.05)


async def test_wait_sees_stalled_request(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "stall", "after_frame": 0, "seconds": 30}])
    task = asyncio.create_task(chat(session, mock))
    (rec,) = await mock.wait_for_requests(1)
    assert rec.json() == REQ
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_determinism_over_http(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    for protocol, path, stream in [
        ("chat", CHAT, True),
        ("responses", "/v1/responses", True),
        ("anthropic", "/v1/messages", False),
    ]:
        req = {**REQ, "stream": stream}
        bodies = [(await chat(session, mock, path, json=req))[1] for _ in range(2)]
        assert bodies[0] == bodies[1]
        assert bodies[0] == b"".join(frames_for(protocol, None, req))


async def test_response_headers(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    async with session.post(mock.url + CHAT, json=REQ) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert resp.headers["x-request-id"].startswith("req_")
        await resp.read()
    async with session.post(mock.url + "/v1/messages", json={**REQ, "stream": False}) as resp:
        assert resp.headers["Content-Type"] == "application/json"
        assert resp.headers["request-id"].startswith("req_")
        await resp.read()


# -- HTTP control API -----------------------------------------------------------


async def test_http_control_api(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    base = mock.url + "/_mock"
    async with session.get(base + "/health") as resp:
        health = await resp.json()
    assert health["ok"] is True

    async with session.post(base + "/script", json={"actions": [{"status": 502}]}) as resp:
        assert resp.status == 200 and (await resp.json())["pending"] == 1
    async with session.post(
        base + "/script", json={"actions": [{"status": 503, "count": 2}], "key": "q"}
    ) as resp:
        assert (await resp.json())["pending"] == 2
    assert mock.pending() == 1 and mock.pending("q") == 2
    async with session.post(base + "/script", json={"actions": [{"fault": "x"}]}) as resp:
        assert resp.status == 400
        assert "actions[0].fault" in (await resp.json())["error"]
    async with session.post(base + "/default", json={"status": 418}) as resp:
        assert resp.status == 200
    async with session.post(base + "/default", json={"bogus": True}) as resp:
        assert resp.status == 400

    assert (await chat(session, mock))[0] == 502
    assert (await chat(session, mock))[0] == 418
    assert (await chat(session, mock, json=None, data=b"\x80", headers={"x-mock-key": "q"}))[
        0
    ] == 400

    async with session.get(base + "/requests") as resp:
        records = await resp.json()
    assert [r["path"] for r in records] == [CHAT] * 3
    assert json.loads(records[0]["body"]) == REQ
    assert records[0]["method"] == "POST"
    assert records[0]["action"] == {"status": 502}
    assert records[2]["key"] == "q"
    assert records[2]["body"] is None
    assert base64.b64decode(records[2]["body_b64"]) == b"\x80"
    assert "content-type" in {k.lower() for k in records[0]["headers"]}

    async with session.post(base + "/reset") as resp:
        assert resp.status == 200
    assert mock.requests == [] and mock.pending("q") == 0
    async with session.get(base + "/requests") as resp:
        assert await resp.json() == []


async def test_record_false(session: aiohttp.ClientSession) -> None:
    async with MockProvider(record=False) as mock:
        mock.script([{"status": 503}])
        assert (await chat(session, mock))[0] == 503
        assert mock.requests == []
        with pytest.raises(RuntimeError):
            await mock.wait_for_requests(1)
