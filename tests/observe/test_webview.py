"""The web view (``GET /ui``): guarded like /status, a strict CSP, and a storm shown live
in a real headless Chromium (`browserfix`).

The storm: the mock answers 503 to everything on one route, so the turns there fail,
open the breaker and park; another route's upstream reports rate limits, so its
key's budget shows as bars.  The page must show the parked turns and their attempt
chains, the failure count growing between two reads, the journal's last failures
with their reasons, the open breaker, the bars and the timeline; then the upstream
recovers and the page shows the turns gone and successes on the timeline.

``UNBROKEN_UI_SCREENSHOT=docs/img/ui.png`` writes the mid-storm screenshot there
(the one docs/observability.md shows); otherwise it goes to the test's temporary
directory and is checked to be a PNG of the window's size.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio

from browserfix import VIEWPORT, Browser
from unbroken.config import parse_config
from unbroken.mock import MockProvider
from unbroken.mock.limits import MockLimits
from unbroken.observe import webview
from unbroken.relay.server import RelayServer

TOKEN = "ui-test-token-0123456789abcdef"
KEY = "sk-mock-web-view-key-000111222"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
SCREENSHOT_ENV = "UNBROKEN_UI_SCREENSHOT"


def config(storm: str, steady: str) -> Any:
    data: dict[str, Any] = {
        "retry": {"delay_ms": 5, "max_delay_ms": 50},
        "health": {"failures_to_open": 3, "open_s": 0.5, "max_open_s": 1.0},
        "routes": {
            "storm": {"upstreams": [{"url": storm}]},
            "steady": {"upstreams": [{"url": steady}]},
        },
        "journal": {"enabled": False},
    }
    return dataclasses.replace(parse_config(data, env={}), port=0, grace_s=2.0, token=TOKEN)


@pytest_asyncio.fixture
async def steady() -> AsyncIterator[MockProvider]:
    async with MockProvider(host="127.0.0.1", port=0) as provider:
        provider.limits = MockLimits(rpm=120, tpm=40_000, start=0.5)  # half spent
        yield provider


async def chat(http: aiohttp.ClientSession, url: str, route: str) -> tuple[int, bytes]:
    headers = {"x-unbroken-token": TOKEN, "authorization": f"Bearer {KEY}"}
    async with http.post(f"{url}/{route}/v1/chat/completions", json=CHAT, headers=headers) as r:
        return r.status, await r.read()


async def test_ui_answers_only_with_the_token_with_a_strict_csp_and_no_secret(
    mock: MockProvider, steady: MockProvider
) -> None:
    async with (
        RelayServer(config(mock.url, steady.url)) as server,
        aiohttp.ClientSession() as http,
    ):
        assert (await chat(http, server.url, "steady"))[0] == 200
        refused: list[tuple[str, dict[str, str], int]] = [
            ("/ui", {}, 401),
            ("/t/wrong-token-0123456789/ui", {}, 401),
            ("/ui", {"x-unbroken-token": "wrong-token-0123456789"}, 401),
            # another site's page cannot read it, token or not (as /status)
            (f"/t/{TOKEN}/ui", {"origin": "https://evil.example"}, 403),
        ]
        for path, sent, status in refused:
            async with http.get(server.url + path, headers=sent) as r:
                assert r.status == status, path
                assert "error" in await r.json()  # not the page
        pages = []
        allowed: list[tuple[str, dict[str, str]]] = [
            ("/ui", {"x-unbroken-token": TOKEN}),
            (f"/t/{TOKEN}/ui", {}),
        ]
        for path, sent in allowed:
            async with http.get(server.url + path, headers=sent) as r:
                assert r.status == 200, path
                pages.append((await r.read(), dict(r.headers)))
            async with http.head(server.url + path, headers=sent) as r:
                assert r.status == 200
        (body, headers), (again, _) = pages
        assert body == again == webview.page()[0]
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert headers["Cache-Control"] == "no-store"
        assert headers["Referrer-Policy"] == "no-referrer"
        csp = dict(d.strip().split(" ", 1) for d in headers["Content-Security-Policy"].split(";"))
        assert csp["default-src"] == "'none'"
        assert csp["connect-src"] == "'self'"
        assert csp["frame-ancestors"] == "'none'"
        assert re.fullmatch(r"'sha256-[A-Za-z0-9+/=]{44}'", csp["script-src"])
        assert re.fullmatch(r"'sha256-[A-Za-z0-9+/=]{44}'", csp["style-src"])
        assert not any("http" in v or "*" in v or "unsafe" in v for v in csp.values())
        # nothing outside the package: no URL to another origin, no external script
        assert not re.search(rb"(src|href)\s*=\s*[\"']?(https?:)?//", body)
        assert b"<script src" not in body and b'<link rel="stylesheet"' not in body
        assert len(body) < 32 * 1024  # one modest page
        # neither the page nor the data it reads carries a secret
        async with http.get(f"{server.url}/t/{TOKEN}/status") as r:
            data = await r.read()
        for secret in (TOKEN, KEY):
            assert secret.encode() not in body and secret.encode() not in data
        assert json.loads(data)["upstreams"]  # the data the page draws is there


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_the_web_view_shows_a_503_storm_live_then_the_recovery(
    chromium: str, mock: MockProvider, steady: MockProvider, tmp_path: Path
) -> None:
    mock.script([{"status": 503, "count": 100_000}])
    async with (
        RelayServer(config(mock.url, steady.url)) as server,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http,
        Browser(chromium, tmp_path / "profile") as browser,
    ):
        for _ in range(3):
            assert (await chat(http, server.url, "steady"))[0] == 200
        turns = [asyncio.ensure_future(chat(http, server.url, "storm")) for _ in range(6)]
        await browser.navigate(f"{server.url}/t/{TOKEN}/ui")
        parked = "document.querySelectorAll('#inflight tbody tr[data-state=\"parked\"]').length"
        await browser.wait_for(f"{parked} >= 4")
        assert await browser.evaluate("Number(document.getElementById('n-parked').textContent)")
        # each parked turn shows its attempt chain: its failed attempts, 503 each
        chips = await browser.evaluate(
            "[...document.querySelectorAll('#inflight tbody tr[data-state=\"parked\"] .chip')]"
            ".map(c => c.textContent)"
        )
        assert chips and all(re.fullmatch(r"#\d+ (503|running)", c) for c in chips), chips
        assert any(c.endswith(" 503") for c in chips)
        # live: the failure count grows between two reads (the probes keep failing)
        count = "Number(document.getElementById('n-failures').textContent)"
        polls = "Number(document.body.dataset.polls || 0)"
        first, first_poll = await browser.evaluate(count), await browser.evaluate(polls)
        assert first >= 3
        second = await browser.wait_for(f"{count} > {first} && {polls} > {first_poll} && {count}")
        await browser.wait_for(f"{count} > {second}")  # and again: the page keeps up
        # the journal's last failures, with their reasons
        reasons = await browser.evaluate(
            "[...document.querySelectorAll('#last-failures tbody tr')].map(r => r.dataset.reason)"
        )
        assert reasons and set(reasons) == {"503"}, reasons
        # upstream health: the storm's breaker open (or probing), its line of parked turns
        card = f"document.querySelector('.card[data-upstream=\"storm/{mock.url}\"]')"
        await browser.wait_for(f"{card} && {card}.dataset.breaker !== 'closed'")
        line = await browser.evaluate(f"{card}.querySelector('.pacer').textContent")
        assert re.search(r"parked [1-9]", line), line
        # rate-limit headroom per key as bars: the steady upstream's two budgets
        steady_card = f"document.querySelector('.card[data-upstream=\"steady/{steady.url}\"]')"
        bars = await browser.evaluate(
            f"[...{steady_card}.querySelectorAll('.bar.ratelimit')].map(b => "
            "[b.textContent, Number(b.dataset.share)])"
        )
        assert [text.split(":")[0] for text, _ in bars] == ["requests", "tokens"], bars
        assert all(0 < share < 1 for _, share in bars), bars  # some spent, some left
        # the recovery timeline: failed attempts drawn
        await browser.wait_for("document.querySelectorAll('#timeline rect.failed').length > 0")
        await browser.wait_for("document.querySelector('#timeline polyline.parked') !== null")
        shot = Path(os.environ.get(SCREENSHOT_ENV) or tmp_path / "ui.png")
        width, height = _png_size(await browser.screenshot(shot))
        assert width == VIEWPORT[0] and height > 600, (width, height)

        mock.reset()  # the upstream is back
        results = await asyncio.wait_for(asyncio.gather(*turns), 30)
        assert all(status == 200 and b"[DONE]" in body for status, body in results)
        await browser.wait_for(
            "document.getElementById('n-inflight').textContent === '0' && "
            "document.querySelector('#inflight tbody td.empty') !== null"
        )
        card_state = await browser.wait_for(f"{card}.dataset.breaker === 'closed' && 'closed'")
        assert card_state == "closed"
        await browser.wait_for("document.querySelectorAll('#timeline rect.ok').length > 0")
        recovered = await browser.evaluate(
            "[...document.querySelectorAll('#totals tr')].map(r => r.textContent)"
        )
        assert any(r.startswith("  recovered") for r in recovered), recovered
        assert await browser.evaluate("document.getElementById('live').textContent") == "live"
        assert browser.exceptions == []
        assert [e for e in browser.errors if "Content Security Policy" in e] == []
