"""What the mock keeps per WebSocket and per server: previous_response_id, records, shutdown.

The socket-local ``previous_response_id`` rule (and the HTTP one), the request
records of WebSocket messages (with path prefixes and invalid messages), WebSocket
only on the Responses path, stopping with open and stalled sockets, and a reset that
clears upgrades but not the socket counter.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import pytest

from mock.wsfix import RECV_TIMEOUT, create, read_reply, recv_text, send, ws_url
from unbroken.mock import MockProvider

# -- previous_response_id -------------------------------------------------------


async def completed_id(ws: aiohttp.ClientWebSocketResponse, **params: Any) -> str:
    await send(ws, create(**params))
    messages = await read_reply(ws)
    last = json.loads(messages[-1])
    assert last["type"] == "response.completed", last
    response_id: str = last["response"]["id"]
    return response_id


async def test_socket_local_previous_response_id(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with session.ws_connect(ws_url(mock)) as ws1:
        local = await completed_id(ws1, store=False, input="one")
        unset = await completed_id(ws1, input="two")  # store missing: socket-local too
        stored = await completed_id(ws1, store=True, input="three")
        # the same socket knows all three
        for prev in (local, unset, stored):
            assert await completed_id(ws1, previous_response_id=prev, input="more")
        async with session.ws_connect(ws_url(mock)) as ws2:
            # a new socket knows only the stored one
            await send(ws2, create(previous_response_id=local))
            (message,) = await read_reply(ws2)
            assert json.loads(message) == {
                "type": "error",
                "status": 400,
                "error": {
                    "type": "invalid_request_error",
                    "code": "previous_response_not_found",
                    "message": f"Previous response with id '{local}' not found.",
                    "param": "previous_response_id",
                },
            }
            await send(ws2, create(previous_response_id=unset))
            assert json.loads((await read_reply(ws2))[0])["error"]["code"] == (
                "previous_response_not_found"
            )
            assert await completed_id(ws2, previous_response_id=stored)
    recs = mock.requests
    assert [(r.socket, r.previous_response_found) for r in recs] == [
        (1, None),
        (1, None),
        (1, None),
        (1, True),
        (1, True),
        (1, True),
        (2, False),
        (2, False),
        (2, True),
    ]
    assert recs[6].previous_response_id == local
    assert recs[6].to_dict()["previous_response_found"] is False
    assert recs[6].to_dict()["socket"] == 2


async def test_unknown_previous_response_id_on_new_socket(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"fault": "reset", "after_frame": 3}])  # consumed by the failing create
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create(previous_response_id="resp_never_seen"))
        (message,) = await read_reply(ws)
        payload = json.loads(message)
        assert payload["error"]["code"] == "previous_response_not_found"
        assert payload["error"]["param"] == "previous_response_id"
        assert "resp_never_seen" in payload["error"]["message"]
        # no reply was produced and the socket stays usable
        assert await completed_id(ws, input="fresh")
    assert mock.pending() == 0
    assert mock.requests[0].previous_response_found is False


async def test_http_previous_response_id_rule(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/responses"
    async with session.ws_connect(ws_url(mock)) as ws:
        local = await completed_id(ws, store=False)
        stored = await completed_id(ws, store=True, input="kept")
    async with session.post(
        url, json={"model": "m", "input": "x", "previous_response_id": local}
    ) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["code"] == "previous_response_not_found"
    assert body["error"]["param"] == "previous_response_id"
    assert body["error"]["type"] == "invalid_request_error"
    async with session.post(
        url, json={"model": "m", "input": "x", "previous_response_id": stored}
    ) as resp:
        assert resp.status == 200
        http_default = (await resp.json())["id"]  # store missing over HTTP: stored (API default)
    async with session.post(url, json={"model": "m", "input": "y", "store": False}) as resp:
        http_unstored = (await resp.json())["id"]
    async with session.post(
        url, json={"model": "m", "input": "z", "stream": True, "previous_response_id": http_default}
    ) as resp:
        assert resp.status == 200
        await resp.read()
    async with session.post(
        url, json={"model": "m", "previous_response_id": http_unstored}
    ) as resp:
        assert resp.status == 400
    async with session.ws_connect(ws_url(mock)) as ws:  # HTTP-stored ids are global
        assert await completed_id(ws, previous_response_id=http_default)
    found = [(r.method, r.previous_response_found) for r in mock.requests]
    assert found == [
        ("WS", None),
        ("WS", None),
        ("POST", False),
        ("POST", True),
        ("POST", None),
        ("POST", True),
        ("POST", False),
        ("WS", True),
    ]
    mock.reset()  # forgets the global store
    async with session.post(url, json={"model": "m", "previous_response_id": stored}) as resp:
        assert resp.status == 400


# -- recording, invalid messages, prefixes, shutdown ----------------------------


async def test_recording_and_path_prefix(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"text": "a", "deltas": 1}, {"text": "b", "deltas": 1}], key="q")
    url = ws_url(mock, "/openai/proxy/v1/responses?tenant=t1")
    raw = json.dumps(create(input="recorded"), separators=(",", ":"))
    async with session.ws_connect(url, headers={"x-mock-key": "q", "X-Trace": "t"}) as ws:
        await ws.send_str(raw)
        await read_reply(ws)
        await ws.send_str("not json")
        (error,) = await read_reply(ws)
        await ws.send_str(json.dumps({"type": "response.steer", "input": "x"}))
        (error2,) = await read_reply(ws)
        await send(ws, create())
        last = await read_reply(ws)
    assert json.loads(error)["error"]["message"].startswith("mock: message is not valid JSON")
    assert "response.steer" in json.loads(error2)["error"]["message"]
    assert json.loads(last[-1])["response"]["output"][0]["content"][0]["text"] == "b"
    recs = mock.requests
    assert [r.method for r in recs] == ["WS"] * 4
    assert {r.path for r in recs} == {"/openai/proxy/v1/responses"}
    assert recs[0].query["tenant"] == "t1"
    assert recs[0].headers["X-Trace"] == "t"
    assert recs[0].body == raw.encode()
    assert recs[1].body == b"not json"
    assert [r.action for r in recs] == [
        {"text": "a", "deltas": 1},
        None,
        None,
        {"text": "b", "deltas": 1},
    ]
    assert {r.key for r in recs} == {"q"}
    assert mock.pending("q") == 0
    assert recs[0].to_dict()["body"] == raw
    async with session.get(mock.url + "/_mock/requests") as resp:
        listed = await resp.json()
    assert [r["socket"] for r in listed] == [1, 1, 1, 1]
    assert (await mock.wait_for_requests(4))[3] is recs[3]


async def test_http_requests_have_no_socket(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with session.post(mock.url + "/v1/chat/completions", json={"messages": []}) as resp:
        await resp.read()
    (rec,) = mock.requests
    assert rec.socket is None and rec.previous_response_id is None
    assert rec.to_dict()["socket"] is None


async def test_websocket_only_on_responses(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(mock.url + "/v1/chat/completions")
    assert info.value.status == 405
    assert mock.upgrades == []


async def test_stop_with_open_and_stalled_sockets() -> None:
    async with MockProvider() as mock, aiohttp.ClientSession() as session:
        mock.script([{"fault": "stall", "after_frame": 1}])
        idle = await session.ws_connect(ws_url(mock))
        stalled = await session.ws_connect(ws_url(mock))
        await send(stalled, create())
        await recv_text(stalled)
        start = time.monotonic()
        await mock.stop()
        assert time.monotonic() - start < 5
        for ws in (idle, stalled):
            msg = await ws.receive(timeout=RECV_TIMEOUT)
            assert msg.type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSED,
                aiohttp.WSMsgType.ERROR,
            )
            await ws.close()


async def test_reset_clears_upgrades_but_not_the_socket_counter(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script_upgrades([{}, {"status": 500}])
    async with session.ws_connect(ws_url(mock)):
        pass
    mock.reset()
    assert mock.upgrades == [] and mock.pending_upgrades() == 0
    async with session.ws_connect(ws_url(mock)):
        pass
    assert [(u.status, u.socket) for u in mock.upgrades] == [(101, 2)]
