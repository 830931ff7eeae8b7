"""Outbound side: one aiohttp client session, request headers and bodies per upstream."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from unbroken.config import Upstream

__all__ = ["HOP_BY_HOP", "UpstreamClient", "body_for", "request_headers", "response_headers"]

# RFC 9110 7.6.1 hop-by-hop headers, plus the ones the relay sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}


def request_headers(
    incoming: Mapping[str, str] | CIMultiDictProxy[str], upstream: Upstream, *, anthropic: bool
) -> CIMultiDict[str]:
    """Headers for the upstream request: hop-by-hop dropped, identity encoding, key injected."""
    out: CIMultiDict[str] = CIMultiDict()
    connection_tokens = {
        t.strip().lower() for t in incoming.get("connection", "").split(",") if t.strip()
    }
    for k, v in incoming.items():
        low = k.lower()
        if low in _DROP_REQUEST or low in connection_tokens:
            continue
        out.add(k, v)
    out["Accept-Encoding"] = "identity"
    key = upstream.api_key
    if key is not None:
        has_bearer, has_x_key = "authorization" in out, "x-api-key" in out
        if has_x_key:
            out["x-api-key"] = key
        if has_bearer:
            out["Authorization"] = f"Bearer {key}"
        if not has_x_key and not has_bearer:
            if anthropic:
                out["x-api-key"] = key
            else:
                out["Authorization"] = f"Bearer {key}"
    return out


def response_headers(upstream_headers: Mapping[str, str], *, keep_length: bool) -> CIMultiDict[str]:
    """Headers for the client response: hop-by-hop dropped; length kept only when asked."""
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream_headers.items():
        low = k.lower()
        if low in _DROP_RESPONSE and not (keep_length and low == "content-length"):
            continue
        out.add(k, v)
    return out


def body_for(body: bytes, parsed: dict[str, Any] | None, upstream: Upstream) -> bytes:
    """The request body for ``upstream``: byte-identical unless its ``models`` map renames."""
    if not upstream.models or parsed is None:
        return body
    model = parsed.get("model")
    if not isinstance(model, str) or model not in upstream.models:
        return body
    return json.dumps({**parsed, "model": upstream.models[model]}, ensure_ascii=False).encode()


def upstream_url(upstream: Upstream, rest: str, query_string: str) -> URL:
    url = f"{upstream.url}/{rest}" if rest else upstream.url
    if query_string:
        url = f"{url}?{query_string}"
    return URL(url, encoded=True)


class UpstreamClient:
    """The relay's single outbound aiohttp session (connection pooling, no decompression)."""

    def __init__(self, *, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=30, enable_cleanup_closed=False
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=None,
                    sock_connect=self.connect_timeout_s,
                    sock_read=None,
                ),
                skip_auto_headers=("User-Agent", "Content-Type"),
                trust_env=False,
            )
        return self._session

    async def request(
        self, method: str, url: URL, headers: CIMultiDict[str], body: bytes
    ) -> aiohttp.ClientResponse:
        return await self.session.request(
            method,
            url,
            headers=headers,
            data=body if body or method not in ("GET", "HEAD") else None,
            allow_redirects=False,
            compress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
