"""Outbound side: one aiohttp client session, request headers and bodies per upstream.

Also the pure helpers both transports share: the upstream URL built from the
client's raw request-target, the request and response headers (credentials and
CORS), request bodies (byte-identical, or re-encoded consistently when a model
is renamed) and the redaction of known secrets from upstream error bodies.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import secrets
import zlib
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from unbroken.config import Upstream
from unbroken.core.wire.client_request import CREDENTIAL_HEADERS
from unbroken.core.wire.protocols.base import loads_object
from unbroken.core.wire.redact import REDACTED_PART, Redactor, redacted_headers
from unbroken.relay.access import CACHED_TARGET, TOKEN_HEADER

__all__ = [
    "HOP_BY_HOP",
    "UpstreamClient",
    "body_for",
    "decoded_body",
    "looped",
    "parse_body",
    "raw_query",
    "redacted_chunks",
    "request_headers",
    "response_headers",
    "strip_key_param",
    "upstream_url",
    "via_entry",
]


def via_entry(seed: str | None = None) -> str:
    """A relay's entry in the ``Via`` header of what it forwards (RFC 9110 7.6.3):
    ``1.1 unbroken-<id>``, a pseudonym drawn for each relay (two relays in one process,
    chained, are two ids).  ``--workers`` siblings are one relay: their id is derived
    from ``seed``, the supervisor's runtime directory (a fresh random path per run).
    A request that arrives carrying a relay's id has come back to it: a loop."""
    if seed is None:
        return f"1.1 unbroken-{secrets.token_hex(8)}"
    return f"1.1 unbroken-{hashlib.sha256(seed.encode()).hexdigest()[:16]}"


def looped(incoming: Mapping[str, str] | CIMultiDictProxy[str], via: str) -> bool:
    """True if a request already passed through the relay whose entry is ``via``."""
    if "via" not in incoming:  # the usual request: no Via at all
        return False
    me = via.split(" ", 1)[1]
    if isinstance(incoming, CIMultiDictProxy):
        return any(me in v for v in incoming.getall("via", ()))
    seen = incoming.get("via")
    return seen is not None and me in seen


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
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "accept-encoding", TOKEN_HEADER}
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "date", "server"}
_NO_TOKENS: frozenset[str] = frozenset()

#: the names each memo below keeps (header names repeat, request after request; a
#: client sending ever new ones cannot grow them)
_MAX_NAMES = 512


@functools.lru_cache(maxsize=_MAX_NAMES)
def _request_name(name: str) -> tuple[str, bool]:
    """A header name as received: its lower-case form, and whether an upstream request
    drops it whatever the Connection header says."""
    low = name.lower()
    return low, low in _DROP_REQUEST


@functools.lru_cache(maxsize=_MAX_NAMES)
def _response_name(name: str) -> int:
    """A header name as received: 0 a client response keeps it, 1 drops it, 2 drops it
    unless the length is kept."""
    low = name.lower()
    if low == "content-length":
        return 2
    return 1 if low in _DROP_RESPONSE or low.startswith("access-control-") else 0


def request_headers(
    incoming: Mapping[str, str] | CIMultiDictProxy[str],
    upstream: Upstream,
    *,
    anthropic: bool,
    gemini: bool = False,
    token: str | None = None,
    via: str,
) -> CIMultiDict[str]:
    """Headers for the upstream request: hop-by-hop dropped, identity encoding, key injected.

    With an injected key (``api_key_env``), the client's own credentials never go
    upstream: of the credential headers it sent (``authorization``, ``x-api-key``,
    ``api-key``, ``x-goog-api-key`` and the upstream's ``key_headers``) the key
    goes into one, the one the provider reads (``x-api-key`` first for
    Anthropic), and the others are removed.  None sent: the protocol's own
    (``x-api-key`` for Anthropic, ``Authorization: Bearer`` otherwise).  For the
    Gemini API (``gemini``: a Gemini path, or a client that sent its key as
    ``?key=``, which `strip_key_param` removes) it is always ``x-goog-api-key``: the
    API takes a key there, and a bearer token only for OAuth.
    The relay's ``x-unbroken-token`` is never forwarded, and its ``token`` is cut out of
    any other header that carries it (a ``Referer`` of a ``/t/<token>/`` URL, say).
    ``Via`` gets the relay's entry ``via`` appended (`via_entry`), the one header added:
    it is how a loop is seen.
    """
    out: CIMultiDict[str] = CIMultiDict()
    connection = incoming.get("connection")
    connection_tokens = (
        {t.strip().lower() for t in connection.split(",") if t.strip()}
        if connection
        else _NO_TOKENS
    )
    for k, v in incoming.items():
        low, drop = _request_name(k)
        if drop or low in connection_tokens:
            continue
        if token is not None and token in v:
            v = v.replace(token, REDACTED_PART)
        out.add(k, v)
    out["Accept-Encoding"] = "identity"
    before = out.getall("via", None)
    out["Via"] = f"{', '.join(before)}, {via}" if before else via
    key = upstream.api_key
    if key is not None:
        names = [*CREDENTIAL_HEADERS, *(h for h in upstream.key_headers if h not in _CRED)]
        sent = [h for h in names if h in out]
        for h in names:
            out.popall(h, None)
        if gemini:
            target = "x-goog-api-key"
        elif anthropic and "x-api-key" in sent:
            target = "x-api-key"
        elif sent:
            target = sent[0]
        else:
            target = "x-api-key" if anthropic else "authorization"
        if target == "authorization":
            out["Authorization"] = f"Bearer {key}"
        else:
            out[target] = key
    return out


