"""The mock's rate limits: RPM/TPM per key, the providers' headers, 429 past the budget."""

from __future__ import annotations

import time

import aiohttp

from unbroken.core.admission.ratehead import parse_rate_headers
from unbroken.mock import MockProvider

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def _post(http: aiohttp.ClientSession, url: str, key: str) -> tuple[int, dict[str, str]]:
    async with http.post(
        url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        await r.read()
        return r.status, {k.lower(): v for k, v in r.headers.items()}


async def test_rpm_per_key_with_openai_headers_and_a_429_past_the_budget() -> None:
    async with MockProvider() as mock, aiohttp.ClientSession() as http:
        async with http.post(mock.url + "/_mock/limits", json={"rpm": 3, "tpm": 1000}) as r:
            assert r.status == 200
        got = [await _post(http, mock.url, "k1") for _ in range(4)]
        assert [s for s, _ in got] == [200, 200, 200, 429]
        h = parse_rate_headers(got[0][1], now_wall=time.time())
        assert h.requests is not None and h.requests.limit == 3 and h.requests.remaining == 2
        assert h.tokens is not None and h.tokens.limit == 1000
        assert h.problems == ()
        assert got[3][1]["retry-after"] == "20"  # one request of three a minute: 20 s
        assert (await _post(http, mock.url, "k2"))[0] == 200  # another key, its own budget
        async with http.get(mock.url + "/_mock/limits") as r:
            view = await r.json()
        assert view["ok"] == 4 and view["limited"] == 1
        assert [s for _, s in view["log"]] == [200, 200, 200, 429, 200]


async def test_anthropic_style_headers_and_a_spent_start() -> None:
    async with MockProvider() as mock, aiohttp.ClientSession() as http:
        async with http.post(
            mock.url + "/_mock/limits", json={"rpm": 60, "style": "anthropic", "start": 0}
        ) as r:
            assert r.status == 200
        status, headers = await _post(http, mock.url, "k")
        assert status == 429 and headers["retry-after"] == "1"
        h = parse_rate_headers(headers, now_wall=time.time())
        assert h.requests is not None and h.requests.remaining == 0
        assert h.requests.reset_s is not None and 59 < h.requests.reset_s <= 60.5
        async with http.post(mock.url + "/_mock/limits", json={"rpm": "lots"}) as r:
            assert r.status == 400 and "limits.rpm" in (await r.json())["error"]
        async with http.post(mock.url + "/_mock/limits", json=None) as r:
            assert r.status == 200
        assert (await _post(http, mock.url, "k"))[0] == 200  # lifted
