"""Who may use the relay, and what a request-target may look like (pure, no I/O).

Every request passes, in this order:

1. the request-target: origin-form only (``/path[?query]``), printable ASCII,
   well-formed ``%HH`` escapes, no control character (raw or escaped), no ``#``,
   no ``.``/``..`` segment (raw or escaped, or before a ``;`` path parameter:
   ``/..;/`` is ``/../`` to Tomcat and its kin): else **400**;
2. the ``Host`` header: the bound address, ``localhost``, ``127.0.0.1`` or
   ``[::1]``, with the bound port, or a name in ``[server] allowed_hosts``: else
   **421** (this is what defeats DNS rebinding);
3. the ``Origin`` header, if any (browsers send it; agents and SDKs do not): it
   must be in ``[server] allowed_origins``: else **403**.  WebSocket upgrades
   included: browsers apply no CORS to WebSockets;
4. the token, when one is configured: ``x-unbroken-token: <token>`` or the path
   prefix ``/t/<token>/``, compared in constant time: else **401**.  ``/healthz``
   needs none.  A route that injects a key of the relay's (``api_key_env``) needs a
   token even when none is configured: the ``key_token`` (`relay.tokenfile`); with
   neither, it answers **401** to everyone.  No key without a right to it.

The target is split into the route name and the rest, still percent-encoded,
which the relay forwards byte for byte.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from unbroken.config import Config
from unbroken.config_values import normalise_origin

__all__ = ["TOKEN_HEADER", "Access", "Denied", "Target", "parse_target"]

#: The header that carries the relay's own token (or ``/t/<token>/`` in the path); never
#: forwarded upstream (`relay.upstream`).
TOKEN_HEADER = "x-unbroken-token"
#: One path segment, query and such: RFC 3986 pchar / "/" / "?", with valid escapes.
_PATH = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*")
_QUERY = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*")
#: An escaped control character: %00-%1F, %7F.
_ESCAPED_CTL = re.compile(r"%(?:[01][0-9A-Fa-f]|7[Ff])")
_DOT = re.compile(r"(?:\.|%2[Ee]){1,2}")
#: What an upstream may take for a path separator once it decodes: %2F, %5C.
_ENCODED_SEP = re.compile(r"%2[Ff]|%5[Cc]")
#: The start of a path parameter (``;x``, raw or escaped), which some back ends strip
#: before they resolve dot segments.
_PARAM = re.compile(r";|%3[Bb]")
_WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True, slots=True)
class Denied:
    """A refusal: the status and a one-line reason (never echoing a secret)."""

    status: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed request-target.

    ``name``: the first segment after any ``/t/<token>`` prefix (a route name, or
    ``healthz``, ``status``, ``metrics``); ``rest``: everything after it, without
    the leading slash, still percent-encoded; ``query``: the raw query (no ``?``);
    ``token``: the token of a ``/t/<token>/`` prefix, if any; ``path``: the
    target's path without that prefix, for messages.
    """

    name: str
    rest: str
    query: str
    token: str | None = field(repr=False)
    path: str
    has_rest: bool  # "/name/..." rather than "/name"


#: targets up to this long are parsed once and remembered (agents repeat a handful);
#: `upstream.upstream_url` caches its URLs by the same bound
CACHED_TARGET = 512


def parse_target(raw: str) -> Target | Denied:
    """Split and check a raw request-target (``request.raw_path``)."""
    if len(raw) <= CACHED_TARGET:
        return _parse_target_cached(raw)
    return _parse_target(raw)


def _parse_target(raw: str) -> Target | Denied:
    bad = Denied(400, "invalid_request_target", "invalid request-target")
    if not raw.startswith("/") or raw.startswith("//"):
        return bad  # absolute-form, authority-form, "*", or a scheme-relative path
    if not raw.isascii() or not raw.isprintable() or " " in raw or "#" in raw:
        return bad
    path, _, query = raw.partition("?")
    if not _PATH.fullmatch(path) or not _QUERY.fullmatch(query):
        return bad
    if _ESCAPED_CTL.search(raw):
        return Denied(400, "invalid_request_target", "control character in the request-target")
    segments = path[1:].split("/")
    if any(
        _DOT.fullmatch(_PARAM.split(part, 1)[0])
        for seg in segments
        for part in _ENCODED_SEP.split(seg)
    ):
        # The upstream would resolve it and leave its base path, key attached.
        return Denied(400, "invalid_request_target", "'.' or '..' segment in the path")
    token: str | None = None
    if len(segments) >= 3 and segments[0] == "t":
        token = segments[1]
        segments = segments[2:]
    name = segments[0]
    rest = "/".join(segments[1:])
    return Target(
        name=name,
        rest=rest,
        query=query,
        token=token,
        path="/" + "/".join(segments),
        has_rest=len(segments) > 1,
    )