_CRED = frozenset(CREDENTIAL_HEADERS)


def response_headers(
    upstream_headers: Mapping[str, str], *, keep_length: bool, secrets: Sequence[str] = ()
) -> CIMultiDict[str]:
    """Headers for the client response: hop-by-hop and CORS dropped; length only when asked.

    The upstream's ``Access-Control-*`` headers never reach the client: a browser
    must not be told by the provider that it may read the relay's answers.  Nor does
    any of ``secrets`` (the relay's keys and token) an upstream echoes in a header
    value, whatever the status (`core.wire.redact.redacted_headers` decides).
    """
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in upstream_headers.items():
        drop = _response_name(k)
        if drop and not (keep_length and drop == 2):
            continue
        out.add(k, v)
    if secrets:
        clean = redacted_headers(out.items(), secrets)
        if clean is not None:
            return CIMultiDict(clean)
    return out


# -- request bodies ----------------------------------------------------------------------


def _encoding(content_encoding: str | None) -> str:
    return (content_encoding or "identity").strip().lower()


def decoded_body(body: bytes, content_encoding: str | None, limit: int) -> bytes | None:
    """A decoded copy of a request body (identity, gzip, deflate), for reading only.

    None when the encoding is not one of those, the bytes do not decode, or the
    decoded form would be larger than ``limit`` (a decompression bomb).
    """
    enc = _encoding(content_encoding)
    if enc == "identity":
        return body
    if enc in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif enc == "deflate":
        wbits = zlib.MAX_WBITS if body[:1] == b"\x78" else -zlib.MAX_WBITS
    else:
        return None
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error:
        return None
    if len(out) > limit or not d.eof:
        return None
    return out


def parse_body(
    body: bytes, headers: Mapping[str, str] | CIMultiDictProxy[str], limit: int
) -> dict[str, Any] | None:
    """The JSON object a request body holds (decoding a gzip/deflate copy), or None.

    ``limit``: the largest decoded size read (use ``config.max_body_bytes``).
    The body forwarded upstream stays the received bytes; see `body_for`.
    """
    if "json" not in headers.get("content-type", ""):
        return None
    encoding = headers.get("content-encoding")
    if encoding is None:  # the usual case: the bytes are the JSON
        return loads_object(body)
    decoded = decoded_body(body, encoding, limit)
    return None if decoded is None else loads_object(decoded)


