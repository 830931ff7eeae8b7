"""Issue 33 item 6: continue mode's ``store: true`` is said where it is decided.

``after_commit = "continue"`` sends a Responses request in background mode, which
turns a client's ``store: false`` into ``store: true`` at the provider.  Before,
nothing said so but a paragraph of docs/failures.md: now a warning at start-up
names the routes that may do it, the log says it once per route the first time it
happens, and docs/configuration.md says it beside the key.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relayfix import make_config, start_relay
from unbroken.config import Route, Upstream
from unbroken.mock import MockProvider

BODY: dict[str, Any] = {"model": "m", "input": "hi", "stream": True, "store": False}
DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _store_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "store: false" in r.getMessage()
    ]


async def test_continue_mode_warns_at_start_and_once_per_route(
    mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    cfg = make_config([{"url": mock.url}], stream={"after_commit": "continue"})
    claude = Route("claude", (Upstream(url="https://api.anthropic.com"),))
    cfg = dataclasses.replace(cfg, routes={**cfg.routes, "claude": claude})
    server, _ = await start_relay(cfg)
    try:
        start = _store_lines(caplog)
        assert len(start) == 1, start
        assert "mock" in start[0] and "store: true" in start[0]
        assert "claude" not in start[0]  # an Anthropic-only route sends no Responses
        caplog.clear()
        mock.script([{"text": "one"}, {"text": "two"}, {"text": "three"}])
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(f"{server.url}/mock/v1/responses", json=BODY) as r:
                    assert r.status == 200
                    await r.read()
    finally:
        await server.stop()
    assert [req.json()["store"] for req in mock.requests] == [True, True, True]
    turns = _store_lines(caplog)
    assert len(turns) == 1, turns  # once per route, not once per turn
    assert turns[0].startswith("route mock:") and "store: true" in turns[0]


async def test_no_warning_without_continue_mode(
    mock: MockProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="unbroken")
    server, _ = await start_relay(make_config([{"url": mock.url}]))
    try:
        mock.script([{"text": "one"}])
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"{server.url}/mock/v1/responses", json=BODY) as r,
        ):
            await r.read()
    finally:
        await server.stop()
    assert mock.requests[0].json()["store"] is False  # sent as the client sent it
    assert _store_lines(caplog) == []


def test_the_routes_that_may_store() -> None:
    from unbroken.core.turn.background import store_override_routes

    assert store_override_routes(
        {
            "openai": ["https://api.openai.com"],
            "claude": ["https://api.anthropic.com"],
            "gemini": ["https://generativelanguage.googleapis.com"],
            "mixed": ["https://api.anthropic.com", "https://openrouter.ai/api"],
            "fake": ["https://notanthropic.com"],
            "none": [],
        }
    ) == ["fake", "mixed", "none", "openai"]


def test_the_docs_say_it_beside_the_key() -> None:
    """docs/configuration.md promised "see below" for ``after_commit`` and had nothing
    below; the key's comment and the text below it now say what it stores."""
    text = DOCS.read_text(encoding="utf-8")
    lines = text.splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("after_commit = "))
    beside = lines[at] + lines[at + 1]  # the key's comment goes on to the next line
    assert "see below" in beside and "store: false" in beside
    below = text[text.index(lines[at]) :]
    m = re.search(r"\*\*`after_commit = \"continue\"`\*\*(.*?)\n\n", below, re.S)
    assert m is not None, "no paragraph on continue mode below the block"
    assert "store: false" in m.group(1) and "store: true" in m.group(1)