#: the last 1,024 short targets' results (both kinds are frozen): at most ~0.5 MiB
_parse_target_cached = functools.lru_cache(maxsize=1024)(_parse_target)


def _host_port(value: str) -> tuple[str, int | None] | None:
    """(lower-case host without brackets, port) of a Host header, or None if malformed."""
    value = value.strip()
    if not value or any(c in value for c in "/?#@\\ ") or not value.isascii():
        return None
    try:
        parts = urlsplit(f"http://{value}")
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    return host.rstrip(".") if host != "." else host, port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Access:
    """The access rules of one running relay (bound address and port known)."""

    def __init__(self, config: Config, port: int) -> None:
        self.port = port
        self.token = config.token
        self._token_bytes = config.token.encode() if config.token else None
        #: the routes that inject a key: they need a token even with none configured
        self.keyed = frozenset(name for name, r in config.routes.items() if r.injects_key)
        key_token = config.token or config.key_token
        self._key_token_bytes = key_token.encode() if key_token else None
        bound = config.host.strip().strip("[]").lower()
        self.wildcard = bound in _WILDCARD_BINDS
        self.local_names = {"localhost", "127.0.0.1", "::1"}
        if not self.wildcard:
            self.local_names.add(bound)
        self.any_host = "*" in config.allowed_hosts
        self.extra_any_port: set[str] = set()
        self.extra_exact: set[tuple[str, int]] = set()
        for entry in config.allowed_hosts:
            if entry == "*":
                continue
            hp = _host_port(entry)
            if hp is None:
                continue
            host, p = hp
            if p is None:
                self.extra_any_port.add(host)
            else:
                self.extra_exact.add((host, p))
        self.origins = frozenset(config.allowed_origins)

        #: Host header -> verdict, for the few short values clients send (bounded)
        self._hosts: dict[str, bool] = {}

    # -- the checks --------------------------------------------------------------------
    def host_ok(self, host_header: str | None) -> bool:
        if host_header is not None:
            known = self._hosts.get(host_header)
            if known is not None:
                return known
            ok = self._host_ok(host_header)
            if len(host_header) <= 256:
                if len(self._hosts) >= 256:
                    self._hosts.clear()
                self._hosts[host_header] = ok
            return ok
        return self._host_ok(None)

    def _host_ok(self, host_header: str | None) -> bool:
        if self.any_host:
            return True
        if host_header is None:
            return False
        hp = _host_port(host_header)
        if hp is None:
            return False
        host, port = hp
        if host in self.extra_any_port or (port is not None and (host, port) in self.extra_exact):
            return True
        same_port = port == self.port or (port is None and self.port == 80)
        if not same_port:
            return False
        if host in self.local_names:
            return True
        # Bound to every interface: clients use one of its addresses.  An IP literal
        # cannot be the product of DNS rebinding, which needs a name.
        return self.wildcard and _is_ip(host)

    def origin_ok(self, origin: str) -> bool:
        canonical = normalise_origin(origin)
        return canonical is not None and canonical in self.origins

    def token_ok(self, given: str | None) -> bool:
        if self._token_bytes is None:
            return True
        return _same(given, self._token_bytes)

    def check(
        self, target: Target, headers: Mapping[str, str], *, open_path: bool
    ) -> Denied | None:
        """None if the request may proceed; ``open_path``: no token needed (/healthz)."""
        if not self.host_ok(headers.get("host")):
            return Denied(
                421,
                "misdirected_request",
                "this relay does not answer for that Host (see [server] allowed_hosts)",
            )
        origin = headers.get("origin")
        if origin is not None and not self.origin_ok(origin):
            return Denied(
                403,
                "origin_not_allowed",
                "requests from web pages are refused (see [server] allowed_origins)",
            )
        if open_path:
            return None
        if self._token_bytes is not None:
            given = target.token if target.token is not None else headers.get(TOKEN_HEADER)
            if not _same(given, self._token_bytes):
                return _UNAUTHORIZED
        elif target.name in self.keyed:
            given = target.token if target.token is not None else headers.get(TOKEN_HEADER)
            if self._key_token_bytes is None or not _same(given, self._key_token_bytes):
                return _KEY_UNAUTHORIZED
        return None


_UNAUTHORIZED = Denied(
    401, "unauthorized", "missing or wrong x-unbroken-token (or /t/<token>/ prefix)"
)
_KEY_UNAUTHORIZED = Denied(
    401,
    "unauthorized",
    "this route injects the relay's API key: send the relay's token as x-unbroken-token "
    "(or a /t/<token>/ prefix); `unbroken serve` logs the file that holds it",
)


def _same(given: str | None, expected: bytes) -> bool:
    """``given`` is the token, compared in constant time."""
    if given is None:
        return False
    try:
        candidate = given.encode("utf-8", "surrogateescape")
    except UnicodeError:
        return False
    return hmac.compare_digest(candidate, expected)