def patched_body(body: bytes, patch: Sequence[tuple[str, object]]) -> bytes:
    """``body`` (a plain JSON object) with the top-level keys of ``patch`` set: the
    one rewrite of a request, asked by the turn machine (``after_commit = "continue"``).
    A body that is not a JSON object goes as it is."""
    obj = loads_object(body)
    if obj is None:
        return body
    obj.update(patch)
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def body_for(
    body: bytes,
    parsed: dict[str, Any] | None,
    upstream: Upstream,
    *,
    content_encoding: str | None = None,
) -> bytes:
    """The request body for ``upstream``: byte-identical unless its ``models`` map renames.

    A renamed body is re-encoded in the body's own ``content_encoding`` (gzip or
    deflate), so it still matches the ``Content-Encoding`` header that goes with
    it.  Without ``content_encoding``, a gzip body is recognised by its magic
    bytes; any other encoding that cannot be re-encoded is forwarded unchanged.
    """
    if not upstream.models or parsed is None:
        return body
    model = parsed.get("model")
    if not isinstance(model, str) or model not in upstream.models:
        return body
    new = json.dumps({**parsed, "model": upstream.models[model]}, ensure_ascii=False).encode()
    enc = _encoding(content_encoding)
    if enc == "identity" and body[:2] == b"\x1f\x8b":
        enc = "gzip"
    if enc == "identity":
        return new
    if enc in ("gzip", "x-gzip"):
        return gzip.compress(new, mtime=0)
    if enc == "deflate":
        return zlib.compress(new)
    return body  # an encoding we cannot produce: leave the model as the client sent it


# -- URLs -------------------------------------------------------------------------------


def upstream_url(upstream: Upstream, rest: str, query_string: str) -> URL:
    """``<upstream url>/<rest>?<query>``, byte for byte: ``rest`` and ``query_string``
    are taken as raw, still percent-encoded text (never decoded, never re-encoded).

    Pass the raw query (`raw_query`), not aiohttp's decoded ``request.query_string``.
    A ``ws://``/``wss://`` upstream URL gives its ``http://``/``https://`` form here:
    the WebSocket transport switches the scheme back itself.
    """
    if len(rest) + len(query_string) <= CACHED_TARGET:
        return _joined(upstream.url, rest, query_string)
    return _join(upstream.url, rest, query_string)


def _join(base: str, rest: str, query_string: str) -> URL:
    scheme, sep, tail = base.partition("://")
    low = scheme.lower()
    if sep and low in ("ws", "wss"):
        base = ("https" if low == "wss" else "http") + "://" + tail
    url = f"{base}/{rest}" if rest else base
    if query_string:
        url = f"{url}?{query_string}"
    return URL(url, encoded=True)


#: the last 1,024 short targets' URLs (a route's turns ask for the same few)
_joined = functools.lru_cache(maxsize=1024)(_join)


def strip_key_param(query: str) -> tuple[str, bool]:
    """``query`` without its ``key=`` parameters (a Gemini API key in the URL), raw
    bytes of the rest kept; and whether there was one.  Used when the route injects its
    own key: the client's key never goes upstream."""
    if "key" not in query:
        return query, False
    parts = query.split("&")
    kept = [p for p in parts if p.split("=", 1)[0] != "key"]
    if len(kept) == len(parts):
        return query, False
    return "&".join(kept), True


def raw_query(request: web.BaseRequest) -> str:
    """The query of the client's request-target exactly as sent (no ``?``; may be '')."""
    _, _, query = request.raw_path.partition("?")
    return query


# -- secrets ----------------------------------------------------------------------------


async def redacted_chunks(chunks: AsyncIterator[bytes], redactor: Redactor) -> AsyncIterator[bytes]:
    """``chunks`` with every secret of ``redactor`` redacted (what might begin one waits
    for the next chunk)."""
    async for chunk in chunks:
        out = redactor.feed(chunk)
        if out:
            yield out
    tail = redactor.flush()
    if tail:
        yield tail


class UpstreamClient:
    """The relay's single outbound aiohttp session (connection pooling, no decompression).

    It keeps no cookies: a jar would add what one provider answer set (Cloudflare's
    ``__cf_bm``, say) to every later request, any client's, so a request would no
    longer go upstream as its client sent it.  (It also costs a jar lookup per request.)
    """

    def __init__(self, *, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30, enable_cleanup_closed=False)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=None,
                    sock_connect=self.connect_timeout_s,
                    sock_read=None,
                ),
                # nothing the client did not send: no default User-Agent, Content-Type,
                # Accept (*/*) or Accept-Encoding (a WebSocket handshake's included)
                skip_auto_headers=("User-Agent", "Content-Type", "Accept", "Accept-Encoding"),
                trust_env=False,
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    def request(
        self, method: str, url: URL, headers: CIMultiDict[str], body: bytes
    ) -> Awaitable[aiohttp.ClientResponse]:
        """The request, for the caller to await (no coroutine of its own to resume while
        it connects and waits for the answer)."""
        return self.session.request(
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
