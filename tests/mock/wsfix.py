"""Clients and readers for the tests of the mock provider's Responses WebSocket mode.

The happy paths go through the official openai SDK (`oai`); faults are observed with
aiohttp's ``ws_connect`` so every message and close code is visible (`read_reply`,
`read_to_close`).  The aiohttp session fixture is in `mock/conftest.py`.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai

from unbroken.mock import MockProvider

TEXT = "Hello from the mock provider."
RECV_TIMEOUT = 10.0
#: Events of the default text reply: created, in_progress, output_item.added,
#: content_part.added, 8 deltas, output_text.done, content_part.done,
#: output_item.done, completed.
TEXT_EVENTS = 16
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})


def oai(mock: MockProvider) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mock.url + "/v1", api_key="x", max_retries=0)


def create(**params: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": "m-test", "input": "hi", **params}


def ws_url(mock: MockProvider, path: str = "/v1/responses") -> str:
    return mock.url + path


async def send(ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]) -> None:
    await ws.send_str(json.dumps(message))


async def recv_text(ws: aiohttp.ClientWebSocketResponse) -> str:
    msg = await ws.receive(timeout=RECV_TIMEOUT)
    assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data)
    assert isinstance(msg.data, str)
    return msg.data


async def read_reply(ws: aiohttp.ClientWebSocketResponse) -> list[str]:
    """TEXT messages up to and including a terminal event (completed/failed/error)."""
    out: list[str] = []
    while True:
        data = await recv_text(ws)
        out.append(data)
        try:
            kind = json.loads(data).get("type")
        except ValueError:
            continue
        if kind in TERMINAL:
            return out


async def read_to_close(ws: aiohttp.ClientWebSocketResponse) -> tuple[list[str], int | None]:
    """TEXT messages until the socket closes; returns them and the close code."""
    out: list[str] = []
    while True:
        msg = await ws.receive(timeout=RECV_TIMEOUT)
        if msg.type == aiohttp.WSMsgType.TEXT:
            out.append(msg.data)
            continue
        assert msg.type in (
            aiohttp.WSMsgType.CLOSE,
            aiohttp.WSMsgType.CLOSED,
            aiohttp.WSMsgType.CLOSING,
            aiohttp.WSMsgType.ERROR,
        ), msg
        return out, ws.close_code


def types(messages: list[str]) -> list[str]:
    return [json.loads(m)["type"] for m in messages]


def sse_data(frame: bytes) -> bytes:
    return frame.split(b"\ndata: ", 1)[1].removesuffix(b"\n\n")
