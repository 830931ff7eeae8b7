"""The mock's WebSocket upgrades: refused, faulted, queued by key, scripted, and validated.

What the control API and the action header do to an upgrade, pings, the validation
of WebSocket actions and upgrade actions, and upgrades in a script file.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from mock.wsfix import RECV_TIMEOUT, create, read_reply, read_to_close, send, types, ws_url
from unbroken.mock import ActionError, MockProvider, load_script, parse_action
from unbroken.mock.actions import parse_upgrade_action

# -- upgrades -----------------------------------------------------------------


async def test_refused_upgrade_and_counting(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script_upgrades([{"status": 426}, {"status": 503, "headers": {"Retry-After": "1"}}, {}])
    assert mock.pending_upgrades() == 3
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(ws_url(mock))
    assert info.value.status == 426
    async with session.get(
        ws_url(mock),
        headers={
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    ) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        body = await resp.json()
    assert body["error"]["type"] == "server_error"
    async with session.ws_connect(ws_url(mock)) as ws:
        await send(ws, create())
        await read_reply(ws)
    async with session.ws_connect(ws_url(mock)):  # the queue is empty: accept
        pass
    assert [(u.status, u.socket) for u in mock.upgrades] == [
        (426, None),
        (503, None),
        (101, 1),
        (101, 2),
    ]
    assert mock.sockets_accepted == 2
    assert mock.pending_upgrades() == 0
    assert [r.socket for r in mock.requests] == [1]  # upgrades are not requests


async def test_upgrade_close_before_headers(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    # aiohttp retries an idempotent GET once after a disconnect: two attempts
    mock.script_upgrades([{"fault": "close_before_headers", "count": 2}])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await session.ws_connect(ws_url(mock))
    async with session.ws_connect(ws_url(mock)):
        pass
    assert [(u.status, u.socket) for u in mock.upgrades] == [(None, None), (None, None), (101, 1)]


async def test_upgrade_queues_by_key_and_control_api(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    async with session.post(
        mock.url + "/_mock/script",
        json={"key": "k", "upgrades": [{"status": 401}], "actions": [{"status": 429}]},
    ) as resp:
        assert resp.status == 200
        assert await resp.json() == {"ok": True, "pending": 1, "pending_upgrades": 1}
    async with session.post(
        mock.url + "/_mock/script", json={"upgrades": [{"reply": "tool"}]}
    ) as resp:
        assert resp.status == 400
        assert "upgrades[0].reply" in (await resp.json())["error"]
    async with session.ws_connect(ws_url(mock)):  # no key: the default queue accepts
        pass
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(ws_url(mock), headers={"x-mock-key": "k"})
    assert info.value.status == 401
    async with session.ws_connect(ws_url(mock), headers={"x-mock-key": "k"}) as ws:
        await send(ws, create())
        (error,) = await read_reply(ws)  # the create pops from the named queue
    assert json.loads(error)["status"] == 429
    async with session.get(mock.url + "/_mock/upgrades") as resp:
        upgrades = await resp.json()
    assert [(u["status"], u["socket"], u["key"]) for u in upgrades] == [
        (101, 1, None),
        (401, None, "k"),
        (101, 2, "k"),
    ]
    async with session.get(mock.url + "/_mock/health") as resp:
        health = await resp.json()
    assert health["upgrades"] == 3 and health["sockets"] == 2


async def test_action_header_on_upgrade_applies_to_every_create(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    mock.script([{"text": "queued"}])
    header = json.dumps({"fault": "error_event", "error": "rate_limit", "after_frame": 1})
    async with session.ws_connect(ws_url(mock), headers={"x-mock-action": header}) as ws:
        for _ in range(2):
            await send(ws, create())
            messages = await read_reply(ws)
            assert types(messages) == ["response.created", "error"]
            assert json.loads(messages[-1])["status"] == 429
    assert mock.pending() == 1  # the queue was not touched
    assert [r.action for r in mock.requests] == [json.loads(header)] * 2


async def test_invalid_action_header_refuses_upgrade(
    mock: MockProvider, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await session.ws_connect(ws_url(mock), headers={"x-mock-action": '{"fault": "nope"}'})
    assert info.value.status == 400
    assert [(u.status, u.socket) for u in mock.upgrades] == [(400, None)]


async def test_pings_are_answered(mock: MockProvider, session: aiohttp.ClientSession) -> None:
    async with session.ws_connect(ws_url(mock), autoping=False) as ws:
        await ws.ping(b"are you there")
        msg = await ws.receive(timeout=RECV_TIMEOUT)
        assert msg.type == aiohttp.WSMsgType.PONG and msg.data == b"are you there"


# -- validation and scripts -----------------------------------------------------


def test_action_validation() -> None:
    assert parse_action({"fault": "close", "after_frame": 3, "code": 4000}).code == 4000
    assert parse_action({"fault": "connection_limit", "code": 1008}).code == 1008
    with pytest.raises(ActionError, match="code"):
        parse_action({"fault": "reset", "code": 1011})
    with pytest.raises(ActionError, match="code"):
        parse_action({"fault": "close", "code": 999})
    with pytest.raises(ActionError, match="code"):
        parse_action({"fault": "close", "code": 5000})
    with pytest.raises(ActionError, match="after_frame"):
        parse_action({"fault": "connection_limit", "after_frame": 1})
    assert parse_upgrade_action({"status": 426, "headers": {"X": "1"}}).status == 426
    with pytest.raises(ActionError, match="reply"):
        parse_upgrade_action({"reply": "tool"})
    with pytest.raises(ActionError, match="fault"):
        parse_upgrade_action({"fault": "reset"})


async def test_script_file_upgrades(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    path = tmp_path / "script.toml"
    path.write_text(
        '[[upgrades]]\nstatus = 426\n\n[[upgrades]]\n_comment = "accept"\n\n'
        '[upgrade_queues]\nk = [{fault = "close_before_headers"}]\n\n'
        '[[actions]]\nfault = "close"\ncode = 4002\n'
    )
    script = load_script(path)
    async with MockProvider() as mock:
        script.apply(mock)
        assert (mock.pending_upgrades(), mock.pending_upgrades("k"), mock.pending()) == (2, 1, 1)
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await session.ws_connect(ws_url(mock))
        async with session.ws_connect(ws_url(mock)) as ws:
            await send(ws, create())
            assert await read_to_close(ws) == ([], 4002)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"upgrades": [{"deltas": 3}]}))
    with pytest.raises(ActionError, match=r"upgrades\[0\]\.deltas"):
        load_script(bad)
